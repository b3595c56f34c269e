"""Tiny random transformers models of every supported family, for parity tests.

Each one turns on its family's distinguishing features at sizes where they matter:
weights are re-drawn larger than transformers' init (and norm scales away from their
init) so that softcaps bind, sliding windows cut off real attention, RoPE scaling moves
logits, and a swapped or mistransposed tensor shows up far above the tolerance.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

VOCAB = 300
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rms_norm_eps=1e-6)

FAMILIES: dict[str, tuple[type, dict[str, Any]]] = {
    "gemma": (transformers.GemmaConfig, dict(num_hidden_layers=2, num_key_value_heads=1)),
    "gemma2": (transformers.Gemma2Config, dict(
        num_hidden_layers=4, sliding_window=4, query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0, final_logit_softcapping=4.0, rope_theta=20_000.0)),
    "gemma3": (transformers.Gemma3TextConfig, dict(
        num_hidden_layers=6, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})),
    "llama": (transformers.LlamaConfig, dict(
        num_hidden_layers=2, tie_word_embeddings=False, rope_theta=500_000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8})),
    "qwen2": (transformers.Qwen2Config, dict(
        num_hidden_layers=2, tie_word_embeddings=False, rope_theta=1_000_000.0)),
    "qwen3": (transformers.Qwen3Config, dict(
        num_hidden_layers=2, tie_word_embeddings=True, rope_theta=1_000_000.0)),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse: both stacks and their order
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(
        num_hidden_layers=3, mlp_only_layers=[1], num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, tie_word_embeddings=False)),
}


def _redraw(model: torch.nn.Module, gemma: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:  # Gemma stores w of (1 + w); the others w itself
                p.copy_(0.3 * noise if gemma else 1.0 + 0.3 * noise)
            elif "embed" in name:
                p.copy_((0.25 if gemma else 0.5) * noise)
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5 * 1.5)


def build(family: str, **overrides: Any) -> transformers.PreTrainedModel:
    """A tiny float32 model of `family` (config fields `overrides` changed) with eager
    attention and random weights."""
    config_cls, extra = FAMILIES[family]
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32)
    _redraw(model, gemma=family.startswith("gemma"))
    return model.eval()


def logits(model: transformers.PreTrainedModel, tokens: Any, mask: Any = None) -> Any:
    """float32 NumPy logits B x T x V of `tokens` (right padding marked by mask zeros)."""
    ids = torch.as_tensor(tokens, dtype=torch.long)
    kwargs = {} if mask is None else {"attention_mask": torch.as_tensor(mask, dtype=torch.long)}
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits.float().numpy()
