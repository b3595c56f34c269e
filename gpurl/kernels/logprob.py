"""Log-probabilities of target tokens without B x T x V logits in memory.

A policy-gradient step needs log p(target) for every token, i.e. a log-softmax over the
vocabulary. Materializing the logits costs B*T*V*4 bytes in fp32 (Gemma 3: V = 262,144,
so 1 MiB per token and 8 GiB for 8k tokens) and autodiff keeps two such arrays alive.
`chunked_token_logprobs` runs the output head chunk by chunk inside `lax.scan`, each
chunk under `jax.checkpoint`, so the forward pass keeps only per-token scalars and the
backward pass recomputes one chunk's logits at a time: peak memory is O(chunk x V)
instead of O(B x T x V), for one extra head matmul (4 instead of 3). Liger Kernel's fused
linear cross-entropy (Hsu et al. 2024, arXiv:2410.10989) chunks the same way but computes
the gradient inside the forward pass, which needs the loss fixed in advance; recomputing
keeps log p an ordinary differentiable array that any RL loss (ratios, clipping, KL) uses.

`token_logprobs_reference` is the pure-jnp version the chunked one is tested against.

Both take the head as `logits_fn(params, hidden_TxD) -> logits_TxV` with the parameters
passed explicitly (e.g. `ModelSpec.logits` and the full parameter tree, or a function of
the head weight alone), so gradients reach the parameters and the hidden states.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

LogitsFn = Callable[[Any, jax.Array], jax.Array]  # (params, hidden_...xD) -> logits_...xV

# fp32 logits of one chunk; see `default_chunk_size`.
CHUNK_BYTES = 256 * 2**20


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk whose fp32 logits take about `CHUNK_BYTES` (a power of two,
    at least 16): 256 for V = 262,144 (Gemma 3), 2,048 for V = 32,000 (Llama 2).

    256 MiB because XLA keeps about two chunk-sized fp32 arrays alive in the backward pass
    (benchmarks/README.md, "Chunked log-probs": 0.55 GB of scratch at Gemma 3's head, plus
    one V x D weight-gradient buffer, against 4.3 GB for the whole logits of 2,048 tokens
    and 17.2 GB for 8,192), small beside the weights and activations of any model with such
    a vocabulary. On CPU 1,024-token chunks were no faster than 256; one 256-token chunk's
    head matmul (256 x 640 x 262,144 for Gemma 3 270M: 86 GFLOP) should also keep a GPU
    busy, which is not measured yet."""
    tokens = max(CHUNK_BYTES // (4 * vocab_size), 16)
    return 2 ** int(math.log2(tokens))


def _stats(logits_TxV: jax.Array, targets_T: jax.Array, temperature: float = 1.0,
           differentiable_entropy: bool = False) -> tuple[jax.Array, jax.Array]:
    """log p(target) and the entropy of softmax(logits / temperature), both fp32.

    By default the entropy is a metric computed from stop-gradient logits, so it adds no
    term to the backward pass; `differentiable_entropy` keeps its gradient (an entropy
    bonus in the loss, PPO's `algo.entropy_coef`)."""
    z_TxV = logits_TxV.astype(jnp.float32) / temperature
    lse_T = jax.nn.logsumexp(z_TxV, axis=-1)
    target_T = jnp.take_along_axis(z_TxV, targets_T[..., None].astype(jnp.int32), axis=-1)[..., 0]
    # -sum p log p, not lse - sum p z: the latter cancels two large numbers (errors of
    # 2e-5 for peaked distributions in fp32). p = 0 terms are 0, even for z = -inf.
    logq_TxV = z_TxV - lse_T[..., None]
    if not differentiable_entropy:
        logq_TxV = jax.lax.stop_gradient(logq_TxV)
    p_TxV = jnp.exp(logq_TxV)
    # Zero log q where p = 0 before the product: where(p > 0, p * logq, 0) alone would
    # send 0 * logq = 0 * -inf = nan back to p in the entropy's gradient.
    entropy_T = -jnp.sum(p_TxV * jnp.where(p_TxV > 0, logq_TxV, 0.0), axis=-1)
    return target_T - lse_T, entropy_T


def _temperature(temperature: float | None) -> float:
    # Temperature 0 (greedy sampling) scores tokens at temperature 1, like
    # `gpurl.algorithms.forward.token_logprobs`.
    return float(temperature or 1.0)


def token_logprobs_reference(logits_fn: LogitsFn, params: Any, hidden_BxTxD: jax.Array,
                             targets_BxT: jax.Array, temperature: float = 1.0,
                             differentiable_entropy: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log p(targets), entropy), each B x T fp32, from the whole B x T x V logits at once."""
    logits_BxTxV = logits_fn(params, hidden_BxTxD)
    return _stats(logits_BxTxV, targets_BxT, _temperature(temperature), differentiable_entropy)


def chunked_token_logprobs(logits_fn: LogitsFn, params: Any, hidden_BxTxD: jax.Array,
                           targets_BxT: jax.Array, temperature: float = 1.0,
                           chunk_size: int | None = None,
                           differentiable_entropy: bool = False) -> tuple[jax.Array, jax.Array]:
    """(log p(targets), entropy), each B x T fp32, equal to `token_logprobs_reference` but
    with the logits of at most ~`chunk_size` tokens alive at once, forward and backward
    (`chunked_head`). Differentiable in `params` and `hidden_BxTxD`; the entropy is a
    stop-gradient metric unless `differentiable_entropy` (see `_stats`)."""
    temperature = _temperature(temperature)
    return chunked_head(logits_fn, params, hidden_BxTxD, targets_BxT,
                        functools.partial(_stats, temperature=temperature,
                                          differentiable_entropy=differentiable_entropy),
                        chunk_size)


def chunked_head(logits_fn: LogitsFn, params: Any, hidden_BxTxD: jax.Array,
                 targets_BxT: jax.Array, stats: Callable[..., tuple[jax.Array, ...]],
                 chunk_size: int | None = None) -> tuple[jax.Array, ...]:
    """`stats(logits_BxCxV, targets_BxC)` (a tuple of per-token B x C arrays) over all T
    tokens, with the logits of at most ~`chunk_size` tokens alive at once.

    `chunk_size` counts tokens over the whole batch; None picks `default_chunk_size(V)`.
    Chunks are slices of the T axis taken from every row (B x c tokens, c = ceil(T /
    ceil(B*T / chunk_size)), so a chunk holds chunk_size tokens or a little more when
    rounding up, and at least B), never slices of B: rows stay split over the data axes
    of the mesh, and every device computes the head for its own rows only. T is padded
    with zeros up to a multiple of c; padded tokens are dropped from the outputs and get
    no gradient."""
    b, t, _ = hidden_BxTxD.shape
    if chunk_size is None:
        vocab = jax.eval_shape(logits_fn, params, hidden_BxTxD[:1, :1]).shape[-1]
        chunk_size = default_chunk_size(vocab)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}.")
    n = min(-(-b * t // chunk_size), t)  # chunks
    c = -(-t // n)  # tokens of each row per chunk
    pad = n * c - t
    hidden_BxTxD = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
    targets_BxT = jnp.pad(targets_BxT, ((0, 0), (0, pad)))
    # Chunk axis first for scan; the swap moves only the unsharded T pieces.
    hidden_JxBxCxD = hidden_BxTxD.reshape(b, n, c, -1).swapaxes(0, 1)
    targets_JxBxC = targets_BxT.reshape(b, n, c).swapaxes(0, 1)

    # prevent_cse=False: scan already keeps XLA from merging the recomputation away.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def chunk(params: Any, hidden_BxCxD: jax.Array, targets_BxC: jax.Array) -> tuple:
        return stats(logits_fn(params, hidden_BxCxD), targets_BxC)

    def body(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, Any]:
        return carry, chunk(params, *xs)

    _, out_JxBxC = jax.lax.scan(body, None, (hidden_JxBxCxD, targets_JxBxC))

    def unchunk(x_JxBxC: jax.Array) -> jax.Array:
        return x_JxBxC.swapaxes(0, 1).reshape(b, n * c)[:, :t]

    return tuple(unchunk(x) for x in out_JxBxC)


def chunked_pair_head(student_fn: LogitsFn, student_params: Any, student_BxTxD: jax.Array,
                      teacher_fn: LogitsFn, teacher_params: Any, teacher_BxTxD: jax.Array,
                      targets_BxT: jax.Array, stats: Callable[..., tuple[jax.Array, ...]],
                      chunk_size: int | None = None) -> tuple[jax.Array, ...]:
    """`stats((student logits_BxCxV, teacher logits_BxCxV), targets_BxC)` over all T tokens
    (`chunked_head`), with two heads' logits of at most ~`chunk_size` tokens alive at once:
    a distillation loss over the whole vocabulary. Both models read the same token ids
    (one vocabulary); their widths (D each) may differ. The teacher's side is a constant
    (stop-gradient), so the backward pass recomputes only the student's head per chunk
    besides the teacher's forward one. None picks half of `default_chunk_size(V)`."""
    if chunk_size is None:
        vocab = jax.eval_shape(student_fn, student_params, student_BxTxD[:1, :1]).shape[-1]
        chunk_size = max(default_chunk_size(vocab) // 2, 16)
    width = student_BxTxD.shape[-1]
    dtype = jnp.promote_types(student_BxTxD.dtype, teacher_BxTxD.dtype)
    pair_BxTxD = jnp.concatenate([student_BxTxD.astype(dtype),
                                   jax.lax.stop_gradient(teacher_BxTxD).astype(dtype)], axis=-1)

    def logits_fn(params: tuple, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        student = student_fn(params[0], hidden[..., :width].astype(student_BxTxD.dtype))
        teacher = teacher_fn(params[1], hidden[..., width:].astype(teacher_BxTxD.dtype))
        return student, jax.lax.stop_gradient(teacher)

    return chunked_head(logits_fn, (student_params, teacher_params), pair_BxTxD, targets_BxT,
                        stats, chunk_size)
