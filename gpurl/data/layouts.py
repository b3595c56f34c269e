"""Row layouts of data files: gpurl's own, TRL's and verl's, converted to gpurl's rows.

A file's layout is chosen once from its column names (after `data.*_key` renames them to
the standard names below), then every row goes through that layout's conversion. gpurl's
rows are `prompt` (text), optionally `messages` (the conversation before the reply, for
`data.chat_template`), `completion` (SFT), `chosen` / `rejected` (preference pairs), and
every other column as metadata that reward functions receive by name (`answer` the
ground truth).

| layout            | columns                                   | from                      |
|-------------------|-------------------------------------------|---------------------------|
| prompt_completion | prompt, completion (text or chat lists)   | gpurl, TRL standard/conv. |
| messages          | messages (ends with the assistant reply)  | gpurl, TRL conversational |
| trajectory        | prompt, trajectory [{text, train}]        | `gpurl generate record=`  |
| verl              | prompt (chat list), reward_model, ...     | verl RL parquet           |
| prompt            | prompt (text or chat list)                | TRL prompt-only, gpurl RL |
| pairs             | prompt, chosen, rejected                  | gpurl, TRL preference     |
| implicit_pairs    | chosen, rejected (full texts/chats)       | TRL implicit prompt       |

TRL's formats: https://huggingface.co/docs/trl/dataset_formats ; verl's:
https://verl.readthedocs.io/en/latest/preparation/prepare_data.html (`prompt` chat list,
`data_source`, `ability`, `reward_model.ground_truth`, `extra_info`).
"""

from __future__ import annotations

from typing import Any, Callable

from gpurl.config import ConfigError, DataConfig

Convert = Callable[[dict, str], dict]
# Which rows a run needs: RL prompts, SFT examples (with a reference completion) or pairs.
NEEDS = ("prompts", "examples", "pairs")


def converter(names: list[str], cfg: DataConfig, need: str,
              source: str) -> tuple[Convert, list[str]]:
    """The conversion of rows with columns `names` (of file `source`) into rows for `need`,
    and the columns that identify a row's prompt (held-out prompts are kept out of the
    training rows by it)."""
    renames = _renames(cfg, names, source)
    present = {renames.get(n, n) for n in names}
    file_layout = _layout(present, need, source)  # the columns can hold some layout
    answer_path = _answer_path(cfg, names, source)
    raw_name = {v: k for k, v in renames.items()}
    key_columns = [raw_name.get(c, c) for c in ("prompt", "messages") if c in present]
    key_columns = key_columns or [raw_name.get("chosen", "chosen")]  # implicit-prompt pairs

    def convert(raw: dict, where: str) -> dict:
        # Arrow gives every row every column of the file (null where a jsonl row lacks
        # it), so a file may mix layouts row by row; a null is an absent field.
        row = {renames.get(k, k): v for k, v in raw.items() if v is not None}
        layout = file_layout if len(present) == len(row) else _layout(set(row), need, where)
        row = LAYOUTS[layout](row, where, need)
        if answer_path and "answer" not in row:
            row["answer"] = _dig(raw, answer_path)
        return row

    return convert, key_columns


def _renames(cfg: DataConfig, names: list[str], source: str) -> dict[str, str]:
    keys = {"prompt": cfg.prompt_key, "completion": cfg.completion_key,
            "messages": cfg.messages_key, "chosen": cfg.chosen_key,
            "rejected": cfg.rejected_key}
    renames = {}
    for standard, key in keys.items():
        if key and key != standard:
            if key not in names:
                raise ConfigError(f"data.{standard}_key={key} is not a column of {source} "
                                  f"(columns: {', '.join(names)}); set it to one of them.")
            renames[key] = standard
    return renames


def _answer_path(cfg: DataConfig, names: list[str], source: str) -> list[str] | None:
    """The ground truth's column path: data.answer_key (dots reach into nested columns),
    else verl's reward_model.ground_truth when the file has it (an `answer` column needs
    no path: it is metadata already)."""
    if cfg.answer_key:
        path = cfg.answer_key.split(".")
        if path[0] not in names:
            raise ConfigError(f"data.answer_key={cfg.answer_key} is not a column of {source} "
                              f"(columns: {', '.join(names)}); set it to one of them.")
        return path
    if "answer" not in names and "reward_model" in names:
        return ["reward_model", "ground_truth"]
    return None


def _dig(row: dict, path: list[str]) -> Any:
    value: Any = row
    for part in path:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _layout(present: set[str], need: str, source: str) -> str:
    if need == "pairs":
        if {"chosen", "rejected"} <= present:
            return "pairs" if "prompt" in present else "implicit_pairs"
        raise ConfigError(f"{source} has no preference pairs (columns: {', '.join(sorted(present))}); "
                          'give rows {"prompt", "chosen", "rejected"} or map the columns with '
                          "data.chosen_key / data.rejected_key.")
    if "prompt" in present and "trajectory" in present:
        return "trajectory"
    if "messages" in present:
        return "messages"
    if "prompt" in present and "completion" in present:
        return "prompt_completion"
    if need == "examples":
        raise ConfigError(f'{source} has neither "prompt" and "completion" nor "messages" '
                          f"columns (it has {', '.join(sorted(present))}); add one of the two "
                          "forms or map its columns with data.prompt_key / data.completion_key.")
    if "prompt" in present:
        return "verl" if "reward_model" in present else "prompt"
    raise ConfigError(f'{source} has neither a "prompt" nor a "messages" column (it has '
                      f"{', '.join(sorted(present))}); add one or name yours with "
                      "data.prompt_key=COLUMN.")


def _prompt_row(row: dict, where: str, need: str) -> dict:
    """`prompt` as text, or as a chat list (kept as `messages`, its text joined)."""
    prompt = row["prompt"]
    if isinstance(prompt, list):
        messages = chat(prompt, f"{where}: 'prompt'")
        return {**row, "messages": messages, "prompt": "\n".join(m["content"] for m in messages)}
    expect_str(prompt, f"{where}: 'prompt'")
    return row


def _prompt_completion(row: dict, where: str, need: str) -> dict:
    row = _prompt_row(row, where, need)
    completion = row["completion"]
    if isinstance(completion, list):  # TRL conversational: the assistant turn(s)
        completion = "".join(m["content"] for m in chat(completion, f"{where}: 'completion'"))
    expect_str(completion, f"{where}: 'completion'")
    return {**row, "completion": completion}


def _messages(row: dict, where: str, need: str) -> dict:
    messages = chat(row["messages"], f"{where}: 'messages'")
    if messages[-1]["role"] == "assistant":
        prompt_messages, completion = messages[:-1], {"completion": messages[-1]["content"]}
    elif need == "examples":
        # Turns after the last assistant reply would be silently dropped; refuse instead.
        raise ConfigError(f'{where}: the last message has role {messages[-1]["role"]!r}; '
                          'end the conversation with the "assistant" reply to train on.')
    else:  # RL: the whole conversation is the prompt
        prompt_messages, completion = messages, {}
    return {**row, "messages": prompt_messages,
            "prompt": "\n".join(m["content"] for m in prompt_messages), **completion}


def _trajectory(row: dict, where: str, need: str) -> dict:
    """A recorded multi-turn trajectory (`gpurl generate env=... record=F`): the prompt and
    segments {"text", "train"}; SFT trains on the "train" segments (the model's turns)
    only. Its completion is the segments' text."""
    expect_str(row["prompt"], f"{where}: 'prompt'")
    segments = row["trajectory"]
    if not isinstance(segments, list) or not segments or not all(
            isinstance(s, dict) and isinstance(s.get("text"), str)
            and isinstance(s.get("train"), bool) for s in segments):
        raise ConfigError(f'{where}: "trajectory" must be a non-empty list of '
                          '{"text": str, "train": bool} objects; fix that row.')
    return {**row, "completion": "".join(s["text"] for s in segments)}


def _pairs(row: dict, where: str, need: str) -> dict:
    row = _prompt_row(row, where, need)
    return _checked_pair(row, *(_reply(row[f], f"{where}: {f!r}") for f in ("chosen", "rejected")),
                         where)


def _implicit_pairs(row: dict, where: str, need: str) -> dict:
    """TRL's implicit prompt: chosen and rejected are whole conversations (or texts) that
    share the prompt; the prompt is their common leading messages (or text, ending before
    the first differing word)."""
    chosen, rejected = row["chosen"], row["rejected"]
    if isinstance(chosen, list) and isinstance(rejected, list):
        chosen = chat(chosen, f"{where}: 'chosen'")
        rejected = chat(rejected, f"{where}: 'rejected'")
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        if not shared:
            raise ConfigError(f"{where}: chosen and rejected share no leading messages, so the "
                              'prompt is unknown; add a "prompt" column.')
        prompt = chosen[:shared]
        row = {**row, "messages": prompt, "prompt": "\n".join(m["content"] for m in prompt)}
        replies = ["".join(m["content"] for m in side[shared:]) for side in (chosen, rejected)]
        return _checked_pair(row, *replies, where)
    expect_str(chosen, f"{where}: 'chosen'")
    expect_str(rejected, f"{where}: 'rejected'")
    cut = 0
    while cut < min(len(chosen), len(rejected)) and chosen[cut] == rejected[cut]:
        cut += 1
    cut = chosen.rfind(" ", 0, cut + 1) if " " in chosen[:cut + 1] else cut
    if cut <= 0:
        raise ConfigError(f"{where}: chosen and rejected share no leading text, so the prompt "
                          'is unknown; add a "prompt" column.')
    return _checked_pair({**row, "prompt": chosen[:cut]}, chosen[cut:], rejected[cut:], where)


def _reply(value: Any, what: str) -> str:
    if isinstance(value, list):  # TRL conversational: [{"role": "assistant", ...}]
        return "".join(m["content"] for m in chat(value, what))
    expect_str(value, what)
    return value


def _checked_pair(row: dict, chosen: str, rejected: str, where: str) -> dict:
    if chosen == rejected:
        raise ConfigError(f'{where}: "chosen" and "rejected" are the same text; a pair '
                          "needs two different completions, so fix or drop that row.")
    return {**row, "chosen": chosen, "rejected": rejected}


LAYOUTS: dict[str, Callable[[dict, str, str], dict]] = {
    "prompt_completion": _prompt_completion, "messages": _messages, "trajectory": _trajectory,
    "verl": _prompt_row, "prompt": _prompt_row, "pairs": _pairs,
    "implicit_pairs": _implicit_pairs}


def chat(messages: Any, what: str) -> list[dict]:
    """A non-empty list of {"role", "content"} strings (other keys dropped)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f'{what} must be a non-empty list of {{"role", "content"}} '
                          "objects; fix that row.")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f'{what}[{i}] is not an object; write it as '
                              '{"role": ..., "content": ...}.')
        for field in ("role", "content"):
            expect_str(message.get(field), f"{what}[{i}][{field!r}]")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def expect_str(value: Any, what: str) -> None:
    if not isinstance(value, str):
        shown = "missing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{what} is {shown}, not a string; make it a string.")
