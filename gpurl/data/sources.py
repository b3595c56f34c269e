"""Where examples come from: a built-in generated task or a jsonl file.

Every example leaving this module has a `prompt` (str) and a `completion` (str). Rows
given as chat `messages` also keep `messages`: the conversation before the final
assistant turn, for rendering through a chat template. Other keys of a jsonl row are
kept as metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from gpurl.config import ConfigError, DataConfig
from gpurl.data.tasks import TASKS


def load_examples(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(train, eval) examples for `cfg`; the two never share a row."""
    if cfg.name in TASKS:
        return _task_examples(cfg)
    if cfg.name == "jsonl":
        return _jsonl_examples(cfg)
    valid = ", ".join([*TASKS, "jsonl"])
    raise ConfigError(f"data.name={cfg.name!r} is not a known source; use one of: {valid}.")


def _task_examples(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    items = TASKS[cfg.name](cfg.num_train + cfg.num_eval, cfg.seed)
    eval_rows = items[cfg.num_train:]
    # Tasks repeat items once their distinct problems run out; keep held-out ones unseen.
    held_out = {row["prompt"] for row in eval_rows}
    train_rows = [row for row in items[:cfg.num_train] if row["prompt"] not in held_out]
    return train_rows, eval_rows


def _jsonl_examples(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    rows = read_jsonl(cfg.path, key="data.path")
    if cfg.eval_path:
        return rows, read_jsonl(cfg.eval_path, key="data.eval_path")
    if cfg.num_eval >= len(rows):
        raise ConfigError(
            f"data.num_eval={cfg.num_eval} leaves no training rows in {cfg.path} "
            f"({len(rows)} rows); lower data.num_eval or set data.eval_path.")
    order_N = np.random.default_rng(cfg.seed).permutation(len(rows))
    split = len(rows) - cfg.num_eval
    # Training rows stay in file order: batching shuffles them anyway, and file order
    # makes a run's data easy to inspect.
    train_idx = np.sort(order_N[:split])
    return [rows[i] for i in train_idx], [rows[i] for i in order_N[split:]]


def read_jsonl(path_str: str | None, key: str = "data.path") -> list[dict]:
    """Examples of a jsonl file of {"prompt","completion"} or {"messages"} rows."""
    path = Path(path_str or "").expanduser()
    if not path_str or not path.is_file():
        raise ConfigError(f"{key}={path_str} does not exist; point it to a jsonl file.")
    rows = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_parse_row(line, f"{path} line {line_no}"))
    if not rows:
        raise ConfigError(f"{path} has no rows; add one JSON object per line.")
    return rows


def _parse_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg}); fix that line.") from e
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is a {type(row).__name__}, not an object; write one "
                          'JSON object per line such as {"prompt": ..., "completion": ...}.')
    if "messages" in row:
        return _from_messages(row, where)
    if "prompt" in row and "completion" in row:
        for field in ("prompt", "completion"):
            _expect_str(row[field], f"{where}: {field!r}")
        return row
    raise ConfigError(f'{where} has neither "prompt" and "completion" nor "messages"; '
                      "add one of the two forms.")


def _from_messages(row: dict, where: str) -> dict:
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
    if messages[-1]["role"] != "assistant":
        # Turns after the last assistant reply would be silently dropped; refuse instead.
        raise ConfigError(f'{where}: the last message has role {messages[-1]["role"]!r}; '
                          'end the conversation with the "assistant" reply to train on.')
    prompt_messages = [{"role": m["role"], "content": m["content"]} for m in messages[:-1]]
    return {**row, "messages": prompt_messages,
            "prompt": "\n".join(m["content"] for m in prompt_messages),
            "completion": messages[-1]["content"]}


def _expect_str(value: Any, what: str) -> None:
    if not isinstance(value, str):
        shown = "missing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{what} is {shown}, not a string; make it a string.")
