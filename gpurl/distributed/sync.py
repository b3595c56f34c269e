"""Weight sync: trainer parameters -> the rollout's copy, in the rollout's layout and
dtypes (the compute dtype: bf16 on GPU, cast here once per step, never inside a decode
loop; `gpurl.models.spec.ModelSpec.serving_params`).

Colocated placement: the rollout mesh holds the same devices, so this is one program that
casts and lays out (a `device_put`, a no-op, for a leaf already in the rollout's dtype and
layout: it shares the trainer's buffer). Split placement: the trainer first gathers each
parameter to a full copy on its devices, cast (a collective inside the trainer mesh, so
fsdp and tp shards spanning processes are handled there, moving half the bytes in bf16),
then every process copies its local full copy onto its own rollout devices, slicing where
the rollout layout is sharded (rollout tp). A rollout whose layers run unrolled holds each
stacked parameter as one array per layer (`ModelSpec.serving_params`), split here. `placement_devices` gives every process both trainer and rollout
devices, so no parameter crosses a host boundary outside the trainer's own collective.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from gpurl.distributed.mesh import shard_bytes
from gpurl.models import lora


class WeightSync:
    """`rollout` is the rollout's parameters, abstract (`jax.ShapeDtypeStruct` leaves with
    their dtype and sharding; a tuple of them where a stacked parameter is held layer by
    layer). `static` (bools over the parameters; default: a LoRA run's frozen base, see
    `gpurl.models.lora.frozen_base`) marks parameters that never change: they are moved
    once and reused, so a LoRA run sends only its adapters after the first sync."""

    def __init__(self, trainer_shardings: Any, rollout: Any, static: Any = None):
        self._train_sh, treedef = jax.tree.flatten(trainer_shardings)
        self.targets = treedef.flatten_up_to(rollout)  # per trainer leaf: abstract, or a tuple
        first = jax.tree.leaves(rollout)[0].sharding
        self.colocated = set(self._train_sh[0].device_set) == set(first.device_set)
        static = lora.frozen_base(trainer_shardings) if static is None else static
        self._static = jax.tree.leaves(static)
        self._moved: list[Any] | None = None  # rollout copies of the static leaves
        self._programs: dict[tuple[int, ...], Any] = {}

    def shares(self, leaf: Any, i: int) -> bool:
        """Whether trainer leaf `i` (array or abstract) is already the rollout's: colocated,
        in the rollout's dtype and layout, not split into layers (its buffer is shared)."""
        target = self.targets[i]
        return (self.colocated and not isinstance(target, tuple) and leaf.dtype == target.dtype
                and self._train_sh[i].is_equivalent_to(target.sharding, len(leaf.shape)))

    def held_bytes(self, abstract_params: Any) -> tuple[float, float]:
        """(bytes per device of the rollout's parameters that are a copy, bytes that share
        the trainer's buffers), for the trainer's parameters `abstract_params`: colocated
        leaves already in the rollout's dtype and layout are not copied."""
        copy = alias = 0.0
        for i, (x, target) in enumerate(zip(jax.tree.leaves(abstract_params), self.targets)):
            parts = list(target) if isinstance(target, tuple) else [target]
            nbytes = shard_bytes(parts, [a.sharding for a in parts])
            if self.shares(x, i):
                alias += nbytes
            else:
                copy += nbytes
        return copy, alias

    def __call__(self, params: Any) -> Any:
        leaves, treedef = jax.tree.flatten(params)
        moving = [i for i, st in enumerate(self._static) if not (st and self._moved)]
        if self.colocated:
            put = [i for i in moving if not isinstance(self.targets[i], tuple)
                   and leaves[i].dtype == self.targets[i].dtype]  # laid out (a no-op if so)
            work = tuple(i for i in moving if i not in put)
            out = dict(zip(put, jax.device_put([leaves[i] for i in put],
                                               [self.targets[i].sharding for i in put])))
            if work:
                out.update(zip(work, self._program(work)([leaves[i] for i in work])))
        else:
            idx = tuple(moving)
            gathered = self._program(idx)([leaves[i] for i in idx])
            out = {i: self._move(full, self.targets[i]) for i, full in zip(idx, gathered)}
        if self._moved is None and any(self._static):
            # A colocated leaf already in the rollout's dtype and layout shares its buffer
            # with the trainer's, which the next train step donates: it is put again every
            # call (a no-op), never cached.
            self._static = [st and not self.shares(leaves[i], i) for i, st in enumerate(self._static)]
            self._moved = [out[i] if st else None for i, st in enumerate(self._static)]
        elif self._moved:
            out.update({i: m for i, m in enumerate(self._moved) if self._static[i]})
        return jax.tree.unflatten(treedef, [out[i] for i in range(len(leaves))])

    def _program(self, idx: tuple[int, ...]) -> Any:
        """The program casting leaves `idx` to the rollout's dtypes: colocated, straight into
        the rollout's layout (split into layers where it holds them apart); split, gathered
        whole on the trainer's devices (`_move` then copies them across)."""
        if idx not in self._programs:
            targets = [self.targets[i] for i in idx]
            dtype = [(t[0] if isinstance(t, tuple) else t).dtype for t in targets]

            def cast(xs: list) -> list:
                return [tuple(x[j].astype(d) for j in range(len(t))) if self.colocated
                        and isinstance(t, tuple) else x.astype(d)
                        for x, t, d in zip(xs, targets, dtype)]
            out = ([jax.tree.map(lambda a: a.sharding, t) for t in targets] if self.colocated
                   else [NamedSharding(self._train_sh[i].mesh, P()) for i in idx])
            self._programs[idx] = jax.jit(cast, in_shardings=([self._train_sh[i] for i in idx],),
                                          out_shardings=out)
        return self._programs[idx]

    @staticmethod
    def _move(full: jax.Array, target: Any) -> Any:
        """A whole copy on this host's trainer devices onto the rollout's devices (one
        array per layer where the rollout holds them apart)."""
        local = full.addressable_shards[0].data  # a whole copy on one of this host's devices
        if isinstance(target, tuple):
            return tuple(_place(local[j], t.sharding) for j, t in enumerate(target))
        return _place(local, target.sharding)


def _place(local: jax.Array, target: NamedSharding) -> jax.Array:
    """An array whole on one device, laid out by `target` over this host's devices."""
    buffers = [jax.device_put(local[index], device)
               for device, index in target.addressable_devices_indices_map(local.shape).items()]
    return jax.make_array_from_single_device_arrays(local.shape, target, buffers)
