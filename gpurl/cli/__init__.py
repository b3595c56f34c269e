"""`gpurl` command line: subcommands, Hydra composition of configs/ (`compose`), one
conversion to frozen dataclasses, the sweep summary (`sweep`). Nothing below this
package imports omegaconf or hydra.

Composition errors (an unknown key, a value of the wrong type, a missing group option)
are caught before Hydra runs the job and reported as one sentence with the fix.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any, Sequence

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

import gpurl
from gpurl.cli.compose import (APPS, App, app_help, config_dir, inherit_run_task,
                               quote_free_text, register_schemas, to_config, upgrade_overrides,
                               validate)
from gpurl.cli.sweep import SWEEP_JOB_FILE, sweep_summary_callback, write_sweep_summary
from gpurl.commands.check import check, job_shape, launched_processes
from gpurl.train.preflight import default_batch
from gpurl.commands.evaluate import evaluate
from gpurl.commands.export import export_run
from gpurl.commands.generate import generate
from gpurl.commands.plan import plan
from gpurl.commands.serve import serve
from gpurl.config import ConfigError, EvalConfig, GenerateConfig, ServeConfig
from gpurl.distributed import runtime
from gpurl.envs import EnvError
from gpurl.rewards import RewardError
from gpurl.train.loop import train
from gpurl.train.plots import plot_runs
from gpurl.train.step import NonFiniteError

__all__ = ["APPS", "App", "config_dir", "main", "sweep_summary_callback", "validate",
           "write_sweep_summary"]

SUBCOMMANDS = {
    "train": "train with the composed config (resumes from run.dir)",
    "plan": "plan [train overrides] [plan.devices=8]: per-device memory of every program, nothing allocated",
    "generate": "generate [model=NAME] prompt=TEXT [n=4] (or prompts_file=F): print completions",
    "eval": "eval [model=NAME] [data=NAME | suite=NAME] [checkpoint=RUN_DIR]: held-out "
            "accuracy and pass@k, or standard suites (GSM8K, MATH-500, AIME, GPQA)",
    "export": "export checkpoint=RUN_DIR out=DIR [step=N]: write an HF safetensors directory",
    "check": "check COMMAND [overrides] [processes=N] [devices=N]: every start-up check of "
             "train, plan, eval or generate, nothing loaded or run",
    "plot": "plot RUN_DIR [RUN_DIR...] [out=FILE.png]: reward / loss / KL / eval curves (plot.png)",
    "serve": "serve [model=NAME | checkpoint=RUN_DIR] [port=8000] [api_key=KEY]: an "
             "OpenAI-compatible server on the rollout engine (127.0.0.1, with a key)",
}
# Hydra's own flags: they print or configure, so they skip gpurl's pre-validation.
_HYDRA_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i",
                     "--resolve", "--shell-completion", "-sc", "--version")


# ---------------------------------------------------------------- Hydra jobs

def _train_job(cfg_node: Any) -> Any:
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and not any(o.startswith("run.dir=") for o in hydra_cfg.overrides.task):
        cfg_node.run.dir = hydra_cfg.runtime.output_dir  # one run directory per sweep job
    if multirun and cfg_node.logger.group is None:
        cfg_node.logger.group = Path(hydra_cfg.sweep.dir).name  # wandb groups a sweep's jobs
    try:
        summary = train(to_config(cfg_node), not _batch_named(hydra_cfg.overrides.task,
                                                              hydra_cfg.runtime.choices))
    except (ConfigError, RewardError, EnvError, NonFiniteError) as e:
        _fail(str(e))
    if multirun and runtime.is_main_process():
        job = {"num": hydra_cfg.job.num, "overrides": list(hydra_cfg.overrides.task),
               "run_dir": str(cfg_node.run.dir)}
        (Path(hydra_cfg.runtime.output_dir) / SWEEP_JOB_FILE).write_text(json.dumps(job) + "\n")
    return summary


def _generate_job(cfg_node: Any) -> None:
    try:
        generate(to_config(cfg_node, GenerateConfig))
    except (ConfigError, EnvError) as e:
        _fail(str(e))


def _eval_job(cfg_node: Any) -> None:
    hydra_cfg = HydraConfig.get()
    from_run = (inherit_run_task(cfg_node, list(hydra_cfg.overrides.task),
                                 dict(hydra_cfg.runtime.choices))
                if cfg_node.checkpoint is not None else [])
    try:
        evaluate(to_config(cfg_node, EvalConfig), from_run)
    except (ConfigError, RewardError, EnvError) as e:
        _fail(str(e))


def _serve_job(cfg_node: Any) -> None:
    try:
        serve(to_config(cfg_node, ServeConfig))
    except ConfigError as e:
        _fail(str(e))


def _plan_job(cfg_node: Any) -> None:
    hydra_cfg = HydraConfig.get()
    try:
        plan(to_config(cfg_node), not _batch_named(hydra_cfg.overrides.task,
                                                   hydra_cfg.runtime.choices))
    except ConfigError as e:
        _fail(str(e))


def _batch_named(overrides: Sequence[str], choices: Any = None) -> bool:
    """Whether the user chose train.batch_size: on the command line, or in a train preset
    of their own (`train=NAME` not shipped in configs/train/); else it is a preset's, which
    a start raises to fit the job."""
    choice = (choices or {}).get("train") or next(
        (o.partition("=")[2] for o in overrides if o.partition("=")[0].lstrip("+") == "train"), None)
    shipped = {p.stem for p in (config_dir() / "train").glob("*.yaml")}
    return (choice is not None and choice not in shipped) or any(
        o.partition("=")[0].lstrip("+~") == "train.batch_size" for o in overrides)


JOBS = {"train": _train_job, "plan": _plan_job, "generate": _generate_job, "eval": _eval_job,
        "serve": _serve_job}


def _fail(message: str) -> typing.NoReturn:
    print(f"gpurl: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _run_hydra(subcommand: str, args: list[str]) -> None:
    register_schemas()
    if subcommand == "plan":  # the train config's hydra.run.dir is run.dir: plan writes nothing
        args = [*args, "hydra.run.dir=."]
    sys.argv = [f"gpurl {subcommand}", *args]
    hydra.main(config_path=str(config_dir()), config_name=APPS[subcommand].config_name,
               version_base="1.3")(JOBS[subcommand])()


# ---------------------------------------------------------------- plain subcommands

def _key_values(args: list[str], required: tuple[str, ...], optional: tuple[str, ...],
                command: str) -> dict[str, str]:
    """`key=value` arguments of the plain (non-Hydra) subcommands."""
    values = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in required + optional:
            _fail(f"'{arg}' is not an argument of gpurl {command}; use "
                  f"{' '.join(k + '=...' for k in required + optional)}.")
        values[key] = value
    missing = [k for k in required if k not in values]
    if missing:
        _fail(f"gpurl {command} needs {', '.join(k + '=...' for k in missing)}.")
    return values


def _export(args: list[str]) -> None:
    values = _key_values(args, ("checkpoint", "out"), ("step", "adapter"), "export")
    step = values.get("step")
    if step is not None and not step.isdigit():
        _fail(f"step={step} is not an integer; give a checkpoint step such as step=100.")
    adapter = values.get("adapter", "false").lower()
    if adapter not in ("true", "false"):
        _fail(f"adapter={values['adapter']} is not valid; use adapter=true (LoRA adapters alone, "
              f"PEFT layout) or adapter=false (merged model).")
    try:
        out = export_run(values["checkpoint"], values["out"], None if step is None else int(step),
                         adapter=adapter == "true")
    except ConfigError as e:
        _fail(str(e))
    print(f"[gpurl] exported {values['checkpoint']} to {out}")


def _plot(args: list[str]) -> None:
    run_dirs = [a for a in args if not a.startswith("out=")]
    outs = [a[len("out="):] for a in args if a.startswith("out=")]
    if not run_dirs:
        _fail("gpurl plot needs at least one run directory: gpurl plot RUN_DIR [RUN_DIR...] [out=FILE.png].")
    out = outs[-1] if outs else "plot.png"
    try:
        written = plot_runs(run_dirs, out)
    except ConfigError as e:
        _fail(str(e))
    if written is None:
        _fail(f"{', '.join(run_dirs)}: no reward, loss, KL or eval metrics to plot; "
              f"check that the runs logged steps to metrics.jsonl.")
    print(f"[gpurl] wrote {written}")


def _check(args: list[str]) -> None:
    """`gpurl check COMMAND [overrides] [processes=N] [devices=N]`."""
    if not args or args[0] not in APPS:
        _fail(f"gpurl check needs the command to check first: gpurl check "
              f"{{{','.join(APPS)}}} [overrides] [processes=N] [devices=N].")
    command, shape, overrides = args[0], {}, []
    for arg in args[1:]:
        key, sep, value = arg.partition("=")
        if key in ("processes", "devices") and sep:
            if not value.isdigit():
                _fail(f"{arg} is not a count; give {key}=N with N a whole number.")
            shape[key] = int(value)
        elif arg not in ("-m", "--multirun"):
            overrides.append(arg)
    try:
        cfg = validate(upgrade_overrides(overrides), APPS[command])
        launched = launched_processes(overrides, config_dir())  # hydra/launcher=slurm's job
        processes, devices = job_shape(cfg.distributed, shape.get("processes", launched),
                                       shape.get("devices"),
                                       cfg.plan.devices if command == "plan" else 0)
        fitted = None
        if command in ("train", "plan") and not _batch_named(overrides):  # as the start does
            cfg, fitted = default_batch(cfg, processes, devices)
        lines = ([fitted] if fitted else []) + check(command, cfg, processes, devices)
    except (ConfigError, RewardError, EnvError) as e:
        _fail(str(e))
    for line in lines:
        print(f"[gpurl] check: {line}")
    memory = " (memory: gpurl plan)" if command in ("train", "plan") else ""  # plan plans training
    print(f"[gpurl] check passed: gpurl {command} would start with this command line{memory}.",
          flush=True)


def _check_launcher(args: list[str]) -> None:
    """`hydra/launcher=slurm` (or submitit_*) needs an optional plugin: say so in one line."""
    launcher = next((a.partition("=")[2] for a in args if a.startswith("hydra/launcher=")), "")
    if (launcher == "slurm" or launcher.startswith("submitit")) and importlib.util.find_spec(
            "hydra_plugins.hydra_submitit_launcher") is None:
        _fail(f"hydra/launcher={launcher} needs the submitit launcher plugin; install it with "
              f"pip install -e '.[slurm]'.")


def _usage() -> str:
    lines = [f"usage: gpurl COMMAND [overrides]   (gpurl {gpurl.__version__})", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "`gpurl train --help` lists the config groups; `--cfg job` prints the config."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return
    if args[0] == "--version":
        print(gpurl.__version__)
        return
    command, rest = args[0], args[1:]
    if command not in SUBCOMMANDS:
        _fail(f"unknown command '{command}'; use one of: {', '.join(SUBCOMMANDS)}.")
    if command in ("export", "plot", "check"):
        {"export": _export, "plot": _plot, "check": _check}[command](rest)
        return
    if command in ("eval", "generate", "serve") and any(a in ("--help", "-h") for a in rest):
        print(app_help(APPS[command]))  # the groups this command takes, not all of configs/
        return
    if command == "generate":
        rest = [quote_free_text(a) for a in rest]
    try:
        rest = upgrade_overrides(rest)
    except ConfigError as e:
        _fail(str(e))
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _check_launcher(rest)
    if not any(a.split("=")[0] in _HYDRA_INFO_FLAGS for a in rest):
        try:
            validate([a for a in rest if a not in ("-m", "--multirun")], APPS[command])
        except ConfigError as e:
            _fail(str(e))
    _run_hydra(command, rest)


def run() -> None:
    """The `gpurl` command: `main`, and after a user error (its sentence already printed,
    exit status 2) an immediate exit: interpreter shutdown would let background threads
    (Orbax's refused checkpoint reads, asyncio loops) print tracebacks after the sentence."""
    try:
        main()
    except SystemExit as e:
        if e.code == 2:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        raise
