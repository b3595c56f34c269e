"""Weight sync: trainer parameters -> the rollout layout.

Colocated placement: the rollout mesh holds the same devices, so this is one `device_put`
(a no-op when the layouts agree). Split placement: the trainer first gathers each
parameter to a full copy on its devices (a collective inside the trainer mesh, so fsdp
and tp shards spanning processes are handled there), then every process copies its
local full copy onto its own rollout devices, slicing where the rollout layout is
sharded (rollout tp). `placement_devices` gives every process both trainer and rollout
devices, so no parameter crosses a host boundary outside the trainer's own collective.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from gpurl.models import lora


class WeightSync:
    """`static` (bools over the parameters; default: a LoRA run's frozen base, see
    `gpurl.models.lora.frozen_base`) marks parameters that never change: they are moved
    once and reused, so a LoRA run sends only its adapters after the first sync."""

    def __init__(self, trainer_shardings: Any, rollout_shardings: Any, static: Any = None):
        self.targets = rollout_shardings
        first_train = jax.tree.leaves(trainer_shardings)[0]
        first_rollout = jax.tree.leaves(rollout_shardings)[0]
        self.colocated = set(first_train.device_set) == set(first_rollout.device_set)
        static = lora.frozen_base(trainer_shardings) if static is None else static
        self._static = jax.tree.leaves(static)
        self._moved: list[Any] | None = None  # rollout copies of the static leaves
        train_sh = jax.tree.leaves(trainer_shardings)
        if not self.colocated:
            full = [NamedSharding(s.mesh, P()) for s in train_sh]
            self._gather_all = jax.jit(lambda p: p, in_shardings=(train_sh,), out_shardings=full)
            moving = [i for i, st in enumerate(self._static) if not st]
            self._gather_moving = jax.jit(
                lambda p: p, in_shardings=([train_sh[i] for i in moving],),
                out_shardings=[full[i] for i in moving])

    def __call__(self, params: Any) -> Any:
        leaves, treedef = jax.tree.flatten(params)
        targets = treedef.flatten_up_to(self.targets)
        moving = [i for i, st in enumerate(self._static) if not (st and self._moved)]
        if self.colocated:
            moved = jax.device_put([leaves[i] for i in moving], [targets[i] for i in moving])
        elif len(moving) == len(leaves):
            moved = list(map(self._move, self._gather_all(leaves), targets))
        else:
            moved = list(map(self._move, self._gather_moving([leaves[i] for i in moving]),
                             [targets[i] for i in moving]))
        out = dict(zip(moving, moved))
        if self._moved is None and any(self._static):
            # A colocated leaf already in the rollout layout shares its buffer with the
            # trainer's, which the next train step donates: it is put again every call
            # (a no-op), never cached.
            self._static = [st and not (self.colocated and leaves[i].sharding.is_equivalent_to(
                targets[i], leaves[i].ndim)) for i, st in enumerate(self._static)]
            self._moved = [out[i] if st else None for i, st in enumerate(self._static)]
        elif self._moved:
            out.update({i: m for i, m in enumerate(self._moved) if self._static[i]})
        return jax.tree.unflatten(treedef, [out[i] for i in range(len(leaves))])

    @staticmethod
    def _move(full: jax.Array, target: NamedSharding) -> jax.Array:
        local = full.addressable_shards[0].data  # a whole copy on one of this host's devices
        buffers = [jax.device_put(local[index], device)
                   for device, index in target.addressable_devices_indices_map(full.shape).items()]
        return jax.make_array_from_single_device_arrays(full.shape, target, buffers)
