"""Preference optimization on (prompt, chosen, rejected) pairs: DPO and its loss variants,
SimPO and ORPO, as pure functions of summed completion log-probs.

Notation per pair: log pi(y) is the summed log-prob of completion y (chosen y_w,
rejected y_l) under the policy, |y| its token count, log pi_ref(y) the same under the
frozen initial model, and h = [log pi(y_w) - log pi_ref(y_w)] - [log pi(y_l) - log pi_ref(y_l)].

- dpo, sigmoid: -log sigma(beta h) (Rafailov et al. 2023, eq. 7); with label smoothing
  eps, (1 - eps) (-log sigma(beta h)) + eps (-log sigma(-beta h)): the expected loss when
  a share eps of the labels is flipped (conservative DPO, Mitchell 2023).
- dpo, ipo: (h - 1 / (2 beta))^2 (Azar et al. 2023, eq. 17, with tau = beta).
- dpo, hinge: max(0, 1 - beta h): SLiC's rank calibration loss max(0, delta - log pi(y_w)
  + log pi(y_l)) (Zhao et al. 2023) on DPO's reference-normalized log-ratios, margin
  delta = 1 / beta, scaled by beta.
- simpo: -log sigma(beta log pi(y_w) / |y_w| - beta log pi(y_l) / |y_l| - gamma)
  (Meng et al. 2024, eq. 6), reference-free; label smoothing as for dpo.
- orpo: -log pi(y_w) / |y_w| + lambda (-log sigma(log odds(y_w) - log odds(y_l))) with
  odds(y) = P(y) / (1 - P(y)), P(y) = exp(log pi(y) / |y|) (Hong et al. 2024, eqs. 6-7;
  the NLL is the chosen completion's token mean), reference-free.

Implicit rewards (metrics, and the accuracy = share of pairs whose chosen reward is the
larger): dpo beta (log pi - log pi_ref), simpo beta log pi / |y|, orpo log pi / |y| (the
per-token log-prob whose odds it compares).

Batch keys (P pairs, W prompt tokens, N completion slots), chosen first on the pair
axis: prompt_tokens (P x W), prompt_lengths (P), completions (P x 2 x N),
completion_lengths (P x 2), comp_mask (P x 2 x N), pair_mask (P: 0 marks eval padding)
and, for dpo, ref_logps (P x 2, from `gpurl.train.preference` before the train step,
outside the differentiated function).

Each algorithm is a pair loss, `(cfg, logp_Px2, len_Px2, ref_Px2) -> (loss_P, reward_Px2,
extra)`, inside the one `pair_objective`; DPO's loss variants are registered by
`algo.dpo_loss`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

from gpurl.algorithms.choices import Choices
from gpurl.algorithms.forward import group_logprobs
from gpurl.algorithms.objective import Batch, Objective
from gpurl.config import DPOConfig, DPOLoss, ORPOConfig, RolloutConfig, SimPOConfig

# The per-token log-prob of a completion is clipped below 0 before the odds: P(y) = 1
# (a tiny model can reach it in fp32) would give log(1 - P) = -inf and a NaN gradient.
_MAX_MEAN_LOGP = -1e-6


def sequence_logps(spec: Any, params: Any, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """(summed log-prob, token count) of the chosen and rejected completions, P x 2 fp32.
    The prompt runs once per pair; only completion tokens go through the head."""
    logp_Px2xN, _ = group_logprobs(spec, params, batch)
    mask_Px2xN = batch["comp_mask"]
    return (logp_Px2xN * mask_Px2xN).sum(-1), mask_Px2xN.sum(-1)


def _smoothed_logsigmoid_loss(z_P: jax.Array, eps: float) -> jax.Array:
    loss_P = -jax.nn.log_sigmoid(z_P)
    return (1.0 - eps) * loss_P - eps * jax.nn.log_sigmoid(-z_P) if eps else loss_P


# (h_P: chosen-minus-rejected log-ratio margin, beta, eps) -> loss P
DPO_LOSSES: Choices[Callable[[jax.Array, float, float], jax.Array]] = Choices("DPO loss", DPOLoss)


@DPO_LOSSES.register(DPOLoss.SIGMOID)
def _sigmoid(h_P: jax.Array, beta: float, eps: float) -> jax.Array:
    return _smoothed_logsigmoid_loss(beta * h_P, eps)


@DPO_LOSSES.register(DPOLoss.IPO)
def _ipo(h_P: jax.Array, beta: float, eps: float) -> jax.Array:
    return (h_P - 1.0 / (2.0 * beta)) ** 2


@DPO_LOSSES.register(DPOLoss.HINGE)
def _hinge(h_P: jax.Array, beta: float, eps: float) -> jax.Array:
    return jax.nn.relu(1.0 - beta * h_P)


def dpo_losses(logp_Px2: jax.Array, ref_Px2: jax.Array, beta: float, kind: str,
               eps: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(loss P, implicit reward P x 2) of DPO with the `kind` loss: sigmoid, ipo, hinge."""
    ratio_Px2 = logp_Px2 - ref_Px2
    h_P = ratio_Px2[:, 0] - ratio_Px2[:, 1]
    return DPO_LOSSES[kind](h_P, beta, eps), beta * ratio_Px2


def simpo_losses(logp_Px2: jax.Array, len_Px2: jax.Array, beta: float, gamma: float,
                 eps: float = 0.0) -> tuple[jax.Array, jax.Array]:
    """(loss P, reward P x 2) of SimPO: length-normalized rewards and a target margin."""
    reward_Px2 = beta * logp_Px2 / jnp.maximum(len_Px2, 1.0)
    return _smoothed_logsigmoid_loss(reward_Px2[:, 0] - reward_Px2[:, 1] - gamma, eps), reward_Px2


def orpo_losses(logp_Px2: jax.Array, len_Px2: jax.Array,
                lam: float) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """(loss P, reward P x 2, {"nll", "log_odds"} P each) of ORPO."""
    mean_Px2 = jnp.minimum(logp_Px2 / jnp.maximum(len_Px2, 1.0), _MAX_MEAN_LOGP)
    # log odds = log P - log(1 - P); log(-expm1(x)) is accurate for P near 1.
    log_odds_Px2 = mean_Px2 - jnp.log(-jnp.expm1(mean_Px2))
    log_odds_P = log_odds_Px2[:, 0] - log_odds_Px2[:, 1]
    nll_P = -mean_Px2[:, 0]
    loss_P = nll_P - lam * jax.nn.log_sigmoid(log_odds_P)
    return loss_P, mean_Px2, {"nll": nll_P, "log_odds": log_odds_P}


# (cfg, logp_Px2, len_Px2, ref_Px2 or None) -> (loss P, reward P x 2, extra metrics P each)
PairLoss = Callable[[Any, jax.Array, jax.Array, Any], tuple[jax.Array, jax.Array, dict]]


def dpo_pair_loss(cfg: DPOConfig, logp_Px2, len_Px2, ref_Px2):
    loss_P, reward_Px2 = dpo_losses(logp_Px2, ref_Px2, cfg.beta, cfg.dpo_loss, cfg.label_smoothing)
    return loss_P, reward_Px2, {}


def simpo_pair_loss(cfg: SimPOConfig, logp_Px2, len_Px2, ref_Px2):
    loss_P, reward_Px2 = simpo_losses(logp_Px2, len_Px2, cfg.beta, cfg.simpo_gamma,
                                      cfg.label_smoothing)
    return loss_P, reward_Px2, {}


def orpo_pair_loss(cfg: ORPOConfig, logp_Px2, len_Px2, ref_Px2):
    return orpo_losses(logp_Px2, len_Px2, cfg.orpo_lambda)


def pair_metrics(loss_P: jax.Array, reward_Px2: jax.Array, extra: dict, logp_Px2: jax.Array,
                 pair_mask_P: jax.Array, norm: jax.Array) -> tuple[jax.Array, dict]:
    """This micro-batch's share of the global mean over pairs (`norm`: real pairs in the
    global batch), and metrics additive the same way."""
    mean = lambda x_P: (x_P * pair_mask_P).sum() / norm  # noqa: E731
    loss = mean(loss_P)
    metrics = {"loss": loss, "rewards/chosen": mean(reward_Px2[:, 0]),
               "rewards/rejected": mean(reward_Px2[:, 1]),
               "rewards/margin": mean(reward_Px2[:, 0] - reward_Px2[:, 1]),
               "rewards/accuracy": mean((reward_Px2[:, 0] > reward_Px2[:, 1]).astype(jnp.float32)),
               "logps/chosen": mean(logp_Px2[:, 0]), "logps/rejected": mean(logp_Px2[:, 1]),
               # whether the policy itself ranks the chosen completion higher: meaningful
               # before training too, where DPO's implicit rewards are all 0
               "logp_accuracy": mean((logp_Px2[:, 0] > logp_Px2[:, 1]).astype(jnp.float32))}
    metrics.update({k: mean(v) for k, v in extra.items()})
    return loss, metrics


@dataclass(frozen=True)
class PairObjective(Objective):
    """A preference objective over summed completion log-probs. `pair_loss(logp_Px2,
    len_Px2, ref_Px2, pair_mask_P, norm) -> (loss, metrics)` is its loss given the
    log-probs, which evaluation computes once per batch and reuses for the reference."""

    pair_loss: Callable[..., tuple[jax.Array, dict]] | None = None


def pair_objective(cfg: Any, pair_loss: PairLoss, reference: bool) -> PairObjective:
    """The objective of a pair loss; `reference`: the batch carries ref_logps (DPO)."""
    def normalizer(batch: Batch) -> jax.Array:
        return jnp.maximum(batch["pair_mask"].sum(), 1.0)

    def on_logps(logp_Px2, len_Px2, ref_Px2, pair_mask_P, norm):
        loss_P, reward_Px2, extra = pair_loss(cfg, logp_Px2, len_Px2, ref_Px2)
        return pair_metrics(loss_P, reward_Px2, extra, logp_Px2, pair_mask_P, norm)

    def loss(spec: Any, params: Any, batch: Batch, norm: jax.Array):
        logp_Px2, len_Px2 = sequence_logps(spec, params, batch)
        ref_Px2 = jax.lax.stop_gradient(batch["ref_logps"]) if reference else None
        loss, metrics = on_logps(logp_Px2, len_Px2, ref_Px2, batch["pair_mask"], norm)
        metrics["tokens"] = ((batch["prompt_lengths"] * batch["pair_mask"]).sum()
                             + batch["comp_mask"].sum())
        return loss, metrics

    return PairObjective(loss=loss, normalizer=normalizer, pair_loss=on_logps)


def dpo_objective(cfg: DPOConfig, rollout: RolloutConfig) -> PairObjective:
    return pair_objective(cfg, dpo_pair_loss, reference=True)


def simpo_objective(cfg: SimPOConfig, rollout: RolloutConfig) -> PairObjective:
    return pair_objective(cfg, simpo_pair_loss, reference=False)


def orpo_objective(cfg: ORPOConfig, rollout: RolloutConfig) -> PairObjective:
    return pair_objective(cfg, orpo_pair_loss, reference=False)
