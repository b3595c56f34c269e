"""Agents as rollouts (`env=agent`): agent code written against the OpenAI API plays each
trajectory through a gateway on 127.0.0.1, and its calls are sampled by the run's rollout
engine, token-exact (`gpurl.serve.sessions`, `gpurl.serve.chat`).

Per round, on each process, for each trajectory of the rows it holds: a session (its own
URL `.../s/<id>/v1` and key: a call with another session's id or key is refused) and the
agent, started on a thread of its own with an `openai.AsyncOpenAI` client on that session
(`env.agent`), or as a program with the session in its environment (`env.agent_command`).
Meanwhile this process's thread runs the engine: the calls that arrived join the running
batch each scheduling iteration, every process iterating together until no process has an
agent left. An agent that raises, hangs past `env.agent_timeout_s`, makes more than
`env.agent_max_calls` calls, prints no reward or sends what the server refuses ends its own
trajectory with `env.error_reward` and a counted reason, never the run.

The rows: a trajectory takes `env.agent_rows` rows of the batch (its first row and its
forks; unused rows empty), each prompt's rows after one another, every row carrying the
trajectory's reward. The group's advantages are computed over its trajectories (each
counted once, `gpurl.algorithms.policy_gradient.group_advantages`), and every row of a
trajectory trains with its trajectory's advantage. Every row's prompt part is the longest
prefix all the group's rows share (at most the data prompts' width); the rest of a row
(context the agent sent, observations, the model's tokens) is its completion part, the
model's tokens trained and the rest masked.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from gpurl.config import ConfigError, EnvConfig, RolloutConfig
from gpurl.distributed import host
from gpurl.models.spec import Params
from gpurl.models.tokenizer import Tokenizer
from gpurl.rollout.collect import AGENT_COUNTS as COUNTS
from gpurl.rollout.engine import Engine, Stream
from gpurl.rollout.prompts import Prompts
from gpurl.rollout.requests import Completion
from gpurl.serve.api import Defaults, Gateway, SessionState
from gpurl.serve.app import Server, build_app
from gpurl.serve.driver import Driver
from gpurl.serve.sessions import Session, common_prefix
from gpurl.user_code import import_object



@dataclass
class Outcome:
    """How one agent ended: its reward, or why it failed (`kind`: raised, timeout, limit
    (a call past a cap, or one the server refused), reward (none, or not a number))."""

    reward: float = 0.0
    failure: str | None = None
    kind: str = "ok"
    info: dict[str, float] = field(default_factory=dict)  # a returned dict's other numbers


@dataclass
class Trajectory:
    state: SessionState
    row: dict
    outcome: Outcome | None = None
    thread: threading.Thread | None = None
    process: subprocess.Popen | None = None
    started: float = field(default_factory=time.monotonic)
    url: str = ""  # its session's base URL
    sid: str = ""  # its session's id on the gateway


@dataclass
class AgentGroup:
    """One prompt's trajectories in continuous mode (`AgentRunner.begin`)."""

    trajectories: list[Trajectory]
    driver: Driver  # whose stream holds their calls

    @property
    def ended(self) -> bool:
        return all(t.outcome is not None for t in self.trajectories)

    def versions(self) -> list[int]:
        """The policy version of every model token of its trajectories."""
        return [v for t in self.trajectories for v in t.state.session.versions()]

    def oldest(self, started: dict[int, int] | None) -> int:
        """The version of its oldest token, counting its calls in flight (`started`: the
        stream's first-token versions); 1 << 30 when it has none."""
        flying = self.driver.flying({t.state.key for t in self.trajectories}) if started else []
        return min([*self.versions(), *(started[i] for i in flying if i in started)],
                   default=1 << 30)

    def snapshot(self) -> list[dict] | None:
        """Its ended trajectories as plain data (a checkpoint's); None while agents still
        play (a resumed run plays the group again from its start)."""
        if not self.ended:
            return None
        return [{"session": t.state.session.state(), "outcome": asdict(t.outcome)}
                for t in self.trajectories]


def check_agent(cfg: EnvConfig) -> str:
    """The agent a start would run, imported (a function) or named (a program)."""
    if cfg.agent_command is not None:
        return f"program {cfg.agent_command!r}"
    solve = import_object(cfg.agent, f"env.agent={cfg.agent!r}", "an agent")
    if not asyncio.iscoroutinefunction(solve):
        raise ConfigError(f"env.agent={cfg.agent!r} is not an async function; define it as "
                          f"`async def solve(client, row)`.")
    _openai()  # the agent's client: the package must be there before the run starts
    return cfg.agent


# The longest an engine iteration waits for agents still between calls: a quarter of the
# last iteration's time (a second wave of the turn's calls would cost a whole iteration and
# a prefill of its own), at most 1 s.
GATHER_FRACTION, GATHER_MAX_S = 0.25, 1.0


class Pace:
    """The gather window (`_gather`): a share of the last busy iteration's time. An idle
    iteration (every agent between calls) costs nothing and does not count: counting it
    shrank the window to nothing exactly when a turn's calls were arriving."""

    def __init__(self) -> None:
        self.last = 0.0  # seconds of the last iteration that prefilled or decoded

    def window(self) -> float:
        return min(GATHER_FRACTION * self.last, GATHER_MAX_S)

    def took(self, seconds: float, busy: bool) -> None:
        if busy:
            self.last = seconds


def _gather(driver: Driver, running: int, window: float) -> None:
    """Waits up to `window` seconds while new calls are queued and some of the `running`
    agents have not yet sent their next one: the queued calls then join the engine with
    theirs, in one iteration."""
    deadline = time.monotonic() + window
    while driver.queued() and running - driver.pending() > 0:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        driver.wait(remaining)


class AgentRunner:
    """The agents of a run on this process: `run` plays one round's trajectories through
    the gateway and returns their rows (`Episodes.arrays`' layout plus the prompts)."""

    def __init__(self, cfg: EnvConfig, engine: Engine, tokenizer: Tokenizer,
                 stop_ids: Sequence[int], rollout: RolloutConfig):
        self.cfg, self.engine, self.tokenizer = cfg, engine, tokenizer
        check_agent(cfg)
        self.solve = (import_object(cfg.agent, "env.agent", "an agent")
                      if cfg.agent is not None else None)
        defaults = Defaults(rollout.temperature, rollout.top_p, rollout.top_k,
                            rollout.max_new_tokens, 0)
        stops = tuple(rollout.stop) + tuple(cfg.stop)
        # every session names the stream its calls join: a round's own (`run`), or in
        # continuous mode the run's (`continuous`, `attach`)
        self.gateway = Gateway(Driver(engine), tokenizer, stop_ids, "gpurl-policy", defaults,
                               stops, cfg.tool_format, sessions={})
        self.continuous = Driver(engine)
        self.server: Server | None = None
        self.temperature = rollout.temperature
        self.width = cfg.max_tokens  # a trajectory row's tokens after its context, at most
        self.last: dict[str, float] = {}  # the last round's counts on this process
        # the numbers the last rows' agents returned beside their rewards: key -> [sum, count]
        self.info: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ one round

    def run(self, params: Params, prompts: Prompts, ids: np.ndarray, seeds: np.ndarray,
            per_prompt_rows: int, prompt_width: int, width: int,
            temperature: float | None) -> dict[str, np.ndarray]:
        """The rows of this process's trajectories: `ids` (each local row's prompt index,
        -1 padding) and `seeds` per row, `per_prompt_rows` rows per prompt; each trajectory
        takes env.agent_rows consecutive rows. Every process calls this together."""
        if self.server is None:
            self.server = Server(build_app(self.gateway, None, self._refused)).start()
        rows_per = self.cfg.agent_rows
        # a round's own stream: a continuous run's (`attach`) goes on beside an evaluation's
        driver = Driver(self.engine, prompt_width)
        temperature = self.temperature if temperature is None else temperature
        trajectories = [self._session(prompts.rows[ids[t]], int(seeds[t]), width, driver,
                                      temperature)
                        if ids[t] >= 0 else None for t in range(0, len(ids), rows_per)]
        played = [t for t in trajectories if t is not None]
        for t in played:
            self._start(t)
        try:
            self._drive(params, played, driver)
        finally:
            driver.close()
            for t in played:
                self.gateway.sessions.pop(t.sid, None)
        self._report(played)
        return self._arrays(trajectories, prompts, ids, per_prompt_rows, prompt_width, width)

    def _session(self, row: dict, seed: int, width: int, driver: Driver,
                 temperature: float) -> Trajectory:
        """A trajectory's session on the gateway (its id and key new; its calls join
        `driver`'s stream), not yet started."""
        sid, key = secrets.token_hex(8), f"gpurl-{secrets.token_urlsafe(24)}"
        state = SessionState(key, Session(self.cfg.agent_rows), seed, self.cfg.agent_max_calls,
                             width, time.monotonic() + self.cfg.agent_timeout_s,
                             driver=driver, temperature=temperature)
        self.gateway.sessions[sid] = state  # before its agent starts calling
        return Trajectory(state, row, url=f"{self.server.url.rsplit('/v1', 1)[0]}/s/{sid}/v1",
                          sid=sid)

    def close(self) -> None:
        """Stops the gateway (its port is free again). An agent still blocking its own
        thread keeps that thread until it returns: Python cannot stop a thread, but its
        trajectory has ended and the gateway serves it nothing more."""
        if self.server is not None:
            self.continuous.cancel()  # every call still waiting is answered first
            self.server.stop()
            self.server = None

    @staticmethod
    def _report(played: list[Trajectory]) -> None:
        """One line on this process's trajectories that ended early, if any."""
        failed = [t.outcome for t in played if t.outcome is not None and t.outcome.failure]
        if not failed:
            return
        kinds = Counter(o.kind for o in failed)
        print(f"[gpurl] agents: {len(failed)} of {len(played)} trajectories ended early with "
              f"env.error_reward ({', '.join(f'{k} {n}' for k, n in sorted(kinds.items()))}); "
              f"the first: {failed[0].failure}", file=sys.stderr, flush=True)

    def _drive(self, params: Params, live: list[Trajectory], driver: Driver) -> None:
        """The engine's loop until no process has an agent left running. Calls that arrive
        while other agents are still between calls (reading a reply, running a tool) are
        gathered for a moment (`_gather`), so that a turn's calls join the engine together
        rather than in waves that each decode alone."""
        pace = Pace()
        while True:
            for t in live:
                if t.outcome is None:
                    self._poll(t)
            running = sum(t.outcome is None for t in live)
            left = running + driver.pending()
            if not host.any_process(left > 0):
                return
            _gather(driver, running, pace.window())
            start = time.perf_counter()
            busy = driver.step(params)
            pace.took(time.perf_counter() - start, busy)
            if not busy and left:
                driver.wait(0.002)

    # ------------------------------------------------------------------ continuous mode
    # (`gpurl.rollout.continuous`): the run's stream, iterated by its batch source, takes
    # the agents' calls; each prompt group's trajectories start when the group is drawn
    # and are trained once all of them ended.

    def attach(self, stream: Stream, prompt_width: int, width: int) -> None:
        """The agents' calls join `stream` (the run's); a trajectory row holds at most
        `width` tokens after the context it started from."""
        if self.server is None:
            self.server = Server(build_app(self.gateway, None, self._refused)).start()
        self.continuous.prefill_width, self.continuous.stream = prompt_width, stream
        self.width = width

    def begin(self, row: dict, seeds: np.ndarray) -> AgentGroup:
        """A prompt's trajectories started, one per env.agent_rows of its rows' `seeds`."""
        group = AgentGroup([self._session(row, int(s), self.width, self.continuous,
                                          self.temperature)
                            for s in seeds[::self.cfg.agent_rows]], self.continuous)
        for t in group.trajectories:
            self._start(t)
        return group

    def admit(self) -> None:
        """The calls that arrived join the stream (before an iteration)."""
        self.continuous.admit()

    def deliver(self, index: int, completion: Completion) -> bool:
        """A finished request: an agent call's (answered), or not an agent's (False)."""
        return self.continuous.deliver(index, completion)

    def served(self, busy: bool) -> None:
        """After an iteration: streaming calls get their new tokens; an idle engine waits
        a moment for the agents' next calls."""
        self.continuous.streamed()
        if not busy:
            self.continuous.wait(0.002)

    def ended(self, group: AgentGroup) -> bool:
        """Whether every trajectory of `group` ended (those past their time end now)."""
        for t in group.trajectories:
            if t.outcome is None:
                self._poll(t)
                if t.outcome is not None and t.outcome.kind == "timeout":
                    self.continuous.cancel({t.state.key})
        return group.ended

    def end(self, group: AgentGroup) -> None:
        """`group`'s sessions leave the gateway (trained, or to be played again): their
        calls are refused, those in the engine dropped, its programs killed."""
        self.continuous.cancel({t.state.key for t in group.trajectories})
        for t in group.trajectories:
            self.gateway.sessions.pop(t.sid, None)
            if t.outcome is None:
                t.state.failure = "played again"
                if t.process is not None:
                    _kill(t.process)

    def report(self, groups: Sequence[AgentGroup]) -> None:
        """The line on trajectories that ended early, of groups a step trains."""
        self._report([t for g in groups for t in g.trajectories])

    def arrays(self, groups: Sequence[AgentGroup], prompts: Prompts, indices: Sequence[int],
               per_prompt_rows: int, prompt_width: int, width: int) -> dict[str, np.ndarray]:
        """`run`'s rows of `groups` (of prompts `indices`), one group after another."""
        trajectories: list[Trajectory | None] = [t for g in groups for t in g.trajectories]
        ids = np.repeat(np.asarray(indices), per_prompt_rows)
        return self._arrays(trajectories, prompts, ids, per_prompt_rows, prompt_width, width)

    def restored(self, state: list[dict], row: dict) -> AgentGroup:
        """An ended group from its `AgentGroup.snapshot`."""
        trajectories = []
        for data in state:
            session = SessionState("", Session.from_state(data["session"]), 0, 0, self.width, 0.0)
            trajectories.append(Trajectory(session, row, Outcome(**data["outcome"])))
        return AgentGroup(trajectories, self.continuous)

    # ------------------------------------------------------------------ agents

    def _start(self, t: Trajectory) -> None:
        url = t.url
        t.started = time.monotonic()
        if self.solve is not None:
            t.thread = threading.Thread(target=self._play, args=(t, url), daemon=True,
                                        name="gpurl-agent")
            t.thread.start()
            return
        env = {**os.environ, "OPENAI_BASE_URL": url, "OPENAI_API_KEY": t.state.key,
               "GPURL_ROW": json.dumps(t.row, default=str)}
        try:
            t.process = subprocess.Popen(self.cfg.agent_command, shell=True, env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True,
                                         start_new_session=True)
            threading.Thread(target=self._feed, args=(t,), daemon=True).start()
        except OSError as e:
            t.outcome = Outcome(failure=f"could not start ({e})", kind="raised")

    @staticmethod
    def _feed(t: Trajectory) -> None:
        try:
            t.process.stdin.write(json.dumps(t.row, default=str) + "\n")
            t.process.stdin.close()
        except (OSError, ValueError):
            pass  # the program closed its input: it reads the row from GPURL_ROW

    def _play(self, t: Trajectory, url: str) -> None:
        """An agent function on this thread's own event loop (a blocking agent blocks only
        itself)."""
        openai = _openai()

        async def play() -> Any:
            client = openai.AsyncOpenAI(base_url=url, api_key=t.state.key, max_retries=0,
                                        timeout=self.cfg.agent_timeout_s)
            try:
                return await self.solve(client, dict(t.row))
            finally:
                await client.close()

        try:
            t.outcome = self._scored(asyncio.run(play()), t)
        except BaseException as e:  # noqa: BLE001 - user code may raise anything
            refused = t.state.failure
            t.outcome = t.outcome or (Outcome(failure=refused, kind="limit") if refused else Outcome(
                failure=f"raised {type(e).__name__}: {e}"[:300], kind="raised"))

    def _poll(self, t: Trajectory) -> None:
        """Ends a trajectory past its time; collects a finished program's reward."""
        if time.monotonic() > t.state.deadline + 1.0:
            t.outcome = Outcome(failure=f"ran past env.agent_timeout_s="
                                        f"{self.cfg.agent_timeout_s:g} s", kind="timeout")
            t.state.failure = t.outcome.failure
            if t.process is not None:
                _kill(t.process)
            return
        if t.process is not None and t.process.poll() is not None:
            out = t.process.stdout.read() if t.process.stdout else ""
            lines = [ln for ln in out.strip().splitlines() if ln.strip()]
            if t.process.returncode != 0:
                t.outcome = Outcome(failure=f"exited with status {t.process.returncode}",
                                    kind="raised")
            elif not lines:
                t.outcome = Outcome(failure="printed no reward", kind="reward")
            else:
                try:
                    value = json.loads(lines[-1])
                except json.JSONDecodeError:
                    t.outcome = Outcome(failure=f"printed no reward (last line {lines[-1][:80]!r})",
                                        kind="reward")
                    return
                t.outcome = self._scored(value, t)

    @staticmethod
    def _scored(value: Any, t: Trajectory) -> Outcome:
        """An agent's return value as its outcome: a number, or a dict with "reward"."""
        if t.state.failure is not None:  # refused by the server meanwhile (a limit)
            return Outcome(failure=t.state.failure, kind="limit")
        reward = value.get("reward") if isinstance(value, dict) else value
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not np.isfinite(reward):
            return Outcome(failure=f"returned {type(value).__name__} {str(value)[:80]!r}, not "
                                   f"a finite reward (a number, or a dict with \"reward\")",
                           kind="reward")
        info = ({k: float(v) for k, v in value.items() if k != "reward" and isinstance(v, (int, float))
                 and not isinstance(v, bool) and np.isfinite(v)} if isinstance(value, dict) else {})
        return Outcome(reward=float(reward), info=info)

    def _refused(self, state: SessionState, reason: str) -> None:
        """A session's refused call: past a limit, its trajectory has ended."""
        if "trajectory" in reason and state.failure is None:
            state.failure = reason

    # ------------------------------------------------------------------ rows

    def _arrays(self, trajectories: list[Trajectory | None], prompts: Prompts, ids: np.ndarray,
                per_prompt_rows: int, prompt_width: int, width: int) -> dict[str, np.ndarray]:
        """`Episodes.arrays`' layout (and each row's prompt part) of the round's rows."""
        rows_per, b, pad = self.cfg.agent_rows, len(ids), self.engine.pad_id
        out = {"tokens": np.full((b, width), pad, np.int32),
               "logprobs": np.zeros((b, width), np.float32),
               "mask": np.zeros((b, width), np.float32), "lengths": np.zeros(b, np.int32),
               "final": np.full((b, width), pad, np.int32), "final_lengths": np.zeros(b, np.int32),
               "env": np.zeros((b, 3), np.float32),
               "prompt_tokens": np.full((b, prompt_width), pad, np.int32),
               "prompt_lengths": np.ones(b, np.int32),
               "counts": np.zeros((b, len(COUNTS)), np.float32)}
        for start in range(0, b, per_prompt_rows):  # one prompt's group at a time
            group = trajectories[start // rows_per:(start + per_prompt_rows) // rows_per]
            self._group(out, start, group, prompts, ids[start], prompt_width, width)
        self.last = {k: float(out["counts"][:, i].sum()) for i, k in enumerate(COUNTS)}
        self.info = _info([t.outcome for t in trajectories if t is not None and t.outcome])
        return out

    def _group(self, out: dict, start: int, group: list[Trajectory | None], prompts: Prompts,
               index: int, prompt_width: int, width: int) -> None:
        rows_per = self.cfg.agent_rows
        contexts = [r.tokens[:r.context] for t in group if t is not None for r in t.state.session.rows]
        fallback = prompts.tokens[index] if index >= 0 else [self.engine.pad_id]
        prefix = (contexts[0][:min(common_prefix(contexts), prompt_width)] if contexts
                  else fallback[:prompt_width])
        prefix = prefix or fallback[:1]
        for j, t in enumerate(group):
            first = start + j * rows_per
            out["prompt_tokens"][first:first + rows_per, :len(prefix)] = prefix
            out["prompt_lengths"][first:first + rows_per] = len(prefix)
            if t is None:
                continue
            outcome = t.outcome or Outcome(failure="did not finish", kind="timeout")
            failed = outcome.failure is not None
            session = t.state.session
            reward = self.cfg.error_reward if failed else outcome.reward
            out["env"][first:first + rows_per] = (reward, session.calls, float(failed))
            truncated = 0
            final = _final_turn(session)
            for f in range(rows_per):
                r = first + f
                n = min(len(final), width)
                out["final"][r, :n], out["final_lengths"][r] = final[:n], n
            for f, row in enumerate(session.rows):
                r = first + f
                if row.tokens[:len(prefix)] != list(prefix):  # a row that does not start alike
                    continue
                rest = slice(len(prefix), None)
                tokens, sampled = row.tokens[rest], row.sampled[rest]
                if len(tokens) > width:
                    truncated += 1
                n = min(len(tokens), width)
                out["tokens"][r, :n], out["lengths"][r] = tokens[:n], n
                out["logprobs"][r, :n] = row.logprobs[rest][:n]
                out["mask"][r, :n] = sampled[:n]
            kinds = [float(outcome.kind == k) for k in ("raised", "timeout", "limit", "reward")]
            out["counts"][first] = (float(failed), *kinds, session.calls, session.forks,
                                    session.dropped, truncated)


def _info(outcomes: Sequence[Outcome]) -> dict[str, list[float]]:
    """Each number agents returned beside their rewards: [sum, how many returned it]."""
    out: dict[str, list[float]] = {}
    for o in outcomes:
        for k, v in o.info.items():
            total = out.setdefault(k, [0.0, 0.0])
            total[0] += v
            total[1] += 1
    return out


def _final_turn(session: Session) -> list[int]:
    """The last run of sampled tokens of the trajectory (what the reward functions score)."""
    if not session.rows:
        return []
    row = session.rows[-1]
    end = len(row.sampled)
    while end and not row.sampled[end - 1]:
        end -= 1
    start = end
    while start and row.sampled[start - 1]:
        start -= 1
    return row.tokens[start:end]


def _kill(process: subprocess.Popen) -> None:
    """The program and every process it started."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise ConfigError("env.agent needs the openai package for its client; install it with "
                          "`pip install openai`.") from None
    return openai
