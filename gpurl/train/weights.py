"""What a run loads besides its train state: the trained tree's initial parameters, the
frozen reference policy, and a reward model, each placed straight into its shards."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh

from gpurl.config import ConfigError, ModelConfig
from gpurl.distributed.mesh import Rules, tree_shardings
from gpurl.models import loading
from gpurl.models.hf import model_config_from_hf
from gpurl.models.scalar import ScalarSpec, load_scalar_hf, scalar_spec
from gpurl.models.spec import Params


def load_initial(spec: Any, shardings: Params) -> Params | None:
    """Initial parameters of any trained tree from the run's checkpoint (see each spec's
    `initial`), each placed on its shards; None for a random init."""
    return spec.initial(shardings, loading.load_params)


def initial_policy(spec: Any, shardings: Params, seed: int) -> Params:
    """The language model's initial parameters (the frozen reference), loaded or drawn from
    `seed` like the train state's, without building a train state (optimizer moments)."""
    policy, shardings = spec.policy, spec.policy_params(shardings)
    loaded = loading.load_params(policy.cfg, policy, shardings)
    if loaded is not None:
        return loaded
    return jax.jit(lambda: policy.init(seed), out_shardings=shardings)()


def reward_model_spec(path: str, policy_cfg: ModelConfig) -> ScalarSpec:
    """`algo.reward_model`'s spec, from its HF config (nothing loaded). Its vocabulary must
    be the policy's: it scores the policy's tokens."""
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"algo.reward_model={path} is not an HF directory with config.json; "
                          f"export an algo=rm run with `gpurl export checkpoint=RUN_DIR out=DIR` "
                          f"and point algo.reward_model at DIR.")
    cfg = model_config_from_hf(path, dataclasses.replace(policy_cfg, checkpoint=path,
                                                         init="checkpoint"))
    if cfg.vocab_size != policy_cfg.vocab_size:
        raise ConfigError(f"algo.reward_model={path} has a vocabulary of {cfg.vocab_size} tokens "
                          f"but the policy's has {policy_cfg.vocab_size}; train the reward model "
                          f"from the policy's base model (algo=rm) so both read the same tokens.")
    return scalar_spec(cfg)


def reward_model_shardings(spec: ScalarSpec, mesh: Mesh, rules: Rules) -> Params:
    """Where the frozen reward model's parameters live on the trainer mesh."""
    return tree_shardings(spec.abstract_params, spec.logical_axes, rules, mesh)


def load_reward_model(path: str, policy_cfg: ModelConfig, mesh: Mesh,
                      rules: Rules) -> tuple[ScalarSpec, Params]:
    """`algo.reward_model`: an HF sequence-classification directory, placed on the trainer
    mesh (frozen)."""
    spec = reward_model_spec(path, policy_cfg)
    return spec, reward_model_params(path, spec, reward_model_shardings(spec, mesh, rules))


def reward_model_params(path: str, spec: ScalarSpec, shardings: Params) -> Params:
    """The reward model's parameters, read from `path` straight into `shardings`."""
    return load_scalar_hf(path, spec, shardings)
