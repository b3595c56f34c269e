"""Prompts as the sampler reads them: token ids (BOS included) beside their data rows.

Every prompt the model samples from (training rollouts, continuous ones, `gpurl eval`,
`gpurl generate`) is encoded here. With an environment that calls tools, a prompt
rendered through the chat template carries the tools' schemas (`tools=`, as HF
`apply_chat_template` and TRL pass them), so the model is shown what it may call. A
plain-text prompt (`data.chat_template=false`, no messages) is the text as it is: no
schema format is made up for it, and the model knows the tools only as far as the
prompt says (the calculator task's worked examples show its calls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from gpurl.config import ConfigError, EnvConfig
from gpurl.models.tokenizer import Tokenizer
from gpurl.rollout.multiturn import EnvFactory


@dataclass(frozen=True)
class Prompts:
    """Rows (prompt text + metadata) and their token ids (BOS included)."""

    rows: list[dict]
    tokens: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)


def prompt_tools(env: EnvConfig | None) -> list[dict]:
    """The function schemas of the tools `env` calls, as chat templates read them
    (`Tool.function`); [] without an environment or with one that calls no tools."""
    if env is None or not env.on:
        return []
    return [tool.function for tool in EnvFactory(env).tools]


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool,
                  tools: Sequence[dict] = ()) -> list[int]:
    """Token ids of a prompt text, or of chat messages (or of a text with `chat`) rendered
    through the tokenizer's chat template with the generation prompt and `tools` (the
    environment's function schemas, `prompt_tools`; unused for a plain text)."""
    if chat or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                             tools=list(tools) or None)
        if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
            text = text[len(tokenizer.bos_token):]
    else:
        text = prompt
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(text)


def encode_prompts(rows: list[dict], tokenizer: Tokenizer, chat: bool, max_len: int,
                   what: str, tools: Sequence[dict] = ()) -> tuple[Prompts, int]:
    """Token ids of each prompt (`encode_prompt`); prompts longer than `max_len` tokens
    are skipped (the count is returned and reported)."""
    kept, tokens, skipped = [], [], 0
    for row in rows:
        ids = encode_prompt(tokenizer, row.get("messages") or row["prompt"], chat, tools)
        if len(ids) > max_len:
            skipped += 1
            continue
        kept.append(row)
        tokens.append(ids)
    if not kept:
        raise ConfigError(f"every {what} prompt is longer than data.max_len={max_len} tokens; "
                          f"raise data.max_len.")
    return Prompts(kept, tokens), skipped
