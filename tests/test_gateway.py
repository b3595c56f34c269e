"""The OpenAI-compatible layer (`gpurl.serve`): token-exact sessions and their fork rule
(plain Python), tool-call parsing, `gpurl serve` answering the real `openai` client, and
a battery of hostile requests the server answers with OpenAI errors while it keeps serving."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from gpurl.models.chat_template import DEFAULT_CHAT_TEMPLATE
from gpurl.models.tokenizer import Tokenizer
from gpurl.serve.chat import Renderer, Sampled, assistant_message
from gpurl.serve.sessions import Session, common_prefix

# ---------------------------------------------------------------- sessions, plain Python


def test_a_session_grows_by_what_extends_it_and_forks_where_history_was_rewritten():
    s = Session(max_rows=2)
    assert s.extend([1, 5, 6]) and s.rows[0].context == 3
    s.sample([7, 8], [-0.5, -0.25])
    assert s.extend([1, 5, 6, 7, 8, 9]) and s.forks == 0  # an observation (9) appended
    s.sample([10], [-1.0])
    row = s.rows[0]
    assert row.tokens == [1, 5, 6, 7, 8, 9, 10]
    assert row.sampled == [False, False, False, True, True, False, True]
    assert row.logprobs == [0, 0, 0, -0.5, -0.25, 0, -1.0] and s.prefilled == 4
    assert not s.extend([1, 5, 99]) and s.forks == 1  # history rewritten: a second row
    assert s.rows[1].tokens == [1, 5, 99] and s.rows[1].context == 3
    assert not s.extend([2]) and s.dropped == 1 and [r.tokens[0] for r in s.rows] == [1, 2]
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2 and common_prefix([]) == 0


def _bpe() -> Tokenizer:
    """A byte-level BPE in which "ab" is one token: sampled "a", "b" decode to "ab", which
    encodes back to the one token, so re-tokenizing a sampled message changes its ids."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<eos>", "<bos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["abab ab abab", "<start_of_turn>model\n<end_of_turn>"] * 50, trainer)
    return Tokenizer(tok, eos_id=1, pad_id=0, bos_id=2, chat_template=DEFAULT_CHAT_TEMPLATE)


def test_sampled_messages_are_spliced_back_as_the_ids_sampled():
    """The second call's prompt extends the first call's prompt + its sampled ids exactly
    (one row); rendering and encoding the same messages as text would give other ids."""
    tok = _bpe()
    renderer, sampled = Renderer(tok, [1]), Sampled()
    a, b = tok.tok.token_to_id("a"), tok.tok.token_to_id("b")
    assert tok.encode("ab") != [a, b]
    first = renderer.ids([{"role": "user", "content": "x"}], None, sampled)
    session = Session()
    session.extend(first)
    ids = [a, b, a, b, 1]  # "abab", then the stop id
    session.sample(ids, [-0.1] * 5)
    message, _ = assistant_message(tok.decode(ids), None)
    sampled.remember(message, ids, tok.decode(ids))
    history = [{"role": "user", "content": "x"}, dict(message), {"role": "user", "content": "y"}]
    second = renderer.ids(history, None, sampled)
    assert second[:len(first) + 5] == first + ids
    assert session.extend(second) and session.forks == 0
    # the same conversation without the session's memory: re-encoded, it is another history
    plain = renderer.ids(history, None, Sampled())
    assert plain[:len(first) + 5] != first + ids


# Qwen3's rule, re-stated: an assistant turn before the last user turn loses its thinking.
DROPS_THINKING = (
    "{% set last = namespace(i=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if m['role'] == 'assistant' and loop.index0 < last.i and '</think>' in c %}"
    "{% set c = c.split('</think>')[-1] %}{% endif %}"
    "<|{{ m['role'] }}|>{{ c }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_a_template_that_drops_earlier_thinking_forks_the_trajectory():
    """With a template that rewrites the history (Qwen3 drops an earlier turn's thinking),
    the next call's prompt does not extend the row: the trajectory forks into a second row
    whose tokens are the context the template gave; the first row keeps what was sampled."""
    tok = _bpe()
    tok.chat_template = DROPS_THINKING
    renderer, sampled, session = Renderer(tok, [1]), Sampled(), Session()
    first = renderer.ids([{"role": "user", "content": "q"}], None, sampled)
    session.extend(first)
    ids = tok.encode("<think>ab</think>ab") + [1]
    session.sample(ids, [0.0] * len(ids))
    message, _ = assistant_message(tok.decode(ids), None)
    sampled.remember(message, ids, tok.decode(ids))
    second = renderer.ids([{"role": "user", "content": "q"}, message,
                           {"role": "user", "content": "r"}], None, sampled)
    assert "<think>" not in tok.decode(second[len(first):])  # the thinking is gone
    assert not session.extend(second) and session.forks == 1 and len(session.rows) == 2
    assert session.rows[0].tokens == first + ids and session.rows[1].tokens == second


def test_tool_calls_are_parsed_into_openai_tool_calls_and_a_broken_one_is_named():
    text = 'Let me add.<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    message, kind = assistant_message(text, "hermes")
    assert kind == "tool_calls" and message["content"] == "Let me add."
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "calculator", "arguments": '{"expression": "2+2"}'}
    broken, kind = assistant_message("<tool_call>{not json</tool_call>", "hermes")
    assert kind == "stop" and "tool_calls" not in broken and "not valid JSON" in broken["tool_call_error"]
    assert assistant_message('{"name": "f", "parameters": {}}', "llama3")[1] == "tool_calls"
    assert assistant_message("plain", None) == ({"role": "assistant", "content": "plain"}, "stop")


# ---------------------------------------------------------------- gpurl serve over HTTP


@pytest.fixture(scope="module")
def served():
    """`gpurl serve` of the tiny random model (byte tokenizer, Gemma's turn markers)."""
    from gpurl.cli.compose import APPS, validate
    from gpurl.commands.serve import Serving

    cfg = validate(["model=tiny", "model.tokenizer=bytes", "port=0", "api_key=test-key",
                    "rollout.max_new_tokens=8", "max_context=512"], APPS["serve"])
    with Serving(cfg) as s:
        yield s


@pytest.mark.slow
def test_the_openai_client_gets_chat_completions_logprobs_streams_and_token_ids(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=served.url, api_key="test-key")
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "1 + 1 ="}]
    chat = client.chat.completions.create(model="tiny", messages=messages, n=2, seed=7,
                                          max_tokens=5, logprobs=True, top_logprobs=3,
                                          extra_body={"return_token_ids": True})
    assert len(chat.choices) == 2 and chat.usage.completion_tokens <= 10
    extra = chat.model_extra
    prompt_ids = extra["prompt_token_ids"]
    assert chat.usage.prompt_tokens == len(prompt_ids) and prompt_ids[0] == 2  # BOS first
    for choice in chat.choices:
        ids = choice.model_extra["token_ids"]
        tokens = choice.logprobs.content
        assert len(tokens) == len(ids) and choice.finish_reason in ("stop", "length")
        for t in tokens:  # the sampled token's log-prob is the sampler's; the top-3, a forward pass
            assert len(t.top_logprobs) == 3 and t.top_logprobs[0].logprob >= t.logprob - 1e-4
            assert t.logprob <= 0 and np.isfinite(t.logprob)
    # the same seed again, streamed: the same text, in deltas
    again = client.chat.completions.create(model="tiny", messages=messages, seed=7, max_tokens=5)
    streamed = client.chat.completions.create(model="tiny", messages=messages, seed=7,
                                              max_tokens=5, stream=True,
                                              stream_options={"include_usage": True})
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (again.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == again.usage.completion_tokens
    # a sent-back answer is spliced: the next prompt extends the first prompt + its ids
    answer = again.choices[0].message.model_dump(exclude_none=True)
    follow = client.chat.completions.create(
        model="tiny", messages=[*messages, answer, {"role": "user", "content": "and 2 + 2 ="}],
        max_tokens=3, extra_body={"return_token_ids": True})
    first = client.chat.completions.create(model="tiny", messages=messages, seed=7, max_tokens=5,
                                           extra_body={"return_token_ids": True})
    history = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    assert follow.model_extra["prompt_token_ids"][:len(history)] == history
    text_call = client.completions.create(model="tiny", prompt="2 + 3 =", max_tokens=4, seed=1,
                                          logprobs=2)
    assert len(text_call.choices[0].logprobs.tokens) == text_call.usage.completion_tokens
    # text completions stream too, in pieces as tokens are sampled, usage last
    text_chunks = list(client.completions.create(
        model="tiny", prompt="2 + 3 =", max_tokens=4, seed=1, stream=True, echo=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in text_chunks if c.choices) == (
        "2 + 3 =" + text_call.choices[0].text)
    assert text_chunks[-1].usage.completion_tokens == text_call.usage.completion_tokens
    assert text_chunks[-2].choices[0].finish_reason == text_call.choices[0].finish_reason


@pytest.mark.slow
def test_hostile_requests_get_openai_errors_and_the_server_keeps_serving(served):
    url = served.url
    ok = {"Authorization": "Bearer test-key"}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with httpx.Client(timeout=120) as http:
        def status(path, body=None, headers=ok, raw=None):
            r = (http.get(url + path, headers=headers) if body is None and raw is None else
                 http.post(url + path, headers=headers, content=raw if raw is not None else json.dumps(body)))
            return r.status_code, r.json()["error"]["message"] if r.status_code != 200 else r.json()

        cases = {
            "no key": status("/models", headers={}),
            "a wrong key": status("/chat/completions", chat, {"Authorization": "Bearer nope"}),
            "malformed JSON": status("/chat/completions", raw=b'{"model": "tiny", "messages": ['),
            "not an object": status("/chat/completions", raw=b"[1, 2]"),
            "a schema error": status("/chat/completions", {**chat, "n": "many"}),
            "n too large": status("/chat/completions", {**chat, "n": 1000}),
            "an unknown role": status("/chat/completions", {**chat, "messages": [{"role": "root"}]}),
            "image content": status("/chat/completions", {**chat, "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "token ids out of range": status("/completions", {"prompt": [1, 10**9]}),
            "an unknown route": status("/embeddings", {"input": "x"}),
            "a body over 8 MiB": status("/completions", raw=b'{"prompt": "' + b"a" * (9 << 20) + b'"}'),
        }
        want = {"no key": 401, "a wrong key": 401, "malformed JSON": 400, "not an object": 400,
                "a schema error": 422, "n too large": 422, "an unknown role": 400,
                "image content": 400, "token ids out of range": 400, "an unknown route": 404,
                "a body over 8 MiB": 413}
        assert {k: v[0] for k, v in cases.items()} == want, cases
        assert all(isinstance(v[1], str) and v[1] for v in cases.values())
        # a huge max_tokens is served within the model's context
        code, body = status("/chat/completions", {**chat, "max_tokens": 10**9})
        assert code == 200 and body["usage"]["total_tokens"] <= 512
        assert status("/chat/completions", chat)[0] == 200  # still serving


# ------------------------------------------- an agent framework's tool loop through the server


def _fit(spec, params, pairs, steps=400):
    """`params` fit (Adam, plain JAX) until greedy decoding of each prompt gives its reply:
    a tiny model made to answer as an agent's tool loop needs."""
    import jax
    import jax.numpy as jnp
    import optax

    width = max(len(p) + len(t) for p, t in pairs)
    tokens = np.zeros((len(pairs), width), np.int32)
    weights = np.zeros((len(pairs), width - 1), np.float32)
    for i, (p, t) in enumerate(pairs):
        tokens[i, :len(p) + len(t)] = p + t
        weights[i, len(p) - 1:len(p) + len(t) - 1] = 1.0  # position j predicts token j + 1
    positions = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    segments = (tokens > 0).astype(np.int32)
    segments[:, 0] = 1
    opt = optax.adam(1e-2)

    def loss(params):
        logits = spec.apply(params, tokens, positions, segments).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        greedy = (logp.argmax(-1) == tokens[:, 1:]) | (weights == 0)
        return -(picked * weights).sum() / weights.sum(), greedy.all()

    @jax.jit
    def step(params, state):
        (_, exact), grads = jax.value_and_grad(loss, has_aux=True)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, exact

    state = opt.init(params)
    for _ in range(steps):
        params, state, exact = step(params, state)
        if exact:  # greedy decoding gives every reply: 20 more steps widen the margin
            for _ in range(20):
                params, state, _ = step(params, state)
            return params
    raise AssertionError(f"the tiny model did not fit its replies in {steps} steps")


@pytest.mark.slow
def test_the_openai_agents_sdk_runs_a_tool_loop_through_the_server(served):
    """The OpenAI Agents SDK, unchanged, drives a tool loop through `gpurl serve`: the model
    (the tiny one, fit to answer as a tool-using agent would) writes a hermes tool call, the
    gateway returns it as `tool_calls`, the SDK runs the tool and sends its result back, and
    the model's next answer is the SDK's final output."""
    agents = pytest.importorskip("agents")
    openai = pytest.importorskip("openai")
    agents.set_tracing_disabled(True)
    ran = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Adds two integers."""
        ran.append((a, b))
        return a + b

    instructions, question = "Add with the tool.", "What is 2 + 2?"
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    tok = served.gateway.tokenizer
    sync = openai.OpenAI(base_url=served.url, api_key="test-key")
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": question}]
    first = sync.chat.completions.create(model="tiny", messages=messages, max_tokens=1,
                                         extra_body={"return_token_ids": True})
    first = first.model_extra["prompt_token_ids"]
    spec, random = served.gateway.rescore.spec, served.params
    try:
        served.use(_fit(spec, random, [(first, tok.encode(call) + [tok.eos_id])]))
        sampled = sync.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                               max_tokens=96, tools=[{"type": "function", "function": {
                                                   "name": "add", "parameters": {"type": "object"}}}])
        message = sampled.choices[0].message
        assert message.tool_calls and message.tool_calls[0].function.name == "add"
        followed = [*messages, message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "4"}]
        second = sync.chat.completions.create(model="tiny", messages=followed, max_tokens=1,
                                              extra_body={"return_token_ids": True})
        answer = "The sum is 4."
        served.use(_fit(spec, served.params, [
            (first, tok.encode(call) + [tok.eos_id]),
            (second.model_extra["prompt_token_ids"], tok.encode(answer) + [tok.eos_id])]))
        client = openai.AsyncOpenAI(base_url=served.url, api_key="test-key")
        agent = agents.Agent(name="calc", instructions=instructions, tools=[add],
                             model=agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=96))
        result = agents.Runner.run_sync(agent, question)
    finally:
        served.use(random)
    assert ran == [(2, 2)]
    assert result.final_output == answer


def test_agents_in_continuous_mode_pass_check_with_split_placement(capsys, monkeypatch):
    """env=agent with rollout.mode=continuous on split placement: `gpurl check` passes
    (agents play in the run's stream, `gpurl.rollout.continuous`)."""
    from gpurl.cli import main

    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    main(["check", "train", "model=tiny", "env=agent", "env.agent=rl_agents:printable",
          "rollout.mode=continuous", "mesh.placement=split", "mesh.rollout_devices=1",
          "devices=2"])
    out = capsys.readouterr()
    assert "env: agent rl_agents:printable" in out.out + out.err


def test_calls_of_agents_between_calls_are_gathered_into_one_iteration():
    """`_gather`: a queued call waits (at most the window) for the running agents that
    have not sent their next call yet, so that a turn's calls join the engine together;
    nothing queued, or every agent's call in, goes on at once (plain Python, no engine)."""
    import threading
    import time

    from gpurl.serve.agents import _gather
    from gpurl.serve.driver import Driver

    driver = Driver(None)  # submit/queued/pending/wait need no engine
    started = time.monotonic()
    _gather(driver, 3, 5.0)  # nothing queued: no wait
    assert time.monotonic() - started < 0.5
    driver.submit([], lambda _: None)

    def late() -> None:
        for _ in range(2):
            time.sleep(0.05)
            driver.submit([], lambda _: None)

    threading.Thread(target=late).start()
    started = time.monotonic()
    _gather(driver, 3, 5.0)  # the other two agents' calls arrive within 0.1 s
    assert driver.queued() == 3 and time.monotonic() - started < 2.0
    started = time.monotonic()
    _gather(driver, 4, 0.2)  # a fourth agent is still thinking: the window ends it
    assert 0.15 < time.monotonic() - started < 2.0


def test_the_gather_window_follows_the_last_busy_iteration():
    """`Pace`: the window is a quarter of the last iteration that prefilled or decoded, at
    most 1 s; the idle iterations between a turn's end and its agents' next calls (every
    agent thinking) leave it as it was. Counting them made it 0 at each turn's start, and
    the turn's calls joined in waves (benchmarks/agent.py: 0.75x -> 0.88x the environment)."""
    from gpurl.serve.agents import Pace

    pace = Pace()
    assert pace.window() == 0.0
    pace.took(2.0, busy=True)
    assert pace.window() == 0.5
    for _ in range(10):
        pace.took(0.0001, busy=False)
    assert pace.window() == 0.5
    pace.took(8.0, busy=True)
    assert pace.window() == 1.0


def test_a_call_dropped_by_the_driver_is_answered_with_the_trajectory_ended():
    """`Driver.cancel`: calls waiting for a trajectory that ended (a timeout, a group played
    again, the run's end) are answered at once, never left hanging (plain Python, no
    engine): `run_call` refuses them with trajectory_ended, a stream ends on an error event."""
    import asyncio

    from gpurl.serve import api
    from gpurl.serve.chat import RequestError
    from gpurl.serve.driver import Driver

    driver = Driver(None)
    answers: list = []
    driver.submit([], answers.append, tag="a")
    driver.submit([], answers.append, tag="b")
    driver.cancel({"a"})  # not admitted yet: only every call (None) reaches the inbox
    assert answers == [] and driver.queued() == 2
    driver.cancel()
    assert answers == [[], []] and driver.pending() == 0

    call = api.Call([1], [], (), False, 0, False, "a")
    no_template = type("Tok", (), {"chat_template": None})()
    gw = api.Gateway(driver, no_template, [], "m", api.Defaults(1.0, 1.0, 0, 4, 8), ())

    async def refused() -> None:
        task = asyncio.ensure_future(api.run_call(gw, call))
        await asyncio.sleep(0.01)
        driver.cancel()
        with pytest.raises(RequestError, match="this trajectory has ended") as e:
            await task
        assert e.value.code == "trajectory_ended"
        event = api._error_event(e.value)
        assert json.loads(event[len("data: "):])["error"]["code"] == "trajectory_ended"

    asyncio.run(refused())
