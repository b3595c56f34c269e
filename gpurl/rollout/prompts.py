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
from gpurl.rewards.thinking import left_open
from gpurl.rollout.multiturn import EnvFactory


@dataclass(frozen=True)
class Prompts:
    """Rows (prompt text + metadata), their token ids (BOS included), and which of them
    leave a thinking trace open for the model (empty: none)."""

    rows: list[dict]
    tokens: list[list[int]]
    opened: tuple[bool, ...] = ()

    def __len__(self) -> int:
        return len(self.rows)

    def opens(self, index: int) -> bool:
        """Whether prompt `index` (-1: padding) leaves a thinking trace open
        (`gpurl.rewards.thinking`: its completion must close it to be finished)."""
        return bool(self.opened) and index >= 0 and self.opened[index]


def prompt_tools(env: EnvConfig | None) -> list[dict]:
    """The function schemas of the tools `env` calls, as chat templates read them
    (`Tool.function`); [] without an environment or with one that calls no tools."""
    if env is None or not env.on or env.agents:  # an agent shows its own tools in its calls
        return []
    return [tool.function for tool in EnvFactory(env).tools]


def render_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool,
                  tools: Sequence[dict] = ()) -> str:
    """The text a prompt is encoded from (BOS not included): a prompt text as it is, or
    chat messages (or a text with `chat`) rendered through the tokenizer's chat template
    with the generation prompt and `tools` (the environment's function schemas,
    `prompt_tools`; unused for a plain text)."""
    if not (chat or isinstance(prompt, list)):
        return prompt
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                         tools=list(tools) or None)
    if tokenizer.bos_token and text.startswith(tokenizer.bos_token):
        text = text[len(tokenizer.bos_token):]
    return text


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], chat: bool,
                  tools: Sequence[dict] = ()) -> list[int]:
    """Token ids of a prompt (`render_prompt`), BOS first."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(render_prompt(tokenizer, prompt, chat, tools))


def encode_prompts(rows: list[dict], tokenizer: Tokenizer, chat: bool, max_len: int,
                   what: str, tools: Sequence[dict] = ()) -> tuple[Prompts, int]:
    """Token ids of each prompt (`encode_prompt`) and whether it leaves a thinking trace
    open (a template such as DeepSeek-R1-Distill's opens `<think>` in its generation
    prompt); prompts longer than `max_len` tokens are skipped (the count is returned and
    reported)."""
    kept, tokens, opened, skipped = [], [], [], 0
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    for row in rows:
        if row.get("images"):
            raise ConfigError(f"{what} prompts have images, which only algo=sft trains on so "
                              f"far; train a vision-language model with algo=sft or drop the "
                              f"images.")
        text = render_prompt(tokenizer, row.get("messages") or row["prompt"], chat, tools)
        ids = bos + tokenizer.encode(text)
        if len(ids) > max_len:
            skipped += 1
            continue
        kept.append(row)
        tokens.append(ids)
        opened.append(left_open(text))
    if not kept:
        raise ConfigError(f"every {what} prompt is longer than data.max_len={max_len} tokens; "
                          f"raise data.max_len.")
    return Prompts(kept, tokens, tuple(opened)), skipped
