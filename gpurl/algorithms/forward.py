"""Forward passes every objective builds on: next-token log-probs of a packed batch, and
the hidden states and log-probs of grouped completions (one prompt pass per group).

Grouped batches (RL and preference pairs) hold P prompts with G completions each:
prompt_tokens (P x W, right-padded), prompt_lengths (P), completions (P x G x N),
completion_lengths (P x G).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from gpurl.algorithms.objective import Batch
from gpurl.kernels.logprob import chunked_token_logprobs


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


def group_states(spec: Any, params: Any, batch: Batch, replay: bool = True) -> jax.Array:
    """Final-norm hidden states s_0..s_N of every completion, B x (N+1) x D for B = P x G
    rows of P prompts with G completions each (N token slots): s_j is the state after the
    prompt and the first j completion tokens, so s_j predicts token j and s_len is the
    state after the whole completion (where a reward model reads its score).

    The G completions of a prompt share it, so the prompt goes through the model once per
    group: its forward pass keeps every layer's keys and values (`PromptKV`), which the
    G completions attend to (positions continue each prompt; padding slots are masked). Gradients
    flow through the shared prompt keys and values, so this is the exact gradient of the
    full-sequence forward at a fraction of the cost (prompts are often 10x longer than
    the completions).

    Batch keys: prompt_tokens (P x W, right-padded), prompt_lengths (P), completions
    (P x G x N), completion_lengths (P x G); with routing replay (and `replay`: the
    policy's forward, not a critic's or the reference's) routes (P x G x N x L x k, the
    experts the sampler chose for each completion token in each of the L sparse layers, -1
    where it did not record one), which the completion tokens are routed to."""
    prompt_PxW, plen_P = batch["prompt_tokens"], batch["prompt_lengths"]
    comp_PxGxN = batch["completions"]
    p, g, n = comp_PxGxN.shape
    w = prompt_PxW.shape[1]
    pos_PxW = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (p, w))
    seg_PxW = (pos_PxW < plen_P[:, None]).astype(jnp.int32)
    hidden_PxWxD, prompt = spec.prompt_kv(params, prompt_PxW, pos_PxW, seg_PxW, g)
    last_PxD = jnp.take_along_axis(hidden_PxWxD, (plen_P - 1)[:, None, None], axis=1)[:, 0]
    comp_BxN = comp_PxGxN.reshape(p * g, n)
    pos_BxN = jnp.repeat(plen_P, g)[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    seg_BxN = (jnp.arange(n)[None] < batch["completion_lengths"].reshape(-1, 1)).astype(jnp.int32)
    routes = batch.get("routes") if replay else None
    if routes is not None:  # P x G x N x L x k -> L x B x N x k
        routes = jnp.moveaxis(routes.reshape(p * g, n, *routes.shape[3:]), 2, 0)
    hidden_BxNxD, _ = spec.hidden(params, comp_BxN, pos_BxN, seg_BxN, prompt, routes)
    return jnp.concatenate([jnp.repeat(last_PxD, g, axis=0)[:, None], hidden_BxNxD], axis=1)


def states_logprobs(spec: Any, params: Any, states_BxN1xD: jax.Array, batch: Batch,
                    temperature: float = 1.0, chunk_size: int | None = None,
                    differentiable_entropy: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log p, entropy) of every completion token from `group_states`, P x G x N fp32. Only
    the states that predict completion tokens go through the vocabulary-sized head, in
    chunks (`gpurl.kernels.logprob`); the entropy carries a gradient only when asked."""
    p, g, n = batch["completions"].shape
    logp_BxN, entropy_BxN = chunked_token_logprobs(
        spec.logits, params, states_BxN1xD[:, :-1], batch["completions"].reshape(p * g, n),
        temperature or 1.0, chunk_size=chunk_size, differentiable_entropy=differentiable_entropy)
    return logp_BxN.reshape(p, g, n), entropy_BxN.reshape(p, g, n)


def group_logprobs(spec: Any, params: Any, batch: Batch, temperature: float = 1.0,
                   chunk_size: int | None = None, replay: bool = True
                   ) -> tuple[jax.Array, jax.Array]:
    """(log p, entropy) of every completion token, P x G x N fp32 (`group_states`, then
    the head on the states that predict completion tokens); `replay`: route completion
    tokens as the sampler did (routing replay; the frozen reference routes on its own)."""
    states = group_states(spec, params, batch, replay)
    return states_logprobs(spec, params, states, batch, temperature, chunk_size)


def final_states(states_BxN1xD: jax.Array, lengths_B: jax.Array) -> jax.Array:
    """The state after each whole completion, B x D."""
    return jnp.take_along_axis(states_BxN1xD, lengths_B[:, None, None].astype(jnp.int32), axis=1)[:, 0]
