"""Packed rows for the RL step: every group's prompt once per row, its completions after it,
no completion padding, and micro-batches sized by tokens.

A batch of P prompts with G completions each (the grouped layout: prompts P x W,
completions P x G x N) becomes B rows of Z slots. A group in a row is its prompt's first
plen - 1 tokens (the shared prefix, segment id k x BRANCHES for the row's k-th group) and
then one branch per completion (segment k x BRANCHES + j): the prompt's last token and
the completion's tokens, positions continuing the prompt (plen - 1, plen, ...). The
attention rule of `gpurl.kernels.segments` lets every branch see its group's prefix and
itself, so each branch computes exactly what the padded forward computes for that
completion, and the prefix is computed once for all the group's branches in the row. (The
prompt's last token is repeated in each branch, one token per completion, so that every
branch's first state predicts its first token without a state shared across branches.)

Rows are filled by first-fit decreasing over whole groups: groups in order of size (prefix
plus branches), each into the first row with room, a new row when none has it. A group
longer than a row (or of `BRANCHES` completions or more) is split into chunks of
branches, each behind its own copy of the prefix; a single branch longer than a row makes
the rows longer (the row length is chosen per batch, never refused). The row length Z,
at least the longest branch with its prefix (`row_length`: a power of two, or a multiple
of `ROW_STEP` for long rows), minimizes the estimated work (slots, plus attention's share
that grows with Z, `_cost`); the rows per micro-batch and per data shard come from the
token budget (`micro_layout`), rounded up to `bucket` values, so the distinct (B, Z)
shapes a run compiles stay few.

With a context axis (`mesh.context` = C > 1) every row's slots are split over C devices
in `balanced_order`, and the head and the completions' columns say where each state sits
(`Plan`); the token budget then counts each device's share of a row, Z / C.

Only integers are planned here, on the host, from the lengths; `gather` builds the packed
arrays on device from the grouped batch (`gpurl.algorithms.forward` runs the model on them).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.buckets import three_bits as bucket  # noqa: F401 - re-exported
from gpurl.data.rollouts import RolloutBatch
from gpurl.distributed import host
from gpurl.kernels.segments import BRANCHES

ROW_MIN = 64  # the shortest row length
ROW_STEP = 4096  # longer rows are multiples of it (2 x mesh.context divides it)
LENGTHS = 4  # row lengths tried per batch: the smallest that fits, x2, x4, x8


def micro_layout(rows: int, length: int, budget: int, shards: int,
                 context: int = 1) -> tuple[int, int]:
    """(rows per micro-batch per shard r, micro-batches M) for `rows` packed rows of
    `length` slots over `shards` batch shards, each row's slots split over `context`
    devices, with at most `budget` tokens per micro-batch and device: M = ceil(rows /
    (shards x r_max)) for r_max = budget // (length / context) (at least 1), and r the
    bucketed share of each micro-batch, at most r_max. `num_micro` recovers M from the
    shapes."""
    r_max = max(budget * context // length, 1)
    per_shard = -(-max(rows, 1) // shards)
    m = -(-per_shard // r_max)
    r = min(bucket(-(-per_shard // m)), r_max)
    return r, -(-per_shard // r)


def num_micro(rows: int, length: int, budget: int, shards: int, context: int = 1) -> int:
    """The micro-batches of a packed batch of `rows` x `length` (`micro_layout`'s M),
    from its shapes: the train step's static count."""
    return -(-rows // (shards * max(budget * context // length, 1)))


@dataclass(frozen=True)
class Plan:
    """Where every token of a grouped batch sits in B packed rows of Z slots (numpy).

    Slot arrays are in the rows' stored order, `balanced_order(Z, C)` of the natural
    (causal) order: device c of the context axis holds slots [c Z/C, (c+1) Z/C). The head
    is C blocks of H slots per row, block c listing device c's slots (indices into its
    own Z/C) that predict a completion token."""

    source: np.ndarray  # B x Z int32: index into [prompts P*W flat, completions P*G*N flat]; -1 empty
    positions: np.ndarray  # B x Z int32
    segments: np.ndarray  # B x Z int32: 0 empty, group x BRANCHES (+ branch)
    head: np.ndarray  # B x C x H int32: per context block, its predicting slots (local indices)
    head_source: np.ndarray  # B x C x H int32: `source` of the token each head slot predicts; -1 none
    row: np.ndarray  # P x G int32: each completion's row
    state_cols: np.ndarray  # P x G x (N+1) int32: the slots of its states s_0..s_n (0 past n)
    head_cols: np.ndarray  # P x G x N int32: the head columns (of C x H) predicting its tokens (0 past n)
    num_micro: int  # M: micro-batches (rows q go to micro-batch q % M)
    context: int = 1  # C: devices each row's slots are split over

    @property
    def shape(self) -> tuple[int, int]:
        return self.source.shape


def balanced_order(length: int, context: int) -> np.ndarray:
    """The stored order of a row's `length` slots split over `context` devices: the
    natural slot each stored slot holds. The row is cut into 2C equal chunks and device c
    holds chunks c and 2C - 1 - c, so each device has the same share of causal attention's
    work (a late chunk's queries see many keys, an early one's few), as in Llama 3's
    context parallelism (Dubey et al. 2024, section 3.3.2). C = 1: the natural order."""
    if context == 1:
        return np.arange(length)
    if length % (2 * context):  # ROW_MIN and ROW_STEP are multiples of 2 x 32
        raise ValueError(f"a row of {length} slots cannot be split into {2 * context} chunks.")
    c = length // (2 * context)
    return np.concatenate([np.r_[k * c:(k + 1) * c, (2 * context - 1 - k) * c:(2 * context - k) * c]
                           for k in range(context)])


def split_token_rows(rows: dict[str, np.ndarray], context: int,
                     pad_id: int = 0) -> dict[str, np.ndarray]:
    """SFT's token rows (tokens, positions, segment_ids, loss_mask: B x T) laid out for a
    context axis of `context` devices: T padded to a multiple of 2C (segment 0), every
    array in `balanced_order`, and the targets the states predict given explicitly (the
    next token in the natural order is no longer the next slot): `targets` and
    `target_mask` (loss_mask of the next token), B x C x T/C, each device's block."""
    b, t = rows["tokens"].shape
    width = -(-t // (2 * context)) * 2 * context
    pad = {"tokens": pad_id, "positions": 0, "segment_ids": 0, "loss_mask": 0}
    padded = {k: np.pad(v, ((0, 0), (0, width - t)), constant_values=pad[k])
              for k, v in rows.items()}
    targets = np.concatenate([padded["tokens"][:, 1:], np.full((b, 1), pad_id)], axis=1)
    mask = np.concatenate([padded["loss_mask"][:, 1:], np.zeros((b, 1))], axis=1)
    order = balanced_order(width, context)
    out = {k: padded[k][:, order] for k in ("tokens", "positions", "segment_ids")}
    out["targets"] = targets[:, order].reshape(b, context, -1).astype(rows["tokens"].dtype)
    out["target_mask"] = mask[:, order].reshape(b, context, -1).astype(rows["loss_mask"].dtype)
    return out


def row_length(longest: int) -> int:
    """The shortest row length that holds `longest` slots: a power of two >= ROW_MIN up
    to `ROW_STEP`, a multiple of it beyond (a 64K-token completion after a 512-token
    prompt takes 69,632 slots, not 131,072: at long contexts a power of two would leave
    up to half of every row empty)."""
    if longest > ROW_STEP:
        return -(-longest // ROW_STEP) * ROW_STEP
    return max(ROW_MIN, 1 << (longest - 1).bit_length())


def attention_cost(d_model: int) -> float:
    """`plan`'s attention_cost of a model of width `d_model`."""
    return 1.0 / (12 * d_model)


def default_budget(micro_groups: int, group: int, width: int, shards: int) -> int:
    """train.micro_batch_tokens=0: the tokens one padded micro-batch holds per shard
    (`micro_groups` prompts x `group` completions x `width` = prompt + completion slots)."""
    return max(micro_groups * group * width // shards, 1)


def _group_sizes(plen_P: np.ndarray, clen_PxG: np.ndarray) -> np.ndarray:
    return plen_P - 1 + (clen_PxG + 1).sum(1)


def _chunks(plen_P: np.ndarray, clen_PxG: np.ndarray, length: int) -> list[tuple[int, list[int]]]:
    """(prompt, its completions) items of at most `length` slots and BRANCHES - 1
    completions: whole groups, and groups too long (or of BRANCHES completions or more,
    whose branch ids would reach the next group's prefix) split into consecutive branches
    behind their own prefix."""
    items = []
    for p in range(len(plen_P)):
        prefix, branches = int(plen_P[p]) - 1, []
        used = prefix
        for g, c in enumerate(clen_PxG[p]):
            if branches and (used + c + 1 > length or len(branches) == BRANCHES - 1):
                items.append((p, branches))
                branches, used = [], prefix
            branches.append(g)
            used += int(c) + 1
        items.append((p, branches))
    return items


def _first_fit(sizes: np.ndarray, length: int) -> np.ndarray:
    """First-fit decreasing: the row of each item (sizes <= length), rows opened in order."""
    order = np.argsort(-sizes, kind="stable")
    free = np.zeros(len(sizes), np.int64)
    opened, row_of = 0, np.zeros(len(sizes), np.int64)
    for i in order:
        fits = np.flatnonzero(free[:opened] >= sizes[i])
        r = int(fits[0]) if len(fits) else opened
        if r == opened:
            free[opened], opened = length, opened + 1
        free[r] -= sizes[i]
        row_of[i] = r
    return row_of


def _cost(slots: int, length: int, attention_cost: float) -> float:
    return slots * (1.0 + attention_cost * length)


def plan(prompt_lengths_P: np.ndarray, completion_lengths_PxG: np.ndarray, width: int,
         completion_width: int, budget: int, shards: int, attention_cost: float = 0.0,
         whole_groups: bool = False, context: int = 1) -> Plan:
    """The packed layout of a grouped batch (prompts `width` wide, completions
    `completion_width`) for `shards` batch shards and `budget` tokens per micro-batch and
    device, each row split over `context` devices (`balanced_order`). `attention_cost`:
    attention's work per slot and unit of row length relative to the rest of a slot's
    work (`attention_cost(d_model)`, 1 / (12 d_model): Z/2 keys x 4 H E flops against
    ~24 d_model^2), which the row length's choice weighs. `whole_groups`: rows at least
    as long as the longest group, so no group (of fewer than BRANCHES completions) is
    split (a loss over a whole group, such as a preference pair's, then sees all of it in
    one micro-batch)."""
    plen_P = np.asarray(prompt_lengths_P, np.int64)
    clen_PxG = np.asarray(completion_lengths_PxG, np.int64)
    p, g = clen_PxG.shape
    longest = int(_group_sizes(plen_P, clen_PxG).max() if whole_groups
                  else (plen_P[:, None] + clen_PxG).max())
    best = None
    for k in range(LENGTHS):
        length = row_length(longest) << k
        items = _chunks(plen_P, clen_PxG, length)
        sizes = np.array([plen_P[q] - 1 + sum(int(clen_PxG[q, j]) + 1 for j in b) for q, b in items])
        row_of = _first_fit(sizes, length)
        r, m = micro_layout(int(row_of.max()) + 1, length, budget, shards, context)
        cost = _cost(shards * r * m * length, length, attention_cost)
        if best is None or cost < best[0]:
            best = (cost, length, items, row_of, r, m)
    _, length, items, row_of, r, m = best
    rows = shards * r * m
    # FFD rows (fullest first) dealt round-robin to the shards, and within a shard to
    # micro-batches (local row l -> micro-batch l % M): tokens spread evenly over both.
    per_shard = rows // shards
    slot_of = np.array([(i % shards) * per_shard + i // shards for i in range(rows)])
    source = np.full((rows, length), -1, np.int32)
    positions = np.zeros((rows, length), np.int32)
    segments = np.zeros((rows, length), np.int32)
    row_PxG = np.zeros((p, g), np.int32)
    start_PxG = np.zeros((p, g), np.int64)  # natural slot of each completion's s_0
    used = np.zeros(rows, np.int64)
    groups = np.zeros(rows, np.int64)
    predicting = np.zeros((rows, length), bool)  # natural slots whose state predicts a token
    comp0 = p * width
    for (q, branches), ffd_row in sorted(zip(items, row_of), key=lambda x: (x[1], x[0][0])):
        row = int(slot_of[ffd_row])
        groups[row] += 1
        seg = int(groups[row]) * BRANCHES
        prefix = int(plen_P[q]) - 1
        at = int(used[row])
        source[row, at:at + prefix] = q * width + np.arange(prefix)
        positions[row, at:at + prefix] = np.arange(prefix)
        segments[row, at:at + prefix] = seg
        at += prefix
        for j, c in enumerate(branches, start=1):
            n = int(clen_PxG[q, c])
            source[row, at] = q * width + prefix
            source[row, at + 1:at + 1 + n] = comp0 + (q * g + c) * completion_width + np.arange(n)
            positions[row, at:at + n + 1] = prefix + np.arange(n + 1)
            segments[row, at:at + n + 1] = seg + j
            row_PxG[q, c], start_PxG[q, c] = row, at
            predicting[row, at:at + n] = True
            at += n + 1
        used[row] = at
    return _stored(source, positions, segments, predicting, row_PxG, start_PxG, clen_PxG,
                   completion_width, m, context)


def plan_grouped(batch: RolloutBatch, lengths_PxG1: np.ndarray | None, budget: int,
                 shards: int, d_model: int, context: int = 1) -> Plan:
    """`plan` of an RL step's rollout batch from its prompt and completion lengths
    (P x (1 + G), the same on every process; None: fetched from the batch's arrays),
    attention weighed for `d_model`."""
    if lengths_PxG1 is None:
        lengths_PxG1 = host.to_host(jnp.concatenate([batch.prompt_lengths[:, None],
                                                     batch.completion_lengths], axis=1))
    return plan(lengths_PxG1[:, 0], lengths_PxG1[:, 1:], batch.prompt_tokens.shape[1],
                batch.completions.shape[2], budget, shards, attention_cost(d_model),
                context=context)


def _stored(source: np.ndarray, positions: np.ndarray, segments: np.ndarray,
            predicting: np.ndarray, row_PxG: np.ndarray, start_PxG: np.ndarray,
            clen_PxG: np.ndarray, n: int, num_micro: int, context: int) -> Plan:
    """The plan of rows laid out in natural order, in the stored order of `context`
    devices (`balanced_order`), with each context block's head and the completions'
    state and head columns."""
    rows, length = source.shape
    order = balanced_order(length, context)
    stored_of = np.argsort(order)  # natural slot -> stored slot
    local = length // context
    # the head: each block's predicting slots, in natural order, as local indices
    r_idx, nat = np.nonzero(predicting)
    block, at = np.divmod(stored_of[nat], local)
    key = r_idx * context + block
    by = np.lexsort((nat, key))  # by (row, block), natural order inside
    r_idx, nat, block, at, key = r_idx[by], nat[by], block[by], at[by], key[by]
    rank = np.arange(len(key)) - np.searchsorted(key, key, side="left")
    quarter = max(local // 4, 1)  # a block's head: a multiple of a quarter of its slots
    h = -(-max(int(rank.max()) + 1 if len(rank) else 1, 1) // quarter) * quarter
    col = block * h + rank
    head = np.zeros((rows, context * h), np.int32)
    head_source = np.full((rows, context * h), -1, np.int32)
    head[r_idx, col] = at
    head_source[r_idx, col] = source[r_idx, nat + 1]
    col_of = np.zeros((rows, length), np.int64)
    col_of[r_idx, nat] = col
    # s_0..s_n of each completion: natural slots start..start+n
    j = np.arange(n + 1)
    live = j <= clen_PxG[..., None]
    nat_PxGxN1 = np.where(live, start_PxG[..., None] + j, 0)
    state_cols = np.where(live, stored_of[np.minimum(nat_PxGxN1, length - 1)], 0).astype(np.int32)
    head_cols = np.where(j[:n] < clen_PxG[..., None],
                         col_of[row_PxG[..., None], np.minimum(nat_PxGxN1[..., :n], length - 1)],
                         0).astype(np.int32)
    return Plan(source[:, order], positions[:, order], segments[:, order],
                head.reshape(rows, context, h), head_source.reshape(rows, context, h),
                row_PxG, state_cols, head_cols, num_micro, context)


# ---------------------------------------------------------------- on device

PACKED = ("pack/tokens", "pack/positions", "pack/segments", "pack/head", "pack/targets",
          "pack/routes")  # row-leading: split over micro-batches (axis 1: split over context)
INDEX = ("pack/row", "pack/state_cols", "pack/head_cols")  # P x G (x N): each completion's place


def plan_arrays(pl: Plan) -> dict[str, np.ndarray]:
    """The plan's arrays the device needs (`gather` turns `pack/source` into tokens and
    `pack/head_source` into targets)."""
    return {"pack/source": pl.source, "pack/positions": pl.positions,
            "pack/segments": pl.segments, "pack/head": pl.head,
            "pack/head_source": pl.head_source, "pack/row": pl.row,
            "pack/state_cols": pl.state_cols, "pack/head_cols": pl.head_cols}


def put(pl: Plan, sharding: jax.sharding.Sharding) -> dict[str, jax.Array]:
    """The plan's arrays on device, sharded like the batch: every process planned the
    whole batch, so each takes its own shards of it."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
            for k, v in plan_arrays(pl).items()}


def planned_spec(groups: int, group: int, longest: int, completion_width: int, budget: int,
                 shards: int, context: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
    """The plan's arrays for the largest micro-batch the token budget allows at the row
    length of a `longest` group (what the memory plan compiles): `groups` x `group`
    completions of `completion_width` slots, one micro-batch of budget // (length /
    context) rows per shard (no more than the completions), a head as wide as the rows."""
    length = row_length(longest)
    most = -(-groups * group // shards)  # a row per completion at most
    rows = shards * min(max(budget * context // length, 1), most)
    sds = jax.ShapeDtypeStruct
    return {**{k: sds((rows, length), jnp.int32) for k in
               ("pack/source", "pack/positions", "pack/segments")},
            **{k: sds((rows, context, length // context), jnp.int32) for k in
               ("pack/head", "pack/head_source")},
            "pack/row": sds((groups, group), jnp.int32),
            "pack/state_cols": sds((groups, group, completion_width + 1), jnp.int32),
            "pack/head_cols": sds((groups, group, completion_width), jnp.int32)}


def gather(batch: dict[str, jax.Array], pad_id: int) -> dict[str, jax.Array]:
    """The batch with its packed rows: tokens from `pack/source` and the targets the head
    slots predict from `pack/head_source`, and the replayed experts of every completion
    slot (-1: routed afresh, as the padded forward routes prompts)."""
    prompt_PxW, comp_PxGxN = batch["prompt_tokens"], batch["completions"]
    flat = jnp.concatenate([prompt_PxW.reshape(-1), comp_PxGxN.reshape(-1)])

    def tokens(src: jax.Array) -> jax.Array:
        return jnp.where(src >= 0, flat[jnp.maximum(src, 0)], pad_id)

    src_BxZ = batch["pack/source"]
    out = {k: v for k, v in batch.items() if k not in ("pack/source", "pack/head_source")}
    out["pack/tokens"] = tokens(src_BxZ)
    out["pack/targets"] = tokens(batch["pack/head_source"])
    if "routes" in batch:  # P x G x N x L x k -> B x Z x L x k
        routes = batch["routes"]
        flat_routes = routes.reshape(-1, *routes.shape[3:])
        comp_BxZ = src_BxZ - prompt_PxW.size
        picked = flat_routes[jnp.clip(comp_BxZ, 0, flat_routes.shape[0] - 1)]
        out["pack/routes"] = jnp.where((comp_BxZ >= 0)[..., None, None], picked, -1).astype(routes.dtype)
    return out


def is_packed(batch: dict) -> bool:
    return "pack/tokens" in batch


def micro_batches(batch: dict[str, jax.Array], num_micro: int
                  ) -> tuple[dict[str, jax.Array], dict[str, jax.Array]]:
    """(the row-leading packed arrays split M x B/M x ..., micro-batch m taking rows m, m+M,
    ...; everything else, whole) of a packed batch."""
    split = {k: v.reshape(v.shape[0] // num_micro, num_micro, *v.shape[1:]).swapaxes(0, 1)
             for k, v in batch.items() if k in PACKED}
    return split, {k: v for k, v in batch.items() if k not in PACKED}


def micro_batch(rows: dict[str, jax.Array], whole: dict[str, jax.Array], m: jax.Array,
                num_micro: int) -> dict[str, jax.Array]:
    """Micro-batch m of a packed batch: its rows, each completion's row within them (-1
    for the completions of other micro-batches, which `gpurl.algorithms.forward` then
    reads as 0), and those completions masked out of the loss (`comp_mask` 0; a
    preference batch's `pair_mask` too: its groups are whole, `plan(whole_groups=True)`)."""
    out = {**whole, **rows}
    row_PxG = whole["pack/row"]
    here_PxG = (row_PxG % num_micro == m).astype(jnp.float32)
    out["pack/row"] = jnp.where(here_PxG > 0, row_PxG // num_micro, -1)
    out["comp_mask"] = whole["comp_mask"] * here_PxG[..., None]
    if "pair_mask" in whole:
        out["pair_mask"] = whole["pair_mask"] * here_PxG[:, 0]
    return out
