"""Hugging Face checkpoints: logits parity with transformers for every family, export round
trip, and the safetensors reader/writer against the `safetensors` package.

Parameters are loaded onto a real (data=1, fsdp=2, tp=2) mesh of 4 host devices, so the
per-shard callbacks of `load_hf_params` are exercised. One jitted apply per family.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers

import hf_models
from gpurl.config import ConfigError, MeshConfig, ModelConfig
from gpurl.distributed.mesh import trainer_mesh, tree_shardings
from gpurl.models import model_spec
from gpurl.models import safetensors_io as st
from gpurl.models.hf import load_hf_params, model_config_from_hf
from gpurl.models.hf_export import export_hf

B, T, LENGTHS = 2, 12, (12, 7)  # T > sliding window 4; row 1 is right-padded
TOKENS = np.random.default_rng(0).integers(0, hf_models.VOCAB, (B, T))
RULES = MeshConfig().train_rules
MAX_DIFF: dict[tuple[str, str], float] = {}  # (family, check) -> max |logit diff|, for reports


@dataclasses.dataclass
class Case:
    family: str
    hf: Any  # the transformers model
    path: Path
    cfg: ModelConfig
    params: Any
    apply: Any  # jitted spec.apply


def _shardings(cfg: ModelConfig) -> Any:
    spec = model_spec(cfg)
    mesh = trainer_mesh(MeshConfig(data=1, fsdp=2, tp=2))
    return spec, tree_shardings(spec.abstract_params, spec.logical_axes, RULES, mesh)


@pytest.fixture(scope="module", params=list(hf_models.FAMILIES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    model = hf_models.build(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg = model_config_from_hf(path, ModelConfig(dtype="float32"))
    spec, shardings = _shardings(cfg)
    params = load_hf_params(path, spec, shardings)
    return Case(request.param, model, path, cfg, params, jax.jit(spec.apply))


def _gpurl_logits(case: Case, lengths: tuple[int, ...] = (T,) * B) -> np.ndarray:
    segments = (np.arange(T)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(T), (B, T))
    return np.asarray(case.apply(case.params, jnp.asarray(TOKENS, jnp.int32),
                                 jnp.asarray(positions, jnp.int32), jnp.asarray(segments)))


def _record(case: Case, check: str, diff: float) -> None:
    MAX_DIFF[(case.family, check)] = diff
    print(f"\n{case.family:7s} {check:9s} max |logit diff| = {diff:.2e}")


def test_params_are_sharded_over_the_mesh(case: Case) -> None:
    q = case.params["blocks"]["attn"]["q"]
    assert q.dtype == jnp.float32 and len(q.sharding.device_set) == 4
    assert not q.sharding.is_fully_replicated


def test_logits_match_transformers(case: Case) -> None:
    diff = float(np.abs(_gpurl_logits(case) - hf_models.logits(case.hf, TOKENS)).max())
    _record(case, "full", diff)
    assert diff < 1e-4


def test_right_padding_matches_attention_mask(case: Case) -> None:
    mask = (np.arange(T)[None] < np.asarray(LENGTHS)[:, None]).astype(np.int64)
    ours, theirs = _gpurl_logits(case, LENGTHS), hf_models.logits(case.hf, TOKENS, mask)
    real = mask.astype(bool)
    diff = float(np.abs(ours[real] - theirs[real]).max())
    _record(case, "padded", diff)
    assert diff < 1e-4


def test_export_round_trip(case: Case, tmp_path: Path) -> None:
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    (tok_dir / "chat_template.jinja").write_text("{{ messages }}")
    (tok_dir / "config.json").write_text('{"eos_token_id": [1, 106], "bos_token_id": 2}')
    out = export_hf(case.params, case.cfg, tmp_path / "export", tokenizer_dir=tok_dir)
    assert {p.name for p in out.iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"}
    written = json.loads((out / "config.json").read_text())
    assert (written["eos_token_id"], written["bos_token_id"]) == ([1, 106], 2)
    assert model_config_from_hf(out, case.cfg) == case.cfg
    back = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32).eval()
    assert type(back) is type(case.hf)
    theirs = case.hf.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, theirs[name]), name
    diff = float(np.abs(hf_models.logits(back, TOKENS) - _gpurl_logits(case)).max())
    _record(case, "exported", diff)
    assert diff < 1e-4


# --------------------------------------------------------------- loading: edge cases


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("llama_ckpt")
    hf_models.build("llama").save_pretrained(path)
    return path


def test_loading_reads_nothing_until_a_shard_is_read(llama_dir: Path) -> None:
    views = st.open_checkpoint(llama_dir)
    w = views["model.layers.0.self_attn.q_proj.weight"]
    lazy = w.T.reshape(64, 4, 16)  # what load_hf_params hands to each shard callback
    assert isinstance(lazy, st.LazyTensor)
    q = safetensors.torch.load_file(llama_dir / "model.safetensors")[
        "model.layers.0.self_attn.q_proj.weight"].numpy()
    np.testing.assert_array_equal(lazy[32:, 2:], q.T.reshape(64, 4, 16)[32:, 2:])


def test_bfloat16_load_and_export_keep_bits(llama_dir: Path, tmp_path: Path) -> None:
    cfg = model_config_from_hf(llama_dir, ModelConfig(dtype="float32", param_dtype="bfloat16"))
    spec, shardings = _shardings(cfg)
    params = load_hf_params(llama_dir, spec, shardings)
    assert params["lm_head"].dtype == jnp.bfloat16
    export_hf(params, cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safetensors.safe_open(tmp_path / "model.safetensors", framework="numpy") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    ours = safetensors.torch.load_file(tmp_path / "model.safetensors")
    for name, value in safetensors.torch.load_file(llama_dir / "model.safetensors").items():
        assert torch.equal(ours[name], value.to(torch.bfloat16)), name


def test_wrong_model_config_names_the_tensor(llama_dir: Path) -> None:
    cfg = dataclasses.replace(model_config_from_hf(llama_dir, ModelConfig()), mlp_dim=96)
    spec, shardings = _shardings(cfg)
    with pytest.raises(ConfigError, match=r"is a llama model.*mlp.gate_proj.weight has shape "
                                          r"\(128, 64\), expected \(96, 64\)"):
        load_hf_params(llama_dir, spec, shardings)
    cfg = dataclasses.replace(cfg, mlp_dim=128, num_layers=3)
    spec, shardings = _shardings(cfg)
    with pytest.raises(ConfigError, match=r"does not fit.*missing.*model\.layers\.2\."):
        load_hf_params(llama_dir, spec, shardings)


def test_multimodal_gemma3_loads_its_text_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    text_dir, mm_dir = tmp_path_factory.mktemp("g3text"), tmp_path_factory.mktemp("g3mm")
    hf_models.build("gemma3").save_pretrained(text_dir)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    (mm_dir / "config.json").write_text(json.dumps(
        {"model_type": "gemma3", "text_config": text_cfg, "vision_config": {}}))
    tensors = {f"language_model.{k}": np.asarray(v)  # the transformers 4 layout
               for k, v in st.open_file(text_dir / "model.safetensors").items()}
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.zeros((2, 3), np.float32)
    st.save_file(tensors, mm_dir / "model.safetensors", {"format": "pt"})
    base = ModelConfig(dtype="float32")
    cfg = model_config_from_hf(mm_dir, base)
    assert cfg == model_config_from_hf(text_dir, base)
    spec, shardings = _shardings(cfg)
    ours, ref = load_hf_params(mm_dir, spec, shardings), load_hf_params(text_dir, spec, shardings)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ours, ref)


def test_export_refuses_what_the_family_cannot_hold(tmp_path: Path) -> None:
    cfg = ModelConfig(family="llama", norm_plus_one=False, scale_embeddings=False, post_norms=True)
    spec = model_spec(cfg)
    params = jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), spec.abstract_params)
    with pytest.raises(ConfigError, match="post_norms=True"):
        export_hf(params, cfg, tmp_path)


# ------------------------------------------------------------------------ config.json


def _config(tmp_path: Path, hf: dict[str, Any], **base: Any) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return model_config_from_hf(tmp_path, ModelConfig(**base))


# Published config.json files, trimmed to what the loader reads; transformers 4 wrote them.
GEMMA3_1B = {"model_type": "gemma3_text", "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
             "hidden_size": 1152, "intermediate_size": 6912, "num_attention_heads": 4,
             "num_hidden_layers": 26, "num_key_value_heads": 1, "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
             "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
             "vocab_size": 262144}
GEMMA3_4B = {"model_type": "gemma3", "vision_config": {"model_type": "siglip_vision_model"},
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                             "model_type": "gemma3_text", "num_hidden_layers": 34,
                             "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024}}
LLAMA_32_1B = {"model_type": "llama", "hidden_act": "silu", "hidden_size": 2048,
               "intermediate_size": 8192, "num_attention_heads": 32, "num_hidden_layers": 16,
               "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "head_dim": 64,
               "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                "original_max_position_embeddings": 8192, "rope_type": "llama3"},
               "rope_theta": 500000.0, "tie_word_embeddings": True, "vocab_size": 128256}
QWEN25_05B = {"model_type": "qwen2", "hidden_act": "silu", "hidden_size": 896,
              "intermediate_size": 4864, "max_window_layers": 21, "num_attention_heads": 14,
              "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
              "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
              "use_sliding_window": False, "vocab_size": 151936}


def test_gemma3_1b_classic_config(tmp_path: Path) -> None:
    cfg = _config(tmp_path, GEMMA3_1B)
    assert (cfg.family, cfg.num_kv_heads, cfg.head_dim, cfg.global_every, cfg.sliding_window) == (
        "gemma3", 1, 256, 6, 512)
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.rope_scaling) == (1e6, 1e4, "none")
    assert cfg.qk_norm and cfg.post_norms and cfg.norm_plus_one and cfg.scale_embeddings
    assert cfg.tie_embeddings and cfg.activation == "gelu_tanh" and cfg.query_pre_attn_scalar == 256


def test_multimodal_gemma3_4b_config_fills_class_defaults(tmp_path: Path) -> None:
    cfg = _config(tmp_path, GEMMA3_4B)
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        34, 2560, 8, 4, 256)
    assert (cfg.vocab_size, cfg.global_every, cfg.sliding_window) == (262208, 6, 1024)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_local_theta) == ("linear", 8.0, 1e4)


def test_llama_and_qwen_configs(tmp_path: Path) -> None:
    llama = _config(tmp_path, LLAMA_32_1B)
    assert (llama.rope_scaling, llama.rope_scaling_factor, llama.rope_original_max_len) == (
        "llama3", 32.0, 8192)
    assert not (llama.norm_plus_one or llama.scale_embeddings or llama.qkv_bias or llama.qk_norm)
    assert llama.norm_eps == 1e-5 and llama.sliding_window is None and llama.activation == "silu"
    qwen = _config(tmp_path, QWEN25_05B)
    assert qwen.qkv_bias and qwen.head_dim == 64 and qwen.sliding_window is None


def test_transformers5_rope_parameters_per_layer_type(tmp_path: Path) -> None:
    hf = {**GEMMA3_1B, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
          "num_hidden_layers": 4, "rope_parameters": {
              "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5},
              "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}}
    cfg = _config(tmp_path, hf)
    assert (cfg.global_every, cfg.rope_theta, cfg.rope_local_theta) == (4, 5e5, 2e4)
    assert (cfg.rope_scaling, cfg.rope_scaling_factor) == ("linear", 2.0)
    flat = {**LLAMA_32_1B, "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}}
    del flat["rope_scaling"], flat["rope_theta"]
    assert (_config(tmp_path, flat).rope_theta, _config(tmp_path, flat).rope_scaling) == (1234.0, "none")


@pytest.mark.parametrize("change, problem", [
    ({"model_type": "mistral"}, "gemma, gemma2, gemma3, gemma3_text, llama, qwen2, qwen3"),
    ({"layer_types": ["sliding_attention", "full_attention", "full_attention"],
      "num_hidden_layers": 3}, "global layers at"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"hidden_activation": "gelu"}, "activation 'gelu'"),
])
def test_unsupported_configs_are_refused(tmp_path: Path, change: dict, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        _config(tmp_path, {**GEMMA3_1B, **change})


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        model_config_from_hf(tmp_path, ModelConfig())


# ------------------------------------------------------------------ safetensors reader


def _sample() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(5, 3)).astype(ml_dtypes.bfloat16),
            "h": rng.normal(size=(7,)).astype(np.float16), "i": np.arange(6, dtype=np.int64),
            "s": np.asarray(2.5, np.float32), "t": rng.normal(size=(3, 4)).astype(np.float32).T}


def test_streamed_writer_agrees_with_safetensors_package(tmp_path: Path) -> None:
    tensors = _sample()
    names = list(tensors)
    st.write_tensors(tmp_path / "ours.safetensors", [(n, tensors[n].dtype, tensors[n].shape)
                                                     for n in names],
                     lambda i: tensors[names[i]], {"format": "pt"})
    raw = (tmp_path / "ours.safetensors").read_bytes()
    assert (8 + int.from_bytes(raw[:8], "little")) % 8 == 0  # data buffer aligned
    theirs = safetensors.torch.load_file(tmp_path / "ours.safetensors")
    back = st.open_file(tmp_path / "ours.safetensors")
    for name, value in tensors.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        np.testing.assert_array_equal(back[name], value)
        bits = theirs[name].view(torch.int16) if value.dtype == ml_dtypes.bfloat16 else theirs[name]
        np.testing.assert_array_equal(bits.numpy(), value.view(np.int16)
                                      if value.dtype == ml_dtypes.bfloat16 else value)
    safetensors.torch.save_file({"w": theirs["w"], "i": theirs["i"]}, tmp_path / "pkg.safetensors")
    again = st.open_file(tmp_path / "pkg.safetensors")
    np.testing.assert_array_equal(again["w"], tensors["w"])
    np.testing.assert_array_equal(again["i"], tensors["i"])
    st.save_file(tensors, tmp_path / "dict.safetensors")  # the package's writer, C order first
    for name, value in st.open_file(tmp_path / "dict.safetensors").items():
        np.testing.assert_array_equal(value, tensors[name])


class _Recorded:
    """A stored tensor that counts the elements LazyTensor reads from it."""

    def __init__(self, a: np.ndarray) -> None:
        self.a, self.read = a, 0

    def __getitem__(self, box: tuple) -> np.ndarray:
        self.read += self.a[box].size
        return self.a[box].copy()


@pytest.mark.parametrize("ops, read", [
    (lambda x: x.T.reshape(2, 4, 6)[1:, :, 2:5], 4 * 3),  # a shard: exactly its bytes
    (lambda x: x.T.reshape(2, 4, 6)[:, 1:3], 6 * 8),  # an inner split sliced: whole rows
    (lambda x: x[-1, 2:][1:].reshape(5, 1), 5),
    (lambda x: x[2].reshape(2, 4)[1], 4),
    (lambda x: x[:, 3].T, 6),
    (lambda x: x[4:2], 0),
])
def test_lazy_tensor_agrees_with_numpy_and_reads_its_box(ops: Any, read: int) -> None:
    a = np.arange(48, dtype=np.float32).reshape(6, 8)
    source = _Recorded(a)
    got = np.asarray(ops(st.LazyTensor(source, a.shape, a.dtype)))
    np.testing.assert_array_equal(got, ops(a))
    assert got.shape == ops(a).shape and source.read == read


def test_sharded_checkpoint_via_index(tmp_path: Path) -> None:
    tensors = _sample()
    st.save_file({"w": tensors["w"]}, tmp_path / "model-00001-of-00002.safetensors")
    st.save_file({"i": tensors["i"]}, tmp_path / "model-00002-of-00002.safetensors")
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors",
                            "i": "model-00002-of-00002.safetensors"}}
    (tmp_path / st.INDEX_FILE).write_text(json.dumps(index))
    assert sorted(st.open_checkpoint(tmp_path)) == ["i", "w"]
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="missing.*model-00002-of-00002"):
        st.open_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncate", "header_json", "header_length", "offsets", "dtype"])
def test_damaged_files_raise_config_error(tmp_path: Path, damage: str) -> None:
    file = tmp_path / "model.safetensors"
    st.save_file(_sample(), file)
    raw = bytearray(file.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    if damage == "truncate":
        raw = raw[:-5]
    elif damage == "header_json":
        raw[10:14] = b"\x00\xff{{"
    elif damage == "header_length":
        raw[:8] = (len(raw) + 1).to_bytes(8, "little")
    else:
        header["w"].update({"offsets": {"data_offsets": [0, 10]}, "dtype": {"dtype": "Q7"}}[damage])
        text = json.dumps(header).encode()
        raw = bytearray(len(text).to_bytes(8, "little") + text + raw[8 + n:])
    file.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"model.safetensors is not a valid safetensors file.*re-download"):
        st.open_file(file)
