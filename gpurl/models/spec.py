"""What jitted code needs to run a decoder: its graph, parameter shapes and logical axes.

Parameters travel as plain nested dicts (`Params`): jitted code takes the parameter pytree
and merges it with the static graph definition inside the trace, so optimizer state,
checkpoints and shardings all work on plain pytrees.

Every trained tree has a spec with the same small interface (`abstract_params`,
`logical_axes`, `init`, and `policy` / `policy_params` for the language model inside it):
a language model (`ModelSpec`), a scalar-head model or PPO's policy with its critic
(`gpurl.models.scalar`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gpurl.config import ConfigError, ModelConfig
from gpurl.models import vision
from gpurl.models.transformer import (FLOAT32_READS, STACKS, KVCache, Layers, PromptKV,
                                      Transformer, compute_dtype, unrolled_sampling)

Params = dict[str, Any]
# (model config, language-model spec, shardings) -> the checkpoint's parameters placed on
# their shards, or None for a random init (`gpurl.models.loading.load_params`).
LoadLM = Callable[[ModelConfig, "ModelSpec", Any], "Params | None"]


@dataclass(frozen=True)
class ModelSpec:
    """A language model: the graph, the parameter shapes and axes."""

    cfg: ModelConfig
    graphdef: Any  # nnx.GraphDef, static under jit
    abstract_params: Params  # jax.ShapeDtypeStruct leaves
    logical_axes: Params  # same structure, tuple[str, ...] leaves

    def apply(self, params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array,
              segments_BxT: jax.Array, pixels: jax.Array | None = None) -> jax.Array:
        return self._merge(params)[0](tokens_BxT, positions_BxT, segments_BxT,
                                      self.image_embeds(params, pixels))

    def hidden(self, params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array,
               segments_BxT: jax.Array, cache: KVCache | PromptKV | None = None,
               routes: jax.Array | None = None, pixels: jax.Array | None = None,
               image_offsets: jax.Array | None = None):
        """Final-norm hidden states and the cache (`Transformer.hidden`); `params` stacked
        or a rollout's copy (`serving_params`). `pixels` (B x M x C x H x W): each row's
        images, its M image slots in the order its image tokens come (slots past a row's
        images are never read); `image_offsets` (B): image tokens of each row before these
        tokens (a prefill after a cached prefix)."""
        model, layers = self._merge(params)
        return model.hidden(tokens_BxT, positions_BxT, segments_BxT, cache, routes, layers,
                            self.image_embeds(params, pixels, image_offsets))

    def prompt_kv(self, params: Params, tokens_PxW: jax.Array, positions_PxW: jax.Array,
                  segments_PxW: jax.Array, group: int, pixels: jax.Array | None = None,
                  image_offsets: jax.Array | None = None) -> tuple[jax.Array, PromptKV]:
        """(final-norm hidden states of P prompts, their keys and values for `group`
        completions each to attend to with `hidden`)."""
        model, layers = self._merge(params)
        return model.prompt_kv(tokens_PxW, positions_PxW, segments_PxW, group, layers,
                               self.image_embeds(params, pixels, image_offsets))

    def image_embeds(self, params: Params, pixels_BxMxCxHxW: jax.Array | None,
                     offsets_B: jax.Array | None = None) -> jax.Array | None:
        """B x (M * I) x D: each row's image tokens' embeddings from its M images' pixels
        (the vision tower and projector, `params["vision"]`), from its `offsets_B`-th image
        token on (0 where None); None without pixels."""
        if pixels_BxMxCxHxW is None:
            return None
        if "vision" not in params:
            raise ConfigError(f"images were given to model={self.cfg.name}, which has no vision "
                              f"tower (model.vision.layers=0); use a vision-language model.")
        b, m = pixels_BxMxCxHxW.shape[:2]
        features_NxIxD = vision.image_features(params["vision"], vision.VisionSpec.of(self.cfg),
                                               pixels_BxMxCxHxW.reshape(b * m, *pixels_BxMxCxHxW.shape[2:]))
        embeds_BxJxD = features_NxIxD.reshape(b, m * features_NxIxD.shape[1], -1)
        if offsets_B is None:
            return embeds_BxJxD
        j = embeds_BxJxD.shape[1]
        index_BxJ = jnp.minimum(offsets_B[:, None] + jnp.arange(j), j - 1)
        return jnp.take_along_axis(embeds_BxJxD, index_BxJ[:, :, None], axis=1)

    def logits(self, params: Params, hidden: jax.Array) -> jax.Array:
        return self._merge(params)[0].logits(hidden)

    def _merge(self, params: Params) -> tuple[Transformer, Layers | None]:
        """The model merged with `params`, and each stack layer by layer when `params`
        holds its layers apart (a rollout's copy): the module then holds one layer's arrays
        in their place, never read."""
        params = {k: v for k, v in params.items() if k != "vision"}  # read by `image_embeds`
        split = [k for k in STACKS if k in params and _is_split(params[k])]
        if not split:
            return nnx.merge(self.graphdef, params), None
        layers = {k: [jax.tree.map(lambda t, j=j: t[j], params[k], is_leaf=_is_layers)
                      for j in range(len(jax.tree.leaves(params[k], is_leaf=_is_layers)[0]))]
                  for k in split}
        stand_in = {**params, **{k: layers[k][0] for k in split}}
        return nnx.merge(self.graphdef, stand_in), layers

    def serving_params(self, shardings: Params) -> Params:
        """A rollout's copy of the parameters, abstract, from their layout there
        (`shardings`, stacked like `abstract_params`): in the compute dtype (what every
        forward casts them to) except the few read in float32 (norm scales, the MoE router:
        `FLOAT32_READS`), and with `model.sampling_layers` unrolled each stacked leaf a
        tuple of one array per layer."""
        dt, unroll = compute_dtype(self.cfg), unrolled_sampling(self.cfg)

        def serving(path: tuple, x: jax.ShapeDtypeStruct, s: NamedSharding) -> Any:
            keep = path[-1].key in FLOAT32_READS or not jnp.issubdtype(x.dtype, jnp.floating)
            dtype = x.dtype if keep else dt
            if unroll and path[0].key in STACKS:
                one = NamedSharding(s.mesh, P(*tuple(s.spec)[1:]))
                return tuple(jax.ShapeDtypeStruct(x.shape[1:], dtype, sharding=one)
                             for _ in range(x.shape[0]))
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=s)
        return jax.tree_util.tree_map_with_path(serving, self.abstract_params, shardings)

    def init(self, seed: int) -> Params:
        """Random parameters (call under jit with out_shardings to create them sharded)."""
        params = nnx.to_pure_dict(nnx.state(Transformer(self.cfg, rngs=nnx.Rngs(seed)), nnx.Param))
        if self.cfg.vision.layers:
            params["vision"] = vision.init_params(vision.VisionSpec.of(self.cfg), seed,
                                                  jnp.dtype(self.cfg.param_dtype))
        return params

    @property
    def policy(self) -> ModelSpec:
        """The language model of the tree: itself."""
        return self

    def policy_params(self, params: Params) -> Params:
        return params

    def initial(self, shardings: Params, load_lm: LoadLM) -> Params | None:
        """The checkpoint's parameters on their shards; None for a random init."""
        return load_lm(self.cfg, self, shardings)


def _is_layers(x: Any) -> bool:
    return isinstance(x, tuple)


def _is_split(tree: Any) -> bool:
    """Whether a stack's leaves are tuples of per-layer arrays (a rollout's copy)."""
    return any(_is_layers(x) for x in jax.tree.leaves(tree, is_leaf=_is_layers))


def serve(params: Params, serving: Params) -> Params:
    """`params` (stacked, stored dtypes; or already a rollout's copy) as the rollout's
    copy `serving` (abstract: `ModelSpec.serving_params`) describes it: cast, and split
    into layers where it holds them apart; computed where `params` lie (placing them is
    the caller's)."""
    def one(x: jax.Array, a: Any) -> Any:
        if isinstance(a, tuple):
            return tuple(x[j].astype(s.dtype) for j, s in enumerate(a))
        return x if x.dtype == a.dtype else x.astype(a.dtype)
    return jax.tree.map(one, params, serving)


def _nest(flat: list[tuple[tuple, Any]]) -> Params:
    out: Params = {}
    for path, leaf in flat:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = leaf
    return out


def model_spec(cfg: ModelConfig) -> ModelSpec:
    """Shapes and logical axes of a model without allocating its parameters."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))),
                                nnx.Param)
    flat = list(nnx.to_flat_state(state))
    abstract = _nest([(path, var.get_value()) for path, var in flat])
    axes = _nest([(path, var.get_metadata()["logical_axes"]) for path, var in flat])
    if cfg.vision.layers:  # the tower: replicated (no logical axis names)
        tower = jax.eval_shape(lambda: vision.init_params(vision.VisionSpec.of(cfg), 0,
                                                          jnp.dtype(cfg.param_dtype)))
        abstract["vision"] = tower
        axes["vision"] = jax.tree.map(lambda x: (None,) * x.ndim, tower)
    return ModelSpec(cfg, graphdef, abstract, axes)


def count_params(params: Params) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(params))


def count_active_params(spec: ModelSpec) -> int:
    """Parameters one token runs through: all but the experts it is not routed to (each
    sparse layer uses experts_per_token of num_experts)."""
    total, moe = count_params(spec.abstract_params), spec.cfg.moe
    if "moe" not in spec.abstract_params["blocks"]:  # dense, or no layer sparse
        return total
    experts = sum(int(spec.abstract_params["blocks"]["moe"][k].size) for k in ("gate", "up", "down"))
    return total - experts * (moe.num_experts - moe.experts_per_token) // moe.num_experts
