"""Every program of a run lowered for another platform, on this machine, from abstract
arrays: the CUDA lowering of a GPU run checked on a CPU-only machine (CI has no GPU).

`lower(cfg, "cuda")` builds the run as `gpurl plan` does (nothing allocated) with the GPU's
choices (`gpurl.kernels.platform.target`: attention `auto` -> cuDNN, Pallas kernels
compiled by Triton instead of interpreted, ragged MoE matmuls, bf16 for `model.dtype=auto`),
then traces each program (the train step, and the stepper's own: eval step, RL prepare,
rollout prefill and decode chunk, preference log-probs) and lowers it with
`lowering_platforms=("cuda",)` under the run's mesh of this machine's devices. A primitive
without a CUDA lowering rule (a Pallas op Triton cannot take, a CPU-only custom call) fails
here, as it would on the first step on a GPU. Compilation is not part of it: XLA's GPU
compiler needs JAX's CUDA plugin, which CI's install does not have; `gpurl plan
plan.target=h100` compiles a run's programs for compile-only GPUs where it is installed
(`gpurl.plan.targets`, tests/test_gpu_plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpurl.config import Config
from gpurl.kernels import platform
from gpurl.plan.programs import Kind, ProgramRecord
from gpurl.train.loop import build

# gpurl's platform name for each lowering platform
BACKENDS = {"cuda": "gpu", "rocm": "gpu", "cpu": "cpu", "tpu": "tpu"}


@dataclass(frozen=True)
class Lowered:
    """One program lowered for a platform: its kind, and its StableHLO text."""

    kind: Kind
    text: str

    @property
    def name(self) -> str:
        return self.kind.value

    def count(self, fragment: str) -> int:
        return self.text.count(fragment)


def programs(cfg: Config) -> list[ProgramRecord]:
    """The record of every program the run `cfg` runs, built with the current platform's
    choices (call inside `platform.target`)."""
    cfg, setup, stepper = build(cfg)
    return [setup.train_program(stepper.batch_spec()), *stepper.programs()]


def lower(cfg: Config, lowering_platform: str = "cuda") -> list[Lowered]:
    """Every program of the run lowered for `lowering_platform`, traced with that
    platform's choices."""
    with platform.target(BACKENDS[lowering_platform]):
        return [Lowered(p.kind, p.fn.trace(*p.args).lower(lowering_platforms=(lowering_platform,))
                        .as_text())
                for p in programs(cfg)]
