"""Chat messages to prompt token ids, and sampled text to an assistant message.

`Renderer.ids` renders an OpenAI chat request's messages through the tokenizer's chat
template (with the generation prompt and the request's tools), as `gpurl.rollout.prompts`
renders a data row, with one difference: an assistant message that the session sampled
(`Sampled`, recognized by its content and tool calls as they were returned) is spliced
back as its exact sampled ids, never decoded and encoded again. The template still
decides where the message goes and whether it is kept as it was: the message's sampled
text is rendered between two markers, and only when the template leaves the text between
them untouched are the sampled ids put there; a template that rewrites it (Qwen3 drops an
earlier turn's `<think>` block) renders that message from its content and tool calls as
any other, so the history is rewritten and the session forks (`gpurl.serve.sessions`).

`assistant_message` parses a completion's tool calls in the configured format
(`gpurl.envs.formats`) into OpenAI `tool_calls`; one it cannot parse is left as text and
named (`tool_call_error`).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Sequence

from gpurl.envs.formats import FORMATS, ToolCallError
from gpurl.models.tokenizer import Tokenizer

# Private-use characters around a spliced message's text: no template writes them.
_OPEN, _CLOSE = "\ue000", "\ue001"


class RequestError(ValueError):
    """A request the server cannot serve; `status` is its HTTP status, `code` OpenAI's."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI content parts of type text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                raise RequestError(f"{where}: only text content parts are served here "
                                   f"(got {part.get('type') if isinstance(part, dict) else part!r})",
                                   param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise RequestError(f"{where}: content must be a string or a list of text parts",
                       param="messages")


def _key(content: Any, tool_calls: Any) -> str:
    """How a returned assistant message is recognized when an agent sends it back."""
    calls = [(c.get("id"), (c.get("function") or {}).get("name"),
              (c.get("function") or {}).get("arguments"))
             for c in (tool_calls or []) if isinstance(c, dict)]
    return json.dumps([content or "", calls])


@dataclass
class Sampled:
    """The assistant messages a session returned: their sampled ids and text, by key."""

    messages: dict[str, tuple[list[int], str]] = field(default_factory=dict)

    def remember(self, message: dict, ids: Sequence[int], text: str) -> None:
        self.messages[_key(message.get("content"), message.get("tool_calls"))] = (list(ids), text)

    def find(self, message: dict) -> tuple[list[int], str] | None:
        return self.messages.get(_key(message.get("content"), message.get("tool_calls")))


class Renderer:
    """Messages -> prompt ids through `tokenizer`'s chat template (`ids`); `stop_ids`: the
    tokens that end a turn (a sampled turn that ended on one is not ended twice)."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Sequence[int]):
        if tokenizer.chat_template is None:
            raise RequestError("the served model's tokenizer has no chat template; use "
                               "/v1/completions with a prompt", status=400)
        self.tokenizer, self.stop_ids = tokenizer, frozenset(stop_ids)

    def ids(self, messages: Sequence[dict], tools: Sequence[dict] | None = None,
            sampled: Sampled | None = None) -> list[int]:
        """The prompt ids of `messages` (BOS first), with the generation prompt."""
        plain = [self._checked(m, i) for i, m in enumerate(messages)]
        spliced, splices = list(plain), {}
        for i, message in enumerate(messages):
            found = sampled.find(message) if sampled is not None and message.get(
                "role") == "assistant" else None
            if found is not None:
                splices[i] = found
                spliced[i] = {"role": "assistant", "content": f"{_OPEN}{found[1]}{_CLOSE}"}
        text = self._render(spliced, tools) if splices else self._render(plain, tools)
        pieces = text.split(_OPEN)
        intact = len(pieces) == len(splices) + 1 and all(
            piece.count(_CLOSE) == 1 and piece.split(_CLOSE)[0] == found[1]
            for piece, found in zip(pieces[1:], splices.values()))
        if splices and not intact:  # the template rewrote a message: render it as given
            text, splices = self._render(plain, tools), {}
            pieces = [text]
        return self._encode(pieces, list(splices.values()))

    def _encode(self, pieces: list[str], splices: list[tuple[list[int], str]]) -> list[int]:
        """The ids of text pieces with each splice's sampled ids between them."""
        tok = self.tokenizer
        first = pieces[0]
        if tok.bos_token and first.startswith(tok.bos_token):
            first = first[len(tok.bos_token):]
        ids = ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(first)
        for (sampled, _), piece in zip(splices, pieces[1:]):
            ids += sampled
            after = tok.encode(piece.split(_CLOSE, 1)[1])
            if sampled and sampled[-1] in self.stop_ids and after and after[0] in self.stop_ids:
                after = after[1:]  # the sampled turn ended on its own stop token already
            ids += after
        return ids

    def _render(self, messages: list[dict], tools: Sequence[dict] | None) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tools=list(tools) if tools else None)
        except Exception as e:  # noqa: BLE001 - a template may raise anything on odd input
            raise RequestError(f"the chat template cannot render these messages "
                               f"({type(e).__name__}: {e})", param="messages") from None

    @staticmethod
    def _checked(message: Any, i: int) -> dict:
        """A message as templates read it: role, text content, and tool fields kept."""
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role", param="messages")
        role = message["role"]
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise RequestError(f"messages[{i}] has an unknown role {role!r}", param="messages")
        out = {"role": "system" if role == "developer" else role,
               "content": text_of(message.get("content"), f"messages[{i}]")}
        for key in ("tool_calls", "tool_call_id", "name"):
            if message.get(key) is not None:
                out[key] = _template_calls(message[key]) if key == "tool_calls" else message[key]
        return out


def _template_calls(calls: Any) -> list[dict]:
    """OpenAI tool calls as chat templates read them: arguments as an object (HF
    templates `tojson` them), not the JSON string the API carries."""
    out = []
    for call in calls if isinstance(calls, list) else []:
        function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        out.append({**call, "function": function})
    return out


def assistant_message(text: str, tool_format: str | None) -> tuple[dict, str]:
    """(the assistant message of a completion's text, its finish reason's kind: "tool_calls"
    when it calls tools, else "stop"); `tool_format` None: tool calls are not parsed."""
    if tool_format is None:
        return {"role": "assistant", "content": text}, "stop"
    try:
        calls = FORMATS[tool_format].parse(text)
    except ToolCallError as e:
        return {"role": "assistant", "content": text, "tool_call_error": str(e)}, "stop"
    if not calls:
        return {"role": "assistant", "content": text}, "stop"
    before = text.split("<tool_call>")[0] if tool_format == "hermes" else ""
    return {"role": "assistant", "content": before.strip() or None,
            "tool_calls": [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                            "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                           for c in calls]}, "tool_calls"
