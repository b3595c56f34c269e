"""One step of DPO / SimPO / ORPO / reward-model training, and held-out evaluation of
preferences and of the task.

    pairs of step s (a pure function of the seed and s; each process loads its slice)
      -> [dpo: reference log-probs of both completions from the frozen initial model, in a
          jitted step; the train step never differentiates through them]
      -> the shared train step (`gpurl.train.step`) on the P x 2 pair batch.

Evaluation: the preference metrics of every held-out pair (implicit-reward accuracy and
margin, the policy's own log-prob ranking, the loss; a reward model's Bradley-Terry
figures), and when the held-out rows are task prompts with answers (the built-in
`addition_prefs`, or jsonl rows with an "answer") and the trained tree generates text,
the greedy task accuracy from the same sampler and rewards RL evaluates with.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.algorithms.dpo import PairObjective, sequence_logps
from gpurl.config import Config, DataConfig, MeshConfig, RewardsConfig, RolloutConfig, TrainConfig
from gpurl.data import packing
from gpurl.data.batching import process_rows, step_indices
from gpurl.data.preferences import encode_pairs, load_pairs, take_pairs
from gpurl.data.sources import default_rewards
from gpurl.distributed import runtime
from gpurl.distributed.mesh import abstract, batch_divisor, replicated, sharded
from gpurl.distributed.sync import WeightSync
from gpurl.models.spec import Params
from gpurl.plan.programs import Kind, ProgramRecord
from gpurl.rewards import from_config as load_rewards
from gpurl.rollout.rounds import Rounds, rollout_engine
from gpurl.rollout.prompts import encode_prompts
from gpurl.rollout.requests import prompt_width
from gpurl.train.step import TrainState, jit_rows
from gpurl.train.stepper import Setup, Stepper


class PreferenceStepper(Stepper):
    """Pair batches (with reference log-probs for DPO) for the shared train step;
    evaluates held-out pairs and, where the data allows, held-out task accuracy."""

    eval_at_start = True

    @classmethod
    def build(cls, setup: Setup, cfg: Config) -> "PreferenceStepper":
        return cls(setup, cfg.data, cfg.train, cfg.rollout, cfg.mesh, cfg.rewards)

    def __init__(self, setup: Setup, data: DataConfig, train: TrainConfig,
                 rollout: RolloutConfig, mesh: MeshConfig, rewards: RewardsConfig):
        self.setup, self.train_cfg = setup, train
        spec, place = setup.spec, setup.place
        train_rows, eval_rows = load_pairs(data)
        self.train = encode_pairs(train_rows, setup.tokenizer, data, "train")
        self.evals = encode_pairs(eval_rows, setup.tokenizer, data, "eval") if eval_rows else None
        self.has_eval = self.evals is not None
        # The reference is the initial policy (`gpurl.train.frozen.Reference`): a separate
        # copy rebuilt (not checkpointed) on resume, or with LoRA the train state's base.
        self.reference = setup.frozen.reference
        # A pair loss over summed log-probs (DPO, SimPO, ORPO) is evaluated on log-probs
        # computed once per batch, the reference's with the same compiled function, so at
        # step 0 DPO's implicit rewards are exactly 0; a reward model on its own loss.
        self.pair_loss = (setup.objective.pair_loss
                          if isinstance(setup.objective, PairObjective) else None)
        self._logps = jit_rows(functools.partial(sequence_logps, spec.policy), place,
                               in_shardings=(place.state.params, place.batch),
                               out_shardings=place.batch) if spec.policy is not None else None
        self._ref_cache: dict[int, jax.Array] = {}
        # Packed rows (train.packed): each pair's prompt once, its two completions after it
        # in the same row (`gpurl.data.packing`, whole groups), micro-batches by tokens.
        self.shards = batch_divisor(place.mesh, mesh.train_rules)
        self.context = place.mesh.shape.get("context", 1)
        width = self.train.prompt_tokens.shape[1] + self.train.completions.shape[2]
        self.budget = train.micro_batch_tokens or packing.default_budget(
            train.batch_size // train.num_micro_batches, 2, width, self.shards)
        self._gather = jax.jit(functools.partial(packing.gather, pad_id=setup.tokenizer.pad_id),
                               out_shardings=place.batch)
        self._metrics = jit_rows(self._eval_metrics, place,
                                 out_shardings=replicated(place.mesh))
        self.task = (_TaskEval(setup, data, rollout, mesh, rewards, self.evals.rows, train)
                     if self.evals is not None and spec.policy is not None
                     and _has_task(rewards, self.evals.rows) else None)

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        pairs = take_pairs(self.train, np.arange(1))
        spec = {k: jax.ShapeDtypeStruct((self.train_cfg.batch_size,) + v.shape[1:], v.dtype)
                for k, v in pairs.items()}
        if self.train_cfg.packed:  # a longest pair: w - 1 prompt slots, 2 x (n + 1) branches
            (p, w), n = spec["prompt_tokens"].shape, spec["completions"].shape[2]
            spec.update(packing.planned_spec(p, 2, w + 2 * n + 1, n, self.budget, self.shards,
                                             self.context))
            spec = jax.eval_shape(self._gather, spec)
        if self.reference is not None:
            spec["ref_logps"] = jax.ShapeDtypeStruct((self.train_cfg.batch_size, 2), jnp.float32)
        return spec

    def programs(self) -> list[ProgramRecord]:
        """The sequence log-probs (the reference's, and held-out pairs')."""
        if self._logps is None:
            return []
        place = self.setup.place
        pairs = {k: v for k, v in self.batch_spec().items() if k != "ref_logps"}
        return [ProgramRecord(Kind.SEQUENCE_LOGPS, self._logps,
                              (abstract(place.abstract_state.params, place.state.params),
                               sharded(pairs, place.batch)), "call (a step's pairs)")]

    def resident_bytes(self) -> float:
        """The frozen reference beside the train state."""
        return self.setup.frozen.bytes_per_device(teacher=False)

    def describe(self) -> str:
        skipped = self.train.num_skipped + (self.evals.num_skipped if self.evals else 0)
        task = f", task eval: {self.task.describe}" if self.task else ""
        what = ("reward model (Bradley-Terry)" if self.pair_loss is None else "reference "
                + ("frozen initial model" if self.reference is not None else "none"))
        return (f"{len(self.train)} train pairs, {len(self.evals) if self.evals else 0} eval "
                f"pairs ({skipped} longer than data.max_len skipped), {what}{task}")

    def _pairs(self, pairs: Any, indices: np.ndarray) -> dict[str, jax.Array]:
        local = indices[process_rows(np.arange(len(indices)), runtime.process_index(),
                                     runtime.process_count())]
        return self.setup.to_global(take_pairs(pairs, local))

    def _reference(self, params: Params) -> Params:
        """The reference's parameters: the frozen initial model's, or a LoRA run's base."""
        return self.reference.inside(params, self.reference.value)

    def step(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        train = self.train_cfg
        indices = step_indices(len(self.train), train.batch_size, step, train.seed)
        batch, static = self._pairs(self.train, indices), ()
        if train.packed:
            batch, static = self._pack(batch, indices)
        if self.reference is not None:
            batch["ref_logps"] = self._logps(self._reference(state.params), batch)[0]
        return self.setup.step_fn(state, batch, None, *static)

    def _pack(self, batch: dict[str, jax.Array], indices: np.ndarray
              ) -> tuple[dict[str, jax.Array], tuple[int, ...]]:
        """The pair batch (pairs `indices`) with its packed rows, planned from the global
        batch's lengths (every process holds every pair, so every process plans the same)."""
        pairs = self.train
        plan = packing.plan(pairs.prompt_lengths[indices], pairs.completion_lengths[indices],
                            pairs.prompt_tokens.shape[1], pairs.completions.shape[2],
                            self.budget, self.shards,
                            packing.attention_cost(self.setup.spec.cfg.d_model), whole_groups=True,
                            context=self.context)
        static = (plan.num_micro,) if plan.num_micro > 1 else ()  # 1: as planned
        return dict(self._gather({**batch, **packing.put(plan, self.setup.place.batch)})), static

    def evaluate(self, params: Params) -> dict[str, float]:
        figures = self._pair_figures(params)
        if self.task is not None:
            figures.update(self.task(params))
        return figures

    def _eval_metrics(self, params: Params, batch: dict, logp_Px2: Any, len_Px2: Any,
                      ref_Px2: Any, norm: jax.Array) -> dict:
        if self.pair_loss is not None:
            return self.pair_loss(logp_Px2, len_Px2, ref_Px2, batch["pair_mask"], norm)[1]
        metrics = self.setup.objective.loss(self.setup.spec, params, batch, norm)[1]
        return {k: v for k, v in metrics.items() if k != "tokens"}

    def _pair_figures(self, params: Params) -> dict[str, float]:
        """Preference metrics averaged over every held-out pair."""
        size = self.train_cfg.eval_batch_size
        norm = jnp.float32(len(self.evals))
        totals: dict[str, float] = {}
        for b, start in enumerate(range(0, len(self.evals), size)):
            idx = np.arange(start, start + size)
            batch = self._pairs(self.evals, np.where(idx < len(self.evals), idx, -1))
            logp_Px2 = len_Px2 = ref_Px2 = None
            if self.pair_loss is not None:
                logp_Px2, len_Px2 = self._logps(params, batch)
            if self.reference is not None:
                if b not in self._ref_cache:
                    self._ref_cache[b] = self._logps(self._reference(params), batch)[0]
                ref_Px2 = self._ref_cache[b]
            metrics = self._metrics(params, batch, logp_Px2, len_Px2, ref_Px2, norm)
            for k, v in jax.device_get(metrics).items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return {f"eval/{k}": v for k, v in totals.items()}


def _has_task(rewards: RewardsConfig, rows: list[dict]) -> bool:
    """Task accuracy needs rewards to score greedy answers: the run's own, or the data's
    default (answer matching) when every held-out row has an "answer"."""
    return bool(rewards.functions) or all("answer" in row for row in rows)


class _TaskEval:
    """Greedy accuracy on the distinct held-out prompts (`Rounds.evaluate`, as in RL)."""

    def __init__(self, setup: Setup, data: DataConfig, rollout: RolloutConfig,
                 mesh: MeshConfig, rewards: RewardsConfig, rows: list[dict],
                 train: TrainConfig):
        self.train = train
        distinct = list({row["prompt"]: row for row in rows}.values())
        self.prompts, _ = encode_prompts(distinct, setup.tokenizer, data.chat_template,
                                         data.max_len, "eval")
        functions = load_rewards(rewards, default_rewards(data))
        width = prompt_width(max(len(t) for t in self.prompts.tokens))
        engine = rollout_engine(setup.spec.policy, setup.tokenizer, rollout, mesh)
        self.rounds = Rounds(engine, setup.tokenizer, functions, width)
        self.sync = WeightSync(setup.place.state.params, engine.abstract_params)
        self.describe = (f"greedy accuracy on {len(self.prompts)} prompts "
                         f"({functions[0].name} >= 1)")

    def __call__(self, params: Params) -> dict[str, Any]:
        return self.rounds.evaluate(self.sync(params), self.prompts, 0,
                                    self.train.eval_batch_size, self.train.seed)
