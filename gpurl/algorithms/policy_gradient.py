"""RL math every policy-gradient algorithm shares, as pure functions over arrays: KL
estimators, loss aggregations, group advantages and importance ratios, each registered by
its choice enum (`gpurl.config`), and the clipped-surrogate policy loss built from them.

Shapes: B sequences (= P prompts x G completions, rows grouped contiguously), T completion
tokens. Masks are 1.0 on completion tokens that carry loss.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from gpurl.algorithms.behaviour import masked_log_ratio, mismatch_metrics
from gpurl.algorithms.choices import Choices
from gpurl.algorithms.objective import Batch
from gpurl.config import Advantage, ImportanceRatio, KLEstimator, LossAgg, PolicyGradientConfig

# ---------------------------------------------------------------- KL(pi || pi_ref) per token

KL_ESTIMATORS: Choices[Callable[[jax.Array], jax.Array]] = Choices("KL estimator", KLEstimator)


@KL_ESTIMATORS.register(KLEstimator.K1)
def _k1(log_r: jax.Array) -> jax.Array:
    return -log_r


@KL_ESTIMATORS.register(KLEstimator.K2)
def _k2(log_r: jax.Array) -> jax.Array:
    return 0.5 * log_r**2


@KL_ESTIMATORS.register(KLEstimator.K3)
def _k3(log_r: jax.Array) -> jax.Array:
    return jnp.exp(log_r) - 1.0 - log_r


def kl_estimate(logp_BxT: jax.Array, ref_logp_BxT: jax.Array, kind: str,
                mask_BxT: jax.Array) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020,
    "Approximating KL Divergence"): with log r = ref_logp - logp,
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r (unbiased, always >= 0);
    0 where `mask_BxT` is 0 (log r is set to 0 there before any exp)."""
    return KL_ESTIMATORS[kind](masked_log_ratio(ref_logp_BxT, logp_BxT, mask_BxT))


# ---------------------------------------------------------------- loss aggregation
# (masked loss, mask, global tokens, global sequences, max tokens) -> this micro-batch's share

LOSS_AGGS: Choices[Callable[..., jax.Array]] = Choices("loss aggregation", LossAgg)


@LOSS_AGGS.register(LossAgg.TOKEN_MEAN)
def _token_mean(masked_BxT, mask_BxT, num_tokens, num_seqs, max_tokens):
    """Sum / tokens in the global batch (DAPO, Yu et al. 2025, eq. 8)."""
    return masked_BxT.sum() / num_tokens


@LOSS_AGGS.register(LossAgg.SEQ_MEAN_TOKEN_MEAN)
def _seq_mean_token_mean(masked_BxT, mask_BxT, num_tokens, num_seqs, max_tokens):
    """Mean over sequences of each sequence's token mean (GRPO, Shao et al. 2024, eq. 3)."""
    return (masked_BxT.sum(-1) / jnp.maximum(mask_BxT.sum(-1), 1.0)).sum() / num_seqs


@LOSS_AGGS.register(LossAgg.SEQ_MEAN_TOKEN_SUM)
def _seq_mean_token_sum(masked_BxT, mask_BxT, num_tokens, num_seqs, max_tokens):
    """Mean over sequences of token sums."""
    return masked_BxT.sum() / num_seqs


@LOSS_AGGS.register(LossAgg.SEQ_MEAN_TOKEN_SUM_NORM)
def _seq_mean_token_sum_norm(masked_BxT, mask_BxT, num_tokens, num_seqs, max_tokens):
    """Token sums / max_tokens, mean over sequences (Dr. GRPO, Liu et al. 2025: a constant
    normalizer removes the length bias)."""
    return masked_BxT.sum() / (num_seqs * max_tokens)


def aggregate(loss_BxT: jax.Array, mask_BxT: jax.Array, kind: str, num_tokens: jax.Array,
              num_seqs: jax.Array, max_tokens: int) -> jax.Array:
    """This micro-batch's share of the global loss; the normalizers are global counts."""
    return LOSS_AGGS[kind](loss_BxT * mask_BxT, mask_BxT, num_tokens, num_seqs, max_tokens)


# ---------------------------------------------------------------- group advantages
# (rewards P x G fp32, eps) -> advantages P x G

ADVANTAGES: Choices[Callable[[jax.Array, float], jax.Array]] = Choices(
    "advantage estimator", Advantage)


@ADVANTAGES.register(Advantage.GRPO)
def _grpo_advantages(r_PxG: jax.Array, eps: float) -> jax.Array:
    """(r - mean) / (std + eps), std with Bessel's correction (Shao et al. 2024, sec. 4.1.2)."""
    group = r_PxG.shape[-1]
    std_Px1 = jnp.std(r_PxG, axis=-1, keepdims=True, ddof=1) if group > 1 else 0.0
    return (r_PxG - r_PxG.mean(-1, keepdims=True)) / (std_Px1 + eps)


@ADVANTAGES.register(Advantage.DRGRPO)
def _drgrpo_advantages(r_PxG: jax.Array, eps: float) -> jax.Array:
    """r - mean (Liu et al. 2025, no std normalization)."""
    return r_PxG - r_PxG.mean(-1, keepdims=True)


@ADVANTAGES.register(Advantage.RLOO)
def _rloo_advantages(r_PxG: jax.Array, eps: float) -> jax.Array:
    """r - mean of the other G-1 rewards (Ahmadian et al. 2024, eq. 8)."""
    group = r_PxG.shape[-1]
    return (r_PxG - r_PxG.mean(-1, keepdims=True)) * group / max(group - 1, 1)


def group_advantages(rewards_B: jax.Array, group: int, kind: str, eps: float = 1e-4,
                     rows_per: int = 1) -> jax.Array:
    """Advantages from rewards of `group` rows per prompt (grouped contiguously). With
    `rows_per` > 1 (agents, `gpurl.serve.agents`) a trajectory takes that many consecutive
    rows, each carrying its reward: the advantages are its group's over trajectories, each
    counted once, and every row of a trajectory gets its trajectory's."""
    r_PxT = rewards_B.reshape(-1, group // rows_per, rows_per)[..., 0].astype(jnp.float32)
    return jnp.repeat(ADVANTAGES[kind](r_PxT, eps), rows_per, axis=-1).reshape(-1)


# ---------------------------------------------------------------- the clipped surrogate

def clipped_objective(ratio: jax.Array, adv: jax.Array, eps_low: float, eps_high: float,
                      dual_clip: float | None = None) -> jax.Array:
    """Negated PPO clipped surrogate, -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    (Schulman et al. 2017, eq. 7; clip-higher: DAPO, Yu et al. 2025, eq. 10). With
    `dual_clip` c > 1 the loss of negative advantages is bounded by -c A (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games", eq. 5)."""
    surrogate = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps_low, 1 + eps_high) * adv)
    if dual_clip is not None:
        surrogate = jnp.where(adv < 0, jnp.maximum(surrogate, dual_clip * adv), surrogate)
    return -surrogate


def sequence_ratio(logp_BxT: jax.Array, old_logp_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """GSPO's length-normalized sequence importance ratio (Zheng et al. 2025, eq. 7):
    s_i = exp(mean over the sequence's tokens of (logp - old_logp)); B."""
    diff_B = masked_log_ratio(logp_BxT, old_logp_BxT, mask_BxT).sum(-1)
    return jnp.exp(diff_B / jnp.maximum(mask_BxT.sum(-1), 1.0))


# (logp, old logp, mask) -> the ratio of every token, B x T
RATIOS: Choices[Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = Choices(
    "importance ratio", ImportanceRatio)


@RATIOS.register(ImportanceRatio.TOKEN)
def _token_ratio(logp_BxT, old_BxT, mask_BxT):
    return jnp.exp(masked_log_ratio(logp_BxT, old_BxT, mask_BxT))


@RATIOS.register(ImportanceRatio.SEQUENCE)
def _sequence_ratio(logp_BxT, old_BxT, mask_BxT):
    return jnp.broadcast_to(sequence_ratio(logp_BxT, old_BxT, mask_BxT)[:, None], logp_BxT.shape)


@RATIOS.register(ImportanceRatio.SEQUENCE_TOKEN)
def _sequence_token_ratio(logp_BxT, old_BxT, mask_BxT):
    """GSPO-token (Zheng et al. 2025, eq. 13): the sequence ratio's value, token gradients."""
    seq_B = sequence_ratio(logp_BxT, old_BxT, mask_BxT)
    return jax.lax.stop_gradient(seq_B)[:, None] * jnp.exp(logp_BxT - jax.lax.stop_gradient(logp_BxT))


def policy_loss(cfg: PolicyGradientConfig, logp_BxT: jax.Array, batch: Batch, norm: dict,
                max_tokens: int) -> tuple[jax.Array, dict]:
    """This micro-batch's share of the loss from policy log-probs (B x T): the clipped
    surrogate with the configured ratio, weighted by the prepare step's truncated
    importance weights against the sampler when it computed them
    (`gpurl.algorithms.behaviour.behaviour_weights`),
    and the KL term in the loss, aggregated as configured.
    Batch keys (B rows): comp_mask, advantages (B, or B x T for PPO's per-token GAE) and,
    when configured, old_logprobs, ref_logprobs, sampler_logprobs, is_weights. With the
    sampler's log-probs, the sampler/trainer mismatch is measured (`mismatch_metrics`)
    against pi_old: the computed one, or this forward pass's own log-probs, which are
    pi_old's on the first pass over a batch (the only pass without a computed one)."""
    mask_BxT = batch["comp_mask"]
    old_BxT = batch.get("old_logprobs", jax.lax.stop_gradient(logp_BxT))
    adv = batch["advantages"]
    adv_BxT = adv[:, None] if adv.ndim == 1 else adv
    ratio_BxT = RATIOS[cfg.importance](logp_BxT, old_BxT, mask_BxT)
    per_token = clipped_objective(ratio_BxT, adv_BxT, cfg.epsilon, cfg.clip_high, cfg.dual_clip)
    if "is_weights" in batch:  # the behaviour correction's weights (truncated, masked)
        per_token = per_token * jax.lax.stop_gradient(batch["is_weights"])
    metrics = {}
    if cfg.beta > 0 and not cfg.kl_in_reward:
        kl_BxT = kl_estimate(logp_BxT, batch["ref_logprobs"], cfg.kl_estimator, mask_BxT)
        per_token = per_token + cfg.beta * kl_BxT
        metrics["kl"] = (kl_BxT * mask_BxT).sum() / norm["tokens"]
    loss = aggregate(per_token, mask_BxT, cfg.loss_agg, norm["tokens"], norm["seqs"], max_tokens)
    clipped = (ratio_BxT < 1 - cfg.epsilon) | (ratio_BxT > 1 + cfg.clip_high)
    metrics.update(loss=loss, clip_fraction=(clipped * mask_BxT).sum() / norm["tokens"],
                   tokens=mask_BxT.sum())
    if "sampler_logprobs" in batch:  # pi_old (this pass's own forward on the first) vs sampler
        metrics.update(mismatch_metrics(old_BxT, batch["sampler_logprobs"], mask_BxT,
                                        norm["tokens"], cfg.mismatch_threshold))
    return loss, metrics


ROW_KEYS = ("comp_mask", "advantages", "old_logprobs", "ref_logprobs", "sampler_logprobs",
            "is_weights", "values", "returns")


def flat_rows(batch: Batch) -> Batch:
    """The per-row keys of a grouped batch with P x G flattened to B rows."""
    return {k: v.reshape(-1, *v.shape[2:]) for k, v in batch.items() if k in ROW_KEYS}


def trained_rows(mask_BxN: jax.Array) -> jax.Array:
    """The number of rows that carry loss (at least 1): the fillers dynamic sampling adds
    when its rounds run out carry none, and a mean over rows must not count them."""
    return jnp.maximum((mask_BxN.sum(-1) > 0).sum(), 1)


def token_normalizer(batch: Batch) -> dict:
    """The global counts `aggregate` divides by: completion tokens and sequences with any."""
    mask_BxN = flat_rows(batch)["comp_mask"]
    return {"tokens": jnp.maximum(mask_BxN.sum(), 1.0),
            "seqs": trained_rows(mask_BxN).astype(jnp.float32)}
