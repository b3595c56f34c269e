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
from gpurl.distributed.mesh import batch_divisor, placement_devices, trainer_mesh
from gpurl.models import count_params, loading
from gpurl.models.scalar import load_initial
from gpurl.models.tokenizer import load_tokenizer
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.metrics import MetricsSink
from gpurl.train.optim import lr_schedule, make_train_optimizer
from gpurl.train.step import (NonFiniteError, Placement, checkpointed, complete, make_eval_step,
                              make_init, make_train_step, placement)


class _Stop:
    """Set by SIGTERM (Slurm preemption, `kill`): the loop checkpoints and exits 0."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, *_: Any) -> None:
        self.requested = True

    def agreed(self) -> bool:
        """Whether any process got SIGTERM: the signal reaches processes at different
        steps, and the checkpoint is a collective every process must join at the same one."""
        return runtime.any_process(self.requested)

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
    # (state, step) -> (state, metrics): one optimizer step (SFT) or one RL step
    advance: Callable[[Any, int], tuple[Any, dict]]
    evaluate: Callable[[Any], dict[str, float]] | None  # params -> eval figures; None = no eval set
    schedule: Callable[[int], Any]
    ckpt: Checkpointer
    describe: str  # data summary for the start-up line
    eval_at_start: bool = False  # RL: held-out accuracy before training too
    # host state a checkpoint records beside the arrays (PPO's adaptive KL coefficient)
    state_meta: Callable[[], dict] = dict
    restore_meta: Callable[[dict], None] = lambda meta: None


class _PendingMetrics:
    """Holds step N's device metrics until step N+1 is dispatched, then logs them; stops
    the run at a non-finite step (train.on_nonfinite=stop) or counts it (skip)."""

    def __init__(self, session: _Session, sink: MetricsSink, skipped: int):
        self.session, self.sink, self.pending = session, sink, None
        self.skipped = skipped  # updates left out for a non-finite loss (restored on resume)
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
        nonfinite = metrics.pop("nonfinite", 0.0) > 0
        if cfg.on_nonfinite == "skip":
            self.skipped += int(nonfinite)
            metrics["nonfinite_skipped"] = float(self.skipped)
        if step % cfg.log_every == 0 or step == cfg.steps or nonfinite:
            self.sink.log(step, metrics)
        if nonfinite and cfg.on_nonfinite == "stop":
            latest = self.session.ckpt.latest_step()
            kept = (f"{self.session.ckpt.directory} keeps the last good checkpoint (step {latest})"
                    if latest is not None else "no checkpoint was written")
            raise NonFiniteError(
                f"step {step}: the loss ({metrics.get('loss', float('nan')):.4g}) or gradient norm "
                f"({metrics.get('grad_norm', float('nan')):.4g}) is not finite, so the run stopped "
                f"without saving this state and {kept}; lower optim.lr, check the data and "
                f"reward functions, or set train.on_nonfinite=skip to leave such updates out.")

    def reset_clock(self) -> None:
        """Eval and checkpoint time is not step time."""
        self.t_last = time.perf_counter()


def _build(cfg: Config) -> tuple[_Session, Callable[[], Any]]:
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    devices = placement_devices(cfg.mesh)[0] if algorithms.is_rl(cfg) else None
    mesh = trainer_mesh(cfg.mesh, devices)
    _check_batch(cfg, batch_divisor(mesh, cfg.mesh.train_rules))
    model_cfg = loading.resolve(cfg.model)
    cfg = dataclasses.replace(cfg, model=model_cfg)  # config.yaml records the real architecture
    tokenizer = load_tokenizer(model_cfg)
    spec = algorithms.model(cfg, model_cfg)
    objective = algorithms.objective(cfg)
    optimizer = make_train_optimizer(cfg)
    place = placement(spec, optimizer, mesh, cfg.mesh.train_rules)
    step_fn = make_train_step(spec, objective, optimizer, place, cfg.train.num_micro_batches,
                              cfg.optim.freeze, skip_nonfinite=cfg.train.on_nonfinite == "skip")
    init = make_init(spec, optimizer, place, cfg.train.seed,
                     lambda: load_initial(spec, place.state.params, loading.load_params))
    common = dict(cfg=cfg, run_dir=run_dir, place=place, schedule=lr_schedule(cfg.optim, cfg.train.steps),
                  ckpt=Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints))
    if algorithms.is_rl(cfg):
        return _Session(**common, **_rl_parts(cfg, spec, tokenizer, place, step_fn, init),
                        eval_at_start=True), init
    if algorithms.is_preference(cfg):
        return _Session(**common, **_preference_parts(cfg, spec, tokenizer, place, step_fn, init),
                        eval_at_start=True), init
    train_examples, eval_examples = load_examples(cfg.data)
    train_rows = encode_sft(train_examples, tokenizer, cfg.data)
    eval_rows = encode_sft(eval_examples, tokenizer, cfg.data) if eval_examples else None
    eval_fn = make_eval_step(spec, objective, place)

    def advance(state, step):
        return step_fn(state, _to_global(place, _train_batch(cfg, train_rows, step)))

    evaluate = None if eval_rows is None else (
        lambda params: _evaluate(eval_fn, params, eval_rows, cfg, place))
    return _Session(**common, advance=advance, evaluate=evaluate,
                    describe=f"{len(train_rows)} train rows ({train_rows.num_truncated} truncated)"
                    ), init


def _rl_parts(cfg: Config, spec, tokenizer, place: Placement, step_fn, init) -> dict[str, Any]:
    """The RL pieces of a session: prompts, sampler, reward scorer, reference model."""
    from gpurl.data import default_rewards, load_prompts
    from gpurl.models.scalar import initial_policy, load_reward_model
    from gpurl.train.rl import RLStepper, encode_prompts

    train_rows, eval_rows = load_prompts(cfg.data)
    limit = cfg.data.max_len
    train, skipped = encode_prompts(train_rows, tokenizer, cfg.data.chat_template, limit, "train")
    evals, eval_skipped = (encode_prompts(eval_rows, tokenizer, cfg.data.chat_template, limit, "eval")
                           if eval_rows else (None, 0))
    # The reference is the initial policy; it is rebuilt (not checkpointed) on resume.
    # With LoRA the reference is the frozen base inside the train state (RLStepper).
    ref = (initial_policy(spec, place.state.params, cfg.train.seed, loading.load_params)
           if cfg.algo.beta > 0 and not cfg.model.lora.rank else None)
    reward_model = (load_reward_model(cfg.algo.reward_model, cfg.model, place.mesh,
                                      cfg.mesh.train_rules) if cfg.algo.reward_model else None)
    stepper = RLStepper(cfg, spec, tokenizer, place, train, evals,
                        list(cfg.rewards) or default_rewards(cfg.data), step_fn, ref, reward_model)
    reward_names = ", ".join(r.name for r in stepper.rewards)
    if reward_model is not None:
        reward_names = (f"reward model {cfg.algo.reward_model}"
                        + (f" + {reward_names}" if cfg.rewards else f" (reported: {reward_names})"))
    return dict(advance=stepper.step, evaluate=stepper.evaluate if evals else None,
                state_meta=stepper.state_meta, restore_meta=stepper.restore_meta,
                describe=(f"{len(train)} train prompts, {len(evals) if evals else 0} eval prompts "
                          f"({skipped + eval_skipped} longer than data.max_len skipped), "
                          f"G={cfg.algo.num_generations}, rewards: {reward_names}"))


def _preference_parts(cfg: Config, spec, tokenizer, place: Placement, step_fn,
                      init) -> dict[str, Any]:
    """The DPO / SimPO / ORPO pieces of a session: pairs, reference model, evaluation."""
    from gpurl.train.preference import PreferenceStepper

    stepper = PreferenceStepper(cfg, spec, tokenizer, place, step_fn, init)
    return dict(advance=stepper.step, evaluate=stepper.evaluate if stepper.evals else None,
                describe=stepper.describe())


def _restore_or_init(s: _Session, init: Callable) -> tuple[Any, dict]:
    """(state, meta of the checkpoint it came from: {} for a fresh start)."""
    latest = s.ckpt.latest_step()
    if latest is None:
        return init(), {}
    state, meta = s.ckpt.restore(latest, checkpointed(s.place, s.place.abstract_state),
                                 checkpointed(s.place, s.place.state))
    state = complete(s.place, state, init)  # a LoRA run's base is not in the checkpoint
    if runtime.is_main_process():
        _trim_metrics(s.run_dir, int(meta["step"]))
    return state, meta


def _run_eval(s: _Session, state: Any, step: int, sink: MetricsSink) -> dict[str, float]:
    figures = s.evaluate(state.params)
    sink.log(step, figures)
    sink.message(f"[gpurl] step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    return figures


def _run_steps(s: _Session, state: Any, start: int, skipped: int, sink: MetricsSink,
               stop: _Stop) -> tuple[int, dict]:
    """Steps from `start` to train.steps, or until SIGTERM: then the current step is
    checkpointed (its scheduled eval is left out to stay within the grace period)."""
    cfg = s.cfg.train
    queue = _PendingMetrics(s, sink, skipped)
    last_eval: dict[str, float] = {}
    step = start
    if s.evaluate is not None and s.eval_at_start and start == 0:
        _run_eval(s, state, 0, sink)
        queue.reset_clock()
    stopping = stop.agreed()
    while step < cfg.steps and not stopping:
        state, metrics_dev = s.advance(state, step)
        step += 1
        queue.push(step, metrics_dev)
        sink.advance()
        final = step == cfg.steps
        stopping = stop.agreed()
        if s.evaluate is not None and (final or (cfg.eval_every and step % cfg.eval_every == 0
                                                 and not stopping)):
            queue.flush()
            last_eval = _run_eval(s, state, step, sink)
            queue.reset_clock()
        if final or stopping or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            queue.flush()  # rows up to a checkpoint are on disk before it exists
            s.ckpt.save(step, checkpointed(s.place, state),
                        {"step": step, "examples_seen": step * cfg.batch_size,
                         "nonfinite_skipped": queue.skipped, **s.state_meta()})
            queue.reset_clock()
    queue.flush()
    if stopping and step < cfg.steps:
        sink.message(f"[gpurl] SIGTERM: saved a checkpoint at step {step}; rerun to resume."
                     if step > start else f"[gpurl] SIGTERM before step {start + 1}; nothing "
                     f"new to save; rerun to resume.")
    return step, last_eval


def _peak_memory() -> dict[str, float]:
    """Peak resident memory of this process and, where the backend reports it (GPU), peak
    device memory, in GB."""
    import resource

    out = {"peak_host_memory_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    stats = jax.local_devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        out["peak_device_memory_gb"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
    return out


def _eval_at(run_dir: Path, step: int) -> dict[str, float]:
    """The eval figures logged at `step` (from metrics.jsonl, so they survive a resume)."""
    path = run_dir / "metrics.jsonl"
    out: dict[str, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line) if line else {}
            if row.get("step") == step:
                out.update({k: v for k, v in row.items() if k.startswith("eval/")})
    return out


def train(cfg: Config) -> dict[str, Any]:
    """Runs (or resumes) training; returns the final eval figures (also in summary.json)."""
    runtime.initialize(cfg.distributed)
    stop = _Stop()  # from here on SIGTERM ends the run at a step boundary, with exit status 0
    try:
        return _train(cfg, stop)
    finally:
        stop.restore()


def _train(cfg: Config, stop: _Stop) -> dict[str, Any]:
    s, init = _build(cfg)
    cfg = s.cfg
    try:
        state, meta = _restore_or_init(s, init)
    except BaseException:
        s.ckpt.close()
        raise
    start, resumed = int(meta.get("step", 0)), bool(meta)
    s.restore_meta(meta)
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
        f"mesh {dict(s.place.mesh.shape)}, {s.describe}, "
        + (f"resuming from step {start}" if resumed else "starting at step 0")
        + f", run dir {s.run_dir}")
    try:
        step, last_eval = _run_steps(s, state, start, int(meta.get("nonfinite_skipped", 0)),
                                     sink, stop)
    finally:
        sink.close()
        s.ckpt.close()
    if step < cfg.train.steps:  # stopped by SIGTERM: a checkpoint holds the step
        return {"step": step, "finished": False}
    summary = {"step": step, "finished": True, **last_eval, **_peak_memory()}
    before = _eval_at(s.run_dir, 0) if main and s.eval_at_start else {}
    if before:
        summary["start"] = before
        sink_line = ", ".join(f"{k} {before[k]:.3f} -> {last_eval[k]:.3f}"
                              for k in before if k in last_eval)
        print(f"[gpurl] held-out, before -> after {step} steps: {sink_line}", flush=True)
    if main:
        (s.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        _write_curves(s.run_dir)
    return summary


def _write_curves(run_dir: Path) -> None:
    """curves.png is a by-product: a plotting failure must not fail a finished run."""
    from gpurl.train.plots import write_curves

    try:
        path = write_curves(run_dir)
    except Exception as e:  # noqa: BLE001 - matplotlib/font/disk errors alike
        print(f"[gpurl] curves.png not written ({type(e).__name__}: {e}); "
              f"run `gpurl plot {run_dir}` to retry.", flush=True)
        return
    if path is not None:
        print(f"[gpurl] curves: {path}", flush=True)
