"""What the OpenAI-compatible routes do, as plain functions over a `Gateway` (tested
without a server): a chat or text completion call becomes engine requests, its completions
become the API's response (or its server-sent events), and, for a session of an agent
trajectory, its tokens join the session's rows (`gpurl.serve.sessions`).

Sampling: `gpurl serve` honours a call's temperature, top_p, top_k, seed and stop; a
training gateway samples every call with the run's rollout settings (the policy being
trained is the run's), so a call's own values are ignored there, and derives each call's
seed from its trajectory's (a rerun samples the same tokens).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Sequence

import numpy as np

from gpurl.models.tokenizer import Tokenizer
from gpurl.rollout.decode import truncate
from gpurl.rollout.requests import Completion, Request
from gpurl.serve.chat import RequestError, Renderer, Sampled, assistant_message
from gpurl.serve.driver import Driver
from gpurl.serve.schemas import (ChatChoice, ChatRequest, ChatResponse, ChoiceLogprobs,
                                 CompletionChoice, CompletionLogprobs, CompletionRequest,
                                 CompletionResponse, ModelCard, ModelList, TokenLogprob,
                                 TopLogprob, Usage)
from gpurl.serve.sessions import Session

# (prompt ids, completion ids, k) -> per completion token, the k likeliest (id, logprob)
Rescorer = Callable[[list[int], list[int], int], list[list[tuple[int, float]]]]


@dataclass
class Defaults:
    """Sampling where a call names none, and what a call may ask for."""

    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int  # a call's default limit
    max_context: int  # prompt + completion tokens at most


@dataclass
class SessionState:
    """A gateway session: its rows, the messages it sampled, and its limits. Its calls draw
    from one sampling stream (its seed, continued by the tokens drawn so far), as a
    multi-turn environment's trajectory does, so a rerun samples the same tokens."""

    key: str
    session: Session
    seed: int
    max_calls: int
    max_tokens: int  # tokens of a row after the context it started from, at most
    deadline: float  # time.monotonic() after which its calls are refused
    sampled: Sampled = field(default_factory=Sampled)
    failure: str | None = None  # the reason its trajectory ended early
    text: str = ""  # the current row as text (the prompts and completions it was given)
    drawn: int = 0  # tokens sampled in the trajectory so far
    driver: Driver | None = None  # the engine stream its calls join (None: the gateway's)
    temperature: float | None = None  # its calls' sampling temperature (None: the gateway's)


@dataclass
class Gateway:
    """What the routes need: the engine's driver, the tokenizer and its renderer, the
    model's name, the tool-call format, sampling defaults, and (training) the sessions by
    key. `submit` queues a call on the driver from the event loop."""

    driver: Driver
    tokenizer: Tokenizer
    stop_ids: Sequence[int]
    model_name: str
    defaults: Defaults
    stop_strings: tuple[str, ...]  # the engine's own (rollout.stop, env.stop): cut from the text
    tool_format: str | None = "hermes"
    rescore: Rescorer | None = None
    sessions: dict[str, SessionState] | None = None  # None: `gpurl serve` (no sessions)
    sampled: Sampled = field(default_factory=Sampled)  # `gpurl serve`'s returned messages
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.renderer = Renderer(self.tokenizer, self.stop_ids) if self.tokenizer.chat_template else None

    def models(self) -> dict:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created)]).model_dump()

    def session(self, sid: str, key: str) -> SessionState:
        """The session `sid` of a training gateway, when `key` is its key."""
        state = (self.sessions or {}).get(sid)
        if state is None:
            raise RequestError("no such session", status=404, code="session_not_found")
        if not hmac.compare_digest(key.encode(), state.key.encode()):
            raise RequestError("incorrect API key for this session", status=401,
                               code="invalid_api_key")
        return state


# ---------------------------------------------------------------- one call


@dataclass
class Call:
    """One call after validation: its prompt ids, engine requests and how to answer."""

    prompt: list[int]
    requests: list[Request]
    stops: tuple[str, ...]
    logprobs: bool
    top_logprobs: int
    tools: bool  # parse tool calls in completions
    session: str | None = None  # the key of the training session that made it
    driver: Driver | None = None  # the stream it joins (None: the gateway's)


def _limits(gw: Gateway, body: Any, prompt: list[int], state: SessionState | None) -> int:
    """The call's max_new_tokens: what it asks (or the default) within the room left, the
    model's context, or a trajectory row's tokens after the context it started from."""
    if state is None:
        cap, used, what = gw.defaults.max_context, len(prompt), "model"
    else:
        row = state.session.rows[-1]
        cap, used, what = state.max_tokens, len(prompt) - row.context, "trajectory row"
    room = cap - used
    if room <= 0:
        raise RequestError(f"this call leaves no room: the {what} holds {cap} tokens and "
                           f"{used} are used", code="context_length_exceeded", param="messages")
    return min(body.limit() or gw.defaults.max_new_tokens, room)


def _requests(gw: Gateway, body: Any, prompt: list[int], limit: int,
              state: SessionState | None) -> list[Request]:
    d = gw.defaults
    if state is not None:  # the run's policy, the trajectory's sampling stream
        temperature = d.temperature if state.temperature is None else state.temperature
        return [Request(tuple(prompt), limit, temperature, d.top_k, d.top_p, state.seed,
                        offset=state.drawn)]
    seed = body.seed if body.seed is not None else secrets.randbelow(1 << 31)
    temperature = d.temperature if body.temperature is None else body.temperature
    top_k = d.top_k if body.top_k in (None, -1) else body.top_k
    top_p = d.top_p if body.top_p is None else body.top_p
    return [Request(tuple(prompt), limit, temperature, top_k, top_p, (seed + i) % (1 << 31))
            for i in range(body.n)]


def chat_call(gw: Gateway, body: ChatRequest, state: SessionState | None) -> Call:
    """A chat call's prompt (messages rendered; a session's sampled messages spliced) and
    requests; a session's history extended or forked by it."""
    if gw.renderer is None:
        raise RequestError("the served model's tokenizer has no chat template; use "
                           "/v1/completions with a prompt")
    _check_session(state, body.n)
    tools = body.tools if body.tool_choice != "none" else None
    prompt = gw.renderer.ids(body.messages, tools, state.sampled if state else gw.sampled)
    if state is not None:
        state.session.extend(prompt)
    limit = _limits(gw, body, prompt, state)
    return Call(prompt, _requests(gw, body, prompt, limit, state), body.stops(), body.logprobs,
                body.top_logprobs or 0, bool(body.tools) and body.tool_choice != "none",
                *_owner(state))


def completion_call(gw: Gateway, body: CompletionRequest, state: SessionState | None) -> Call:
    """A text completion call: the prompt as text (BOS first) or as token ids."""
    _check_session(state, body.n)
    tok = gw.tokenizer
    if isinstance(body.prompt, str):
        prompt = _text_prompt(tok, body.prompt, state)
    else:
        prompt = [int(t) for t in body.prompt]
        if not prompt or min(prompt) < 0 or max(prompt) >= tok.vocab_size:
            raise RequestError(f"prompt token ids must lie in [0, {tok.vocab_size})",
                               param="prompt")
    if state is not None:
        state.session.extend(prompt)
        state.text = body.prompt if isinstance(body.prompt, str) else ""
    limit = _limits(gw, body, prompt, state)
    return Call(prompt, _requests(gw, body, prompt, limit, state), body.stops(),
                body.logprobs is not None, body.logprobs or 0, False, *_owner(state))


def _owner(state: SessionState | None) -> tuple[str | None, Driver | None]:
    """(the session's key, the stream its calls join) of a call, or (None, None)."""
    return (None, None) if state is None else (state.key, state.driver)


def _text_prompt(tok: Tokenizer, text: str, state: SessionState | None) -> list[int]:
    """A text prompt's ids (BOS first). A session's prompt that starts with its current
    row's text (the prompts and completions it was given) keeps that row's exact tokens
    for it: only the text after it (an observation) is encoded."""
    if state is not None and state.text and state.session.rows and text.startswith(state.text):
        return state.session.context() + tok.encode(text[len(state.text):])
    return ([] if tok.bos_id is None else [tok.bos_id]) + tok.encode(text)


def _check_session(state: SessionState | None, n: int) -> None:
    if state is None:
        return
    if state.failure is not None:
        raise RequestError(f"this trajectory has ended ({state.failure})", status=400,
                           code="trajectory_ended")
    if n != 1:
        raise RequestError("a trajectory's call samples one choice (n=1)", param="n")
    if state.session.calls >= state.max_calls:
        state.failure = f"more than {state.max_calls} calls"
        raise RequestError(f"this trajectory may make {state.max_calls} calls",
                           status=400, code="trajectory_limit")
    if time.monotonic() > state.deadline:
        state.failure = "past its wall-clock limit"
        raise RequestError("this trajectory ran past its wall-clock limit", status=400,
                           code="trajectory_limit")


async def run_call(gw: Gateway, call: Call, on_tokens: Callable[[int, list[int]], None] | None = None
                   ) -> list[Completion]:
    """The call's completions from the engine (awaited on the event loop)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def done(completions: list[Completion]) -> None:
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(completions))

    def progress(choice: int, tokens: list[int], _: list[float]) -> None:
        loop.call_soon_threadsafe(on_tokens, choice, tokens)

    (call.driver or gw.driver).submit(call.requests, done,
                                      progress if on_tokens is not None else None, call.session)
    completions = await future
    if not completions:  # dropped by the driver: the trajectory ended meanwhile
        raise RequestError("this trajectory has ended", status=400, code="trajectory_ended")
    return completions


# ---------------------------------------------------------------- answers


@dataclass
class Choice:
    """One completion as the API answers it: tokens kept (cut after a stop string),
    their text (without the stop string), why it ended, and what stopped it (the stop
    string or token id, vLLM's `stop_reason`; None at the token limit)."""

    tokens: list[int]
    logprobs: list[float]
    text: str
    finish: str  # stop | length
    stop: str | int | None = None
    versions: list[int] = field(default_factory=list)  # the policy version of each token


def finish(gw: Gateway, c: Completion, stops: tuple[str, ...]) -> Choice:
    """The completion cut at its first stop string: the text before it, the tokens up to
    the one that completed it (what was sampled and fed stays in the history)."""
    tokens, logprobs = [int(t) for t in c.tokens], [float(x) for x in c.logprobs]
    versions = [int(v) for v in c.versions] if c.versions is not None else [0] * len(tokens)
    text = gw.tokenizer.decode(tokens)
    if stops:
        cut = truncate(text, stops)
        if len(cut) < len(text):
            keep = next(i + 1 for i in range(len(tokens))
                        if len(truncate(gw.tokenizer.decode(tokens[:i + 1]), stops))
                        < len(gw.tokenizer.decode(tokens[:i + 1])))
            found = min((s for s in stops if text.startswith(s, len(cut))), key=len)
            return Choice(tokens[:keep], logprobs[:keep], cut, "stop", found, versions[:keep])
    if c.stopped:  # on a stop id: the engine's own stop strings are cut too
        cut = truncate(text, gw.stop_strings)
        found = next((s for s in gw.stop_strings if text.startswith(s, len(cut))), tokens[-1])
        return Choice(tokens, logprobs, cut, "stop", found if len(cut) < len(text) else tokens[-1],
                      versions)
    return Choice(tokens, logprobs, text, "length", None, versions)


def _token_text(tok: Tokenizer, i: int) -> tuple[str, list[int]]:
    text = tok.decode([i])
    return text, list(text.encode())


def _logprobs(gw: Gateway, prompt: list[int], choice: Choice, k: int) -> list[TokenLogprob]:
    tops = gw.rescore(prompt, choice.tokens, k) if k and gw.rescore else [[] for _ in choice.tokens]
    out = []
    for i, lp, top in zip(choice.tokens, choice.logprobs, tops):
        text, raw = _token_text(gw.tokenizer, i)
        out.append(TokenLogprob(token=text, logprob=lp, bytes=raw, top_logprobs=[
            TopLogprob(token=_token_text(gw.tokenizer, j)[0], logprob=p,
                       bytes=_token_text(gw.tokenizer, j)[1]) for j, p in top]))
    return out


def record(gw: Gateway, state: SessionState | None, message: dict, choice: Choice) -> None:
    """A returned message remembered for splicing; a session's row grows by its tokens."""
    sampled = state.sampled if state is not None else gw.sampled
    text = gw.tokenizer.decode(choice.tokens)
    sampled.remember(message, choice.tokens, text)
    if state is not None:
        state.session.sample(choice.tokens, choice.logprobs, choice.versions)
        state.drawn += len(choice.tokens)
        state.text += text


def chat_response(gw: Gateway, body: ChatRequest, call: Call, completions: list[Completion],
                  state: SessionState | None) -> dict:
    choices, generated = [], 0
    for index, c in enumerate(completions):
        choice = finish(gw, c, call.stops)
        generated += len(choice.tokens)
        message, kind = assistant_message(choice.text, gw.tool_format if call.tools else None)
        record(gw, state, message, choice)
        reason = "tool_calls" if kind == "tool_calls" else choice.finish
        logprobs = (ChoiceLogprobs(content=_logprobs(gw, call.prompt, choice, call.top_logprobs))
                    if call.logprobs else None)
        choices.append(ChatChoice(index=index, message=message, finish_reason=reason,
                                  logprobs=logprobs, stop_reason=choice.stop,
                                  token_ids=choice.tokens if body.return_token_ids else None))
    return _response(ChatResponse, "chatcmpl", gw, call, body.return_token_ids, choices, generated)


def completion_response(gw: Gateway, body: CompletionRequest, call: Call,
                        completions: list[Completion], state: SessionState | None) -> dict:
    choices, generated = [], 0
    prefix = gw.tokenizer.decode(call.prompt) if body.echo else ""
    for index, c in enumerate(completions):
        choice = finish(gw, c, call.stops)
        generated += len(choice.tokens)
        record(gw, state, {"role": "assistant", "content": choice.text}, choice)
        logprobs = None
        if call.logprobs:
            tokens = _logprobs(gw, call.prompt, choice, call.top_logprobs)
            offsets = np.cumsum([0] + [len(t.token) for t in tokens])[:-1] + len(prefix)
            logprobs = CompletionLogprobs(
                tokens=[t.token for t in tokens], token_logprobs=[t.logprob for t in tokens],
                top_logprobs=[{x.token: x.logprob for x in t.top_logprobs} for t in tokens]
                if call.top_logprobs else None, text_offset=[int(o) for o in offsets])
        choices.append(CompletionChoice(index=index, text=prefix + choice.text,
                                        finish_reason=choice.finish, logprobs=logprobs,
                                        stop_reason=choice.stop,
                                        token_ids=choice.tokens if body.return_token_ids else None))
    return _response(CompletionResponse, "cmpl", gw, call, body.return_token_ids, choices,
                     generated)


def _response(kind: type, prefix: str, gw: Gateway, call: Call, token_ids: bool,
              choices: list, generated: int) -> dict:
    """A chat or text completion response's envelope around its choices, as JSON."""
    return kind(id=f"{prefix}-{secrets.token_hex(12)}", created=int(time.time()),
                model=gw.model_name, choices=choices, usage=_usage(call.prompt, generated),
                prompt_token_ids=call.prompt if token_ids else None).model_dump(exclude_none=True)


def _usage(prompt: list[int], generated: int) -> Usage:
    return Usage(prompt_tokens=len(prompt), completion_tokens=generated,
                 total_tokens=len(prompt) + generated)


# ---------------------------------------------------------------- streaming


async def _deltas(gw: Gateway, call: Call, whole: bool = False) -> AsyncIterator[tuple]:
    """A streamed call's text as it is sampled: (choice, new text) pieces, held back as long
    as they may be the start of a stop string (or not at all with `whole`: a tool call is
    parsed from the whole text), then (None, the completions, the text each choice was sent)."""
    queue: asyncio.Queue = asyncio.Queue()
    hold = max((len(s) for s in call.stops), default=1) - 1
    task = asyncio.ensure_future(run_call(gw, call, lambda i, t: queue.put_nowait((i, t))))
    sent = [0] * len(call.requests)
    while not task.done() or not queue.empty():
        try:
            index, tokens = await asyncio.wait_for(queue.get(), timeout=0.05)
        except asyncio.TimeoutError:
            continue
        if whole:
            continue
        text = gw.tokenizer.decode(tokens)
        if call.stops and truncate(text, call.stops) != text:
            continue  # the stop string is in: the final chunk says what stands
        safe = len(text) - hold
        while safe > sent[index] and text[safe - 1] == "\ufffd":
            safe -= 1  # a multi-byte character not yet whole
        if safe > sent[index]:
            yield index, text[sent[index]:safe]
            sent[index] = safe
    yield None, task.result(), sent


def _error_event(e: RequestError) -> str:
    """An error as the last server-sent event of a stream (its status is already sent)."""
    error = {"message": str(e), "type": "invalid_request_error", "param": e.param, "code": e.code}
    return f"data: {json.dumps({'error': error})}\n\n"


def _wants_usage(body: ChatRequest | CompletionRequest) -> bool:
    return bool((body.stream_options or {}).get("include_usage"))


async def chat_events(gw: Gateway, body: ChatRequest, call: Call,
                      state: SessionState | None) -> AsyncIterator[str]:
    """A streamed chat call as server-sent events: a role chunk, text deltas as tokens are
    sampled (tool calls come whole at the end), the finish chunk (and usage when asked),
    then `[DONE]`."""
    ident, created = f"chatcmpl-{secrets.token_hex(12)}", int(time.time())

    def chunk(choices: list[dict], **extra: Any) -> str:
        data = {"id": ident, "object": "chat.completion.chunk", "created": created,
                "model": gw.model_name, "choices": choices, **extra}
        return f"data: {json.dumps(data)}\n\n"

    for index in range(len(call.requests)):
        yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                      "finish_reason": None}])
    try:
        async for index, *piece in _deltas(gw, call, whole=bool(call.tools)):
            if index is not None:
                yield chunk([{"index": index, "delta": {"content": piece[0]}, "finish_reason": None}])
                continue
            completions, sent = piece
    except RequestError as e:  # the trajectory ended while the call waited
        yield _error_event(e)
        return
    full = chat_response(gw, body, call, completions, state)
    for index, choice in enumerate(full["choices"]):
        message, delta = choice["message"], {}
        text = message.get("content") or ""
        if message.get("tool_calls"):
            delta["tool_calls"] = [{**tc, "index": i} for i, tc in enumerate(message["tool_calls"])]
            if text and not sent[index]:
                delta["content"] = text
        elif len(text) > sent[index]:
            delta["content"] = text[sent[index]:]
        extra = {"logprobs": choice["logprobs"]} if "logprobs" in choice else {}
        yield chunk([{"index": index, "delta": delta, "finish_reason": choice["finish_reason"],
                      **extra}])
    if _wants_usage(body):
        yield chunk([], usage=full["usage"])
    yield "data: [DONE]\n\n"


async def completion_events(gw: Gateway, body: CompletionRequest, call: Call,
                            state: SessionState | None) -> AsyncIterator[str]:
    """A streamed text completion as server-sent events: text pieces as tokens are sampled,
    each choice's last piece with its finish reason (and log-probs), usage when asked, then
    `[DONE]`."""
    ident, created = f"cmpl-{secrets.token_hex(12)}", int(time.time())

    def chunk(choices: list[dict], **extra: Any) -> str:
        data = {"id": ident, "object": "text_completion", "created": created,
                "model": gw.model_name, "choices": choices, **extra}
        return f"data: {json.dumps(data)}\n\n"

    echoed = gw.tokenizer.decode(call.prompt) if body.echo else ""
    begun: set[int] = set()
    try:
        async for index, *piece in _deltas(gw, call):
            if index is not None:  # a choice's first piece carries the echoed prompt
                text = piece[0] if index in begun else echoed + piece[0]
                begun.add(index)
                yield chunk([{"index": index, "text": text, "finish_reason": None}])
                continue
            completions, sent = piece
    except RequestError as e:  # the trajectory ended while the call waited
        yield _error_event(e)
        return
    full = completion_response(gw, body, call, completions, state)
    for index, choice in enumerate(full["choices"]):
        rest = choice["text"][len(echoed) + sent[index]:] if sent[index] else choice["text"]
        yield chunk([{**choice, "text": rest}])
    if _wants_usage(body):
        yield chunk([], usage=full["usage"])
    yield "data: [DONE]\n\n"
