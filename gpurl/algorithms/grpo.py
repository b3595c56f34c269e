"""GRPO and its variants as one objective over a batch of scored completions.

GRPO (Shao et al. 2024, DeepSeekMath, eq. 3): clipped token ratios, group-normalized
advantages, KL to a frozen reference in the loss. Variants by config (presets in
configs/algo/): GSPO (Zheng et al. 2025) uses the length-normalized sequence ratio
(`importance=sequence`, or `sequence_token` for GSPO-token); DAPO (Yu et al. 2025)
clip-higher, token-mean aggregation, dynamic sampling and overlong shaping; Dr. GRPO
(Liu et al. 2025) mean-only advantages and a constant normalizer; RLOO (Ahmadian et al.
2024) leave-one-out advantages.

Batch keys, grouped by prompt (P prompts, G completions each, N completion slots, W
prompt tokens) so that micro-batches split whole groups: prompt_tokens (P x W),
prompt_lengths (P), completions (P x G x N), completion_lengths (P x G), comp_mask
(P x G x N: 1 on completion tokens that carry loss), advantages (P x G), and when needed
old_logprobs (num_iterations > 1), ref_logprobs (beta > 0) and sampler_logprobs
(tis_cap), each P x G x N. `policy_loss` takes the same keys flattened to B = P x G rows.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gpurl.algorithms.common import (Batch, Objective, aggregate, clipped_objective,
                                     group_logprobs, kl_estimate, sequence_ratio)
from gpurl.config import AlgoConfig


def _ratio(cfg: AlgoConfig, logp_BxT: jax.Array, old_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    if cfg.importance == "token":
        return jnp.exp(logp_BxT - old_BxT)
    seq_B = sequence_ratio(logp_BxT, old_BxT, mask_BxT)
    if cfg.importance == "sequence":
        return jnp.broadcast_to(seq_B[:, None], logp_BxT.shape)
    # GSPO-token (Zheng et al. 2025, eq. 13): the sequence ratio's value, token gradients.
    return jax.lax.stop_gradient(seq_B)[:, None] * jnp.exp(logp_BxT - jax.lax.stop_gradient(logp_BxT))


def policy_loss(cfg: AlgoConfig, logp_BxT: jax.Array, batch: Batch, norm: dict,
                max_tokens: int) -> tuple[jax.Array, dict]:
    """This micro-batch's share of the loss from policy log-probs (B x T-1)."""
    mask_BxT = batch["comp_mask"]
    old_BxT = batch.get("old_logprobs", jax.lax.stop_gradient(logp_BxT))
    adv = batch["advantages"]  # B (one per sequence) or B x T (PPO's per-token GAE)
    adv_BxT = adv[:, None] if adv.ndim == 1 else adv
    ratio_BxT = _ratio(cfg, logp_BxT, old_BxT, mask_BxT)
    per_token = clipped_objective(ratio_BxT, adv_BxT, cfg.epsilon, cfg.clip_high, cfg.dual_clip)
    if cfg.tis_cap is not None:  # truncated importance sampling (Yao et al. 2025)
        weight = jnp.minimum(jnp.exp(old_BxT - batch["sampler_logprobs"]), cfg.tis_cap)
        per_token = per_token * jax.lax.stop_gradient(weight)
    metrics = {}
    if cfg.beta > 0 and not cfg.kl_in_reward:
        kl_BxT = kl_estimate(logp_BxT, batch["ref_logprobs"], cfg.kl_estimator)
        per_token = per_token + cfg.beta * kl_BxT
        metrics["kl"] = (kl_BxT * mask_BxT).sum() / norm["tokens"]
    loss = aggregate(per_token, mask_BxT, cfg.loss_agg, norm["tokens"], norm["seqs"], max_tokens)
    clipped = (ratio_BxT < 1 - cfg.epsilon) | (ratio_BxT > 1 + cfg.clip_high)
    metrics.update(loss=loss, clip_fraction=(clipped * mask_BxT).sum() / norm["tokens"],
                   tokens=mask_BxT.sum())
    return loss, metrics


ROW_KEYS = ("comp_mask", "advantages", "old_logprobs", "ref_logprobs", "sampler_logprobs",
            "values", "returns")


def flat_rows(batch: Batch) -> Batch:
    """The per-row keys of a grouped batch with P x G flattened to B rows."""
    return {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items() if k in ROW_KEYS}


def grpo_objective(cfg: AlgoConfig, max_tokens: int, temperature: float = 1.0) -> Objective:
    """The objective the shared train step differentiates."""
    def normalizer(batch: Batch) -> dict:
        mask_BxN = flat_rows(batch)["comp_mask"]
        return {"tokens": jnp.maximum(mask_BxN.sum(), 1.0),
                "seqs": jnp.maximum((mask_BxN.sum(-1) > 0).sum(), 1).astype(jnp.float32)}

    def loss(spec: Any, params: Any, batch: Batch, norm: dict):
        logp_PxGxN, entropy_PxGxN = group_logprobs(spec, params, batch, temperature)
        rows = flat_rows(batch)
        loss, metrics = policy_loss(cfg, logp_PxGxN.reshape(rows["comp_mask"].shape), rows,
                                    norm, max_tokens)
        metrics["entropy"] = (entropy_PxGxN * batch["comp_mask"]).sum() / norm["tokens"]
        return loss, metrics

    return Objective(loss=loss, normalizer=normalizer)
