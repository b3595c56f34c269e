"""Every algorithm, once: one `Algorithm` record per name, read by the loop, the optimizer,
evaluation and export. Nothing else in gpurl compares an algorithm's name.

Adding an algorithm is a file of its own (its objective, and for RL its prepare step)
plus one record below, and a preset in configs/algo/ whose defaults list names the
record's config schema (`gpurl_<schema>`).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable

from gpurl.algorithms import distill, dpo, grpo, ppo, rm, sft
from gpurl.algorithms.objective import Objective
from gpurl.algorithms.rl import Prepare
from gpurl.config import (AlgoConfig, Config, ConfigError, DPOConfig, GRPOConfig, KDConfig,
                          ModelConfig, OPDConfig, ORPOConfig, PPOConfig, RewardModelConfig,
                          RolloutConfig, SFTConfig, SimPOConfig, lookup)
from gpurl.config.dicts import from_dict, yaml_key
from gpurl.models.export import export_language_model, export_reward_model
from gpurl.models.spec import model_spec


class Family(str, enum.Enum):
    """What an algorithm learns from, which picks its stepper in `gpurl.train.loop`."""

    SFT = "sft"  # reference completions
    RL = "rl"  # sampled completions and their rewards
    PREFERENCE = "preference"  # (prompt, chosen, rejected) pairs


def _language_model(cfg: AlgoConfig, model_cfg: ModelConfig) -> Any:
    return model_spec(model_cfg)


def _no_reference(cfg: AlgoConfig) -> bool:
    return False


def _kl_reference(cfg: Any) -> bool:
    """A frozen reference when the KL term is on."""
    return cfg.beta > 0


def _always(cfg: AlgoConfig) -> bool:
    return True


@dataclass(frozen=True)
class Algorithm:
    name: str  # algo.name
    family: Family
    config: type[AlgoConfig]  # the schema of its algo.* keys
    # (algo config, rollout config) -> the objective the shared train step differentiates
    objective: Callable[[Any, RolloutConfig], Objective]
    # RL: the jitted step between rollout and train step (advantages, log-probs, values)
    prepare: Prepare | None = None
    # RL: the prepare step's state before the first step (checkpointed with the run)
    carry: Callable[[Any], dict[str, float]] = lambda cfg: {}
    # (algo config, model config) -> the spec of the trained tree
    model: Callable[[Any, ModelConfig], Any] = _language_model
    # the parts of the trained tree with an AdamW each and their learning rates (None:
    # optim.lr); None: one AdamW over the whole tree
    optimizer: Callable[[Any], dict[str, float | None] | None] = lambda cfg: None
    needs_reference: Callable[[Any], bool] = _no_reference  # a frozen copy of the initial policy
    # (spec, params, model config, out dir, adapter) -> the HF directory written
    export: Callable[..., Any] = export_language_model
    # a mixture-of-experts model's load-balancing loss coefficient unless
    # model.moe.aux_loss_coef sets one: Qwen3's router_aux_loss_coef (0.001) for supervised
    # fine-tuning; off for RL and preference learning, as verl's Megatron bridge for
    # Qwen3-MoE sets (moe_router_load_balancing_type="none", "default None for RL")
    router_aux_loss: float = 0.0
    # a frozen teacher (algo.teacher) is loaded on the trainer mesh and passed to the
    # train step's loss and the RL prepare step (`gpurl.algorithms.objective.Teacher`)
    distills: bool = False


_GRPO_FAMILY = dict(family=Family.RL, config=GRPOConfig, objective=grpo.objective,
                    prepare=grpo.prepare, needs_reference=_kl_reference)

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("sft", Family.SFT, SFTConfig, sft.objective, router_aux_loss=0.001),
    Algorithm("kd", Family.SFT, KDConfig, distill.kd_objective, router_aux_loss=0.001,
              distills=True),
    # the GRPO family: one objective, presets differ (configs/algo/*.yaml)
    Algorithm("grpo", **_GRPO_FAMILY),
    Algorithm("gspo", **_GRPO_FAMILY),
    Algorithm("dapo", **_GRPO_FAMILY),
    Algorithm("drgrpo", **_GRPO_FAMILY),
    Algorithm("rloo", **_GRPO_FAMILY),
    Algorithm("opd", Family.RL, OPDConfig, distill.opd_objective, prepare=distill.opd_prepare,
              needs_reference=_kl_reference, distills=True),
    Algorithm("ppo", Family.RL, PPOConfig, ppo.objective, prepare=ppo.prepare,
              carry=ppo.initial_carry, model=ppo.model, optimizer=ppo.optimizer_parts,
              needs_reference=_kl_reference),
    Algorithm("dpo", Family.PREFERENCE, DPOConfig, dpo.dpo_objective, needs_reference=_always),
    Algorithm("simpo", Family.PREFERENCE, SimPOConfig, dpo.simpo_objective),
    Algorithm("orpo", Family.PREFERENCE, ORPOConfig, dpo.orpo_objective),
    Algorithm("rm", Family.PREFERENCE, RewardModelConfig, rm.objective, model=rm.model,
              export=export_reward_model),
)}

AlgoName = enum.Enum("AlgoName", {name.upper(): name for name in ALGORITHMS}, type=str)


def get(name: str) -> Algorithm:
    """The record of `algo.name`."""
    return lookup(ALGORITHMS, name, "algo.name")


def schemas() -> list[type[AlgoConfig]]:
    """Every config schema an algorithm uses, once each."""
    return list(dict.fromkeys(a.config for a in ALGORITHMS.values()))


def _choose(strict: bool) -> Callable[[type, dict[str, Any]], type]:
    def choose(cls: type, data: dict[str, Any]) -> type:
        if cls is not AlgoConfig:
            return cls
        name = data.get("name", AlgoConfig.name)
        schema = get(name).config
        known = {yaml_key(f.name) for f in dataclasses.fields(schema)}
        extra = sorted(set(data) - known)
        if strict and extra:
            raise ConfigError(
                f"algo={name} has no key algo.{extra[0]} (its keys are those of "
                f"{schema.__name__}); choose the algorithm with algo={name} instead of "
                f"algo.name, or drop the key.")
        return schema
    return choose


def parse(data: dict[str, Any], cls: type = Config, strict: bool = False) -> Any:
    """A frozen config from plain dicts (a composed command line, a run's config.yaml), with
    the `algo` node built by its algorithm's schema. `strict`: keys of another algorithm's
    schema are an error (the command line); otherwise they are dropped (config.yaml files
    written before the schemas were split hold every algorithm's keys)."""
    return from_dict(data, cls, _choose(strict))
