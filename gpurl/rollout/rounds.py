"""Sampling and per-shard scoring of prompts, for training and for evaluation.

Every process generates the rows of its slice of the prompts (`engine.Engine`: continuous
batching over decode slots), its devices score their
own shards (`ShardedScorer`: shard_map + io_callback), and the scores stay on device,
sharded like the rows: nothing here iterates an array the process cannot address. Only
evaluation brings scores to the host, to count correct answers.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from gpurl.config import ConfigError, EnvConfig, MeshConfig, RolloutConfig
from gpurl.distributed import runtime
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models.spec import ModelSpec, Params
from gpurl.models.tokenizer import Tokenizer
from gpurl.rewards import Reward
from gpurl.rollout.decode import stop_token_ids
from gpurl.rollout.engine import Completion, Engine, Rollout
from gpurl.rollout.multiturn import EnvFactory, Episodes
from gpurl.rollout.prompts import Prompts
from gpurl.rollout.scoring import RowContext, ShardedScorer

# A completion counts as correct when the first reward function gives it at least this.
CORRECT = 1.0 - 1e-6


def to_host(x: jax.Array) -> np.ndarray:
    """The whole (small) array on every process's host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def row_seeds(seed: int, step: int, rnd: int, rows: int) -> np.ndarray:
    """Sampling seed of every global row of rollout round `rnd` of step `step`: the same in
    every process and on every resume."""
    return np.random.SeedSequence([seed, step, rnd]).generate_state(rows, np.uint32)


@dataclass
class Round:
    """One rollout round: completions of G samples per prompt, and their scores. Device
    arrays are in device-row order (each process's rows, padding last) and sharded over
    the rollout mesh."""

    rollout: Rollout  # tokens B x N, lengths B, sampler logprobs B x N (multi-turn: mask B x N)
    prompt_tokens: jax.Array  # B x W, rows as the rollout
    prompt_lengths: jax.Array  # B
    # B x (2 + functions): weighted total, each function's score, failed (`ShardedScorer`);
    # with an environment its trajectory reward is column 1 and in the total
    scores: jax.Array
    functions: jax.Array  # B: the reward functions' weighted total alone (no environment)
    row_ids: jax.Array  # B: the global row of each device row; -1 marks padding
    positions: np.ndarray  # host, one per global row r: its device row
    rollout_s: float
    reward_s: float
    engine: dict[str, float]  # the rollout engine's counts (`Engine.stats`)
    env: jax.Array | None = None  # B x 3 with an environment: trajectory reward, turns, error


class RolloutEngine:
    """Samples `group` completions per prompt on the rollout mesh and scores them. With an
    environment (`env.name`) a completion is a multi-turn trajectory (`multiturn`): its
    model turns and the environment's observations, `env.max_tokens` wide; its reward is
    the environment's plus the reward functions' score of the last model turn."""

    def __init__(self, spec: ModelSpec, tokenizer: Tokenizer, rollout: RolloutConfig,
                 mesh: MeshConfig, rewards: Sequence[Reward], prompt_width: int,
                 devices: Sequence[jax.Device] | None = None, env: EnvConfig | None = None):
        self.tokenizer, self.rewards, self.prompt_width = tokenizer, list(rewards), prompt_width
        self.env = env if env is not None and env.on else None
        stop = tuple(rollout.stop) + (tuple(self.env.stop) if self.env else ())
        self.factory = EnvFactory(self.env) if self.env else None
        self.sampler = Engine(spec, rollout, rollout_mesh(mesh, devices), mesh.sample_rules,
                              stop_ids=stop_token_ids(tokenizer, stop), pad_id=tokenizer.pad_id)
        self.scorer = ShardedScorer(self.sampler.mesh, self.rewards, tokenizer, stop)
        # completion width: a trajectory's tokens after the prompt, or one completion's
        self.width = self.env.max_tokens if self.env else rollout.max_new_tokens
        self.stop = stop
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

    def padded_rows(self, rows: int) -> int:
        """This process's rows rounded up to a multiple of its rollout data shards."""
        shards = self.sampler.local_shards
        return -(-rows // shards) * shards

    def run(self, params: Params, prompts: Prompts, indices: np.ndarray, group: int,
            seeds: np.ndarray, temperature: float | None = None) -> Round:
        """Generates `group` completions for each prompt index (-1 = padding) and scores
        them. `indices` (prompts) and `seeds` (rows) are global; each process takes its
        slice. Global row r = prompt r // group, sample r % group."""
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
        requests = [self.sampler.request(t, s, max_new_tokens=self._turn_tokens(),
                                         temperature=temperature)
                    for t, s in zip(tokens, local_seeds)]
        t0 = time.perf_counter()
        env = None
        if self.env:
            rows = [prompts.rows[i] if i >= 0 else None for i in ids] + [None] * (padded - per)
            self.episodes = Episodes(self.factory, self.tokenizer, self.stop, self.width,
                                     self.sampler.cfg.max_new_tokens, self.sampler.routes_shape)
            requests = self.episodes.begin(rows, local_ids.tolist(), requests)
            self.sampler.generate(params, requests, resume=self.episodes.resume,
                                  prefill_width=self.prompt_width)
            arrays = self.episodes.arrays(self.width, self.sampler.pad_id)
            put = functools.partial(jax.make_array_from_process_local_data, self.sampler.rows)
            rollout = Rollout(put(arrays["tokens"]), put(arrays["lengths"]), put(arrays["logprobs"]),
                              put(arrays["routes"]) if "routes" in arrays else None,
                              put(arrays["mask"]))
            scored = (put(arrays["final"]), put(arrays["final_lengths"]))
            env = put(arrays["env"])
        else:
            done = self.sampler.generate(params, requests, prefill_width=self.prompt_width)
            rollout = self._rollout(done)
            scored = (rollout.tokens, rollout.lengths)
        prompt_tokens, prompt_lengths = self._prompts(tokens)  # the trainer's sequences reuse them
        t1 = time.perf_counter()
        global_rows = [prompts.rows[i] if i >= 0 else prompts.rows[0] for i in indices]
        row_ids = jax.make_array_from_process_local_data(self.sampler.rows, local_ids)
        scores = self.scorer(*scored, row_ids, RowContext(global_rows, group))
        functions = scores[:, 0]
        if env is not None:
            scores = self._with_env(scores, env, row_ids)
        # Device row of global row r: processes hold `padded` rows each, real ones first.
        positions = (np.arange(count)[:, None] * padded + np.arange(per)[None]).reshape(-1)
        return Round(rollout, prompt_tokens, prompt_lengths, scores, functions, row_ids, positions,
                     t1 - t0, time.perf_counter() - t1, dict(self.sampler.stats), env)

    def _turn_tokens(self) -> int:
        """Tokens a first request may draw: a turn's limit, within the trajectory's."""
        return min(self.sampler.cfg.max_new_tokens, self.width)

    def _rollout(self, done: list[Completion]) -> Rollout:
        """This process's completions as the global row-sharded Rollout (B x N)."""
        n = self.sampler.cfg.max_new_tokens
        tokens_BxN = np.full((len(done), n), self.sampler.pad_id, np.int32)
        logprobs_BxN = np.zeros((len(done), n), np.float32)
        lengths_B = np.zeros(len(done), np.int32)
        recorded = done and done[0].routes is not None
        routes = (np.full((len(done), n, *done[0].routes.shape[1:]), -1, np.int16)
                  if recorded else None)
        for b, c in enumerate(done):
            tokens_BxN[b, :len(c.tokens)], logprobs_BxN[b, :len(c.tokens)] = c.tokens, c.logprobs
            lengths_B[b] = len(c.tokens)
            if recorded:
                routes[b, :len(c.tokens)] = c.routes
        put = functools.partial(jax.make_array_from_process_local_data, self.sampler.rows)
        return Rollout(put(tokens_BxN), put(lengths_B), put(logprobs_BxN),
                       put(routes) if recorded else None)

    def _prompts(self, tokens: list[list[int]]) -> tuple[jax.Array, jax.Array]:
        """(prompts right-padded to the prompt width B x W, their lengths B), row-sharded."""
        width = self.prompt_width
        if max(len(t) for t in tokens) > width:
            raise ConfigError(f"a prompt has {max(len(t) for t in tokens)} tokens, more than the "
                              f"{width} allowed; shorten the prompt or raise data.max_len.")
        prompt_BxW = np.full((len(tokens), width), self.sampler.pad_id, np.int32)
        for b, t in enumerate(tokens):
            prompt_BxW[b, :len(t)] = t
        lengths_B = np.asarray([len(t) for t in tokens], np.int32)
        put = functools.partial(jax.make_array_from_process_local_data, self.sampler.rows)
        return put(prompt_BxW), put(lengths_B)

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
            correct_PxG = self._scores(params, prompts, pass_k, None, batch_rows, seed)[:, :, 1] >= CORRECT
            out[f"eval/pass@{pass_k}"] = float(correct_PxG.any(-1).mean())
            out["eval/pass@1"] = float(correct_PxG.mean())
        return out

    def _scores(self, params: Params, prompts: Prompts, k: int, temperature: float | None,
                batch_rows: int, seed: int) -> np.ndarray:
        """P x k x (2 + functions) scores of the P `prompts`, k samples each, on the host."""
        n, count = len(prompts), runtime.process_count()
        per_call = max(batch_rows // k, 1)
        per_call += -per_call % count
        chunks = []
        for start in range(0, n, per_call):
            idx = np.arange(start, start + per_call)
            idx = np.where(idx < n, idx, -1)
            seeds = row_seeds(seed, 2**31, start, len(idx) * k)
            r = self.run(params, prompts, idx, k, seeds, temperature)
            scores = to_host(r.scores)[r.positions]
            chunks.append(scores.reshape(len(idx), k, -1)[idx >= 0])
        return np.concatenate(chunks)


def _with_env(scores: jax.Array, env_Bx3: jax.Array, row_ids_B: jax.Array) -> jax.Array:
    """The scorer's columns with the environment's trajectory reward added to the total
    and inserted as column 1 (padding rows 0)."""
    reward_B = jnp.where(row_ids_B >= 0, env_Bx3[:, 0], 0.0)
    return jnp.concatenate([(scores[:, 0] + reward_B)[:, None], reward_B[:, None], scores[:, 1:]], 1)
