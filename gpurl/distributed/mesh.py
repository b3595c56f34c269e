"""Trainer mesh and placement.

Only this package calls `jax.devices()` or builds a `Mesh` (`job_devices()`: JAX's, or the
compile-only GPUs of `gpurl.plan.targets` inside `using_devices`). Rules come from
`mesh.train_rules`: a logical axis maps to one or more mesh axes
(`gpurl.models.axes`, which `Rules`, `logical_spec` and `tree_shardings` here re-export).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gpurl.config import ConfigError, MeshConfig
from gpurl.models.axes import Rules, logical_spec, tree_shardings

__all__ = ["Rules", "logical_spec", "tree_shardings"]  # re-exported: imported from here too

TRAIN_AXES = ("data", "fsdp", "context", "expert", "tp")

_DEVICES: contextvars.ContextVar[list[jax.Device] | None] = contextvars.ContextVar(
    "devices", default=None)


def job_devices() -> list[jax.Device]:
    """Every device of the job: JAX's, or those `using_devices` names."""
    return _DEVICES.get() or list(jax.devices())


@contextlib.contextmanager
def using_devices(chosen: list[jax.Device]) -> Iterator[None]:
    """Meshes built inside this block use `chosen` (compile-only devices of a GPU this
    machine does not have: `gpurl plan plan.target=...`)."""
    token = _DEVICES.set(chosen)
    try:
        yield
    finally:
        _DEVICES.reset(token)


def mesh_sizes(cfg: MeshConfig, count: int) -> dict[str, int]:
    """{axis: size} of the trainer mesh over `count` devices: one size may be -1 to take
    what is left (mesh.context=auto, unresolved: 1)."""
    sizes = [cfg.data, cfg.fsdp, cfg.context_width or 1, cfg.expert, cfg.tp]
    fixed = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if count % fixed:
            raise ConfigError(
                f"mesh sizes data={cfg.data} fsdp={cfg.fsdp} context={cfg.context} "
                f"expert={cfg.expert} tp={cfg.tp} do not fit "
                f"{count} devices; make the fixed sizes divide the device count.")
        sizes[sizes.index(-1)] = count // fixed
    if math.prod(sizes) != count:
        raise ConfigError(
            f"mesh.data*mesh.fsdp*mesh.context*mesh.expert*mesh.tp = {math.prod(sizes)} but there "
            f"are {count} "
            f"devices; choose sizes whose product is {count} (or set one to -1).")
    return dict(zip(TRAIN_AXES, sizes))


def trainer_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """(data, fsdp, context, expert, tp) mesh over all devices (`mesh_sizes`)."""
    devices = job_devices() if devices is None else list(devices)
    sizes = mesh_sizes(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(list(sizes.values())), TRAIN_AXES)


def rollout_shards(cfg: MeshConfig, count: int) -> int:
    """Model replicas (the rollout mesh's data axis) over `count` rollout devices."""
    tp = cfg.rollout_width or 1
    if count % tp:
        raise ConfigError(
            f"mesh.rollout_tp={tp} does not divide the {count} rollout "
            f"devices; choose a divisor of {count}.")
    return count // tp


def rollout_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """(data, tp) mesh for generation: `mesh.rollout_tp` devices per model replica (auto,
    unresolved: 1; a run resolves it for its model, `gpurl.distributed.layout`)."""
    devices = job_devices() if devices is None else list(devices)
    shards = rollout_shards(cfg, len(devices))
    return Mesh(np.asarray(devices).reshape(shards, -1), ("data", "tp"))


def rollout_per_process(cfg: MeshConfig, local_counts: Sequence[int]) -> int:
    """Split placement: how many of each process's devices (`local_counts`) sample; the
    rest train."""
    count, total = len(local_counts), sum(local_counts)
    if total < 2:
        raise ConfigError(f"mesh.placement=split samples and trains on devices of their own, "
                          f"and this job has {total} device; use mesh.placement=colocated.")
    if not 0 < cfg.rollout_devices < total or cfg.rollout_devices % count:
        raise ConfigError(
            f"mesh.placement=split needs mesh.rollout_devices between 1 and {total - 1} and a "
            f"multiple of the {count} processes (got {cfg.rollout_devices}); set "
            f"mesh.rollout_devices, e.g. mesh.rollout_devices={max(total // 2 // count, 1) * count}.")
    per = cfg.rollout_devices // count
    for p, local in enumerate(local_counts):
        if local <= per:
            raise ConfigError(
                f"process {p} has {local} devices, so it cannot give {per} to rollout and "
                f"keep one for training; lower mesh.rollout_devices or use mesh.placement=colocated.")
    return per


def placement_devices(cfg: MeshConfig) -> tuple[list[jax.Device], list[jax.Device]]:
    """(trainer devices, rollout devices). Colocated: both are every device. Split: each
    process gives its first `mesh.rollout_devices / processes` local devices to rollout and
    the rest to training, so every process samples its own rows and trains on its own
    rows (no process waits on another's host for data)."""
    devices = job_devices()
    if cfg.placement == "colocated":
        return devices, devices
    processes = sorted({d.process_index for d in devices})
    local = [sorted((d for d in devices if d.process_index == p), key=lambda d: d.id)
             for p in processes]
    per = rollout_per_process(cfg, [len(ds) for ds in local])
    rollout, train = [], []
    for ds in local:
        rollout += ds[:per]
        train += ds[per:]
    return train, rollout


def held_bytes(abstract: Any) -> float:
    """Bytes one device holds of a tree of `jax.ShapeDtypeStruct`s laid out by their own
    shardings (the largest shard where shards differ)."""
    return float(sum(math.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                     for x in jax.tree.leaves(abstract)))


def shard_bytes(abstract: Any, shardings: Any) -> int:
    """Bytes one device holds of a tree of arrays laid out by `shardings` (the largest
    shard where shards differ)."""
    total = 0
    for x, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        total += math.prod(s.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
    return total


def abstract(tree: Any, shardings: Any) -> Any:
    """`tree`'s shapes and dtypes with `shardings`, as arguments to lower a program with."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        tree, shardings)


def sharded(batch: Any, sharding: Any) -> Any:
    """A batch's shapes and dtypes (a dict or another tree of arrays), every array laid
    out by `sharding`."""
    return jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding), batch)


def batch_sharding(mesh: Mesh, rules: Rules) -> NamedSharding:
    """Rows of a batch are split over the `batch` rule's axes (data and fsdp)."""
    axes = tuple(a for a in rules.get("batch", ()) if mesh.shape[a] > 1)
    return NamedSharding(mesh, P(axes if axes else None))


def packed_spec(batch: NamedSharding) -> P:
    """The spec of packed rows' arrays (rows x tokens, or rows x context blocks): rows
    like `batch`, tokens over the context axis when the mesh has one."""
    rows = batch.spec[0] if batch.spec else None
    if batch.mesh.shape.get("context", 1) > 1:
        return P(rows, "context")
    return P(rows)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_divisor(mesh: Mesh, rules: Rules) -> int:
    """Number of shards a batch is split into: batch sizes must be multiples of it."""
    return batch_shards(mesh.shape, rules)


def batch_shards(shape: Mapping[str, int], rules: Rules) -> int:
    """`batch_divisor` of a mesh of axis sizes `shape`."""
    return math.prod(shape[a] for a in rules.get("batch", ()))
