"""Sampling and per-shard scoring of prompts, for training and for evaluation.

Every process generates the rows of its slice of the prompts (`engine.Engine`: continuous
batching over decode slots), its devices score their own shards (`ShardedScorer`:
shard_map + io_callback), and the scores stay on device, sharded like the rows: nothing
here iterates an array the process cannot address. Only evaluation brings scores to the
host, to count correct answers.

A round's completions are on this process's host when the engine returns them; they stay
there (`Round.local`) until the trainer's batch is assembled, which puts them on the
trainer's devices: the tokens cross to a device once. Scoring needs only the row ids on
the devices (each shard's callback reads its rows' tokens from its host), and the rollout
mesh receives only the lengths (reward shaping and statistics) and, multi-turn, the
masks and the environment's figures.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from gpurl.config import ConfigError, EnvConfig, MeshConfig, RolloutConfig
from gpurl.distributed import host, runtime
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models.spec import ModelSpec, Params
from gpurl.models.tokenizer import Tokenizer
from gpurl.rewards import Reward
from gpurl.rollout.decode import stop_token_ids
from gpurl.rollout.engine import Engine
from gpurl.rollout.programs import Rollout
from gpurl.rollout.requests import Completion, Request
from gpurl.rollout.multiturn import EnvFactory, Episodes
from gpurl.rollout.prompts import Prompts, request_images
from gpurl.rollout.scoring import CUT, RowContext, ShardedScorer

# A completion counts as correct when the first reward function gives it at least this.
CORRECT = 1.0 - 1e-6


class Agents(Protocol):
    """What plays the trajectories when agents do (`gpurl.serve.agents.AgentRunner`):
    `run` plays a round and returns its rows as `Episodes.arrays` lays them out, plus
    "prompt_tokens", "prompt_lengths" and "counts" (per row, the trajectory's counts on
    its first row); `close` stops what serves them, and `info` holds the numbers the
    agents of the last rows returned beside their rewards (key -> [sum, count]). Continuous mode
    (`gpurl.rollout.continuous`) plays prompt groups in the run's stream instead: `attach`
    it, `begin` a group, and around each iteration `admit` the calls that arrived, offer
    each finished request (`deliver`), then `served`; `ended` says when a group's agents
    all ended, `end` takes its sessions off the gateway, and `arrays` gives the rows of
    groups (`restored`: an ended group from a checkpoint)."""

    info: dict[str, list[float]]

    def run(self, params: Params, prompts: Prompts, ids: np.ndarray, seeds: np.ndarray,
            per_prompt_rows: int, prompt_width: int, width: int,
            temperature: float | None) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...

    def attach(self, stream: Any, prompt_width: int, width: int) -> None: ...

    def begin(self, row: dict, seeds: np.ndarray) -> Any: ...

    def admit(self) -> None: ...

    def deliver(self, index: int, completion: Completion) -> bool: ...

    def served(self, busy: bool) -> None: ...

    def ended(self, group: Any) -> bool: ...

    def end(self, group: Any) -> None: ...

    def report(self, groups: Sequence[Any]) -> None: ...

    def arrays(self, groups: Sequence[Any], prompts: Prompts, indices: Sequence[int],
               per_prompt_rows: int, prompt_width: int, width: int) -> dict[str, np.ndarray]: ...

    def restored(self, state: list[dict], row: dict) -> Any: ...


def row_seeds(seed: int, step: int, rnd: int, rows: int) -> np.ndarray:
    """Sampling seed of every global row of rollout round `rnd` of step `step`: the same in
    every process and on every resume."""
    return np.random.SeedSequence([seed, step, rnd]).generate_state(rows, np.uint32)


@dataclass
class Round:
    """One rollout round: completions of G samples per prompt, and their scores. Device
    arrays are in device-row order (each process's rows, padding last) and sharded over
    the rollout mesh (`sharding`); `local` holds this process's rows on the host."""

    # this process's rows (B_local, device-row order): "tokens" x N, "lengths", "logprobs"
    # x N, "prompt_tokens" x W, "prompt_lengths"; routing replay "routes" x N x L x k;
    # multi-turn "mask" x N (1 on the model's tokens)
    local: dict[str, np.ndarray]
    lengths: jax.Array  # B: completion lengths
    # B x (2 + functions): weighted total, each function's score, failed (`ShardedScorer`);
    # with an environment its trajectory reward is column 1 and in the total
    scores: jax.Array
    functions: jax.Array  # B: the reward functions' weighted total alone (no environment)
    row_ids: jax.Array  # B: the global row of each device row; -1 marks padding
    positions: np.ndarray  # host, one per global row r: its device row
    rollout_s: float
    reward_s: float
    counts: dict[str, float]  # the rollout engine's counts (`Engine.stats`)
    sharding: NamedSharding  # the rollout rows
    env: jax.Array | None = None  # B x 3 with an environment: trajectory reward, turns, error
    mask: jax.Array | None = None  # B x N with an environment: 1 on the model's tokens
    # B x len(AGENT_COUNTS) with agents (env=agent): each trajectory's counts on its first row
    agent: jax.Array | None = None
    # with agents: the numbers they returned beside their rewards, key -> [sum, count]
    agent_info: dict[str, list[float]] | None = None

    @functools.cached_property
    def rollout(self) -> Rollout:
        """The completions on the rollout mesh, put there when first asked for (the
        trainer's batch takes them from the host instead)."""
        put = functools.partial(host.to_device, sharding=self.sharding)
        routes = self.local.get("routes")
        return Rollout(put(self.local["tokens"]), self.lengths, put(self.local["logprobs"]),
                       None if routes is None else put(routes), self.mask)


def stop_strings(rollout: RolloutConfig, env: EnvConfig | None) -> tuple[str, ...]:
    """What ends a completion: rollout.stop, and an environment's turn ends."""
    return tuple(rollout.stop) + (tuple(env.stop) if env is not None and env.on else ())


def rollout_engine(spec: ModelSpec, tokenizer: Tokenizer, rollout: RolloutConfig,
                   mesh: MeshConfig, devices: Sequence[jax.Device] | None = None,
                   env: EnvConfig | None = None) -> Engine:
    """The rollout engine on the rollout mesh (`devices`: split placement's), stopping at
    EOS (unless rollout.ignore_eos) and the tokens of `stop_strings`."""
    stop = stop_strings(rollout, env)
    return Engine(spec, rollout, rollout_mesh(mesh, devices), mesh.sample_rules,
                  stop_ids=stop_token_ids(tokenizer, stop, not rollout.ignore_eos),
                  pad_id=tokenizer.pad_id)


def check_rows(prompts: int, group: int, count: int, shards: int) -> None:
    """`prompts` x `group` rows split evenly over `count` processes and `shards` rollout
    data shards, or one sentence naming train.batch_size."""
    rows = prompts * group
    if prompts % count or rows % max(shards, 1):
        raise ConfigError(
            f"train.batch_size={prompts} prompts x algo.num_generations={group} = {rows} "
            f"rows must split evenly over {count} processes and {shards} rollout data "
            f"shards; change train.batch_size.")


class Rounds:
    """Samples `group` completions per prompt with `engine` and scores them. With an
    environment (`env.name`) a completion is a multi-turn trajectory (`multiturn`): its
    model turns and the environment's observations, `env.max_tokens` wide; its reward is
    the environment's plus the reward functions' score of the last model turn."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer, rewards: Sequence[Reward],
                 prompt_width: int, env: EnvConfig | None = None, agents: Agents | None = None):
        self.engine, self.tokenizer, self.rewards = engine, tokenizer, list(rewards)
        self.prompt_width = prompt_width
        self.env = env if env is not None and env.on else None
        self.stop = stop_strings(engine.cfg, self.env)
        # env=agent: agent code plays the trajectories through a gateway (given by the
        # caller: `gpurl.serve.agents.AgentRunner`); else an environment per trajectory
        self.agents = agents
        self.factory = EnvFactory(self.env) if self.env and agents is None else None
        self.scorer = ShardedScorer(engine.mesh, self.rewards, tokenizer, self.stop)
        # completion width: a trajectory's tokens after the prompt, or one completion's
        self.width = self.env.max_tokens if self.env else engine.cfg.max_new_tokens
        self.episodes: Episodes | None = None  # the last round's trajectories
        self._with_env = jax.jit(_with_env)

    @property
    def score_names(self) -> list[str]:
        """Names of the score columns after the total: the environment's, the functions'."""
        return (["env"] if self.env else []) + [r.name for r in self.rewards]

    @property
    def plan_width(self) -> int:
        """The longest prompt a request can have: with an environment, a resumed turn's
        prompt holds the trajectory so far."""
        return self.prompt_width + (self.width if self.env else 0)

    def close(self) -> None:
        """Stops the agents' gateway, if any (`gpurl.serve.agents.AgentRunner.close`)."""
        if self.agents is not None:
            self.agents.close()

    def check_rows(self, prompts: int, group: int) -> None:
        """A step's `prompts` x `group` rows split evenly over the processes and the
        rollout's data shards (`check_rows`)."""
        check_rows(prompts, group, runtime.process_count(), self.engine.mesh.shape["data"])

    def padded_rows(self, rows: int) -> int:
        """This process's rows rounded up to a multiple of its rollout data shards."""
        shards = self.engine.local_shards
        return -(-rows // shards) * shards

    def run(self, params: Params, prompts: Prompts, indices: np.ndarray, group: int,
            seeds: np.ndarray, temperature: float | None = None) -> Round:
        """Generates `group` completions for each prompt index (-1 = padding) and scores
        them. `indices` (prompts) and `seeds` (rows) are global; each process takes its
        slice. Global row r = prompt r // group, sample r % group."""
        engine = self.engine
        count, rank = runtime.process_count(), runtime.process_index()
        per = len(indices) // count * group  # rows of each process
        ids = np.repeat(indices, group)[rank * per:(rank + 1) * per]
        padded = self.padded_rows(per)
        tokens = [prompts.tokens[i] if i >= 0 else prompts.tokens[0] for i in ids]
        tokens += [prompts.tokens[0]] * (padded - per)
        local_seeds = np.zeros(padded, np.uint32)
        local_seeds[:per] = seeds[rank * per:(rank + 1) * per]
        local_ids = np.full(padded, -1, np.int32)
        local_ids[:per] = np.where(ids >= 0, rank * per + np.arange(per), -1)
        t0 = time.perf_counter()
        if self.agents is not None:
            row_ids = np.concatenate([ids, np.full(padded - per, -1)])
            return self._agents(params, prompts, row_ids, local_seeds, local_ids, indices,
                                group, per, temperature, t0)
        row_prompts = [max(i, 0) for i in ids] + [0] * (padded - per)
        requests = [self.first_requests(t, [s], temperature, **request_images(prompts, i))[0]
                    for t, s, i in zip(tokens, local_seeds, row_prompts)]
        env = mask = None
        if self.env:
            rows = [prompts.rows[i] if i >= 0 else None for i in ids] + [None] * (padded - per)
            self.episodes = self.new_episodes()
            requests = self.episodes.begin(rows, local_ids.tolist(), requests)
            engine.generate(params, requests, resume=self.episodes.resume,
                            prefill_width=self.prompt_width)
            local, scored, env, mask = self._trajectories(self.episodes.arrays(self.width,
                                                                               engine.pad_id))
        else:
            done = engine.generate(params, requests, prefill_width=self.prompt_width)
            local = self._completions(done)
            scored = (local["tokens"], local["lengths"], self._stopped(done))
        local["prompt_tokens"], local["prompt_lengths"] = self._prompts(tokens)
        if prompts.pixels_shape is not None:  # each row's prompt's images
            local["prompt_pixels"] = prompts.pixels(row_prompts)
        global_rows = [prompts.rows[i] if i >= 0 else prompts.rows[0] for i in indices]
        opened = np.asarray([prompts.opens(i) for i in ids] + [False] * (padded - per))
        return self._scored(local, (*scored, opened), local_ids, global_rows, group, per,
                            time.perf_counter() - t0, dict(engine.stats), env, mask)

    def _agents(self, params: Params, prompts: Prompts, row_ids: np.ndarray, seeds: np.ndarray,
                local_ids: np.ndarray, indices: np.ndarray, group: int, per: int,
                temperature: float | None, t0: float) -> Round:
        """A round whose trajectories agents play through the gateway (`self.agents`)."""
        arrays = self.agents.run(params, prompts, row_ids, seeds, group, self.prompt_width,
                                 self.width, temperature)
        global_rows = [prompts.rows[i] if i >= 0 else prompts.rows[0] for i in indices]
        return self._agent_round(arrays, local_ids, global_rows, group, per,
                                 time.perf_counter() - t0, dict(self.engine.stats))

    def score_agents(self, prompts: Prompts, indices: Sequence[int], groups: Sequence,
                     group: int, rollout_s: float, counts: dict[str, float]) -> Round:
        """`score` for trajectories agents played in the run's stream (continuous mode):
        `groups` are the prompts' `AgentGroup`s, `group` rows each."""
        arrays = self.agents.arrays(groups, prompts, indices, group, self.prompt_width, self.width)
        self.agents.report(groups)
        count, rank = runtime.process_count(), runtime.process_index()
        per = len(indices) * group
        global_rows: list = [None] * (count * len(indices))  # this process's groups alone
        global_rows[rank * len(indices):(rank + 1) * len(indices)] = [prompts.rows[i] for i in indices]
        local_ids = (rank * per + np.arange(per)).astype(np.int32)
        return self._agent_round(arrays, local_ids, global_rows, group, per, rollout_s, counts)

    def _agent_round(self, arrays: dict[str, np.ndarray], local_ids: np.ndarray,
                     global_rows: list, group: int, per: int, rollout_s: float,
                     counts: dict[str, float]) -> Round:
        """The scored Round of agents' rows (`Agents.run`'s layout)."""
        local, scored, env, mask = self._trajectories(arrays)
        local["prompt_tokens"], local["prompt_lengths"] = arrays["prompt_tokens"], arrays["prompt_lengths"]
        opened = np.zeros(len(local_ids), bool)
        agent = host.to_device(arrays["counts"], self.engine.rows)
        out = self._scored(local, (*scored, opened), local_ids, global_rows, group, per,
                           rollout_s, counts, env, mask)
        return dataclasses.replace(out, agent=agent, agent_info=dict(self.agents.info))

    def new_episodes(self) -> Episodes:
        """Trajectories of some rows (`Episodes.begin`) with this run's environment."""
        return Episodes(self.factory, self.tokenizer, self.stop, self.width,
                        self.engine.cfg.max_new_tokens, self.engine.routes_shape)

    def first_requests(self, tokens: Sequence[int], seeds: Sequence[int],
                       temperature: float | None = None, **images: Any) -> list[Request]:
        """The first requests of rows of prompt `tokens`, one per seed: a turn's worth of
        tokens each with an environment, else a completion's; `images` as
        `request_images` gives them."""
        return [self.engine.request(tokens, int(s), max_new_tokens=self._turn_tokens(),
                                    temperature=temperature, **images) for s in seeds]

    def _trajectories(self, arrays: dict[str, np.ndarray]) -> tuple:
        """(the rows' arrays, what the reward functions score: the last model turns, which
        the environment ended (stopped), the environment's figures and the model-token
        mask on the rollout rows) of trajectories' `Episodes.arrays`."""
        put = functools.partial(host.to_device, sharding=self.engine.rows)
        local = {k: arrays[k] for k in ("tokens", "lengths", "logprobs", "routes", "mask")
                 if k in arrays}
        ended = np.ones(len(arrays["final_lengths"]), bool)
        return (local, (arrays["final"], arrays["final_lengths"], ended), put(arrays["env"]),
                put(arrays["mask"]))

    @staticmethod
    def _stopped(done: list[Completion]) -> np.ndarray:
        """Whether each completion ended on a stop id (else at its token limit)."""
        return np.asarray([c.stopped for c in done], bool)

    def score(self, prompts: Prompts, indices: Sequence[int], done: list[Completion],
              group: int, rollout_s: float, counts: dict[str, float],
              episodes: Sequence[Episodes] = ()) -> Round:
        """A round of completions sampled elsewhere (`continuous.Continuous`): this
        process's groups of prompts `indices` (every process the same number), `done`
        their `group` completions each, in order; with an environment, `episodes` are the
        groups' trajectories, which the round holds instead."""
        count, rank = runtime.process_count(), runtime.process_index()
        per = len(indices) * group
        env = mask = None
        if episodes:
            arrays = [e.arrays(self.width, self.engine.pad_id) for e in episodes]
            local, scored, env, mask = self._trajectories(
                {k: np.concatenate([a[k] for a in arrays]) for k in arrays[0]})
        else:
            local = self._completions(done)
            scored = (local["tokens"], local["lengths"], self._stopped(done))
        ids = np.repeat(indices, group)
        tokens = [prompts.tokens[i] for i in ids]
        scored = (*scored, np.asarray([prompts.opens(i) for i in ids], bool))
        local["prompt_tokens"], local["prompt_lengths"] = self._prompts(tokens)
        global_rows: list = [None] * (count * len(indices))  # this process's groups alone
        global_rows[rank * len(indices):(rank + 1) * len(indices)] = [prompts.rows[i] for i in indices]
        local_ids = (rank * per + np.arange(per)).astype(np.int32)
        return self._scored(local, scored, local_ids, global_rows, group, per, rollout_s,
                            counts, env, mask)

    def _scored(self, local: dict[str, np.ndarray], scored: tuple[np.ndarray, ...],
                local_ids: np.ndarray, global_rows: list, group: int, per: int,
                rollout_s: float, counts: dict[str, float], env: jax.Array | None = None,
                mask: jax.Array | None = None) -> Round:
        """The Round of this process's rows `local` (`per` real rows first, then padding)
        once they are scored where they live."""
        put = functools.partial(host.to_device, sharding=self.engine.rows)
        t1 = time.perf_counter()
        row_ids = put(local_ids)
        scores = self.scorer(row_ids, RowContext(global_rows, group, local_ids, *scored))
        functions = scores[:, 0]
        if env is not None:
            scores = self._with_env(scores, env, row_ids)
        # Device row of global row r: processes hold `padded` rows each, real ones first.
        padded, count = len(local_ids), runtime.process_count()
        positions = (np.arange(count)[:, None] * padded + np.arange(per)[None]).reshape(-1)
        return Round(local, put(local["lengths"]), scores, functions, row_ids, positions,
                     rollout_s, time.perf_counter() - t1, counts, self.engine.rows, env, mask)

    def _turn_tokens(self) -> int:
        """Tokens a first request may draw: a turn's limit, within the trajectory's."""
        return min(self.engine.cfg.max_new_tokens, self.width)

    def _completions(self, done: list[Completion]) -> dict[str, np.ndarray]:
        """This process's completions as arrays (B_local x N, padded)."""
        n = self.engine.cfg.max_new_tokens
        out = {"tokens": np.full((len(done), n), self.engine.pad_id, np.int32),
               "logprobs": np.zeros((len(done), n), np.float32),
               "lengths": np.asarray([len(c.tokens) for c in done], np.int32)}
        if done and done[0].routes is not None:
            out["routes"] = np.full((len(done), n, *done[0].routes.shape[1:]), -1, np.int16)
        for b, c in enumerate(done):
            out["tokens"][b, :len(c.tokens)], out["logprobs"][b, :len(c.tokens)] = c.tokens, c.logprobs
            if "routes" in out:
                out["routes"][b, :len(c.tokens)] = c.routes
        return out

    def _prompts(self, tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """(prompts right-padded to the prompt width B x W, their lengths B), this process's."""
        width = self.prompt_width
        if max(len(t) for t in tokens) > width:
            raise ConfigError(f"a prompt has {max(len(t) for t in tokens)} tokens, more than the "
                              f"{width} allowed; shorten the prompt or raise data.max_len.")
        prompt_BxW = np.full((len(tokens), width), self.engine.pad_id, np.int32)
        for b, t in enumerate(tokens):
            prompt_BxW[b, :len(t)] = t
        return prompt_BxW, np.asarray([len(t) for t in tokens], np.int32)

    def evaluate(self, params: Params, prompts: Prompts, pass_k: int, batch_rows: int,
                 seed: int) -> dict[str, float]:
        """Greedy accuracy on `prompts` (`params` in the rollout layout), and pass@k with k
        samples each at the rollout temperature (pass@1 = the mean of those samples): a
        completion is correct when the first reward function (with an environment: the
        environment's trajectory reward) gives it >= 1."""
        greedy = self._scores(params, prompts, 1, 0.0, batch_rows, seed)
        out = {"eval/accuracy": float((greedy[:, 0, 1] >= CORRECT).mean()),
               "eval/reward": float(greedy[:, 0, 0].mean())}
        if pass_k:
            correct_PxG = self.correct(params, prompts, pass_k, batch_rows, seed)
            out[f"eval/pass@{pass_k}"] = float(correct_PxG.any(-1).mean())
            out["eval/pass@1"] = float(correct_PxG.mean())
        return out

    def correct(self, params: Params, prompts: Prompts, samples: int, batch_rows: int,
                seed: int) -> np.ndarray:
        """P x `samples` on the host: whether each of `samples` completions per prompt, at
        the rollout temperature, is correct (the first reward function gives it >= 1)."""
        return self.judged(params, prompts, samples, batch_rows, seed)[0]

    def judged(self, params: Params, prompts: Prompts, samples: int, batch_rows: int,
               seed: int) -> tuple[np.ndarray, np.ndarray]:
        """(`correct`'s P x `samples`, whether each completion was cut at the token limit)."""
        scores = self._scores(params, prompts, samples, None, batch_rows, seed)
        return scores[:, :, 1] >= CORRECT, scores[:, :, CUT] > 0

    def _scores(self, params: Params, prompts: Prompts, k: int, temperature: float | None,
                batch_rows: int, seed: int) -> np.ndarray:
        """P x k x (2 + functions) scores of the P `prompts`, k samples each, on the host."""
        n, count = len(prompts), runtime.process_count()
        per_call = max(batch_rows // k, 1)
        per_call += -per_call % count
        rows_per = self.env.rows_per_trajectory if self.env is not None else 1
        chunks = []
        for start in range(0, n, per_call):
            idx = np.arange(start, start + per_call)
            idx = np.where(idx < n, idx, -1)
            seeds = row_seeds(seed, 2**31, start, len(idx) * k * rows_per)
            r = self.run(params, prompts, idx, k * rows_per, seeds, temperature)
            scores = host.to_host(r.scores)[r.positions]  # a trajectory's rows score alike
            chunks.append(scores.reshape(len(idx), k, rows_per, -1)[:, :, 0][idx >= 0])
        return np.concatenate(chunks)


def _with_env(scores: jax.Array, env_Bx3: jax.Array, row_ids_B: jax.Array) -> jax.Array:
    """The scorer's columns with the environment's trajectory reward added to the total
    and inserted as column 1 (padding rows 0)."""
    reward_B = jnp.where(row_ids_B >= 0, env_Bx3[:, 0], 0.0)
    return jnp.concatenate([(scores[:, 0] + reward_B)[:, None], reward_B[:, None], scores[:, 1:]], 1)
