"""One RL step, as a pipeline over device arrays, and held-out evaluation by sampling.

    sync:    trainer parameters -> the rollout layout (`WeightSync`)
    collect: rollout rounds of G completions per prompt, scored per shard, dynamic
             sampling, the trainer batch (`gpurl.rollout.collect`)
    prepare: the algorithm's registered prepare step: log-probs, advantages, values
    train:   `algo.num_iterations` dispatches of the shared train step

Every process handles only its own rows, and rewards stay on device, sharded, from the
scorer to the advantages. The step returns device metrics and never waits for them: the
loop reads step s's metrics after dispatching step s+1.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.algorithms import behaviour
from gpurl.algorithms.rl import RLContext, RLInputs
from gpurl.config import (Config, ConfigError, DataConfig, EnvConfig, MeshConfig,
                          PolicyGradientConfig, RewardsConfig, RolloutConfig, TrainConfig)
from gpurl.data.sources import default_rewards, load_prompts
from gpurl.distributed import layout
from gpurl.data import packing
from gpurl.data.rollouts import RolloutBatch
from gpurl.distributed.mesh import batch_divisor, placement_devices, replicated
from gpurl.distributed.sync import WeightSync
from gpurl.plan.memory import device_memory
from gpurl.rewards import from_config as load_rewards
from gpurl.rollout.collect import Collector, Shaping
from gpurl.rollout.rounds import Rounds, rollout_engine
from gpurl.rollout.prompts import Prompts, encode_prompts, prompt_tools
from gpurl.rollout.requests import prompt_width
from gpurl.rollout.sources import batch_source
from gpurl.rollout.weights import PolicyWeights
from gpurl.serve.agents import AgentRunner
from gpurl.train.metrics import DeviceTimer, Sum, Within
from gpurl.train.step import TrainState, jit_rows
from gpurl.train.rl_programs import RLPrograms
from gpurl.train.stepper import Setup, Stepper


class RLStepper(RLPrograms, Stepper):
    """Rollouts, rewards and batches of an RL algorithm for the shared train step.

    The trained tree is the language model or PPO's policy with its critic; rollouts use
    the language model inside it (`spec.policy`)."""

    eval_at_start = True

    @classmethod
    def build(cls, setup: Setup, cfg: Config) -> "RLStepper":
        local = [d for d in setup.place.mesh.devices.flat if d.process_index == jax.process_index()]
        return cls(setup, cfg.algo, cfg.data, cfg.train, cfg.rollout, cfg.mesh, cfg.rewards,
                   env=cfg.env, memory=device_memory(cfg.plan, local[0])[0])

    @staticmethod
    def trainer_devices(mesh: MeshConfig) -> Sequence[jax.Device]:
        return placement_devices(mesh)[0]

    def __init__(self, setup: Setup, algo: PolicyGradientConfig, data: DataConfig,
                 train: TrainConfig, rollout: RolloutConfig, mesh: MeshConfig,
                 rewards: RewardsConfig, env: EnvConfig | None = None,
                 memory: float = float("inf")):
        self.setup, self.algo, self.train, self.rollout = setup, algo, train, rollout
        spec, place = setup.spec, setup.place
        self.prompts, self.evals, self.skipped = _prompts(data, setup, env, train)
        self.has_eval = self.evals is not None
        self.frozen = setup.frozen  # the reference, a reward model, a teacher (loaded late)
        # With an environment its reward is the task's; reward functions apply when named.
        self.functions = load_rewards(rewards, [] if env and env.on else default_rewards(data))
        # mesh.rollout_tp=auto: the width leaving the KV pool most room (colocated: beside the state)
        beside = (setup.place.state_bytes() + self.frozen.bytes_per_device()
                  if mesh.placement == "colocated" else 0.0)
        mesh, self.layout = layout.resolve(mesh, spec.policy, placement_devices(mesh)[1],
                                           memory - beside)
        self.engine = rollout_engine(spec.policy, setup.tokenizer, rollout, mesh,
                                     placement_devices(mesh)[1], env)
        self.rounds = _rounds(self.engine, setup.tokenizer, self.functions,
                              [self.prompts, self.evals], env, rollout)
        self.group = algo.num_generations * _rows_per(env)  # rows per prompt
        self.rounds.check_rows(train.batch_size, self.group)
        self.sync = WeightSync(spec.policy_params(place.state.params),
                               self.engine.abstract_params)
        # With a reward model and no reward functions named, the functions (the data's
        # answer check) only report; the reward model's score is the reward.
        shaping = Shaping(self.rounds.width, algo.overlong_buffer, algo.overlong_penalty,
                          0.0 if self.frozen.reward_model is not None and not rewards.functions
                          else 1.0)
        self.collector = Collector(
            self.rounds, self.prompts, group=self.group, batch_size=train.batch_size,
            seed=train.seed, shaping=shaping, drop_equal=algo.dynamic_sampling,
            rounds=1 + (algo.max_refills if algo.dynamic_sampling else 0),
            batch_sharding=place.batch, colocated=self.sync.colocated,
            pad_id=setup.tokenizer.pad_id)
        # rollout.mode: where the step's batches come from (off-policy ones are corrected:
        # the prepare step computes pi_old, `gpurl.algorithms.behaviour.behaviour_weights`)
        self.source = batch_source(rollout, self.collector, PolicyWeights(self.sync),
                                   self.prompts, group=self.group,
                                   batch_size=train.batch_size, seed=train.seed, steps=train.steps)
        self.overlap = self.source.off_policy
        self.carry = {k: jnp.float32(v) for k, v in setup.algorithm.carry(algo).items()}
        self._timer: DeviceTimer | None = None
        # Packed rows (train.packed): the plan's row shards and token budget per micro-batch
        self.shards = batch_divisor(place.mesh, mesh.train_rules)
        self.context = place.mesh.shape.get("context", 1)
        self.budget = train.micro_batch_tokens or packing.default_budget(
            train.batch_size // train.num_micro_batches, self.group,
            self.rounds.prompt_width + self.rounds.width, self.shards)
        reward_model = self.frozen.reward_model
        ctx = RLContext(spec, rollout.temperature, reward_model.spec if reward_model else None,
                        off_policy=self.overlap, rows_per_trajectory=_rows_per(env))
        self._prepare = jit_rows(functools.partial(self._prepare_fn, ctx), place,
                                 out_shardings=(place.batch, replicated(place.mesh),
                                               replicated(place.mesh)))

    def describe(self) -> str:
        reward_model = self.frozen.reward_model
        names = self.collector.describe_rewards(reward_model.path if reward_model else None)
        ahead = self.source.describe(behaviour.describe(self.algo, self.overlap))
        return (f"{len(self.prompts)} train prompts, {len(self.evals) if self.evals else 0} eval "
                f"prompts ({self.skipped} longer than data.max_len skipped), "
                f"G={self.algo.num_generations}, rewards: {names}{ahead}; rollout "
                f"{dict(self.engine.mesh.shape)} ({self.layout})")

    def _prepare_fn(self, ctx: RLContext, params: Any, ref_params: Any, rm_params: Any,
                    teacher: Any, rollout: RolloutBatch, packed: dict | None,
                    rewards_B: jax.Array, carry: dict) -> tuple[dict, dict, dict]:
        """The trainer batch of a rollout batch (`packed`: the packed layout's arrays,
        train.packed) through the algorithm's prepare function."""
        batch = rollout.arrays()
        if packed is not None:  # the packed rows' tokens, from the plan's indices
            batch = packing.gather({**batch, **packed}, self.collector.pad_id)
        reference = self.frozen.reference
        ref_params = reference.inside(params, ref_params) if reference is not None else None
        return self.setup.algorithm.prepare(
            self.algo, ctx, RLInputs(params, ref_params, rm_params, batch, rewards_B, carry,
                                     teacher))

    def step(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        got = self.source.next(step, self.setup.spec.policy_params(state.params))
        if self._timer is not None and got.computed_at is not None:
            self._timer.observe(got.computed_at)  # the previous step's train time ends
        t_sync = got.metrics.pop("time/sync_s")
        packed, static = None, ()
        if self.train.packed:  # planned from the hosts' lengths: no device is waited for
            plan = self._pack(got.batch, got.lengths())
            packed = packing.put(plan, self.setup.place.batch)
            static = (plan.num_micro,) if plan.num_micro > 1 else ()  # 1: as planned
        ref, rm, teacher = self.frozen.values()
        batch, prepared, self.carry = self._prepare(state.params, ref, rm, teacher, got.batch,
                                                    packed, got.rewards, self.carry)
        prepare = DeviceTimer(batch, start=got.assembled_at, watch=True)  # of time/train_s
        nonfinite = 0.0
        for _ in range(self.algo.num_iterations):
            state, metrics = self.setup.step_fn(state, batch, teacher, *static)  # dispatched, not awaited
            nonfinite = nonfinite + metrics["nonfinite"]  # updates left out, all iterations
        self._timer = DeviceTimer(nonfinite, start=got.assembled_at)  # assembly + prepare + train
        metrics = {**metrics, **prepared, **got.metrics, "nonfinite": nonfinite, "time/sync_s": t_sync,
                   "time/train_s": self._timer, "time/prepare_s": Within(prepare, self._timer)}
        if self.overlap:
            metrics["off_policy/lag"] = got.lag
        if "reward/model" in prepared:  # scored on the trainer mesh, after the functions
            for key in ("reward/mean", "reward/batch_mean"):
                metrics[key] = Sum(metrics[key], prepared["reward/model"])
        overlapped = self.source.after_dispatch(step)  # one_ahead: the next step's round 0
        if overlapped is not None:
            metrics["time/overlapped_rollout_s"] = overlapped
            self._timer.exclude(overlapped)
        return state, metrics

    def _pack(self, batch: RolloutBatch, lengths_PxG1: np.ndarray | None = None) -> packing.Plan:
        """A collected batch's packed layout, the same on every process (`plan_grouped`)."""
        return packing.plan_grouped(batch, lengths_PxG1, self.budget, self.shards,
                                    self.setup.spec.policy.cfg.d_model, self.context)

    def state_meta(self) -> dict[str, Any]:
        """The prepare step's carry (PPO's adaptive KL coefficient) and the batch source's
        state (the data position; in continuous mode, what is in flight)."""
        return {**{k: float(v) for k, v in self.carry.items()}, **self.source.state_meta()}

    def restore_meta(self, meta: dict) -> None:
        self.carry = {k: jnp.float32(meta.get(k, v)) for k, v in self.carry.items()}
        self.source.restore_meta(meta)

    def evaluate_sampled(self, params: Any) -> dict[str, float]:
        return self.rounds.evaluate(params, self.evals, self.train.eval_pass_k,
                                    self.train.eval_batch_size, self.train.seed)

    def sampler(self) -> tuple[Any, Callable[[Any], Any]]:
        return self.engine, lambda params: self.sync(self.setup.spec.policy_params(params))


def _rounds(engine: Any, tokenizer: Any, functions: list, prompts: list[Prompts | None],
            env: EnvConfig | None, rollout: RolloutConfig) -> Rounds:
    """The step's rounds, at the width of the longest of `prompts`; with env=agent, agents
    play their trajectories through the gateway (`gpurl.serve.agents`)."""
    longest = max(len(t) for p in prompts if p is not None for t in p.tokens)
    agents = (AgentRunner(env, engine, tokenizer, engine.stop_ids, rollout)
              if env is not None and env.agents else None)
    return Rounds(engine, tokenizer, functions, prompt_width(longest), env, agents)


def _check_images(train: TrainConfig, env: EnvConfig | None) -> None:
    """One sentence for what prompts with images cannot go through yet (continuous
    rollouts: `gpurl.rollout.sources.batch_source`)."""
    if env is not None and env.on:
        raise ConfigError("prompts with images go through single-turn rollouts only so far; "
                          "drop env or the images.")
    if train.packed:
        raise ConfigError("prompts with images train on padded rows so far; set "
                          "train.packed=false.")


def _rows_per(env: EnvConfig | None) -> int:
    """Rows one trajectory takes in the batch (env.agent_rows with agents, else 1)."""
    return env.rows_per_trajectory if env is not None else 1


def _prompts(data: DataConfig, setup: Setup, env: EnvConfig | None,
             config: TrainConfig) -> tuple[Prompts, Prompts | None, int]:
    """(train prompts, held-out prompts or None, how many were too long and skipped);
    chat prompts show the environment's tools."""
    train_rows, eval_rows = load_prompts(data)
    tools = prompt_tools(env)
    train, skipped = encode_prompts(train_rows, setup.tokenizer, data.chat_template,
                                    data.max_len, "train", tools)
    if train.pixels_shape is not None:
        _check_images(config, env)
    if not eval_rows:
        return train, None, skipped
    evals, eval_skipped = encode_prompts(eval_rows, setup.tokenizer, data.chat_template,
                                         data.max_len, "eval", tools)
    return train, evals, skipped + eval_skipped
