"""Forward passes every objective builds on: next-token log-probs of a packed batch, and
the hidden states and log-probs of grouped completions (one prompt pass per group).

Grouped batches (RL and preference pairs) hold P prompts with G completions each:
prompt_tokens (P x W, right-padded), prompt_lengths (P), completions (P x G x N),
completion_lengths (P x G). A packed batch (`gpurl.data.packing`) also holds the same
tokens laid out in B rows of Z slots (`pack/*`): the model then runs on the rows, every
slot a real token, and only per-token numbers (log-probs, values) come back to the
grouped layout, where every loss reads them as it reads the padded forward's.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from gpurl.algorithms.objective import Batch
from gpurl.data.packing import is_packed
from gpurl.kernels.logprob import chunked_pair_head, chunked_token_logprobs, default_chunk_size
from gpurl.models.axes import logical_spec
from gpurl.models.layers import constrain_blocks, layout, split_tokens
from gpurl.models.transformer import SHARED_PREFIX


def shifted_targets(batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Targets for logits[:, :-1]: token t+1 and its loss weight (0 across packed segments,
    since the first token of a segment carries no loss); rows split over the context axis
    (`gpurl.data.packing.split_token_rows`) carry theirs, B x C x T/C."""
    if "targets" in batch:
        return batch["targets"], batch["target_mask"]
    return batch["tokens"][:, 1:], batch["loss_mask"][:, 1:]


def row_hidden(spec: Any, params: Any, batch: Batch) -> jax.Array:
    """Final-norm hidden states of token rows (SFT, logit distillation), B x T x D; rows
    split over the context axis run with their tokens split (`split_tokens`)."""
    inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])
    if "targets" not in batch:  # a vision-language model's rows carry their images
        return spec.hidden(params, *inputs, pixels=batch.get("pixels"))[0]
    with split_tokens():
        return spec.hidden(params, *inputs)[0]


def row_head(hidden_BxTxD: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the states that predict a token, their targets, their loss weights) of token rows:
    every state but the last of each row; rows split over the context axis: each
    device's own block of states (B x C rows of T/C), against `targets`."""
    targets, mask = shifted_targets(batch)
    if "targets" not in batch:
        return hidden_BxTxD[:, :-1], targets, mask
    b, blocks, t = targets.shape
    head = constrain_blocks(hidden_BxTxD.reshape(b * blocks, t, hidden_BxTxD.shape[-1]))
    return (head, constrain_blocks(targets.reshape(b * blocks, t)),
            constrain_blocks(mask.reshape(b * blocks, t)))


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
    the completions). A packed batch gives the rows' states instead, B x Z x D
    (`_packed_states`): read them with `states_logprobs` and `state_values`.

    Batch keys: prompt_tokens (P x W, right-padded), prompt_lengths (P), completions
    (P x G x N), completion_lengths (P x G); a vision-language model's prompt_pixels (P x
    M x 3 x H x W, its prompts' images, which the prompt pass reads); with routing replay (and `replay`: the
    policy's forward, not a critic's or the reference's) routes (P x G x N x L x k, the
    experts the sampler chose for each completion token in each of the L sparse layers, -1
    where it did not record one), which the completion tokens are routed to."""
    if is_packed(batch):
        return _packed_states(spec, params, batch, replay)
    prompt_PxW, plen_P = batch["prompt_tokens"], batch["prompt_lengths"]
    comp_PxGxN = batch["completions"]
    p, g, n = comp_PxGxN.shape
    w = prompt_PxW.shape[1]
    pos_PxW = jnp.broadcast_to(jnp.arange(w, dtype=jnp.int32), (p, w))
    seg_PxW = (pos_PxW < plen_P[:, None]).astype(jnp.int32)
    hidden_PxWxD, prompt = spec.prompt_kv(params, prompt_PxW, pos_PxW, seg_PxW, g,
                                          pixels=batch.get("prompt_pixels"))
    last_PxD = jnp.take_along_axis(hidden_PxWxD, (plen_P - 1)[:, None, None], axis=1)[:, 0]
    comp_BxN = comp_PxGxN.reshape(p * g, n)
    pos_BxN = jnp.repeat(plen_P, g)[:, None] + jnp.arange(n, dtype=jnp.int32)[None]
    seg_BxN = (jnp.arange(n)[None] < batch["completion_lengths"].reshape(-1, 1)).astype(jnp.int32)
    routes = batch.get("routes") if replay else None
    if routes is not None:  # P x G x N x L x k -> L x B x N x k
        routes = jnp.moveaxis(routes.reshape(p * g, n, *routes.shape[3:]), 2, 0)
    hidden_BxNxD, _ = spec.hidden(params, comp_BxN, pos_BxN, seg_BxN, prompt, routes)
    return jnp.concatenate([jnp.repeat(last_PxD, g, axis=0)[:, None], hidden_BxNxD], axis=1)


def _packed_states(spec: Any, params: Any, batch: Batch, replay: bool) -> jax.Array:
    """Final-norm hidden states of the packed rows, B x Z x D: each branch sees its
    group's prefix and itself (`gpurl.kernels.segments`), so a completion's states are
    the padded forward's."""
    routes = batch.get("pack/routes") if replay else None
    if routes is not None:  # B x Z x L x k -> L sparse layers x B x Z x k
        routes = jnp.moveaxis(routes, 2, 0)
    with split_tokens():  # over the context axis, where the mesh has one
        hidden_BxZxD, _ = spec.hidden(params, batch["pack/tokens"], batch["pack/positions"],
                                      batch["pack/segments"], SHARED_PREFIX, routes)
    return hidden_BxZxD


def _unpack(values_BxZ: jax.Array, batch: Batch, cols: str, lengths: jax.Array) -> jax.Array:
    """P x G x W numbers of each completion from packed B x Z ones: column `batch[cols]`
    (P x G x W) of its row for j < `lengths`, and 0 past them and for a completion whose
    row is -1 (in another micro-batch, `gpurl.data.packing.micro_batch`): nothing is read
    from slots that belong to other completions, so no value but 0 ever stands in for
    one (an unrelated slot's log-prob could overflow exp() in a ratio or KL)."""
    row_PxG, col_PxGxW = batch["pack/row"], batch[cols]
    j = jnp.arange(col_PxGxW.shape[-1], dtype=jnp.int32)
    flat = jnp.maximum(row_PxG, 0)[..., None] * values_BxZ.shape[1] + col_PxGxW
    out = values_BxZ.reshape(-1)[flat.reshape(-1)].reshape(col_PxGxW.shape)
    here_PxGxW = (row_PxG >= 0)[..., None] & (j < lengths[..., None])
    return jnp.where(here_PxGxW, out, 0.0)


def state_values(fn: Callable[[jax.Array], jax.Array], states: jax.Array,
                 batch: Batch) -> jax.Array:
    """fn (... x D -> ..., a scalar head) of every completion's states s_0..s_N from
    `group_states`, P x G x (N+1); packed states go through `fn` in their rows, and only
    the numbers come back (0 past each completion's end)."""
    p, g, n = batch["completions"].shape
    if not is_packed(batch):
        return fn(states).reshape(p, g, n + 1)
    return _unpack(fn(states), batch, "pack/state_cols", batch["completion_lengths"] + 1)


def _head_rows(states: jax.Array, batch: Batch
               ) -> tuple[jax.Array, jax.Array, Callable[[jax.Array], jax.Array]]:
    """(the states that predict completion tokens, B x C x D; their targets, B x C; the map
    of B x C numbers back to the completions' P x G x N) from `group_states`. Padded: every
    state but the last of each row; packed: each row's `pack/head` slots."""
    p, g, n = batch["completions"].shape
    if is_packed(batch):
        # each context block's own states: rows x blocks are the head's rows, so every
        # device runs the head on the slots it holds (one block when there is no context axis)
        b, blocks, h = batch["pack/head"].shape
        z = states.shape[1]
        head_BCxHxD = jnp.take_along_axis(
            constrain_blocks(states.reshape(b * blocks, z // blocks, states.shape[-1])),
            constrain_blocks(batch["pack/head"].reshape(b * blocks, h))[..., None], axis=1)
        targets_BCxH = constrain_blocks(batch["pack/targets"].reshape(b * blocks, h))
        lengths = batch["completion_lengths"]
        return (head_BCxHxD, targets_BCxH,
                lambda x_BCxH: _unpack(x_BCxH.reshape(b, -1), batch, "pack/head_cols", lengths))
    return (states[:, :-1], batch["completions"].reshape(p * g, n),
            lambda x_BxN: x_BxN.reshape(p, g, n))


def head_params(spec: Any, params: Any) -> Any:
    """`params` with the output head's weight (the embedding when tied) gathered whole
    along its model dimension (the `embed` rule's axes: fsdp, context), once, before the
    chunked head's loop: inside it XLA gathers the weight again for every chunk (a
    vocabulary-sized all-gather per 512 tokens, forward and backward), which made most
    of a long-context step's interconnect traffic. The weight stays split over the
    vocabulary's axis (tp); its gradient is reduced once. Outside a `sharded_rows`
    trace, `params` as they are."""
    current = layout()
    key = "embed" if spec.cfg.tie_embeddings else "lm_head"
    if current is None or not current.rules or not isinstance(params, dict) or key not in params:
        return params
    weight, mesh = params[key], current.rows.mesh
    rules = {**current.rules, "embed": ()}
    whole = NamedSharding(mesh, logical_spec(spec.logical_axes[key], weight.shape, rules, mesh))
    return {**params, key: jax.lax.with_sharding_constraint(weight, whole)}


def head_chunk(spec: Any, chunk_size: int | None = None, share: int = 1) -> int:
    """Tokens per chunk of the chunked head (`gpurl.kernels.logprob`): `chunk_size` when
    given, else `default_chunk_size(V) // share` tokens on every device the batch rows are
    split over. A chunk counts tokens over the whole batch while its logits budget is one
    device's: on 8 row shards the default alone gave each device 1/8 of it and read (and
    converted) the whole head weight 8x as often (`qwen3_30b_a3b` on 8 H100s: 32 tokens per
    chunk per device, 0.97 of 2.35 TB per train-step call by the GPU compiler's account)."""
    if chunk_size is not None:
        return chunk_size
    tokens = max(default_chunk_size(spec.cfg.vocab_size) // share, 16)
    current = layout()
    if current is None or not current.rows.spec or current.rows.spec[0] is None:
        return tokens
    axes = current.rows.spec[0]
    for axis in (axes,) if isinstance(axes, str) else axes:
        tokens *= current.rows.mesh.shape[axis]
    return tokens


def states_logprobs(spec: Any, params: Any, states_BxN1xD: jax.Array, batch: Batch,
                    temperature: float = 1.0, chunk_size: int | None = None,
                    differentiable_entropy: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log p, entropy) of every completion token from `group_states`, P x G x N fp32. Only
    the states that predict completion tokens go through the vocabulary-sized head, in
    chunks (`gpurl.kernels.logprob`); the entropy carries a gradient only when asked.
    Packed rows: the states of each row's `pack/head` slots, against `pack/targets`."""
    head_BxCxD, targets_BxC, back = _head_rows(states_BxN1xD, batch)
    logp_BxC, entropy_BxC = chunked_token_logprobs(
        spec.logits, head_params(spec, params), head_BxCxD, targets_BxC, temperature or 1.0,
        chunk_size=head_chunk(spec, chunk_size), differentiable_entropy=differentiable_entropy)
    return back(logp_BxC), back(entropy_BxC)


def states_pair(spec: Any, params: Any, states: jax.Array, teacher: Any, teacher_states: jax.Array,
                batch: Batch, stats: Callable[..., tuple[jax.Array, ...]],
                chunk_size: int | None = None) -> tuple[jax.Array, ...]:
    """`stats((student logits, teacher logits), targets)` (per-token numbers) at every
    completion token, each P x G x N, from the student's and a frozen teacher's
    `group_states` of the same batch: both heads run chunk by chunk on the states that
    predict completion tokens (`gpurl.kernels.logprob.chunked_pair_head`), so no
    tokens x vocabulary array exists; only the student's side carries a gradient."""
    head_BxCxD, targets_BxC, back = _head_rows(states, batch)
    teacher_BxCxD = _head_rows(teacher_states, batch)[0]
    out = chunked_pair_head(spec.logits, head_params(spec, params), head_BxCxD,
                            teacher.spec.logits, head_params(teacher.spec, teacher.params),
                            teacher_BxCxD, targets_BxC, stats, head_chunk(spec, chunk_size, share=2))
    return tuple(back(x) for x in out)


def group_logprobs(spec: Any, params: Any, batch: Batch, temperature: float = 1.0,
                   chunk_size: int | None = None, replay: bool = True
                   ) -> tuple[jax.Array, jax.Array]:
    """(log p, entropy) of every completion token, P x G x N fp32 (`group_states`, then
    the head on the states that predict completion tokens); `replay`: route completion
    tokens as the sampler did (routing replay; the frozen reference routes on its own)."""
    states = group_states(spec, params, batch, replay)
    return states_logprobs(spec, params, states, batch, temperature, chunk_size)


def final_values(fn: Callable[[jax.Array], jax.Array], states: jax.Array,
                 batch: Batch) -> jax.Array:
    """fn (a scalar head) of the state after each whole completion, B (`state_values`)."""
    values_PxGxN1 = state_values(fn, states, batch)
    lengths_B = batch["completion_lengths"].reshape(-1, 1).astype(jnp.int32)
    return jnp.take_along_axis(values_PxGxN1.reshape(lengths_B.shape[0], -1), lengths_B, axis=1)[:, 0]
