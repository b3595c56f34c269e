"""Every host-side collective and every host <-> device transfer of rows, in one place.

- `gather` / `gather_ints` / `any_process`: small integers agreed between processes, host
  to host through the job's coordinator (never a device program; see `gather`);
  `gather_text`: every process's text (a checkpoint's per-process state).
- `to_device`: this process's rows of a row-sharded array, from the host.
- `local_rows` / `local`: the rows of a row-sharded array this process addresses, to the
  host (no collective).
- `to_host`: a whole small array on every process's host (a collective).

`counts` tallies each kind of call, so a test can count the round trips a code path
makes (the rollout engine agrees once per scheduling iteration; a round's tokens go to
the device once). The one gather outside this module is the HF exporter's
(`gpurl.models.hf_export.host`): the models layer sits below this one.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Sequence

import jax
import numpy as np
from jax._src import distributed
from jax.experimental import multihost_utils
from jax.sharding import Sharding

# How long an agreement waits for the slowest process (one compiling a large program).
AGREE_TIMEOUT_MS = 3_600_000
TEXT_PART = 1 << 20  # characters per key-value entry of `gather_text`
_agreements = itertools.count()

# calls per kind: "gather" (host agreements), "to_device", "to_host" (collective fetches),
# "local" (fetches of this process's rows)
counts: Counter[str] = Counter()


def gather(values: Sequence[int]) -> np.ndarray:
    """Every process's `values` (the same count everywhere), processes x values int64, in
    process order: a collective, every process calls it at the same point; free with one
    process.

    Host to host through the coordinator's key-value store, never a device program: on
    CPUs, gloo matches the collectives of programs that run at the same time on disjoint
    devices (the rollout's and the trainer's under mesh.placement=split) by their order
    only, so an agreement sent as a device all-gather while a train step's all-gathers
    run could meet the peer's other collective. A peer that dies ends the job through the
    coordinator's heartbeats, not through this wait."""
    values = [int(v) for v in values]
    counts["gather"] += 1
    if jax.process_count() == 1:
        return np.asarray([values], np.int64).reshape(1, len(values))
    client = distributed.global_state.client
    n, me = next(_agreements), jax.process_index()
    client.key_value_set(f"gpurl/agree/{n}/{me}", ",".join(map(str, values)))
    rows = [client.blocking_key_value_get(f"gpurl/agree/{n}/{p}", AGREE_TIMEOUT_MS)
            for p in range(jax.process_count())]
    if n:  # every process has read agreement n - 1 (it set its key of n after that)
        client.key_value_delete(f"gpurl/agree/{n - 1}/{me}")
    return np.asarray([[int(x) for x in row.split(",")] if row else [] for row in rows],
                      np.int64).reshape(len(rows), len(values))


def gather_text(text: str) -> list[str]:
    """Every process's `text`, in process order (a collective, as `gather`), sent in parts
    of at most `TEXT_PART` characters."""
    counts["gather"] += 1
    if jax.process_count() == 1:
        return [text]
    client = distributed.global_state.client
    n, me = next(_agreements), jax.process_index()
    parts = [text[i:i + TEXT_PART] for i in range(0, len(text), TEXT_PART)] or [""]
    for i, part in enumerate(parts):
        client.key_value_set(f"gpurl/text/{n}/{me}/{i + 1}", part)
    client.key_value_set(f"gpurl/text/{n}/{me}/0", str(len(parts)))
    out = []
    for p in range(jax.process_count()):
        count = int(client.blocking_key_value_get(f"gpurl/text/{n}/{p}/0", AGREE_TIMEOUT_MS))
        out.append("".join(client.blocking_key_value_get(f"gpurl/text/{n}/{p}/{i + 1}",
                                                         AGREE_TIMEOUT_MS) for i in range(count)))
    return out


def gather_ints(value: int) -> list[int]:
    """Every process's `value`, in process order (`gather`)."""
    return [int(x) for x in gather([value])[:, 0]]


def any_process(flag: bool) -> bool:
    """True when `flag` is set in any process (`gather`); free with one process."""
    return bool(gather([int(bool(flag))]).any())


def to_device(local: np.ndarray, sharding: Sharding) -> jax.Array:
    """The global array whose rows on this process are `local` (every process passes its
    own rows, in process order). Where `sharding` does not split rows by process (a mesh
    whose row axes do not span the processes: a tensor or context axis across them), every
    process's devices need other processes' rows too, so the rows are gathered first (a
    host collective); without that each process would take its own rows for all of them."""
    counts["to_device"] += 1
    if jax.process_count() > 1 and not _rows_by_process(sharding, local.shape[0]):
        whole = np.asarray(multihost_utils.process_allgather(local, tiled=True))
        return jax.make_array_from_callback(whole.shape, sharding, lambda idx: whole[idx])
    return jax.make_array_from_process_local_data(sharding, local)


def _rows_by_process(sharding: Sharding, rows: int) -> bool:
    """Whether this process's devices hold exactly rows [p x rows, (p + 1) x rows) of the
    global array (`rows` per process, every process the same)."""
    total = rows * jax.process_count()
    start = jax.process_index() * rows
    held = set()
    for index in sharding.addressable_devices_indices_map((total,)).values():
        row = index[0]
        held.update(range(row.start or 0, total if row.stop is None else row.stop))
    return held == set(range(start, start + rows))


def local_rows(array: jax.Array) -> list[tuple[int, np.ndarray]]:
    """(first global row, rows) of each distinct shard this process holds (tp replicas
    once), on the host."""
    counts["local"] += 1
    seen: dict[int, np.ndarray] = {}
    for shard in array.addressable_shards:
        start = shard.index[0].start or 0
        if start not in seen:
            seen[start] = np.asarray(shard.data)
    return sorted(seen.items())


def local(array: jax.Array) -> np.ndarray:
    """This process's rows of a row-sharded array, in order, on the host."""
    return np.concatenate([rows for _, rows in local_rows(array)])


def to_host(x: jax.Array) -> np.ndarray:
    """The whole (small) array on every process's host; a collective when another process
    holds part of it."""
    counts["to_host"] += 1
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
