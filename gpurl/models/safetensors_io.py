"""Safetensors without the `safetensors` package: zero-copy memory-mapped reads, plain writes.

Format (https://github.com/huggingface/safetensors#format): 8-byte little-endian header
length N, N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}`, then the data buffer; offsets are relative to the buffer.
Every tensor comes back as a view into one `np.memmap` per file, so opening a 100 GB
checkpoint costs nothing until a slice of a tensor is read (each device reads its shard).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ml_dtypes
import numpy as np

from gpurl.config import ConfigError

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"), "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_MAX_HEADER = 100_000_000  # the reference implementation's limit
INDEX_FILE = "model.safetensors.index.json"


def _corrupt(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"{path} is not a valid safetensors file ({problem}); re-download or "
                       f"re-export the checkpoint.")


def read_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], dict[str, str], int]:
    """(tensor entries, metadata, byte offset of the data buffer), all bounds-checked."""
    path = Path(path)
    size = path.stat().st_size
    if size < 8:
        raise _corrupt(path, f"{size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 2 <= n <= min(size - 8, _MAX_HEADER):
            raise _corrupt(path, f"header length {n} does not fit a file of {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:  # bad UTF-8 or JSON, huge ints, deep nesting
        raise _corrupt(path, f"header is not JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _corrupt(path, "__metadata__ is not an object")
    _check_entries(path, header, data_size=size - 8 - n)
    return header, metadata, 8 + n


def _check_entries(path: Path, header: dict[str, Any], data_size: int) -> None:
    spans = []
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise _corrupt(path, f"tensor {_short(name)} has a malformed entry "
                                 f"{_short(entry)}") from None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise _corrupt(path, f"tensor {_short(name)} has unknown dtype {_short(dtype)}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise _corrupt(path, f"tensor {_short(name)} has invalid shape {_short(shape)}")
        if not (type(begin) is int and type(end) is int and 0 <= begin <= end <= data_size):
            raise _corrupt(path, f"tensor {_short(name)} spans bytes [{_short(begin)}, "
                                 f"{_short(end)}) outside the "
                                 f"{data_size}-byte data buffer (truncated file?)")
        if end - begin != math.prod(shape) * DTYPES[dtype].itemsize:
            raise _corrupt(path, f"tensor {_short(name)} of shape {_short(shape)} and dtype "
                                 f"{dtype} does not fill its {end - begin} bytes")
        spans.append((begin, end, name))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise _corrupt(path, f"tensors {_short(first)} and {_short(second)} overlap")


def _short(value: Any) -> str:
    """repr for a message: a damaged header can hold megabytes in one name."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def open_file(path: str | Path) -> dict[str, np.ndarray]:
    """Tensors of one file as read-only views into a memory map (nothing is read yet)."""
    path = Path(path)
    header, _, start = read_header(path)
    if not header:
        return {}
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        flat = buf[start + begin:start + end].view(DTYPES[entry["dtype"]])
        out[name] = flat.reshape(entry["shape"])
    return out


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: a file, a sharded index, or every *.safetensors."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigError(f"checkpoint {path} does not exist; set model.checkpoint to a Hugging "
                          f"Face checkpoint directory.")
    if (path / INDEX_FILE).is_file():
        return sorted({path / f for f in _weight_map(path).values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {path}; point model.checkpoint at a Hugging "
                          f"Face checkpoint saved with safe_serialization (the default).")
    return files


def _weight_map(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"{path / INDEX_FILE} is unreadable ({e!r}); re-download the "
                          f"checkpoint.") from None
    missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    if missing:
        raise ConfigError(f"{path / INDEX_FILE} names shards that are missing: {missing}; "
                          f"re-download the checkpoint.")
    return weight_map


def open_checkpoint(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a (possibly sharded) checkpoint, memory-mapped; a name may occur once."""
    path = Path(path)
    tensors: dict[str, np.ndarray] = {}
    origin: dict[str, Path] = {}
    for file in checkpoint_files(path):
        for name, view in open_file(file).items():
            if name in tensors:
                raise ConfigError(f"tensor {name!r} is in both {origin[name]} and {file}; remove "
                                  f"the stray file from {path}.")
            tensors[name], origin[name] = view, file
    if path.is_dir() and (path / INDEX_FILE).is_file():
        absent = sorted(set(_weight_map(path)) - set(tensors))
        if absent:
            raise ConfigError(f"{path / INDEX_FILE} lists tensors its shards lack, e.g. "
                              f"{absent[:3]}; re-download the checkpoint.")
    return tensors


def save_file(tensors: Mapping[str, Any], path: str | Path,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file (atomically: a temporary file renamed into place)."""
    arrays = [(name, _little_endian(np.asarray(x))) for name, x in tensors.items()]
    write_tensors(path, [(name, a.dtype, a.shape) for name, a in arrays],
                  lambda i: arrays[i][1], metadata)


def write_tensors(path: str | Path | None, entries: Sequence[tuple[str, Any, Sequence[int]]],
                  fetch: Callable[[int], np.ndarray],
                  metadata: Mapping[str, str] | None = None) -> None:
    """Stream tensors into a safetensors file, one on the host at a time.

    `entries` are (name, dtype, shape); `fetch(i)` returns entry i's array and is called
    once per entry in a fixed order. With `path=None` only the fetches run (the processes
    that take part in a collective gather but do not write).
    """
    order = _write_order(entries)
    raw = _header_bytes(entries, order, metadata)
    if path is None:
        for i in order:
            fetch(i)
        return
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for i in order:
            name, dtype, shape = entries[i]
            a = np.asarray(fetch(i), order="C")
            if a.dtype != np.dtype(dtype) or a.shape != tuple(shape):
                raise ValueError(f"tensor {name!r} is {a.dtype}{list(a.shape)}, but its header "
                                 f"entry says {np.dtype(dtype)}{list(shape)}.")
            f.write(_little_endian(a).reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)


def _write_order(entries: Sequence[tuple[str, Any, Sequence[int]]]) -> list[int]:
    # Widest dtypes first keeps each tensor aligned to its itemsize (as `safetensors` does).
    return sorted(range(len(entries)),
                  key=lambda i: (-np.dtype(entries[i][1]).itemsize, entries[i][0]))


def _header_bytes(entries: Sequence[tuple[str, Any, Sequence[int]]], order: list[int],
                  metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for i in order:
        name, dtype, shape = entries[i]
        dtype = np.dtype(dtype).newbyteorder("<") if np.dtype(dtype).byteorder == ">" else np.dtype(dtype)
        if dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot "
                            f"store; cast it to one of {sorted(_NAMES)}.")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _NAMES[dtype], "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # keeps the data buffer 8-byte aligned in the file


def _little_endian(a: np.ndarray) -> np.ndarray:
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
