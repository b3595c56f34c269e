"""Multi-turn rollouts: each row's environment stepped between its turns, on the host of
the process that holds the row.

    turn 1:  the engine decodes the prompt (+ the environment's reset observation) up to
             a turn stop (EOS, rollout.stop, env.stop; one token per turn end)
    step:    the finished row's environment reads the turn's text -> observation, reward,
             done (`Episodes.resume`, called by the engine as the row finishes)
    turn k:  the observation's tokens are appended and the row is queued again, sampling
             keys continuing where they stopped (`Request.offset`); meanwhile its decode
             slot and KV blocks serve other rows
    end:     done, env.max_turns turns, env.max_tokens tokens, or an error

A trajectory is the tokens after the prompt, model and observation tokens interleaved,
positions continuous; `model` marks the model's own (loss mask 1, sampler log-probs),
observation tokens are never trained (mask 0, log-prob 0). The engine runs on each
process's own rows only, so every environment lives on exactly one process and is
stepped exactly once per turn; nothing is replicated or gathered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from gpurl.config import ConfigError, EnvConfig
from gpurl.envs import Environment, EnvError, Step, ToolEnvironment, load_tools, resolve
from gpurl.envs.base import Observation
from gpurl.user_code import Timeout, call_with_timeout
from gpurl.envs.formats import FORMATS
from gpurl.envs.tools import ToolRaised
from gpurl.models.tokenizer import Tokenizer
from gpurl.rollout.decode import truncate
from gpurl.rollout.requests import Completion, Request

# Keys of a data row that are not metadata for the environment.
_NOT_METADATA = ("prompt", "messages")
# A two-message conversation the chat template renders before an observation's messages
# (the observation's text is what the template adds after it).
_BEFORE = [{"role": "user", "content": "A"}, {"role": "assistant", "content": "B"}]


class EnvFactory:
    """Builds one environment per trajectory from its data row (`env.name`, its tools)."""

    def __init__(self, cfg: EnvConfig):
        self.cfg, self.cls = cfg, resolve(cfg.name)
        self.name = cfg.name
        self.uses_tools = isinstance(self.cls, type) and issubclass(self.cls, ToolEnvironment)
        if cfg.tools and not self.uses_tools:
            raise ConfigError(f"env.tools names tools but env.name={cfg.name!r} does not call "
                              f"tools; subclass gpurl.envs.ToolEnvironment or drop env.tools.")
        names = list(cfg.tools) or (list(self.cls.default_tools) if self.uses_tools else [])
        self.tools = load_tools(names)
        self.format = FORMATS[cfg.tool_format]

    def make(self, row: dict) -> Environment:
        metadata = {k: v for k, v in row.items() if k not in _NOT_METADATA}
        prompt = row.get("messages") or row.get("prompt")
        if self.uses_tools:
            return self.cls(prompt, tools=self.tools, tool_format=self.format, **metadata)
        return self.cls(prompt, **metadata)


def observation_text(tokenizer: Tokenizer, obs: Observation) -> str:
    """The text an observation appends: itself, or chat messages as the chat template
    renders them after an assistant turn (with the generation prompt of the next one)."""
    if obs is None or isinstance(obs, str):
        return obs or ""
    if not isinstance(obs, list) or not all(isinstance(m, dict) for m in obs):
        raise TypeError(f"an observation must be text or a list of chat messages, not {type(obs).__name__}")
    head = tokenizer.apply_chat_template(_BEFORE)
    full = tokenizer.apply_chat_template(_BEFORE + obs, add_generation_prompt=True)
    if not full.startswith(head):
        raise ConfigError("the tokenizer's chat template renders a conversation differently "
                          "when messages follow, so observations cannot be appended as chat "
                          "messages; return observation text from the environment.")
    return full[len(head):]


@dataclass
class Trajectory:
    """One row's tokens after its prompt and what its environment said."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    model: list[bool] = field(default_factory=list)  # the model's own tokens
    routes: list[np.ndarray] = field(default_factory=list)  # routing replay, per token
    rewards: list[float] = field(default_factory=list)  # one per environment step
    turns: int = 0
    error: bool = False
    final: tuple[int, int] = (0, 0)  # the last model turn's token span
    env: Environment | None = None
    versions: list[int] = field(default_factory=list)  # per token: its sampler's policy version, -1 observations
    actions: list[str] = field(default_factory=list)  # the texts its environment stepped with

    @property
    def drawn(self) -> int:
        return int(sum(self.model))

    def reward(self, cfg: EnvConfig) -> float:
        if self.error:
            return cfg.error_reward
        if not self.rewards:
            return 0.0
        return float(sum(self.rewards)) if cfg.reward == "sum" else float(self.rewards[-1])


class Episodes:
    """The trajectories of one rollout call on this process: `begin` builds their
    environments and first requests, the engine calls `resume` as each turn ends."""

    def __init__(self, factory: EnvFactory, tokenizer: Tokenizer, stop: Sequence[str],
                 max_tokens: int, turn_tokens: int, routes_shape: tuple[int, int] | None):
        self.factory, self.cfg, self.tokenizer = factory, factory.cfg, tokenizer
        self.stop, self.max_tokens, self.turn_tokens = tuple(stop), max_tokens, turn_tokens
        self.routes_shape = routes_shape
        self.trajectories: list[Trajectory] = []
        self.first: list[Request] = []
        self.row_ids: list[int] = []

    def begin(self, rows: Sequence[dict | None], row_ids: Sequence[int],
              requests: Sequence[Request]) -> list[Request]:
        """Environments of `rows` (None: a padding row, no environment) and the first
        request of each: the prompt plus the reset observation."""
        self.first, self.row_ids = list(requests), list(row_ids)
        self.trajectories = [Trajectory() for _ in requests]
        out = []
        for i, (row, req) in enumerate(zip(rows, requests)):
            traj = self.trajectories[i]
            if row is None:
                out.append(req)
                continue
            traj.env = self._guard(i, "could not be built", lambda: self.factory.make(row))
            obs = (self._guard(i, "raised in reset()", traj.env.reset)
                   if traj.env is not None else None)
            fits = traj.error or not obs or self._observe(traj, obs, i)
            if not fits and not traj.error:
                raise ConfigError(f"environment {self.factory.name!r} said more before the first "
                                  f"turn of row {self.row_ids[i]} than env.max_tokens="
                                  f"{self.max_tokens} tokens leave room for; raise env.max_tokens.")
            out.append(self._next(i) if not traj.error else req)
        return out

    def resume(self, i: int, done: Completion) -> Request | None:
        """Steps row i's environment with its finished turn; the row's next request, or
        None when its trajectory ends."""
        traj = self.trajectories[i]
        start = len(traj.tokens)
        traj.tokens += done.tokens.tolist()
        traj.logprobs += done.logprobs.tolist()
        traj.model += [True] * len(done.tokens)
        traj.versions += (done.versions.tolist() if done.versions is not None
                          else [0] * len(done.tokens))
        if self.routes_shape is not None:
            traj.routes += list(done.routes)
        traj.final = (start, len(traj.tokens))
        traj.turns += 1
        if traj.env is None or traj.error:  # padding, or an environment that failed to start
            return None
        text = truncate(self.tokenizer.decode(done.tokens), self.stop)
        traj.actions.append(text)
        step = self._guard(i, "raised in step()", lambda: _as_step(traj.env.step(text)))
        if step is None:
            return None
        traj.rewards.append(float(step.reward))
        if step.done or traj.turns >= self.cfg.max_turns:
            return None
        if step.observation and not self._observe(traj, step.observation, i):
            return None
        return self._next(i)

    def model_versions(self) -> list[int]:
        """The policy version that sampled each model token of its trajectories."""
        return [v for t in self.trajectories for v in t.versions if v >= 0]

    def oldest(self) -> int:
        """The policy version of the oldest model token of its trajectories (1 << 30: none)."""
        return min(self.model_versions(), default=1 << 30)

    def snapshot(self) -> dict:
        """The trajectories as plain data (for a checkpoint); `restore` rebuilds them."""
        return {"first": [r.state() for r in self.first], "row_ids": self.row_ids,
                "trajectories": [{**{k: getattr(t, k) for k in _SAVED},
                                  "final": list(t.final), "live": t.env is not None,
                                  "routes": [x.tolist() for x in t.routes]}
                                 for t in self.trajectories]}

    def restore(self, state: dict, rows: Sequence[dict | None]) -> None:
        """The trajectories `snapshot` gave. The environment of each trajectory still going
        is built from its row again and replayed: reset(), then step() with each text it
        was given, so an environment must act the same on the same calls (one that draws
        randomness seeds it from its row)."""
        self.first = [Request.from_state(r) for r in state["first"]]
        self.row_ids = list(state["row_ids"])
        self.trajectories = []
        for i, (data, row) in enumerate(zip(state["trajectories"], rows)):
            traj = Trajectory(**{k: data[k] for k in _SAVED}, final=tuple(data["final"]),
                              routes=[np.asarray(x, np.int16) for x in data["routes"]])
            self.trajectories.append(traj)
            if data["live"] and row is not None:
                traj.env = self.factory.make(row)
                traj.env.reset()
                for text in traj.actions:
                    traj.env.step(text)

    # ------------------------------------------------------------------ host arrays

    def arrays(self, width: int, pad_id: int) -> dict[str, np.ndarray]:
        """This process's trajectories as row arrays: tokens, logprobs, model mask (B x
        width), lengths, the last model turn (B x width, lengths), and per row the
        trajectory reward, turns and error flag."""
        b = len(self.trajectories)
        out = {"tokens": np.full((b, width), pad_id, np.int32),
               "logprobs": np.zeros((b, width), np.float32),
               "mask": np.zeros((b, width), np.float32),
               "lengths": np.zeros(b, np.int32),
               "final": np.full((b, width), pad_id, np.int32),
               "final_lengths": np.zeros(b, np.int32),
               "env": np.zeros((b, 3), np.float32)}
        if self.routes_shape is not None:
            out["routes"] = np.full((b, width, *self.routes_shape), -1, np.int16)
        for r, t in enumerate(self.trajectories):
            n = len(t.tokens)
            out["tokens"][r, :n], out["logprobs"][r, :n] = t.tokens, t.logprobs
            out["mask"][r, :n], out["lengths"][r] = t.model, n
            s, e = t.final
            out["final"][r, :e - s], out["final_lengths"][r] = t.tokens[s:e], e - s
            out["env"][r] = (t.reward(self.cfg), t.turns, float(t.error))
            if self.routes_shape is not None:
                out["routes"][r, :n] = np.stack(t.routes) if t.routes else 0
        return out

    # ------------------------------------------------------------------ internals

    def _next(self, i: int) -> Request | None:
        traj, first = self.trajectories[i], self.first[i]
        left = self.max_tokens - len(traj.tokens)
        if left <= 0:
            return None
        return dataclasses.replace(first, prompt=first.prompt + tuple(traj.tokens),
                                   max_new_tokens=min(self.turn_tokens, left), offset=traj.drawn)

    def _observe(self, traj: Trajectory, obs: Observation, i: int) -> bool:
        """Appends an observation's tokens (never trained); False when they leave no room
        for another model token (the trajectory ends without them) or are not text."""
        text = self._guard(i, "returned an observation that is not text or chat messages",
                           lambda: observation_text(self.tokenizer, obs), timed=False)
        if traj.error:
            return False
        ids = self.tokenizer.encode(text) if text else []
        if len(traj.tokens) + len(ids) >= self.max_tokens:
            return False
        traj.tokens += ids
        traj.logprobs += [0.0] * len(ids)
        traj.model += [False] * len(ids)
        traj.versions += [-1] * len(ids)
        if self.routes_shape is not None:
            traj.routes += [np.full(self.routes_shape, -1, np.int16)] * len(ids)
        return True

    def _guard(self, i: int, what: str, fn: Any, timed: bool = True) -> Any:
        """`fn()` under env.timeout_s; an error or timeout ends trajectory i with
        env.error_reward (env.on_error=end) or stops the run naming the environment and row."""
        try:
            return call_with_timeout(fn, self.cfg.timeout_s if timed else 0.0,
                                     f"env {self.factory.name}")
        except ConfigError:
            raise
        except BaseException as e:  # noqa: BLE001 - user code may raise anything
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            self.trajectories[i].error = True
            if self.cfg.on_error == "end":
                return None
            row = self.row_ids[i]
            if isinstance(e, Timeout):
                why = f"did not return within env.timeout_s={self.cfg.timeout_s:g} s"
            elif isinstance(e, ToolRaised):
                why = str(e)
            else:
                why = f"{what}: {type(e).__name__}: {e}"
            raise EnvError(f"environment {self.factory.name!r} {why} on row {row}; fix it, "
                           f"raise env.timeout_s, or set env.on_error=end to end such "
                           f"trajectories with env.error_reward.") from None


# a trajectory's fields a checkpoint keeps as they are
_SAVED = ("tokens", "logprobs", "model", "rewards", "turns", "error", "versions", "actions")


def _as_step(value: Any) -> Step:
    """A step's return value as a Step: a Step or an (observation, reward, done) triple."""
    if isinstance(value, Step):
        return value
    if isinstance(value, tuple) and len(value) == 3:
        return Step(*value)
    raise TypeError(f"step() returned {type(value).__name__}; return "
                    f"Step(observation, reward, done) or an (observation, reward, done) tuple")
