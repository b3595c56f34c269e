"""Tools: plain Python callables with a JSON schema, and the environment that calls them.

A tool is a function of keyword arguments returning something printable (`str()` of it
is what the model reads). Its schema is `fn.schema` when the function carries one, else
it is derived from the signature and the docstring. User tools load by
"pkg.module:function" (`env.tools`), built-in ones by name. The model sees the schemas
through the chat template (`Tool.function`, `gpurl.rollout.prompts.prompt_tools`).
"""

from __future__ import annotations

import ast
import inspect
import math
import operator
import typing
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from gpurl.config import ConfigError
from gpurl.envs.base import Environment, Step
from gpurl.user_code import import_object
from gpurl.envs.formats import FORMATS, ToolCallError, ToolFormat

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean",
               list: "array", dict: "object"}


@dataclass(frozen=True)
class Tool:
    name: str
    fn: Callable[..., Any]
    schema: dict  # {"name", "description", "parameters": JSON schema of the arguments}

    @property
    def function(self) -> dict:
        """The schema as chat templates read it (HF `apply_chat_template(tools=...)`, the
        OpenAI function format): {"type": "function", "function": {"name", ...}}, named
        as calls to it are looked up."""
        return {"type": "function", "function": {**self.schema, "name": self.name}}

    def check(self, arguments: dict[str, Any]) -> None:
        """Raises ToolCallError (read by the model) when the arguments do not fit."""
        params = self.schema.get("parameters", {})
        known, required = set(params.get("properties", {})), set(params.get("required", []))
        unknown, missing = set(arguments) - known, required - set(arguments)
        if unknown or missing:
            parts = ([f"unknown arguments {sorted(unknown)}"] if unknown else []) + (
                [f"missing arguments {sorted(missing)}"] if missing else [])
            raise ToolCallError(f"{self.name}: {' and '.join(parts)}")


def schema_of(fn: Callable[..., Any], name: str) -> dict:
    """`fn.schema` ({"name", "description", "parameters"}, or that wrapped as
    {"type": "function", "function": {...}}), or a JSON schema from its signature
    (annotated types) and docstring."""
    given = getattr(fn, "schema", None)
    if isinstance(given, dict):
        return given["function"] if isinstance(given.get("function"), dict) else given
    props, required = {}, []
    try:  # annotations may be strings (`from __future__ import annotations`)
        hints = typing.get_type_hints(fn)
    except Exception:  # noqa: BLE001 - an unresolvable annotation only loses its type
        hints = {}
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(hints.get(p.name))
        props[p.name] = {"type": kind} if kind else {}
        if p.default is p.empty:
            required.append(p.name)
    doc = inspect.getdoc(fn) or ""
    return {"name": name, "description": doc.split("\n\n")[0].replace("\n", " "),
            "parameters": {"type": "object", "properties": props, "required": required}}


# ------------------------------------------------------------------ built-in tools

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION = 200  # characters
_MAX_MAGNITUDE = 1e15


def _arith(node: ast.AST) -> float:
    """The value of a parsed arithmetic expression: numbers, + - * / // % ** and
    parentheses only (a tree walk, never `eval`)."""
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_arith(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _arith(node.left), _arith(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("the power is too large")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > _MAX_MAGNITUDE:
            raise ValueError("the result is too large")
        return value
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression (numbers, + - * / // % ** and parentheses)."""
    if not isinstance(expression, str) or len(expression) > _MAX_EXPRESSION:
        return f"error: give the expression as a string of at most {_MAX_EXPRESSION} characters"
    try:
        value = _arith(ast.parse(expression.replace("^", "**"), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return f"{value:.6g}" if isinstance(value, float) else str(value)


calculator.schema = {  # type: ignore[attr-defined]
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string",
                                                 "description": "e.g. 37 * (12 + 5)"}}}}

BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {"calculator": calculator}


def load_tools(names: Sequence[str]) -> list[Tool]:
    """Built-in tools by name and user functions by "pkg.module:function"."""
    tools = []
    for name in names:
        fn = (BUILTIN_TOOLS[name] if name in BUILTIN_TOOLS else
              import_object(name, f"env.tools entry {name!r}",
                            f"a built-in tool ({', '.join(BUILTIN_TOOLS)})"))
        if not callable(fn):
            raise ConfigError(f"env.tools entry {name!r} is not callable; point it at a function.")
        short = name.rpartition(":")[2]
        tools.append(Tool(short, fn, schema_of(fn, short)))
    names_seen = [t.name for t in tools]
    if len(set(names_seen)) != len(names_seen):
        raise ConfigError(f"env.tools has two tools of the same name ({names_seen}); "
                          f"give each tool a distinct function name.")
    return tools


class ToolRaised(Exception):
    """A tool raised: the trajectory ends as env.on_error says (the model is not to blame)."""

    def __init__(self, tool: str, error: BaseException):
        super().__init__(f"tool {tool!r} raised {type(error).__name__}: {error}")
        self.tool, self.error = tool, error


class ToolEnvironment(Environment):
    """Calls the tools a model turn asks for and answers with their results; a turn with
    no tool call is the final answer, scored by `score` (0 unless a subclass says; the
    reward functions score the final text too). A malformed call is answered with what
    is wrong, so the model can try again."""

    default_tools: tuple[str, ...] = ()  # loaded when env.tools names none

    def __init__(self, prompt: Any, *, tools: Sequence[Tool] = (),
                 tool_format: ToolFormat = FORMATS["hermes"], **metadata: Any):
        super().__init__(prompt, **metadata)
        self.tools = {t.name: t for t in tools}
        self.format = tool_format
        self.calls = 0

    def score(self, answer: str) -> float:
        """The reward of the final answer (a turn without a tool call)."""
        return 0.0

    def step(self, action: str) -> Step:
        try:
            calls = self.format.parse(action)
        except ToolCallError as e:
            return Step(self.format.respond([f"error: {e}"]))
        if not calls:
            return Step(None, self.score(action), True)
        results = []
        for call in calls:
            self.calls += 1
            tool = self.tools.get(call.name)
            if tool is None:
                results.append(f"error: no tool named {call.name!r} (tools: "
                               f"{', '.join(self.tools) or 'none'})")
                continue
            try:
                tool.check(call.arguments)
            except ToolCallError as e:
                results.append(f"error: {e}")
                continue
            try:
                results.append(str(tool.fn(**call.arguments)))
            except Exception as e:  # noqa: BLE001 - a user's tool may raise anything
                raise ToolRaised(call.name, e) from e
        return Step(self.format.respond(results))
