"""PPO with a learned critic (`algo=ppo`), as RLHF uses it (Ouyang et al. 2022; Ziegler et
al. 2019), on the same rollouts, rewards and train step as the GRPO family.

Per completion token t (B sequences, N token slots, mask m):
- reward r_t = -beta KL_t, plus the sequence's score (reward functions and/or a reward
  model) on its last token (Ziegler et al. 2019, eq. 2; Stiennon et al. 2020, eq. 1);
  KL_t estimates KL(pi_old || pi_ref) at token t (`algo.kl_estimator`, k1 in the preset);
- values V_t = V(s_t) of the state before token t from the critic; V after the last token is 0;
- GAE (Schulman et al. 2016, eqs. 11-16): delta_t = r_t + gamma V_{t+1} - V_t,
  A_t = delta_t + gamma lambda A_{t+1}; returns R_t = A_t + V_t; over the model's tokens
  only: a multi-turn trajectory's observation spans (mask 0) are crossed (`gae`);
- advantages whitened over the batch's tokens (`algo.whiten_advantages`);
- policy loss: the clipped surrogate with token ratios (Schulman et al. 2017, eq. 7;
  `gpurl.algorithms.policy_gradient.policy_loss` with per-token advantages);
- value loss: 0.5 max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), the clipped
  form of OpenAI baselines' PPO2, token mean;
- loss = policy + vf_coef value - entropy_coef entropy;
- adaptive KL coefficient (Ziegler et al. 2019, sec. 2.2): e = clip(KL / KL_target - 1,
  -0.2, 0.2), beta <- beta (1 + e rows / horizon), KL the mean summed KL per sequence; the
  coefficient is the prepare step's carry, updated on device (checkpointed as kl_coef).

Batch keys beyond GRPO's (P x G x N unless noted): old_logprobs (always computed: the KL
reward and GAE read the trainer's own log-probs), ref_logprobs (beta > 0), values,
returns, advantages (per token), and is_weights with a behaviour correction (algo.tis_cap,
rollout.mode=one_ahead).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from gpurl.algorithms.forward import group_logprobs, group_states, state_values, states_logprobs
from gpurl.algorithms.objective import Batch, Objective
from gpurl.algorithms.behaviour import off_policy_terms
from gpurl.algorithms.policy_gradient import (flat_rows, kl_estimate, policy_loss, token_normalizer,
                                              trained_rows)
from gpurl.algorithms.rl import RLContext, RLInputs
from gpurl.algorithms.rm import reward_model_scores
from gpurl.config import KLControlConfig, ModelConfig, PPOConfig, RolloutConfig
from gpurl.models.scalar import ActorCriticSpec, head


def token_rewards(scores_B: jax.Array, kl_BxN: jax.Array, mask_BxN: jax.Array,
                  kl_coef: jax.Array | float) -> jax.Array:
    """r_t = -beta KL_t on every completion token, plus the score on the last one (the
    last token of the mask: a multi-turn trajectory's last model token)."""
    after_BxN = jnp.cumsum(mask_BxN[:, ::-1], axis=1)[:, ::-1] - mask_BxN  # mask tokens later
    last_BxN = mask_BxN * (after_BxN == 0)
    return (-kl_coef * kl_BxN + scores_B[:, None] * last_BxN) * mask_BxN


def gae(rewards_BxN: jax.Array, values_BxN: jax.Array, mask_BxN: jax.Array, gamma: float,
        lam: float) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns), B x N, by a reverse scan over tokens; 0 outside the mask.

    Tokens outside the mask are crossed, not ends: a multi-turn trajectory's observation
    spans sit between model tokens, and GAE runs over the model's tokens alone, as if
    the spans were not there. A model token's next value and next advantage are those
    of the next model token (past any span), and gamma and lambda discount once per model
    token. (verl's multi-turn GAE crosses observation tokens the same way.) With the
    mask a prefix of the row (one completion), this is plain GAE."""

    def back(carry: tuple[jax.Array, jax.Array], xs: tuple[jax.Array, ...]):
        next_value_B, next_adv_B = carry
        r_B, v_B, m_B = xs
        adv_B = r_B + gamma * next_value_B - v_B + gamma * lam * next_adv_B
        on_B = m_B > 0
        carry = (jnp.where(on_B, v_B, next_value_B), jnp.where(on_B, adv_B, next_adv_B))
        return carry, jnp.where(on_B, adv_B, 0.0)

    zeros_B = jnp.zeros_like(values_BxN[:, 0])
    _, adv_NxB = jax.lax.scan(back, (zeros_B, zeros_B),
                              (rewards_BxN.T, values_BxN.T, mask_BxN.T), reverse=True)
    adv_BxN = adv_NxB.T
    return adv_BxN, (adv_BxN + values_BxN) * mask_BxN


def masked_whiten(x_BxN: jax.Array, mask_BxN: jax.Array, eps: float = 1e-8) -> jax.Array:
    """(x - mean) / std over the masked tokens (unbiased variance); 0 outside the mask."""
    n = jnp.maximum(mask_BxN.sum(), 1.0)
    mean = (x_BxN * mask_BxN).sum() / n
    var = (((x_BxN - mean) ** 2) * mask_BxN).sum() / jnp.maximum(n - 1.0, 1.0)
    return (x_BxN - mean) * jax.lax.rsqrt(var + eps) * mask_BxN


def value_loss(values_BxN: jax.Array, old_BxN: jax.Array, returns_BxN: jax.Array,
               mask_BxN: jax.Array, clip: float | None, num_tokens: jax.Array) -> jax.Array:
    """This micro-batch's share of the token-mean clipped value loss (`num_tokens`: global)."""
    loss_BxN = (values_BxN - returns_BxN) ** 2
    if clip is not None:
        clipped_BxN = old_BxN + jnp.clip(values_BxN - old_BxN, -clip, clip)
        loss_BxN = jnp.maximum(loss_BxN, (clipped_BxN - returns_BxN) ** 2)
    return 0.5 * (loss_BxN * mask_BxN).sum() / num_tokens


def critic_values(spec: ActorCriticSpec, params: Any, batch: Batch,
                  policy_states_BxN1xD: jax.Array | None = None) -> jax.Array:
    """V of the state before every completion token, B x N fp32: from the policy's states
    (shared backbone) or from the critic's own forward pass."""
    critic = params["critic"]
    if spec.shared:
        states = policy_states_BxN1xD
        if states is None:
            states = group_states(spec.policy, params["policy"], batch)
    else:
        states = group_states(spec.critic.base, critic["backbone"], batch, replay=False)
    values_PxGxN1 = state_values(lambda h: head(critic["score"], h), states, batch)
    return values_PxGxN1[..., :-1].reshape(-1, values_PxGxN1.shape[-1] - 1)


def prepare(cfg: PPOConfig, ctx: RLContext, x: RLInputs) -> tuple[Batch, dict, dict]:
    """Old log-probs and values, token rewards, GAE advantages and returns of a rollout
    batch (before the train step; nothing here is differentiated), and the next KL
    coefficient."""
    spec, batch, kl_coef = ctx.spec, x.batch, x.carry["kl_coef"]
    p, g, n = batch["completions"].shape
    policy = x.params["policy"]
    states = group_states(spec.policy, policy, batch)
    old_BxN = states_logprobs(spec.policy, policy, states, batch, ctx.temperature)[0].reshape(-1, n)
    values_BxN = critic_values(spec, x.params, batch, states)
    mask_BxN = batch["comp_mask"].reshape(-1, n)
    out, scores_B = dict(batch), x.rewards
    weights, stats = off_policy_terms(cfg, ctx.off_policy, old_BxN, batch)
    out.update(weights)
    kl_BxN = jnp.zeros_like(old_BxN)
    if x.ref_params is not None:
        ref_BxN = group_logprobs(spec.policy, x.ref_params, batch, ctx.temperature,
                                 replay=False)[0].reshape(-1, n)
        out["ref_logprobs"] = ref_BxN.reshape(p, g, n)
        kl_BxN = kl_estimate(old_BxN, ref_BxN, cfg.kl_estimator, mask_BxN)
    if ctx.reward_model is not None:
        rm_B = reward_model_scores(ctx.reward_model, x.reward_model, batch)
        scores_B = scores_B + rm_B
        stats["reward/model"] = rm_B.mean()
    rewards_BxN = token_rewards(scores_B, kl_BxN, mask_BxN, kl_coef)
    adv_BxN, returns_BxN = gae(rewards_BxN, values_BxN, mask_BxN, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        adv_BxN = masked_whiten(adv_BxN, mask_BxN)
    grouped = lambda x: x.reshape(p, g, n)  # noqa: E731
    out.update(old_logprobs=grouped(old_BxN), values=grouped(values_BxN),
               returns=grouped(returns_BxN), advantages=grouped(adv_BxN))
    tokens = jnp.maximum(mask_BxN.sum(), 1.0)
    rows = trained_rows(mask_BxN)  # not dynamic sampling's fillers: they carry no KL
    kl = kl_BxN.sum() / rows
    stats.update({"kl/rollout": kl, "kl/coef": jnp.asarray(kl_coef),
                  "values/mean": (values_BxN * mask_BxN).sum() / tokens,
                  "returns/mean": (returns_BxN * mask_BxN).sum() / tokens})
    return out, stats, {"kl_coef": adaptive_kl_coef(cfg, kl_coef, kl, rows)}


def adaptive_kl_coef(cfg: KLControlConfig, beta: jax.Array, kl: jax.Array,
                     rows: int | jax.Array) -> jax.Array:
    """The KL coefficient of Ziegler et al. 2019 (sec. 2.2) after a step that measured `kl`
    (the mean summed KL per sequence) over `rows` trained sequences; fixed without a
    target."""
    if cfg.kl_target is None:
        return beta
    error = jnp.clip(kl / cfg.kl_target - 1.0, -0.2, 0.2)
    return beta * (1.0 + error * rows / cfg.kl_horizon)


def initial_carry(cfg: PPOConfig) -> dict[str, float]:
    """The prepare step's state before the first step: the KL coefficient at algo.beta."""
    return {"kl_coef": cfg.beta}


def model(cfg: PPOConfig, model_cfg: ModelConfig) -> ActorCriticSpec:
    """What PPO trains: the policy and its critic, as one parameter tree."""
    return ActorCriticSpec.of(model_cfg, cfg.critic)


def optimizer_parts(cfg: PPOConfig) -> dict[str, float | None]:
    """An AdamW per part: the critic at algo.critic_lr (None: optim.lr)."""
    return {"policy": None, "critic": cfg.critic_lr}


def objective(cfg: PPOConfig, rollout: RolloutConfig) -> Objective:
    """Policy and critic losses of one batch, differentiated together (each part's
    gradient reaches only its own parameters unless the backbone is shared)."""
    temperature = rollout.temperature

    def loss(spec: ActorCriticSpec, params: Any, batch: Batch, norm: dict):
        states = group_states(spec.policy, params["policy"], batch)
        logp_PxGxN, entropy_PxGxN = states_logprobs(
            spec.policy, params["policy"], states, batch, temperature,
            differentiable_entropy=cfg.entropy_coef > 0)
        rows = flat_rows(batch)
        mask_BxN = rows["comp_mask"]
        p_loss, metrics = policy_loss(cfg, logp_PxGxN.reshape(mask_BxN.shape), rows, norm,
                                      mask_BxN.shape[-1])
        values_BxN = critic_values(spec, params, batch, states)
        v_loss = value_loss(values_BxN, rows["values"], rows["returns"], mask_BxN,
                            cfg.value_clip, norm["tokens"])
        entropy = (entropy_PxGxN.reshape(mask_BxN.shape) * mask_BxN).sum() / norm["tokens"]
        total = p_loss + cfg.vf_coef * v_loss - cfg.entropy_coef * entropy
        metrics.update(loss=total, policy_loss=p_loss, value_loss=v_loss, entropy=entropy,
                       value_error=(jnp.abs(values_BxN - rows["returns"]) * mask_BxN).sum()
                       / norm["tokens"])
        return total, metrics

    return Objective(loss=loss, normalizer=token_normalizer)
