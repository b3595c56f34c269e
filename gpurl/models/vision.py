"""Vision towers of vision-language models (issue 67, first part): Gemma 3's SigLIP encoder
and its multimodal projector, as pure functions over a parameter tree, loaded from the HF
checkpoint's tensors; and the model's image preprocessing (`gpurl.data.images`).

Gemma 3 (4B and up; HF `Gemma3ForConditionalGeneration`, Gemma Team 2025, sec. 2.1) sees an
image as `vision_config.image_size` square pixels cut into patches of `patch_size`: a
SigLIP vision transformer (Zhai et al. 2023: patch embedding by a strided convolution,
learned positions, pre-LayerNorm blocks of bidirectional attention and a GELU MLP, a final
LayerNorm) encodes every patch, and the projector average-pools the patch grid to
`mm_tokens_per_image` tokens (a square grid), normalizes them with Gemma's (1 + w) RMSNorm
and maps them to the language model's width. Those tokens replace the image's soft tokens
in the text's embeddings.

Shapes: N images, C channels, H x W pixels, P patches, V the tower's width, I image tokens,
D the language model's width, F the tower's MLP width.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.config import ConfigError, ModelConfig, VisionConfig

Tree = dict[str, Any]


@dataclass(frozen=True)
class VisionSpec:
    """The tower and projector of a Gemma 3 checkpoint (HF config.json's `vision_config`,
    `mm_tokens_per_image` and the text model's `hidden_size`)."""

    width: int  # V
    layers: int
    heads: int
    mlp: int  # F
    image_size: int  # pixels per side
    patch: int  # pixels per patch side
    eps: float  # LayerNorm's and the projector's RMSNorm's epsilon
    tokens: int  # I: image tokens per image (a square number)
    text_width: int  # D
    channels: int = 3

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.tokens)

    @classmethod
    def of(cls, cfg: ModelConfig) -> VisionSpec:
        """The tower of a vision-language model config (`model.vision`)."""
        v = cfg.vision
        spec = cls(width=v.width, layers=v.layers, heads=v.heads, mlp=v.mlp_dim,
                   image_size=v.image_size, patch=v.patch, eps=v.eps, tokens=v.tokens,
                   text_width=cfg.d_model)
        spec.check()
        return spec

    @classmethod
    def from_hf(cls, config: dict) -> VisionSpec:
        """From a Gemma 3 multimodal config.json (as a dict); one sentence when it cannot
        describe a tower gpurl runs."""
        vision = vision_config_from_hf(config, VisionConfig(), "this config.json")
        ids = (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id)
        return cls.of(ModelConfig(d_model=config["text_config"]["hidden_size"],
                                  vocab_size=max(ids) + 1, vision=vision))

    def check(self) -> None:
        side, tokens = self.patches_per_side, self.tokens_per_side
        if self.image_size % self.patch or tokens * tokens != self.tokens or side % tokens:
            raise ConfigError(
                f"a {self.image_size}-pixel image in patches of {self.patch} cannot be pooled "
                f"to {self.tokens} image tokens; the patches per side must be a multiple of "
                f"the square root of mm_tokens_per_image.")
        if self.width % self.heads:
            raise ConfigError(f"vision_config.hidden_size={self.width} does not split over "
                              f"{self.heads} attention heads.")


def vision_config_from_hf(hf: dict[str, Any], base: VisionConfig, source: str) -> VisionConfig:
    """A Gemma 3 multimodal config.json's tower and image tokens (transformers'
    Gemma3Config and SiglipVisionConfig defaults where the file omits a key)."""
    vision = hf.get("vision_config")
    if not isinstance(vision, dict) or hf.get("model_type") != "gemma3":
        raise ConfigError(f"{source} is not a Gemma 3 vision-language checkpoint (its config.json "
                          f"has no vision_config); set model.vision.layers=0 for its text "
                          f"model or load a vision-language checkpoint.")
    act = vision.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: vision_config.hidden_act={act!r} is not supported; gpurl "
                          f"runs SigLIP towers with gelu_pytorch_tanh.")
    defaults = VisionConfig(layers=27)

    def get(key: str, field: str, config: dict = vision) -> Any:
        return config.get(key, getattr(defaults, field))

    return dataclasses.replace(
        base, layers=get("num_hidden_layers", "layers"), width=get("hidden_size", "width"),
        heads=get("num_attention_heads", "heads"), mlp_dim=get("intermediate_size", "mlp_dim"),
        image_size=get("image_size", "image_size"), patch=get("patch_size", "patch"),
        eps=get("layer_norm_eps", "eps"), tokens=get("mm_tokens_per_image", "tokens", hf),
        image_token_id=hf.get("image_token_id", get("image_token_index", "image_token_id", hf)),
        boi_token_id=hf.get("boi_token_id", get("boi_token_index", "boi_token_id", hf)),
        eoi_token_id=hf.get("eoi_token_id", get("eoi_token_index", "eoi_token_id", hf)))


# ---------------------------------------------------------------- the tower


def _layer_norm(x: jax.Array, p: Tree, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = ((x32 - mean) ** 2).mean(-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps) * p["scale"] + p["bias"]).astype(x.dtype)


def _dense(x: jax.Array, p: Tree) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def _block(x_NxPxV: jax.Array, p: Tree, spec: VisionSpec) -> jax.Array:
    """One pre-LayerNorm encoder block: bidirectional attention, then the MLP."""
    n, length, width = x_NxPxV.shape
    e = width // spec.heads
    h = _layer_norm(x_NxPxV, p["norm1"], spec.eps)

    def heads(name: str) -> jax.Array:
        return _dense(h, p[name]).reshape(n, length, spec.heads, e)

    q, k, v = heads("q"), heads("k"), heads("v")
    scores_NxHxPxP = jnp.einsum("nqhe,nkhe->nhqk", q, k) * e ** -0.5
    weights = jax.nn.softmax(scores_NxHxPxP.astype(jnp.float32), axis=-1).astype(v.dtype)
    attended = jnp.einsum("nhqk,nkhe->nqhe", weights, v).reshape(n, length, width)
    x_NxPxV = x_NxPxV + _dense(attended, p["out"])
    h = _layer_norm(x_NxPxV, p["norm2"], spec.eps)
    h = jax.nn.gelu(_dense(h, p["fc1"]), approximate=True)
    return x_NxPxV + _dense(h, p["fc2"])


def patches(pixels_NxCxHxW: jax.Array, patch: int) -> jax.Array:
    """N x P x (C * patch * patch): each patch's pixels in the convolution kernel's order
    (channel, row, column), the patches row by row."""
    n, c, height, width = pixels_NxCxHxW.shape
    rows, cols = height // patch, width // patch
    x = pixels_NxCxHxW.reshape(n, c, rows, patch, cols, patch)
    return x.transpose(0, 2, 4, 1, 3, 5).reshape(n, rows * cols, c * patch * patch)


def encode(params: Tree, spec: VisionSpec, pixels_NxCxHxW: jax.Array) -> jax.Array:
    """N x P x V: the SigLIP tower's last hidden states of N preprocessed images."""
    x = patches(pixels_NxCxHxW.astype(params["patch"]["kernel"].dtype), spec.patch)
    x_NxPxV = _dense(x, params["patch"]) + params["positions"][None]

    def layer(carry: jax.Array, p: Tree) -> tuple[jax.Array, None]:
        return _block(carry, p, spec), None

    x_NxPxV, _ = jax.lax.scan(layer, x_NxPxV, params["blocks"])
    return _layer_norm(x_NxPxV, params["post_norm"], spec.eps)


def project(params: Tree, spec: VisionSpec, hidden_NxPxV: jax.Array) -> jax.Array:
    """N x I x D: the patch grid average-pooled to the image tokens' grid (row by row),
    Gemma's RMSNorm (x / rms * (1 + w)), then the projection to the text width."""
    n, _, width = hidden_NxPxV.shape
    side, tokens = spec.patches_per_side, spec.tokens_per_side
    k = side // tokens
    grid = hidden_NxPxV.reshape(n, tokens, k, tokens, k, width).astype(jnp.float32)
    pooled_NxIxV = grid.mean(axis=(2, 4)).reshape(n, tokens * tokens, width)
    rms = jax.lax.rsqrt((pooled_NxIxV ** 2).mean(-1, keepdims=True) + spec.eps)
    normed = pooled_NxIxV * rms * (1.0 + params["norm"].astype(jnp.float32))
    out = normed.astype(params["projection"].dtype) @ params["projection"]
    return out.astype(hidden_NxPxV.dtype)


def image_features(params: Tree, spec: VisionSpec, pixels_NxCxHxW: jax.Array) -> jax.Array:
    """N x I x D: what replaces each image's soft tokens in the text's embeddings."""
    return project(params["projector"], spec, encode(params["tower"], spec, pixels_NxCxHxW))


# ---------------------------------------------------------------- the text's side

# Where an image goes in a prompt's text: Gemma 3's own marker, which its chat template
# writes for an `{"type": "image"}` content part (`gpurl.data.layouts.chat` writes it too).
IMAGE_MARKER = "<start_of_image>"


@dataclass(frozen=True)
class ImageTokens:
    """How a vision-language model's text holds an image (transformers' Gemma3Processor):
    each marker becomes "\n\n", the begin token, `count` image soft tokens, the end
    token, "\n\n"; the images are resized to `size` pixels a side."""

    image: int
    begin: int
    end: int
    count: int
    size: int

    @classmethod
    def of(cls, cfg: ModelConfig) -> ImageTokens | None:
        v = cfg.vision
        if not v.layers:
            return None
        return cls(v.image_token_id, v.boi_token_id, v.eoi_token_id, v.tokens, v.image_size)

    def encode(self, texts: list[str], encode_batch: Any) -> tuple[list[list[int]], list[int]]:
        """(token ids of each text with its markers expanded, each text's image count).
        The pieces between markers are tokenized apart, with the processor's "\n\n" on
        their image side: the begin and end tokens are special in the model's tokenizer,
        so its whole-string tokenization never merges across them either."""
        split = [t.split(IMAGE_MARKER) for t in texts]
        pieces = [(("\n\n" if i else "") + piece + ("\n\n" if i < len(parts) - 1 else ""))
                  for parts in split for i, piece in enumerate(parts)]
        ids = iter(encode_batch(pieces))
        block = [self.begin] + [self.image] * self.count + [self.end]
        out = []
        for parts in split:
            row: list[int] = []
            for i in range(len(parts)):
                row += (block if i else []) + next(ids)
            out.append(row)
        return out, [len(parts) - 1 for parts in split]


# ---------------------------------------------------------------- the language model's side


def image_tokens(tokens_BxT: jax.Array, cfg: ModelConfig) -> jax.Array:
    """B x T: which tokens are image tokens (the soft tokens an image's features replace)."""
    if not cfg.vision.layers:
        raise ConfigError("images were given to a text model (model.vision.layers=0); use a "
                          "vision-language preset or set model.vision.layers from the checkpoint.")
    return tokens_BxT == cfg.vision.image_token_id


def place_images(x_BxTxD: jax.Array, is_image_BxT: jax.Array, images_BxJxD: jax.Array
                 ) -> jax.Array:
    """The embeddings with row b's k-th image token replaced by `images_BxJxD[b, k]` (each
    row's image tokens' features in order; transformers' `masked_scatter`, row by row so
    that rows stay on their own shards). Rows with fewer image tokens than J leave the
    rest unread."""
    j = images_BxJxD.shape[1]
    index_BxT = jnp.clip(jnp.cumsum(is_image_BxT, axis=1) - 1, 0, max(j - 1, 0))
    picked_BxTxD = jnp.take_along_axis(images_BxJxD.astype(x_BxTxD.dtype),
                                       index_BxT[:, :, None], axis=1)
    return jnp.where(is_image_BxT[:, :, None], picked_BxTxD, x_BxTxD)


def image_sees(is_image_BxT: jax.Array, positions_BxT: jax.Array) -> jax.Array:
    """B x T: the last position each token sees (`gpurl.kernels.attention.attention_mask`):
    an image token sees to the end of its run of image tokens (Gemma 3's language model
    attends within an image both ways: transformers' `token_type_ids` blocks), any other
    token its own position."""
    t = is_image_BxT.shape[1]
    index_BxT = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), is_image_BxT.shape)
    # the first text token at or after each token (T if none): its run ends just before
    next_text_BxT = jax.lax.cummin(jnp.where(is_image_BxT, t, index_BxT), axis=1, reverse=True)
    end_BxT = jnp.where(is_image_BxT, next_text_BxT - 1, index_BxT)
    return jnp.take_along_axis(positions_BxT, end_BxT, axis=1)


# ---------------------------------------------------------------- parameters


def init_params(spec: VisionSpec, seed: int = 0, dtype: Any = jnp.float32) -> Tree:
    """Random parameters of `spec`'s shapes (a tiny test model, or a `model.init=random`
    run; a real tower is loaded). Traceable: drawn on the device under jit."""
    keys = iter(jax.random.split(jax.random.fold_in(jax.random.key(seed), 67), 32))
    v, f, pixels = spec.width, spec.mlp, spec.channels * spec.patch * spec.patch

    def normal(shape: tuple[int, ...], std: float, mean: float = 0.0) -> jax.Array:
        return (mean + std * jax.random.normal(next(keys), shape, jnp.float32)).astype(dtype)

    def dense(i: int, o: int, layers: tuple[int, ...] = ()) -> Tree:
        return {"kernel": normal((*layers, i, o), i ** -0.5), "bias": normal((*layers, o), 0.02)}

    def norm(layers: tuple[int, ...] = ()) -> Tree:
        return {"scale": normal((*layers, v), 0.1, 1.0), "bias": normal((*layers, v), 0.02)}

    stack = (spec.layers,)
    return {"tower": {
        "patch": dense(pixels, v),
        "positions": normal((spec.patches_per_side ** 2, v), 0.02),
        "blocks": {"norm1": norm(stack), "q": dense(v, v, stack), "k": dense(v, v, stack),
                   "v": dense(v, v, stack), "out": dense(v, v, stack), "norm2": norm(stack),
                   "fc1": dense(v, f, stack), "fc2": dense(f, v, stack)},
        "post_norm": norm()},
        "projector": {"norm": normal((v,), 0.1), "projection": normal((v, spec.text_width), v ** -0.5)}}


# HF names under the tower's prefix of an encoder block's tensors, by gpurl's path
_BLOCK = {("norm1", "scale"): "layer_norm1.weight", ("norm1", "bias"): "layer_norm1.bias",
          ("norm2", "scale"): "layer_norm2.weight", ("norm2", "bias"): "layer_norm2.bias",
          **{(ours, part): f"{theirs}.{'weight' if part == 'kernel' else 'bias'}"
             for ours, theirs in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"),
                                  ("v", "self_attn.v_proj"), ("out", "self_attn.out_proj"),
                                  ("fc1", "mlp.fc1"), ("fc2", "mlp.fc2"))
             for part in ("kernel", "bias")}}


def hf_tensors(params: Tree, spec: VisionSpec) -> dict[str, np.ndarray]:
    """The tower and projector as the tensors transformers' Gemma3ForConditionalGeneration
    saves (`vision_tower.`, `multi_modal_projector.`; `load_hf`'s inverse), on the host."""
    tower, out = params["tower"], {}
    for i in range(spec.layers):
        for (ours, part), name in _BLOCK.items():
            x = np.asarray(tower["blocks"][ours][part][i], np.float32)
            out[f"vision_tower.encoder.layers.{i}.{name}"] = x.T if part == "kernel" else x
    kernel = np.asarray(tower["patch"]["kernel"], np.float32)
    out.update({
        "vision_tower.embeddings.patch_embedding.weight":
            kernel.T.reshape(spec.width, spec.channels, spec.patch, spec.patch),
        "vision_tower.embeddings.patch_embedding.bias": np.asarray(tower["patch"]["bias"]),
        "vision_tower.embeddings.position_embedding.weight": np.asarray(tower["positions"]),
        "vision_tower.post_layernorm.weight": np.asarray(tower["post_norm"]["scale"]),
        "vision_tower.post_layernorm.bias": np.asarray(tower["post_norm"]["bias"]),
        "multi_modal_projector.mm_soft_emb_norm.weight": np.asarray(params["projector"]["norm"]),
        "multi_modal_projector.mm_input_projection_weight":
            np.asarray(params["projector"]["projection"])})
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def hf_config(cfg: ModelConfig, text: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 multimodal config.json around the text model's (`vision_config_from_hf`'s
    inverse)."""
    v = cfg.vision
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "text_config": {**text, "model_type": "gemma3_text", "architectures": None},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": v.width,
                              "num_hidden_layers": v.layers, "num_attention_heads": v.heads,
                              "intermediate_size": v.mlp_dim, "image_size": v.image_size,
                              "patch_size": v.patch, "layer_norm_eps": v.eps,
                              "hidden_act": "gelu_pytorch_tanh", "vision_use_head": False},
            "mm_tokens_per_image": v.tokens, "image_token_index": v.image_token_id,
            "boi_token_index": v.boi_token_id, "eoi_token_index": v.eoi_token_id,
            "tie_word_embeddings": text.get("tie_word_embeddings", True)}


def load_hf(spec: VisionSpec, tensors: Mapping[str, Any], dtype: Any = jnp.float32) -> Tree:
    """The tower and projector from an HF checkpoint's `tensors` (name -> array-like), in
    either naming: the Hub files' (`vision_tower.vision_model.`, `multi_modal_projector.`)
    or transformers 5's in-memory one (`model.vision_tower.`, `model.multi_modal_projector.`).
    Linear weights are stored out x in, and the patch convolution V x C x p x p: both are
    turned into in x out kernels."""
    end = "post_layernorm.weight"
    found = [k for k in tensors if k.endswith(end) and "vision_tower." in k]
    if not found:
        raise ConfigError("the checkpoint has no vision tower (no vision_tower.*."
                          "post_layernorm.weight); a vision-language checkpoint is needed.")
    tower = found[0][:-len(end)]
    projector = tower[:tower.index("vision_tower.")] + "multi_modal_projector."

    def get(name: str) -> np.ndarray:
        return np.asarray(tensors[name], np.float32)

    def put(x: np.ndarray) -> jax.Array:
        return jnp.asarray(x, dtype)

    def block_tensor(i: int, path: tuple[str, str]) -> np.ndarray:
        x = get(f"{tower}encoder.layers.{i}.{_BLOCK[path]}")
        return x.T if path[1] == "kernel" else x

    blocks: Tree = {}
    for path in _BLOCK:
        stacked = np.stack([block_tensor(i, path) for i in range(spec.layers)])
        blocks.setdefault(path[0], {})[path[1]] = put(stacked)
    conv = get(f"{tower}embeddings.patch_embedding.weight")  # V x C x p x p
    return {"tower": {
        "patch": {"kernel": put(conv.reshape(spec.width, -1).T),
                  "bias": put(get(f"{tower}embeddings.patch_embedding.bias"))},
        "positions": put(get(f"{tower}embeddings.position_embedding.weight")),
        "blocks": blocks,
        "post_norm": {"scale": put(get(f"{tower}post_layernorm.weight")),
                      "bias": put(get(f"{tower}post_layernorm.bias"))}},
        "projector": {"norm": put(get(f"{projector}mm_soft_emb_norm.weight")),
                      "projection": put(get(f"{projector}mm_input_projection_weight"))}}
