"""Chat templates: Jinja rendering compatible with Hugging Face `tokenizer_config.json`.

Templates come from files users download, so they run in jinja2's immutable sandbox.
The environment mirrors what HF `apply_chat_template` offers (trim/lstrip blocks, the
loop-controls extension, `raise_exception`, `strftime_now`, a plain-JSON `tojson`) so
that templates written for HF render the same text here.
"""

from __future__ import annotations

import datetime
import functools
import json
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpurl.config import ConfigError

# Gemma's turn markers rendered as plain text; for the byte tokenizer they are ordinary
# bytes, so a model learns them like any other text.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


class TemplateRaised(Exception):
    """Raised by a template's own `raise_exception(...)` call."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False, ensure_ascii: bool = False) -> str:
    # jinja2's built-in tojson HTML-escapes <, >, & and '; HF templates expect plain JSON.
    return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys,
                      ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"The chat template does not parse ({e.message}, template line {e.lineno}); "
            "fix chat_template in tokenizer_config.json or set data.chat_template=false.") from e


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool,
                         bos_token: str = "", eos_token: str = "",
                         tools: list[dict] | None = None) -> str:
    """Render `messages` ([{"role", "content"}, ...]) through a Jinja chat template.

    `tools`: function schemas ({"type": "function", "function": {"name", "description",
    "parameters"}}) the template shows the model, as HF `apply_chat_template(tools=...)`
    passes them; None (no tools) is passed as None too, since templates such as Llama
    3.1's render an empty tool section for `tools=[]`."""
    compiled = _compile(template)
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, tools=tools)
    except TemplateRaised as e:
        raise ConfigError(
            f"The chat template rejected a conversation ({e}); fix the messages in the "
            "data or set data.chat_template=false.") from e
    except jinja2.TemplateError as e:
        raise ConfigError(
            f"The chat template failed to render ({e}); fix chat_template in "
            "tokenizer_config.json or set data.chat_template=false.") from e
