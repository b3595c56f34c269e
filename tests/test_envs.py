"""Multi-turn environments and tools: formats, the calculator's parser, the token layout
of a trajectory on the tiny model, and failures that end trajectories, not runs."""

from __future__ import annotations

import functools
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TINY_MODEL, make_config
from gpurl.algorithms.forward import group_logprobs
from gpurl.algorithms.policy_gradient import flat_rows, policy_loss, token_normalizer
from gpurl.commands.generate import generate
from gpurl.config import (ConfigError, DataConfig, EnvConfig, GenerateConfig, GRPOConfig,
                          MeshConfig, ModelConfig, RolloutConfig)
from gpurl.data.sft import encode_sft
from gpurl.data.sources import read_jsonl
from gpurl.data.tasks import tool_call
from gpurl.envs import Environment, EnvError, Step, load_tools, resolve
from gpurl.envs.formats import FORMATS, ToolCall, ToolCallError
from gpurl.envs.tools import calculator, schema_of
from gpurl.models import model_spec
from gpurl.models.tokenizer import byte_tokenizer
from gpurl.rewards import load as load_rewards
from gpurl.rollout.collect import Collector
from gpurl.rollout.requests import Request
from gpurl.rollout.prompts import Prompts
from gpurl.distributed.host import to_host
from gpurl.rollout.rounds import Rounds, rollout_engine
from gpurl.train.loop import train


# ---------------------------------------------------------------- formats and tools


def test_hermes_and_llama3_tool_calls_parse():
    hermes = FORMATS["hermes"].parse
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": '
            '"2 + 3"}}</tool_call> and <tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n'
            '</tool_call>')
    assert hermes(text) == [ToolCall("calculator", {"expression": "2 + 3"}), ToolCall("f", {"x": 1})]
    assert hermes("Answer: 5") == []
    for bad in ("<tool_call>{name: calculator}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        with pytest.raises(ToolCallError):
            hermes(bad)
    llama = FORMATS["llama3"].parse
    assert llama('<|python_tag|>{"name": "calculator", "parameters": {"expression": "7*6"}}') == [
        ToolCall("calculator", {"expression": "7*6"})]
    assert llama('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"y": 2}}') == [
        ToolCall("a", {}), ToolCall("b", {"y": 2})]
    assert llama("The answer is 42.") == []
    assert FORMATS["hermes"].respond(["5", "7"]) == ("<tool_response>5</tool_response>\n"
                                                     "<tool_response>7</tool_response>\n")
    assert FORMATS["llama3"].respond(["5"]) == [{"role": "ipython", "content": "5"}]


def test_calculator_parses_arithmetic_and_never_evaluates_code():
    assert calculator("37 * (12 + 5)") == "629"
    assert calculator("7 / 2") == "3.5" and calculator("2^10") == "1024" and calculator("-3 + 1") == "-2"
    for code in ("__import__('os').system('echo hi')", "open('/etc/passwd').read()",
                 "(lambda: 1)()", "x + 1", "[1, 2]", "'a' * 3"):
        assert calculator(code).startswith("error:"), code
    assert calculator("9 ** 9 ** 9").startswith("error:")  # no runaway power
    assert calculator("1 / 0") == "error: division by zero"
    assert calculator("1" * 300).startswith("error:")


def add(a: int, b: int = 0) -> int:
    """Adds two integers.

    More text."""
    return a + b


def test_tools_load_by_path_with_a_schema_from_the_signature():
    tools = load_tools(["calculator", "test_envs:add"])
    assert [t.name for t in tools] == ["calculator", "add"]
    assert tools[0].schema == calculator.schema
    assert schema_of(add, "add") == {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "required": ["a"]}}
    with pytest.raises(ToolCallError, match="unknown arguments"):
        tools[1].check({"a": 1, "c": 2})
    with pytest.raises(ToolCallError, match="missing arguments"):
        tools[1].check({"b": 2})
    with pytest.raises(ConfigError, match="could not be imported"):
        load_tools(["test_envs:nothing"])
    with pytest.raises(ConfigError, match="neither a built-in"):
        resolve("calculatr")
    assert resolve("test_envs:Scripted") is Scripted


def test_calculator_environment_answers_calls_and_scores_the_answer():
    env = resolve("calculator")("Q: ...", tools=load_tools(["calculator"]), answer="62")
    step = env.step(tool_call("calculator", expression="37 + 25"))
    assert step == Step("<tool_response>62</tool_response>\n", 0.0, False)
    assert env.step("<tool_call>{oops}</tool_call>").observation.startswith("<tool_response>error: ")
    assert "no tool named 'search'" in env.step(tool_call("search", q="x")).observation
    assert env.step("Answer: 62") == Step(None, 1.0, True)
    assert env.step("Answer: 61").reward == 0.0
    game = resolve("guess_number")("Game 1 ...", answer="12")
    assert [game.step(a) for a in (" 10", " 15", "what?", " 12")] == [
        Step("Higher.\nGuess:"), Step("Lower.\nGuess:"), Step("Say a number.\nGuess:"),
        Step(None, 1.0, True)]


# ---------------------------------------------------------------- trajectories on the tiny model


class Scripted(Environment):
    """Says "[r]" before the first turn, then "<1>" and "<2>"; the third turn ends the
    trajectory. Step rewards 0.5, 0.25, 1."""

    def reset(self):
        self.turn = 0
        return "[r]"

    def step(self, action):
        self.turn += 1
        turn = self.turn
        return Step(f"<{turn}>" if turn < 3 else None, (0.5, 0.25, 1.0)[turn - 1], turn == 3)


TOK = byte_tokenizer()
SPEC = model_spec(ModelConfig(**TINY_MODEL, tokenizer="bytes"))


@functools.cache
def params() -> Any:
    """The tiny model's weights, drawn when a test first needs them (not at collection: its
    25 eager programs compiled in every pytest worker)."""
    return SPEC.init(0)


PROMPTS = Prompts([{"prompt": f"q{i} =", "answer": str(i)} for i in range(4)],
                  [[TOK.bos_id] + TOK.encode(f"q{i} =") if TOK.bos_id is not None
                   else TOK.encode(f"q{i} =") for i in range(4)])


def env_rounds(env: EnvConfig, temperature: float = 1.0, rewards=()) -> Rounds:
    rollout = RolloutConfig(max_new_tokens=5, temperature=temperature, stop=(), slots=4)
    return Rounds(rollout_engine(SPEC, TOK, rollout, MeshConfig(), env=env), TOK,
                  load_rewards(list(rewards)), 16, env)


@pytest.mark.slow
def test_a_three_turn_trajectory_has_the_hand_built_layout():
    """Observation spans masked, log-probs only on model tokens, sampling keys continuing
    across turns: the trajectory equals turns generated one by one with the prompt grown by
    hand; the training forward pass over the whole trajectory (continuous positions) gives
    the sampler's log-probs; the loss has no gradient through observation tokens."""
    env = EnvConfig(name="test_envs:Scripted", max_turns=5, max_tokens=40)
    rounds = env_rounds(env)
    seeds = np.arange(8, dtype=np.uint32) + 100
    r = rounds.run(params(), PROMPTS, np.arange(4), 2, seeds)
    tokens, lengths = to_host(r.rollout.tokens), to_host(r.rollout.lengths)
    logprobs, mask = to_host(r.rollout.logprobs), to_host(r.rollout.mask)
    scores = to_host(r.scores)
    sampler = rounds.engine
    for row in range(8):
        prompt, seed = PROMPTS.tokens[row // 2], int(seeds[row])
        want_tokens, want_mask, want_lp, drawn = [], [], [], 0
        obs = TOK.encode("[r]")
        for turn in range(3):
            want_tokens += obs
            want_mask += [0] * len(obs)
            want_lp += [0.0] * len(obs)
            c = sampler.generate(params(), [Request(tuple(prompt + want_tokens), 5, 1.0, seed=seed,
                                                  offset=drawn)])[0]
            want_tokens += c.tokens.tolist()
            want_mask += [1] * len(c.tokens)
            want_lp += c.logprobs.tolist()
            drawn += len(c.tokens)
            obs = TOK.encode(f"<{turn + 1}>")
        n = len(want_tokens)
        assert lengths[row] == n
        assert tokens[row, :n].tolist() == want_tokens
        assert mask[row].tolist() == want_mask + [0] * (40 - n)
        np.testing.assert_allclose(logprobs[row, :n], want_lp, atol=1e-5)
        assert not logprobs[row, n:].any()
        np.testing.assert_allclose(scores[row, :2], [1.75, 1.75], atol=1e-6)  # summed step rewards

    collector = object.__new__(Collector)  # only its batch assembly
    collector.group, collector.pad_id = 2, TOK.pad_id
    rollout, _ = collector._assemble_fn([Collector._parts(r, r.scores[:, 0])], jnp.arange(8),
                                        jnp.ones(8, bool))
    batch = rollout.arrays()
    assert np.array_equal(np.asarray(batch["comp_mask"]).reshape(8, -1), mask)
    forward, _ = group_logprobs(SPEC, params(), batch)
    forward = np.asarray(forward).reshape(8, -1)
    np.testing.assert_allclose(forward * mask, logprobs * mask, atol=1e-4)

    cfg = GRPOConfig(name="grpo", beta=0.0)
    rows = {**flat_rows(batch), "advantages": jnp.linspace(-1.0, 1.0, 8)}

    def loss(logp_BxN):
        return policy_loss(cfg, logp_BxN, {**rows, "old_logprobs": jax.lax.stop_gradient(logp_BxN)},
                           token_normalizer(batch), 40)[0]

    grad = np.asarray(jax.grad(loss)(jnp.asarray(forward)))
    assert not grad[mask == 0].any() and (grad[mask == 1] != 0).mean() > 0.9


def test_a_checkpointed_trajectory_goes_on_as_the_uninterrupted_one():
    """Continuous rollouts checkpoint trajectories in flight: their snapshot (JSON) restores
    tokens, rewards and versions, and rebuilds each environment still going by replaying
    reset() and its steps, so a stateful environment (Scripted counts its turns) answers
    the next turns as the uninterrupted one does."""
    from gpurl.rollout.requests import Completion

    rounds = env_rounds(EnvConfig(name="test_envs:Scripted", max_turns=5, max_tokens=40))
    live = rounds.new_episodes()
    rows = [PROMPTS.rows[0]] * 2
    live.begin(rows, [0, 1], rounds.first_requests(PROMPTS.tokens[0], [1, 2]))

    def turn(version: int) -> Completion:
        return Completion(np.asarray(TOK.encode("ab"), np.int32), np.full(2, -0.5, np.float32),
                          True, None, np.full(2, version, np.int32))

    live.resume(0, turn(3))
    restored = rounds.new_episodes()
    restored.restore(json.loads(json.dumps(live.snapshot())), rows)
    assert restored.oldest() == live.oldest() == 3
    for episodes in (live, restored):
        assert episodes.resume(0, turn(4)).prompt[-3:] == tuple(TOK.encode("<2>"))
        assert episodes.resume(0, turn(5)) is None  # Scripted's third turn ends it
        assert episodes.resume(1, turn(5)).offset == 2  # row 1's first turn
    for k, x in live.arrays(40, TOK.pad_id).items():
        assert np.array_equal(x, restored.arrays(40, TOK.pad_id)[k]), k
    assert restored.trajectories[0].rewards == [0.5, 0.25, 1.0]


@pytest.mark.slow
def test_trajectories_end_at_max_turns_and_max_tokens():
    rounds = env_rounds(EnvConfig(name="test_envs:Scripted", max_turns=2, max_tokens=40,
                                  reward="last"), temperature=0.0)
    r = rounds.run(params(), PROMPTS, np.arange(4), 1, np.zeros(4, np.uint32))
    env = to_host(r.env)
    assert env[:, 1].tolist() == [2] * 4 and np.allclose(env[:, 0], 0.25)  # the last step's
    short = env_rounds(EnvConfig(name="test_envs:Scripted", max_tokens=9), temperature=0.0)
    r = short.run(params(), PROMPTS, np.arange(4), 1, np.zeros(4, np.uint32))
    lengths, mask = to_host(r.rollout.lengths), to_host(r.rollout.mask)
    assert (lengths <= 9).all() and (mask.sum(-1) >= 1).all()


@pytest.mark.e2e
def test_raising_and_hanging_tools_end_their_trajectories_and_the_run_goes_on(tmp_path):
    """Rows with an even answer call the raising (then the hanging) tool: those
    trajectories end with env.error_reward and are counted, the others finish; the runs
    complete. With env.on_error=stop the run ends with one sentence naming the tool."""
    def config(tool: str, run: str, **env):
        return make_config(
            algo={"name": "grpo", "num_generations": 4}, model=dict(TINY_MODEL, tokenizer="bytes"),
            data={"name": "arithmetic", "num_train": 64, "num_eval": 0, "max_len": 16},
            optim={"lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
            train={"steps": 1, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0,
                   "eval_batch_size": 16, "eval_pass_k": 0},
            rollout={"max_new_tokens": 4},
            env={"name": "rl_envs:ScriptedCalls", "tools": [tool, "calculator"],
                 "max_tokens": 64, "timeout_s": 0.3, "error_reward": -1.0, **env},
            logger={"progress": False}, run={"dir": str(tmp_path / run)})

    for tool in ("rl_envs:boom", "rl_envs:hang"):
        run = tool.partition(":")[2]
        train(config(tool, run))
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        steps = [x for x in rows if "env/errors" in x]
        assert len(steps) == 1
        for x in steps:
            errors = x["env/errors"]
            assert 0 < errors < 16, x  # some rows failed, not all
            # failed rows score -1, the others 1 (their second turn)
            np.testing.assert_allclose(x["reward/env"], (16 - errors - errors) / 16, atol=1e-6)
    with pytest.raises(EnvError, match=r"^environment 'rl_envs:ScriptedCalls' tool 'boom' raised "
                                       r"RuntimeError: the tool broke on row \d+; fix it"):
        train(config("rl_envs:boom", "stop", on_error="stop"))


@pytest.mark.slow
def test_recorded_trajectories_train_sft_on_model_turns_only(tmp_path, capsys):
    """`gpurl generate env=... record=F` writes trajectories that SFT reads: loss on the
    model's turns (and the final EOS), none on observations or the prompt."""
    record = tmp_path / "trajectories.jsonl"
    out = generate(GenerateConfig(
        model=ModelConfig(**TINY_MODEL, tokenizer="bytes"), n=2, num_prompts=2,
        rollout=RolloutConfig(max_new_tokens=4, stop=("\n",)), record=str(record),
        env=EnvConfig(name="guess_number", max_turns=3, max_tokens=30),
        data=DataConfig(name="guess_number", num_train=16, num_eval=4, few_shot=1, max_len=256)))
    shown = capsys.readouterr().out
    assert "=== prompt 0 (tiny, env guess_number)" in shown and "[env] " in shown
    rows = read_jsonl(str(record), need_completion=True)
    assert len(rows) == len(out) == 4 and all(r["turns"] >= 1 for r in rows)
    assert any(not s["train"] for r in rows for s in r["trajectory"])
    encoded = encode_sft(rows, TOK, DataConfig(name="jsonl", path=str(record), max_len=512))
    for b, row in enumerate(rows):
        want = [0.0] * (1 + len(TOK.encode(row["prompt"])))  # bos + prompt
        for seg in row["trajectory"]:
            want += [float(seg["train"])] * len(TOK.encode(seg["text"]))
        want += [1.0]  # EOS
        got = encoded.loss_mask[b]
        assert got[:len(want)].tolist() == [0.0] + want[1:] and not got[len(want):].any()


@pytest.mark.e2e
def test_ppo_trains_on_guess_the_number_trajectories(tmp_path):
    """PPO with its critic on multi-turn trajectories (GAE over the model's tokens): the
    run completes with finite losses and the environment's metrics."""
    cfg = make_config(
        algo={"name": "ppo", "num_generations": 2}, model=dict(TINY_MODEL, tokenizer="bytes"),
        data={"name": "guess_number", "num_train": 32, "num_eval": 0, "max_len": 256, "few_shot": 1},
        optim={"lr": 1e-3, "warmup_steps": 0, "decay": "constant"},
        train={"steps": 2, "batch_size": 4, "eval_every": 0, "checkpoint_every": 0},
        rollout={"max_new_tokens": 4, "stop": ["\n"]},
        env={"name": "guess_number", "max_turns": 3, "max_tokens": 32},
        logger={"progress": False}, run={"dir": str(tmp_path / "ppo")})
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / "ppo/metrics.jsonl").read_text().splitlines()]
    steps = [x for x in rows if "env/turns" in x]
    assert len(steps) == 2
    for x in steps:
        assert np.isfinite([x["loss"], x["values/mean"], x["returns/mean"]]).all()
        assert x["env/observation_tokens"] > 0 and 1 <= x["env/turns"] <= 3
