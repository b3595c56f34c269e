"""Shared pieces of every algorithm: the objective interface and target shifting."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp

Batch = dict[str, jax.Array]
# (model spec, params, micro_batch, normalizer) -> (loss, metrics). The loss is this
# micro-batch's share of the global-batch loss, so shares add up across micro-batches;
# every metric must be additive the same way.
LossFn = Callable[[Any, Any, Batch, Any], tuple[jax.Array, dict]]


@dataclass(frozen=True)
class Objective:
    loss: LossFn
    normalizer: Callable[[Batch], jax.Array]  # computed once on the global batch


def shifted_targets(batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Targets for logits[:, :-1]: token t+1 and its loss weight (0 across packed segments,
    since the first token of a segment carries no loss)."""
    return batch["tokens"][:, 1:], batch["loss_mask"][:, 1:]


def token_logprobs(apply: Callable[..., jax.Array], params: Any, batch: Batch,
                   temperature: float = 1.0) -> jax.Array:
    """log p(token t+1 | tokens <= t) for t < T-1 (B x T-1, fp32), with logits divided by
    the sampling temperature so it matches the sampler's log-probabilities."""
    logits_BxTxV = apply(params, batch["tokens"], batch["positions"], batch["segment_ids"])
    logits_BxTxV = logits_BxTxV[:, :-1].astype(jnp.float32) / (temperature or 1.0)
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
    return jnp.take_along_axis(logp_BxTxV, batch["tokens"][:, 1:, None], axis=-1)[..., 0]


def group_states(spec: Any, params: Any, batch: Batch) -> jax.Array:
    """Final-norm hidden states s_0..s_N of every completion, B x (N+1) x D for B = P x G
    rows of P prompts with G completions each (N token slots): s_j is the state after the
    prompt and the first j completion tokens, so s_j predicts token j and s_len is the
    state after the whole completion (where a reward model reads its score).

    The G completions of a prompt share it, so the prompt goes through the model once per
    group: its forward pass fills a KV cache that is repeated G times, and the completions
    run on top of it (positions continue each prompt; padding slots are masked). Gradients
    flow through the shared prompt keys and values, so this is the exact gradient of the
    full-sequence forward at a fraction of the cost (prompts are often 10x longer than
    the completions).

    Batch keys: prompt_tokens (P x W, right-padded), prompt_lengths (P), completions
    (P x G x N), completion_lengths (P x G)."""
    from gpurl.models import init_cache

    prompt_PxW, plen_P = batch["prompt_tokens"], batch["prompt_lengths"]
    comp_PxGxN = batch["completions"]
    p, g, n = comp_PxGxN.shape
    w = prompt_PxW.shape[1]
    pos_PxW = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (p, w))
    seg_PxW = (pos_PxW < plen_P[:, None]).astype(jnp.int32)
    cache = init_cache(spec.cfg, p, w + n)
    hidden_PxWxD, cache = spec.hidden(params, prompt_PxW, pos_PxW, seg_PxW, cache)
    last_PxD = jnp.take_along_axis(hidden_PxWxD, (plen_P - 1)[:, None, None], axis=1)[:, 0]
    cache = jax.tree.map(lambda x: jnp.repeat(x, g, axis=0) if x.ndim else x, cache)
    comp_BxN = comp_PxGxN.reshape(p * g, n)
    pos_BxN = jnp.repeat(plen_P, g)[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    seg_BxN = (jnp.arange(n)[None] < batch["completion_lengths"].reshape(-1, 1)).astype(jnp.int32)
    hidden_BxNxD, _ = spec.hidden(params, comp_BxN, pos_BxN, seg_BxN, cache)
    return jnp.concatenate([jnp.repeat(last_PxD, g, axis=0)[:, None], hidden_BxNxD], axis=1)


def states_logprobs(spec: Any, params: Any, states_BxN1xD: jax.Array, batch: Batch,
                    temperature: float = 1.0, chunk_size: int | None = None,
                    differentiable_entropy: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log p, entropy) of every completion token from `group_states`, P x G x N fp32. Only
    the states that predict completion tokens go through the vocabulary-sized head, in
    chunks (`gpurl.kernels.logprob`); the entropy carries a gradient only when asked."""
    from gpurl.kernels.logprob import chunked_token_logprobs

    p, g, n = batch["completions"].shape
    logp_BxN, entropy_BxN = chunked_token_logprobs(
        spec.logits, params, states_BxN1xD[:, :-1], batch["completions"].reshape(p * g, n),
        temperature or 1.0, chunk_size=chunk_size, differentiable_entropy=differentiable_entropy)
    return logp_BxN.reshape(p, g, n), entropy_BxN.reshape(p, g, n)


def group_logprobs(spec: Any, params: Any, batch: Batch, temperature: float = 1.0,
                   chunk_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """(log p, entropy) of every completion token, P x G x N fp32 (`group_states`, then
    the head on the states that predict completion tokens)."""
    states = group_states(spec, params, batch)
    return states_logprobs(spec, params, states, batch, temperature, chunk_size)


def final_states(states_BxN1xD: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """The state after each whole completion, B x D."""
    return jnp.take_along_axis(states_BxN1xD, lengths_B[:, None, None].astype(jnp.int32), axis=1)[:, 0]


# ---------------------------------------------------------------- RL math shared by the
# policy-gradient algorithms. Shapes: B sequences (= prompts x G), T completion tokens,
# G completions per prompt. Masks are 1.0 on completion tokens.

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
ADVANTAGES = ("grpo", "drgrpo", "rloo")


def kl_estimate(logp_BxT: jax.Array, ref_logp_BxT: jax.Array, kind: str) -> jax.Array:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020,
    "Approximating KL Divergence"): with log r = ref_logp - logp,
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r (unbiased, always >= 0)."""
    log_r = ref_logp_BxT - logp_BxT
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return jnp.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; use one of {KL_ESTIMATORS}")


def aggregate(loss_BxT: jax.Array, mask_BxT: jax.Array, kind: str, num_tokens: jax.Array,
              num_seqs: jax.Array, max_tokens: int) -> jax.Array:
    """This micro-batch's share of the global loss; the normalizers are global counts.

    token_mean: sum / tokens in the global batch (DAPO, Yu et al. 2025, eq. 8).
    seq_mean_token_mean: mean over sequences of each sequence's token mean (GRPO, Shao
    et al. 2024, eq. 3). seq_mean_token_sum: mean over sequences of token sums.
    seq_mean_token_sum_norm: token sums / max_tokens, mean over sequences (Dr. GRPO, Liu
    et al. 2025: a constant normalizer removes the length bias)."""
    masked_BxT = loss_BxT * mask_BxT
    if kind == "token_mean":
        return masked_BxT.sum() / num_tokens
    if kind == "seq_mean_token_mean":
        return (masked_BxT.sum(-1) / jnp.maximum(mask_BxT.sum(-1), 1.0)).sum() / num_seqs
    if kind == "seq_mean_token_sum":
        return masked_BxT.sum() / num_seqs
    if kind == "seq_mean_token_sum_norm":
        return masked_BxT.sum() / (num_seqs * max_tokens)
    raise ValueError(f"unknown loss aggregation {kind!r}; use one of {LOSS_AGGS}")


def group_advantages(rewards_B: jax.Array, group: int, kind: str, eps: float = 1e-4) -> jax.Array:
    """Advantages from rewards of G completions per prompt (rows grouped contiguously).

    grpo: (r - mean) / (std + eps), std with Bessel's correction (Shao et al. 2024, sec. 4.1.2);
    drgrpo: r - mean (Liu et al. 2025, no std normalization);
    rloo: r - mean of the other G-1 rewards (Ahmadian et al. 2024, eq. 8)."""
    r_PxG = rewards_B.reshape(-1, group).astype(jnp.float32)
    mean_Px1 = r_PxG.mean(-1, keepdims=True)
    if kind == "grpo":
        std_Px1 = jnp.std(r_PxG, axis=-1, keepdims=True, ddof=1) if group > 1 else 0.0
        adv_PxG = (r_PxG - mean_Px1) / (std_Px1 + eps)
    elif kind == "drgrpo":
        adv_PxG = r_PxG - mean_Px1
    elif kind == "rloo":
        adv_PxG = (r_PxG - mean_Px1) * group / max(group - 1, 1)
    else:
        raise ValueError(f"unknown advantage estimator {kind!r}; use one of {ADVANTAGES}")
    return adv_PxG.reshape(-1)


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
    diff_B = ((logp_BxT - old_logp_BxT) * mask_BxT).sum(-1)
    return jnp.exp(diff_B / jnp.maximum(mask_BxT.sum(-1), 1.0))
