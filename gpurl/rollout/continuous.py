"""Continuous rollouts (`rollout.mode=continuous`, split placement): the rollout engine never
stops for training.

The engine runs one generation for the whole run (`Engine.stream`). Prompt groups join it
from the data's index stream so that `rollout.in_flight` batches are always queued or
decoding; each step trains the first groups whose G completions all finished
(ready-first), whatever step their prompts were drawn in. While the trainer computes step
s, the engine goes on with the weights it has; the new ones (version s + 1) enter between
two decode chunks, and the requests in flight keep their tokens and KV cache and go on
with them (PipelineRL's in-flight update), so a completion can span several policy
versions; every token records the one that sampled it.

When the weights enter: `rollout.swap_chunks=0`, at the first scheduling iteration at
which they are computed (every process agrees on that iteration, so all rollout devices
take a version together); N > 0, after exactly N iterations of each step's collection (or
when its batch is ready, if sooner): a schedule that depends on tokens alone, so a run is
bit-reproducible.

Bounded staleness (`rollout.max_lag` = L): at step s no trained token is older than
version s - L. Ready-first alone would starve long completions (short ones keep filling
the batches until the long ones' first tokens are too old), so the groups holding a token
of version s - L are due at step s: the step waits for them and trains them first
(earliest deadline first), and the rest of the batch is ready-first. A group first
sampled before a step's weight swap is a version old, so it has L steps to be trained:
`rollout.in_flight` <= L (checked) keeps the groups due at a step within one batch. Should
more be due (a request admitted late), the rest pass the bound: a request in
flight holding an older token starts over (its tokens dropped, its sampling keys from its
first token again, under the current weights), and a finished group holding one is
sampled again; the engine takes new weights at once when its own are older than the
bound. The loss corrects for the lag with the trainer's
policy at the step start as the proximal policy and truncated importance weights
min(pi_old / pi_behaviour, C) per token (`gpurl.algorithms.behaviour.behaviour_weights`),
pi_behaviour being each token's log-prob under the version that
sampled it.

Dynamic sampling (`algo.dynamic_sampling`): a step scores rounds of `per` groups as they
become ready, drops the uninformative ones (all G rewards equal) and goes on streaming
until a batch of informative groups is kept or 1 + `algo.max_refills` rounds are scored
(the batch is then filled with dropped groups, which carry no loss), as synchronous
rounds do; the groups it drops are replaced from the data's stream by the top-up.

Multi-turn environments (`env=...`): a group's G trajectories are `Episodes` of their own;
as a row's turn ends the stream calls `_resume` (on the row's host, between two decode
chunks), its environment steps and the next turn joins the stream (its trajectory so far
found in the prefix cache). A group's oldest token counts every turn's, so the bound holds
for trajectories that span versions. Checkpoints keep the trajectories and the texts their
environments were given, and a resumed run replays them (`Episodes.restore`).

Agents (`env=agent`, `gpurl.serve.agents`): a group's G agents start when the group is
drawn, and their calls join the same stream (admitted before each iteration, answered as
they finish), so an agent's trajectory spans policy versions as an environment's does;
each sampled token records its version, and the group is ready once all its agents ended.
The bound holds as above: a call in flight holding a token past it starts over (the agent
only waits longer), and an ended group holding one is played again by new agents. Which
version samples a token depends on when an agent's call arrives, so such runs are not
bit-reproducible. A checkpoint keeps the groups whose agents all ended; the groups still
playing are played again from their start by a resumed run (agents cannot be saved).
"""

from __future__ import annotations

import base64
import json
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpurl.config import RolloutConfig
from gpurl.distributed import host, runtime
from gpurl.rollout.collect import Choice, Collected, Collector
from gpurl.rollout.prompts import Prompts
from gpurl.rollout.multiturn import Episodes
from gpurl.rollout.requests import Completion, Request
from gpurl.rollout.rounds import Round, row_seeds
from gpurl.rollout.weights import PolicyWeights, corrected


@dataclass
class Group:
    """One prompt's G requests in the stream."""

    prompt: int  # index into the prompts
    seeds: np.ndarray  # G sampling seeds
    requests: list[int]  # their indices in the stream
    done: dict[int, Completion] = field(default_factory=dict)
    episodes: Episodes | None = None  # with an environment: its G trajectories
    agents: Any = None  # with agents (env=agent): their `AgentGroup`, its calls in the stream

    @property
    def ready(self) -> bool:
        if self.agents is not None:
            return self.agents.ended
        return len(self.done) == len(self.requests)

    def oldest(self, started: dict[int, int] | None = None) -> int:
        """The version of its oldest token: of its finished completions, and of its
        requests in flight given `started` (`Stream.started`); 1 << 30 when it has none."""
        done = [int(c.versions.min(initial=1 << 30)) for c in self.done.values()]
        flying = [started[i] for i in self.requests if i in started] if started else []
        earlier = [self.episodes.oldest()] if self.episodes is not None else []  # past turns
        if self.agents is not None:
            earlier.append(self.agents.oldest(started))
        return min(done + flying + earlier, default=1 << 30)

    def lags(self, step: int) -> np.ndarray:
        """How many versions each of its model tokens is behind `step`."""
        if self.episodes is not None:
            return step - np.asarray(self.episodes.model_versions(), np.int64)
        if self.agents is not None:
            return step - np.asarray(self.agents.versions(), np.int64)
        return np.concatenate([step - self.done[i].versions for i in self.requests])


class Continuous:
    """The batch source of continuous mode (`gpurl.rollout.sources.BatchSource`):
    `next(step, policy)` returns step's batch, taking `policy` (the trainer's latest
    weights, version `step`) into the engine when the schedule says."""

    off_policy = True
    streams = True

    def __init__(self, collector: Collector, weights: PolicyWeights, prompts: Prompts,
                 cfg: RolloutConfig, group: int, batch_size: int, seed: int):
        self.rounds, self.collector, self.prompts, self.cfg = collector.source, collector, prompts, cfg
        self.agents = self.rounds.agents  # env=agent: plays the groups' trajectories
        self.weights, self.group, self.seed = weights, group, seed
        self.batches_in_flight = cfg.in_flight  # the stream's pool holds these at once
        self.per = batch_size // runtime.process_count()  # groups per process and step
        self.stream = None  # made at the first step (a collective)
        self.params: Any = None  # the weights in the engine
        self.version = -1  # their policy version (-1: none yet)
        self.groups: dict[int, Group] = {}  # not yet trained, by id
        self.owner: dict[int, int] = {}  # stream request -> group id
        self.ready: list[int] = []  # group ids ready, in the order they became ready
        self.drawn_at: dict[int, int] = {}  # group id -> the data batch it was drawn in
        self._ids = 0
        self._counts: dict[str, float] = {}
        self._restored: dict | None = None  # a checkpoint's stream, rebuilt at the next step
        self._replay: list[tuple[int, np.ndarray, int]] = []  # a checkpoint's groups still playing

    def next(self, step: int, policy: Any) -> Collected:
        """The batch of step `step` (`policy`: the trainer's weights, version `step`)."""
        self.weights.start()
        got = self.collect(step, policy)
        got.computed_at = self.weights.computed_at
        return got

    def after_dispatch(self, step: int) -> float | None:
        return None  # the engine goes on at the next step's first scheduling iteration

    def describe(self, correction: str | None) -> str:
        swap = (f"after {self.cfg.swap_chunks} decode iterations of each step"
                if self.cfg.swap_chunks else "as soon as they are computed")
        return (f", continuous rollouts (new weights enter {swap}; tokens at most "
                f"{self.cfg.max_lag} versions old, {corrected(correction)})")

    def state_meta(self) -> dict[str, Any]:
        """Every process's in-flight state (`snapshot`, compressed), in process order, and
        the data position (all batches drawn)."""
        text = base64.b64encode(zlib.compress(json.dumps(self.snapshot()).encode()))
        return {"data_position": float(self.collector.position),
                "continuous": host.gather_text(text.decode())}

    def restore_meta(self, meta: dict) -> None:
        self.collector.position = int(meta.get("data_position", self.collector.position))
        if "continuous" in meta:
            text = meta["continuous"][runtime.process_index()]
            self.restore(json.loads(zlib.decompress(base64.b64decode(text))))

    def collect(self, step: int, policy: Any) -> Collected:
        """The batch of step `step`: the stream iterates until a round of groups is ready,
        taking the trainer's weights (`policy`, computed or not yet) when they are due;
        under dynamic sampling, rounds go on (up to 1 + algo.max_refills) until a batch of
        informative groups is kept, the dropped ones replaced from the stream."""
        if self.stream is None:
            self._open()
        oldest = step - self.cfg.max_lag
        self._iterations, self._sync_s = 0, 0.0
        self._restarted = self._drop_ready(oldest)
        choice, lags = Choice(), []
        for _ in range(self.collector.rounds):
            t0, sync_before = time.perf_counter(), self._sync_s
            self._fill(step, policy, oldest)
            r, lag = self._round(step, time.perf_counter() - t0 - (self._sync_s - sync_before))
            lags.append(lag)
            if self.collector.add_round(choice, r):
                break
        if self.cfg.swap_chunks and self.version < step:  # deterministic: by the batch's end
            self._sync_s += self._take(policy, step)
        return self._batch(step, choice, lags)

    def snapshot(self) -> dict:
        """The in-flight state as plain data, for a checkpoint: the stream (its decoding
        requests flushed to the queues, tokens, versions and sampling offsets kept), the
        groups with their finished completions, the ready order, the data position. The
        next step takes the trainer's weights at its first iteration, so a run resumed from
        the checkpoint (`restore`) goes on exactly as this one does."""
        self.params = None  # the weights are taken again: the resumed run must do the same
        return {"stream": None if self.stream is None else self.stream.snapshot(),
                "position": self.collector.position, "ids": self._ids, "ready": self.ready,
                "counts": self._counts,
                "groups": [[gid, g.prompt, g.seeds.tolist(), g.requests, self.drawn_at[gid],
                            [[i, _completion_state(c)] for i, c in g.done.items()],
                            None if g.episodes is None else g.episodes.snapshot(),
                            None if g.agents is None else g.agents.snapshot()]
                           for gid, g in self.groups.items()],
                "replay": [[p, s.tolist(), d] for p, s, d in self._replay]}

    def restore(self, state: dict) -> None:
        """The state `snapshot` gave (this process's); the stream is rebuilt at the next
        step (a collective)."""
        self.collector.position, self._ids = state["position"], state["ids"]
        self.ready, self._counts, self._restored = list(state["ready"]), state["counts"], state["stream"]
        self._replay = [(p, np.asarray(s, np.uint32), d) for p, s, d in state.get("replay", [])]
        for gid, prompt, seeds, requests, drawn, done, episodes, *agents in state["groups"]:
            seeds = np.asarray(seeds, np.uint32)
            if self.agents is not None:
                if agents[0] is None:  # still playing: played again from its start
                    self.ready = [x for x in self.ready if x != gid]
                    self._replay.append((prompt, seeds, drawn))
                    continue
                g = Group(prompt, seeds, [], agents=self.agents.restored(agents[0],
                                                                         self.prompts.rows[prompt]))
                self.groups[gid], self.drawn_at[gid] = g, drawn
                continue
            g = Group(prompt, seeds, list(requests),
                      {i: _completion_from(c) for i, c in done})
            if episodes is not None:
                g.episodes = self.rounds.new_episodes()
                g.episodes.restore(episodes, [self.prompts.rows[prompt]] * len(requests))
            self.groups[gid], self.drawn_at[gid] = g, drawn
            for i in g.requests:
                if i not in g.done:
                    self.owner[i] = gid

    # --------------------------------------------------------------- internals

    def _open(self) -> None:
        """The run's stream (a checkpoint's, when restored); with agents, their calls join
        it, the calls a checkpoint held are dropped and its groups still playing are
        played again."""
        resume = self._resume if self.rounds.env and self.agents is None else None
        self.stream = self.rounds.engine.stream(self.rounds.prompt_width, self._restored, resume)
        self._restored = None
        if self.agents is None:
            return
        self.agents.attach(self.stream, self.rounds.prompt_width, self.rounds.width)
        self.stream.cancel(set(self.stream.unfinished()) - set(self.owner))
        for prompt, seeds, drawn in self._replay:
            self._add(prompt, seeds, drawn)
        self._replay = []

    def _take(self, policy: Any, step: int) -> float:
        """The trainer's weights of version `step` into the engine (waiting until they are
        computed: a collective); the seconds it took."""
        t0 = time.perf_counter()
        self.params, _ = self.weights.take(policy)
        self.version = step
        return time.perf_counter() - t0

    def _top_up(self) -> None:
        """Draws batches of prompts (this process's slice) until `rollout.in_flight`
        batches of groups are queued, decoding or ready."""
        rank, g = runtime.process_index(), self.group
        while len(self.groups) + len(self._replay) < self.cfg.in_flight * self.per:
            position = self.collector.position
            idx = self.collector.indices(position)
            self.collector.position += 1
            seeds = row_seeds(self.seed, position, 0, len(idx) * g)
            mine = slice(rank * self.per, (rank + 1) * self.per)
            for j, prompt in enumerate(idx[mine]):
                at = (rank * self.per + j) * g
                self._add(int(prompt), seeds[at:at + g], position)

    def _add(self, prompt: int, seeds: np.ndarray, position: int) -> None:
        if self.agents is not None:  # its agents start; their calls join as they come
            gid, self._ids = self._ids, self._ids + 1
            self.groups[gid] = Group(prompt, seeds, [], agents=self.agents.begin(
                self.prompts.rows[prompt], seeds))
            self.drawn_at[gid] = position
            return
        requests = self.rounds.first_requests(self.prompts.tokens[prompt], seeds)
        episodes = None
        if self.rounds.env:  # the G trajectories' environments, built from the prompt's row
            episodes = self.rounds.new_episodes()
            requests = episodes.begin([self.prompts.rows[prompt]] * len(requests),
                                      [prompt] * len(requests), requests)
        gid, self._ids = self._ids, self._ids + 1
        indices = self.stream.add(requests)
        self.groups[gid] = Group(prompt, seeds, indices, episodes=episodes)
        self.drawn_at[gid] = position
        for i in indices:
            self.owner[i] = gid

    def _drop_ready(self, oldest: int) -> int:
        """Ready groups holding a token older than `oldest` are sampled again (the same
        prompt and seeds, under the current weights)."""
        stale = [gid for gid in self.ready if self.groups[gid].oldest() < oldest]
        for gid in stale:
            self.ready.remove(gid)
            g = self.groups.pop(gid)
            if g.agents is not None:
                self.agents.end(g.agents)
            self._add(g.prompt, g.seeds, self.drawn_at.pop(gid))
        return len(stale) * self.group

    def _due(self, step: int) -> list[int]:
        """The groups step `step` must train, at most a batch: those holding a token of
        version step - max_lag, which step + 1 could not (oldest first). A step waits for
        them rather than starting them over, so a long completion is trained late but is
        not starved by the short ones finishing first (rollout.in_flight <= max_lag keeps
        the groups due at a step within one batch)."""
        started = self.stream.started()
        due = sorted((g.oldest(started), gid) for gid, g in self.groups.items())
        return [gid for oldest, gid in due if oldest <= step - self.cfg.max_lag][:self.per]

    def _can_batch(self, step: int) -> bool:
        """A batch is ready: `per` groups ready, the ones due among them."""
        return len(self.ready) >= self.per and all(self.groups[g].ready for g in self._due(step))

    def _fill(self, step: int, policy: Any, oldest: int) -> None:
        """Iterates the stream until every process has a round of groups ready, taking the
        trainer's weights when they are due."""
        while True:
            self._top_up()
            self._restarted += self.stream.drop_stale(oldest)
            due = self.version < step and (self.params is None or self.version < oldest or (
                self.cfg.swap_chunks and self._iterations >= self.cfg.swap_chunks))
            enough, computed = host.gather([self._can_batch(step),
                                            self.weights.computed(policy)]).min(axis=0)
            if self.version < step and (due or (not self.cfg.swap_chunks and computed)):
                self._sync_s += self._take(policy, step)
                continue
            if enough:
                return
            if self.agents is not None:
                self.agents.admit()
            busy = self.stream.iterate(self.params, self.version)
            self._iterations += busy  # an idle one (agents between calls) takes no turn
            for index, completion in self.stream.finished():
                if self.agents is not None and self.agents.deliver(index, completion):
                    continue
                gid = self.owner.pop(index)
                self.groups[gid].done[index] = completion
                if self.groups[gid].ready:
                    self.ready.append(gid)
            if self.agents is not None:
                self.agents.served(busy)
                self.ready += [gid for gid, g in self.groups.items()
                               if gid not in self.ready and self.agents.ended(g.agents)]
            self._restarted += self._drop_ready(oldest)

    def _round(self, step: int, rollout_s: float) -> tuple[Round, np.ndarray]:
        """A round of this process's `per` groups (the due ones first, then ready-first),
        scored; and each group's token lags behind `step` (sum, count, max), per x 3."""
        due = self._due(step)
        taken = due + [gid for gid in self.ready if gid not in due][:self.per - len(due)]
        self.ready = [gid for gid in self.ready if gid not in taken]
        groups = [self.groups.pop(gid) for gid in taken]
        for gid in taken:
            self.drawn_at.pop(gid)
        done = [g.done[i] for g in groups for i in g.requests]
        counts = {k: v - self._counts.get(k, 0.0) for k, v in self.stream.stats.items()}
        self._counts = dict(self.stream.stats)
        if self.agents is not None:
            for g in groups:
                self.agents.end(g.agents)
            r = self.rounds.score_agents(self.prompts, [g.prompt for g in groups],
                                         [g.agents for g in groups], self.group, rollout_s, counts)
        else:
            r = self.rounds.score(self.prompts, [g.prompt for g in groups], done, self.group,
                                  rollout_s, counts, [g.episodes for g in groups if g.episodes])
        lags = [g.lags(step) for g in groups]
        return r, np.asarray([(x.sum(), x.size, x.max(initial=0)) for x in lags], np.int64)

    def _resume(self, index: int, done: Completion) -> Request | None:
        """A multi-turn row's turn ended (called by the stream, on this row's host): its
        environment steps, and its next turn's request, or None when it ends."""
        g = self.groups[self.owner[index]]
        return g.episodes.resume(index - g.requests[0], done)

    def _batch(self, step: int, choice: Choice, lags: list[np.ndarray]) -> Collected:
        """The batch of the step's rounds; the lag figures of the groups it trains."""
        groups, num_kept = choice.groups(self.collector.batch_size)
        rank = runtime.process_index()
        mine = np.asarray([lags[rnd][g - rank * self.per] for rnd, g in groups[:num_kept]
                           if g // self.per == rank], np.int64).reshape(-1, 3)
        total, tokens, most, restarted = host.gather(
            [mine[:, 0].sum(), mine[:, 1].sum(), mine[:, 2].max(initial=0), self._restarted]).T
        got = self.collector.batch(choice.rounds, choice.rewards, groups, num_kept,
                                   float(total.sum() / max(tokens.sum(), 1)))
        got.metrics.update({"off_policy/lag_max": float(most.max()),
                            "rollout/restarted": float(restarted.sum()),
                            "time/sync_s": self._sync_s, "rollout/version": float(self.version)})
        return got


def _completion_state(c: Completion) -> dict:
    return {"tokens": c.tokens.tolist(), "logprobs": c.logprobs.tolist(), "stopped": c.stopped,
            "versions": c.versions.tolist(),
            "routes": None if c.routes is None else c.routes.tolist()}


def _completion_from(data: dict) -> Completion:
    return Completion(np.asarray(data["tokens"], np.int32), np.asarray(data["logprobs"], np.float32),
                      data["stopped"], None if data["routes"] is None
                      else np.asarray(data["routes"], np.int16),
                      np.asarray(data["versions"], np.int32))
