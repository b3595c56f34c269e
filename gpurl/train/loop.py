"""The one training loop shared by every algorithm.

It builds the mesh, data, model and optimizer from the frozen config, restores the
newest checkpoint in `run.dir` if there is one (parameters, optimizer, RNG and the data
position, which is a pure function of the step), then runs jitted steps, evaluating and
checkpointing on their cadences. The host reads step N's metrics after dispatching
step N+1 so the device never waits on logging.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

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
from gpurl.models import count_params, loading, model_spec
from gpurl.models.tokenizer import load_tokenizer
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.metrics import MetricsSink
from gpurl.train.optim import lr_schedule, make_optimizer
from gpurl.train.step import Placement, make_eval_step, make_init, make_train_step, placement


class _Stop:
    """Set by SIGTERM (Slurm preemption, `kill`): the loop checkpoints and exits."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, *_: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


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


@dataclass
class _Session:
    """Everything one run uses, built once from the config."""

    cfg: Config
    run_dir: Path
    place: Placement
    train_rows: TokenRows
    eval_rows: TokenRows | None
    step_fn: Callable
    eval_fn: Callable
    schedule: Callable[[int], Any]
    ckpt: Checkpointer


class _PendingMetrics:
    """Holds step N's device metrics until step N+1 is dispatched, then logs them."""

    def __init__(self, session: _Session, sink: MetricsSink):
        self.session, self.sink, self.pending = session, sink, None
        self.t_last = time.perf_counter()

    def push(self, step: int, metrics_dev: dict) -> None:
        self.flush()
        now = time.perf_counter()
        self.pending, self.t_last = (step, metrics_dev, now - self.t_last), now

    def flush(self) -> None:
        if self.pending is None:
            return
        (step, metrics_dev, seconds), self.pending = self.pending, None
        metrics = {k: float(v) for k, v in jax.device_get(metrics_dev).items()}
        tokens = metrics.pop("tokens", 0.0)
        metrics.update({"lr": float(self.session.schedule(step - 1)), "time/step_s": seconds,
                        "tokens_per_s": tokens / max(seconds, 1e-9)})
        cfg = self.session.cfg.train
        if step % cfg.log_every == 0 or step == cfg.steps:
            self.sink.log(step, metrics)

    def reset_clock(self) -> None:
        """Eval and checkpoint time is not step time."""
        self.t_last = time.perf_counter()


def _build(cfg: Config) -> tuple[_Session, Callable[[], Any]]:
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = trainer_mesh(cfg.mesh)
    _check_batch(cfg, batch_divisor(mesh, cfg.mesh.train_rules))
    model_cfg = loading.resolve(cfg.model)
    cfg = dataclasses.replace(cfg, model=model_cfg)  # config.yaml records the real architecture
    tokenizer = load_tokenizer(model_cfg)
    train_examples, eval_examples = load_examples(cfg.data)
    spec = model_spec(model_cfg)
    objective = algorithms.objective(cfg.algo)
    optimizer = make_optimizer(cfg.optim, cfg.train.steps)
    place = placement(spec, optimizer, mesh, cfg.mesh.train_rules)
    return _Session(
        cfg=cfg, run_dir=run_dir, place=place,
        train_rows=encode_sft(train_examples, tokenizer, cfg.data),
        eval_rows=encode_sft(eval_examples, tokenizer, cfg.data) if eval_examples else None,
        step_fn=make_train_step(spec, objective, optimizer, place, cfg.train.num_micro_batches),
        eval_fn=make_eval_step(spec, objective, place),
        schedule=lr_schedule(cfg.optim, cfg.train.steps),
        ckpt=Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints),
    ), make_init(spec, optimizer, place, cfg.train.seed,
                 lambda: loading.load_params(model_cfg, spec, place.state.params))


def _restore_or_init(s: _Session, init: Callable) -> tuple[Any, int, bool]:
    latest = s.ckpt.latest_step()
    if latest is None:
        return init(), 0, False
    state, meta = s.ckpt.restore(latest, s.place.abstract_state, s.place.state)
    if runtime.is_main_process():
        _trim_metrics(s.run_dir, int(meta["step"]))
    return state, int(meta["step"]), True


def _run_steps(s: _Session, state: Any, start: int, sink: MetricsSink) -> tuple[int, dict]:
    cfg = s.cfg.train
    stop, queue = _Stop(), _PendingMetrics(s, sink)
    last_eval: dict[str, float] = {}
    step = start
    try:
        while step < cfg.steps and not stop.requested:
            state, metrics_dev = s.step_fn(state, _to_global(s.place, _train_batch(s.cfg, s.train_rows, step)))
            step += 1
            queue.push(step, metrics_dev)
            sink.advance()
            final = step == cfg.steps
            if s.eval_rows is not None and (final or (cfg.eval_every and step % cfg.eval_every == 0)):
                queue.flush()
                last_eval = _evaluate(s.eval_fn, state.params, s.eval_rows, s.cfg, s.place)
                sink.log(step, last_eval)
                sink.message(f"[gpurl] step {step}: " + ", ".join(
                    f"{k}={v:.4g}" for k, v in last_eval.items()))
                queue.reset_clock()
            if final or stop.requested or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
                queue.flush()  # rows up to a checkpoint are on disk before it exists
                s.ckpt.save(step, state, {"step": step, "examples_seen": step * cfg.batch_size,
                                          "epoch": step * cfg.batch_size // len(s.train_rows)})
                queue.reset_clock()
        queue.flush()
    finally:
        stop.restore()
    if stop.requested and step < cfg.steps:
        sink.message(f"[gpurl] SIGTERM: saved a checkpoint at step {step}; rerun to resume.")
    return step, last_eval


def train(cfg: Config) -> dict[str, Any]:
    """Runs (or resumes) training; returns the final eval figures (also in summary.json)."""
    runtime.initialize(cfg.distributed)
    s, init = _build(cfg)
    cfg = s.cfg
    state, start, resumed = _restore_or_init(s, init)
    if start >= cfg.train.steps:
        done = s.run_dir / "summary.json"
        print(f"[gpurl] {s.run_dir} already finished at step {start} (train.steps="
              f"{cfg.train.steps}); raise train.steps to continue or use a new run.dir.", flush=True)
        return json.loads(done.read_text()) if done.exists() else {"step": start, "finished": True}
    main = runtime.is_main_process()
    sink = MetricsSink(cfg.logger, s.run_dir, to_dict(cfg), cfg.train.steps, start, enabled=main)
    if main:
        _prepare_run_dir(s.run_dir, cfg, resumed, sink.message)
    sink.message(
        f"[gpurl] {cfg.algo.name} on {cfg.model.name} ({count_params(state.params):,} params), "
        f"mesh {dict(s.place.mesh.shape)}, {len(s.train_rows)} train rows "
        f"({s.train_rows.num_truncated} truncated), "
        + (f"resuming from step {start}" if resumed else "starting at step 0")
        + f", run dir {s.run_dir}")
    try:
        step, last_eval = _run_steps(s, state, start, sink)
    finally:
        sink.close()
        s.ckpt.close()
    if step < cfg.train.steps:
        raise SystemExit(143)
    summary = {"step": step, "finished": True, **last_eval}
    if main:
        (s.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
