"""One step of supervised fine-tuning, and held-out loss, token accuracy and perplexity.

    rows of step s (a pure function of the seed and s; each process loads its slice)
      -> the shared train step on B x T token rows.
"""

from __future__ import annotations


import numpy as np
import jax

from gpurl.config import Config, ConfigError, DataConfig, TrainConfig
from gpurl.data.batching import eval_batches, process_rows, step_indices, take
from gpurl.data.packing import split_token_rows
from gpurl.data.sft import TokenRows, encode_sft
from gpurl.data.sources import load_examples
from gpurl.distributed import runtime
from gpurl.distributed.mesh import abstract, sharded
from gpurl.plan.programs import Kind, ProgramRecord
from gpurl.train.step import TrainState, make_eval_step
from gpurl.train.stepper import Setup, Stepper


class SFTStepper(Stepper):
    """Batches of (prompt, completion) rows with loss on the completion."""

    @classmethod
    def build(cls, setup: Setup, cfg: Config) -> "SFTStepper":
        return cls(setup, cfg.data, cfg.train)

    def __init__(self, setup: Setup, data: DataConfig, train: TrainConfig):
        self.setup, self.train = setup, train
        train_examples, eval_examples = load_examples(data)
        self.rows = encode_sft(train_examples, setup.tokenizer, data)
        self.evals: TokenRows | None = (encode_sft(eval_examples, setup.tokenizer, data)
                                        if eval_examples else None)
        self.has_eval = self.evals is not None
        self._eval_fn = make_eval_step(setup.spec, setup.objective, setup.place,
                                       setup.teacher.shardings if setup.teacher else None)
        self.context = setup.place.mesh.shape.get("context", 1)

    def _laid_out(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows as the train step takes them: split over the context axis when the mesh
        has one (`gpurl.data.packing.split_token_rows`), else as they are."""
        if self.context == 1:
            return rows
        if "pixels" in rows:
            raise ConfigError("rows with images cannot be split over a context axis yet; "
                              "set mesh.context=1 for a vision-language model.")
        return split_token_rows(rows, self.context, self.rows.pad_id)

    def describe(self) -> str:
        return f"{len(self.rows)} train rows ({self.rows.num_truncated} truncated)"

    def step(self, state: TrainState, step: int) -> tuple[TrainState, dict]:
        indices = step_indices(len(self.rows), self.train.batch_size, step, self.train.seed)
        local = process_rows(indices, runtime.process_index(), runtime.process_count())
        batch = self.setup.to_global(self._laid_out(take(self.rows, local)))
        return self.setup.step_fn(state, batch, self.setup.frozen_teacher())

    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        rows = self._laid_out(take(self.rows, np.arange(1)))
        return {k: jax.ShapeDtypeStruct((self.train.batch_size,) + v.shape[1:], v.dtype)
                for k, v in rows.items()}

    def programs(self) -> list[ProgramRecord]:
        place = self.setup.place
        return [ProgramRecord(Kind.EVAL, self._eval_fn,
                              (abstract(place.abstract_state.params, place.state.params),
                               sharded(self.batch_spec(), place.batch),
                               self.setup.abstract_teacher()), "call (a batch of held-out rows)")]

    def evaluate(self, params) -> dict[str, float]:
        totals: dict[str, float] = {}
        rank, count = runtime.process_index(), runtime.process_count()
        for batch in eval_batches(self.evals, self.train.eval_batch_size):
            local = self._laid_out({k: v[process_rows(np.arange(len(v)), rank, count)]
                                    for k, v in batch.items()})
            metrics = self._eval_fn(params, self.setup.to_global(local), self.setup.frozen_teacher())
            for k, v in jax.device_get(metrics).items():
                totals[k] = totals.get(k, 0.0) + float(v)
        tokens = max(totals.pop("tokens", 0.0), 1.0)
        out = {f"eval/{k}": v / tokens for k, v in totals.items()}
        # exp of the data's unsmoothed NLL (the loss is label-smoothed when
        # algo.label_smoothing > 0, and a part of logit distillation's)
        out["eval/perplexity"] = float(np.exp(min(out.get("eval/nll", 0.0), 50.0)))
        return out
