"""Tool-call formats: how a model writes a call and how the tool's result is given back.
One registered record per format (`env.tool_format`), each a pair of pure functions.

- hermes: Qwen 2.5 / Qwen 3 (and Hermes) chat templates. The model writes
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call; results
  come back as `<tool_response>result</tool_response>` (Qwen's template wraps them so in
  the user turn that follows).
- llama3: Llama 3.1 / 3.2 JSON tool calling. The model's turn is a JSON object
  `{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`); results come
  back as an `ipython` message of the chat template.

A parse returns the calls in order (none: the turn is an answer, not a call) or raises
`ToolCallError` with a message the model reads as the observation. Arguments are parsed
as JSON, never evaluated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

from gpurl.envs.base import Observation


class ToolCallError(ValueError):
    """A turn that tries to call a tool but is not a valid call; the message says why."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def _call(obj: Any, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError('a tool call must be a JSON object with a "name" string')
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            raise ToolCallError(f'the "{args_key}" of a tool call are not valid JSON') from None
    if not isinstance(args, dict):
        raise ToolCallError(f'the "{args_key}" of a tool call must be a JSON object')
    return ToolCall(obj["name"], args)


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ToolCallError(f"the tool call is not valid JSON ({e.msg})") from None


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> list[ToolCall]:
    return [_call(_load(m.group(1).strip()), "arguments") for m in _HERMES_CALL.finditer(text)]


def respond_hermes(results: list[str]) -> Observation:
    return "".join(f"<tool_response>{r}</tool_response>\n" for r in results)


def parse_llama3(text: str) -> list[ToolCall]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    if not body.startswith("{"):
        return []
    return [_call(_load(part), "parameters") for part in _split_objects(body)]


def _split_objects(body: str) -> list[str]:
    """`{...}; {...}` -> its JSON objects (Llama 3.1 separates parallel calls with `;`)."""
    parts = [p.strip() for p in body.split(";")]
    return [p for p in parts if p] if all(p.startswith("{") for p in parts if p) else [body]


def respond_llama3(results: list[str]) -> Observation:
    return [{"role": "ipython", "content": r} for r in results]


@dataclass(frozen=True)
class ToolFormat:
    parse: Callable[[str], list[ToolCall]]
    respond: Callable[[list[str]], Observation]


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat(parse_hermes, respond_hermes),
    "llama3": ToolFormat(parse_llama3, respond_llama3),
}
