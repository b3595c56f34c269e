"""RL prompts: task options, few-shot, Countdown and its reward, GSM8K, jsonl. CPU, no JAX."""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction
from pathlib import Path

import pytest

from gpurl.config import ConfigError, DataConfig
from gpurl.data import (TASK_REWARDS, TASKS, arithmetic, countdown, default_rewards,
                        load_examples, load_prompts)
from gpurl.rewards import load, score
from gpurl.rewards.builtin import countdown as countdown_reward

ADDITION = DataConfig(a_range=[10, 99], b_range=[1, 9], ops=["+"], few_shot=4,
                      num_train=710, num_eval=100, max_len=64)


def _jsonl(path: Path, rows: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# --- arithmetic ----------------------------------------------------------------------------

def test_arithmetic_ranges_and_ops() -> None:
    cfg = DataConfig(a_range=[10, 12], b_range=[3, 4], ops=["*", "-"])
    items = arithmetic(100, seed=0, cfg=cfg)
    problems = {it["prompt"] for it in items[:12]}
    assert len(problems) == 12  # 3 * 2 products + 3 * 2 differences, each once
    for it in items:
        a, op, b = re.fullmatch(r"(\d+) ([*-]) (\d+) =", it["prompt"]).groups()
        assert 10 <= int(a) <= 12 and 3 <= int(b) <= 4
        assert it["answer"] == str(int(a) * int(b) if op == "*" else int(a) - int(b))
    # The listing order of ops does not change the items.
    assert items == arithmetic(100, seed=0, cfg=DataConfig(a_range=[10, 12], b_range=[3, 4],
                                                           ops=["-", "*"]))


def test_addition_preset_matches_the_measured_format() -> None:
    train, eval_ = load_prompts(ADDITION)
    assert len(eval_) == 100 and len(train) == 710
    queries = [row["prompt"].split("\n")[-1] for row in train + eval_]
    assert len(set(queries)) == len(queries) == 810
    assert (train, eval_) == load_prompts(ADDITION)
    assert load_prompts(DataConfig(**{**vars(ADDITION), "seed": 1})) != (train, eval_)
    train_lines = {row["prompt"].split("\n")[-1] + row["completion"] for row in train}
    prefixes = set()
    for row in train + eval_:  # 4 worked lines drawn per prompt, then the query line
        lines = row["prompt"].split("\n")
        assert len(lines) == 5
        for line in lines[:4]:
            a, b, r = map(int, re.fullmatch(r"(\d\d) \+ (\d) = (\d+)", line).groups())
            assert a + b == r
            assert line in train_lines  # worked examples come from training rows only
        assert lines[-1] + row["completion"] not in lines[:4]  # never the prompt's own answer
        query = lines[-1]
        assert re.fullmatch(r"\d\d \+ \d =", query)
        assert row["answer"] == str(eval(query[:-2])) and row["completion"] == " " + row["answer"]
        prefixes.add("\n".join(lines[:4]))
    assert len(prefixes) > 700  # a different draw for (nearly) every prompt
    assert not {q for q in queries[:710]} & {q for q in queries[710:]}


def test_few_shot_does_not_move_items_or_split() -> None:
    cfg = dict(a_range=[0, 9], b_range=[0, 9], num_train=60, num_eval=20, seed=3)
    plain_train, plain_eval = load_prompts(DataConfig(**cfg))
    train, eval_ = load_prompts(DataConfig(**cfg, few_shot=2))
    assert [r["prompt"] for r in plain_eval] == [r["prompt"].split("\n")[-1] for r in eval_]
    assert [r["prompt"] for r in plain_train] == [r["prompt"].split("\n")[-1] for r in train]


def test_eval_is_disjoint_when_problems_run_out() -> None:
    cfg = DataConfig(a_range=[1, 3], b_range=[1, 3], ops=["+"], num_train=20, num_eval=4,
                     few_shot=1)
    train, eval_ = load_prompts(cfg)
    assert len(eval_) == 4 and train
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    with pytest.raises(ConfigError, match=r"data.few_shot=5 needs more than 5 distinct"):
        load_prompts(DataConfig(a_range=[1, 3], b_range=[1, 3], ops=["+"], num_train=20,
                                num_eval=4, few_shot=5))


@pytest.mark.parametrize("kwargs,match", [
    (dict(a_range=[5, 2]), r"data.a_range=\[5, 2\] is not valid; give \[lo, hi\]"),
    (dict(b_range=[-1, 3]), r"data.b_range=\[-1, 3\] is not valid"),
    (dict(a_range=[1]), r"data.a_range=\[1\] is not valid"),
    (dict(ops=["/"]), r"data.ops=\['/'\] is not valid; give a non-empty list of \+, - and \*"),
    (dict(ops=[]), r"data.ops=\[\] is not valid"),
    (dict(few_shot=-1), r"data.few_shot=-1 is not valid"),
    (dict(name="jsonl", path="x.jsonl", few_shot=2), r"data.few_shot needs reference"),
    (dict(name="countdown", countdown_numbers=1), r"data.countdown_numbers=1 is not valid"),
    (dict(name="gsm8k"), r"data=gsm8k needs rows; set data.dataset to a Hub id or data.path"),
    (dict(name="gsm8k", path="x", prompt_template="Q: {q}"), r"must contain \{question\}"),
    (dict(prompt_template="{question}"), r"applies to data=gsm8k"),
    (dict(name="mnist"), r"data.name='mnist' is not valid; use one of: arithmetic, countdown"),
])
def test_data_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        DataConfig(**kwargs)


def test_arithmetic_without_problems_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"gives no problem \(a - b needs a >= b\)"):
        arithmetic(5, 0, DataConfig(a_range=[0, 3], b_range=[5, 9], ops=["-"]))


# --- countdown -----------------------------------------------------------------------------

def _numbers_in(expression: str) -> list[int]:
    return [node.value for node in ast.walk(ast.parse(expression, mode="eval"))
            if isinstance(node, ast.Constant)]


@pytest.mark.parametrize("count,max_number", [(3, 20), (4, 20), (2, 5), (6, 99)])
def test_countdown_targets_are_reachable(count: int, max_number: int) -> None:
    cfg = DataConfig(name="countdown", countdown_numbers=count, countdown_max=max_number)
    items = countdown(300, seed=2, cfg=cfg)
    assert items == countdown(300, seed=2, cfg=cfg) and countdown(30, 2, cfg) == items[:30]
    for it in items:
        assert len(it["numbers"]) == count and all(1 <= n <= max_number for n in it["numbers"])
        assert sorted(_numbers_in(it["solution"])) == sorted(it["numbers"])
        assert Fraction(eval(it["solution"])) == int(it["answer"]) >= 1  # trusted text
        assert it["prompt"] == (f"Using the numbers {it['numbers']}, make {it['answer']}. You may "
                                f"use + - * / and each number at most once. Answer with the "
                                f"expression.\nExpression:")
        assert it["completion"] == " " + it["solution"]
    rewards = countdown_reward([it["prompt"] for it in items], [it["completion"] for it in items],
                               [it["answer"] for it in items], [it["numbers"] for it in items])
    assert rewards == [1.0] * len(items)
    assert TASKS["countdown"] is countdown


@pytest.mark.parametrize("completion,expected", [
    (" 3 * 7 + 12\nmore text", 1.0),
    ("(12 - 7) * 3 + 18", 0.0),  # 18 is not given
    ("12 + 7 * 3", 1.0),
    ("3 * 7 + 12 = 33", 1.0),
    ("3 * 7 + 12 = 34", 0.0),  # a wrong claimed result
    ("12 * 3 - 3", 0.0),  # 3 used twice
    ("12 + 7 + 3", 0.0),  # 22, the wrong target
    ("33", 0.0),
    ("7 * 3 + 12.0", 0.0),  # floats are not the given numbers
    ("-3 + 36", 0.0),
    ("12 / (7 - 7) + 3", 0.0),  # division by zero
    ("3 ** 3 + 6", 0.0),
    ("", 0.0),
    ("\n3 * 7 + 12", 0.0),  # only the first line counts
    ("(" * 500 + "3" + ")" * 500, 0.0),
])
def test_countdown_reward(completion: str, expected: float) -> None:
    assert countdown_reward(["p"], [completion], ["33"], [[3, 7, 12]]) == [expected]


def test_countdown_reward_allows_repeated_given_numbers_and_fractions() -> None:
    completions = ["5 * 5 - 2", "(5 + 5) / 2", "5 * 5 / 5", "3 / 2 * 4"]
    numbers = [[5, 5, 2], [5, 5, 2], [5, 5, 2], [4, 2, 3]]
    # Three 5s are one more than given; 3 / 2 is an exact fraction in between.
    assert countdown_reward(["p"] * 4, completions, [23, 5, 5, 6], numbers) == [1, 1, 0, 1]


@pytest.mark.parametrize("completion", [
    "__import__('os').system('touch PWNED')", "open('PWNED', 'w')", "(lambda: 33)()",
    "[33][0]", "x", "3 if 1 else 4", "().__class__",
])
def test_countdown_reward_never_executes(completion: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert countdown_reward(["p"], [completion], ["33"], [[3, 7, 12]]) == [0.0]
    assert not (tmp_path / "PWNED").exists()


def test_countdown_through_the_reward_registry() -> None:
    train, _ = load_prompts(DataConfig(name="countdown", num_train=8, num_eval=2))
    metadata = {key: [row[key] for row in train] for key in ("answer", "numbers")}
    total, _ = score(load(default_rewards(DataConfig(name="countdown"))),
                     [r["prompt"] for r in train], [r["completion"] for r in train], metadata)
    assert total.tolist() == [1.0] * len(train)


# --- gsm8k ---------------------------------------------------------------------------------

GSM_ROWS = [{"question": f"Tom has {i} apples and buys 3 more. How many?",
             "answer": f"{i} + 3 = <<{i}+3={i + 3}>>{i + 3}\n#### {i + 3:,}", "id": i}
            for i in range(998, 1008)]


def test_gsm8k_prompts_answers_and_holdout(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    cfg = DataConfig(name="gsm8k", path=path, num_eval=3)
    train, eval_ = load_prompts(cfg)
    assert len(train) == 7 and len(eval_) == 3 and (train, eval_) == load_prompts(cfg)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    for row in [*train, *eval_]:
        source = GSM_ROWS[row["id"] - 998]
        assert row["prompt"] == f"Question: {source['question']}\nAnswer:"
        assert row["answer"] == str(row["id"] + 3)  # commas dropped
        assert row["completion"] == " " + source["answer"]
    assert load_examples(cfg) == (train, eval_)  # SFT trains on the reasoning
    with pytest.raises(ConfigError, match=r"every training prompt of data=gsm8k is also held out"):
        load_prompts(DataConfig(name="gsm8k", path=path, eval_path=path))
    other = _jsonl(tmp_path / "test.jsonl", GSM_ROWS[:2])
    train, eval_ = load_prompts(DataConfig(name="gsm8k", path=path, eval_path=other,
                                           prompt_template="Q: {question}\nA:"))
    assert len(train) == 8 and len(eval_) == 2 and eval_[0]["prompt"].startswith("Q: Tom has 998")


def test_gsm8k_few_shot_blocks_are_blank_line_separated(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "gsm.jsonl", GSM_ROWS)
    train, eval_ = load_prompts(DataConfig(name="gsm8k", path=path, num_eval=3, few_shot=2))
    blocks = eval_[0]["prompt"].split("\n\n")
    assert len(blocks) == 3 and blocks[-1].startswith("Question: ") and len(train) == 7
    assert all(b.startswith("Question: ") and "\n#### " in b for b in blocks[:2])


@pytest.mark.parametrize("rows,match", [
    ([{"question": "q", "answer": "4"}], r"row 1: \"answer\" has no \"####\""),
    ([{"question": "q", "answer": "x #### four"}], r"after \"####\" is 'four', not a number"),
    ([{"answer": "#### 4"}], r"bad.jsonl has no \"question\" column; data=gsm8k rows have"),
    ([{"question": "q"}], r"bad.jsonl has no \"answer\" column"),
    ([{"question": 3, "answer": "#### 4"}], r"row 1: 'question' is a int, not a string"),
    (['{"question": "q", "answer": "#### 4"}', "{oops"], r"line 2 is not valid JSON"),
])
def test_gsm8k_errors(tmp_path: Path, rows: list, match: str) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=match):
        list(load_prompts(DataConfig(name="gsm8k", path=path, num_eval=0))[0])


# --- generic jsonl -------------------------------------------------------------------------

def test_jsonl_prompts_keep_metadata_without_completion(tmp_path: Path) -> None:
    rows = [{"prompt": f"p{i}", "answer": i, "tags": ["x"]} for i in range(6)]
    rows.append({"messages": [{"role": "user", "content": "hi"}], "answer": 7})
    rows.append({"messages": [{"role": "user", "content": "q"},
                              {"role": "assistant", "content": "ref"}], "answer": 8})
    path = _jsonl(tmp_path / "rl.jsonl", rows)
    train, eval_ = load_prompts(DataConfig(name="jsonl", path=path, num_eval=2, seed=0))
    assert len(train) == 6 and len(eval_) == 2
    by_answer = {row["answer"]: row for row in [*train, *eval_]}
    assert by_answer[3] == rows[3]
    assert by_answer[7]["prompt"] == "hi" and by_answer[7]["messages"] == rows[6]["messages"]
    assert "completion" not in by_answer[7]
    assert by_answer[8]["prompt"] == "q" and by_answer[8]["completion"] == "ref"
    with pytest.raises(ConfigError, match=r"row 1 has neither \"prompt\" and \"completion\""):
        list(load_examples(DataConfig(name="jsonl", path=path, num_eval=0))[0])  # SFT: completions


def test_jsonl_prompt_errors(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(ConfigError, match=r"row 2 has neither a \"prompt\" nor a \"messages\""):
        list(load_prompts(DataConfig(name="jsonl", path=path, num_eval=0))[0])
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "completion": 1}])
    with pytest.raises(ConfigError, match=r"row 1: 'completion' is a int"):
        list(load_prompts(DataConfig(name="jsonl", path=path, num_eval=0))[0])


# --- default rewards -----------------------------------------------------------------------

def test_every_source_has_default_rewards_that_resolve() -> None:
    names = {"arithmetic", "arithmetic_prefs", "countdown", "gsm8k", "math", "jsonl", "hf",
             "calculator", "guess_number", "quadrant"}
    assert set(TASK_REWARDS) == names
    for name in names:
        cfg = DataConfig(name=name, path="x.jsonl", dataset="owner/name")
        assert default_rewards(cfg) == TASK_REWARDS[name] and load(default_rewards(cfg))
    assert default_rewards(ADDITION) == ["first_number_match"]
    # The real model's few-shot completion: the answer, then an invented example line.
    total, _ = score(load(default_rewards(ADDITION)), ["p"], [" 35\n12 + 3 = 15"],
                     {"answer": ["35"]})
    assert total.tolist() == [1.0]
