"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3):
a targeted projection computes h = x W + (alpha / r) * dropout(x) A B, with A (in x r)
drawn like PEFT's kaiming-uniform init and B (r x out) zero, so a fresh adapter leaves
the model exactly as it was.

Adapters are ordinary parameters of the model graph, beside the weight they adapt:
"blocks/attn/q" gets "blocks/attn/q_lora/a" and ".../b" (stacked over layers like the weight;
`model.lora.targets` chooses layers by per-layer paths such as "blocks/3/attn/q"). The parameter tree thus
holds base and adapters together, and everything that runs the model (the train step,
the sampler, reference log-probs) needs no LoRA branch. What LoRA changes is which part
of that tree moves: with adapters present, every base parameter is frozen
(`frozen_base`), which keeps it out of the gradient, the optimizer state, the
checkpoint and, after the first, every weight sync.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import fnmatch
import math
import re
from typing import Any, Iterator

import jax
import jax.numpy as jnp
from flax import nnx

from gpurl.config import ConfigError, LoraConfig, ModelConfig, OptimConfig
from gpurl.models.paths import param_path

SUFFIX = "_lora"  # "q" is adapted by "q_lora": {"a": in x r, "b": r x out}
# (module, weight) -> how many leading axes of the weight are its input
PROJECTIONS = {("attn", "q"): 1, ("attn", "k"): 1, ("attn", "v"): 1, ("attn", "o"): 2,
               ("mlp", "gate"): 1, ("mlp", "up"): 1, ("mlp", "down"): 1}
# Paths of a decoder's own (non-adapter) parameters, at any depth of a larger tree (PPO's
# {"policy": ..., "critic": ...}); a critic's score vector or other heads stay trainable.
BASE_PATTERN = rf"^(?!.*{SUFFIX}/)(.*/)?(embed|lm_head|final_norm/scale|blocks/.+)$"


def enabled(cfg: ModelConfig) -> bool:
    return cfg.lora.rank > 0


def base_config(cfg: ModelConfig) -> ModelConfig:
    """The same model without adapters."""
    return dataclasses.replace(cfg, lora=LoraConfig())


def _matches(pattern: str, path: str) -> bool:
    if fnmatch.fnmatchcase(path, pattern):
        return True
    try:
        return re.search(pattern, path) is not None
    except re.error:  # "*/q" is a glob only
        return False


def target_paths(cfg: ModelConfig) -> list[str]:
    """Paths ("blocks/3/attn/q": layer 3's q) of the projections `model.lora.targets` selects.
    The parameters of all layers are stacked ("blocks/attn/q" with a leading layers axis);
    these per-layer paths are how adapters are chosen and exported."""
    # a mixture-of-experts layer's MLP is its experts, which take no adapters
    candidates = [f"blocks/{i}/{module}/{name}" for i in range(cfg.num_layers)
                  for module, name in PROJECTIONS
                  if not (module == "mlp" and cfg.moe.is_sparse(i))]
    chosen = set()
    for pattern in cfg.lora.targets:
        hits = {p for p in candidates if _matches(pattern, p)}
        if not hits:
            raise ConfigError(
                f"model.lora.targets pattern {pattern!r} matches no projection; use globs or "
                f"regexes over paths like blocks/0/attn/q (attn q, k, v, o and mlp gate, up, "
                f"down of blocks 0..{cfg.num_layers - 1}).")
        chosen |= hits
    return [p for p in candidates if p in chosen]


# ---------------------------------------------------------------------------- the module

# The train step sets a key here while it traces the loss; every other forward pass
# (sampling, reference and old log-probs, evaluation) runs without dropout. A context
# keeps the key out of the parameter tree and out of every objective's signature.
_DROPOUT_KEY: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "lora_dropout_key", default=None)


@contextlib.contextmanager
def dropout_key(key: jax.Array | None) -> Iterator[None]:
    """Adapter dropout draws from `key` for forward passes traced inside this block."""
    token = _DROPOUT_KEY.set(key)
    try:
        yield
    finally:
        _DROPOUT_KEY.reset(token)


class LoraAdapter(nnx.Module):
    """x (..., *in) -> (alpha / r) * dropout(x) A B (..., *out) for one weight (*in, *out).

    Layers are stacked, so a projection adapted in some layers has an adapter in every
    layer: `layers` (static, one flag per layer) zeroes the term of the others, whose A and
    B then get no gradient and stay as drawn (A zero, B zero)."""

    def __init__(self, weight: nnx.Param, in_ndim: int, cfg: LoraConfig, index: int,
                 layers: tuple[bool, ...], rngs: nnx.Rngs | None):
        shape, axes = weight.shape, weight.get_metadata()["logical_axes"]
        r, dtype = cfg.rank, weight.dtype
        bound = 1.0 / math.sqrt(math.prod(shape[:in_ndim]))  # kaiming_uniform(a=sqrt(5))
        a = (jnp.zeros(shape[:in_ndim] + (r,), jnp.float32) if rngs is None else
             jax.random.uniform(rngs.params(), shape[:in_ndim] + (r,), jnp.float32, -bound, bound))
        self.a = nnx.Param(a.astype(dtype), logical_axes=axes[:in_ndim] + ("lora_rank",))
        self.b = nnx.Param(jnp.zeros((r,) + shape[in_ndim:], dtype),
                           logical_axes=("lora_rank",) + axes[in_ndim:])
        self.in_ndim, self.scale, self.rate, self.index = in_ndim, cfg.alpha / r, cfg.dropout, index
        self.layers = None if all(layers) else layers

    def __call__(self, x: jax.Array, layer: jax.Array) -> jax.Array:
        key = _DROPOUT_KEY.get()
        if self.rate > 0 and key is not None:
            key = jax.random.fold_in(jax.random.fold_in(key, self.index), layer)
            keep = jax.random.bernoulli(key, 1.0 - self.rate, x.shape)
            x = jnp.where(keep, x / (1.0 - self.rate), 0.0).astype(x.dtype)
        h = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.in_ndim)
        scale = jnp.asarray(self.scale, x.dtype)
        if self.layers is not None:
            scale = scale * jnp.asarray(self.layers, x.dtype)[layer]
        return jnp.tensordot(h * scale, self.b[...].astype(x.dtype), axes=1)


def adapted(module: nnx.Module, name: str, x: jax.Array, y: jax.Array,
            layer: jax.Array) -> jax.Array:
    """`y` = x @ module.name plus the adapter's term when `name` is adapted."""
    adapter = getattr(module, name + SUFFIX, None)
    return y if adapter is None else y + adapter(x, layer)


def attach(blocks: list[nnx.Module], cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    """Adds adapters to the blocks of a `Transformer` before they are stacked: every layer
    gets one beside each projection targeted in any layer. Called after the base is built,
    and targeted adapters draw in `target_paths` order, so the base and the adapters draw
    the same random init as an unrolled stack."""
    targets = target_paths(cfg)
    names = list(dict.fromkeys(tuple(p.split("/")[2:]) for p in targets))
    flags = {n: tuple(f"blocks/{i}/{'/'.join(n)}" in targets for i in range(len(blocks)))
             for n in names}
    for path in [f"blocks/{i}/{m}/{w}" for i in range(len(blocks)) for m, w in PROJECTIONS]:
        _, layer, module, name = path.split("/")
        if (module, name) not in flags:
            continue
        owner = getattr(blocks[int(layer)], module)
        index = list(PROJECTIONS).index((module, name))
        setattr(owner, name + SUFFIX, LoraAdapter(
            getattr(owner, name), PROJECTIONS[module, name], cfg.lora, index,
            flags[module, name], rngs if path in targets else None))


# ---------------------------------------------------------------------------- the tree

def has_adapters(tree: Any) -> bool:
    return any(f"{SUFFIX}/" in param_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])


def frozen_base(tree: Any) -> Any:
    """Tree of bools: True for a decoder's own parameters when the tree holds adapters
    (LoRA on); all False otherwise."""
    if not has_adapters(tree):
        return jax.tree.map(lambda _: False, tree)
    base = re.compile(BASE_PATTERN)
    return jax.tree_util.tree_map_with_path(lambda p, _: bool(base.search(param_path(p))), tree)


def optim_config(optim: OptimConfig, model: ModelConfig) -> OptimConfig:
    """`optim` with the base frozen when LoRA is on (no gradient, no Adam moments)."""
    if not enabled(model):
        return optim
    return dataclasses.replace(optim, freeze=tuple(optim.freeze) + (BASE_PATTERN,))


def strip(params: Any) -> Any:
    """The base parameters: the tree without its adapters (no copy)."""
    if not isinstance(params, dict):
        return params
    return {k: strip(v) for k, v in params.items() if not str(k).endswith(SUFFIX)}


def node_at(tree: Any, path: str) -> Any:
    for key in path.split("/"):
        tree = tree[int(key) if key.isdigit() else key]  # layer indices are int keys
    return tree


def merged(params: Any, cfg: ModelConfig) -> Any:
    """Base parameters with every adapter folded in: W + (alpha / r) A B in the targeted
    layers (under jit, each weight keeps its sharding). A model built with
    `base_config(cfg)` runs them."""
    targets = target_paths(cfg)
    scale = cfg.lora.alpha / cfg.lora.rank

    def fold(params: Any) -> Any:
        base = strip(params)
        for module, name in dict.fromkeys(tuple(p.split("/")[2:]) for p in targets):
            owner = node_at(base, f"blocks/{module}")
            adapter = node_at(params, f"blocks/{module}")[name + SUFFIX]
            mask_L = jnp.asarray([f"blocks/{i}/{module}/{name}" in targets
                                  for i in range(cfg.num_layers)], jnp.float32)
            delta = jax.vmap(lambda a, b: jnp.tensordot(a, b, axes=1))(
                adapter["a"].astype(jnp.float32), adapter["b"].astype(jnp.float32))
            w = owner[name]
            delta = delta * mask_L.reshape((-1,) + (1,) * (delta.ndim - 1))
            owner[name] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
        return base

    shardings = jax.tree.map(lambda x: x.sharding, strip(params))
    return jax.jit(fold, out_shardings=shardings)(params)


def with_fresh_adapters(spec: Any, base: Any, shardings: Any, seed: int) -> Any:
    """`base` (a checkpoint's weights, without adapters) plus the adapters a fresh model
    of `spec` draws from `seed`, each created in its shards. The random base init inside
    the jitted call is dead code and never runs."""
    def adapters_only(tree: Any) -> Any:
        if not isinstance(tree, dict):
            return None
        out = {k: (v if str(k).endswith(SUFFIX) else adapters_only(v)) for k, v in tree.items()}
        return {k: v for k, v in out.items() if v}

    fresh = jax.jit(lambda: adapters_only(spec.init(seed)),
                    out_shardings=adapters_only(shardings))()

    def join(b: Any, a: Any) -> Any:
        if not isinstance(b, dict):
            return b
        out = {k: join(v, a.get(k, {}) if isinstance(a, dict) else {}) for k, v in b.items()}
        out.update({k: v for k, v in a.items() if str(k).endswith(SUFFIX)})
        return out

    return join(base, fresh)


def disabled(params: Any) -> Any:
    """`params` with every adapter's B at zero, so the model computes exactly its base:
    a LoRA run's reference model, sharing the base arrays (no second copy)."""
    def zero_b(path: tuple, x: Any) -> Any:
        keys = param_path(path).split("/")
        is_b = len(keys) > 1 and keys[-2].endswith(SUFFIX) and keys[-1] == "b"
        return jnp.zeros_like(x) if is_b else x
    return jax.tree_util.tree_map_with_path(zero_b, params)
