"""Decoders with a scalar head: reward models and critics, and the PPO actor-critic pair.

A scalar model is the decoder's backbone (everything up to the final norm) plus one
weight vector `score` (D): its output at a position is `hidden . score`. A reward model
reads it at the last token of a sequence (Bradley-Terry training, `algo=rm`); a critic
reads it at every position (PPO values). The backbone is built with tied embeddings so
it never holds a vocabulary-sized output head it would not use; its HF form is the
`...ForSequenceClassification` class with `num_labels=1` (`score.weight`, 1 x D, no bias),
so reward models trained here load in transformers and HF reward models load here.

`ActorCriticSpec` pairs the policy with its critic for PPO: parameters
{"policy": ..., "critic": ...}, where the critic is a whole scalar model (its own
backbone) or, with a shared backbone, just {"score"} read off the policy's hidden states.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.config import ConfigError, CriticBackbone, ModelConfig
from gpurl.models import families
from gpurl.models.hf import load_hf_params
from gpurl.models.hf_export import export_hf
from gpurl.models.safetensors_io import open_checkpoint
from gpurl.models.spec import LoadLM, ModelSpec, Params, model_spec


def backbone_config(cfg: ModelConfig) -> ModelConfig:
    """The architecture of a scalar model's backbone: no separate output head."""
    return dataclasses.replace(cfg, tie_embeddings=True)


@dataclass(frozen=True)
class ScalarSpec:
    """A backbone and a score vector: parameters {"backbone": ..., "score": D}."""

    base: ModelSpec  # the backbone (tied embeddings)

    @property
    def cfg(self) -> ModelConfig:
        return self.base.cfg

    @property
    def abstract_params(self) -> Params:
        d = self.cfg.d_model
        return {"backbone": self.base.abstract_params,
                "score": jax.ShapeDtypeStruct((d,), jnp.float32)}

    @property
    def logical_axes(self) -> Params:
        return {"backbone": self.base.logical_axes, "score": ("embed",)}

    def init(self, seed: int) -> Params:
        # Zero head: a fresh critic predicts 0 and a fresh reward model ties every pair.
        return {"backbone": self.base.init(seed), "score": jnp.zeros((self.cfg.d_model,), jnp.float32)}

    @property
    def policy(self) -> None:
        """A scalar model has no language model that generates text."""
        return None

    def policy_params(self, params: Params) -> Params:
        raise ValueError("a scalar model holds no language model")

    def initial(self, shardings: Params, load_lm: LoadLM) -> Params | None:
        """The checkpoint's decoder as the backbone, with a zero head; None: random init."""
        backbone = load_lm(self.cfg, self.base, shardings["backbone"])
        return None if backbone is None else {
            "backbone": backbone, "score": _zeros(shardings["score"], self.cfg.d_model)}


def scalar_spec(cfg: ModelConfig) -> ScalarSpec:
    return ScalarSpec(model_spec(backbone_config(cfg)))


def head(score_D: jax.Array, states_BxNxD: jax.Array) -> jax.Array:
    """The scalar at every state, fp32 (B x N)."""
    return jnp.einsum("bnd,d->bn", states_BxNxD.astype(jnp.float32), score_D.astype(jnp.float32))


def backbone_of(policy: Params) -> Params:
    """A policy's parameters without a separate output head (the critic's initial backbone)."""
    return {k: v for k, v in policy.items() if k != "lm_head"}


@dataclass(frozen=True)
class ActorCriticSpec:
    """PPO's policy and critic as one parameter tree, so one jitted step, one optimizer
    (with a learning rate per part) and one checkpoint cover both."""

    policy: ModelSpec
    critic: ScalarSpec
    shared: bool  # the critic is a score vector on the policy's backbone

    @classmethod
    def of(cls, cfg: ModelConfig, backbone: CriticBackbone) -> ActorCriticSpec:
        """The policy `cfg` with a critic on its own or on the policy's backbone."""
        return cls(model_spec(cfg), scalar_spec(cfg), shared=backbone == CriticBackbone.SHARED)

    def policy_params(self, params: Params) -> Params:
        return params["policy"]

    def initial(self, shardings: Params, load_lm: LoadLM) -> Params | None:
        """The checkpoint as the policy; the critic a copy of its backbone with a zero head."""
        policy = load_lm(self.cfg, self.policy, shardings["policy"])
        if policy is None:
            return None
        critic = {"score": _zeros(shardings["critic"]["score"], self.cfg.d_model)}
        if not self.shared:  # a copy: the train state donates both trees
            critic["backbone"] = jax.jit(lambda p: jax.tree.map(jnp.copy, p),
                                         out_shardings=shardings["critic"]["backbone"])(
                backbone_of(policy))
        return {"policy": policy, "critic": critic}

    @property
    def cfg(self) -> ModelConfig:
        return self.policy.cfg

    def _critic_tree(self, tree: Params) -> Params:
        return {"score": tree["score"]} if self.shared else tree

    @property
    def abstract_params(self) -> Params:
        return {"policy": self.policy.abstract_params,
                "critic": self._critic_tree(self.critic.abstract_params)}

    @property
    def logical_axes(self) -> Params:
        return {"policy": self.policy.logical_axes,
                "critic": self._critic_tree(self.critic.logical_axes)}

    def init(self, seed: int) -> Params:
        policy = self.policy.init(seed)
        critic = {"score": jnp.zeros((self.cfg.d_model,), jnp.float32)}
        if not self.shared:
            critic["backbone"] = backbone_of(policy)
        return {"policy": policy, "critic": critic}


def export_scalar_hf(params: Params, cfg: ModelConfig, out_dir: str | Path,
                     tokenizer_dir: str | Path | None = None) -> Path:
    """A scalar model as an HF `...ForSequenceClassification` directory (num_labels 1).
    Every process must call it; process 0 writes."""
    score = np.asarray(jax.device_get(params["score"]), np.float32).reshape(1, -1)
    out = export_hf(params["backbone"], backbone_config(cfg), out_dir, tokenizer_dir,
                    extra={"score.weight": score})
    if jax.process_index() != 0:
        return out
    config_file = out / "config.json"
    hf = json.loads(config_file.read_text())
    hf.update(architectures=[families.get(cfg.family).hf.classifier_architecture], num_labels=1,
              tie_word_embeddings=cfg.tie_embeddings)
    hf.setdefault("pad_token_id", 0)
    config_file.write_text(json.dumps(hf, indent=2) + "\n")
    return out


def load_scalar_hf(path: str | Path, spec: ScalarSpec, shardings: Params) -> Params:
    """A reward model from an HF `...ForSequenceClassification` directory (one label)."""
    tensors = open_checkpoint(Path(path))
    score = tensors.get("score.weight")
    if score is None or score.shape[0] != 1 or score.shape[-1] != spec.cfg.d_model:
        raise ConfigError(
            f"{path} holds no one-label score head (score.weight of shape 1 x "
            f"{spec.cfg.d_model}); point algo.reward_model at a reward model exported by "
            f"`gpurl export` from an algo=rm run, or at an HF ...ForSequenceClassification "
            f"checkpoint with num_labels=1.")
    backbone = load_hf_params(path, spec.base, shardings["backbone"], extra=("score.weight",))
    score_D = np.asarray(score, np.float32).reshape(-1)
    return {"backbone": backbone, "score": jax.device_put(score_D, shardings["score"])}


def _zeros(sharding: Any, d: int) -> jax.Array:
    return jax.device_put(np.zeros((d,), np.float32), sharding)
