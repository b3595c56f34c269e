"""Reward-model training on preference pairs (`algo=rm`).

Bradley-Terry (Bradley & Terry 1952; as a reward-model loss in Ouyang et al. 2022,
InstructGPT, eq. 1): the probability that the chosen completion y_w beats the rejected
y_l is sigma(r(x, y_w) - r(x, y_l)), and the loss is -log sigma(r_w - r_l), averaged over
pairs. r(x, y) is the scalar head on the state after the whole completion
(`gpurl.models.scalar`), i.e. the last token of prompt + completion, as transformers'
`...ForSequenceClassification` reads it. `reward_model_scores` is the same score of RL
completions, where a trained reward model gives the reward (`algo.reward_model`).

Batch keys as for DPO (`gpurl.algorithms.dpo`): prompt_tokens (P x W), prompt_lengths (P),
completions (P x 2 x N, chosen first), completion_lengths (P x 2), comp_mask, pair_mask (P).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gpurl.algorithms.forward import final_values, group_states
from gpurl.algorithms.objective import Batch, Objective
from gpurl.config import ModelConfig, RewardModelConfig, RolloutConfig
from gpurl.models.scalar import ScalarSpec, head, scalar_spec


def pair_scores(spec: ScalarSpec, params: Any, batch: Batch) -> jax.Array:
    """r(x, y) of the chosen and rejected completions, P x 2 fp32 (prompt run once per pair)."""
    return reward_model_scores(spec, params, batch).reshape(-1, 2)


def bradley_terry(scores_Px2: jax.Array, pair_mask_P: jax.Array,
                  norm: jax.Array) -> tuple[jax.Array, dict]:
    """This micro-batch's share of the mean loss over the global batch's real pairs (`norm`),
    and metrics additive the same way."""
    margin_P = scores_Px2[:, 0] - scores_Px2[:, 1]
    mean = lambda x_P: (x_P * pair_mask_P).sum() / norm  # noqa: E731
    loss = mean(-jax.nn.log_sigmoid(margin_P))
    return loss, {"loss": loss, "rewards/chosen": mean(scores_Px2[:, 0]),
                  "rewards/rejected": mean(scores_Px2[:, 1]), "rewards/margin": mean(margin_P),
                  "rewards/accuracy": mean((margin_P > 0).astype(jnp.float32))}


def reward_model_scores(spec: ScalarSpec, params: Any, batch: Batch) -> jax.Array:
    """A reward model's score of every completion (after its last token), B fp32. It routes
    every token itself: the batch's recorded routes are the policy's experts (routing
    replay), which mean nothing to another model."""
    states = group_states(spec.base, params["backbone"], batch, replay=False)
    return final_values(lambda h: head(params["score"], h), states, batch)


def model(cfg: RewardModelConfig, model_cfg: ModelConfig) -> ScalarSpec:
    """What algo=rm trains: the decoder's backbone with a scalar head."""
    return scalar_spec(model_cfg)


def objective(cfg: RewardModelConfig, rollout: RolloutConfig) -> Objective:
    def normalizer(batch: Batch) -> jax.Array:
        return jnp.maximum(batch["pair_mask"].sum(), 1.0)

    def loss(spec: ScalarSpec, params: Any, batch: Batch, norm: jax.Array):
        loss, metrics = bradley_terry(pair_scores(spec, params, batch), batch["pair_mask"], norm)
        metrics["tokens"] = ((batch["prompt_lengths"] * batch["pair_mask"]).sum()
                             + batch["comp_mask"].sum())
        return loss, metrics

    return Objective(loss=loss, normalizer=normalizer)
