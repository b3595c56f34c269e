"""One step of DPO / SimPO / ORPO, and held-out evaluation of preferences and of the task.

    pairs of step s (a pure function of the seed and s; each process loads its slice)
      -> [dpo: reference log-probs of both completions from the frozen initial model, in a
          jitted prepare step; the train step never differentiates through them]
      -> the shared train step (`gpurl.train.step`) on the P x 2 pair batch.

Evaluation: the preference metrics of every held-out pair (implicit-reward accuracy and
margin, the policy's own log-prob ranking, the loss), and when the held-out rows are task
prompts with answers (the built-in `addition_prefs`, or jsonl rows with an "answer"), the
greedy task accuracy from the same sampler and rewards RL evaluates with.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.algorithms.dpo import needs_reference, pair_loss, sequence_logps
from gpurl.algorithms.rm import bradley_terry, pair_scores
from gpurl.config import Config
from gpurl.data.batching import process_rows, step_indices
from gpurl.data.preferences import encode_pairs, load_pairs, take_pairs
from gpurl.distributed import runtime
from gpurl.distributed.mesh import replicated
from gpurl.models import ModelSpec, Params, lora
from gpurl.models.scalar import ScalarSpec
from gpurl.models.tokenizer import Tokenizer
from gpurl.train.step import Placement, TrainState


class PreferenceStepper:
    """Builds pair batches (with reference log-probs for DPO) for the shared train step;
    evaluates held-out pairs and, where the data allows, held-out task accuracy."""

    def __init__(self, cfg: Config, spec: ModelSpec, tokenizer: Tokenizer, place: Placement,
                 step_fn: Callable, init: Callable[[], TrainState]):
        self.cfg, self.place, self.step_fn = cfg, place, step_fn
        train_rows, eval_rows = load_pairs(cfg.data)
        self.train = encode_pairs(train_rows, tokenizer, cfg.data, "train")
        self.evals = encode_pairs(eval_rows, tokenizer, cfg.data, "eval") if eval_rows else None
        # The reference is the initial policy; it is rebuilt (not checkpointed) on resume.
        # With LoRA the reference is the frozen base inside the train state (`_reference`).
        self.base_ref = needs_reference(cfg.algo) and cfg.model.lora.rank > 0
        self.ref_params = init().params if needs_reference(cfg.algo) and not self.base_ref else None
        self._logps = jax.jit(functools.partial(sequence_logps, spec),
                              in_shardings=(place.state.params, place.batch),
                              out_shardings=place.batch)
        self._ref_cache: dict[int, jax.Array] = {}
        self._metrics = jax.jit(functools.partial(pair_loss, cfg.algo),
                                out_shardings=replicated(place.mesh))
        # algo=rm trains a scalar model: its held-out figures are Bradley-Terry's, and it
        # has no language-model head to answer task prompts with.
        self.reward_model = isinstance(spec, ScalarSpec)
        if self.reward_model:
            self._rm_metrics = jax.jit(
                lambda params, batch, norm: bradley_terry(pair_scores(spec, params, batch),
                                                          batch["pair_mask"], norm)[1],
                in_shardings=(place.state.params, place.batch, None),
                out_shardings=replicated(place.mesh))
        self.task = (_TaskEval(cfg, spec, tokenizer, place, self.evals.rows)
                     if self.evals is not None and not self.reward_model
                     and _has_task(cfg, self.evals.rows) else None)

    def describe(self) -> str:
        skipped = self.train.num_skipped + (self.evals.num_skipped if self.evals else 0)
        task = f", task eval: {self.task.describe}" if self.task else ""
        what = ("reward model (Bradley-Terry)" if self.reward_model else "reference "
                + ("frozen initial model" if self.ref_params is not None or self.base_ref
                   else "none"))
        return (f"{len(self.train)} train pairs, {len(self.evals) if self.evals else 0} eval "
                f"pairs ({skipped} longer than data.max_len skipped), {what}{task}")

    def _global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """Each process passes only its own pairs; JAX assembles the global batch."""
        return {k: jax.make_array_from_process_local_data(self.place.batch, v)
                for k, v in batch.items()}

    def _reference(self, params: Params) -> Params:
        """The reference's parameters: the frozen initial model's, or a LoRA run's base."""
        return lora.disabled(params) if self.base_ref else self.ref_params

    def step(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        train = self.cfg.train
        indices = step_indices(len(self.train), train.batch_size, step, train.seed)
        local = process_rows(indices, runtime.process_index(), runtime.process_count())
        batch = self._global(take_pairs(self.train, local))
        if self.ref_params is not None or self.base_ref:
            batch["ref_logps"] = self._logps(self._reference(state.params), batch)[0]
        return self.step_fn(state, batch)

    def evaluate(self, params: Params) -> dict[str, float]:
        figures = self._pair_figures(params)
        if self.task is not None:
            figures.update(self.task(params))
        return figures

    def _pair_figures(self, params: Params) -> dict[str, float]:
        """Preference metrics averaged over every held-out pair. The reference log-probs
        come from the same compiled function as the policy's, so at step 0 DPO's implicit
        rewards are exactly 0 (no pair counts as ranked right by rounding noise)."""
        size, count = self.cfg.train.eval_batch_size, runtime.process_count()
        norm = jnp.float32(len(self.evals))
        totals: dict[str, float] = {}
        for b, start in enumerate(range(0, len(self.evals), size)):
            idx = np.arange(start, start + size)
            idx = np.where(idx < len(self.evals), idx, -1)
            local = idx[process_rows(np.arange(size), runtime.process_index(), count)]
            batch = self._global(take_pairs(self.evals, local))
            if self.reward_model:
                for k, v in jax.device_get(self._rm_metrics(params, batch, norm)).items():
                    totals[k] = totals.get(k, 0.0) + float(v)
                continue
            logp_Px2, len_Px2 = self._logps(params, batch)
            ref_Px2 = None
            if self.ref_params is not None or self.base_ref:
                if b not in self._ref_cache:
                    self._ref_cache[b] = self._logps(self._reference(params), batch)[0]
                ref_Px2 = self._ref_cache[b]
            _, metrics = self._metrics(logp_Px2, len_Px2, ref_Px2, batch["pair_mask"], norm)
            for k, v in jax.device_get(metrics).items():
                totals[k] = totals.get(k, 0.0) + float(v)
        return {f"eval/{k}": v for k, v in totals.items()}


def _has_task(cfg: Config, rows: list[dict]) -> bool:
    """Task accuracy needs rewards to score greedy answers: the run's own, or the data's
    default (answer matching) when every held-out row has an "answer"."""
    return bool(cfg.rewards) or all("answer" in row for row in rows)


class _TaskEval:
    """Greedy accuracy on the distinct held-out prompts (`Rollouts.evaluate`, as in RL)."""

    def __init__(self, cfg: Config, spec: ModelSpec, tokenizer: Tokenizer, place: Placement,
                 rows: list[dict]):
        from gpurl.data import default_rewards
        from gpurl.distributed.sync import WeightSync
        from gpurl.rewards import load as load_rewards
        from gpurl.rollout.sampler import MIN_PROMPT_BUCKET, bucket
        from gpurl.train.rl import Rollouts, encode_prompts

        self.cfg = cfg
        distinct = list({row["prompt"]: row for row in rows}.values())
        self.prompts, _ = encode_prompts(distinct, tokenizer, cfg.data.chat_template,
                                         cfg.data.max_len, "eval")
        rewards = load_rewards(list(cfg.rewards) or default_rewards(cfg.data),
                               cfg.reward_weights or None)
        width = bucket(max(len(t) for t in self.prompts.tokens), MIN_PROMPT_BUCKET)
        self.engine = Rollouts(spec, tokenizer, cfg.rollout, cfg.mesh, rewards, width)
        self.sync = WeightSync(place.state.params, self.engine.sampler.param_shardings)
        self.describe = (f"greedy accuracy on {len(self.prompts)} prompts "
                         f"({rewards[0].name} >= 1)")

    def __call__(self, params: Params) -> dict[str, Any]:
        return self.engine.evaluate(self.sync(params), self.prompts, 0,
                                    self.cfg.train.eval_batch_size, self.cfg.train.seed)
