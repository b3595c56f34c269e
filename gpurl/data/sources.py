"""Where rows come from: a generated task, a GSM8K-format file or a jsonl file.

`load_prompts` gives RL rows: a `prompt` (the complete text fed to the model, worked
examples included) and metadata, which reward functions receive by name: `answer` for
tasks and GSM8K, every other field of a jsonl row. `load_examples` gives SFT rows, which
must also have a `completion`. Rows given as chat `messages` keep `messages`: the
conversation before the final assistant turn, for rendering through a chat template.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpurl.config import ConfigError, DataConfig
from gpurl.data.tasks import TASKS

# GSM8K prompt unless data.prompt_template replaces it; the reference completion is
# " " + the row's answer (reasoning, then "#### 72").
GSM8K_TEMPLATE = "Question: {question}\nAnswer:"

# Reward functions of each source when a run names none (see gpurl.rewards.builtin).
# Few-shot arithmetic completions start with the answer, then invent more example lines.
TASK_REWARDS: dict[str, list[str]] = {
    "arithmetic": ["first_number_match"], "arithmetic_prefs": ["first_number_match"],
    "countdown": ["countdown"], "calculator": ["numeric_match"], "guess_number": ["numeric_match"],
    "gsm8k": ["numeric_match"], "jsonl": ["numeric_match"]}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def default_rewards(cfg: DataConfig) -> list[str]:
    """The reward function names for `cfg`'s source when the run names none."""
    return list(TASK_REWARDS[cfg.name])


def load_prompts(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval) RL rows: "prompt" plus metadata; the two never share a prompt."""
    return _load(cfg, need_completion=False)


def load_examples(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval) SFT rows: "prompt" and "completion"; the two never share a prompt."""
    return _load(cfg, need_completion=True)


def _load(cfg: DataConfig, need_completion: bool) -> tuple[list[dict], list[dict]]:
    if cfg.name not in _SOURCES:
        raise ConfigError(f"data.name={cfg.name!r} is not a known source; use one of: "
                          f"{', '.join(_SOURCES)}.")
    train, eval_ = _SOURCES[cfg.name](cfg, need_completion)
    # Generated tasks repeat items once their distinct problems run out, and files may
    # repeat a prompt: keep held-out prompts unseen.
    held_out = {row["prompt"] for row in eval_}
    train = [row for row in train if row["prompt"] not in held_out]
    if not train:
        raise ConfigError(f"every training prompt of data={cfg.name} is also held out; give "
                          f"data.eval_path other prompts or lower data.num_eval.")
    return _add_few_shot(cfg, train, eval_)


def _add_few_shot(cfg: DataConfig, train: list[dict],
                  eval_: list[dict]) -> tuple[list[dict], list[dict]]:
    """Prepends `cfg.few_shot` worked examples, drawn from the training rows, to every
    prompt: "13 + 8 = 21\n...\n27 + 5 =". Each prompt gets its own draw (never itself,
    never a held-out row): one fixed set would teach every prompt the same accidental
    pattern (with "81 + 1 = 82" among the examples, Gemma 3 270M answers a + 1 to most
    queries). Examples spanning several lines are separated by a blank line."""
    if not cfg.few_shot:
        return train, eval_
    distinct = list({row["prompt"]: row for row in train}.values())
    if cfg.few_shot >= len(distinct):
        raise ConfigError(f"data.few_shot={cfg.few_shot} needs more than {len(distinct)} "
                          f"distinct training prompts; lower data.few_shot or add rows.")
    lines = [row["prompt"] + row["completion"] for row in distinct]
    sep = "\n\n" if any("\n" in line for line in lines) else "\n"
    # A stream of its own, so the worked examples do not move the items or the split.
    rng = np.random.default_rng([cfg.seed, 1])

    def with_prefix(row: dict) -> dict:
        picks = [i for i in rng.choice(len(distinct), cfg.few_shot + 1, replace=False).tolist()
                 if distinct[i]["prompt"] != row["prompt"]][:cfg.few_shot]
        return {**row, "prompt": sep.join(lines[i] for i in picks) + sep + row["prompt"]}

    return [with_prefix(row) for row in train], [with_prefix(row) for row in eval_]


def _task_rows(cfg: DataConfig, need_completion: bool) -> tuple[list[dict], list[dict]]:
    items = TASKS[cfg.name](cfg.num_train + cfg.num_eval, cfg.seed, cfg)
    return items[:cfg.num_train], items[cfg.num_train:]


def _jsonl_rows(cfg: DataConfig, need_completion: bool) -> tuple[list[dict], list[dict]]:
    rows = read_jsonl(cfg.path, "data.path", need_completion)
    if cfg.eval_path:
        return rows, read_jsonl(cfg.eval_path, "data.eval_path", need_completion)
    return _hold_out(rows, cfg)


def _gsm8k_rows(cfg: DataConfig, need_completion: bool) -> tuple[list[dict], list[dict]]:
    template = cfg.prompt_template or GSM8K_TEMPLATE

    def read(path: str | None, key: str) -> list[dict]:
        return [_from_gsm8k(row, where, template) for where, row in _json_objects(path, key)]

    rows = read(cfg.path, "data.path")
    if cfg.eval_path:
        return rows, read(cfg.eval_path, "data.eval_path")
    return _hold_out(rows, cfg)


_SOURCES: dict[str, Callable[[DataConfig, bool], tuple[list[dict], list[dict]]]] = {
    "arithmetic": _task_rows, "arithmetic_prefs": _task_rows, "countdown": _task_rows,
    "calculator": _task_rows, "guess_number": _task_rows,
    "gsm8k": _gsm8k_rows,
    "jsonl": _jsonl_rows}


def _hold_out(rows: list[dict], cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval): `cfg.num_eval` rows drawn by `cfg.seed` are held out."""
    if cfg.num_eval >= len(rows):
        raise ConfigError(
            f"data.num_eval={cfg.num_eval} leaves no training rows in {cfg.path} "
            f"({len(rows)} rows); lower data.num_eval or set data.eval_path.")
    order_X = np.random.default_rng(cfg.seed).permutation(len(rows))
    split = len(rows) - cfg.num_eval
    # Training rows stay in file order: batching shuffles them anyway, and file order
    # makes a run's data easy to inspect.
    train_idx = np.sort(order_X[:split])
    return [rows[i] for i in train_idx], [rows[i] for i in order_X[split:]]


def read_jsonl(path_str: str | None, key: str = "data.path",
               need_completion: bool = True) -> list[dict]:
    """Rows of a jsonl file of {"prompt"[, "completion"]} or {"messages"} objects; the
    completion is required when `need_completion` (SFT)."""
    return [_parse_row(row, where, need_completion) for where, row in _json_objects(path_str, key)]


def _json_objects(path_str: str | None, key: str) -> list[tuple[str, dict]]:
    """(where, object) for every non-blank line, `where` naming the file and line."""
    path = Path(path_str or "").expanduser()
    if not path_str or not path.is_file():
        raise ConfigError(f"{key}={path_str} does not exist; point it to a jsonl file.")
    objects = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                where = f"{path} line {line_no}"
                objects.append((where, _parse_object(line, where)))
    if not objects:
        raise ConfigError(f"{path} has no rows; add one JSON object per line.")
    return objects


def _parse_object(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg}); fix that line.") from e
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is a {type(row).__name__}, not an object; write one "
                          'JSON object per line such as {"prompt": ..., "completion": ...}.')
    return row


def _parse_row(row: dict, where: str, need_completion: bool) -> dict:
    if "messages" in row:
        return _from_messages(row, where, need_completion)
    if "prompt" in row and "trajectory" in row:
        return _from_trajectory(row, where)
    if "prompt" in row and ("completion" in row or not need_completion):
        for field in ("prompt", "completion"):
            if field in row:
                _expect_str(row[field], f"{where}: {field!r}")
        return row
    if need_completion:
        raise ConfigError(f'{where} has neither "prompt" and "completion" nor "messages"; '
                          "add one of the two forms.")
    raise ConfigError(f'{where} has neither "prompt" nor "messages"; add one of the two.')


def _from_messages(row: dict, where: str, need_completion: bool) -> dict:
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f'{where}: "messages" must be a non-empty list of '
                          '{"role", "content"} objects; fix that row.')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f'{where}: messages[{i}] is not an object; write it as '
                              '{"role": ..., "content": ...}.')
        for field in ("role", "content"):
            _expect_str(message.get(field), f"{where}: messages[{i}][{field!r}]")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if messages[-1]["role"] == "assistant":
        prompt_messages, completion = messages[:-1], {"completion": messages[-1]["content"]}
    elif need_completion:
        # Turns after the last assistant reply would be silently dropped; refuse instead.
        raise ConfigError(f'{where}: the last message has role {messages[-1]["role"]!r}; '
                          'end the conversation with the "assistant" reply to train on.')
    else:  # RL: the whole conversation is the prompt
        prompt_messages, completion = messages, {}
    return {**row, "messages": prompt_messages,
            "prompt": "\n".join(m["content"] for m in prompt_messages), **completion}


def _from_trajectory(row: dict, where: str) -> dict:
    """A recorded multi-turn trajectory (`gpurl generate env=... record=F`): the prompt and
    segments {"text", "train"}; SFT trains on the "train" segments (the model's turns)
    only. Its completion is the segments' text."""
    _expect_str(row["prompt"], f"{where}: 'prompt'")
    segments = row["trajectory"]
    if not isinstance(segments, list) or not segments or not all(
            isinstance(s, dict) and isinstance(s.get("text"), str)
            and isinstance(s.get("train"), bool) for s in segments):
        raise ConfigError(f'{where}: "trajectory" must be a non-empty list of '
                          '{"text": str, "train": bool} objects; fix that row.')
    return {**row, "completion": "".join(s["text"] for s in segments)}


def _from_gsm8k(row: dict, where: str, template: str) -> dict:
    """{"question", "answer": "...reasoning... #### 72"} -> prompt, completion, answer "72"."""
    for field in ("question", "answer"):
        if field not in row:
            raise ConfigError(f'{where} has no "{field}"; GSM8K rows are '
                              '{"question": ..., "answer": "... #### 72"}.')
        _expect_str(row[field], f"{where}: {field!r}")
    _, hashes, final = row["answer"].rpartition("####")
    number = final.strip().replace(",", "")
    if not hashes:
        raise ConfigError(f'{where}: "answer" has no "####" before the final answer; '
                          'end it with "#### <number>".')
    if not _NUMBER.fullmatch(number):
        raise ConfigError(f'{where}: the final answer after "####" is {final.strip()!r}, '
                          'not a number; write a number after "####".')
    return {**row, "prompt": template.replace("{question}", row["question"]),
            "completion": " " + row["answer"], "answer": number}


def _expect_str(value: Any, what: str) -> None:
    if not isinstance(value, str):
        shown = "missing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{what} is {shown}, not a string; make it a string.")
