"""Safetensors through the `safetensors` package: lazy per-shard reads, streamed writes.

Reading: `safe_open` parses and validates the header (the package's errors become one-line
`ConfigError`s) and memory-maps the file; every tensor comes back as a `LazyTensor` over
the package's slice (`get_slice`), so opening a 100 GB checkpoint reads nothing and each
device later reads only its shard. Writing a dict of host arrays uses the package too;
`write_tensors` streams one tensor at a time instead, because the package's writer takes
every tensor at once (benchmarks/README.md, "Safetensors": the whole model on the host).
Format: https://github.com/huggingface/safetensors#format.
"""

from __future__ import annotations

import json
import math
import operator
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ml_dtypes  # registers bfloat16 with NumPy, which the package's numpy framework needs
import numpy as np
import safetensors.numpy
from safetensors import SafetensorError, safe_open

from gpurl.config import ConfigError

# What the package's numpy framework can return (it has no NumPy type for F8_* or F4).
DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype("u1"), "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"), "I16": np.dtype("<i2"), "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"), "U64": np.dtype("<u8"), "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"
Pick = int | tuple[int, int]  # one axis of an index: a position, or a range [start, stop)


# ------------------------------------------------------------------------------ reading

class LazyTensor:
    """A tensor of a safetensors file that reads nothing until `np.asarray` converts it.

    `.T`, `.reshape` (only splitting axes) and indexing with integers and unit-step slices
    compose into one box of the stored tensor, so converting reads only the box. Indexing
    a reshaped tensor reads at once: each split axis's box covers whole rows of its first
    part (exactly the bytes when only that part is sliced, as a device's shard is).
    """

    def __init__(self, source: Any, shape: Sequence[int], dtype: Any) -> None:
        """`source[box]` (a tuple of ints and slices) returns that box of the stored tensor
        as an array: `safe_open(...).get_slice(name)`."""
        self._source, self.dtype = source, np.dtype(dtype)
        self._box: tuple[Pick, ...] = tuple((0, int(n)) for n in shape)
        self._axes = tuple(range(len(shape)))  # the stored axis behind each view group
        self._splits = tuple((int(n),) for n in shape)  # each group's sizes in the view

    def _with(self, box: Sequence[Pick], axes: Sequence[int],
              splits: Sequence[tuple[int, ...]]) -> LazyTensor:
        out = object.__new__(LazyTensor)
        out._source, out.dtype = self._source, self.dtype
        out._box, out._axes, out._splits = tuple(box), tuple(axes), tuple(splits)
        return out

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(n for sizes in self._splits for n in sizes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def __repr__(self) -> str:
        return f"LazyTensor(shape={self.shape}, dtype={self.dtype})"

    @property
    def T(self) -> LazyTensor:
        if any(len(sizes) > 1 for sizes in self._splits):
            raise ValueError(f"{self} was reshaped; transpose it before reshaping.")
        return self._with(self._box, self._axes[::-1], self._splits[::-1])

    def reshape(self, *shape: int | Sequence[int]) -> LazyTensor:
        dims = list(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = self.size // known if known else 0
        groups, i = [], 0
        for sizes in self._splits:
            run: list[int] = []
            while i < len(dims) and (not run or math.prod(run) != math.prod(sizes)):
                run, i = run + [int(dims[i])], i + 1
            groups.append(tuple(run))
        if groups and all(d == 1 for d in dims[i:]):
            groups[-1], i = groups[-1] + tuple(dims[i:]), len(dims)
        if (i < len(dims) or not all(groups)
                or [math.prod(g) for g in groups] != [math.prod(s) for s in self._splits]):
            raise ValueError(f"cannot reshape {self} to {tuple(dims)} without reading it: "
                             f"only reshapes that split axes stay lazy.")
        return self._with(self._box, self._axes, groups)

    def __getitem__(self, index: Any) -> LazyTensor | np.ndarray:
        picks = self._picks(index)
        if any(len(sizes) > 1 for sizes in self._splits):
            return self._read(picks)
        box, axes, splits = list(self._box), [], []
        for axis, pick in zip(self._axes, picks):
            start = box[axis][0]
            if isinstance(pick, int):
                box[axis] = start + pick
            else:
                box[axis] = (start + pick[0], start + pick[1])
                axes.append(axis)
                splits.append((pick[1] - pick[0],))
        return self._with(box, axes, splits)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy is False:
            raise ValueError(f"{self} lives in a file; reading it always copies.")
        out = self._read(self._picks(()))
        return out if dtype is None else out.astype(dtype, copy=False)

    def _picks(self, index: Any) -> list[Pick]:
        index = index if isinstance(index, tuple) else (index,)
        shape = self.shape
        if len(index) > len(shape):
            raise IndexError(f"{len(index)} indices for {self}")
        picks: list[Pick] = []
        for n, i in zip(shape, index + (slice(None),) * (len(shape) - len(index))):
            if isinstance(i, slice):
                start, stop, step = i.indices(n)
                if step != 1:
                    raise IndexError(f"{self} takes unit-step slices only, not {i}")
                picks.append((start, max(start, stop)))
                continue
            i = operator.index(i)
            if not -n <= i < n:
                raise IndexError(f"index {i} is out of bounds for an axis of size {n}")
            picks.append(i % n)
        return picks

    def _read(self, picks: list[Pick]) -> np.ndarray:
        box, shape, post, rest = list(self._box), [], [], iter(picks)
        for axis, sizes in zip(self._axes, self._splits):
            first, *inner = [next(rest) for _ in sizes]
            lo, hi = (first, first + 1) if isinstance(first, int) else first
            row = math.prod(sizes[1:])
            box[axis] = (box[axis][0] + lo * row, box[axis][0] + hi * row)
            shape += [hi - lo, *sizes[1:]]
            post += [0 if isinstance(first, int) else slice(None)]
            post += [p if isinstance(p, int) else slice(*p) for p in inner]
        stored = [b[1] - b[0] for b in box if isinstance(b, tuple)]
        if 0 in stored:  # the package refuses empty slices
            chunk = np.empty(stored, self.dtype)
        else:
            chunk = np.asarray(self._source[tuple(slice(*b) if isinstance(b, tuple) else b
                                                  for b in box)])
        kept = sorted(self._axes)  # the chunk's axes, in stored order
        chunk = chunk.transpose([kept.index(a) for a in self._axes])
        return np.asarray(chunk.reshape(shape)[tuple(post)])  # never a NumPy scalar


def _corrupt(path: Path, problem: str) -> ConfigError:
    return ConfigError(f"{path} is not a valid safetensors file ({problem}); re-download or "
                       f"re-export the checkpoint.")


def _problem(error: SafetensorError) -> str:
    """The package's message on one short line (a damaged header can hold megabytes)."""
    text = " ".join(str(error).split()).removeprefix("Error while deserializing header: ")
    if any(s in text for s in ("not fully covered", "header too small", "header too large",
                               "invalid header length")):
        text += ": truncated file?"
    return text if len(text) <= 300 else text[:297] + "..."


def open_file(path: str | Path) -> dict[str, LazyTensor]:
    """Tensors of one file, validated by the package and lazy (nothing is read yet)."""
    path = Path(path)
    try:
        with safe_open(path, framework="numpy") as f:  # slices keep the memory map open
            slices = {name: f.get_slice(name) for name in f.keys()}
    except SafetensorError as e:
        raise _corrupt(path, _problem(e)) from None
    out = {}
    for name, piece in slices.items():
        dtype = DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise ConfigError(f"tensor {name!r} of {path} is {piece.get_dtype()}, which gpurl "
                              f"cannot read; convert the checkpoint to bfloat16 or float32.")
        out[name] = LazyTensor(piece, piece.get_shape(), dtype)
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


def open_checkpoint(path: str | Path) -> dict[str, LazyTensor]:
    """All tensors of a (possibly sharded) checkpoint, lazy; a name may occur once."""
    path = Path(path)
    tensors: dict[str, LazyTensor] = {}
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


# ------------------------------------------------------------------------------ writing

def save_file(tensors: Mapping[str, Any], path: str | Path,
              metadata: Mapping[str, str] | None = None) -> None:
    """Write host arrays with the package (atomically: a temporary file renamed into place)."""
    arrays = {name: np.asarray(x, order="C") for name, x in tensors.items()}  # it needs C order
    for name, a in arrays.items():
        _dtype_name(name, a.dtype)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    safetensors.numpy.save_file(arrays, tmp, dict(metadata) if metadata else None)
    os.replace(tmp, path)


def write_tensors(path: str | Path | None, entries: Sequence[tuple[str, Any, Sequence[int]]],
                  fetch: Callable[[int], np.ndarray],
                  metadata: Mapping[str, str] | None = None) -> None:
    """Stream tensors into a safetensors file, one on the host at a time (the package's
    writer needs them all at once), atomically.

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


def _dtype_name(name: str, dtype: Any) -> str:
    dtype = np.dtype(dtype)
    dtype = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    if dtype not in _NAMES:
        raise TypeError(f"tensor {name!r} has dtype {dtype}, which gpurl does not write to "
                        f"safetensors; cast it to one of {sorted(_NAMES)}.")
    return _NAMES[dtype]


def _header_bytes(entries: Sequence[tuple[str, Any, Sequence[int]]], order: list[int],
                  metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for i in order:
        name, dtype, shape = entries[i]
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _dtype_name(name, dtype), "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # keeps the data buffer 8-byte aligned in the file


def _little_endian(a: np.ndarray) -> np.ndarray:
    return a.astype(a.dtype.newbyteorder("<")) if a.dtype.byteorder == ">" else a
