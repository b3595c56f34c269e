"""The one attention function every model calls (training, prefill, decode).

`implementation` picks the kernel; this file holds the pure-jnp reference (`xla`) that
every faster kernel is tested against. Shapes (`gpurl.glossary`): B batch, T query
tokens, S key tokens, H query heads, K key/value heads (H % K == 0), Q = H / K, E head width.

The mask is described, never materialized by the caller: positions and segment ids of the
queries and of the keys, plus an optional sliding window. A key is visible to a query
iff kv_pos <= q_pos, the key is in the query's segment or in that segment's shared
prefix (`visible_segments`), the key's segment is not 0 (padding or an empty cache slot)
and, with a window, q_pos - kv_pos < window. A vision-language model's image tokens see
their whole image (Gemma 3): such a query passes `q_sees`, the last position it sees (its
image's last token), in place of its own position in the causal test (`attention_mask`);
only `xla` takes it, and calls with it run there.
Shared prefixes are how packed RL rows compute each group's prompt once: see
`gpurl.kernels.segments`. Flash kernels evaluate
this per block, so T x S never exists in memory; `xla` builds it (`attention_mask`) one
query chunk at a time and, for long self-attention, skips the keys a chunk cannot see
(`causal_groups`).

Implementations (`model.attention`):
- `xla`: the reference; any backend. Dense within each query chunk, so it computes
  masked pairs too, except that long self-attention skips whole key ranges past the
  causal diagonal (and before a sliding window): about half the work.
- `pallas`: FlashAttention-2 kernels in Pallas (`pallas_attention.py`), forward and
  backward, every feature. On GPUs they lower to Triton; elsewhere they run in Pallas's
  interpreter (correct but slow: for tests, not for training on CPU).
- `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`. Its mask is index
  based (causal, left window), so it runs only where that equals ours: self-attention
  (`contiguous=True`: the keys are the queries' own tokens, positions counting up by one
  within each segment), no logit soft-cap, fp16/bf16, head width a multiple of 8 up to
  256. Segments reach it as a dense B x 1 x T x S mask (its API takes no segment ids).
  Calls outside those limits run `pallas` and log the reason once. Needs a CUDA GPU:
  requesting it elsewhere is a configuration error.
- `auto`: `cudnn` (with the per-call fallback to `pallas`) on GPUs of compute capability
  8.0 or newer (Ampere, Ada, Hopper, Blackwell), `xla` elsewhere (CPUs, V100, T4, RTX
  20xx), logged once.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from gpurl.kernels import platform
from gpurl.kernels.paged_attention import paged_decode_attention, paged_write
from gpurl.kernels.pallas_attention import flash_attention
from gpurl.kernels.pallas_paged import paged_decode_attention as paged_pallas
from gpurl.kernels.segments import visible_segments

IMPLEMENTATIONS = ("xla", "cudnn", "pallas")

log = logging.getLogger(__name__)
_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        log.info(message)


def resolve(implementation: str, backend: str | None = None) -> str:
    """The implementation to run on `backend` (default: JAX's) for `model.attention`."""
    if implementation != "auto" and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"attention implementation {implementation!r} is unknown; use one of "
            f"auto, {', '.join(IMPLEMENTATIONS)}.")
    backend = backend or platform.backend()
    if implementation == "cudnn" and backend != "gpu":
        raise ValueError(
            f"model.attention=cudnn needs a CUDA GPU but JAX runs on {backend}; "
            "use model.attention=auto or xla.")
    if implementation == "auto":
        if backend == "gpu" and platform.cudnn_attention_supported():
            return "cudnn"
        if backend == "gpu":
            _log_once("attention: auto -> xla on this GPU (cuDNN flash attention needs "
                      "compute capability 8.0 or newer).")
            return "xla"
        _log_once(f"attention: auto -> xla on {backend} (the cuDNN and Pallas kernels "
                  "target GPUs).")
        return "xla"
    if implementation == "pallas" and backend != "gpu":
        _log_once(f"attention: pallas runs in Pallas's interpreter on {backend} (slow; "
                  "meant for tests).")
    return implementation


def attention_mask(
    q_positions_BxT: jax.Array,
    kv_positions_BxS: jax.Array,
    q_segments_BxT: jax.Array,
    kv_segments_BxS: jax.Array,
    window: int | None = None,
    q_sees_BxT: jax.Array | None = None,
) -> jax.Array:
    """Causal, same segment or its shared prefix (packing), non-padding (segment 0) and
    optional sliding window. `q_sees`: the last position each query sees (default its
    own; an image token's is its image's last token, so the image attends within itself
    both ways while the window still counts back from the query's own position)."""
    q_pos = q_positions_BxT[:, :, None]
    kv_pos = kv_positions_BxS[:, None, :]
    sees = q_pos if q_sees_BxT is None else q_sees_BxT[:, :, None]
    mask_BxTxS = (kv_pos <= sees) & visible_segments(q_segments_BxT[:, :, None],
                                                      kv_segments_BxS[:, None, :])
    if window is not None:
        mask_BxTxS &= q_pos - kv_pos < window
    return mask_BxTxS


@dataclass(frozen=True)
class Shards:
    """How a traced program splits attention's inputs over its mesh: rows (axis 0) over
    the `rows` mesh axes, heads over the `heads` axes (None: whole on every device).

    A Pallas kernel is one opaque call to XLA's partitioner, which would gather every row
    and head to every device and run the whole kernel there; given `Shards`, each device
    runs the kernel on its own rows and heads (`shard_map`), as the xla and cuDNN paths
    are partitioned."""

    mesh: Mesh
    rows: Any  # a mesh axis name, a tuple of them, or None
    heads: Any = None
    context: str | None = None  # the axis the tokens (axis 1) are split over (`context_attention`)

    def spec(self, ndim: int, heads: int | None = None, rows_axis: int = 0) -> P:
        axes: list[Any] = [None] * ndim
        axes[rows_axis] = self.rows
        if heads is not None:
            axes[heads] = self.heads
        return P(*axes)

    def run(self, fn: Callable, in_specs: tuple, out_specs: Any, *args: Any) -> Any:
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)(*args)


def attention(
    q_BxTxHxE: jax.Array,
    k_BxSxKxE: jax.Array,
    v_BxSxKxE: jax.Array,
    q_positions_BxT: jax.Array,
    q_segments_BxT: jax.Array,
    kv_positions_BxS: jax.Array,
    kv_segments_BxS: jax.Array,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    contiguous: bool = False,
    shared_prefix: bool = False,
    implementation: str = "xla",
    shards: Shards | None = None,
    q_sees_BxT: jax.Array | None = None,
) -> jax.Array:
    """Grouped-query attention; returns B x T x H x E in the query dtype.

    `implementation` is one of IMPLEMENTATIONS (resolve `auto` first with `resolve`);
    `contiguous` promises self-attention with positions counting up by one inside each
    segment (see the module docstring): `cudnn` needs it (its mask is index based) and
    `xla` uses it to skip keys past the diagonal (`causal_groups`). `shards`: how the
    inputs are split over the program's mesh, which the Pallas kernels run under (see
    `Shards`). `q_sees_BxT`: the last position each query sees (see `attention_mask`):
    dense `xla` attention, whatever `implementation` says (the flash kernels and cuDNN
    mask by position or index without it)."""
    if implementation not in _IMPLEMENTATIONS:
        implementation = resolve(implementation)
    if q_sees_BxT is not None:
        if implementation != "xla":
            _log_once(f"attention: {implementation} -> xla for calls whose image tokens "
                      "see their whole image.")
        return _chunked(q_BxTxHxE, q_positions_BxT, q_segments_BxT, k_BxSxKxE, v_BxSxKxE,
                        kv_positions_BxS, kv_segments_BxS, scale=scale, softcap=softcap,
                        window=window, q_sees_BxT=q_sees_BxT)
    if implementation == "cudnn":
        reason = ("tokens split over a context axis (cuDNN's mask is index based)"
                  if shards is not None and shards.context is not None else
                  _cudnn_unsupported(q_BxTxHxE, k_BxSxKxE, softcap, contiguous))
        if reason:
            _log_once(f"attention: cudnn -> pallas for calls with {reason}.")
            implementation = "pallas"
    args = (q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, q_positions_BxT, q_segments_BxT,
            kv_positions_BxS, kv_segments_BxS)
    if shards is not None and shards.context is not None:
        return context_attention(*args, scale=scale, softcap=softcap, window=window,
                                 implementation=implementation, shards=shards)
    fn = functools.partial(_IMPLEMENTATIONS[implementation], scale=scale, softcap=softcap,
                           window=window, contiguous=contiguous, shared_prefix=shared_prefix)
    if implementation == "pallas" and shards is not None:
        qkv, rows = shards.spec(4, heads=2), shards.spec(2)
        return shards.run(fn, (qkv, qkv, qkv, rows, rows, rows, rows), qkv, *args)
    return fn(*args)


def context_attention(q_BxTxHxE: jax.Array, k_BxTxKxE: jax.Array, v_BxTxKxE: jax.Array,
                      q_positions_BxT: jax.Array, q_segments_BxT: jax.Array,
                      kv_positions_BxT: jax.Array, kv_segments_BxT: jax.Array, *,
                      scale: float, softcap: float | None, window: int | None,
                      implementation: str, shards: Shards) -> jax.Array:
    """Self-attention of packed rows whose tokens are split over the `shards.context` mesh
    axis in `gpurl.data.packing.balanced_order` (device c holds the row's natural chunks c
    and 2C - 1 - c of 2C): each device all-gathers the row's keys, values, positions and
    segments and attends with its own queries (Llama 3's context parallelism, Dubey et
    al. 2024, section 3.3.2: it composes with any mask, shared prefixes included, because
    the mask is read from positions and segments, never from indices). Backward, the
    gather's transpose sums each key's gradient onto the device that holds it.

    All-gather rather than a ring: a ring passes each key block C - 1 times with compute
    in between, which pays when the transfer of a layer's keys outlasts its attention;
    with grouped-query attention keys and values are a small share of a layer's traffic
    (K / H of the queries), so one gather per layer is cheaper to schedule and to
    account for (docs/scaling.md, "The context axis").

    `xla`: the first chunk's queries (natural chunk c < C) see only keys of the first half
    of the row, so they attend to it alone, and the second chunk's to all keys: 3/4 of the
    dense pairs, 1.5x the causal ones. `pallas` (and `cudnn`, whose index-based mask
    cannot describe a split row) run the flash kernel, which skips key blocks no query of
    a block can see."""
    axis, mesh = shards.context, shards.mesh
    width = mesh.shape[axis]
    if implementation == "cudnn":
        implementation = "pallas"
    fn = functools.partial(_IMPLEMENTATIONS[implementation], scale=scale, softcap=softcap,
                           window=window)

    def local(q, k, v, q_pos, q_seg, kv_pos, kv_seg):
        keys = [jax.lax.all_gather(x, axis, axis=1, tiled=True) for x in (k, v, kv_pos, kv_seg)]
        if implementation != "xla":
            return fn(q, *keys[:2], q_pos, q_seg, *keys[2:])
        half = q.shape[1] // 2
        early = [x.reshape(x.shape[0], width, 2, half, *x.shape[2:])[:, :, 0].reshape(
            x.shape[0], width * half, *x.shape[2:]) for x in keys]  # natural chunks 0..C-1
        first = _chunked(q[:, :half], q_pos[:, :half], q_seg[:, :half], *early[:2], *early[2:],
                         scale=scale, softcap=softcap, window=window, remat=True)
        second = _chunked(q[:, half:], q_pos[:, half:], q_seg[:, half:], *keys[:2], *keys[2:],
                          scale=scale, softcap=softcap, window=window, remat=True)
        return jnp.concatenate([first, second], axis=1)

    qkv = P(shards.rows, axis, shards.heads, None)
    rows = P(shards.rows, axis)
    return jax.shard_map(local, mesh=mesh, in_specs=(qkv, qkv, qkv, rows, rows, rows, rows),
                         out_specs=qkv, check_vma=False)(
        q_BxTxHxE, k_BxTxKxE, v_BxTxKxE, q_positions_BxT, q_segments_BxT, kv_positions_BxT,
        kv_segments_BxT)


# fp32 attention logits of one query chunk of `xla` (B x H x chunk x S); see `query_chunk`.
CHUNK_BYTES = 256 * 2**20


def query_chunk(b: int, t: int, h: int, s: int) -> int:
    """Queries per chunk of `xla` attention: all T when the B x H x T x S fp32 logits fit
    in `CHUNK_BYTES`, else the power of two (at least 16) whose chunk does. A long
    sequence's logits then never exist whole, forward or backward (each chunk is
    rematerialized): 4,096 tokens x 16 heads take 1 GiB per logits-sized array, and the
    backward pass keeps several."""
    per_query = 4 * b * h * s
    if t * per_query <= CHUNK_BYTES:
        return t
    return max(16, 1 << max(CHUNK_BYTES // per_query, 1).bit_length() - 1)


# Query groups of a long self-attention in `xla`, each with its own static key range; see
# `causal_groups`. More groups skip more (work (G + 1) / 2G of dense) but compile one
# attention body (forward and backward) per group. Forward + backward of 4,096 tokens x
# 16 heads on 2 CPU cores (benchmarks/README.md): 8 groups took 0.52x the dense CPU time
# and +2 s to compile, 16 groups 0.41x (their chunks are smaller too) and +5 s.
CAUSAL_GROUPS = 16


def causal_groups(t: int, window: int | None) -> list[tuple[int, int, int]]:
    """(first query, end query, first key) of each query group of a `contiguous`
    self-attention over t tokens (T = S); the group's keys end where its queries end.

    Contiguity (queries and keys are the same tokens, positions counting up by one inside
    each segment) means query i never sees key j > i: a later key of its own segment has
    a later position, and a key of another segment is masked anyway. With a window it
    also never sees key j <= i - window (its position is at least window earlier, or it is
    in another segment). So queries [q0, q1) need only keys [max(0, q0 - window + 1), q1),
    and dropping the others removes only masked pairs: the softmax is the same, up to
    float32 summation order. The groups are `CAUSAL_GROUPS` equal slices of the queries:
    for causal attention equal slices minimize the computed area (the sum over groups of
    width x key prefix), and the FLOPs fall to (G + 1) / 2G of dense, 53% for G = 16."""
    width = -(-t // max(1, min(CAUSAL_GROUPS, t)))
    return [(q0, min(q0 + width, t), 0 if window is None else max(0, q0 - window + 1))
            for q0 in range(0, t, width)]


def _xla(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, q_pos_BxT, q_seg_BxT, kv_pos_BxS, kv_seg_BxS, *,
         scale, softcap, window, contiguous=False, shared_prefix=False):
    """Dense masked attention in query chunks (`_chunked`). A `contiguous` self-attention
    long enough to need several chunks runs as `causal_groups` instead: each group of
    queries attends, chunk by chunk, to its static key range only, and the groups' outputs
    are concatenated (with shared prefixes, every key range starts at 0: see
    `attention`). A short one (a single chunk) and any other call (KV cache, prompt keys)
    run dense over all S keys."""
    b, t, h, _ = q_BxTxHxE.shape
    s = k_BxSxKxE.shape[1]
    kw = dict(scale=scale, softcap=softcap, window=window)
    q_args = (q_BxTxHxE, q_pos_BxT, q_seg_BxT)
    kv_args = (k_BxSxKxE, v_BxSxKxE, kv_pos_BxS, kv_seg_BxS)
    if not contiguous or t != s or query_chunk(b, t, h, s) >= t:
        return _chunked(*q_args, *kv_args, **kw)
    out_BxTxHxE = []
    for q0, q1, k0 in causal_groups(t, None if shared_prefix else window):
        # As many chunks as `query_chunk` needs, of equal size (a group's width is rarely
        # a power of two). Every group is rematerialized, as one chunk or chunk by chunk,
        # so like the dense chunks no group's logits outlive its own forward or backward.
        n = -(-(q1 - q0) // query_chunk(b, q1 - q0, h, q1 - k0))
        out_BxTxHxE.append(_chunked(*(x[:, q0:q1] for x in q_args),
                                    *(x[:, k0:q1] for x in kv_args), **kw,
                                    chunk=-(-(q1 - q0) // n), remat=True))
    return jnp.concatenate(out_BxTxHxE, axis=1)


def _chunked(q_BxTxHxE, q_pos_BxT, q_seg_BxT, k_BxSxKxE, v_BxSxKxE, kv_pos_BxS, kv_seg_BxS, *,
             scale, softcap, window, chunk=None, remat=False, q_sees_BxT=None):
    """Every query against every key, masked, in chunks of `chunk` queries (default
    `query_chunk`), each rematerialized (a single chunk only with `remat`)."""
    b, t, h, e = q_BxTxHxE.shape
    c = query_chunk(b, t, h, k_BxSxKxE.shape[1]) if chunk is None else chunk
    q_sees_BxT = q_pos_BxT if q_sees_BxT is None else q_sees_BxT

    def part(q_BxCxHxE, q_pos_BxC, q_seg_BxC, q_sees_BxC):
        mask_BxCxS = attention_mask(q_pos_BxC, kv_pos_BxS, q_seg_BxC, kv_seg_BxS, window,
                                    q_sees_BxC)
        return _xla_attention(q_BxCxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxCxS, scale, softcap)

    if c >= t:
        # Outside a loop, prevent_cse keeps XLA from merging the recomputation with the
        # forward (which would keep the logits alive after all).
        return (jax.checkpoint(part) if remat else part)(q_BxTxHxE, q_pos_BxT, q_seg_BxT,
                                                         q_sees_BxT)
    # Query chunks in a `lax.map`, each rematerialized: every query still sees every key,
    # so this is the same softmax, row by row. Padded queries have segment 0 (no key).
    n = -(-t // c)
    pad = n * c - t

    def chunks(x):  # B x T x ... -> n x B x c x ...
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(b, n, c, *x.shape[2:]).swapaxes(0, 1)

    out_NxBxCxHxE = jax.lax.map(
        lambda xs: jax.checkpoint(part, prevent_cse=False)(*xs),
        (chunks(q_BxTxHxE), chunks(q_pos_BxT), chunks(q_seg_BxT), chunks(q_sees_BxT)))
    return out_NxBxCxHxE.swapaxes(0, 1).reshape(b, n * c, h, e)[:, :t]


def _xla_attention(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask_BxTxS, scale, softcap):
    b, t, h, d = q_BxTxHxE.shape
    k = k_BxSxKxE.shape[2]
    q_BxTxKxQxE = q_BxTxHxE.reshape(b, t, k, h // k, d)
    logits_BxKxQxTxS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKxQxE, k_BxSxKxE, preferred_element_type=jnp.float32)
    logits_BxKxQxTxS *= scale
    if softcap is not None:
        logits_BxKxQxTxS = softcap * jnp.tanh(logits_BxKxQxTxS / softcap)
    mask = mask_BxTxS[:, None, None, :, :]
    logits_BxKxQxTxS = jnp.where(mask, logits_BxKxQxTxS, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits_BxKxQxTxS, axis=-1)
    # Rows with no visible key (padding queries) would average all values; zero them.
    probs = jnp.where(mask, probs, 0.0).astype(v_BxSxKxE.dtype)
    out_BxTxKxQxE = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxE)
    return out_BxTxKxQxE.reshape(b, t, h, d)


def _pallas(*args, scale, softcap, window, contiguous=False, shared_prefix=False):
    # the kernels skip masked blocks from the positions and segments themselves
    del contiguous, shared_prefix
    interpret = platform.backend() != "gpu"
    return flash_attention(*args, scale=scale, softcap=softcap, window=window,
                           interpret=interpret)


def _cudnn_unsupported(q_BxTxHxE: jax.Array, k_BxSxKxE: jax.Array, softcap: float | None,
                       contiguous: bool) -> str:
    """Why cuDNN cannot run this call ('' when it can)."""
    d = q_BxTxHxE.shape[-1]
    if softcap is not None:
        return "a logit soft-cap (cuDNN has none)"
    if not contiguous or q_BxTxHxE.shape[1] != k_BxSxKxE.shape[1]:
        return "a KV cache (cuDNN's mask is index based)"
    if q_BxTxHxE.dtype not in (jnp.bfloat16, jnp.float16):
        return f"{q_BxTxHxE.dtype} inputs (cuDNN takes fp16/bf16)"
    if d % 8 or d > 256:
        return f"head width {d} (cuDNN takes multiples of 8 up to 256)"
    return ""


def _cudnn(q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, q_pos_BxT, q_seg_BxT, kv_pos_BxS, kv_seg_BxS, *,
           scale, softcap, window, contiguous=True, shared_prefix=False):
    # No soft-cap here (see _cudnn_unsupported). Causality is by index (contiguous: a
    # visible key never follows its query, shared prefixes included); the segments, and
    # with shared prefixes the window (by position: a prefix key's index distance is not
    # its position distance), reach cuDNN as the dense mask.
    del softcap, contiguous
    same_BxTxS = visible_segments(q_seg_BxT[:, :, None], kv_seg_BxS[:, None, :])
    local = None if window is None else (window - 1, 0)
    if shared_prefix and window is not None:
        same_BxTxS &= q_pos_BxT[:, :, None] - kv_pos_BxS[:, None, :] < window
        local = None
    out_BxTxHxE = jax.nn.dot_product_attention(
        q_BxTxHxE, k_BxSxKxE, v_BxSxKxE, mask=same_BxTxS[:, None], scale=scale,
        is_causal=True, local_window_size=local, implementation="cudnn")
    # cuDNN leaves queries without a visible key undefined; the reference returns zeros.
    seen_BxT = q_seg_BxT != 0
    return jnp.where(seen_BxT[:, :, None, None], out_BxTxHxE, 0).astype(q_BxTxHxE.dtype)


_IMPLEMENTATIONS: dict[str, Callable[..., jax.Array]] = {
    "xla": _xla, "cudnn": _cudnn, "pallas": _pallas}


def paged_attention(q_BxHxE: jax.Array, k_BxKxE: jax.Array, v_BxKxE: jax.Array,
                    k_pool: jax.Array, v_pool: jax.Array, layer: jax.Array,
                    table_BxI: jax.Array, lengths_B: jax.Array, live: jax.Array, *,
                    scale: float, softcap: float | None = None, window: int | None = None,
                    implementation: str = "xla", shards: Shards | None = None
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One decode step over a paged KV pool (`paged_attention.py`: layout and mask): writes
    each row's new key and value at its position, then attends to the row's tokens up to
    it. Returns (B x H x E, the key pool, the value pool). `xla` runs the jnp reference;
    `pallas` (and `cudnn`, which has no paged form) the Pallas kernel of
    `pallas_paged.py`, whose programs read only their own row's blocks (with `shards`,
    each device its own rows' pool shard: the pool's axis 0 is split like the rows)."""
    k_pool = paged_write(k_pool, layer, k_BxKxE, table_BxI, lengths_B)
    v_pool = paged_write(v_pool, layer, v_BxKxE, table_BxI, lengths_B)
    args = (q_BxHxE, k_pool, v_pool, layer, table_BxI, lengths_B, live)
    if implementation in ("pallas", "cudnn"):
        fn = functools.partial(paged_pallas, scale=scale, softcap=softcap, window=window,
                               interpret=platform.backend() != "gpu")
        if shards is None:
            out_BxHxE = fn(*args)
        else:
            q, pool, rows = shards.spec(3, heads=1), shards.spec(6, heads=4), shards.spec(1)
            out_BxHxE = shards.run(fn, (q, pool, pool, P(), shards.spec(2), rows, P()), q, *args)
    else:
        out_BxHxE = paged_decode_attention(*args, scale=scale, softcap=softcap, window=window)
    return out_BxHxE, k_pool, v_pool
