"""Where rows come from: a generated task, a data file, or a dataset in the HF cache.

`load_prompts` gives RL rows: a `prompt` (the complete text fed to the model, worked
examples included) and metadata, which reward functions receive by name: `answer` for
tasks, GSM8K and MATH, every other column of a file's rows. `load_examples` gives SFT rows,
which also have a `completion`; `load_rows(cfg, "pairs")` preference pairs. Rows given as
chat `messages` keep `messages`: the conversation before the final assistant turn, for
rendering through a chat template. Files are read through `datasets` (`tables.py`) in any
layout of `layouts.py` (gpurl's, TRL's, verl's); their rows stay memory-mapped and are
converted when read.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import numpy as np

from gpurl.config import ConfigError, DataConfig
from gpurl.data.images import image_key
from gpurl.data.layouts import converter, expect_str
from gpurl.data.tables import Rows, columns, open_hub, open_table
from gpurl.data.tasks import TASKS

# GSM8K and MATH prompts unless data.prompt_template replaces them ({question} is the
# row's question / problem); the reference completion is " " + the worked solution.
GSM8K_TEMPLATE = "Question: {question}\nAnswer:"
MATH_TEMPLATE = "Problem: {question}\nGive the final answer as \\boxed{...}.\nSolution:"

# Reward functions of each source when a run names none (see gpurl.rewards.builtin).
# Few-shot arithmetic completions start with the answer, then invent more example lines;
# GSM8K and MATH answers are compared as mathematics (LaTeX, fractions, units).
TASK_REWARDS: dict[str, list[str]] = {
    "arithmetic": ["first_number_match"], "arithmetic_prefs": ["first_number_match"],
    "countdown": ["countdown"], "calculator": ["numeric_match"], "guess_number": ["numeric_match"],
    "quadrant": ["first_line_match"], "gsm8k": ["math_verify"], "math": ["math_verify"], "jsonl": ["numeric_match"],
    "hf": ["numeric_match"]}

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def default_rewards(cfg: DataConfig) -> list[str]:
    """The reward function names for `cfg`'s source when the run names none."""
    return list(TASK_REWARDS[cfg.name])


def load_prompts(cfg: DataConfig) -> tuple[Sequence[dict], Sequence[dict]]:
    """(train, eval) RL rows: "prompt" plus metadata; the two never share a prompt."""
    return load_rows(cfg, "prompts")


def load_examples(cfg: DataConfig) -> tuple[Sequence[dict], Sequence[dict]]:
    """(train, eval) SFT rows: "prompt" and "completion"; the two never share a prompt."""
    return load_rows(cfg, "examples")


def load_rows(cfg: DataConfig, need: str) -> tuple[Sequence[dict], Sequence[dict]]:
    """(train, eval) rows for `need` (prompts, examples or pairs); never a shared prompt."""
    if cfg.name not in _SOURCES:
        raise ConfigError(f"data.name={cfg.name!r} is not a known source; use one of: "
                          f"{', '.join(_SOURCES)}.")
    train, eval_ = _SOURCES[cfg.name](cfg, need)
    # Generated tasks repeat items once their distinct problems run out, and files may
    # repeat a prompt: keep held-out prompts unseen.
    train = _without(train, eval_)
    if not len(train):
        raise ConfigError(f"every training prompt of data={cfg.name} is also held out; give "
                          f"data.eval_path other prompts or lower data.num_eval.")
    return _add_few_shot(cfg, train, eval_)


def _without(train: Sequence[dict], eval_: Sequence[dict]) -> Sequence[dict]:
    """`train` less the rows whose prompt is held out (file rows: compared by their raw
    prompt column, read a chunk at a time, so no row is converted)."""
    if isinstance(train, Rows) and isinstance(eval_, Rows):
        held_out = set(eval_.keys())
        keep = [i for i, key in enumerate(train.keys()) if key not in held_out]
        return train if len(keep) == len(train) else train.take(np.asarray(keep, np.int64))
    held_out = {_prompt_key(row) for row in eval_}
    return [row for row in train if _prompt_key(row) not in held_out]


def _prompt_key(row: dict) -> Any:
    """What makes a generated row's prompt itself: its text and its images' contents."""
    images = row.get("images")
    return row["prompt"] if not images else (row["prompt"], tuple(map(image_key, images)))


def _add_few_shot(cfg: DataConfig, train: Sequence[dict],
                  eval_: Sequence[dict]) -> tuple[Sequence[dict], Sequence[dict]]:
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


def _task_rows(cfg: DataConfig, need: str) -> tuple[list[dict], list[dict]]:
    items = TASKS[cfg.name](cfg.num_train + cfg.num_eval, cfg.seed, cfg)
    return items[:cfg.num_train], items[cfg.num_train:]


def _file_rows(cfg: DataConfig, need: str) -> tuple[Sequence[dict], Sequence[dict]]:
    """data=jsonl (any file format) and data=hf: rows in gpurl's, TRL's or verl's layout."""
    def read(path: str | None, key: str) -> Rows:
        return _converted(cfg, _open_file(cfg, path, key), str(path), need)

    return _with_eval(cfg, read)


def _hub_rows(cfg: DataConfig, need: str) -> tuple[Sequence[dict], Sequence[dict]]:
    return _hub_splits(cfg, lambda table, source: _converted(cfg, table, source, need))


def _hub_splits(cfg: DataConfig, rows: Callable[[Any, str], Rows],
                ) -> tuple[Sequence[dict], Sequence[dict]]:
    """(train, eval) rows of data.dataset's data.split and data.eval_split, or a hold-out
    of data.split; `rows(table, source)` converts a split's table."""
    train = rows(open_hub(cfg.dataset, cfg.split, cfg.subset), cfg.dataset)
    if cfg.eval_split:
        return train, rows(open_hub(cfg.dataset, cfg.eval_split, cfg.subset),
                           f"{cfg.dataset} ({cfg.eval_split})")
    return _hold_out(train, cfg)


def _with_eval(cfg: DataConfig, read: Callable[[str | None, str], Rows],
               ) -> tuple[Sequence[dict], Sequence[dict]]:
    """(train, eval) rows of data.path and data.eval_path, or a hold-out of data.path."""
    rows = read(cfg.path, "data.path")
    if cfg.eval_path:
        return rows, read(cfg.eval_path, "data.eval_path")
    return _hold_out(rows, cfg)


def _open_file(cfg: DataConfig, path: str | None, key: str) -> Any:
    """The table of a data file that has rows (jsonl lines checked first: the error then
    names the bad line, which pyarrow's reader cannot)."""
    if path and Path(path).suffix.lower() in (".jsonl", ".json"):
        _check_json_lines(path, key)
    table = open_table(path, key, cfg.split)
    if not len(table):
        raise ConfigError(f"{path} has no rows; add some.")
    return table


def _converted(cfg: DataConfig, table: Any, source: str, need: str) -> Rows:
    if not len(table):
        raise ConfigError(f"{source} has no rows; add some.")
    convert, key = converter(columns(table), cfg, need, source)
    return Rows(table, convert, source, key)


def _task_file_rows(convert: Callable[[dict, str, DataConfig], dict], columns_needed: tuple,
                    ) -> Callable[[DataConfig, str], tuple[Sequence[dict], Sequence[dict]]]:
    """The source of a benchmark's own layout (GSM8K, MATH) in any file format, or on the
    Hub (data.dataset, when data.path is null: the presets name the published dataset)."""

    def rows_of(cfg: DataConfig, need: str) -> tuple[Sequence[dict], Sequence[dict]]:
        def checked(table: Any, source: str) -> Rows:
            if not len(table):
                raise ConfigError(f"{source} has no rows; add some.")
            for field in columns_needed:
                if field not in columns(table):
                    raise ConfigError(f'{source} has no "{field}" column; data={cfg.name} rows '
                                      f"have {', '.join(columns_needed)}.")
            return Rows(table, lambda row, where: convert(row, where, cfg), source,
                        [columns_needed[0]])

        if cfg.path is None:
            return _hub_splits(cfg, checked)
        return _with_eval(cfg, lambda path, key: checked(_open_file(cfg, path, key), str(path)))

    return rows_of


def _from_gsm8k(row: dict, where: str, cfg: DataConfig) -> dict:
    """{"question", "answer": "...reasoning... #### 72"} -> prompt, completion, answer "72"."""
    for field in ("question", "answer"):
        expect_str(row.get(field), f"{where}: {field!r}")
    template = cfg.prompt_template or GSM8K_TEMPLATE
    return {**row, "prompt": template.replace("{question}", row["question"]),
            "completion": " " + row["answer"], "answer": gsm8k_answer(row["answer"], where)}


def gsm8k_answer(solution: str, where: str) -> str:
    """The number after a GSM8K solution's last "####", thousands separators dropped."""
    _, hashes, final = solution.rpartition("####")
    number = final.strip().replace(",", "")
    if not hashes:
        raise ConfigError(f'{where}: "answer" has no "####" before the final answer; '
                          'end it with "#### <number>".')
    if not _NUMBER.fullmatch(number):
        raise ConfigError(f'{where}: the final answer after "####" is {final.strip()!r}, '
                          'not a number; write a number after "####".')
    return number


def _from_math(row: dict, where: str, cfg: DataConfig) -> dict:
    """MATH / MATH-500 rows {"problem", "solution"[, "answer"]} -> prompt, completion (the
    solution) and answer (the row's, else the solution's last \\boxed{...})."""
    for field in ("problem", "solution"):
        expect_str(row.get(field), f"{where}: {field!r}")
    answer = row.get("answer") or last_boxed(row["solution"])
    if not answer:
        raise ConfigError(f'{where} has no "answer" and its solution no \\boxed{{...}}; add '
                          "the final answer to that row.")
    template = cfg.prompt_template or MATH_TEMPLATE
    return {**row, "prompt": template.replace("{question}", row["problem"]),
            "completion": " " + row["solution"], "answer": str(answer)}


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


_SOURCES: dict[str, Callable[[DataConfig, str], tuple[Sequence[dict], Sequence[dict]]]] = {
    "arithmetic": _task_rows, "arithmetic_prefs": _task_rows, "countdown": _task_rows,
    "calculator": _task_rows, "guess_number": _task_rows, "quadrant": _task_rows,
    "gsm8k": _task_file_rows(_from_gsm8k, ("question", "answer")),
    "math": _task_file_rows(_from_math, ("problem", "solution")),
    "jsonl": _file_rows, "hf": _hub_rows}


def _hold_out(rows: Sequence[dict], cfg: DataConfig) -> tuple[Sequence[dict], Sequence[dict]]:
    """(train, eval): `cfg.num_eval` rows drawn by `cfg.seed` are held out."""
    if cfg.num_eval >= len(rows):
        raise ConfigError(
            f"data.num_eval={cfg.num_eval} leaves no training rows in {cfg.path or cfg.dataset} "
            f"({len(rows)} rows); lower data.num_eval or set data.eval_path.")
    order_X = np.random.default_rng(cfg.seed).permutation(len(rows))
    split = len(rows) - cfg.num_eval
    # Training rows stay in file order: batching shuffles them anyway, and file order
    # makes a run's data easy to inspect.
    train_idx = np.sort(order_X[:split])
    if isinstance(rows, Rows):
        return rows.take(train_idx), rows.take(order_X[split:])
    return [rows[i] for i in train_idx], [rows[i] for i in order_X[split:]]


def read_jsonl(path_str: str | None, key: str = "data.path",
               need_completion: bool = True) -> list[dict]:
    """Rows of a jsonl file of {"prompt"[, "completion"]} or {"messages"} objects; the
    completion is required when `need_completion` (SFT)."""
    cfg = DataConfig(name="jsonl", path=path_str)
    table = _open_file(cfg, path_str, key)
    return list(_converted(cfg, table, str(path_str), "examples" if need_completion else "prompts"))


def _check_json_lines(path_str: str, key: str) -> None:
    """One sentence naming the first line of a jsonl file that is not a JSON object."""
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}={path_str} does not exist; point it to a data file.")
    with path.open(encoding="utf-8") as f:
        if path.suffix.lower() == ".json" and f.read(1) == "[":
            return  # a JSON array: `datasets` reads it as a whole
        f.seek(0)
        seen = False
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                seen = True
                _parse_object(line, f"{path} line {line_no}")
    if not seen:
        raise ConfigError(f"{path} has no rows; add one JSON object per line.")


def _parse_object(line: str, where: str) -> None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg}); fix that line.") from e
    if not isinstance(row, dict):
        raise ConfigError(f"{where} is a {type(row).__name__}, not an object; write one "
                          'JSON object per line such as {"prompt": ..., "completion": ...}.')
