"""What a run loads besides its train state: the trained tree's initial parameters, the
frozen reference policy, a reward model and a distillation teacher, each placed straight
into its shards."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from gpurl import hub
from gpurl.algorithms.objective import Teacher, TeacherModel
from gpurl.config import ConfigError, LoraConfig, ModelConfig, TeacherConfig
from gpurl.distributed.mesh import Rules, held_bytes, tree_shardings
from gpurl.models import loading
from gpurl.models.hf import model_config_from_hf
from gpurl.models.scalar import ScalarSpec, load_scalar_hf, scalar_spec
from gpurl.models.spec import Params, model_spec
from gpurl.models.tokenizer import Tokenizer
from gpurl.models.transformer import compute_dtype


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
    be the policy's: it scores the policy's tokens. `path` may be a Hub id."""
    name, path = path, hub.local_path(path, "algo.reward_model", kind="model_meta")
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"algo.reward_model={name} is not an HF directory with config.json; "
                          f"export an algo=rm run with `gpurl export checkpoint=RUN_DIR out=DIR` "
                          f"and point algo.reward_model at DIR.")
    cfg = model_config_from_hf(path, dataclasses.replace(policy_cfg, checkpoint=path,
                                                         init="checkpoint"))
    if cfg.vocab_size != policy_cfg.vocab_size:
        raise ConfigError(f"algo.reward_model={name} has a vocabulary of {cfg.vocab_size} tokens "
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
    """The reward model's parameters, read from `path` (a Hub id: fetched first) straight
    into `shardings`."""
    return load_scalar_hf(hub.local_path(path, "algo.reward_model"), spec, shardings)


def teacher_config(algo: TeacherConfig, student: ModelConfig) -> ModelConfig:
    """The teacher's model config: `algo.teacher`'s own architecture (config.json or GGUF
    metadata) over the student's settings, without adapters, stored and computed in
    `algo.teacher_dtype` (auto: the student's compute dtype). Nothing is loaded."""
    if algo.teacher is None:
        raise ConfigError(f"algo={algo.name} learns from a teacher but algo.teacher is not set; "
                          f"set algo.teacher to a Hub id (org/name), an HF directory or a .gguf "
                          f"file.")
    path = Path(hub.local_path(algo.teacher, "algo.teacher", kind="model_meta")).expanduser()
    if not path.is_dir() and path.suffix != ".gguf" or not path.exists():
        raise ConfigError(f"algo.teacher={algo.teacher} is not an HF safetensors directory or a "
                          f".gguf file; point it to the teacher's weights (a `gpurl export` "
                          f"directory).")
    dtype = (algo.teacher_dtype if algo.teacher_dtype != "auto"
             else jnp.dtype(compute_dtype(student)).name)
    cfg = loading.resolve(dataclasses.replace(
        student, name=f"teacher {algo.teacher}", init="checkpoint",
        checkpoint=hub.pinned(algo.teacher, "algo.teacher") if hub.is_hub_id(algo.teacher)
        else str(path),
        lora=LoraConfig(), dtype=dtype, param_dtype=dtype))
    if cfg.vocab_size != student.vocab_size:
        raise ConfigError(f"algo.teacher={algo.teacher} has {cfg.vocab_size} vocabulary rows but "
                          f"the student has {student.vocab_size}; distill between models that "
                          f"share a tokenizer and vocabulary.")
    return cfg


def check_teacher_tokenizer(algo: TeacherConfig, teacher: ModelConfig,
                            student: Tokenizer) -> None:
    """The teacher reads the student's token ids: its own tokenizer (beside its weights,
    when it has one) must have the student's vocabulary and special ids."""
    path = Path(loading.checkpoint_path(teacher, weights=False) or "")
    if path.is_dir() and not (path / "tokenizer.json").is_file():
        return  # no tokenizer shipped with the weights: the vocabulary size was checked
    own = loading.checkpoint_tokenizer(teacher)
    specials = ("bos_id", "eos_id", "pad_id")
    differs = [k for k in specials if getattr(own, k) != getattr(student, k)]
    if own.tok.get_vocab(with_added_tokens=True) != student.tok.get_vocab(with_added_tokens=True):
        differs.insert(0, "vocabulary")
    if differs:
        raise ConfigError(f"algo.teacher={algo.teacher} has another tokenizer than the student "
                          f"({', '.join(differs)} differ); distill between models that share a "
                          f"tokenizer, such as two sizes of one family.")


class TeacherWeights:
    """A distillation run's teacher on the trainer mesh: its spec and shardings from the
    start (the memory plan and the programs compile against them), its weights read
    straight into their shards at first use, after the plan has checked that they fit."""

    def __init__(self, cfg: ModelConfig, mesh: Mesh, rules: Rules):
        self.cfg = cfg
        self.model = TeacherModel(model_spec(cfg))
        spec = self.model.spec
        self.shardings = Teacher(tree_shardings(spec.abstract_params, spec.logical_axes, rules,
                                                mesh), self.model)
        self.abstract = Teacher(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            spec.abstract_params, self.shardings.params), self.model)

    def bytes_per_device(self) -> float:
        return held_bytes(self.abstract.params)

    @functools.cached_property
    def value(self) -> Teacher:
        """The teacher's parameters, read from its checkpoint once."""
        return Teacher(loading.load_params(self.cfg, self.model.spec, self.shardings.params),
                       self.model)


def load_teacher(algo: TeacherConfig, student: ModelConfig, tokenizer: Tokenizer, mesh: Mesh,
                 rules: Rules) -> TeacherWeights:
    """`algo.teacher` checked against the student and laid out on the trainer mesh."""
    cfg = teacher_config(algo, student)
    check_teacher_tokenizer(algo, cfg, tokenizer)
    return TeacherWeights(cfg, mesh, rules)
