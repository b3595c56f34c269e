"""The one training loop shared by every algorithm.

It builds the mesh, data, model and optimizer from the frozen config, restores the
newest checkpoint in `run.dir` if there is one (parameters, optimizer, RNG and the data
position, which is a pure function of the step), then runs jitted steps, evaluating and
checkpointing on their cadences. The host reads step N's metrics after dispatching
step N+1 so the device never waits on logging.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import yaml

from gpurl import algorithms
from gpurl.config import Config, ConfigError, to_dict
from gpurl.data.batching import eval_batches, process_rows, step_indices, take
from gpurl.data.sft import TokenRows, encode_sft
from gpurl.data.sources import load_examples
from gpurl.distributed import runtime
from gpurl.distributed.mesh import batch_divisor, trainer_mesh
from gpurl.models import count_params, model_spec
from gpurl.models.tokenizer import load_tokenizer
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.metrics import MetricsSink
from gpurl.train.optim import lr_schedule, make_optimizer
from gpurl.train.step import Placement, make_eval_step, make_init, make_train_step, placement


class _Stop:
    """Set by SIGTERM (Slurm preemption, `kill`): the loop checkpoints and exits."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, *_: Any) -> None:
        self.requested = True


def _check_batch(cfg: Config, divisor: int) -> None:
    micro = cfg.train.batch_size // cfg.train.num_micro_batches
    if micro % divisor or cfg.train.eval_batch_size % divisor:
        raise ConfigError(
            f"the micro-batch ({micro} rows) and train.eval_batch_size "
            f"({cfg.train.eval_batch_size}) must be multiples of the {divisor} batch shards "
            f"of the mesh; change train.batch_size/micro_batch_size or mesh.data/mesh.fsdp.")


def _to_global(place: Placement, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Each process passes only its own rows; JAX assembles the global sharded batch."""
    return {k: jax.make_array_from_process_local_data(place.batch, v) for k, v in batch.items()}


def _train_batch(cfg: Config, rows: TokenRows, step: int) -> dict[str, np.ndarray]:
    indices = step_indices(len(rows), cfg.train.batch_size, step, cfg.train.seed)
    return take(rows, process_rows(indices, runtime.process_index(), runtime.process_count()))


def _evaluate(eval_fn, params, rows: TokenRows, cfg: Config, place: Placement) -> dict[str, float]:
    totals: dict[str, float] = {}
    for batch in eval_batches(rows, cfg.train.eval_batch_size):
        local = {k: v[process_rows(np.arange(len(v)), runtime.process_index(),
                                   runtime.process_count())] for k, v in batch.items()}
        for k, v in jax.device_get(eval_fn(params, _to_global(place, local))).items():
            totals[k] = totals.get(k, 0.0) + float(v)
    tokens = max(totals.pop("tokens", 0.0), 1.0)
    out = {f"eval/{k}": v / tokens for k, v in totals.items()}
    out["eval/perplexity"] = float(np.exp(min(out.get("eval/loss", 0.0), 50.0)))
    return out


def _prepare_run_dir(run_dir: Path, cfg: Config, resuming: bool, sink_msg) -> None:
    """config.yaml records the resolved config; a resumed run reports what changed."""
    path = run_dir / "config.yaml"
    current = to_dict(cfg)
    if resuming and path.exists():
        before = yaml.safe_load(path.read_text()) or {}
        changed = [f"{g}.{k}: {before.get(g, {}).get(k)!r} -> {v!r}"
                   for g, sec in current.items() if isinstance(sec, dict)
                   for k, v in sec.items() if before.get(g, {}).get(k) != v]
        if changed:
            sink_msg("[gpurl] resuming with a changed config: " + "; ".join(changed))
    path.write_text(yaml.safe_dump(current, sort_keys=False))


def _trim_metrics(run_dir: Path, step: int) -> None:
    """Drops rows logged after the checkpoint we resume from (they will be redone)."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [r for r in path.read_text().splitlines() if r and json.loads(r)["step"] <= step]
        path.write_text("".join(r + "\n" for r in rows))


def train(cfg: Config) -> dict[str, Any]:
    """Runs (or resumes) training; returns the final eval figures (also in summary.json)."""
    runtime.initialize(cfg.distributed)
    main = runtime.is_main_process()
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = trainer_mesh(cfg.mesh)
    _check_batch(cfg, batch_divisor(mesh, cfg.mesh.train_rules))

    tokenizer = load_tokenizer(cfg.model)
    train_examples, eval_examples = load_examples(cfg.data)
    train_rows = encode_sft(train_examples, tokenizer, cfg.data)
    eval_rows = encode_sft(eval_examples, tokenizer, cfg.data) if eval_examples else None

    spec = model_spec(cfg.model)
    objective = algorithms.objective(cfg.algo)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    place = placement(spec, optimizer, mesh, cfg.mesh.train_rules)
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints)

    latest = ckpt.latest_step()
    if latest is not None:
        state, meta = ckpt.restore(latest, place.abstract_state, place.state)
        start = int(meta["step"])
        if main:
            _trim_metrics(run_dir, start)
    else:
        state, start = make_init(spec, optimizer, place, cfg.train.seed)(), 0

    sink = MetricsSink(cfg.logger, run_dir, to_dict(cfg), cfg.train.steps, start, enabled=main)
    if main:
        _prepare_run_dir(run_dir, cfg, latest is not None, sink.message)
    sink.message(
        f"[gpurl] {cfg.algo.name} on {cfg.model.name} ({count_params(state.params):,} params), "
        f"mesh {dict(mesh.shape)}, {len(train_rows)} train rows "
        f"({train_rows.num_truncated} truncated), "
        + (f"resuming from step {start}" if latest is not None else "starting at step 0")
        + f", run dir {run_dir}")

    step_fn = make_train_step(spec, objective, optimizer, place, cfg.train.num_micro_batches)
    eval_fn = make_eval_step(spec, objective, place)
    stop = _Stop()
    pending = None
    last_eval: dict[str, float] = {}

    def flush(pending) -> None:
        step, metrics_dev, seconds = pending
        metrics = {k: float(v) for k, v in jax.device_get(metrics_dev).items()}
        tokens = metrics.pop("tokens", 0.0)
        metrics.update({"lr": float(schedule(step - 1)), "time/step_s": seconds,
                        "tokens_per_s": tokens / max(seconds, 1e-9)})
        if step % cfg.train.log_every == 0 or step == cfg.train.steps:
            sink.log(step, metrics)

    def save(step: int) -> None:
        ckpt.save(step, state, {"step": step, "examples_seen": step * cfg.train.batch_size,
                                "epoch": step * cfg.train.batch_size // len(train_rows)})

    step = start
    t_last = time.perf_counter()
    while step < cfg.train.steps:
        batch = _to_global(place, _train_batch(cfg, train_rows, step))
        state, metrics_dev = step_fn(state, batch)
        step += 1
        if pending is not None:
            flush(pending)
        now = time.perf_counter()
        pending, t_last = (step, metrics_dev, now - t_last), now
        sink.advance()
        eval_due = cfg.train.eval_every and step % cfg.train.eval_every == 0
        if eval_rows is not None and (eval_due or step == cfg.train.steps):
            flush(pending)
            pending = None
            last_eval = _evaluate(eval_fn, state.params, eval_rows, cfg, place)
            sink.log(step, last_eval)
            sink.message(f"[gpurl] step {step}: " + ", ".join(
                f"{k}={v:.4g}" for k, v in last_eval.items()))
            t_last = time.perf_counter()
        ckpt_due = cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0
        if ckpt_due or step == cfg.train.steps or stop.requested:
            save(step)
            t_last = time.perf_counter()
        if stop.requested:
            sink.message(f"[gpurl] SIGTERM: saved a checkpoint at step {step}; rerun to resume.")
            break
    if pending is not None:
        flush(pending)
    sink.close()
    ckpt.close()
    summary = {"step": step, "finished": step >= cfg.train.steps, **last_eval}
    if main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if stop.requested:
        raise SystemExit(143)
    return summary
