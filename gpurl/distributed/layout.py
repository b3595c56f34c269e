"""The layouts chosen for the user: the rollout's `mesh.rollout_tp=auto`, and the
trainer's `mesh.context=auto` candidates (`wider_contexts`; the memory plan picks one).

A rollout replica spans `rollout_tp` devices (tensor parallel), and the rollout devices
hold `devices / rollout_tp` replicas (data parallel). Each device holds 1 / rollout_tp of
the rollout's weights and of every KV head it serves, so a wider replica frees memory for
the KV pool (more rows decoding at once), at the cost of an all-reduce per layer. `auto`
takes, of the widths the rollout devices and the model allow (a divisor of the devices, of
the KV heads and of the experts, at most one 8-GPU host: NVLink), the narrowest whose room
for the KV pool is within 10% of the widest's; the room is a device's memory less what
stays beside the rollout (colocated: the train state) and the rollout's weights.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Sequence

import jax

from gpurl.config import MeshConfig
from gpurl.distributed.mesh import held_bytes, rollout_mesh, tree_shardings

ROOM_TOLERANCE = 0.9  # auto: the narrowest width with this share of the most room
MAX_CONTEXT = 32  # packed rows of 64 slots split into 2 x 32 chunks
DEVICES_PER_HOST = 8  # GPUs of a node: a replica (or a compile-only topology) wider crosses the network


def widths(devices: int, model: Any) -> list[int]:
    """Tensor-parallel widths a rollout of `model` (a ModelConfig) may take on `devices`."""
    experts = model.moe.num_experts
    return [d for d in range(1, min(devices, DEVICES_PER_HOST) + 1)
            if devices % d == 0 and model.num_kv_heads % d == 0
            and (not experts or experts % d == 0)]


def weight_bytes(spec: Any, cfg: MeshConfig, devices: Sequence[jax.Device], width: int) -> float:
    """Bytes one device holds of the rollout's copy of the weights at `width`."""
    mesh = rollout_mesh(dataclasses.replace(cfg, rollout_tp=str(width)), devices)
    serving = spec.serving_params(tree_shardings(spec.abstract_params, spec.logical_axes,
                                                 cfg.sample_rules, mesh))
    return held_bytes(serving)


def resolve(cfg: MeshConfig, spec: Any, devices: Sequence[jax.Device], room: float
            ) -> tuple[MeshConfig, str]:
    """`cfg` with `rollout_tp` a size, and a line saying which and why: as set, or auto's
    choice for `spec` (the rollout's ModelSpec) on `devices` with `room` bytes per device
    for the rollout's weights and KV pool."""
    if cfg.rollout_width is not None:
        return cfg, f"mesh.rollout_tp={cfg.rollout_width}"
    options = widths(len(devices), spec.cfg)
    left = {d: room - weight_bytes(spec, cfg, devices, d) for d in options}
    best = max(left.values())
    # nothing fits at any width: the most room (the memory plan then says what to change)
    width = next(d for d in options if left[d] >= (ROOM_TOLERANCE * best if best > 0 else best))
    gib = 2**30
    others = ", ".join(f"{d}: {left[d] / gib:.1f}" for d in options)
    return (dataclasses.replace(cfg, rollout_tp=str(width)),
            f"mesh.rollout_tp=auto picked {width} (GiB left per device for the KV pool by "
            f"width: {others})")


def device_bytes(device: jax.Device) -> tuple[float, str]:
    """(bytes a run may use of `device`, where the figure comes from): the allocator's
    limit on an accelerator, else this host's memory shared by its devices."""
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"]), f"{device.platform} bytes_limit"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    count = max(jax.local_device_count(), 1)
    return host / count, f"host RAM / {count} local devices"


def for_sampling(cfg: MeshConfig, spec: Any, devices: Sequence[jax.Device]) -> MeshConfig:
    """`cfg` resolved for a run that only samples (`gpurl generate`, `gpurl eval`): the
    rollout's weights and KV pool have the whole device."""
    return resolve(cfg, spec, devices, device_bytes(devices[0])[0])[0]


def wider_contexts(cfg: MeshConfig, shape: dict[str, int]) -> list[MeshConfig]:
    """mesh.context=auto's wider candidates, narrowest first: `cfg` with the sizes of the
    trainer mesh `shape` (built at context 1) spelled out and context 2, 4, ... (up to 32),
    each width's devices taken from fsdp (the context axis shards parameters as fsdp does,
    so a device holds as much of them) and what fsdp cannot give from data."""
    out = []
    width = 2
    while width <= MAX_CONTEXT:
        from_fsdp = math.gcd(width, shape["fsdp"])
        from_data = width // from_fsdp
        if shape["data"] % from_data:
            break
        out.append(dataclasses.replace(
            cfg, data=shape["data"] // from_data, fsdp=shape["fsdp"] // from_fsdp,
            context=str(width), expert=shape["expert"], tp=shape["tp"]))
        width *= 2
    return out
