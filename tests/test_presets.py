"""Every full-size preset: `jax.eval_shape` parameter count within 1% of the published
count (no memory spent), and each preset composes through the CLI."""

from __future__ import annotations

import functools

import jax
import pytest

from gpurl.cli import validate
from gpurl.models import count_params, model_spec
from gpurl.models.spec import count_active_params

# Published totals: the parameter counts reported by the checkpoints' model cards / HF
# safetensors metadata (text model only for Gemma 3 4B, whose checkpoint adds a vision tower).
PUBLISHED = {
    "gemma3_270m": 268_098_176,
    "gemma2b": 2_506_172_416,
    "gemma7b": 8_537_680_896,
    "gemma2_2b": 2_614_341_888,
    "gemma2_9b": 9_241_705_984,
    "gemma3_1b": 999_885_952,
    "gemma3_4b": 3_880_099_328,
    # google/gemma-3-4b-it's safetensors total: the text model, the SigLIP tower, the projector
    "gemma3_4b_vision": 4_300_079_472,
    "llama3_1b": 1_235_814_400,
    "llama3_8b": 8_030_261_248,
    "qwen2_5_0_5b": 494_032_768,
    "qwen2_5_1_5b": 1_543_714_304,
    "qwen2_5_7b": 7_615_616_512,
    "qwen3_0_6b": 596_049_920,
    # The HF safetensors total (2,031,739,904) stores the tied lm_head a second time.
    "qwen3_1_7b": 2_031_739_904 - 151_936 * 2048,
    "qwen3_8b": 8_190_735_360,
    # The large presets: Gemma 3 technical report (2025), Table 1, text model = embedding +
    # non-embedding parameters (the vision encoder's 417M left out); the Qwen model cards'
    # "Number of Parameters"; Llama 3.1 70B's HF safetensors total.
    "gemma3_12b": 1_012_000_000 + 10_759_000_000,
    "gemma3_27b": 1_416_000_000 + 25_600_000_000,
    "gemma3_12b_vision": 417_000_000 + 1_012_000_000 + 10_759_000_000,  # + the vision encoder
    "gemma3_27b_vision": 417_000_000 + 1_416_000_000 + 25_600_000_000,
    "qwen2_5_14b": 14_700_000_000,
    "qwen2_5_32b": 32_500_000_000,
    "qwen3_14b": 14_800_000_000,
    "qwen3_32b": 32_800_000_000,
    "llama3_70b": 70_553_706_496,
    # Qwen3 technical report (Yang et al. 2025), table 2 and the model cards: total 30.5B
    # (3.3B activated) and 235B (22B activated)
    "qwen3_30b_a3b": 30_500_000_000,
    "qwen3_235b_a22b": 235_000_000_000,
}
ACTIVE = {"qwen3_30b_a3b": 3_300_000_000, "qwen3_235b_a22b": 22_000_000_000}


@functools.lru_cache(maxsize=None)
def _spec(name: str):
    """A preset's model spec, traced once for the tests that count its parameters."""
    return model_spec(validate([f"model={name}"]).model)


# Tracing the init of a stack is quadratic in its layers (flax's RNG counter under
# eval_shape), so the presets over 10B parameters count in the slow tier.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if PUBLISHED[n] > 1e10
                                  else n for n in sorted(PUBLISHED)])
def test_preset_parameter_count(name):
    spec = _spec(name)  # eval_shape inside: nothing is allocated
    assert spec.cfg.name == name
    count = count_params(spec.abstract_params)
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01, (name, count)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(spec.abstract_params))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ACTIVE))
def test_moe_preset_active_parameters(name):
    """The parameters a token runs through (embedding and head included) within the
    published figures' precision: 3,353M for "3.3B" (and 22,1xxM for "22B")."""
    active = count_active_params(_spec(name))
    assert abs(active - ACTIVE[name]) / ACTIVE[name] < 0.02, (name, active)


@pytest.mark.slow
def test_layer_patterns_match_the_families():
    gemma3 = validate(["model=gemma3_270m"]).model
    assert [i for i in range(gemma3.num_layers) if gemma3.is_global(i)] == [5, 11, 17]
    gemma2 = validate(["model=gemma2_2b"]).model
    assert [gemma2.is_global(i) for i in range(4)] == [False, True, False, True]
    assert all(validate(["model=llama3_8b"]).model.is_global(i) for i in range(32))
