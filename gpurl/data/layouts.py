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

Images (vision-language models): a message's content may be a list of parts, OpenAI's
and TRL's `{"type": "text", "text": ...}` and `{"type": "image"}` (or `image_url`); each
image part becomes the model's image marker (`gpurl.models.vision.IMAGE_MARKER`) in the
text, and the row's `images` column lists the images in order (paths, bytes, the datasets
Image feature's {"bytes", "path"}); image parts may carry their image themselves
(`"image"`, `"path"`, or `image_url.url` as a path or a base64 data URL) instead. A
plain-text prompt places its images with the marker itself.

TRL's formats: https://huggingface.co/docs/trl/dataset_formats ; verl's:
https://verl.readthedocs.io/en/latest/preparation/prepare_data.html (`prompt` chat list,
`data_source`, `ability`, `reward_model.ground_truth`, `extra_info`).
"""

from __future__ import annotations

import base64
from typing import Any, Callable

from gpurl.config import ConfigError, DataConfig
from gpurl.models.vision import IMAGE_MARKER

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
    key_columns += [raw_name.get("images", "images")] if "images" in present else []

    def convert(raw: dict, where: str) -> dict:
        # Arrow gives every row every column of the file (null where a jsonl row lacks
        # it), so a file may mix layouts row by row; a null is an absent field.
        row = {renames.get(k, k): v for k, v in raw.items() if v is not None}
        layout = file_layout if len(present) == len(row) else _layout(set(row), need, where)
        inline = [image for key in ("prompt", "messages") if isinstance(row.get(key), list)
                  for image in _inline_images(row[key])]
        row = LAYOUTS[layout](row, where, need)
        if inline or "images" in row:
            row["images"] = _row_images(row.get("images"), inline, where)
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


def _inline_images(messages: list) -> list[Any]:
    """The images image parts carry themselves, in order (`data:` URLs decoded)."""
    out = []
    for m in messages:
        parts = m.get("content") if isinstance(m, dict) else None
        for part in parts if isinstance(parts, list) else ():
            if not isinstance(part, dict) or part.get("type") not in ("image", "image_url"):
                continue
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            source = part.get("image", part.get("path", url))
            if isinstance(source, str) and source.startswith("data:"):
                source = base64.b64decode(source.partition(",")[2])
            if source is not None:
                out.append(source)
    return out


def _row_images(column: Any, inline: list, where: str) -> list:
    if column is not None and inline:
        raise ConfigError(f"{where} gives images both in its 'images' column and inside its "
                          f"messages; keep one of the two.")
    if column is None:
        return inline
    return list(column) if isinstance(column, (list, tuple)) else [column]


def _content(content: Any, what: str) -> Any:
    """A message's content as text: a list of parts joined, each image part as the image
    marker; anything else is returned for `expect_str` to refuse."""
    if not isinstance(content, list):
        return content
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append(part["text"])
        elif kind in ("image", "image_url"):
            out.append(IMAGE_MARKER)
        else:
            raise ConfigError(f'{what}[{j}] is not a {{"type": "text", "text": ...}} or '
                              f'{{"type": "image"}} part; fix that row.')
    return "".join(out)


def chat(messages: Any, what: str) -> list[dict]:
    """A non-empty list of {"role", "content"} strings (other keys dropped; a content list
    of text and image parts joined into one string, `_content`)."""
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f'{what} must be a non-empty list of {{"role", "content"}} '
                          "objects; fix that row.")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ConfigError(f'{what}[{i}] is not an object; write it as '
                              '{"role": ..., "content": ...}.')
        content = _content(message.get("content"), f"{what}[{i}]['content']")
        expect_str(message.get("role"), f"{what}[{i}]['role']")
        expect_str(content, f"{what}[{i}]['content']")
        out.append({"role": message["role"], "content": content})
    return out


def expect_str(value: Any, what: str) -> None:
    if not isinstance(value, str):
        shown = "missing" if value is None else f"a {type(value).__name__}"
        raise ConfigError(f"{what} is {shown}, not a string; make it a string.")
