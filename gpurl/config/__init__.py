"""Typed schemas of every config group, and the choice enums their fields take.

Hydra composes YAML files in `configs/` over these schemas (registered in its
ConfigStore by `gpurl.cli`), so a typo in a key or a value of the wrong type fails at
composition. `gpurl.cli` converts the composed config once into these frozen
dataclasses; nothing below the CLI sees omegaconf. Every field carries a comment: it
is the documentation of the key (`gpurl train --cfg job` prints the values;
`python -m gpurl.cli.config_docs` writes docs/configuration.md from them).

The package, one module per group and the shared parts: `checks` (the value checks and
`ConfigError`), `algo` (one schema per family of algorithms; each option in
`configs/algo/` names the schema it fills, `gpurl.algorithms.registry` maps an
algorithm's name to its schema), `model`, `data`, `env`, `run` (the run's other groups
and the root `Config`), `dicts` (plain dicts <-> configs, YAML key names, moved keys).
It imports nothing from gpurl outside itself: every other module may import it, and
`from gpurl.config import ...` takes every schema from here.
"""

from __future__ import annotations

from gpurl.config.checks import DTYPES, ConfigError, lookup
from gpurl.config.data import DataConfig
from gpurl.config.env import EnvConfig
from gpurl.config.algo import (Advantage, AlgoConfig, CriticBackbone, CriticConfig, Divergence,
                               DistillSignal, DPOConfig, DPOLoss, GRPOConfig, ImportanceRatio,
                               KDConfig, KLControlConfig, KLEstimator, LossAgg, OPDConfig,
                               ORPOConfig, PolicyGradientConfig, PPOConfig, RewardModelConfig,
                               SFTConfig, SimPOConfig, TeacherConfig, TISLevel)
from gpurl.config.model import LoraConfig, MoEConfig, ModelConfig, VisionConfig
from gpurl.config.run import (LoggerName, Placement, RolloutMode, OptimConfig, TrainConfig,
                              RolloutConfig, MeshConfig, LoggerConfig, RunConfig, DistributedConfig,
                              RewardsConfig, PlanConfig, Config, GenerateConfig, EvalConfig,
                              ServeConfig)

__all__ = ["DTYPES", "ConfigError", "lookup", "DataConfig", "EnvConfig", "Advantage",
           "AlgoConfig", "CriticBackbone", "CriticConfig", "Divergence", "DistillSignal",
           "DPOConfig", "DPOLoss", "GRPOConfig", "ImportanceRatio", "TISLevel", "KDConfig",
           "KLControlConfig", "KLEstimator", "LossAgg", "OPDConfig", "ORPOConfig",
           "PolicyGradientConfig", "PPOConfig", "RewardModelConfig", "SFTConfig", "SimPOConfig",
           "TeacherConfig", "LoraConfig", "MoEConfig", "ModelConfig", "VisionConfig", "LoggerName", "Placement",
           "RolloutMode", "OptimConfig", "TrainConfig", "RolloutConfig", "MeshConfig", "LoggerConfig",
           "RunConfig", "DistributedConfig", "RewardsConfig", "PlanConfig", "Config",
           "GenerateConfig", "EvalConfig", "ServeConfig"]
