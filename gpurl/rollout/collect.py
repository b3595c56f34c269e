"""One RL step's rollouts: rounds of G completions per prompt, dynamic sampling, and the
trainer batch, with rewards on device from the scorer to the batch.

    round 0: the next batch of prompts of the data stream, sampled and scored
    [dynamic sampling (DAPO): groups whose G rewards are all equal carry no gradient;
     more rounds of fresh prompts until the batch is full or algo.max_refills is spent]
    -> the kept groups (fillers without loss if rounds ran out), grouped by prompt, on
       the trainer mesh, with each row's shaped reward.

Rewards are shaped (function weight, DAPO's overlong punishment) and reduced to metrics
on device; the host receives only the P-element "group is informative" mask of a round
under dynamic sampling, to choose the groups to keep.
"""

from __future__ import annotations

import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from gpurl.data.batching import step_indices
from gpurl.data.rollouts import RolloutBatch
from gpurl.distributed import host
from gpurl.rollout.rounds import Round, Rounds, row_seeds
from gpurl.rollout.prompts import Prompts
from gpurl.rollout.scoring import ERRORS

# Rewards closer than this count as equal (a group without signal).
EQUAL = 1e-9


@dataclass(frozen=True)
class Shaping:
    """The reward of a row from its scores: function_weight x the functions' weighted
    total, plus the environment's trajectory reward (whatever else is configured), plus
    DAPO's overlong punishment (Yu et al. 2025, eq. 13). A reward model's score is added
    on the trainer mesh, in the prepare step."""

    max_tokens: int  # rollout.max_new_tokens (multi-turn: env.max_tokens)
    overlong_buffer: int = 0  # the penalty ramps over the last N tokens; 0 = off
    overlong_penalty: float = 1.0  # the penalty at the length limit
    # 0 when a reward model gives the reward and no functions were named: the data's
    # answer check only reports (an environment's reward is never weighted by it)
    function_weight: float = 1.0


def overlong_penalty(lengths_B: jax.Array, max_tokens: int, buffer: int,
                     factor: float) -> jax.Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max - buffer
    tokens, then falling linearly to -factor at the length limit. Off when the buffer is 0
    or not shorter than the limit (the paper's 4096 of 20480 tokens has no meaning for
    8-token answers)."""
    if buffer <= 0 or buffer >= max_tokens:
        return jnp.zeros(lengths_B.shape, jnp.float32)
    start = max_tokens - buffer
    return factor * jnp.clip((start - lengths_B) / buffer, -1.0, 0.0).astype(jnp.float32)


def shaped_rewards(shaping: Shaping, functions_B: jax.Array, env_Bx3: jax.Array | None,
                   lengths_B: jax.Array, row_ids_B: jax.Array) -> jax.Array:
    """The reward of every device row from the reward functions' weighted total (B,
    `Round.functions`) and the environment's trajectory reward (column 0 of `Round.env`;
    None without an environment); padding rows 0."""
    total_B = shaping.function_weight * functions_B + overlong_penalty(
        lengths_B, shaping.max_tokens, shaping.overlong_buffer, shaping.overlong_penalty)
    if env_Bx3 is not None:
        total_B = total_B + env_Bx3[:, 0]
    return jnp.where(row_ids_B >= 0, total_B, 0.0).astype(jnp.float32)


def group_spread(rewards_B: jax.Array, group: int) -> jax.Array:
    """max - min of each group's rewards, P (rows grouped contiguously)."""
    r_PxG = rewards_B.reshape(-1, group)
    return r_PxG.max(-1) - r_PxG.min(-1)


@dataclass
class Choice:
    """The rounds of one step's batch, their shaped rewards, and the (round, group) pairs
    they keep and drop (`Collector.add_round`)."""

    rounds: list[Round] = field(default_factory=list)
    rewards: list[jax.Array] = field(default_factory=list)
    kept: list[np.ndarray] = field(default_factory=list)
    dropped: list[np.ndarray] = field(default_factory=list)

    def groups(self, batch_size: int) -> tuple[np.ndarray, int]:
        """(the batch's `batch_size` (round, group) pairs: the kept ones first, then dropped
        ones to fill it, which carry no loss; how many are kept)."""
        kept_pairs, dropped_pairs = np.concatenate(self.kept), np.concatenate(self.dropped)
        num_kept = min(len(kept_pairs), batch_size)
        return np.concatenate([kept_pairs[:num_kept], dropped_pairs])[:batch_size], num_kept


def select_groups(informative_P: np.ndarray | None, num_groups: int,
                  wanted: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept group indices, dropped ones) of one round. Dynamic sampling (DAPO, Yu et al.
    2025, sec. 3.2) keeps the informative groups (`informative_P`); without it
    (`informative_P` None) the round's first `wanted` groups are the batch."""
    order = np.arange(num_groups)
    if informative_P is None:
        return order[:wanted], order[wanted:]
    return order[informative_P], order[~informative_P]


@dataclass
class Collected:
    """A step's trainer batch and what the step logs about its rollouts."""

    batch: RolloutBatch  # grouped by prompt, on the trainer mesh
    rewards: jax.Array  # B: the shaped reward of every batch row, on the trainer mesh
    metrics: dict[str, Any]  # device scalars, host counts and times
    assembled_at: float  # host time when the batch assembly was dispatched
    # policy versions between the parameters that sampled the trained groups and those
    # the step trains: mean over the groups that carry loss (1 for a round sampled ahead)
    lag: float = 0.0
    # () -> P x (1 + G): the batch's prompt and completion lengths on every host, from the
    # hosts that generated them (a collective: every process calls it, or none)
    lengths: Callable[[], np.ndarray] | None = None
    # host time at which the trainer's previous update was first seen computed (the end of
    # that step's train time), set by the batch source; None: not seen
    computed_at: float | None = None


class Collector:
    """Rounds of rollouts for the shared train step of the RL algorithms.

    `source` samples and scores a round; `to_trainer` moves its arrays onto the trainer
    mesh (`batch_sharding`; `colocated`: the rollout's devices are the trainer's);
    `rounds` is 1 + the refills dynamic sampling may run (`drop_equal`).

    Every round draws the next batch of prompts of the data's index stream (`step_indices`:
    epoch permutations of the prompts, a pure function of the seed); `position` counts the
    batches drawn, so the data advances by the rounds actually run, and a run resumed at
    a checkpoint's position draws what the uninterrupted run would have."""

    def __init__(self, source: Rounds, prompts: Prompts, *, group: int,
                 batch_size: int, seed: int, shaping: Shaping, drop_equal: bool, rounds: int,
                 batch_sharding: NamedSharding, colocated: bool, pad_id: int):
        self.source, self.prompts, self.group = source, prompts, group
        self.batch_size, self.seed, self.shaping = batch_size, seed, shaping
        self.drop_equal, self.rounds = drop_equal, rounds
        self.batch_sharding, self.colocated, self.pad_id = batch_sharding, colocated, pad_id
        self._shape = jax.jit(functools.partial(shaped_rewards, shaping))
        self._spread = jax.jit(lambda r, pos: group_spread(r[pos], group))
        self._stats = jax.jit(self._round_stats)
        # rows scored 0 because a reward function failed (rewards.on_error=zero)
        self.count_errors = any(r.on_error == "zero" for r in source.rewards)
        self._errors = jax.jit(lambda scores, ids: (scores[:, ERRORS] * (ids >= 0)).sum())
        self._assemble = jax.jit(self._assemble_fn, out_shardings=(batch_sharding, batch_sharding))
        self.position = 0  # batches of prompts drawn so far (checkpointed by the stepper)

    def describe_rewards(self, reward_model: str | None) -> str:
        """What the reward sums (an environment's, a reward model's at path `reward_model`,
        the functions'), and the functions that only report."""
        env, functions = self.source.env, ", ".join(r.name for r in self.source.rewards)
        summed = [f"environment {env.name}"] if env is not None else []
        if reward_model is not None:
            summed.append(f"reward model {reward_model}")
        reported = functions and not self.shaping.function_weight
        if functions and not reported:
            summed.append(functions)
        names = " + ".join(summed) or "none"
        return names + (f" (reported: {functions})" if reported else "")

    def spec(self) -> RolloutBatch:
        """The global shapes and dtypes of the batch `collect` hands over: batch_size
        prompts of the rounds' prompt width, G completions of their width each, and the
        routes of routing replay when the engine records them."""
        return RolloutBatch.spec(self.batch_size, self.group, self.source.prompt_width,
                                 self.source.width, self.source.engine.routes_shape,
                                 self.prompts.pixels_shape)

    def to_trainer(self, x: jax.Array | np.ndarray) -> jax.Array:
        """Rollout rows onto the trainer mesh: this process's rows from its host, or a
        device array of the rollout mesh. Split placement brings the latter through this
        host (a few bytes a row), since each process's rows are on its own rollout devices
        and go to its own trainer devices; a device-to-device copy across device sets would
        need a cross-host transfer that multi-process GPU runtimes do not offer here."""
        if isinstance(x, np.ndarray):
            return host.to_device(x, self.batch_sharding)
        if self.colocated:
            return jax.device_put(x, self.batch_sharding)
        return host.to_device(host.local(x), self.batch_sharding)

    def indices(self, position: int) -> np.ndarray:
        """The global prompt indices of batch `position` of the data's index stream."""
        return step_indices(len(self.prompts), self.batch_size, position, self.seed)

    def round(self, params: Any, step: int, rnd: int) -> Round:
        """Rollout round `rnd` of `step` on the next batch of prompts; its sampling seeds
        are functions of step and round."""
        idx = self.indices(self.position)
        self.position += 1
        return self.source.run(params, self.prompts, idx, self.group,
                               row_seeds(self.seed, step, rnd, len(idx) * self.group))

    def round_rewards(self, r: Round) -> jax.Array:
        """The shaped reward of every device row of a round (`shaped_rewards`), B."""
        return self._shape(r.functions, r.env, r.lengths, r.row_ids)

    def collect(self, params: Any, step: int, first: Round | None = None) -> Collected:
        """The rounds of `step` (`first`: its round 0, sampled ahead) and the batch of the
        groups they keep."""
        choice = Choice()
        for rnd in range(self.rounds):
            r = first if rnd == 0 and first is not None else self.round(params, step, rnd)
            if self.add_round(choice, r):
                break
        groups, num_kept = choice.groups(self.batch_size)
        ahead = first is not None  # round 0 was sampled by the previous step's parameters
        lag = float(np.mean(groups[:num_kept, 0] == 0)) if ahead and num_kept else 0.0
        return self.batch(choice.rounds, choice.rewards, groups, num_kept, lag)

    def add_round(self, choice: "Choice", r: Round) -> bool:
        """Scores round `r` into `choice` (its groups kept or, under dynamic sampling,
        dropped as uninformative); True once a batch of groups is kept."""
        rnd = len(choice.rounds)
        choice.rewards.append(self.round_rewards(r))
        keep, drop = self._select(choice.rewards[-1], r)
        choice.kept.append(np.stack([np.full_like(keep, rnd), keep], 1))
        choice.dropped.append(np.stack([np.full_like(drop, rnd), drop], 1))
        choice.rounds.append(r)
        return sum(len(k) for k in choice.kept) >= self.batch_size

    def batch(self, rounds: list[Round], rewards: list[jax.Array], groups: np.ndarray,
              num_kept: int, lag: float) -> Collected:
        """The trainer batch of the (round, group) pairs `groups` of `rounds` (the first
        `num_kept` carry loss; `rewards`: each round's shaped rewards) and its metrics."""
        select_B, keep_B = self._rows(rounds, groups, num_kept)
        assembled_at = time.perf_counter()
        parts = [{k: self.to_trainer(x) for k, x in self._parts(r, shaped).items()}
                 for r, shaped in zip(rounds, rewards)]
        batch, rewards_B = self._assemble(parts, jnp.asarray(select_B, jnp.int32),
                                          jnp.asarray(keep_B))
        metrics = self._stats(rounds[0].scores, rounds[0].lengths, rewards[0],
                              jnp.asarray(rounds[0].positions))
        metrics.update({
            "reward/batch_mean": rewards_B.mean(), "groups/kept": float(num_kept),
            "rollout/rounds": float(len(rounds)),
            "time/rollout_s": sum(r.rollout_s for r in rounds),
            "time/reward_s": sum(r.reward_s for r in rounds),
            # decode steps spent on live rows, of all row-steps the engine ran; requests
            # that gave their KV blocks back to the pool (recomputed when readmitted)
            "rollout/slot_use": (sum(r.counts["live_row_steps"] for r in rounds)
                                 / max(sum(r.counts["row_steps"] for r in rounds), 1)),
            "rollout/preempted": float(sum(r.counts["preempted"] for r in rounds)),
            **self._prefix_cache(rounds)})
        if self.count_errors:
            metrics["reward/errors"] = sum(self._errors(r.scores, r.row_ids) for r in rounds)
        if rounds[0].env is not None:  # multi-turn: the unfiltered round 0's trajectories
            metrics.update(self._env_stats(rounds[0].env, rounds[0].mask,
                                           rounds[0].lengths, jnp.asarray(rounds[0].positions)))
        if rounds[0].agent is not None:  # agents: how their trajectories went
            metrics.update(agent_stats(rounds[0].agent, rounds[0].row_ids,
                                       self.source.env.rows_per_trajectory))
            metrics.update(agent_info(rounds[0].agent_info or {}))
        return Collected(batch, rewards_B, metrics, assembled_at, lag,
                         functools.partial(self._lengths, rounds, select_B))

    @staticmethod
    def _prefix_cache(rounds: list[Round]) -> dict[str, float]:
        """The rounds' prefix-cache figures over every process (one host gather): tokens
        the prefills computed, tokens of the sequences admitted (prompts, and each
        multi-turn trajectory's sequence at every turn), the share of those found in the
        cache, and blocks the cache gave up under pool pressure."""
        keys = ("prefill_tokens", "sequence_tokens", "cached_tokens", "evicted")
        total = host.gather([sum(r.counts.get(k, 0) for r in rounds) for k in keys]).sum(axis=0)
        prefill, sequence, cached, evicted = (float(x) for x in total)
        return {"rollout/prefill_tokens": prefill, "rollout/sequence_tokens": sequence,
                "rollout/prefix_hit_rate": cached / max(sequence, 1.0),
                "rollout/evicted_blocks": evicted}

    def _lengths(self, rounds: list[Round], select_B: np.ndarray) -> np.ndarray:
        """P x (1 + G) prompt and completion lengths of the batch's rows `select_B` (device
        rows of the rounds' concatenation), gathered from every process's host copies."""
        mine = np.stack([np.stack([r.local["prompt_lengths"], r.local["lengths"]]) for r in rounds])
        every = host.gather(mine.reshape(-1)).reshape(-1, *mine.shape)  # processes x R x 2 x B
        rows = np.moveaxis(every, 0, 2).reshape(len(rounds), 2, -1)  # R x 2 x device rows
        prompt_B, completion_B = (np.concatenate(rows[:, i]) for i in (0, 1))
        g = self.group
        return np.concatenate([prompt_B[select_B][::g, None],
                               completion_B[select_B].reshape(-1, g)], axis=1)

    @staticmethod
    def _parts(r: Round, shaped: jax.Array) -> dict[str, jax.Array | np.ndarray]:
        """A round's arrays the batch is assembled from: its rows on this host, and the
        shaped rewards on the rollout mesh."""
        names = {"prompt_tokens": "prompt_tokens", "prompt_lengths": "prompt_lengths",
                 "completions": "tokens", "completion_lengths": "lengths",
                 "sampler_logprobs": "logprobs", "routes": "routes", "model_mask": "mask",
                 "prompt_pixels": "prompt_pixels"}
        out = {k: r.local[name] for k, name in names.items() if name in r.local}
        out["rewards"] = shaped
        return out

    @staticmethod
    @jax.jit
    def _env_stats(env_Bx3: jax.Array, mask_BxN: jax.Array, lengths_B: jax.Array,
                   pos: jax.Array) -> dict[str, jax.Array]:
        """Trajectory metrics over the global rows (device rows `pos`)."""
        env_Bx3, mask_BxN, lengths_B = env_Bx3[pos], mask_BxN[pos], lengths_B[pos]
        model_B = mask_BxN.sum(-1)
        return {"env/reward": env_Bx3[:, 0].mean(), "env/turns": env_Bx3[:, 1].mean(),
                "env/errors": env_Bx3[:, 2].sum(), "env/model_tokens": model_B.mean(),
                "env/observation_tokens": (lengths_B - model_B).mean()}

    def _select(self, rewards_B: jax.Array, r: Round) -> tuple[np.ndarray, np.ndarray]:
        """`select_groups` of a round; under dynamic sampling the host receives the P
        informative-group flags, nothing else."""
        informative_P = (host.to_host(self._spread(rewards_B, jnp.asarray(r.positions))) > EQUAL
                         if self.drop_equal else None)
        return select_groups(informative_P, len(r.positions) // self.group, self.batch_size)

    def _rows(self, rounds: list[Round], groups: np.ndarray,
              num_kept: int) -> tuple[np.ndarray, np.ndarray]:
        """Device rows of the chosen (round, group) pairs in the rounds' concatenation,
        and whether each row carries loss (fillers do not)."""
        g = self.group
        offsets = np.cumsum([0] + [len(r.row_ids) for r in rounds])
        positions = np.stack([r.positions for r in rounds])
        round_B = np.repeat(groups[:, 0], g)
        global_B = (groups[:, 1:2] * g + np.arange(g)[None]).reshape(-1)
        select_B = offsets[round_B] + positions[round_B, global_B]
        return select_B, np.repeat(np.arange(len(groups)) < num_kept, g)

    def _assemble_fn(self, rounds: list[dict], select_B: jax.Array,
                     keep_B: jax.Array) -> tuple[RolloutBatch, jax.Array]:
        """Concatenates rounds and keeps rows `select_B` (whole groups, in order), grouped
        by prompt: every array's leading axis is the P prompts, so micro-batches and
        shards split whole groups."""
        g = self.group
        rows = {k: jnp.concatenate([r[k] for r in rounds])[select_B] for k in rounds[0]}
        comp_BxN, clen_B = rows["completions"], rows["completion_lengths"]
        p, n = select_B.shape[0] // g, comp_BxN.shape[1]
        real_BxN = jnp.arange(n)[None, :] < clen_B[:, None]
        trained_BxN = real_BxN & keep_B[:, None]
        if "model_mask" in rows:  # multi-turn: observation tokens carry no loss
            trained_BxN = trained_BxN & (rows["model_mask"] > 0)
        grouped = lambda x: x.reshape(p, g, *x.shape[1:])  # noqa: E731
        batch = RolloutBatch(
            prompt_tokens=rows["prompt_tokens"][::g].astype(jnp.int32),
            prompt_lengths=rows["prompt_lengths"][::g].astype(jnp.int32),
            completions=grouped(jnp.where(real_BxN, comp_BxN, self.pad_id)),
            completion_lengths=grouped(clen_B.astype(jnp.int32)),
            comp_mask=grouped(trained_BxN.astype(jnp.float32)),
            sampler_logprobs=grouped(jnp.where(real_BxN, rows["sampler_logprobs"], 0.0)),
            routes=grouped(rows["routes"]) if "routes" in rows else None,  # B x N x L x k
            prompt_pixels=rows["prompt_pixels"][::g] if "prompt_pixels" in rows else None)
        return batch, rows["rewards"]

    def _round_stats(self, scores: jax.Array, lengths_B: jax.Array, rewards_B: jax.Array,
                     pos: jax.Array) -> dict[str, jax.Array]:
        """Metrics of the unfiltered round 0, over its global rows (device rows `pos`)."""
        r_PxG = rewards_B[pos].reshape(-1, self.group)
        lengths_B, scores = lengths_B[pos], scores[pos]
        out = {"reward/mean": r_PxG.mean(), "reward/std": r_PxG.std(-1).mean(),
               "completion/length": lengths_B.mean(),
               "completion/truncated": (lengths_B >= self.shaping.max_tokens).mean(),
               "groups/all_equal": ((r_PxG.max(-1) - r_PxG.min(-1)) <= EQUAL).mean()}
        for f, name in enumerate(self.source.score_names):
            out[f"reward/{name}"] = scores[:, 1 + f].mean()
        return out


# Each agent trajectory's counts (`gpurl.serve.agents`), on its first row
AGENT_COUNTS = ("failed", "raised", "timeouts", "over_limit", "no_reward", "calls", "forks",
                "dropped", "truncated")


@functools.partial(jax.jit, static_argnums=2)
def agent_stats(counts_BxC: jax.Array, row_ids_B: jax.Array, rows_per: int) -> dict[str, jax.Array]:
    """Agent metrics over the round's trajectories (every process's): the share that failed
    and how many for each reason (raised, ran past env.agent_timeout_s, a call past a cap
    or refused, no reward), and per trajectory its calls, forks, rows dropped past
    env.agent_rows and rows cut at env.max_tokens."""
    n = jnp.maximum((row_ids_B >= 0).sum() / rows_per, 1.0)
    total = dict(zip(AGENT_COUNTS, counts_BxC.sum(0)))
    return {"agent/failed": total["failed"] / n, "agent/raised": total["raised"],
            "agent/timeouts": total["timeouts"], "agent/over_limit": total["over_limit"],
            "agent/no_reward": total["no_reward"], "agent/calls": total["calls"] / n,
            "agent/forks": total["forks"] / n, "agent/rows_dropped": total["dropped"],
            "agent/truncated": total["truncated"]}


def agent_info(mine: dict[str, list[float]]) -> dict[str, float]:
    """`agent/info/<key>`: each number agents returned beside their reward (a dict's other
    keys), its mean over the trajectories that returned it on every process (one gather)."""
    total: dict[str, list[float]] = {}
    for text in host.gather_text(json.dumps(mine)):
        for k, (value, count) in json.loads(text).items():
            both = total.setdefault(k, [0.0, 0.0])
            both[0], both[1] = both[0] + value, both[1] + count
    return {f"agent/info/{k}": value / count for k, (value, count) in sorted(total.items())}
