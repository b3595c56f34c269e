"""Prompts as the sampler reads them: token ids (BOS included) beside their data rows."""

from __future__ import annotations

from dataclasses import dataclass

from gpurl.config import ConfigError
from gpurl.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompts:
    """Rows (prompt text + metadata) and their token ids (BOS included)."""

    rows: list[dict]
    tokens: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """Token ids of a prompt text, or of chat messages (or of a text with `chat`) rendered
    through the tokenizer's chat template with the generation prompt."""
    if chat or isinstance(prompt, list):
        messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
            text = text[len(tokenizer.bos_token):]
    else:
        text = prompt
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(text)


def encode_prompts(rows: list[dict], tokenizer: Tokenizer, chat: bool, max_len: int,
                   what: str) -> tuple[Prompts, int]:
    """Token ids of each prompt; prompts longer than `max_len` tokens are skipped (the
    count is returned and reported)."""
    kept, tokens, skipped = [], [], 0
    for row in rows:
        ids = encode_prompt(tokenizer, row.get("messages") or row["prompt"], chat)
        if len(ids) > max_len:
            skipped += 1
            continue
        kept.append(row)
        tokens.append(ids)
    if not kept:
        raise ConfigError(f"every {what} prompt is longer than data.max_len={max_len} tokens; "
                          f"raise data.max_len.")
    return Prompts(kept, tokens), skipped
