"""The frozen models a run holds beside its train state, by role: the reference policy,
the reward model and the distillation teacher (and whatever role comes later: one more
field here). The algorithm's registry record says which it needs; the steppers receive
them in one object.

Nothing is read before the memory plan has checked that everything fits: each role has its
spec, shardings and abstract arguments from the start (the plan and the ahead-of-time
programs compile against them), and its weights are read straight into their shards at
the first use.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from gpurl.algorithms.registry import Algorithm
from gpurl.config import AlgoConfig, MeshConfig
from gpurl.distributed.mesh import abstract, held_bytes
from gpurl.models import lora
from gpurl.models.scalar import ScalarSpec
from gpurl.models.spec import Params
from gpurl.train.step import Placement
from gpurl.train.weights import (TeacherWeights, initial_policy, reward_model_params,
                                 reward_model_shardings, reward_model_spec)


class Reference:
    """The frozen reference policy: the initial policy. With LoRA it is the train state's
    own frozen base, the adapters read as 0 (no copy: `inside`); otherwise a separate copy,
    rebuilt (not checkpointed) on resume and loaded at the first step (`value`)."""

    def __init__(self, spec: Any, place: Placement, lora_base: bool, seed: int):
        self.spec, self.place, self.seed = spec, place, seed
        self.base = lora_base  # the train state's base, adapters off
        self.own = not lora_base  # a separate frozen copy

    @functools.cached_property
    def value(self) -> Params | None:
        """The separate copy's parameters (read once); None for a LoRA run's base."""
        if not self.own:
            return None
        return initial_policy(self.spec, self.place.state.params, self.seed)

    def abstract(self) -> Params | None:
        """The separate copy's abstract parameters on the trainer mesh; None without one."""
        if not self.own:
            return None
        return abstract(self.spec.policy_params(self.place.abstract_state.params),
                        self.spec.policy_params(self.place.state.params))

    def inside(self, params: Params, own: Params | None) -> Params:
        """Inside a jitted program: the reference's parameters given the trained tree
        `params` and the separate copy `own` (`value`, an argument of the program)."""
        return lora.disabled(self.spec.policy_params(params)) if self.base else own

    def bytes_per_device(self) -> float:
        return held_bytes(self.abstract()) if self.own else 0.0


class RewardModel:
    """`algo.reward_model`: an HF sequence-classification directory scoring the policy's
    tokens on the trainer mesh."""

    def __init__(self, path: str, policy_cfg: Any, place: Placement, mesh: MeshConfig):
        self.path = path
        self.spec: ScalarSpec = reward_model_spec(path, policy_cfg)
        self.shardings = reward_model_shardings(self.spec, place.mesh, mesh.train_rules)

    @functools.cached_property
    def value(self) -> Params:
        """Its parameters, read from the directory once."""
        return reward_model_params(self.path, self.spec, self.shardings)

    def abstract(self) -> Params:
        return abstract(self.spec.abstract_params, self.shardings)

    def bytes_per_device(self) -> float:
        return held_bytes(self.abstract())


@dataclass(frozen=True)
class Frozen:
    """A run's frozen models by role; None where the algorithm needs none."""

    reference: Reference | None = None
    reward_model: RewardModel | None = None
    teacher: TeacherWeights | None = None

    @classmethod
    def of(cls, algorithm: Algorithm, algo: AlgoConfig, spec: Any, place: Placement,
           mesh: MeshConfig, lora_base: bool, seed: int,
           teacher: TeacherWeights | None = None) -> "Frozen":
        """The roles `algorithm` declares for this config: a reference when it needs one
        (`Algorithm.needs_reference`), a reward model when `algo.reward_model` names one,
        and the teacher the loop loaded (`gpurl.train.weights.load_teacher`)."""
        reference = (Reference(spec, place, lora_base, seed)
                     if algorithm.needs_reference(algo) else None)
        path = getattr(algo, "reward_model", None)
        reward = RewardModel(path, spec.cfg, place, mesh) if path else None
        return cls(reference, reward, teacher)

    def values(self) -> tuple[Params | None, Params | None, Any]:
        """(the reference's separate copy, the reward model's parameters, the teacher), each
        read at its first use; None for a role the run lacks."""
        return (self.reference.value if self.reference else None,
                self.reward_model.value if self.reward_model else None,
                self.teacher.value if self.teacher else None)

    def abstract(self) -> tuple[Any, Any, Any]:
        """`values`' abstract arguments, for compiling ahead of time."""
        return (self.reference.abstract() if self.reference else None,
                self.reward_model.abstract() if self.reward_model else None,
                self.teacher.abstract if self.teacher else None)

    def bytes_per_device(self, teacher: bool = True) -> float:
        """Bytes per trainer device of the roles held (`teacher=False`: without the teacher,
        which the train step's plan counts among its arguments)."""
        return ((self.reference.bytes_per_device() if self.reference else 0.0)
                + (self.reward_model.bytes_per_device() if self.reward_model else 0.0)
                + (self.teacher.bytes_per_device() if self.teacher and teacher else 0.0))
