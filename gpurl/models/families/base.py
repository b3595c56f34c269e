"""What a model family record holds: how transformers and llama.cpp describe the family.

A family is one file of `gpurl/models/families/` defining `FAMILY`; the generic readers
and writers (`gpurl.models.hf`, `hf_export`, `gguf`) only read these records, so adding
a family touches its file and a preset YAML in configs/model/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

# config.json keys of the shape fields, in the order `hf_defaults` takes them.
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim")


def hf_defaults(*shapes: int, **rest: Any) -> dict[str, Any]:
    """Defaults of a transformers config class: shapes in `SHAPE_KEYS` order, then the rest."""
    return {**dict(zip(SHAPE_KEYS, shapes)), **rest}


@dataclass(frozen=True)
class HFFamily:
    """What a transformers model type fixes, and the config defaults its class fills in
    (real config.json files omit keys that equal them: Gemma 3 4B's text_config names only
    five)."""

    model_types: tuple[str, ...]  # config.json model_type values read as this family; export writes the first
    architecture: str  # the ...ForCausalLM class
    act_key: str  # config.json key of the MLP activation
    gemma: bool  # (1 + w) norms and sqrt(D)-scaled embeddings
    post_norms: bool  # norms after attention and after the MLP
    qk_norm: bool
    qkv_bias: bool | None  # None: the config's attention_bias, which gpurl supports only off
    layer_types: bool  # has sliding-window layers (and query_pre_attn_scalar, softcaps)
    local_rope: bool  # sliding layers have their own RoPE base
    defaults: dict[str, Any]
    export_keys: dict[str, Any] = field(default_factory=dict)  # config.json keys only this family writes
    activation_aliases: dict[str, str] = field(default_factory=dict)  # activation names the class reads as others
    classifier: str | None = None  # ...ForSequenceClassification class; None: from `architecture`
    moe: bool = False  # MLPs are mixtures of experts (num_experts, moe_intermediate_size, ...)

    @property
    def classifier_architecture(self) -> str:
        return self.classifier or self.architecture.replace("ForCausalLM", "ForSequenceClassification")


class GGUFMetadata(Protocol):
    """Typed access to a GGUF file's `{architecture}.*` keys (`gpurl.models.gguf`)."""

    def get(self, key: str, default: Any = ..., kind: Callable = int) -> Any: ...


@dataclass(frozen=True)
class GGUFArch:
    """How llama.cpp writes the family (its `general.architecture` value is `name`)."""

    name: str
    # ModelConfig fields of the family from the metadata, given the fields every
    # architecture reads alike (`gpurl.models.gguf._base_fields`)
    fields: Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]]
    norm_offset: float  # llama.cpp writes Gemma's RMSNorm weight w as 1 + w
    permuted_qk: bool  # llama.cpp reorders llama's q/k rows for its interleaved RoPE
    tokenizer: bool = False  # the file's tokenizer.ggml.* metadata rebuilds the tokenizer (Gemma's SentencePiece)


@dataclass(frozen=True)
class Family:
    name: str  # the value of model.family
    hf: HFFamily
    gguf: GGUFArch | None = None  # None: gpurl does not read this family from GGUF


def llama_like_gguf(family: str) -> Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]]:
    """GGUF fields of the SwiGLU families without Gemma's norm and embedding conventions."""
    def fields_of(meta: GGUFMetadata, fields: dict[str, Any]) -> dict[str, Any]:
        return dict(fields, family=family, activation="silu", norm_plus_one=False,
                    scale_embeddings=False)
    return fields_of
