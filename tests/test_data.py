"""Data pipeline: tokenizer, tasks, jsonl sources, SFT rows, batching. CPU only, no JAX."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpurl.config import ConfigError, DataConfig, ModelConfig
from gpurl.data import (TASKS, arithmetic, encode_sft, eval_batches, load_examples,
                        process_rows, step_indices, take)
from gpurl.models.chat_template import render_chat_template
from gpurl.models.loading import load_tokenizer
from gpurl.models.tokenizer import Tokenizer, byte_tokenizer

TOK = byte_tokenizer()


# --- tokenizer ---------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.text(max_size=64))
def test_byte_tokenizer_roundtrips_any_unicode(text: str) -> None:
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text
    assert len(ids) == len(text.encode("utf-8"))  # no merges: one id per byte
    assert all(3 <= i < 259 for i in ids)


def test_byte_tokenizer_ids() -> None:
    assert (TOK.pad_id, TOK.eos_id, TOK.bos_id, TOK.vocab_size) == (0, 1, 2, 259)
    text = "Hi, héllo 日本\n"
    assert TOK.encode(text) == [b + 3 for b in text.encode("utf-8")]
    assert TOK.encode_batch(["ab", "", "c d"]) == [TOK.encode("ab"), [], TOK.encode("c d")]
    # Special names in text stay bytes; special ids and out-of-vocab ids are not decoded.
    assert TOK.encode("<eos>") == [b + 3 for b in b"<eos>"]
    assert TOK.decode([TOK.bos_id, *TOK.encode("ok"), TOK.eos_id, TOK.pad_id, 400]) == "ok"
    assert TOK.decode(np.array(TOK.encode("np"), np.int32)) == "np"


def test_byte_chat_template() -> None:
    messages = [{"role": "user", "content": "12 + 7 ="}, {"role": "assistant", "content": "19"}]
    assert TOK.apply_chat_template(messages) == (
        "<start_of_turn>user\n12 + 7 =<end_of_turn>\n<start_of_turn>model\n19<end_of_turn>\n")
    assert TOK.apply_chat_template(messages[:1], add_generation_prompt=True) == (
        "<start_of_turn>user\n12 + 7 =<end_of_turn>\n<start_of_turn>model\n")


def test_chat_template_sandbox_and_raise_exception() -> None:
    template = ("{% if messages[0]['role'] != 'user' %}"
                "{{ raise_exception('user first') }}{% endif %}"
                "{{ bos_token }}{{ messages | tojson }}")
    assert render_chat_template(template, [{"role": "user", "content": "<a>"}], False, "B") == (
        'B[{"role": "user", "content": "<a>"}]')
    with pytest.raises(ConfigError, match="user first"):
        render_chat_template(template, [{"role": "system", "content": "x"}], False)
    with pytest.raises(ConfigError, match="failed to render"):  # sandbox blocks internals
        render_chat_template("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}",
                             [], False)


def _write_hf_tokenizer(folder: Path, config: dict) -> None:
    TOK.tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def test_load_tokenizer_from_tokenizer_json(tmp_path: Path) -> None:
    template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    _write_hf_tokenizer(tmp_path, {"eos_token": {"content": "<eos>"}, "bos_token": "<bos>",
                                   "pad_token": None, "chat_template": template})
    for path in (tmp_path, tmp_path / "tokenizer.json"):
        tok = load_tokenizer(ModelConfig(tokenizer=str(path)))
        assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.vocab_size) == (1, 2, 1, 259)
        assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<bos>[x]"
        assert tok.decode(tok.encode("round trip")) == "round trip"


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    assert load_tokenizer(ModelConfig(tokenizer="bytes")).vocab_size == 259
    with pytest.raises(ConfigError, match=r"does not exist.*bytes"):
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "nope.json")))
    with pytest.raises(ConfigError, match=r"259 ids but model.vocab_size=100"):
        load_tokenizer(ModelConfig(tokenizer="bytes", vocab_size=100))


# --- tasks and sources -------------------------------------------------------------------

def test_arithmetic_is_deterministic_correct_and_unique() -> None:
    items = arithmetic(500, seed=3)
    assert items == arithmetic(500, seed=3)
    assert items != arithmetic(500, seed=4)
    assert arithmetic(50, seed=3) == items[:50]  # prefix-stable in num
    assert len({it["prompt"] for it in items}) == 500
    assert {"+", "-"} <= {it["prompt"].split()[1] for it in items}
    for it in items:
        a, op, b = re.fullmatch(r"(\d+) ([+-]) (\d+) =", it["prompt"]).groups()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert 0 <= int(a) <= 99 and 0 <= int(b) <= 99 and value >= 0
        assert it["answer"] == str(value) and it["completion"] == f" {value}"
    assert TASKS["arithmetic"] is arithmetic


def test_arithmetic_defaults_keep_the_original_items() -> None:
    # Pinned from the task before it had ranges and ops: default runs see the same data.
    assert [it["prompt"] for it in arithmetic(4, 1234)] == [
        "56 - 46 =", "79 + 96 =", "3 + 74 =", "71 - 57 ="]
    assert arithmetic(300, 1234, DataConfig(ops=["-", "+"])) == arithmetic(300, 1234)


@pytest.mark.parametrize("num_train,num_eval", [(300, 40), (15_050, 100)])
def test_task_split_has_no_overlap(num_train: int, num_eval: int) -> None:
    train, eval_ = load_examples(DataConfig(num_train=num_train, num_eval=num_eval, seed=5))
    assert len(eval_) == num_eval
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    if num_train + num_eval <= 15_050:
        assert len(train) == num_train


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_jsonl_both_forms_and_metadata(tmp_path: Path) -> None:
    rows = [{"prompt": "p0", "completion": "c0", "id": 0},
            {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "a"}], "id": 1}]
    path = _jsonl(tmp_path / "train.jsonl", rows)
    eval_path = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "e", "completion": "f"}])
    train, eval_ = load_examples(DataConfig(name="jsonl", path=path, eval_path=eval_path))
    assert train[0] == rows[0]
    assert train[1]["id"] == 1 and train[1]["completion"] == "a" and train[1]["prompt"] == "s\nu"
    assert train[1]["messages"] == rows[1]["messages"][:2]
    assert list(eval_) == [{"prompt": "e", "completion": "f"}]


def test_jsonl_seeded_holdout(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": str(i), "completion": "x"} for i in range(20)])
    cfg = DataConfig(name="jsonl", path=path, num_eval=5, seed=7)
    train, eval_ = load_examples(cfg)
    again = load_examples(cfg)
    assert (list(train), list(eval_)) == (list(again[0]), list(again[1]))
    assert len(train) == 15 and len(eval_) == 5
    assert sorted(r["prompt"] for r in [*train, *eval_]) == sorted(str(i) for i in range(20))
    assert [int(r["prompt"]) for r in train] == sorted(int(r["prompt"]) for r in train)


@pytest.mark.parametrize("rows,match", [
    (['{"prompt": "a", "completion": "b"}', '{"prompt": '], r"line 2 is not valid JSON"),
    ([{"question": "a"}], r"bad.jsonl has neither \"prompt\" and \"completion\" nor"),
    ([{"prompt": "a", "completion": 3}], r"row 1: 'completion' is a int, not a string"),
    ([{"messages": [{"role": "user"}]}], r"row 1: 'messages'\[0\]\['content'\] is missing"),
    ([{"messages": "hi"}], r"row 1: 'messages' must be a non-empty list"),
    ([{"messages": [{"role": "user", "content": "q"}]}], r"last message has role 'user'"),
    ([[1, 2]], r"line 1 is a list, not an object"),
    ([], r"has no rows"),
    ([{"prompt": "a", "completion": "b"}] * 3, r"data.num_eval=3 leaves no training rows"),
])
def test_jsonl_errors(tmp_path: Path, rows: list, match: str) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=match):
        train, eval_ = load_examples(DataConfig(name="jsonl", path=path,
                                                num_eval=3 if "num_eval" in match else 0))
        list(train)  # file rows are converted (and checked) when read


def test_jsonl_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.path=.*does not exist"):
        load_examples(DataConfig(name="jsonl", path=str(tmp_path / "none.jsonl")))


def _damaged(tmp_path: Path) -> dict[str, Path]:
    """A damaged copy of each file format gpurl reads (and of a save_to_disk directory)."""
    import datasets

    good = datasets.Dataset.from_list([{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"}
                                       for i in range(40)])
    files = {"parquet": tmp_path / "d.parquet", "arrow": tmp_path / "d.arrow",
             "csv": tmp_path / "d.csv", "json": tmp_path / "d.json",
             "save_to_disk": tmp_path / "saved"}
    good.to_parquet(str(files["parquet"]))
    raw = files["parquet"].read_bytes()
    files["parquet"].write_bytes(raw[:len(raw) // 2])  # cut short: no footer
    files["arrow"].write_bytes(b"\x00not an arrow stream\xff" * 20)
    files["csv"].write_bytes(b"prompt,completion\n\xff\xfe bad bytes,\"unclosed\n")
    files["json"].write_text('[{"prompt": "a", "completion": "b"}, {"prompt": ')
    good.save_to_disk(str(files["save_to_disk"]))
    for arrow in files["save_to_disk"].glob("*.arrow"):
        arrow.write_bytes(arrow.read_bytes()[:64])
    return files


@pytest.mark.parametrize("kind", ["parquet", "arrow", "csv", "json", "save_to_disk"])
def test_a_damaged_data_file_is_one_sentence(tmp_path: Path, kind: str) -> None:
    """data.path and suite_path to a damaged file of any format: one sentence naming the
    key, the file and what to do (before: pyarrow's or datasets' traceback)."""
    from gpurl.data import suites

    path = _damaged(tmp_path)[kind]
    for call in (lambda: list(load_examples(DataConfig(name="jsonl", path=str(path),
                                                       num_eval=0))[0]),
                 lambda: suites.load(suites.get("gsm8k"), str(path))):
        with pytest.raises(ConfigError) as raised:
            call()
        message = str(raised.value)
        assert str(path) in message and "\n" not in message, message
        assert message.endswith(".") and message.count(". ") == 0, message
        if kind != "json":  # a .json file's lines are read first: the bad line is named
            assert re.search(r"not a readable \w+ file|cannot be read", message), message


# --- SFT rows ----------------------------------------------------------------------------

EXAMPLES = [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(0, 60, 7)]


def _segments(rows, n: int):
    """(tokens, positions, loss_mask) of every example in row n, by segment id."""
    seg = rows.segment_ids[n]
    for s in range(1, seg.max() + 1):
        at = seg == s
        assert at.any()
        yield rows.tokens[n, at], rows.positions[n, at], rows.loss_mask[n, at]


def test_loss_mask_is_exactly_completion_and_eos() -> None:
    rows = encode_sft(EXAMPLES, TOK, DataConfig(max_len=32))
    assert rows.tokens.shape == (len(EXAMPLES), 32) and rows.tokens.dtype == np.int32
    assert rows.loss_mask.dtype == np.float32 and rows.num_truncated == 0
    for n, ex in enumerate(EXAMPLES):
        target = rows.tokens[n][rows.loss_mask[n] == 1]
        assert target.tolist() == TOK.encode(ex["completion"]) + [TOK.eos_id]
        assert TOK.decode(target) == ex["completion"]
        length = int((rows.segment_ids[n] > 0).sum())
        assert rows.tokens[n, 0] == TOK.bos_id and rows.tokens[n, length - 1] == TOK.eos_id
        assert TOK.decode(rows.tokens[n, :length]) == ex["prompt"] + ex["completion"]
        assert (rows.tokens[n, length:] == TOK.pad_id).all()


def test_chat_template_completion_is_the_assistant_turn() -> None:
    ex = {"prompt": "2 + 2 =", "completion": "4"}
    rows = encode_sft([ex], TOK, DataConfig(max_len=96, chat_template=True))
    target = rows.tokens[0][rows.loss_mask[0] == 1]
    assert TOK.decode(target) == "4<end_of_turn>" and target[-1] == TOK.eos_id
    prompt = TOK.decode(rows.tokens[0][(rows.loss_mask[0] == 0) & (rows.segment_ids[0] > 0)])
    assert prompt == TOK.apply_chat_template([{"role": "user", "content": "2 + 2 ="}], True)


def test_chat_template_bos_is_not_doubled() -> None:
    template = "{{ bos_token }}{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    tok = Tokenizer(TOK.tok, eos_id=1, pad_id=0, bos_id=2, chat_template=template)
    rows = encode_sft([{"prompt": "q", "completion": "a"}], tok, DataConfig(chat_template=True))
    assert rows.tokens[0, :4].tolist() == [2, *TOK.encode("<q>")]
    assert TOK.decode(rows.tokens[0][rows.loss_mask[0] == 1]) == "<a>"


def test_messages_without_template_join_contents() -> None:
    ex = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
          "prompt": "s\nu", "completion": "a"}
    rows = encode_sft([ex], TOK, DataConfig(max_len=16))
    assert TOK.decode(rows.tokens[0]) == "s\nua"


def test_first_token_never_has_loss_without_bos() -> None:
    tok = Tokenizer(TOK.tok, eos_id=1, pad_id=0, bos_id=None)
    rows = encode_sft([{"prompt": "", "completion": "abc"}], tok, DataConfig(max_len=8))
    assert rows.tokens[0, :4].tolist() == [*TOK.encode("abc"), 1]
    assert rows.loss_mask[0].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]


def test_truncation_keeps_the_start_and_counts() -> None:
    examples = [{"prompt": "a" * 10, "completion": "b" * 10}, {"prompt": "c", "completion": "d"}]
    rows = encode_sft(examples, TOK, DataConfig(max_len=12))
    assert rows.num_truncated == 1
    assert TOK.decode(rows.tokens[0]) == "a" * 10 + "b"
    assert rows.loss_mask[0].sum() == 1 and rows.loss_mask[1].sum() == 2
    assert rows.positions[0].tolist() == list(range(12))


@pytest.mark.parametrize("max_len", [16, 40, 100])
def test_packing_preserves_every_example(max_len: int) -> None:
    rng = np.random.default_rng(0)
    examples = [{"prompt": "p" * int(rng.integers(0, 12)),
                 "completion": "c" * int(rng.integers(1, 9))} for _ in range(50)]
    cfg = DataConfig(max_len=max_len)
    single = encode_sft(examples, TOK, cfg)
    packed = encode_sft(examples, TOK, DataConfig(max_len=max_len, packing=True))
    assert packed.num_truncated == single.num_truncated
    assert len(packed) <= len(single)
    found = [seg for n in range(len(packed)) for seg in _segments(packed, n)]
    assert len(found) == len(examples)
    expected = [next(_segments(single, n)) for n in range(len(single))]
    # Segments from all rows, matched by content (order in rows differs from input order).
    key = lambda seg: (seg[0].tobytes(), seg[2].tobytes())  # noqa: E731
    assert sorted(map(key, found)) == sorted(map(key, expected))
    for tokens, positions, _ in found:
        assert positions.tolist() == list(range(len(tokens)))
    assert (packed.loss_mask[packed.segment_ids == 0] == 0).all()
    assert (packed.tokens[packed.segment_ids == 0] == TOK.pad_id).all()


def test_packing_is_first_fit_in_order() -> None:
    lengths = [6, 5, 3, 2, 4, 1]  # with bos + eos: 8 7 5 4 6 3 tokens
    examples = [{"prompt": "", "completion": "x" * n} for n in lengths]
    rows = encode_sft(examples, TOK, DataConfig(max_len=10, packing=True))
    # The 3 goes back to row 1 (free 3), not row 0 (free 2) and not a new row.
    sizes = [[len(tokens) for tokens, _, _ in _segments(rows, n)] for n in range(len(rows))]
    assert sizes == [[8], [7, 3], [5, 4], [6]]


def test_encode_sft_rejects_no_examples() -> None:
    with pytest.raises(ConfigError, match="no examples"):
        encode_sft([], TOK, DataConfig())


# --- batching ----------------------------------------------------------------------------

@pytest.mark.parametrize("num_rows,batch_size", [(10, 3), (10, 5), (4, 9), (1, 2)])
def test_step_indices_stream_is_epoch_permutations(num_rows: int, batch_size: int) -> None:
    steps = 12
    stream = np.concatenate([step_indices(num_rows, batch_size, s, seed=3) for s in range(steps)])
    assert stream.dtype == np.int64 and stream.shape == (steps * batch_size,)
    epochs = stream.size // num_rows
    for e in range(epochs):  # every row exactly once per epoch, even across batch edges
        epoch_N = stream[e * num_rows:(e + 1) * num_rows]
        assert sorted(epoch_N.tolist()) == list(range(num_rows))
        assert (epoch_N == np.random.default_rng([3, e]).permutation(num_rows)).all()
    step_7 = step_indices(num_rows, batch_size, 7, seed=3)
    assert (step_7 == stream[7 * batch_size:8 * batch_size]).all()


def test_step_indices_depends_on_seed() -> None:
    assert (step_indices(100, 8, 2, seed=0) == step_indices(100, 8, 2, seed=0)).all()
    assert not (step_indices(100, 8, 2, seed=0) == step_indices(100, 8, 2, seed=1)).all()


def test_process_rows_partition_the_batch() -> None:
    indices = step_indices(50, 12, 3, seed=0)
    for count in (1, 2, 3, 4, 6, 12):
        parts = [process_rows(indices, i, count) for i in range(count)]
        assert all(len(p) == 12 // count for p in parts)
        assert (np.concatenate(parts) == indices).all()
    with pytest.raises(ConfigError, match="multiple of 5"):
        process_rows(indices, 0, 5)


def test_take_and_eval_batches_cover_every_row_once() -> None:
    rows = encode_sft(EXAMPLES, TOK, DataConfig(max_len=16))
    batch = take(rows, np.array([2, 0]))
    assert set(batch) == {"tokens", "positions", "segment_ids", "loss_mask"}
    assert (batch["tokens"] == rows.tokens[[2, 0]]).all()
    batches = list(eval_batches(rows, 4))
    assert len(batches) == -(-len(rows) // 4)
    assert all(b["tokens"].shape == (4, 16) for b in batches)
    stacked = {k: np.concatenate([b[k] for b in batches]) for k in batch}
    assert (stacked["tokens"][:len(rows)] == rows.tokens).all()
    assert (stacked["loss_mask"][:len(rows)] == rows.loss_mask).all()
    tail = slice(len(rows), None)
    assert (stacked["segment_ids"][tail] == 0).all() and (stacked["loss_mask"][tail] == 0).all()
    assert (stacked["tokens"][tail] == TOK.pad_id).all()
