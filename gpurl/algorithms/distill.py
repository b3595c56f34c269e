"""Distillation from a frozen teacher: on-policy distillation (`algo=opd`) and logit
distillation on a dataset (`algo=kd`).

On-policy distillation (Agarwal et al. 2024, "On-Policy Distillation of Language Models:
Learning from Self-Generated Mistakes" (GKD); Gu et al. 2024, MiniLLM; Qwen3 technical
report, sec. 4.5; Lu & Thinking Machines 2025, "On-Policy Distillation"): the student
samples completions, the teacher scores every sampled token, and the student moves toward
the teacher on its own distribution, minimising the per-token reverse KL
KL(pi_S || pi_T) = E_{y ~ pi_S}[log pi_S(y) - log pi_T(y)]. Two signals (`algo.signal`):

- sampled: the one-sample estimate at each sampled token, A_t = log pi_T(y_t) - log pi_S(y_t)
  (stop-gradient; no discount: each token's advantage is its own term), as the per-token
  advantage of the clipped policy-gradient loss (ratios, aggregation, truncated importance
  weights unchanged); its gradient is the reverse KL's at discount 0. NeMo RL's
  distillation advantage and Thinking Machines' recipe use the same estimate.
- full: the exact reverse KL over the vocabulary (or the student's top-k tokens) at each
  sampled position, sum_v pi_S(v) (log pi_S(v) - log pi_T(v)), differentiated directly,
  computed chunk by chunk over tokens like the log-prob kernels
  (`gpurl.kernels.logprob.chunked_pair_head`): no tokens x vocabulary array exists.

Either is weighted by `algo.distill_weight`; `algo.task_weight` > 0 adds the task rewards'
group advantages (as GRPO computes them) to every token's advantage.

Logit distillation (Hinton et al. 2015; GKD's generalized JSD): at every target token of
SFT data, a divergence between the two next-token distributions at temperature tau,
scaled by tau^2, mixed with the cross-entropy on the data's tokens by `algo.ce_weight`.

Both models read the same token ids; the teacher's log-probs and states come from forward
passes on the trainer mesh, each device computing its own rows.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from gpurl.algorithms import grpo
from gpurl.algorithms.behaviour import mismatch_metrics
from gpurl.algorithms.choices import Choices
from gpurl.algorithms.forward import (group_logprobs, group_states, head_chunk, head_params,
                                      row_head, row_hidden, shifted_targets, states_logprobs,
                                      states_pair)
from gpurl.algorithms.objective import Batch, Objective, Teacher
from gpurl.algorithms.policy_gradient import aggregate, flat_rows, policy_loss, token_normalizer
from gpurl.algorithms.rl import RLContext, RLInputs
from gpurl.algorithms.sft import token_nll
from gpurl.config import Divergence, DistillSignal, KDConfig, OPDConfig, RolloutConfig
from gpurl.kernels.logprob import chunked_pair_head
from gpurl.models import moe

# ---------------------------------------------------------------- divergences per token
# (student log-probs ..xV, teacher log-probs ..xV, parameter) -> one number per token, fp32.
# Each carries its gradient in the student's log-probs in closed form (`_closed_form`):
# exactly 0 where the two distributions are equal bit for bit, where autodiff's gradient
# would be float noise around 0 (sum p = 1 up to rounding), which Adam would magnify into
# a full-size step.


def _kl(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """KL(p || q) = sum_v p(v) (log p(v) - log q(v)) over the last axis."""
    return jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)


def _closed_form(gradient: Callable[[jax.Array, jax.Array, Any, jax.Array], jax.Array]):
    """A divergence whose gradient in the student's log-probs s is `gradient(s, t, param,
    value)`, any vector that log-softmax's backward pass maps to the true gradient in the
    logits (the true one plus a multiple of p = exp(s), which it removes). The teacher's
    log-probs get none."""
    def wrap(value: Callable[[jax.Array, jax.Array, Any], jax.Array]):
        @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
        def divergence(student: jax.Array, teacher: jax.Array, param: Any = 0.5) -> jax.Array:
            return value(student, teacher, param)

        def forward(student, teacher, param):
            out = value(student, teacher, param)
            return out, (student, teacher, out)

        def backward(param, saved, cotangent):
            student, teacher, out = saved
            grad = gradient(student, teacher, param, out)
            return cotangent[..., None] * grad, jnp.zeros_like(teacher)

        divergence.defvjp(forward, backward)
        divergence.__doc__ = value.__doc__
        return divergence
    return wrap


DIVERGENCES: Choices[Callable[[jax.Array, jax.Array, float], jax.Array]] = Choices(
    "divergence", Divergence)


@DIVERGENCES.register(Divergence.FORWARD_KL)
@_closed_form(lambda s, t, _, out: jnp.exp(s) - jnp.exp(t))
def forward_kl(student: jax.Array, teacher: jax.Array, beta: float = 0.5) -> jax.Array:
    """KL(pi_T || pi_S): mass-covering; the classic KD loss (Hinton et al. 2015).
    Gradient in the student's logits: p - q."""
    return _kl(teacher, student)


@DIVERGENCES.register(Divergence.REVERSE_KL)
@_closed_form(lambda s, t, _, out: jnp.exp(s) * (s - t - out[..., None]))
def reverse_kl(student: jax.Array, teacher: jax.Array, beta: float = 0.5) -> jax.Array:
    """KL(pi_S || pi_T): mode-seeking (MiniLLM, Gu et al. 2024). Gradient in the student's
    logits: p (log p - log q - KL)."""
    return _kl(student, teacher)


def _mixture(student: jax.Array, teacher: jax.Array, beta: float) -> jax.Array:
    """log(beta q + (1 - beta) p) per token, equal to the student's log-probs bit for bit
    where the two are equal (log1p(beta expm1(0)) = 0), from the smaller side so that
    expm1 never overflows."""
    lo = jnp.minimum(teacher - student, 0.0)
    hi = jnp.minimum(student - teacher, 0.0)
    return jnp.where(teacher > student, teacher + jnp.log1p((1.0 - beta) * jnp.expm1(hi)),
                     student + jnp.log1p(beta * jnp.expm1(lo)))


def _jsd(student: jax.Array, teacher: jax.Array, beta: float) -> jax.Array:
    mix = _mixture(student, teacher, beta)
    return beta * _kl(teacher, mix) + (1.0 - beta) * _kl(student, mix)


_jsd_closed = _closed_form(lambda s, t, beta, out: (1.0 - beta) * jnp.exp(s)
                           * (s - _mixture(s, t, beta)))(_jsd)


@DIVERGENCES.register(Divergence.JSD)
def generalized_jsd(student: jax.Array, teacher: jax.Array, beta: float = 0.5) -> jax.Array:
    """GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024, eq. 4), with
    P = pi_T, Q = pi_S and M = beta P + (1 - beta) Q:
    JSD(beta) = beta KL(P || M) + (1 - beta) KL(Q || M); its gradient in log Q is
    (1 - beta) Q log(Q / M). It vanishes at both ends of beta, so beta = 0 is taken as the
    forward KL and beta = 1 as the reverse KL, the limits it interpolates between (TRL's
    GKD trainer reads beta the same way)."""
    if beta == 0.0:
        return forward_kl(student, teacher)
    if beta == 1.0:
        return reverse_kl(student, teacher)
    return _jsd_closed(student, teacher, beta)


def _restricted(student: jax.Array, teacher: jax.Array, k: int
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the student's k likeliest tokens as a mask (more where the k-th value ties), both
    log-probs renormalized over them)."""
    kth = jax.lax.stop_gradient(jax.lax.top_k(student, k)[0][..., -1:])
    keep = student >= kth
    low = jnp.finfo(jnp.float32).min

    def renorm(x: jax.Array) -> jax.Array:
        x = jnp.where(keep, x, low)
        return jnp.where(keep, x - jax.nn.logsumexp(x, axis=-1, keepdims=True), 0.0)
    return keep, renorm(student), renorm(teacher)


def _top_k_value(student: jax.Array, teacher: jax.Array, k: int) -> jax.Array:
    keep, s, t = _restricted(student, teacher, k)
    return jnp.sum(jnp.where(keep, jnp.exp(s) * (s - t), 0.0), axis=-1)


def _top_k_gradient(student, teacher, k, out):
    keep, s, t = _restricted(student, teacher, k)
    return jnp.where(keep, jnp.exp(s) * (s - t - out[..., None]), 0.0)


top_k_reverse_kl = _closed_form(_top_k_gradient)(_top_k_value)
top_k_reverse_kl.__doc__ = """The reverse KL between the two distributions restricted to
the student's k likeliest tokens and renormalized there (a proper divergence: 0 where they
agree on those tokens); equal to `reverse_kl` when k is the vocabulary."""


def _log_probs(logits: tuple[jax.Array, jax.Array], temperature: float
               ) -> tuple[jax.Array, jax.Array]:
    """The student's and the teacher's fp32 log-probs at `temperature`, from one
    log-softmax over both: XLA then reduces the two with the same code, so equal logits
    give bit-equal log-probs (two separate reductions may round differently)."""
    both = jax.nn.log_softmax(jnp.stack([z.astype(jnp.float32) for z in logits]) / temperature,
                              axis=-1)
    return both[0], both[1]


def teacher_states(teacher: Teacher, batch: Batch) -> jax.Array:
    """The teacher's `group_states` of a grouped batch, a constant of the loss (its
    router statistics, for a mixture-of-experts teacher, are not the student's)."""
    with moe.collect():
        return jax.lax.stop_gradient(group_states(teacher.spec, teacher.params, batch,
                                                  replay=False))


# ---------------------------------------------------------------- on-policy distillation


def opd_prepare(cfg: OPDConfig, ctx: RLContext, x: RLInputs,
                old: jax.Array | None = None) -> tuple[Batch, dict, dict]:
    """GRPO's prepare step (reference, behaviour correction, task-reward group advantages)
    and the distillation signal: with signal=sampled, each token's advantage
    distill_weight x (log pi_T - log pi_S) + task_weight x the group advantage, log pi_S
    the trainer's own log-probs at the step's start (not the sampler's); with signal=full
    the task part only (the loss adds the exact KL)."""
    batch, temp = x.batch, ctx.temperature
    sampled = cfg.signal == DistillSignal.SAMPLED
    if sampled and old is None:
        old = group_logprobs(ctx.spec.policy, ctx.spec.policy_params(x.params), batch, temp)[0]
    out, metrics, carry = grpo.prepare(cfg, ctx, x, old)
    task_PxG = cfg.task_weight * out["advantages"]
    if not sampled:
        out["advantages"] = task_PxG
        return out, metrics, carry
    teacher_PxGxN = group_logprobs(x.teacher.spec, x.teacher.params, batch, temp, replay=False)[0]
    mask_PxGxN = batch["comp_mask"]
    signal_PxGxN = jnp.where(mask_PxGxN > 0, teacher_PxGxN - old, 0.0)
    out["advantages"] = cfg.distill_weight * signal_PxGxN + task_PxG[..., None] * mask_PxGxN
    metrics["distill/reverse_kl"] = -signal_PxGxN.sum() / jnp.maximum(mask_PxGxN.sum(), 1.0)
    return out, metrics, carry


def opd_objective(cfg: OPDConfig, rollout: RolloutConfig) -> Objective:
    """The clipped policy-gradient loss on the prepared advantages (`grpo.objective`'s)
    and, with signal=full, distill_weight x the exact per-token reverse KL to the teacher,
    aggregated as algo.loss_agg says. A full-signal run without task rewards or a KL term
    skips the policy-gradient part (its advantages are all 0)."""
    temperature = rollout.temperature or 1.0
    full = cfg.signal == DistillSignal.FULL
    policy_gradient = not full or cfg.task_weight > 0 or (cfg.beta > 0 and not cfg.kl_in_reward)

    def divergence(logits: tuple[jax.Array, jax.Array],
                   targets: jax.Array) -> tuple[jax.Array, ...]:
        """(the reverse KL, the student's log-prob of the sampled token) per token."""
        student, teacher = _log_probs(logits, temperature)
        logp = jnp.take_along_axis(student, targets[..., None].astype(jnp.int32), -1)[..., 0]
        if cfg.top_k:
            return top_k_reverse_kl(student, teacher, cfg.top_k), logp
        return reverse_kl(student, teacher), logp

    def loss(spec: Any, params: Any, batch: Batch, norm: dict, teacher: Any):
        rows = flat_rows(batch)
        mask_BxN = rows["comp_mask"]
        states = group_states(spec, params, batch)
        total, metrics = jnp.float32(0.0), {"tokens": mask_BxN.sum()}
        if policy_gradient:
            logp_PxGxN, entropy_PxGxN = states_logprobs(spec, params, states, batch, temperature)
            total, metrics = policy_loss(cfg, logp_PxGxN.reshape(mask_BxN.shape), rows, norm,
                                         mask_BxN.shape[-1])
            metrics["entropy"] = (entropy_PxGxN * batch["comp_mask"]).sum() / norm["tokens"]
        if full:
            kl_PxGxN, logp_PxGxN = states_pair(spec, params, states, teacher,
                                               teacher_states(teacher, batch), batch, divergence)
            if not policy_gradient:  # the mismatch, measured as `policy_loss` measures it
                metrics.update(mismatch_metrics(logp_PxGxN.reshape(mask_BxN.shape),
                                                rows["sampler_logprobs"], mask_BxN,
                                                norm["tokens"], cfg.mismatch_threshold))
            total = total + cfg.distill_weight * aggregate(
                kl_PxGxN.reshape(mask_BxN.shape), mask_BxN, cfg.loss_agg, norm["tokens"],
                norm["seqs"], mask_BxN.shape[-1])
            metrics["distill/reverse_kl"] = (kl_PxGxN * batch["comp_mask"]).sum() / norm["tokens"]
            metrics["loss"] = total
        return total, metrics

    return Objective(loss=loss, normalizer=token_normalizer, takes_teacher=True)


# ---------------------------------------------------------------- logit distillation


def kd_objective(cfg: KDConfig, rollout: RolloutConfig) -> Objective:
    """Per target token of the SFT rows: (1 - w) tau^2 D(pi_S^tau, pi_T^tau) + w CE, a
    token mean over the global batch like SFT's loss (w = algo.ce_weight, D =
    algo.divergence). The teacher runs on the same (packed) rows, inside the loss but
    outside the gradient."""
    tau, weight, beta = cfg.kd_temperature, cfg.ce_weight, cfg.jsd_beta
    measure = DIVERGENCES[cfg.divergence]
    name = f"distill/{cfg.divergence.value}"

    def normalizer(batch: Batch) -> jax.Array:
        return jnp.maximum(shifted_targets(batch)[1].sum(), 1.0)

    def stats(logits: tuple[jax.Array, jax.Array], targets: jax.Array) -> tuple[jax.Array, ...]:
        div = measure(*_log_probs(logits, tau), beta) * tau**2
        ce, nll, correct = token_nll(logits[0], targets, cfg.label_smoothing)
        return div, ce, nll, correct.astype(jnp.float32)

    def loss(spec: Any, params: Any, batch: Batch, norm: jax.Array, teacher: Any):
        head_BxTxD, targets_BxT, mask_BxT = row_head(row_hidden(spec, params, batch), batch)
        with moe.collect():  # the teacher's router statistics are not the student's
            teacher_BxTxD = jax.lax.stop_gradient(
                row_head(row_hidden(teacher.spec, teacher.params, batch), batch)[0])
        div_BxT, ce_BxT, nll_BxT, correct_BxT = chunked_pair_head(
            spec.logits, head_params(spec, params), head_BxTxD, teacher.spec.logits,
            head_params(teacher.spec, teacher.params), teacher_BxTxD, targets_BxT, stats,
            head_chunk(spec, share=2))
        loss_sum = (((1.0 - weight) * div_BxT + weight * ce_BxT) * mask_BxT).sum()
        metrics = {"loss": loss_sum / norm, name: (div_BxT * mask_BxT).sum() / norm,
                   "nll": (nll_BxT * mask_BxT).sum() / norm,
                   "token_accuracy": (correct_BxT * mask_BxT).sum() / norm,
                   "tokens": mask_BxT.sum()}
        return loss_sum / norm, metrics

    return Objective(loss=loss, normalizer=normalizer, takes_teacher=True)
