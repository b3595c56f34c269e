"""Data files as other frameworks write them, read through `datasets`.

Each file is written the way that framework's documentation describes it: verl's RL
parquet (https://verl.readthedocs.io/en/latest/preparation/prepare_data.html: `data_source`,
`prompt` as a chat list, `ability`, `reward_model` {"style", "ground_truth"}, `extra_info`),
TRL's dataset formats (https://huggingface.co/docs/trl/dataset_formats: standard and
conversational language modeling, prompt-completion, prompt-only and preference, with
explicit and implicit prompt), and plain files in every supported container (jsonl, json,
parquet, csv, arrow, save_to_disk).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import datasets
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.config import ConfigError, DataConfig
from gpurl.data.preferences import load_pairs
from gpurl.data.sources import load_examples, load_prompts
from gpurl.train import loop

USER = {"role": "user", "content": "What is 2 + 3?"}


def _verl_rows(n: int) -> list[dict]:
    """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    return [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": f"What is {i} + 3? Let's think step by step "
                                                    "and output the final answer after \"####\"."}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 3)},
             "extra_info": {"split": "train", "index": i, "answer": f"{i} + 3 = {i + 3}",
                            "question": f"What is {i} + 3?"}} for i in range(n)]


def _parquet(path: Path, rows: list[dict]) -> str:
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_verl_rl_parquet_gives_chat_prompts_ground_truth_and_metadata(tmp_path: Path) -> None:
    path = _parquet(tmp_path / "train.parquet", _verl_rows(8))
    train, eval_ = load_prompts(DataConfig(name="jsonl", path=path, num_eval=2))
    assert len(train) == 6 and len(eval_) == 2
    row = train[0]
    source = _verl_rows(8)[row["extra_info"]["index"]]
    assert row["messages"] == source["prompt"] and row["prompt"] == source["prompt"][0]["content"]
    assert row["answer"] == source["reward_model"]["ground_truth"]
    assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
    assert row["extra_info"] == source["extra_info"]
    # data.answer_key reaches any nested column
    other = load_prompts(DataConfig(name="jsonl", path=path, num_eval=2,
                                    answer_key="extra_info.answer"))[0][0]
    assert other["answer"] == f"{other['extra_info']['index']} + 3 = {other['extra_info']['index'] + 3}"


def test_trl_language_modeling_and_prompt_completion(tmp_path: Path) -> None:
    conv = [{"messages": [{"role": "system", "content": "be brief"}, USER,
                          {"role": "assistant", "content": "5"}]}]
    standard_pc = [{"prompt": "The sky is", "completion": " blue."}]
    conv_pc = [{"prompt": [USER], "completion": [{"role": "assistant", "content": "5"}]}]
    for name, rows in {"conv": conv, "standard_pc": standard_pc, "conv_pc": conv_pc}.items():
        path = _parquet(tmp_path / f"{name}.parquet", rows * 3)
        train, _ = load_examples(DataConfig(name="jsonl", path=path, num_eval=0))
        row = train[0]
        if name == "standard_pc":
            assert (row["prompt"], row["completion"]) == ("The sky is", " blue.")
            assert "messages" not in row
        else:
            assert row["completion"] == "5" and row["messages"][-1] == USER
            assert row["prompt"].endswith(USER["content"])


def test_trl_prompt_only(tmp_path: Path) -> None:
    for rows in ([{"prompt": "The sky is"}], [{"prompt": [USER]}]):
        path = _parquet(tmp_path / "p.parquet", rows * 2)
        row = load_prompts(DataConfig(name="jsonl", path=path, num_eval=0))[0][0]
        assert row["prompt"] in ("The sky is", USER["content"])
        assert "completion" not in row


@pytest.mark.parametrize("form", ["standard", "conversational", "implicit_standard",
                                  "implicit_conversational"])
def test_trl_preference_formats(tmp_path: Path, form: str) -> None:
    rows = {
        "standard": [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}],
        "conversational": [{"prompt": [USER], "chosen": [{"role": "assistant", "content": "5"}],
                            "rejected": [{"role": "assistant", "content": "6"}]}],
        "implicit_standard": [{"chosen": "The sky is blue.", "rejected": "The sky is green."}],
        "implicit_conversational": [
            {"chosen": [USER, {"role": "assistant", "content": "5"}],
             "rejected": [USER, {"role": "assistant", "content": "6"}]}],
    }[form]
    path = _parquet(tmp_path / "prefs.parquet", rows * 3)
    pair = load_pairs(DataConfig(name="jsonl", path=path, num_eval=0))[0][0]
    if form.endswith("standard"):
        assert (pair["prompt"], pair["chosen"], pair["rejected"]) == (
            "The sky is", " blue.", " green.")
    else:
        assert pair["messages"] == [USER] and (pair["chosen"], pair["rejected"]) == ("5", "6")


def test_every_container_reads_the_same_rows(tmp_path: Path) -> None:
    rows = [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}", "answer": str(i + 1)}
            for i in range(12)]
    table = datasets.Dataset.from_list(rows)
    paths = {"jsonl": tmp_path / "t.jsonl", "json": tmp_path / "t.json",
             "parquet": tmp_path / "t.parquet", "csv": tmp_path / "t.csv"}
    paths["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["json"].write_text(json.dumps(rows))  # one JSON array
    table.to_parquet(str(paths["parquet"]))
    table.to_csv(str(paths["csv"]), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    paths["save_to_disk"] = tmp_path / "saved"
    paths["arrow"] = Path(table.load_from_disk(str(tmp_path / "saved")).cache_files[0]["filename"])
    datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(
        str(tmp_path / "dict"))
    paths["save_to_disk splits"] = tmp_path / "dict"
    expected = None
    for name, path in paths.items():
        train, eval_ = load_examples(DataConfig(name="jsonl", path=str(path), num_eval=3))
        got = ([dict(r) for r in train], [dict(r) for r in eval_])
        expected = expected or got
        assert got == expected, name
    test_split = load_examples(DataConfig(name="jsonl", path=str(tmp_path / "dict"), split="test",
                                          num_eval=1))[0]
    assert len(test_split) == 2
    with pytest.raises(ConfigError, match=r"holds the splits train, test, not 'dev'; set "
                                          r"data.split"):
        load_examples(DataConfig(name="jsonl", path=str(tmp_path / "dict"), split="dev"))
    with pytest.raises(ConfigError, match=r"unknown suffix '.txt'"):
        (tmp_path / "t.txt").write_text("x")
        load_examples(DataConfig(name="jsonl", path=str(tmp_path / "t.txt")))


def test_column_keys_map_other_names(tmp_path: Path) -> None:
    rows = [{"question": f"q{i}", "response": f"r{i}", "gold": i} for i in range(4)]
    path = _parquet(tmp_path / "t.parquet", rows)
    cfg = DataConfig(name="jsonl", path=path, num_eval=0, prompt_key="question",
                     completion_key="response", answer_key="gold")
    row = load_examples(cfg)[0][1]
    assert (row["prompt"], row["completion"], row["answer"]) == ("q1", "r1", 1)
    with pytest.raises(ConfigError, match=r"data.prompt_key=query is not a column of .*t.parquet "
                                          r"\(columns: question, response, gold\)"):
        load_examples(dataclasses.replace(cfg, prompt_key="query"))


def test_data_hf_reads_a_local_dataset_and_its_splits(tmp_path: Path) -> None:
    repo = tmp_path / "my_gsm8k"
    (repo / "data").mkdir(parents=True)
    gsm = [{"question": f"q{i}", "answer": f"r #### {i}"} for i in range(6)]
    datasets.Dataset.from_list(gsm[:4]).to_parquet(str(repo / "data" / "train-00000.parquet"))
    datasets.Dataset.from_list(gsm[4:]).to_parquet(str(repo / "data" / "test-00000.parquet"))
    cfg = DataConfig(name="hf", dataset=str(repo), split="train", eval_split="test",
                     prompt_key="question", completion_key="answer")
    train, eval_ = load_examples(cfg)
    assert [r["prompt"] for r in train] == ["q0", "q1", "q2", "q3"]
    assert [r["prompt"] for r in eval_] == ["q4", "q5"]
    with pytest.raises(ConfigError, match=r"is not in the Hugging Face cache"):
        load_prompts(DataConfig(name="hf", dataset="nobody/no-such-dataset-gpurl"))


def test_math_rows_take_the_answer_or_the_last_boxed(tmp_path: Path) -> None:
    rows = [{"problem": "Simplify 2/4.", "solution": "It is $\\boxed{\\frac{1}{2}}$.",
             "answer": "\\frac{1}{2}", "level": "Level 1"},
            {"problem": "What is $1+1$?", "solution": "First \\boxed{3}, no: \\boxed{\\{2\\}}."},
            {"problem": "p", "solution": "s \\boxed{x^{2}}"}]
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    train = load_prompts(DataConfig(name="math", path=str(path), num_eval=0))[0]
    assert [r["answer"] for r in train] == ["\\frac{1}{2}", "\\{2\\}", "x^{2}"]
    assert train[0]["prompt"] == ("Problem: Simplify 2/4.\nGive the final answer as "
                                  "\\boxed{...}.\nSolution:")
    assert train[0]["completion"] == " " + rows[0]["solution"] and train[0]["level"] == "Level 1"


def test_a_million_row_parquet_file_is_not_copied_into_python(tmp_path: Path) -> None:
    """Loading keeps the rows in the memory-mapped Arrow file: the split holds index
    arrays, and converting happens per row on access."""
    n = 200_000
    table = datasets.Dataset.from_dict({"prompt": [f"{i} + 1 =" for i in range(n)],
                                        "answer": [str(i + 1) for i in range(n)]})
    path = str(tmp_path / "big.parquet")
    table.to_parquet(path)
    train, eval_ = load_prompts(DataConfig(name="jsonl", path=path, num_eval=100))
    assert len(train) == n - 100 and isinstance(train.index, np.ndarray)
    assert train.table.cache_files  # memory-mapped from datasets' cache, not in RAM
    assert train[len(train) - 1]["answer"] == str(int(train[len(train) - 1]["prompt"].split()[0]) + 1)


@pytest.mark.e2e
def test_grpo_and_sft_train_on_other_frameworks_files(tmp_path: Path) -> None:
    """GRPO on verl's parquet (its chat prompts rendered by the tokenizer's chat template)
    and SFT on TRL's conversational save_to_disk directory run end to end."""
    verl = _parquet(tmp_path / "verl.parquet", _verl_rows(12))
    rl = make_config(algo={"name": "grpo", "num_generations": 4, "beta": 0.0}, model=TINY_MODEL,
                     data={"name": "jsonl", "path": verl, "num_eval": 4, "max_len": 256},
                     rollout={"max_new_tokens": 4}, logger={"progress": False},
                     train={"steps": 2, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0,
                            "eval_batch_size": 4, "eval_pass_k": 0},
                     run={"dir": str(tmp_path / "grpo")})
    assert loop.train(rl)["finished"]
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert any("reward/numeric_match" in r for r in rows)
    conv = datasets.Dataset.from_list(
        [{"messages": [{"role": "user", "content": f"{i} + 1 ="},
                       {"role": "assistant", "content": f" {i + 1}"}]} for i in range(20)])
    conv.save_to_disk(str(tmp_path / "trl_sft"))
    sft = make_config(algo={"name": "sft"}, model=TINY_MODEL,
                      data={"name": "jsonl", "path": str(tmp_path / "trl_sft"), "num_eval": 4,
                            "max_len": 32},
                      logger={"progress": False}, optim={"lr": 3e-3, "warmup_steps": 0},
                      train={"steps": 3, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
                      run={"dir": str(tmp_path / "sft")})
    assert loop.train(sft)["finished"]
