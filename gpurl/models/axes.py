"""Logical axis names to mesh axes: the rules (`mesh.train_rules`, `mesh.sample_rules`)
map a parameter's or activation's logical axis to one or more mesh axes, and a dimension
whose size does not divide by them is replicated instead (tiny models on many devices).
The model layers read them (`gpurl.models.moe` places its experts by them); the meshes
themselves are built above, in `gpurl.distributed.mesh`.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

Rules = Mapping[str, Sequence[str]]


def logical_spec(axes: Sequence[str | None], shape: Sequence[int], rules: Rules,
                 mesh: Mesh) -> P:
    """PartitionSpec for one array; a mesh axis is used at most once per array."""
    used: set[str] = set()
    spec: list[Any] = []
    for name, dim in zip(axes, shape):
        mesh_axes = [a for a in rules.get(name, ()) if a not in used and mesh.shape[a] > 1]
        if not mesh_axes or dim % math.prod(mesh.shape[a] for a in mesh_axes):
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(tuple(mesh_axes) if len(mesh_axes) > 1 else mesh_axes[0])
    return P(*spec)


def tree_shardings(abstract: Any, logical_axes: Any, rules: Rules, mesh: Mesh) -> Any:
    """NamedShardings for a pytree given a same-structured pytree of logical axes."""
    return jax.tree.map(
        lambda x, axes: NamedSharding(mesh, logical_spec(axes, x.shape, rules, mesh)),
        abstract, logical_axes, is_leaf=lambda x: isinstance(x, tuple))
