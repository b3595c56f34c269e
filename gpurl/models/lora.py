"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3):
a targeted projection computes h = x W + (alpha / r) * dropout(x) A B, with A (in x r)
drawn like PEFT's kaiming-uniform init and B (r x out) zero, so a fresh adapter leaves
the model exactly as it was.

Adapters are ordinary parameters of the model graph, beside the weight they adapt:
"blocks/3/attn/q" gets "blocks/3/attn/q_lora/a" and ".../b". The parameter tree thus
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
BASE_PATTERN = rf"^(?!.*{SUFFIX}/)(.*/)?(embed|lm_head|final_norm/scale|blocks/\d+/.+)$"


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
    """Paths ("blocks/3/attn/q") of the projections `model.lora.targets` selects."""
    candidates = [f"blocks/{i}/{module}/{name}" for i in range(cfg.num_layers)
                  for module, name in PROJECTIONS]
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
    """x (..., *in) -> (alpha / r) * dropout(x) A B (..., *out) for one weight (*in, *out)."""

    def __init__(self, weight: nnx.Param, in_ndim: int, cfg: LoraConfig, index: int,
                 rngs: nnx.Rngs):
        shape, axes = weight.shape, weight.get_metadata()["logical_axes"]
        r, dtype = cfg.rank, weight.dtype
        bound = 1.0 / math.sqrt(math.prod(shape[:in_ndim]))  # kaiming_uniform(a=sqrt(5))
        a = jax.random.uniform(rngs.params(), shape[:in_ndim] + (r,), jnp.float32, -bound, bound)
        self.a = nnx.Param(a.astype(dtype), logical_axes=axes[:in_ndim] + ("lora_rank",))
        self.b = nnx.Param(jnp.zeros((r,) + shape[in_ndim:], dtype),
                           logical_axes=("lora_rank",) + axes[in_ndim:])
        self.in_ndim, self.scale, self.rate, self.index = in_ndim, cfg.alpha / r, cfg.dropout, index

    def __call__(self, x: jax.Array) -> jax.Array:
        key = _DROPOUT_KEY.get()
        if self.rate > 0 and key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(key, self.index), 1.0 - self.rate,
                                        x.shape)
            x = jnp.where(keep, x / (1.0 - self.rate), 0.0).astype(x.dtype)
        h = jnp.tensordot(x, self.a[...].astype(x.dtype), axes=self.in_ndim)
        return jnp.tensordot(h * jnp.asarray(self.scale, x.dtype), self.b[...].astype(x.dtype),
                             axes=1)


def adapted(module: nnx.Module, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """`y` = x @ module.name plus the adapter's term when `name` is adapted."""
    adapter = getattr(module, name + SUFFIX, None)
    return y if adapter is None else y + adapter(x)


def attach(model: nnx.Module, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
    """Adds an adapter beside every targeted projection of a built `Transformer`. Called
    after the base is built, so the base draws the same random init as without LoRA."""
    for index, path in enumerate(target_paths(cfg)):
        _, layer, module, name = path.split("/")
        owner = getattr(model.blocks[int(layer)], module)
        setattr(owner, name + SUFFIX, LoraAdapter(getattr(owner, name), PROJECTIONS[module, name],
                                                  cfg.lora, index, rngs))


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
    """Base parameters with every adapter folded in: W + (alpha / r) A B (under jit, each
    weight keeps its sharding). A model built with `base_config(cfg)` runs them."""
    paths = target_paths(cfg)
    scale = cfg.lora.alpha / cfg.lora.rank

    def fold(params: Any) -> Any:
        base = strip(params)
        for path in paths:
            *parents, name = path.split("/")
            owner = node_at(base, "/".join(parents))
            adapter = node_at(params, "/".join(parents))[name + SUFFIX]
            w = owner[name]
            delta = jnp.tensordot(adapter["a"].astype(jnp.float32),
                                  adapter["b"].astype(jnp.float32), axes=1)
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
