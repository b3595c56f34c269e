"""GPUs a run can be compiled for on a machine without them: XLA's deviceless compilation.

`compile_only(gpu, count)` makes `count` compile-only devices of a known GPU (`GPUS`) the
devices every mesh is built from (`gpurl.distributed.mesh.using_devices`), so `gpurl plan
plan.target=h100` compiles each program of a run with XLA's GPU compiler, for that GPU,
on a CPU machine, and reads its memory analysis. Nothing runs: compile-only devices hold
no memory. It needs JAX's CUDA plugin (the `gpu-plan` extra, or `cuda12` / `cuda13` on a
GPU machine) for the compiler, `ptxas` (nvidia-cuda-nvcc) for Triton's kernels and cuDNN
for cuDNN attention; no driver and no GPU.

Without a GPU XLA does no autotuning: a matmul gets its default Triton tiling rather than
the fastest of cuBLAS and Triton, so scratch sizes can differ slightly from an on-GPU
compile (docs/scaling.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Iterator

from jax.experimental import topologies

from gpurl.config import ConfigError
from gpurl.distributed import layout, mesh

# JAX's CUDA plugins, newest first: either one carries XLA's GPU compiler.
PLUGINS = ("jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


@dataclass(frozen=True)
class Gpu:
    """What XLA's GPU compiler needs to know of a GPU (its `GpuTargetConfigProto`): the
    figures CUDA's device query reports."""

    description: str  # CUDA's device name (nvidia-smi's)
    capability: tuple[int, int]  # compute capability
    sms: int  # streaming multiprocessors
    fp32_per_sm: int  # FP32 lanes per SM
    clock_ghz: float  # boost clock
    memory_bytes: int  # device memory (cudaDeviceProp.totalGlobalMem)
    bandwidth: int  # memory bandwidth, bytes/s
    l2_bytes: int
    smem_per_sm: int  # shared memory per SM, bytes
    smem_per_block_optin: int  # shared memory one block may opt in to, bytes
    bf16_flops: float = 0.0  # dense bf16 (fp16 before Ampere) tensor-core peak, flop/s
    # NVLink bandwidth of one GPU in one direction, bytes/s (NVIDIA's data sheets: 900 GB/s
    # both ways on H100/H200 SXM, 600 on A100 SXM, 300 on V100 SXM2)
    link_bandwidth: float = 0.0

    def target_config(self) -> str:
        """The text `GpuTargetConfigProto` XLA compiles for (a CUDA device query's figures;
        limits common to every CUDA GPU since Volta written out)."""
        return (
            "gpu_device_info {\n"
            "  threads_per_block_limit: 1024\n  threads_per_warp: 32\n"
            "  shared_memory_per_block: 49152\n"
            f"  shared_memory_per_core: {self.smem_per_sm}\n"
            "  threads_per_core_limit: 2048\n"
            f"  core_count: {self.sms}\n  fpus_per_core: {self.fp32_per_sm}\n"
            "  block_dim_limit_x: 2147483647\n  block_dim_limit_y: 65535\n"
            "  block_dim_limit_z: 65535\n"
            f"  memory_bandwidth: {self.bandwidth}\n  l2_cache_size: {self.l2_bytes}\n"
            f"  clock_rate_ghz: {self.clock_ghz}\n  device_memory_size: {self.memory_bytes}\n"
            f"  shared_memory_per_block_optin: {self.smem_per_block_optin}\n"
            f"  cuda_compute_capability {{ major: {self.capability[0]} "
            f"minor: {self.capability[1]} }}\n"
            "  registers_per_core_limit: 65536\n  registers_per_block_limit: 65536\n"
            "}\n"
            'platform_name: "CUDA"\n'
            f'device_description_str: "{self.description}"\n')


# Device-query figures: OpenXLA's xla/tools/hlo_opt/gpu_specs (a100_sxm_80, h100_sxm,
# v100); the H200 is the H100's GH100 with 141 GB of HBM3e at 4.8 TB/s (NVIDIA's H200
# datasheet) and reports 143,771 MiB. Dense tensor-core peaks (no sparsity), from NVIDIA's
# datasheets: H100 / H200 SXM 989.4 TFLOPS bf16, A100 SXM 312, V100 SXM2 125 (fp16).
_HOPPER = dict(capability=(9, 0), sms=132, fp32_per_sm=128, clock_ghz=1.98, l2_bytes=50 * 2**20,
               smem_per_sm=233_472, smem_per_block_optin=232_448)
GPUS: dict[str, Gpu] = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", memory_bytes=84_978_434_048,
                bandwidth=3_352_320_000_000, bf16_flops=989.4e12, link_bandwidth=450e9,
                **_HOPPER),
    "h200": Gpu("NVIDIA H200", memory_bytes=143_771 * 2**20, bandwidth=4_800_000_000_000,
                bf16_flops=989.4e12, link_bandwidth=450e9, **_HOPPER),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", capability=(8, 0), sms=108, fp32_per_sm=64,
                clock_ghz=1.41, memory_bytes=85_100_068_864, bandwidth=2_039_040_000_000,
                l2_bytes=40 * 2**20, smem_per_sm=167_936, smem_per_block_optin=166_912,
                bf16_flops=312e12, link_bandwidth=300e9),
    "v100": Gpu("Tesla V100-SXM2-16GB", capability=(7, 0), sms=80, fp32_per_sm=64,
                clock_ghz=1.53, memory_bytes=16_935_419_904, bandwidth=898_048_000_000,
                l2_bytes=6 * 2**20, smem_per_sm=98_304, smem_per_block_optin=98_304,
                bf16_flops=125e12, link_bandwidth=150e9),
}


def gpu(name: str) -> Gpu:
    """The GPU `plan.target` names; one sentence with the known names otherwise."""
    if name not in GPUS:
        raise ConfigError(f"plan.target={name} is not a GPU gpurl can compile for; use one "
                          f"of {', '.join(GPUS)}.")
    return GPUS[name]


def compiler_installed() -> bool:
    """Whether one of JAX's CUDA plugins (XLA's GPU compiler) is importable."""
    try:
        return any(importlib.util.find_spec(p) is not None for p in PLUGINS)
    except ModuleNotFoundError:  # no jax_plugins namespace at all
        return False


def memory_fraction() -> float:
    """The fraction of a GPU's memory JAX's allocator takes (XLA_PYTHON_CLIENT_MEM_FRACTION,
    0.75 unless set): what a run on that GPU can use."""
    return float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def topology(count: int) -> str:
    """XLA's CUDA topology string, slices x hosts x devices per host: up to 8 GPUs on one
    host, more as whole 8-GPU hosts."""
    per_host = min(count, layout.DEVICES_PER_HOST)
    if count % per_host:
        raise ConfigError(f"plan.devices={count} with plan.target is not whole {per_host}-GPU "
                          f"hosts; use 1 to {layout.DEVICES_PER_HOST} or a multiple of {per_host}.")
    return f"1x{count // per_host}x{per_host}"


@contextlib.contextmanager
def compile_only(target: Gpu, count: int) -> Iterator[None]:
    """Meshes built inside this block are made of `count` compile-only `target` GPUs."""
    if not compiler_installed():
        raise ConfigError(
            "plan.target compiles for a GPU this machine does not have, which needs JAX's "
            "CUDA plugin (XLA's GPU compiler); install it with `pip install -e \".[gpu-plan]\"` "
            "(about 1 GB, Linux x86_64/aarch64), or drop plan.target to plan with this "
            "machine's compiler.")
    desc = topologies.get_topology_desc(platform="cuda", target_config=target.target_config(),
                                        topology=topology(count))
    with mesh.using_devices(list(desc.devices)):
        yield
