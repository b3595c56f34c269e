"""Test setup: 4 forced host devices (so sharding is real) before JAX is imported, and
small shared builders so tests reuse compiled functions instead of recompiling."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from gpurl.config import Config  # noqa: E402


def make_config(**groups: dict[str, Any]) -> Config:
    """Config() with per-group field overrides: make_config(train={"steps": 3})."""
    cfg = Config()
    for group, values in groups.items():
        cfg = dataclasses.replace(cfg, **{group: dataclasses.replace(getattr(cfg, group), **values)})
    return cfg


TINY_MODEL = {"vocab_size": 259, "d_model": 32, "num_layers": 2, "num_heads": 4,
              "num_kv_heads": 2, "head_dim": 8, "mlp_dim": 64, "dtype": "float32"}


@pytest.fixture
def tiny_config():
    return make_config


@pytest.fixture(scope="session")
def gemma3_gguf():
    """Path of the real Gemma 3 270M GGUF from the PyPI package (assembled once per session)."""
    from pathlib import Path

    from gpurl.models.gguf import default_gemma3_270m_path

    return Path(default_gemma3_270m_path())
