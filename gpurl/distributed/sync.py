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


class WeightSync:
    def __init__(self, trainer_shardings: Any, rollout_shardings: Any):
        self.targets = rollout_shardings
        first_train = jax.tree.leaves(trainer_shardings)[0]
        first_rollout = jax.tree.leaves(rollout_shardings)[0]
        self.colocated = set(first_train.device_set) == set(first_rollout.device_set)
        if not self.colocated:
            full = jax.tree.map(lambda s: NamedSharding(s.mesh, P()), trainer_shardings)
            self._gather = jax.jit(lambda p: p, in_shardings=(trainer_shardings,),
                                   out_shardings=full)

    def __call__(self, params: Any) -> Any:
        if self.colocated:
            return jax.device_put(params, self.targets)
        return jax.tree.map(self._move, self._gather(params), self.targets)

    @staticmethod
    def _move(full: jax.Array, target: NamedSharding) -> jax.Array:
        local = full.addressable_shards[0].data  # a whole copy on one of this host's devices
        buffers = [jax.device_put(local[index], device)
                   for device, index in target.addressable_devices_indices_map(full.shape).items()]
        return jax.make_array_from_single_device_arrays(full.shape, target, buffers)
