"""The sampler against the trainer: pi_old, the behaviour policy, what is measured every
step and what corrects the loss.

Three policies meet in an RL step (decoupled PPO, Hilton et al. 2022): pi_behaviour drew
each token (the sampler's recorded log-probs, of the policy it sampled with:
`gpurl.rollout.sampling`), pi_old is the trainer's policy at the start of the step
(the proximal policy the clipped ratio is taken against), and pi_theta is trained. With the
ratio r = pi_old / pi_behaviour of each trained token:

- measured on every step (`mismatch_metrics`, `mismatch/*`): the mean and maximum
  |log r|, the K3 estimate of KL(pi_behaviour || pi_old) and the share of tokens with
  |log r| > algo.mismatch_threshold. On a synchronous run r differs from 1 only by
  numerics (compute dtype, kernels, unreplayed experts): the sampler records log-probs of
  the whole tempered softmax whatever top-k / top-p drew a token, as the trainer computes
  them (`gpurl.rollout.sampling`); on an asynchronous run also by the policy versions
  between sampler and trainer.
- corrected when configured (`behaviour_weights`, `off_policy/*`): the loss of each token
  is weighted by min(r, C) (truncated importance sampling, algo.tis_cap; C = 2 on runs
  that train rounds sampled ahead), read per token, per sequence or as the sequence's
  geometric mean (algo.tis_level); and/or tokens whose r leaves a band get weight 0
  (masked importance sampling, algo.ratio_mask).

Shapes as in `gpurl.algorithms.policy_gradient`: B sequences, T completion tokens, masks
1.0 on the tokens that carry loss.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from gpurl.algorithms.choices import Choices
from gpurl.algorithms.objective import MAXIMUM, Batch
from gpurl.config import PolicyGradientConfig, TISLevel
from gpurl.config.algo import RATIO_MASK_OFF

# The cap C of the truncated importance weight on `rollout.mode=one_ahead` and `continuous` runs
# when algo.tis_cap is null: C = 2, the value of Yao et al. 2025 and the default threshold of
# verl's rollout correction (`rollout_is_threshold`).
ASYNC_TIS_CAP = 2.0
# log r is bounded at +-SAFE_LOG_RATIO before exp() in the K3 metric, so a token the
# sampler found e^-100 times less likely reads as a large number, not as inf (verl bounds
# its rollout-correction ratios at exp(+-20) alike).
SAFE_LOG_RATIO = 20.0


def masked_log_ratio(num_BxT: jax.Array, den_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
    """num - den on the masked tokens and exactly 0 elsewhere, selected (`where`), not
    multiplied: a masked slot may hold any value (a padding slot's log-prob at a low
    temperature is in the thousands), and exp() of it times a mask of 0 would be
    inf x 0 = NaN in the value and in every gradient. Every exp() of a log-ratio in the
    RL math reads it through here."""
    return jnp.where(mask_BxT > 0, num_BxT - den_BxT, 0.0)


# ---------------------------------------------------------------- when pi_old is computed

def behaviour_cap(cfg: PolicyGradientConfig, off_policy: bool) -> float | None:
    """The cap C of the truncated importance weight min(pi_old / pi_sampler, C), or None
    when the loss takes no truncated weight: algo.tis_cap when set; on a run that trains
    rounds sampled a step ahead (`off_policy`, rollout.mode one_ahead or continuous),
    `ASYNC_TIS_CAP` unless algo.async_correction=false (which leaves a set algo.tis_cap in
    force)."""
    if cfg.tis_cap is not None:
        return cfg.tis_cap
    return ASYNC_TIS_CAP if off_policy and cfg.async_correction else None


def ratio_band(cfg: PolicyGradientConfig) -> tuple[float, float] | None:
    """The band [low, high] outside which algo.ratio_mask gives a token weight 0; None
    when the mask is off."""
    if cfg.ratio_mask == RATIO_MASK_OFF:
        return None
    return cfg.ratio_mask_low, cfg.ratio_mask_high


def corrects(cfg: PolicyGradientConfig, off_policy: bool) -> bool:
    """Whether the loss weighs tokens against the sampler (a truncated weight or a mask)."""
    return behaviour_cap(cfg, off_policy) is not None or ratio_band(cfg) is not None


def needs_old_logprobs(cfg: PolicyGradientConfig, off_policy: bool) -> bool:
    """Whether the prepare step computes pi_old, the trainer's own log-probs of the batch
    with the parameters the step starts from: for several passes over a batch, for a
    batch sampled by another policy (`off_policy`) or corrected against the sampler, and
    for a KL in the reward (a KL against the sampler's log-probs would measure the
    sampler/trainer mismatch too). Otherwise the loss's own forward pass is pi_old (its
    parameters are the step's), which `mismatch_metrics` reads."""
    return (cfg.num_iterations > 1 or off_policy or corrects(cfg, off_policy)
            or (cfg.beta > 0 and cfg.kl_in_reward))


def ratio_uses_old(cfg: PolicyGradientConfig) -> bool:
    """Whether the loss's ratio pi_theta / pi_old reads the computed pi_old: only when the
    batch is trained more than once. On one pass theta is pi_old's parameters, so the
    ratio is 1 exactly as sg[pi_theta] (a second forward pass would add only float noise,
    which a 3e-4 clip range such as GSPO's could mistake for a policy change)."""
    return cfg.num_iterations > 1


# ---------------------------------------------------------------- where r is read

# log r where a weight or a mask reads it, on each token, B x T (masked log r in): the
# token's own; the sequence's product of its tokens' ratios (sum of log r); or their
# geometric mean (mean of log r over the sequence's masked tokens). verl's rollout
# correction names the same levels token, sequence and geometric.
BEHAVIOUR_RATIOS: Choices[Callable[[jax.Array, jax.Array], jax.Array]] = Choices(
    "behaviour ratio level", TISLevel)


@BEHAVIOUR_RATIOS.register(TISLevel.TOKEN)
def _token_log_ratio(log_r_BxT, mask_BxT):
    return log_r_BxT


@BEHAVIOUR_RATIOS.register(TISLevel.SEQUENCE)
def _sequence_log_ratio(log_r_BxT, mask_BxT):
    return jnp.broadcast_to(log_r_BxT.sum(-1, keepdims=True), log_r_BxT.shape)


@BEHAVIOUR_RATIOS.register(TISLevel.GEOMETRIC)
def _geometric_log_ratio(log_r_BxT, mask_BxT):
    mean_Bx1 = log_r_BxT.sum(-1, keepdims=True) / jnp.maximum(mask_BxT.sum(-1, keepdims=True), 1.0)
    return jnp.broadcast_to(mean_Bx1, log_r_BxT.shape)


# ---------------------------------------------------------------- corrections

def behaviour_weights(old_BxT: jax.Array, sampler_BxT: jax.Array, mask_BxT: jax.Array,
                      cap: float | None, level: str = TISLevel.TOKEN,
                      band: tuple[float, float] | None = None,
                      band_level: str = TISLevel.TOKEN) -> tuple[jax.Array, dict]:
    """The weight of each token's loss against the sampler, B x T (0 off the mask), and
    its metrics over the masked tokens:

    w = min(r_level, C) x 1[low <= r_band_level <= high],

    the first factor without a `cap` is 1 (truncated importance sampling: decoupled PPO,
    Hilton et al. 2022, with AReaL's truncation, Fu et al. 2025, and Yao et al. 2025 for the
    sampler/trainer mismatch), the second without a `band` is 1 (masked importance
    sampling: a token, or every token of a sequence, whose ratio leaves the band gets no
    gradient; IcePop, Ling team 2025, is token level with [0.5, 5] and the ratio itself as
    the weight inside, i.e. C = 5; Liu, Li et al. 2025, "When Speed Kills Stability", mask
    at the sequence level and by the geometric mean). `level`, `band_level`: where r is
    read (`BEHAVIOUR_RATIOS`). A masked token keeps its place in the loss's normalizer, as
    in IcePop's objective (verl's rejection sampling takes it out of the normalizer instead).

    Logged: the share of tokens whose weight was truncated, the share masked, the mean
    weight, and the effective sample size (sum w)^2 / (n sum w^2) of the n tokens (1 when
    every weight is equal)."""
    log_r_BxT = masked_log_ratio(old_BxT, sampler_BxT, mask_BxT)
    n = jnp.maximum(mask_BxT.sum(), 1.0)
    weights_BxT, metrics = mask_BxT, {}
    if cap is not None:
        raw_BxT = jnp.exp(BEHAVIOUR_RATIOS[level](log_r_BxT, mask_BxT))
        weights_BxT = jnp.minimum(raw_BxT, cap) * mask_BxT
        metrics["off_policy/weight_clip_fraction"] = ((raw_BxT > cap) * mask_BxT).sum() / n
    if band is not None:
        read_BxT = BEHAVIOUR_RATIOS[band_level](log_r_BxT, mask_BxT)
        low = math.log(band[0]) if band[0] > 0 else -math.inf
        inside_BxT = (read_BxT >= low) & (read_BxT <= math.log(band[1]))
        weights_BxT = jnp.where(inside_BxT, weights_BxT, 0.0)
        metrics["off_policy/masked_fraction"] = (~inside_BxT * mask_BxT).sum() / n
    total = weights_BxT.sum()
    metrics.update({"off_policy/weight_mean": total / n,
                    "off_policy/ess": total**2 / (n * jnp.maximum((weights_BxT**2).sum(), 1e-30))})
    return weights_BxT, metrics


def off_policy_terms(cfg: PolicyGradientConfig, off_policy: bool, old_BxT: jax.Array,
                     batch: Batch) -> tuple[Batch, dict]:
    """The batch keys and metrics of the behaviour correction (`behaviour_weights`) that
    the prepare step adds, shaped like the batch's log-probs; nothing without one."""
    if not corrects(cfg, off_policy):
        return {}, {}
    shape = batch["sampler_logprobs"].shape
    weights, metrics = behaviour_weights(
        old_BxT.reshape(shape), batch["sampler_logprobs"], batch["comp_mask"],
        behaviour_cap(cfg, off_policy), cfg.tis_level, ratio_band(cfg),
        TISLevel(cfg.ratio_mask) if ratio_band(cfg) else TISLevel.TOKEN)
    return {"is_weights": weights}, metrics


def describe(cfg: PolicyGradientConfig, off_policy: bool) -> str:
    """The correction in words, for the start-up line ("" when none)."""
    parts = []
    if (cap := behaviour_cap(cfg, off_policy)) is not None:
        parts.append(f"truncated importance weights (C={cap:g}, {cfg.tis_level.value})")
    if (band := ratio_band(cfg)) is not None:
        parts.append(f"{cfg.ratio_mask} ratios outside [{band[0]:g}, {band[1]:g}] masked")
    return " and ".join(parts)


# ---------------------------------------------------------------- measured every step

# a maximum over the micro-batches, not a sum (`gpurl.algorithms.objective.reduce_micro`)
MISMATCH_MAX = "mismatch/logprob_abs" + MAXIMUM


def mismatch_metrics(old_BxT: jax.Array, sampler_BxT: jax.Array, mask_BxT: jax.Array,
                     num_tokens: jax.Array, threshold: float) -> dict:
    """The sampler/trainer mismatch on the trained tokens (`mask_BxT`), this micro-batch's
    share: with log r = log pi_old - log pi_sampler, the mean |log r| over the global
    batch's `num_tokens` tokens, the maximum |log r|, the K3 estimate of
    KL(pi_sampler || pi_old) from the sampler's tokens, (r - 1) - log r (Schulman 2020;
    log r bounded at +-SAFE_LOG_RATIO), and the share of tokens with |log r| > `threshold`."""
    log_r_BxT = jax.lax.stop_gradient(masked_log_ratio(old_BxT, sampler_BxT, mask_BxT))
    gap_BxT = jnp.abs(log_r_BxT)
    bounded_BxT = jnp.clip(log_r_BxT, -SAFE_LOG_RATIO, SAFE_LOG_RATIO)
    k3_BxT = jnp.exp(bounded_BxT) - 1.0 - bounded_BxT  # 0 off the mask (log r = 0)
    return {"mismatch/logprob_abs_mean": gap_BxT.sum() / num_tokens,
            MISMATCH_MAX: gap_BxT.max(),
            "mismatch/k3_kl": k3_BxT.sum() / num_tokens,
            "mismatch/over_threshold": ((gap_BxT > threshold) * mask_BxT).sum() / num_tokens}
