"""`gpurl` command line: subcommands, Hydra composition of configs/, one conversion to
frozen dataclasses. Nothing below this module imports omegaconf or hydra.

Composition errors (an unknown key, a value of the wrong type, a missing group option)
are caught before Hydra runs the job and reported as one sentence with the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import sys
import typing
from pathlib import Path
from typing import Any, Sequence

import gpurl
from gpurl.config import Config, ConfigError, EvalConfig, GenerateConfig, from_dict, yaml_key

SUBCOMMANDS = {
    "train": "train with the composed config (resumes from run.dir)",
    "generate": "generate [model=NAME] prompt=TEXT [n=4] (or prompts_file=F): print completions",
    "eval": "eval [model=NAME] [data=NAME] [checkpoint=RUN_DIR]: held-out accuracy and pass@k",
    "export": "export checkpoint=RUN_DIR out=DIR [step=N]: write an HF safetensors directory",
    "plot": "plot RUN_DIR [RUN_DIR...] [out=FILE.png]: reward / loss / KL / eval curves (plot.png)",
}
# Hydra's own flags: they print or configure, so they skip gpurl's pre-validation.
_HYDRA_INFO_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i",
                     "--resolve", "--shell-completion", "-sc", "--version")


def config_dir() -> Path:
    """configs/ ships inside the wheel as gpurl/configs; an editable install reads the repo's."""
    here = Path(gpurl.__file__).resolve().parent
    for candidate in (here / "configs", here.parent / "configs"):
        if (candidate / "config.yaml").exists():
            return candidate
    raise FileNotFoundError(f"gpurl's configs/ directory was not found next to {here}; reinstall gpurl.")


# ---------------------------------------------------------------- schema <-> dataclasses

def _schema(cls: type) -> Any:
    """Typed OmegaConf node for a dataclass, with keyword-safe field names renamed."""
    from omegaconf import DictConfig, OmegaConf

    structured = OmegaConf.structured(cls)
    OmegaConf.set_readonly(structured, False)
    hints = typing.get_type_hints(cls)
    content = {}
    for f in dataclasses.fields(cls):
        sub = hints[f.name]
        content[yaml_key(f.name)] = (_schema(sub) if dataclasses.is_dataclass(sub)
                                      else structured._get_node(f.name))
    return DictConfig(content)


def to_config(cfg: Any, cls: type = Config) -> Any:
    """The one conversion: composed DictConfig -> frozen, validated `cls` (Config for train)."""
    from omegaconf import OmegaConf

    return from_dict(OmegaConf.to_container(cfg, resolve=True), cls)


@dataclasses.dataclass(frozen=True)
class _App:
    """A Hydra-composed subcommand: its name, root config file and schema."""

    name: str
    config_name: str
    schema: type


APPS = {"train": _App("train", "config", Config),
        "generate": _App("generate", "generate", GenerateConfig),
        "eval": _App("eval", "eval", EvalConfig)}


def _register_schema() -> None:
    from hydra.core.config_store import ConfigStore

    for app in APPS.values():
        ConfigStore.instance().store(name=f"gpurl_{app.config_name}_schema", node=_schema(app.schema))


# ---------------------------------------------------------------- clear errors

def _known_keys(schema: type) -> list[str]:
    from omegaconf import OmegaConf

    keys = []
    for group, sec in OmegaConf.to_container(_schema(schema)).items():
        keys += [f"{group}.{key}" for key in sec] if isinstance(sec, dict) else [group]
    return keys


def _explain(exc: BaseException, overrides: Sequence[str], app: _App) -> str:
    """One sentence for a Hydra/OmegaConf composition error."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    chain = [exc]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    for e in chain:
        if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and getattr(e, "full_key", None):
            guess = difflib.get_close_matches(e.full_key, _known_keys(app.schema), n=1)
            hint = f"did you mean '{guess[0]}'? " if guess else ""
            return (f"unknown config key '{e.full_key}'; {hint}"
                    f"run `gpurl {app.name} --cfg job` to list every key.")
        if isinstance(e, ValidationError) and getattr(e, "full_key", None):
            first = str(e).splitlines()[0]
            return f"bad value for '{e.full_key}': {first}; fix the value on the command line."
        if isinstance(e, MissingConfigException):
            options = getattr(e, "options", None) or []
            missing = getattr(e, "missing_cfg_file", "") or ""
            group, _, option = missing.rpartition("/")
            return (f"{group}={option} is not a known option"
                    + (f"; use one of: {', '.join(sorted(options))}." if options
                       else "; `gpurl train --help` lists the config groups."))
        if isinstance(e, OverrideParseException):
            return f"could not parse the override: {str(e).splitlines()[0]}; write it as key=value."
    return f"{str(exc).splitlines()[0]}; check the overrides {list(overrides)}."


def _validation_sets(overrides: list[str]) -> list[list[str]]:
    """For a sweep, one override list per swept value (others at their first value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    base = [o.input_line if not o.is_sweep_override() else
            f"{o.get_key_element()}={next(iter(o.sweep_string_iterator()))}" for o in parsed]
    sets = [base]
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            for value in list(o.sweep_string_iterator())[1:]:
                sets.append(base[:i] + [f"{o.get_key_element()}={value}"] + base[i + 1:])
    return sets


def validate(overrides: list[str], app: _App = APPS["train"]) -> Any:
    """Composes the config as Hydra will and converts it; raises ConfigError with one sentence."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_schema()
    user = [_quote_free_text(o) if app.name == "generate" else o for o in overrides
            if not o.startswith("hydra") and not o.startswith("-")]
    try:
        sets = _validation_sets(user)
    except Exception as e:  # noqa: BLE001 - Hydra's parser raises several types
        raise ConfigError(_explain(e, user, app)) from None
    cfg = None
    for values in sets:
        GlobalHydra.instance().clear()
        with initialize_config_dir(str(config_dir()), version_base="1.3", job_name="gpurl"):
            try:
                composed = compose(app.config_name, overrides=values)
            except Exception as e:  # noqa: BLE001
                raise ConfigError(_explain(e, values, app)) from None
            converted = to_config(composed, app.schema)
            cfg = cfg or converted
    GlobalHydra.instance().clear()
    return cfg


# ---------------------------------------------------------------- commands

def _train_job(cfg_node: Any) -> Any:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from gpurl.train.loop import train

    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and not any(o.startswith("run.dir=") for o in hydra_cfg.overrides.task):
        cfg_node.run.dir = hydra_cfg.runtime.output_dir  # one run directory per sweep job
    if multirun and cfg_node.logger.group is None:
        cfg_node.logger.group = Path(hydra_cfg.sweep.dir).name  # wandb groups a sweep's jobs
    from gpurl.distributed import runtime
    from gpurl.rewards import RewardError
    from gpurl.train.step import NonFiniteError

    try:
        summary = train(to_config(cfg_node))
    except (ConfigError, RewardError, NonFiniteError) as e:
        _fail(str(e))
    if multirun and runtime.is_main_process():
        job = {"num": hydra_cfg.job.num, "overrides": list(hydra_cfg.overrides.task),
               "run_dir": str(cfg_node.run.dir)}
        (Path(hydra_cfg.runtime.output_dir) / SWEEP_JOB_FILE).write_text(json.dumps(job) + "\n")
    return summary


# ---------------------------------------------------------------- sweep summary

SWEEP_JOB_FILE = "gpurl_job.json"  # in each sweep job's directory: its number, overrides, run dir


def sweep_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per finished job of a sweep: job number, the overrides that differ between
    jobs (`overrides`), all of them (`all_overrides`), run dir and final eval figures."""
    jobs = sorted((json.loads(p.read_text()) for p in Path(sweep_dir).rglob(SWEEP_JOB_FILE)),
                  key=lambda job: job["num"])
    common = set.intersection(*(set(job["overrides"]) for job in jobs)) if len(jobs) > 1 else set()
    rows = []
    for job in jobs:
        summary_path = Path(job["run_dir"]) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        rows.append({"job": job["num"],
                     "overrides": " ".join(o for o in job["overrides"] if o not in common),
                     "all_overrides": " ".join(job["overrides"]), "run_dir": job["run_dir"],
                     **{k: v for k, v in summary.items() if k.startswith("eval/")}})
    return rows


def _eval_keys(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({k for r in rows for k in r if k.startswith("eval/")})


def sweep_table(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of `sweep_rows` (eval figures to 4 significant digits)."""
    keys = ["job", "overrides"] + _eval_keys(rows)
    cells = [[(f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "-")))
              for k in keys] for r in rows]
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()

    return "\n".join([line(keys), line(["-" * w for w in widths])] + [line(c) for c in cells])


def write_sweep_summary(sweep_dir: str | Path) -> Path | None:
    """Prints the table of a sweep's jobs and writes it to `sweep_dir/summary.csv`."""
    import csv

    rows = sweep_rows(sweep_dir)
    if not rows:
        print(f"[gpurl] sweep {sweep_dir}: no finished job to summarize.", flush=True)
        return None
    out = Path(sweep_dir) / "summary.csv"
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, restval="", fieldnames=["job", "overrides", *_eval_keys(rows),
                                                           "run_dir", "all_overrides"])
        writer.writeheader()
        writer.writerows(rows)
    varying = rows[0]["overrides"].split()
    common = [o for o in rows[0]["all_overrides"].split() if o not in varying]
    shared = f"; every job: {' '.join(common)}" if common and len(rows) > 1 else ""
    print(f"[gpurl] sweep summary ({len(rows)} jobs, also in {out}{shared}):\n"
          f"{sweep_table(rows)}", flush=True)
    return out


def sweep_summary_callback() -> Any:
    """Hydra callback (configs/config.yaml, hydra.callbacks): the table at the end of `-m`."""
    from hydra.experimental.callback import Callback

    class SweepSummary(Callback):
        def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
            write_sweep_summary(config.hydra.sweep.dir)

    return SweepSummary()


def _generate_job(cfg_node: Any) -> None:
    from gpurl.rollout.generate import generate

    try:
        generate(to_config(cfg_node, GenerateConfig))
    except ConfigError as e:
        _fail(str(e))


def _eval_job(cfg_node: Any) -> None:
    from gpurl.train.evaluate import evaluate

    try:
        evaluate(to_config(cfg_node, EvalConfig))
    except ConfigError as e:
        _fail(str(e))


JOBS = {"train": _train_job, "generate": _generate_job, "eval": _eval_job}


def _fail(message: str) -> typing.NoReturn:
    print(f"gpurl: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _run_hydra(subcommand: str, args: list[str]) -> None:
    import hydra

    _register_schema()
    sys.argv = [f"gpurl {subcommand}", *args]
    hydra.main(config_path=str(config_dir()), config_name=APPS[subcommand].config_name,
               version_base="1.3")(JOBS[subcommand])()


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
    from gpurl.train.export import export_run

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
    from gpurl.train.plots import plot_runs

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


def _quote_free_text(arg: str) -> str:
    """`prompt=12 + 7 =` is free text, not Hydra grammar: pass it as one quoted string."""
    key, sep, value = arg.partition("=")
    if key != "prompt" or not sep or (value[:1] in "'\"" and value[-1:] == value[:1] and value):
        return arg
    escaped = value.replace("\\", "\\\\").replace("'", "\\'").replace("${", "\\${")
    return f"prompt='{escaped}'"


def _check_launcher(args: list[str]) -> None:
    """`hydra/launcher=slurm` (or submitit_*) needs an optional plugin: say so in one line."""
    import importlib.util

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
    if command in ("export", "plot"):
        (_export if command == "export" else _plot)(rest)
        return
    if command == "generate":
        rest = [_quote_free_text(a) for a in rest]
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _check_launcher(rest)
    if not any(a.split("=")[0] in _HYDRA_INFO_FLAGS for a in rest):
        try:
            validate([a for a in rest if a not in ("-m", "--multirun")], APPS[command])
        except ConfigError as e:
            _fail(str(e))
    _run_hydra(command, rest)


if __name__ == "__main__":
    main()
