"""Export to a Hugging Face directory: config.json (the classic `rope_theta`/`rope_scaling`
form that transformers 4.x and 5.x both read), model.safetensors and the tokenizer files;
LoRA adapters alone in PEFT's layout (`export_peft`).

Tensors are gathered and written one at a time, so the host never holds the whole model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from gpurl import hub
from gpurl.config import ConfigError, ModelConfig
from gpurl.models import families, lora, vision
from gpurl.models.hf import (FULL, HF_ACTIVATIONS, SLIDING, check_layout, config_from_dict,
                             leaf_at,
                             hf_layout, read_hf_config)
from gpurl.models.safetensors_io import write_tensors
from gpurl.models.spec import Params

_IGNORED_FIELDS = ("name", "checkpoint", "tokenizer", "dtype", "param_dtype", "attention",
                   "init_std", "max_seq_len")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "generation_config.json")


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """config.json for `cfg` in the classic form; ConfigError if its family cannot hold it."""
    fam = families.get(cfg.family).hf
    hf: dict[str, Any] = {
        "architectures": [fam.architecture], "model_type": fam.model_types[0],
        "torch_dtype": cfg.param_dtype, "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, fam.act_key: HF_ACTIVATIONS[cfg.activation],
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": cfg.max_seq_len, "rope_theta": _number(cfg.rope_theta),
        "rope_scaling": _rope_scaling_dict(cfg)}
    if fam.qkv_bias is None:
        hf["attention_bias"] = False
    hf.update(fam.export_keys)
    if fam.layer_types:
        hf.update(query_pre_attn_scalar=_number(cfg.query_pre_attn_scalar or cfg.head_dim),
                  sliding_window=cfg.sliding_window, attn_logit_softcapping=cfg.attn_softcap,
                  final_logit_softcapping=cfg.final_softcap,
                  layer_types=[FULL if cfg.is_global(i) else SLIDING for i in range(cfg.num_layers)])
    if fam.local_rope:
        hf["rope_local_base_freq"] = _number(cfg.rope_local_theta or cfg.rope_theta)
    if fam.moe:
        moe = cfg.moe
        hf.update(num_experts=moe.num_experts, num_experts_per_tok=moe.experts_per_token,
                  moe_intermediate_size=moe.expert_mlp_dim, norm_topk_prob=moe.norm_topk_prob,
                  decoder_sparse_step=moe.sparse_step, mlp_only_layers=list(moe.dense_layers),
                  router_aux_loss_coef=0.001 if moe.aux_loss_coef is None else moe.aux_loss_coef)
    _check_expressible(cfg, hf)
    return hf


def _rope_scaling_dict(cfg: ModelConfig) -> dict[str, Any] | None:
    if cfg.rope_scaling == "none":
        return None
    out: dict[str, Any] = {"rope_type": cfg.rope_scaling, "factor": cfg.rope_scaling_factor}
    if cfg.rope_scaling == "llama3":
        out.update(low_freq_factor=cfg.rope_low_freq_factor,
                   high_freq_factor=cfg.rope_high_freq_factor,
                   original_max_position_embeddings=cfg.rope_original_max_len)
    return out


def _canonical(cfg: ModelConfig) -> dict[str, Any]:
    """Architecture fields with equivalent settings written one way (e.g. None = head_dim)."""
    out = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
           if f.name not in _IGNORED_FIELDS}
    out["query_pre_attn_scalar"] = float(cfg.query_pre_attn_scalar or cfg.head_dim)
    out["rope_local_theta"] = cfg.rope_local_theta or cfg.rope_theta
    if all(cfg.is_global(i) for i in range(cfg.num_layers)):
        out.update(sliding_window=None, global_every=1, rope_local_theta=cfg.rope_theta)
    out["global_every"] = min(out["global_every"], cfg.num_layers + 1)
    default = ModelConfig()
    unused = {"none": ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_len"),
              "linear": ("rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len"),
              "llama3": ()}[cfg.rope_scaling]
    out.update({k: getattr(default, k) for k in unused})
    return out


def _check_expressible(cfg: ModelConfig, hf: dict[str, Any]) -> None:
    """Read the config back; any field that changed is one the family cannot represent."""
    try:
        back = _canonical(config_from_dict(hf, cfg, source="the exported config"))
    except ConfigError as e:
        raise ConfigError(f"model={cfg.name} cannot be exported as {cfg.family}: {e}") from None
    wanted = _canonical(cfg)
    diff = {k: (wanted[k], back[k]) for k in wanted if wanted[k] != back[k]}
    if diff:
        shown = ", ".join(f"{k}={a!r} (a {cfg.family} checkpoint holds {b!r})" for k, (a, b) in diff.items())
        raise ConfigError(f"model={cfg.name} cannot be exported as model.family={cfg.family}: "
                          f"{shown}; choose the family whose architecture has these features.")


def host(x: Any) -> np.ndarray:
    """One parameter on the host; a multi-process array is gathered (a collective)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def _special_ids(tokenizer_dir: str | Path | None) -> dict[str, Any]:
    """bos/eos/pad ids of the checkpoint the tokenizer came from (the family defaults are
    Gemma's or Llama 2's, wrong for e.g. Llama 3 or Qwen)."""
    file = Path(tokenizer_dir or "") / "config.json"
    if tokenizer_dir is None or not file.is_file():
        return {}
    src = read_hf_config(file.parent)
    return {k: src[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in src}


def _copy_tokenizer(tokenizer_dir: str | Path, out: Path) -> None:
    src = Path(tokenizer_dir)
    files = [src / f for f in TOKENIZER_FILES if (src / f).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer.model") for f in files):
        raise ConfigError(f"no tokenizer.json in {src}; pass the directory of the checkpoint "
                          f"the model came from as tokenizer_dir.")
    for f in files:
        shutil.copyfile(f, out / f.name)


def export_hf(params: Params, cfg: ModelConfig, out_dir: str | Path,
              tokenizer_dir: str | Path | None = None,
              extra: dict[str, np.ndarray] | None = None) -> Path:
    """Write `params` as a HF checkpoint (config.json, model.safetensors, tokenizer files).

    Every process must call it (sharded arrays are gathered collectively); process 0 writes.
    One tensor at a time is on the host. `extra` adds host tensors by HF name (a reward
    model's score head).
    """
    out = Path(out_dir)
    hf = {**hf_config_dict(cfg), **_special_ids(tokenizer_dir)}
    layout = hf_layout(cfg)
    names = [t.name for t in layout]
    if "vision" in params:  # a vision-language model: Gemma3ForConditionalGeneration
        tower, params = params["vision"], {k: v for k, v in params.items() if k != "vision"}
        names = ["language_model." + n for n in names]
        extra = {**(extra or {}), **vision.hf_tensors(jax.tree.map(host, tower),
                                                      vision.VisionSpec.of(cfg))}
        hf = vision.hf_config(cfg, hf)
    check_layout(layout, params)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    entries = [(n, np.dtype(leaf_at(params, t.path).dtype), t.shape) for n, t in zip(names, layout)]
    extra = list((extra or {}).items())
    entries += [(name, x.dtype, x.shape) for name, x in extra]

    def fetch(i: int) -> np.ndarray:
        if i >= len(layout):
            return extra[i - len(layout)][1]
        t = layout[i]
        leaf = leaf_at(params, t.path)
        return t.host_value(host(leaf[t.index()] if t.index() else leaf))

    write_tensors(out / "model.safetensors" if writer else None, entries, fetch, {"format": "pt"})
    if writer:
        (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        if tokenizer_dir is not None:
            _copy_tokenizer(tokenizer_dir, out)
    return out


# ---------------------------------------------------------------------------- PEFT export

def _peft_targets(cfg: ModelConfig, names: list[str]) -> list[str] | str:
    """PEFT's target_modules: short names ("q_proj") when every layer is adapted alike,
    else a regex PEFT full-matches against module names."""
    short = sorted({n.rsplit(".", 1)[-1] for n in names})
    if len(names) == len(short) * cfg.num_layers:
        return short
    return "|".join(re.escape(n) for n in names)


def export_peft(params: Any, cfg: ModelConfig, out_dir: str | Path,
                base_model: str | None = None) -> Path:
    """The adapters alone in PEFT's layout (adapter_config.json, adapter_model.safetensors),
    loadable with `peft.PeftModel.from_pretrained` on the HF export of the base. Every
    process must call it (sharded arrays are gathered); process 0 writes."""
    hf_names = {"/".join(map(str, (t.path[0], t.layer, *t.path[1:]) if t.layer is not None
                             else t.path)): t.name.removesuffix(".weight") for t in hf_layout(cfg)}
    entries, sources, modules = [], [], []
    for path in lora.target_paths(cfg):
        _, layer, parent, name = path.split("/")
        adapter = lora.node_at(params, f"blocks/{parent}")[name + lora.SUFFIX]
        module = hf_names[path]
        modules.append(module)
        in_ndim = lora.PROJECTIONS[parent, name]
        # Ours: A (*in, r), B (r, *out), delta = A @ B (in x out). PEFT's nn.Linear weights
        # are out x in: lora_A (r, in), lora_B (out, r), delta^T = lora_B @ lora_A.
        for part, stacked in (("lora_A", adapter["a"]), ("lora_B", adapter["b"])):
            leaf = stacked[int(layer)]
            rows = math.prod(leaf.shape[:in_ndim]) if part == "lora_A" else leaf.shape[0]
            entries.append((f"base_model.model.{module}.{part}.weight", np.dtype(leaf.dtype),
                            (leaf.size // rows, rows)))
            sources.append(leaf)

    def fetch(i: int) -> np.ndarray:
        return host(sources[i]).reshape(entries[i][2][::-1]).T

    out = Path(out_dir)
    writer = jax.process_index() == 0
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    write_tensors(out / "adapter_model.safetensors" if writer else None, entries, fetch,
                  {"format": "pt"})
    if writer:
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank,
                  "lora_alpha": cfg.lora.alpha, "lora_dropout": cfg.lora.dropout,
                  "target_modules": _peft_targets(cfg, modules), "bias": "none",
                  "fan_in_fan_out": False, "use_rslora": False, "inference_mode": True,
                  "base_model_name_or_path": base_model}
        if base_model and hub.is_hub_id(base_model):  # org/name@commit: PEFT's revision key
            config["base_model_name_or_path"], config["revision"] = hub.split_id(base_model)
        (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
