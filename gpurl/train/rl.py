"""One RL step of the GRPO family, and held-out evaluation by sampling.

    prompts of step s (a pure function of the seed and s, each repeated G times)
      -> rollout on the rollout mesh (prefill + decode, sampler log-probs)
      -> rewards per shard (`ShardedScorer`: shard_map + io_callback), overlong shaping
      -> [dynamic sampling: drop groups whose rewards are all equal, sample more prompts]
      -> sequences on the trainer mesh, reference / old log-probs, advantages
      -> `algo.num_iterations` optimizer steps on the batch.

Every process handles only its own rows: it generates the prompts of its slice, its
devices score their own shards, and the batch is assembled by jitted gathers, so nothing
here iterates an array the process cannot address. The host sees the B rewards of the
step (a few hundred floats, gathered from every process) to choose the groups to keep.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gpurl import algorithms
from gpurl.algorithms import ppo
from gpurl.algorithms.common import group_advantages, group_logprobs, kl_estimate
from gpurl.config import Config, ConfigError, MeshConfig, RolloutConfig
from gpurl.data.batching import step_indices
from gpurl.distributed import runtime
from gpurl.models import ModelSpec, Params, lora
from gpurl.models.tokenizer import Tokenizer
from gpurl.distributed.mesh import placement_devices, replicated, rollout_mesh
from gpurl.distributed.sync import WeightSync
from gpurl.rewards import Reward, load as load_rewards
from gpurl.rewards.sharded import RowContext, ShardedScorer
from gpurl.rollout.decode import local_rows, stop_token_ids
from gpurl.rollout.generate import encode_prompt
from gpurl.rollout.sampler import MIN_PROMPT_BUCKET, Rollout, Sampler, bucket
from gpurl.train.step import Placement, TrainState


@dataclass(frozen=True)
class Prompts:
    """Rows (prompt text + metadata) and their token ids (BOS included)."""

    rows: list[dict]
    tokens: list[list[int]]

    def __len__(self) -> int:
        return len(self.rows)


def encode_prompts(rows: list[dict], tokenizer: Tokenizer, chat: bool, max_len: int,
                   what: str) -> tuple[Prompts, int]:
    """Token ids of each prompt; prompts longer than `max_len` tokens are skipped (the
    count is returned and reported)."""
    kept, tokens, skipped = [], [], 0
    for row in rows:
        ids = encode_prompt(tokenizer, row.get("messages") or row["prompt"], chat)
        if len(ids) > max_len:
            skipped += 1
            continue
        kept.append(row)
        tokens.append(ids)
    if not kept:
        raise ConfigError(f"every {what} prompt is longer than data.max_len={max_len} tokens; "
                          f"raise data.max_len.")
    return Prompts(kept, tokens), skipped


def to_host(x: jax.Array) -> np.ndarray:
    """The whole (small) array on every process's host."""
    if x.is_fully_addressable:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def row_seeds(seed: int, step: int, rnd: int, rows: int) -> np.ndarray:
    """Sampling seed of every global row of rollout round `rnd` of step `step`: the same in
    every process and on every resume."""
    return np.random.SeedSequence([seed, step, rnd]).generate_state(rows, np.uint32)


def overlong_penalty(lengths_B: np.ndarray, max_tokens: int, buffer: int, factor: float) -> np.ndarray:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max - buffer
    tokens, then falling linearly to -factor at the length limit. Off when the buffer is 0
    or not shorter than the limit (the paper's 4096 of 20480 tokens has no meaning for
    8-token answers)."""
    if buffer <= 0 or buffer >= max_tokens:
        return np.zeros(len(lengths_B), np.float32)
    start = max_tokens - buffer
    return factor * np.clip((start - lengths_B) / buffer, -1.0, 0.0).astype(np.float32)


def select_groups(rewards_B: np.ndarray, group: int, wanted: int, drop_equal: bool
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(kept group indices, dropped ones) of one rollout round. With `drop_equal` (DAPO's
    dynamic sampling, Yu et al. 2025, sec. 3.2) groups whose G rewards are all equal
    carry no gradient and are dropped."""
    r_PxG = rewards_B.reshape(-1, group)
    informative = (r_PxG.max(-1) - r_PxG.min(-1)) > 1e-9
    order = np.arange(len(r_PxG))
    if not drop_equal:
        return order[:wanted], order[wanted:]
    return order[informative], order[~informative]


@dataclass
class _Round:
    """One rollout round: the global rollout and its prompts."""

    rollout: Rollout
    prompt_tokens: jax.Array  # B x P, rows as the rollout
    prompt_lengths: jax.Array  # B
    scores: np.ndarray  # B x (1 + F) on the host
    lengths: np.ndarray  # B completion lengths on the host
    valid: np.ndarray  # B bool: rows of real prompts (not padding)
    positions: np.ndarray  # B: row of global row r in the device arrays (after padding)
    rollout_s: float
    reward_s: float


class Rollouts:
    """Sampling and sharded scoring of prompts, for training and for evaluation."""

    def __init__(self, spec: ModelSpec, tokenizer: Tokenizer, rollout: RolloutConfig,
                 mesh: MeshConfig, rewards: Sequence[Reward], prompt_width: int,
                 devices: Sequence[jax.Device] | None = None):
        self.tokenizer, self.rewards, self.prompt_width = tokenizer, list(rewards), prompt_width
        self.sampler = Sampler(spec, rollout, rollout_mesh(mesh, devices), mesh.sample_rules,
                               stop_ids=stop_token_ids(tokenizer, rollout.stop),
                               pad_id=tokenizer.pad_id)
        self.scorer = ShardedScorer(self.sampler.mesh, self.rewards, tokenizer, rollout.stop)

    def run(self, params: Params, prompts: Prompts, indices: np.ndarray, group: int,
                 seeds: np.ndarray, temperature: float | None = None) -> _Round:
        """Generates `group` completions for each prompt index (-1 = padding) and scores
        them. `indices` (prompts) and `seeds` (rows) are global; each process takes its
        slice. Global row r = prompt r // group, sample r % group."""
        count, rank = runtime.process_count(), runtime.process_index()
        per = len(indices) // count * group  # rows of each process
        ids = np.repeat(indices, group)[rank * per:(rank + 1) * per]
        padded = self.sampler.padded_rows(per, bucket_rows=False)
        tokens = [prompts.tokens[i] if i >= 0 else prompts.tokens[0] for i in ids]
        tokens += [prompts.tokens[0]] * (padded - per)
        local_seeds = np.zeros(padded, np.uint32)
        local_seeds[:per] = seeds[rank * per:(rank + 1) * per]
        t0 = time.perf_counter()
        batch = self.sampler.prepare(tokens, local_seeds, self.prompt_width, bucket_rows=False)
        rollout = self.sampler.generate_prepared(params, batch, temperature=temperature)
        prompt_tokens, prompt_lengths, _ = batch  # the trainer's sequences reuse them
        row_ids = np.full(padded, -1, np.int32)
        row_ids[:per] = np.where(ids >= 0, rank * per + np.arange(per), -1)
        jax.block_until_ready(rollout)
        t1 = time.perf_counter()
        global_rows = [prompts.rows[i] if i >= 0 else prompts.rows[0] for i in indices]
        row_ids = jax.make_array_from_process_local_data(self.sampler.rows, row_ids)
        scores = self.scorer(rollout.tokens, rollout.lengths, row_ids,
                             RowContext(global_rows, group))
        # Device row of global row r: processes hold `padded` rows each, real ones first.
        positions = (np.arange(count)[:, None] * padded + np.arange(per)[None]).reshape(-1)
        scores_np, lengths_np = to_host(scores)[positions], to_host(rollout.lengths)[positions]
        return _Round(rollout, prompt_tokens, prompt_lengths, scores_np, lengths_np,
                      np.repeat(indices >= 0, group), positions, t1 - t0, time.perf_counter() - t1)

    def evaluate(self, params: Params, prompts: Prompts, pass_k: int, batch_rows: int,
                 seed: int) -> dict[str, float]:
        """Greedy accuracy on `prompts` (`params` in the rollout layout), and pass@k with k
        samples each at the rollout temperature (pass@1 = the mean of those samples): a
        completion is correct when the first reward function gives it >= 1."""
        greedy = self._scores(params, prompts, 1, 0.0, batch_rows, seed)
        out = {"eval/accuracy": float((greedy[:, 0, 1] >= 1.0 - 1e-6).mean()),
               "eval/reward": float(greedy[:, 0, 0].mean())}
        if pass_k:
            correct_NxK = self._scores(params, prompts, pass_k, None, batch_rows, seed)[:, :, 1] >= 1.0 - 1e-6
            out[f"eval/pass@{pass_k}"] = float(correct_NxK.any(-1).mean())
            out["eval/pass@1"] = float(correct_NxK.mean())
        return out

    def _scores(self, params: Params, prompts: Prompts, k: int, temperature: float | None,
                batch_rows: int, seed: int) -> np.ndarray:
        """N x k x (1 + F) scores of `prompts`, k samples each."""
        n, count = len(prompts), runtime.process_count()
        per_call = max(batch_rows // k, 1)
        per_call += -per_call % count
        chunks = []
        for start in range(0, n, per_call):
            idx = np.arange(start, start + per_call)
            idx = np.where(idx < n, idx, -1)
            seeds = row_seeds(seed, 2**31, start, len(idx) * k)
            r = self.run(params, prompts, idx, k, seeds, temperature)
            chunks.append(r.scores.reshape(len(idx), k, -1)[idx >= 0])
        return np.concatenate(chunks)


class RLStepper:
    """Builds rollouts, rewards and batches for the shared train step; evaluates.

    `spec` is what the step trains: the language model, or PPO's policy with its critic
    (`gpurl.models.scalar.ActorCriticSpec`); rollouts always use the language model.
    `reward_model` (PPO): a scalar model whose score of each completion is its reward."""

    def __init__(self, cfg: Config, spec: Any, tokenizer: Tokenizer, place: Placement,
                 train: Prompts, evals: Prompts | None, reward_names: Sequence[str],
                 step_fn: Callable, ref_params: Params | None,
                 reward_model: tuple[Any, Params] | None = None):
        self.cfg, self.spec, self.tokenizer, self.place = cfg, spec, tokenizer, place
        self.train, self.evals, self.step_fn, self.ref_params = train, evals, step_fn, ref_params
        self.policy = algorithms.policy_spec(spec)
        self.actor_critic = self.policy is not spec
        self.reward_model = reward_model
        # With a reward model and no reward functions named, the functions (the data's
        # answer check) only report; the reward model's score is the reward.
        self.function_weight = 0.0 if reward_model is not None and not cfg.rewards else 1.0
        self.kl = ppo.AdaptiveKL(cfg.algo.beta, cfg.algo.kl_target, cfg.algo.kl_horizon)
        # LoRA: the reference is the train state's own frozen base (adapters read as 0)
        self.base_ref = ref_params is None and cfg.algo.beta > 0 and cfg.model.lora.rank > 0
        self.group = cfg.algo.num_generations
        self.rewards = load_rewards(reward_names, cfg.reward_weights or None,
                                    cfg.rewards_on_error, cfg.reward_timeout_s)
        longest = max(len(t) for t in train.tokens + (evals.tokens if evals else []))
        self.engine = Rollouts(self.policy, tokenizer, cfg.rollout, cfg.mesh, self.rewards,
                               bucket(longest, MIN_PROMPT_BUCKET), placement_devices(cfg.mesh)[1])
        self.sync = WeightSync(algorithms.policy_params(spec, place.state.params),
                               self.engine.sampler.param_shardings)
        # rollout.async with split placement: step s+1's first rollout round is generated
        # with the parameters step s starts from, while step s trains (one step off-policy).
        self.overlap = cfg.rollout.async_ and not self.sync.colocated
        self._prefetched: tuple[int, _Round] | None = None
        self.max_new = cfg.rollout.max_new_tokens
        self._check_rows()
        self._assemble = jax.jit(self._assemble_fn, out_shardings=place.batch)
        self._prepare = jax.jit(self._prepare_fn, out_shardings=(place.batch, replicated(place.mesh)))

    def _check_rows(self) -> None:
        rows = self.cfg.train.batch_size * self.group
        count = runtime.process_count()
        shards = self.engine.sampler.mesh.shape["data"]
        if self.cfg.train.batch_size % count or rows % max(shards, 1):
            raise ConfigError(
                f"train.batch_size={self.cfg.train.batch_size} prompts x algo.num_generations="
                f"{self.group} = {rows} rows must split evenly over {count} processes and "
                f"{shards} rollout data shards; change train.batch_size.")

    def _to_trainer(self, x: jax.Array) -> jax.Array:
        """Rollout rows onto the trainer mesh. Split placement: through this host (a few
        KB of tokens), since each process's rows are on its own rollout devices and go to
        its own trainer devices; a device-to-device copy across device sets would need a
        cross-host transfer that multi-process GPU runtimes do not offer for this case."""
        if self.sync.colocated:
            return jax.device_put(x, self.place.batch)
        local = np.concatenate([rows for _, rows in local_rows(x)])
        return jax.make_array_from_process_local_data(self.place.batch, local)

    def _rewards(self, r: _Round) -> np.ndarray:
        """Total reward of each row with DAPO's overlong shaping; padding rows 0."""
        algo = self.cfg.algo
        shaped = self.function_weight * r.scores[:, 0] + overlong_penalty(
            r.lengths, self.max_new, algo.overlong_buffer, algo.overlong_penalty)
        return np.where(r.valid, shaped, 0.0).astype(np.float32)

    # ------------------------------------------------------------------ batch on device

    def _assemble_fn(self, rounds: list[tuple], select_K: jax.Array, keep_K: jax.Array) -> dict:
        """Concatenates rounds and keeps rows `select_K` (whole groups, in order), grouped
        by prompt: every array's leading axis is the P prompts, so micro-batches and
        shards split whole groups."""
        g = self.group
        cat = [jnp.concatenate([r[i] for r in rounds]) for i in range(5)]
        prompt_BxW, plen_B, comp_BxN, clen_B, clp_BxN = (x[select_K] for x in cat)
        p, n = select_K.shape[0] // g, comp_BxN.shape[1]
        real_BxN = jnp.arange(n)[None, :] < clen_B[:, None]
        grouped = lambda x: x.reshape(p, g, *x.shape[1:])  # noqa: E731
        return {"prompt_tokens": prompt_BxW[::g].astype(jnp.int32),
                "prompt_lengths": plen_B[::g].astype(jnp.int32),
                "completions": grouped(jnp.where(real_BxN, comp_BxN, self.tokenizer.pad_id)),
                "completion_lengths": grouped(clen_B.astype(jnp.int32)),
                "comp_mask": grouped((real_BxN & keep_K[:, None]).astype(jnp.float32)),
                "sampler_logprobs": grouped(jnp.where(real_BxN, clp_BxN, 0.0))}

    def _prepare_fn(self, params: Params, ref_params: Params | None, reward_model: Any,
                    batch: dict, rewards_K: jax.Array, kl_coef: jax.Array) -> tuple[dict, dict]:
        """Reference / old log-probs, KL-in-reward, advantages (PPO: values, GAE)."""
        algo, temp = self.cfg.algo, self.cfg.rollout.temperature
        if self.base_ref:
            ref_params = lora.disabled(algorithms.policy_params(self.spec, params))
        if self.actor_critic:
            rm = None if reward_model is None else (self.reward_model[0], reward_model)
            return ppo.prepare(algo, self.spec, temp, params, ref_params, rm, batch,
                               rewards_K, kl_coef)
        out = dict(batch)
        if ref_params is not None:
            out["ref_logprobs"] = group_logprobs(self.policy, ref_params, batch, temp)[0]
        if algo.num_iterations > 1 or algo.tis_cap is not None:
            out["old_logprobs"] = group_logprobs(self.policy, params, batch, temp)[0]
        if ref_params is not None and algo.kl_in_reward:
            old = out.get("old_logprobs", batch["sampler_logprobs"])
            kl_K = (kl_estimate(old, out["ref_logprobs"], algo.kl_estimator)
                    * batch["comp_mask"]).sum(-1).reshape(-1)
            rewards_K = rewards_K - algo.beta * kl_K
        adv_K = group_advantages(rewards_K, self.group, algo.advantage, algo.adv_eps)
        out["advantages"] = adv_K.reshape(-1, self.group)
        return out, {}

    # ------------------------------------------------------------------ the step

    def _round(self, params: Params, step: int, rnd: int) -> _Round:
        """Rollout round `rnd` of `step`: its prompts and seeds are functions of both."""
        cfg, algo = self.cfg, self.cfg.algo
        stream = step * (1 + algo.max_refills) + rnd if algo.dynamic_sampling else step
        idx = step_indices(len(self.train), cfg.train.batch_size, stream, cfg.train.seed)
        return self.engine.run(params, self.train, idx, self.group,
                               row_seeds(cfg.train.seed, step, rnd, len(idx) * self.group))

    def step(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        cfg, algo = self.cfg, self.cfg.algo
        prompts_per_step = cfg.train.batch_size
        t0 = time.perf_counter()
        params = self.sync(algorithms.policy_params(self.spec, state.params))
        jax.block_until_ready(params)
        t_sync = time.perf_counter() - t0
        rounds, rewards, kept, dropped = [], [], [], []
        for rnd in range(1 + (algo.max_refills if algo.dynamic_sampling else 0)):
            if rnd == 0 and self._prefetched is not None and self._prefetched[0] == step:
                r = self._prefetched[1]  # generated while the previous step trained
            else:
                r = self._round(params, step, rnd)
            rewards.append(self._rewards(r))
            keep, drop = select_groups(rewards[-1], self.group, prompts_per_step,
                                       algo.dynamic_sampling)
            kept += [(len(rounds), g) for g in keep]
            dropped += [(len(rounds), g) for g in drop]
            rounds.append(r)
            if len(kept) >= prompts_per_step:
                break
        self._prefetched = None
        kept_groups = kept[:prompts_per_step]
        groups = kept_groups + dropped[:prompts_per_step - len(kept_groups)]  # fillers: no loss
        keep_K = np.repeat(np.arange(len(groups)) < len(kept_groups), self.group)
        offsets = np.cumsum([0] + [r.rollout.lengths.shape[0] for r in rounds])
        select_K = np.asarray([offsets[i] + rounds[i].positions[g * self.group + j]
                               for i, g in groups for j in range(self.group)])
        rewards_K = np.asarray([rewards[i][g * self.group + j]
                                for i, g in groups for j in range(self.group)], np.float32)
        r0 = rounds[0]
        t2 = time.perf_counter()
        parts = [tuple(self._to_trainer(x) for x in
                       (r.prompt_tokens, r.prompt_lengths, r.rollout.tokens, r.rollout.lengths,
                        r.rollout.logprobs)) for r in rounds]
        batch = self._assemble(parts, jnp.asarray(select_K, jnp.int32), jnp.asarray(keep_K))
        rm_params = None if self.reward_model is None else self.reward_model[1]
        batch, prepared = self._prepare(state.params, self.ref_params, rm_params, batch,
                                        jnp.asarray(rewards_K), jnp.float32(self.kl.value))
        metrics_dev: dict[str, Any] = {}
        nonfinite = 0.0
        for _ in range(algo.num_iterations):
            state, metrics_dev = self.step_fn(state, batch)  # dispatched, not awaited
            nonfinite = nonfinite + metrics_dev["nonfinite"]  # updates left out, all iterations
        t_overlap = 0.0
        if self.overlap and step + 1 < cfg.train.steps:
            t3 = time.perf_counter()
            self._prefetched = (step + 1, self._round(params, step + 1, 0))
            t_overlap = time.perf_counter() - t3
        metrics = {k: float(v) for k, v in jax.device_get({**metrics_dev, **prepared}).items()}
        metrics["nonfinite"] = float(nonfinite)
        if "kl/rollout" in metrics:
            self.kl.update(metrics["kl/rollout"], len(rewards_K))
        t_train = time.perf_counter() - t2 - t_overlap

        g0 = rewards[0].reshape(-1, self.group)  # round 0: the unfiltered batch
        metrics.update({
            "reward/mean": float(g0.mean()), "reward/std": float(g0.std(-1).mean()),
            "reward/batch_mean": float(rewards_K.mean()),
            "completion/length": float(r0.lengths.mean()),
            "completion/truncated": float((r0.lengths >= self.max_new).mean()),
            "groups/all_equal": float(((g0.max(-1) - g0.min(-1)) <= 1e-9).mean()),
            "groups/kept": float(len(kept_groups)), "rollout/rounds": float(len(rounds)),
            "time/sync_s": t_sync, "time/rollout_s": sum(r.rollout_s for r in rounds),
            "time/reward_s": sum(r.reward_s for r in rounds), "time/train_s": t_train,
        })
        if "reward/model" in metrics:  # scored on device, after the host saw the rewards
            metrics["reward/mean"] += metrics["reward/model"]
            metrics["reward/batch_mean"] += metrics["reward/model"]
        if self.overlap:
            metrics["time/overlapped_rollout_s"] = t_overlap  # next step's, during training
        if cfg.rewards_on_error == "zero":  # rows scored 0 because a reward function failed
            metrics["reward/errors"] = float(sum((r.scores[:, -1] * r.valid).sum() for r in rounds))
        for f, reward in enumerate(self.rewards):
            metrics[f"reward/{reward.name}"] = float(r0.scores[:, 1 + f].mean())
        return state, metrics

    def state_meta(self) -> dict[str, float]:
        """What a checkpoint records beside the arrays: the adaptive KL coefficient."""
        return {"kl_coef": self.kl.value}

    def restore_meta(self, meta: dict) -> None:
        self.kl.value = float(meta.get("kl_coef", self.kl.value))

    def evaluate(self, params: Params) -> dict[str, float]:
        params = algorithms.policy_params(self.spec, params)
        return self.engine.evaluate(self.sync(params), self.evals, self.cfg.train.eval_pass_k,
                                    self.cfg.train.eval_batch_size, self.cfg.train.seed)
