"""Model families, one file each: `FAMILY`, the record `gpurl.models.hf`, `hf_export` and
`gguf` read (config.json fields and defaults, export special cases, GGUF metadata).

Every module of this package except `base` is a family and is found by listing the
package, so a new family is a new file here (and a preset in configs/model/).
"""

from __future__ import annotations

import importlib
import pkgutil

from gpurl.config import lookup
from gpurl.models.families.base import Family, GGUFArch, HFFamily

__all__ = ["FAMILIES", "Family", "GGUFArch", "HFFamily", "by_gguf_arch", "by_model_type", "get"]


def _discover() -> dict[str, Family]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name != "base":
            family = importlib.import_module(f"{__name__}.{info.name}").FAMILY
            found[family.name] = family
    return found


FAMILIES: dict[str, Family] = _discover()


def get(name: str) -> Family:
    """The family `model.family` names."""
    return lookup(FAMILIES, name, "model.family")


def by_model_type(model_type: str | None) -> Family | None:
    """The family of a config.json `model_type` (None when gpurl has none)."""
    return next((f for f in FAMILIES.values() if model_type in f.hf.model_types), None)


def by_gguf_arch(arch: str) -> Family | None:
    """The family of a GGUF `general.architecture` (None when gpurl reads none)."""
    return next((f for f in FAMILIES.values() if f.gguf and f.gguf.name == arch), None)
