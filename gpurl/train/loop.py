"""The one training loop shared by every algorithm.

It builds the mesh, model, optimizer and train step from the frozen config, and the
stepper of the algorithm's family (SFT, RL, preference: `STEPPERS`), restores the newest
checkpoint in `run.dir` if there is one (parameters, optimizer, RNG and the data
position: a pure function of the step, or for RL the batches of prompts the rollout
rounds drew, which the stepper records), then runs the steps, evaluating and
checkpointing on their cadences. The host reads step N's metrics after dispatching
step N+1 so the device never waits on logging.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import signal
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, Callable

import jax
import yaml

from gpurl import hub
from gpurl.algorithms import registry
from gpurl.algorithms.registry import Family
from gpurl.rollout.suites import SuiteEvaluation, load_rows
from gpurl.config import Config, ModelConfig
from gpurl.config.dicts import to_dict, upgrade
from gpurl.distributed import host, runtime
from gpurl.distributed.mesh import batch_divisor, trainer_mesh
from gpurl.distributed.pins import agreed_pin
from gpurl.models import count_params, loading
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.frozen import Frozen
from gpurl.train.metrics import MetricsSink
from gpurl.train.optim import frozen_patterns, lr_schedule, train_optimizer
from gpurl.plan.memory import ProgramPlan, check, plan_summary
from gpurl.train.fitting import fitted
from gpurl.train.plots import write_curves
from gpurl.train.preference import PreferenceStepper
from gpurl.train.rl import RLStepper
from gpurl.train.sft import SFTStepper
from gpurl.train.preflight import (check_context, check_experts, default_batch, eval_batch,
                                   fit_batch, train_checks)
from gpurl.train.step import (NonFiniteError, Placement, checkpointed, complete, make_init,
                              make_train_step, placement, scaling_for)
from gpurl.train.stepper import Setup, Stepper
from gpurl.train.weights import load_initial, load_teacher

STEPPERS: dict[Family, type[Stepper]] = {
    Family.SFT: SFTStepper, Family.RL: RLStepper, Family.PREFERENCE: PreferenceStepper}


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
        return host.any_process(self.requested)

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _pinned(cfg: Config) -> Config:
    """Every Hub id of the run (the model's, a teacher's, a reward model's, the data's)
    pinned to the commit process 0 resolves it to now (`org/name@<commit>`, the same on
    every process: `agreed_pin`): config.yaml then names what every process, and `gpurl
    eval`, `gpurl export` and `gpurl generate` of the run, read."""
    algo = cfg.algo
    for key in ("teacher", "reward_model"):
        if getattr(algo, key, None) is not None:
            algo = dataclasses.replace(algo, **{key: agreed_pin(getattr(algo, key), f"algo.{key}")})
    data = cfg.data
    if data.dataset is not None and data.path is None:
        data = dataclasses.replace(data, dataset=agreed_pin(data.dataset, "data.dataset",
                                                            "dataset"))
    model, named = cfg.model, loading.weights_name(cfg.model)
    if named is not None and hub.is_hub_id(named[0]):
        model = dataclasses.replace(model, checkpoint=agreed_pin(*named))
    return dataclasses.replace(cfg, model=model, algo=algo, data=data)


def _router_defaults(model: ModelConfig, algorithm: registry.Algorithm) -> ModelConfig:
    """The algorithm's load-balancing coefficient where model.moe.aux_loss_coef is null."""
    if model.moe.aux_loss_coef is not None:
        return model
    return dataclasses.replace(model, moe=dataclasses.replace(
        model.moe, aux_loss_coef=algorithm.router_aux_loss if model.moe.num_experts else 0.0))


def _prepare_run_dir(run_dir: Path, cfg: Config, resuming: bool, sink_msg) -> None:
    """config.yaml records the resolved config; a resumed run reports what changed."""
    path = run_dir / "config.yaml"
    current = to_dict(cfg)
    if resuming and path.exists():
        before = upgrade(yaml.safe_load(path.read_text()) or {})  # older runs: moved keys
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
    stepper: Stepper
    schedule: Callable[[int], Any]
    ckpt: Checkpointer
    plans: list[ProgramPlan]  # the memory plan checked before the start ([]: plan.check=false)


def first_step_advice(cfg: Config, step: int, metrics: dict[str, float]) -> list[str]:
    """Warnings on a run's first step whose completions cannot hold an answer: every one
    cut at the length limit, or none scored while a newline stop ends each at one line."""
    lines = []
    if metrics.get("completion/truncated", 0.0) >= 1.0 and not cfg.rollout.ignore_eos:
        limit = (f"env.max_tokens={cfg.env.max_tokens}" if cfg.env.on
                 else f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}")
        lines.append(f"[gpurl] warning: every completion of step {step} reached {limit}, so "
                     f"answers are cut off; raise {limit.partition('=')[0]} (rollout=reasoning "
                     f"gives 512 tokens).")
    if ("\n" in cfg.rollout.stop and not cfg.env.on and "reward/mean" in metrics
            and metrics["reward/mean"] == 0.0):
        lines.append(f"[gpurl] warning: no completion of step {step} scored, and rollout.stop "
                     f"ends each at its first newline; if answers span lines, set "
                     f"rollout.stop=[] or rollout=reasoning.")
    return lines


class _PendingMetrics:
    """Holds step N's device metrics until step N+1 is dispatched, then logs them; stops
    the run at a non-finite step (train.on_nonfinite=stop) or counts it (skip)."""

    def __init__(self, session: _Session, sink: MetricsSink, skipped: int):
        self.session, self.sink, self.pending = session, sink, None
        self.skipped = skipped  # updates left out for a non-finite loss (restored on resume)
        self.t_last = time.perf_counter()
        self.advised = False  # the first step's completions were looked at

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
        if not self.advised:
            self.advised = True
            for line in first_step_advice(self.session.cfg, step, metrics):
                self.sink.message(line)
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


def build(cfg: Config) -> tuple[Config, Setup, Stepper]:
    """The run's mesh, model, optimizer, train step and stepper, from abstract shapes only:
    nothing is allocated on a device and no file is written (`gpurl plan` stops here)."""
    algorithm = registry.get(cfg.algo.name)
    stepper_cls = STEPPERS[algorithm.family]
    check_context(cfg, algorithm)
    mesh = trainer_mesh(cfg.mesh, stepper_cls.trainer_devices(cfg.mesh))
    shards = batch_divisor(mesh, cfg.mesh.train_rules)
    fit_batch(cfg, algorithm.family, shards, runtime.process_count())
    cfg = eval_batch(cfg, shards, runtime.process_count())  # config.yaml records the width used
    cfg = _pinned(cfg)
    model_cfg = _router_defaults(loading.resolve(cfg.model), algorithm)
    check_experts(model_cfg, mesh.shape, cfg.mesh.train_rules)
    cfg = dataclasses.replace(cfg, model=model_cfg)  # config.yaml records the real architecture
    spec = algorithm.model(cfg.algo, model_cfg)
    objective = algorithm.objective(cfg.algo, cfg.rollout)
    optimizer = train_optimizer(cfg.optim, model_cfg, algorithm.optimizer(cfg.algo),
                                cfg.train.steps)
    # fp16 (model.dtype=float16): dynamic loss scaling, the scale in the train state
    scaling = scaling_for(model_cfg, cfg.optim)
    place = placement(spec, optimizer, mesh, cfg.mesh.train_rules, scaling)
    tokenizer = loading.load_tokenizer(model_cfg)
    # a distillation algorithm's frozen teacher, laid out on the trainer mesh (read later)
    teacher = (load_teacher(cfg.algo, model_cfg, tokenizer, mesh, cfg.mesh.train_rules)
               if algorithm.distills else None)
    step_fn = make_train_step(spec, objective, optimizer, place, cfg.train.num_micro_batches,
                              frozen_patterns(cfg.optim, model_cfg), skip_nonfinite=cfg.train.on_nonfinite == "skip",
                              scaling=scaling,
                              teacher_shardings=teacher.shardings if teacher else None)
    init = make_init(spec, optimizer, place, cfg.train.seed,
                     lambda: load_initial(spec, place.state.params), scaling)
    frozen = Frozen.of(algorithm, cfg.algo, spec, place, cfg.mesh, cfg.model.lora.rank > 0,
                       cfg.train.seed, teacher)
    setup = Setup(algorithm, cfg.algo, spec, objective, tokenizer, place, step_fn, init, frozen)
    return cfg, setup, stepper_cls.build(setup, cfg)


def _build(cfg: Config) -> tuple[_Session, Callable[[], Any]]:
    for line in train_checks(cfg, *runtime.job_shape()):  # what `gpurl check train` runs, first
        if line.startswith("warning:") and runtime.is_main_process():
            print(f"[gpurl] {line}", flush=True)
    suite_rows = load_rows(cfg.train.suites, limit=cfg.train.suites_limit, offer_path=False)  # before compiling
    cfg, setup, stepper, plans = fitted(cfg, build, check=cfg.plan.check)
    if suite_rows:  # sampled by the run's rollout engine at evaluations
        stepper.suites = SuiteEvaluation.of(cfg.train, suite_rows, setup.tokenizer,
                                            stepper.sampler()[0], cfg.data.chat_template,
                                            cfg.rewards)
    check(cfg, plans)  # before anything is allocated; the run reuses the compiled programs
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    session = _Session(cfg, run_dir, setup.place, stepper,
                       lr_schedule(cfg.optim, cfg.train.steps),
                       Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints), plans)
    return session, setup.init


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


def _run_eval(s: _Session, state: Any, step: int, sink: MetricsSink, held_out: bool,
              suites: bool) -> dict[str, float]:
    """The held-out figures and/or `train.suites`' (whichever is due), logged as one row."""
    figures = s.stepper.evaluations(state.params, held_out, suites)
    sink.log(step, figures)
    sink.message(f"[gpurl] step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in figures.items()))
    return figures


def _evals_due(s: _Session, step: int, final: bool) -> tuple[bool, bool]:
    """(held-out evaluation, suites) due after `step`: every train.eval_every steps and
    train.suites_every steps (0: with the held-out ones), and after the last step."""
    cfg = s.cfg.train
    def every(n: int) -> bool:
        return final or bool(n) and step % n == 0
    return (s.stepper.has_eval and every(cfg.eval_every),
            s.stepper.has_suites and every(cfg.suites_every or cfg.eval_every))


def _run_steps(s: _Session, state: Any, start: int, skipped: int, sink: MetricsSink,
               stop: _Stop) -> tuple[int, dict]:
    """Steps from `start` to train.steps, or until SIGTERM: then the current step is
    checkpointed (its scheduled eval is left out to stay within the grace period)."""
    cfg = s.cfg.train
    queue = _PendingMetrics(s, sink, skipped)
    last_eval: dict[str, float] = {}
    step = start
    if s.stepper.eval_at_start and start == 0 and (s.stepper.has_eval or s.stepper.has_suites):
        _run_eval(s, state, 0, sink, s.stepper.has_eval, s.stepper.has_suites)
        queue.reset_clock()
    stopping = stop.agreed()
    while step < cfg.steps and not stopping:
        state, metrics_dev = s.stepper.step(state, step)
        step += 1
        queue.push(step, metrics_dev)
        sink.advance()
        final = step == cfg.steps
        stopping = stop.agreed()
        held_out, suites = _evals_due(s, step, final)
        if (held_out or suites) and (final or not stopping):
            queue.flush()
            last_eval = {**last_eval, **_run_eval(s, state, step, sink, held_out, suites)}
            queue.reset_clock()
        if ((final and cfg.save_final) or stopping
                or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
            queue.flush()  # rows up to a checkpoint are on disk before it exists
            s.ckpt.save(step, checkpointed(s.place, state),
                        {"step": step, "examples_seen": step * cfg.batch_size,
                         "nonfinite_skipped": queue.skipped, **s.stepper.state_meta()})
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


def train(cfg: Config, preset_batch: bool = False) -> dict[str, Any]:
    """Runs (or resumes) training; returns the final eval figures (also in summary.json).
    `preset_batch`: cfg's train.batch_size is a preset's, not the user's (the command line
    named none), so it is raised to fit the job if it does not (`preflight.default_batch`)."""
    runtime.initialize(cfg.distributed)
    if preset_batch:
        cfg, line = default_batch(cfg, *runtime.job_shape())
        if line and runtime.is_main_process():
            print(f"[gpurl] {line}", flush=True)
    stop = _Stop()  # from here on SIGTERM ends the run at a step boundary, with exit status 0
    try:
        return _train(cfg, stop)
    finally:
        stop.restore()


def _train(cfg: Config, stop: _Stop) -> dict[str, Any]:
    s, init = _build(cfg)
    sink = None
    try:  # every way out closes the checkpoint manager: its threads must not outlive the run
        state, meta = _restore_or_init(s, init)
        cfg = s.cfg
        start, resumed = int(meta.get("step", 0)), bool(meta)
        s.stepper.restore_meta(meta)
        if start >= cfg.train.steps:
            done = s.run_dir / "summary.json"
            print(f"[gpurl] {s.run_dir} already finished at step {start} (train.steps="
                  f"{cfg.train.steps}); raise train.steps to continue or use a new run.dir.",
                  flush=True)
            return json.loads(done.read_text()) if done.exists() else {"step": start,
                                                                        "finished": True}
        main = runtime.is_main_process()
        sink = MetricsSink(cfg.logger, s.run_dir, to_dict(cfg), cfg.train.steps, start,
                           enabled=main)
        if main:
            _prepare_run_dir(s.run_dir, cfg, resumed, sink.message)
        teacher = s.stepper.setup.teacher
        taught = (f", teacher {teacher.cfg.checkpoint} ({count_params(teacher.abstract.params):,} "
                  f"params, {teacher.cfg.dtype})" if teacher is not None else "")
        sink.message(
            f"[gpurl] {cfg.algo.name} on {cfg.model.name} ({count_params(state.params):,} params)"
            f"{taught}, mesh {dict(s.place.mesh.shape)}, {s.stepper.describe()}, "
            + (f"{s.stepper.suites}, " if s.stepper.suites else "")
            + (f"memory per device: {plan_summary(s.plans)}, " if s.plans else "")
            + (f"resuming from step {start}" if resumed else "starting at step 0")
            + f", run dir {s.run_dir}")
        for p in s.plans:
            for chosen in p.chosen:
                sink.message(f"[gpurl] plan: {chosen}")
        step, last_eval = _run_steps(s, state, start, int(meta.get("nonfinite_skipped", 0)),
                                     sink, stop)
    finally:
        if sink is not None:
            sink.close()
        s.ckpt.close()
        s.stepper.close()
    if step < cfg.train.steps:  # stopped by SIGTERM: a checkpoint holds the step
        return {"step": step, "finished": False}
    summary = {"step": step, "finished": True, **last_eval, **_peak_memory()}
    before = _eval_at(s.run_dir, 0) if main and s.stepper.eval_at_start else {}
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
    try:
        path = write_curves(run_dir)
    except Exception as e:  # noqa: BLE001 - matplotlib/font/disk errors alike
        print(f"[gpurl] curves.png not written ({type(e).__name__}: {e}); "
              f"run `gpurl plot {run_dir}` to retry.", flush=True)
        return
    if path is not None:
        print(f"[gpurl] curves: {path}", flush=True)
