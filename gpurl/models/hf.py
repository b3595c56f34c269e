"""Hugging Face checkpoints: config.json -> ModelConfig, safetensors -> sharded params (export: hf_export.py).

Loading never holds a whole model on one device or on the host: every tensor stays a lazy
slice of the memory-mapped file (a `LazyTensor`: transposes, reshapes and indexing read
nothing), and `jax.make_array_from_callback` reads only the slice each device owns. Export
writes the classic `rope_theta`/`rope_scaling` config form, which transformers 4.x and 5.x
both read.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np

from gpurl.config import ConfigError, ModelConfig, MoEConfig
from gpurl.models import families
from gpurl.models.families import HFFamily
from gpurl.models.safetensors_io import LazyTensor, open_checkpoint
from gpurl.models.spec import ModelSpec, Params
from gpurl.models.transformer import layer_stacks
from gpurl.models import vision
from gpurl.models.vision import vision_config_from_hf


_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "silu": "silu",
                "swish": "silu"}
HF_ACTIVATIONS = {"gelu_tanh": "gelu_pytorch_tanh", "silu": "silu"}
FULL, SLIDING = "full_attention", "sliding_attention"


# ---------------------------------------------------------------------------- config.json


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """config.json of a checkpoint; a multimodal one yields its text_config (with model_type)."""
    path = Path(path)
    file = (path.parent if path.is_file() else path) / "config.json"
    try:
        hf = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no config.json at {file}; set model.checkpoint to a Hugging Face "
                          f"checkpoint directory.") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{file} is not valid JSON ({e}); re-download the checkpoint.") from None
    if isinstance(hf.get("text_config"), dict):
        text = {"tie_word_embeddings": hf.get("tie_word_embeddings", True), **hf["text_config"]}
        text.setdefault("model_type", hf.get("model_type"))
        return text
    return hf


def model_config_from_hf(path: str | Path, base: ModelConfig) -> ModelConfig:
    """`base` with every architecture field taken from the checkpoint's config.json; a
    vision-language `base` (model.vision.layers > 0) takes its tower's fields too."""
    hf, vision = read_hf_config(path), None
    if base.vision.layers:  # else a text model, even from a multimodal checkpoint
        file = Path(path)
        raw = json.loads(((file.parent if file.is_file() else file) / "config.json").read_text())
        vision = vision_config_from_hf(raw, base.vision, str(path))
    return config_from_dict(hf, base, source=str(path), vision=vision)



def config_from_dict(hf: dict[str, Any], base: ModelConfig, source: str,
                     vision: Any = None) -> ModelConfig:
    family = families.by_model_type(hf.get("model_type"))
    if family is None:
        known = sorted(t for f in families.FAMILIES.values() for t in f.hf.model_types)
        raise ConfigError(f"{source} holds a {hf.get('model_type')!r} model; gpurl loads "
                          f"model_type {', '.join(known)}; use a checkpoint of one of them.")
    fam = family.hf

    def get(key: str) -> Any:
        return hf.get(key, fam.defaults.get(key))

    _check_unsupported(hf, fam, source)
    heads, d = get("num_attention_heads"), get("hidden_size")
    fields = dict(
        family=family.name, vocab_size=get("vocab_size"), d_model=d, num_layers=get("num_hidden_layers"),
        num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads,
        head_dim=get("head_dim") or d // heads, mlp_dim=get("intermediate_size"),
        activation=_activation(hf, fam, source), norm_eps=hf.get("rms_norm_eps", 1e-6),
        norm_plus_one=fam.gemma, scale_embeddings=fam.gemma, post_norms=fam.post_norms,
        qk_norm=fam.qk_norm, qkv_bias=bool(fam.qkv_bias),
        tie_embeddings=bool(get("tie_word_embeddings")), query_pre_attn_scalar=None,
        attn_softcap=None, final_softcap=None)
    if fam.layer_types:
        fields.update(query_pre_attn_scalar=float(get("query_pre_attn_scalar")),
                      attn_softcap=_float_or_none(get("attn_logit_softcapping")),
                      final_softcap=_float_or_none(get("final_logit_softcapping")))
    fields.update(_window_fields(hf, fam, fields["num_layers"], source))
    fields.update(_rope_fields(hf, fam, fields["sliding_window"] is not None, source))
    fields["moe"] = _moe_config(hf, fam, base.moe) if fam.moe else dataclasses.replace(
        base.moe, num_experts=0)
    if vision is not None:  # a vision-language model's tower (`vision_config_from_hf`)
        fields["vision"] = vision
    return dataclasses.replace(base, **fields)


def _moe_config(hf: dict[str, Any], fam: HFFamily, base: MoEConfig) -> MoEConfig:
    """The experts of a mixture-of-experts config.json (transformers 5 writes
    num_local_experts, older files num_experts); the training terms stay `base`'s."""
    def get(key: str) -> Any:
        return hf.get(key, fam.defaults.get(key))

    experts = hf.get("num_local_experts", get("num_experts"))
    return dataclasses.replace(
        base, num_experts=int(experts), experts_per_token=int(get("num_experts_per_tok")),
        expert_mlp_dim=int(get("moe_intermediate_size")), norm_topk_prob=bool(get("norm_topk_prob")),
        sparse_step=int(get("decoder_sparse_step")),
        dense_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))


def _float_or_none(x: Any) -> float | None:
    return None if x is None else float(x)


def _check_unsupported(hf: dict[str, Any], fam: HFFamily, source: str) -> None:
    unsupported = {"attention_bias": fam.qkv_bias is None, "mlp_bias": True,
                   "use_bidirectional_attention": True, "use_sliding_window": True}
    for key, checked in unsupported.items():
        if checked and hf.get(key):
            raise ConfigError(f"{source} sets {key}=true, which gpurl's decoder does not "
                              f"implement; use a checkpoint without it.")


def _activation(hf: dict[str, Any], fam: HFFamily, source: str) -> str:
    name = hf.get(fam.act_key) or hf.get("hidden_activation") or fam.defaults[fam.act_key]
    name = fam.activation_aliases.get(name, name)
    if name not in _ACTIVATIONS:
        raise ConfigError(f"{source} uses activation {name!r}; gpurl supports "
                          f"{', '.join(_ACTIVATIONS)}.")
    return _ACTIVATIONS[name]


def _window_fields(hf: dict[str, Any], fam: HFFamily, num_layers: int, source: str) -> dict[str, Any]:
    """Sliding window and global_every from layer_types (or the older sliding_window_pattern)."""
    if not fam.layer_types:  # Llama and Qwen windows are refused by _check_unsupported
        return {"sliding_window": None, "global_every": 1}
    types = hf.get("layer_types")
    if types is None:
        pattern = (hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                   or fam.defaults["sliding_window_pattern"])
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {FULL, SLIDING}:
        raise ConfigError(f"{source} has layer_types {types}, not {num_layers} of "
                          f"{FULL!r}/{SLIDING!r}; use a checkpoint of a supported model.")
    window = hf.get("sliding_window", fam.defaults["sliding_window"])
    if SLIDING not in types or window is None:
        return {"sliding_window": None, "global_every": 1}
    every = types.index(FULL) + 1 if FULL in types else num_layers + 1
    if any((t == FULL) != ((i + 1) % every == 0) for i, t in enumerate(types)):
        raise ConfigError(
            f"{source} has global layers at {[i for i, t in enumerate(types) if t == FULL]}; gpurl "
            f"needs layer i global iff (i + 1) % global_every == 0; use a checkpoint with a "
            f"regular pattern.")
    return {"sliding_window": int(window), "global_every": every}


def _rope_tables(hf: dict[str, Any], fam: HFFamily) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(global, sliding-layer) RoPE parameters from `rope_parameters` or the classic keys."""
    theta = hf.get("rope_theta", fam.defaults.get("rope_theta", 10_000.0))
    glob = {"rope_theta": theta, **(hf.get("rope_scaling") or {})}
    local = ({"rope_theta": hf.get("rope_local_base_freq", fam.defaults["rope_local_base_freq"])}
             if fam.local_rope else None)
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:  # transformers 5, one table per layer type
        glob.update(params.get(FULL) or {})
        if params.get(SLIDING):
            local = {**(local or {"rope_theta": glob["rope_theta"]}), **params[SLIDING]}
    else:
        glob.update(params)
    return glob, local


def _rope_kind(table: dict[str, Any] | None) -> str:
    return (table or {}).get("rope_type", (table or {}).get("type")) or "default"


def _rope_fields(hf: dict[str, Any], fam: HFFamily, has_local: bool, source: str) -> dict[str, Any]:
    glob, local = _rope_tables(hf, fam)
    kind, local_kind = _rope_kind(glob), _rope_kind(local)
    if has_local and not fam.local_rope:
        local_kind = kind  # one rotary table for all layers (Gemma 2)
    if kind not in ("default", "linear", "llama3") or local_kind != "default":
        raise ConfigError(f"{source} uses RoPE {kind!r} on global and {local_kind!r} on sliding "
                          f"layers; gpurl supports default, linear or llama3 on global layers and "
                          f"default on sliding ones, use a checkpoint without this scaling.")
    if glob.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source} sets partial_rotary_factor; gpurl rotates whole heads, use "
                          f"a checkpoint without it.")
    theta = float(glob["rope_theta"])
    local_theta = float(local["rope_theta"]) if local else None
    if not fam.local_rope and local_theta not in (None, theta):
        raise ConfigError(f"{source} gives sliding layers their own RoPE base, which gpurl "
                          f"supports only for gemma3.")
    out: dict[str, Any] = {"rope_theta": theta, "rope_scaling": "none",
                           "rope_local_theta": local_theta if fam.local_rope else None}
    if kind != "default":
        out.update(rope_scaling=kind, rope_scaling_factor=float(glob["factor"]))
    if kind == "llama3":
        out.update(rope_low_freq_factor=float(glob["low_freq_factor"]),
                   rope_high_freq_factor=float(glob["high_freq_factor"]),
                   rope_original_max_len=int(glob.get("original_max_position_embeddings",
                                                      hf.get("max_position_embeddings", 2048))))
    return out


# ------------------------------------------------------------------- parameter layout


@dataclass(frozen=True)
class HFTensor:
    """One HF tensor: the parameter of gpurl's tree it is (with `layer`, that layer's slice
    of a stacked parameter), its HF name and shape, and whether gpurl stores it transposed
    (a linear layer: HF [out, in], gpurl [in, ...out])."""

    path: tuple[Any, ...]
    name: str
    shape: tuple[int, ...]
    transpose: bool = False
    layer: int | None = None  # index in the stack (`layer_stacks`), not the layer's number
    expert: int | None = None  # index on the experts axis (a mixture-of-experts weight)

    def index(self) -> tuple[int, ...]:
        """Where this tensor sits in its leaf: (stack index[, expert])."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)

    def host_value(self, leaf: np.ndarray) -> np.ndarray:
        """This tensor in HF's layout from gpurl's host value of its (layer of the) leaf."""
        x = np.asarray(leaf)
        return x.reshape(self.shape[::-1]).T if self.transpose else x.reshape(self.shape)


_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_SANDWICH_NORMS = {"attn_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
                   "mlp_norm": "pre_feedforward_layernorm",
                   "post_mlp_norm": "post_feedforward_layernorm"}


def hf_layout(cfg: ModelConfig) -> list[HFTensor]:
    d, v = cfg.d_model, cfg.vocab_size
    out = [HFTensor(("embed",), "model.embed_tokens.weight", (v, d))]
    for i in range(cfg.num_layers):
        out += _block_layout(cfg, i)
    out.append(HFTensor(("final_norm", "scale"), "model.norm.weight", (d,)))
    if not cfg.tie_embeddings:
        out.append(HFTensor(("lm_head",), "lm_head.weight", (v, d), transpose=True))
    return out


def _block_layout(cfg: ModelConfig, i: int) -> list[HFTensor]:
    d, f, e = cfg.d_model, cfg.mlp_dim, cfg.head_dim
    heads = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}
    stack, index = layer_stacks(cfg)[i]

    def t(path: tuple[str, ...], name: str, shape: tuple[int, ...],
          transpose: bool = False, expert: int | None = None) -> HFTensor:
        return HFTensor((stack,) + path, f"model.layers.{i}.{name}", shape, transpose, index, expert)

    out = [t(("attn", x), f"self_attn.{x}_proj.weight", (n * e, d), True) for x, n in heads.items()]
    out.append(t(("attn", "o"), "self_attn.o_proj.weight", (d, cfg.num_heads * e), True))
    if cfg.qkv_bias:
        out += [t(("attn", f"{x}_bias"), f"self_attn.{x}_proj.bias", (n * e,)) for x, n in heads.items()]
    if cfg.qk_norm:
        out += [t(("attn", f"{x}_norm", "scale"), f"self_attn.{x}_norm.weight", (e,)) for x in "qk"]
    norms = _SANDWICH_NORMS if cfg.post_norms else _NORMS
    out += [t((ours, "scale"), f"{theirs}.weight", (d,)) for ours, theirs in norms.items()]
    if cfg.moe.is_sparse(i):
        fx = cfg.moe.expert_mlp_dim
        out.append(t(("moe", "router"), "mlp.gate.weight", (cfg.moe.num_experts, d), True))
        for j in range(cfg.moe.num_experts):
            out += [t(("moe", x), f"mlp.experts.{j}.{x}_proj.weight", (fx, d), True, j)
                    for x in ("gate", "up")]
            out.append(t(("moe", "down"), f"mlp.experts.{j}.down_proj.weight", (d, fx), True, j))
        return out
    out += [t(("mlp", x), f"mlp.{x}_proj.weight", (f, d), True) for x in ("gate", "up")]
    out.append(t(("mlp", "down"), "mlp.down_proj.weight", (d, f), True))
    return out


def leaf_at(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[Any, ...], value: Any) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def check_layout(layout: list[HFTensor], abstract: Params) -> None:
    ours = {tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
            for path, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    mapped = {t.path for t in layout}
    if ours != mapped:
        raise RuntimeError(f"gpurl/models/hf.py maps {sorted(map(str, mapped - ours))} but the model "
                           f"has {sorted(map(str, ours - mapped))}; update hf_layout to the model.")


# ---------------------------------------------------------------------------- loading

# Multimodal Gemma 3 nests the text model; transformers 4 and 5 name it differently.
_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
             ("language_model.lm_head.", "lm_head."))
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|^(model\.)?(vision_tower|multi_modal_projector)\.")


def _text_tensors(path: Path) -> dict[str, LazyTensor]:
    out = {}
    for name, view in open_checkpoint(path).items():
        if _IGNORED.search(name):
            continue
        for old, new in _PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = view
    return _split_fused_experts(out)


_FUSED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def _split_fused_experts(tensors: dict[str, LazyTensor]) -> dict[str, LazyTensor]:
    """Per-expert views of fused expert tensors (transformers 5's in-memory layout,
    `experts.gate_up_proj` E x 2F x D and `experts.down_proj` E x D x F) under the
    per-expert names checkpoints on the Hub use (`experts.{j}.gate_proj.weight`, ...)."""
    out = {}
    for name, view in tensors.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = view
            continue
        prefix, kind = match.groups()
        for j in range(view.shape[0]):
            if kind == "down_proj":
                out[f"{prefix}.{j}.down_proj.weight"] = view[j]
            else:
                half = view.shape[1] // 2
                out[f"{prefix}.{j}.gate_proj.weight"] = view[j, :half]
                out[f"{prefix}.{j}.up_proj.weight"] = view[j, half:]
    return out


def _mismatch(path: Path, cfg: ModelConfig, problem: str) -> ConfigError:
    try:
        hf = read_hf_config(path)
        what = (f"a {hf.get('model_type')} model with {hf.get('num_hidden_layers')} layers, "
                f"hidden_size {hf.get('hidden_size')}, vocab {hf.get('vocab_size')}")
    except ConfigError:
        what = "a checkpoint without a readable config.json"
    return ConfigError(
        f"the checkpoint at {path} is {what}; it does not fit model={cfg.name} ({cfg.family}, "
        f"{cfg.num_layers} layers, d_model {cfg.d_model}, vocab {cfg.vocab_size}): {problem}; "
        f"build the model config from the checkpoint (model_config_from_hf) or point "
        f"model.checkpoint at a matching checkpoint.")


def _check_names(layout: list[HFTensor], tensors: dict[str, LazyTensor], path: Path,
                 cfg: ModelConfig) -> None:
    expected = {t.name: t.shape for t in layout}
    missing = [f"{n} {expected[n]}" for n in expected if n not in tensors]
    # Tied checkpoints sometimes store the shared matrix twice; transformers ignores it.
    extra = [n for n in tensors if n not in expected and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if missing:
        raise _mismatch(path, cfg, f"tensors missing (expected shape in brackets): {missing[:5]}"
                                   f"{' ...' if len(missing) > 5 else ''}")
    if extra:
        raise _mismatch(path, cfg, f"unexpected tensors {extra[:5]}{' ...' if len(extra) > 5 else ''}")


def load_hf_params(path: str | Path, spec: ModelSpec, shardings: Params,
                   extra: tuple[str, ...] = ()) -> Params:
    """Params of `spec` from a HF safetensors checkpoint, each tensor built on its shards.

    `shardings` has the structure of `spec.abstract_params` with `NamedSharding` leaves;
    every device reads only its own slice of the memory-mapped file (a stacked layer
    parameter: its slice of each layer's tensor). Tensors named in `extra` (a reward
    model's score head) are left to the caller.
    """
    path, cfg = Path(path), spec.cfg
    layout = hf_layout(cfg)
    text = {k: v for k, v in spec.abstract_params.items() if k != "vision"}
    check_layout(layout, text)
    tensors = {n: v for n, v in _text_tensors(path).items() if n not in extra}
    _check_names(layout, tensors, path, cfg)
    views: dict[tuple, dict[tuple[int, ...], LazyTensor]] = {}  # a leaf's views by `index()`
    for t in layout:
        view, target = tensors[t.name], leaf_at(spec.abstract_params, t.path)
        if tuple(view.shape) != t.shape:
            raise _mismatch(path, cfg, f"tensor {t.name} has shape {tuple(view.shape)}, expected "
                                       f"{t.shape}")
        shape = target.shape[len(t.index()):]
        views.setdefault(t.path, {})[t.index()] = (view.T if t.transpose else view).reshape(shape)
    params: Params = {}
    for leaf_path, parts in views.items():  # views, no copy, until a device reads its slice
        target = leaf_at(spec.abstract_params, leaf_path)
        _set(params, leaf_path, jax.make_array_from_callback(
            target.shape, leaf_at(shardings, leaf_path),
            lambda index, parts=parts, dt=target.dtype: _read(parts, index, dt)))
    if "vision" in spec.abstract_params:  # the tower: small, read whole and placed
        tower = vision.load_hf(vision.VisionSpec.of(cfg), open_checkpoint(path))
        params["vision"] = jax.tree.map(
            lambda x, a, sh: jax.device_put(x.astype(a.dtype), sh), tower,
            spec.abstract_params["vision"], shardings["vision"])
    return params


def _read(parts: dict[tuple[int, ...], LazyTensor], index: tuple, dtype: Any) -> np.ndarray:
    """The slice `index` of a parameter from its lazy views, keyed by their place
    on the leaf's stacked leading axes (layers, then experts; () for an unstacked leaf)."""
    depth = len(next(iter(parts)))
    if depth == 0:
        return np.array(parts[()][index], dtype, order="C")
    sizes = [1 + max(k[d] for k in parts) for d in range(depth)]
    lead = [range(n)[i] for n, i in zip(sizes, index[:depth])]
    rest = index[depth:]
    out = np.stack([np.asarray(parts[k][rest], dtype) for k in _product(lead)])
    return out.reshape(tuple(len(r) for r in lead) + out.shape[1:])


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    keys: list[tuple[int, ...]] = [()]
    for r in ranges:
        keys = [k + (i,) for k in keys for i in r]
    return keys
