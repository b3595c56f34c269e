"""Malformed model files (hypothesis): whatever the bytes, the safetensors and GGUF readers
either read the file or raise ConfigError with a one-line message; never an IndexError,
struct.error, MemoryError, RecursionError, a hang or a crash.

Each example starts from a small valid file and truncates it, overwrites bytes (random
ones, or integers at the extremes: 0, 2^31, 2^63 - 1, 2^64 - 1) or inserts bytes, mostly
in the header; structured examples also write headers whose every field is arbitrary.
"""

from __future__ import annotations

import itertools
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from gpurl.config import ConfigError, ModelConfig
from gpurl.models import safetensors_io
from gpurl.models.gguf import model_config_from_gguf, read_gguf
from gpurl.models.gguf_tokenizer import tokenizer_from_gguf

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
EXTREMES = [0, 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1]
_names = itertools.count()


def _mutations(header_bytes: int) -> st.SearchStrategy:
    where = st.integers(0, header_bytes)
    return st.lists(st.one_of(
        st.tuples(st.just("cut"), where),
        st.tuples(st.just("bytes"), where, st.binary(min_size=1, max_size=8)),
        st.tuples(st.just("int"), where, st.sampled_from(EXTREMES)),
        st.tuples(st.just("insert"), where, st.binary(min_size=1, max_size=16)),
    ), min_size=1, max_size=3)


def _mutate(raw: bytes, mutations: list[tuple]) -> bytes:
    out = bytearray(raw)
    for kind, at, *value in mutations:
        at = min(at, len(out))
        if kind == "cut":
            del out[at:]
        elif kind == "bytes":
            out[at:at + len(value[0])] = value[0]
        elif kind == "int":
            out[at:at + 8] = struct.pack("<Q", value[0])
        else:
            out[at:at] = value[0]
    return bytes(out)


def _write(folder: Path, raw: bytes, suffix: str) -> Path:
    # A fresh file each time: an earlier example's memory map must never see new bytes.
    path = folder / f"fuzz{next(_names)}{suffix}"
    path.write_bytes(raw)
    return path


def _event(outcome: str) -> None:
    """Tallies outcomes for `pytest --hypothesis-show-statistics` (inside @given only)."""
    try:
        event(outcome)
    except Exception:  # noqa: BLE001 - called outside a hypothesis test
        pass


def _assert_clear(error: ConfigError) -> None:
    message = str(error)
    assert message and "\n" not in message and len(message) < 2000, message


# ---------------------------------------------------------------- safetensors


def _read_safetensors(path: Path) -> None:
    try:
        tensors = safetensors_io.open_file(path)
        for view in tensors.values():
            np.asarray(view).sum()  # every byte of every tensor is readable
        _event("read")
    except ConfigError as e:
        _assert_clear(e)
        _event("ConfigError")


@pytest.fixture(scope="module")
def safetensors_file(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("st") / "seed.safetensors"
    safetensors_io.save_file({"w": np.arange(12, dtype=np.float32).reshape(3, 4),
                              "b": np.ones(5, np.int8), "e": np.zeros((0, 3), np.float16)},
                             path, metadata={"format": "pt"})
    return path.read_bytes()


@FUZZ
@given(data=st.data())
def test_mutated_safetensors(tmp_path, safetensors_file, data):
    header = 8 + int.from_bytes(safetensors_file[:8], "little")
    raw = _mutate(safetensors_file, data.draw(_mutations(header)))
    _read_safetensors(_write(tmp_path, raw, ".safetensors"))


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: (st.lists(inner, max_size=4)
                   | st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
_entry = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "I8", "Q7", ""]) | _json,
    "shape": st.lists(st.integers(-2, 2**40), max_size=3) | _json,
    "data_offsets": st.lists(st.integers(-2, 2**64), max_size=3) | _json})


@FUZZ
@given(header=st.dictionaries(st.text(max_size=6), _entry | _json, max_size=4),
       data_bytes=st.integers(0, 64), declared=st.sampled_from([None, *EXTREMES]))
def test_arbitrary_safetensors_headers(tmp_path, header, data_bytes, declared):
    text = json.dumps(header).encode()
    length = len(text) if declared is None else declared
    _read_safetensors(_write(tmp_path, struct.pack("<Q", length) + text + bytes(data_bytes),
                             ".safetensors"))


def test_deeply_nested_safetensors_header(tmp_path):
    text = b"[" * 100_000 + b"]" * 100_000
    _read_safetensors(_write(tmp_path, struct.pack("<Q", len(text)) + text, ".safetensors"))


# ---------------------------------------------------------------- GGUF


def _read_gguf(path: Path) -> None:
    stage = "header"
    try:
        gguf = read_gguf(path)
        stage = "tensors"
        for name in gguf.tensors:
            gguf.tensor(name)
        stage = "architecture"
        model_config_from_gguf(path, ModelConfig())
        stage = "tokenizer"
        tokenizer_from_gguf(path)
        _event("read")
    except ConfigError as e:
        _assert_clear(e)
        _event(f"ConfigError at the {stage}")


# The metadata gpurl reads, as (GGUFWriter method, value): a tiny Gemma 3 with a tokenizer.
SEED_METADATA = {
    **{f"gemma3.{key}": ("uint32", value) for key, value in {
        "embedding_length": 32, "block_count": 1, "feed_forward_length": 64,
        "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 16,
        "context_length": 64}.items()},
    "gemma3.attention.layer_norm_rms_epsilon": ("float32", 1e-6),
    "tokenizer.ggml.model": ("string", "llama"),
    "tokenizer.ggml.tokens": ("array",
                              ["<pad>", "<eos>", "<bos>", "<unk>", "a", "b", "ab", "\u2581"]),
    "tokenizer.ggml.token_type": ("array", [3, 3, 3, 2, 1, 1, 1, 1]),
    "tokenizer.ggml.eos_token_id": ("uint32", 1),
    "tokenizer.ggml.bos_token_id": ("uint32", 2),
    "tokenizer.ggml.unknown_token_id": ("uint32", 3),
}


def _write_gguf(path: Path, metadata: dict[str, tuple[str, object]], vocab: int = 8) -> None:
    """A GGUF file with `metadata`, an F32 embedding of `vocab` rows and a Q8_0 tensor."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "gemma3")
    for key, (kind, value) in metadata.items():
        getattr(writer, f"add_{kind}")(key, value)
    writer.add_tensor("token_embd.weight", np.ones((vocab, 32), np.float32))
    q8 = gguf.quants.quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> tuple[bytes, int]:
    """The seed GGUF file and the byte length of its header."""
    path = tmp_path_factory.mktemp("gguf") / "seed.gguf"
    _write_gguf(path, SEED_METADATA)
    return path.read_bytes(), read_gguf(path).data_start


@FUZZ
@given(data=st.data())
def test_mutated_gguf(tmp_path, gguf_file, data):
    raw, header = gguf_file
    _read_gguf(_write(tmp_path, _mutate(raw, data.draw(_mutations(header))), ".gguf"))


_value_types = st.sampled_from(list(range(14)) + [2**31])


@FUZZ
@given(version=st.sampled_from([2, 3, 7]), counts=st.tuples(st.sampled_from([0, 1, 2, 2**63]),
                                                             st.sampled_from([0, 1, 3, 2**63])),
       fields=st.lists(st.tuples(st.text(max_size=30), _value_types,
                                 st.binary(max_size=24)), max_size=4),
       tail=st.binary(max_size=64))
def test_arbitrary_gguf_headers(tmp_path, version, counts, fields, tail):
    raw = b"GGUF" + struct.pack("<IQQ", version, *counts)
    for key, vtype, payload in fields:
        name = key.encode()
        raw += struct.pack("<Q", len(name)) + name + struct.pack("<I", vtype) + payload
    _read_gguf(_write(tmp_path, raw + tail, ".gguf"))


_metadata_values = st.one_of(
    st.tuples(st.just("uint32"), st.sampled_from([0, 1, 3, 7, 2**32 - 1])),
    st.tuples(st.just("int32"), st.integers(-2**31, 2**31 - 1)),
    st.tuples(st.just("uint64"), st.sampled_from([0, 2**63, 2**64 - 1])),
    st.tuples(st.just("float32"), st.floats(width=32)),
    st.tuples(st.just("string"), st.text(max_size=10)),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("array"), st.lists(st.integers(-5, 10), min_size=1, max_size=10)
              | st.lists(st.text(max_size=4), min_size=1, max_size=10)),
    st.just(("delete", None)))


@FUZZ
@given(changes=st.lists(st.tuples(st.sampled_from(sorted(SEED_METADATA)), _metadata_values),
                        min_size=1, max_size=3),
       vocab=st.sampled_from([1, 8, 300]))
def test_gguf_metadata_of_the_wrong_type_or_value(tmp_path, changes, vocab):
    """Well-formed files whose architecture or tokenizer metadata is missing, of another
    type, zero, negative, huge or out of range."""
    metadata = dict(SEED_METADATA)
    for key, (kind, value) in changes:
        if kind == "delete":
            metadata.pop(key, None)
        else:
            metadata[key] = (kind, value)
    path = tmp_path / f"fuzz{next(_names)}.gguf"
    _write_gguf(path, metadata, vocab)
    _read_gguf(path)


def test_deeply_nested_gguf_arrays(tmp_path):
    key = b"general.x"
    nested = struct.pack("<IQ", 9, 1) * 50_000  # array of arrays of arrays ...
    raw = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
           + struct.pack("<I", 9) + nested + struct.pack("<IQ", 4, 0))
    _read_gguf(_write(tmp_path, raw, ".gguf"))


def test_the_seed_files_read(tmp_path, safetensors_file, gguf_file):
    """The unmutated files are valid, so the mutations start from real headers."""
    tensors = safetensors_io.open_file(_write(tmp_path, safetensors_file, ".safetensors"))
    assert sorted(tensors) == ["b", "e", "w"]
    path = _write(tmp_path, gguf_file[0], ".gguf")
    assert sorted(read_gguf(path).tensors) == ["blk.0.ffn_up.weight", "token_embd.weight"]
    assert model_config_from_gguf(path, ModelConfig()).d_model == 32
    assert tokenizer_from_gguf(path).eos_id == 1
