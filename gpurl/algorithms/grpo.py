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
old_logprobs (num_iterations > 1: `ratio_uses_old`), ref_logprobs (beta > 0), sampler_logprobs and
is_weights (the behaviour correction's weights, `behaviour.behaviour_weights`), each P x G x N.
`prepare` adds advantages and the log-probs to the rollout batch.
"""

from __future__ import annotations

from typing import Any

import jax

from gpurl.algorithms.behaviour import needs_old_logprobs, off_policy_terms, ratio_uses_old
from gpurl.algorithms.forward import group_logprobs
from gpurl.algorithms.objective import Batch, Objective
from gpurl.algorithms.policy_gradient import (flat_rows, group_advantages, kl_estimate,
                                              policy_loss, token_normalizer, trained_rows)
from gpurl.algorithms.rl import RLContext, RLInputs
from gpurl.algorithms.rm import reward_model_scores
from gpurl.config import GRPOConfig, RolloutConfig


def objective(cfg: GRPOConfig, rollout: RolloutConfig) -> Objective:
    """The objective the shared train step differentiates. Dr. GRPO's constant normalizer
    is the batch's completion width N: rollout.max_new_tokens, or env.max_tokens for
    multi-turn trajectories."""
    temperature = rollout.temperature

    def loss(spec: Any, params: Any, batch: Batch, norm: dict):
        logp_PxGxN, entropy_PxGxN = group_logprobs(spec, params, batch, temperature)
        rows = flat_rows(batch)
        mask_BxN = rows["comp_mask"]
        loss, metrics = policy_loss(cfg, logp_PxGxN.reshape(mask_BxN.shape), rows, norm,
                                    mask_BxN.shape[-1])
        metrics["entropy"] = (entropy_PxGxN * batch["comp_mask"]).sum() / norm["tokens"]
        return loss, metrics

    return Objective(loss=loss, normalizer=token_normalizer)


def prepare(cfg: GRPOConfig, ctx: RLContext, x: RLInputs, old: jax.Array | None = None
            ) -> tuple[Batch, dict, dict]:
    """Reference and old log-probs, the behaviour correction, a reward model's score and
    the KL penalty in the reward when configured, then group advantages. `old`: pi_old,
    P x G x N, when the caller computed it already (`gpurl.algorithms.distill`)."""
    policy, params, batch = ctx.spec.policy, ctx.spec.policy_params(x.params), x.batch
    temp, group = ctx.temperature, batch["completions"].shape[1]
    out, metrics, rewards_B = dict(batch), {}, x.rewards
    if x.ref_params is not None:
        out["ref_logprobs"] = group_logprobs(policy, x.ref_params, batch, temp, replay=False)[0]
    if needs_old_logprobs(cfg, ctx.off_policy):
        if old is None:
            old = group_logprobs(policy, params, batch, temp)[0]
        weights, metrics = off_policy_terms(cfg, ctx.off_policy, old, batch)
        out.update(weights)
        if ratio_uses_old(cfg):
            out["old_logprobs"] = old
    if ctx.reward_model is not None:
        scores_B = reward_model_scores(ctx.reward_model, x.reward_model, batch)
        rewards_B = rewards_B + scores_B
        metrics["reward/model"] = scores_B.mean()
    if x.ref_params is not None and cfg.kl_in_reward:  # from the trainer's own log-probs
        mask_BxN = batch["comp_mask"].reshape(-1, batch["comp_mask"].shape[-1])
        kl_B = kl_estimate(old.reshape(mask_BxN.shape), out["ref_logprobs"].reshape(mask_BxN.shape),
                           cfg.kl_estimator, mask_BxN).sum(-1)
        rewards_B = rewards_B - cfg.beta * kl_B
        metrics["kl/rollout"] = kl_B.sum() / trained_rows(mask_BxN)
    out["advantages"] = group_advantages(rewards_B, group, cfg.advantage, cfg.adv_eps,
                                         ctx.rows_per_trajectory).reshape(-1, group)
    return out, metrics, x.carry
