"""A user's first hour (issue 49): data presets bring the rollout their answers need, the
first step says when completions cannot hold an answer, `gpurl eval checkpoint=RUN`
evaluates the run's own task, environments compose for eval and generate, their --help
lists only their groups, and `gpurl check` runs a real start's checks and exits."""

from __future__ import annotations

import pytest
import yaml

from gpurl.cli import APPS, main, validate
from gpurl.config.dicts import to_dict


def _run(capsys, *args: str) -> tuple[int, str]:
    """`gpurl ARGS` in this process: (exit status, stdout + stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("app", ["train", "eval"])
def test_reasoning_data_brings_a_rollout_that_holds_worked_answers(app):
    for data in (["data=gsm8k", "data.path=t.jsonl"], ["data=math", "data.path=t.jsonl"],
                 ["data=jsonl", "data.path=t.jsonl"], ["data=hf", "data.dataset=a/b"]):
        r = validate(data, APPS[app]).rollout
        assert (r.max_new_tokens, r.stop) == (512, ()), data
    # the command line still decides
    assert validate(["data=gsm8k", "data.path=t", "rollout=short"], APPS[app]).rollout.max_new_tokens == 8
    assert validate(["data=gsm8k", "data.path=t", "rollout.max_new_tokens=64"],
                    APPS[app]).rollout.max_new_tokens == 64
    assert validate([], APPS[app]).rollout.stop == ("\n",)  # the line-format main job keeps its own


def test_first_step_says_when_no_completion_can_hold_an_answer():
    from gpurl.train.loop import first_step_advice

    cfg = validate([])
    cut = first_step_advice(cfg, 1, {"completion/truncated": 1.0, "reward/mean": 0.5})
    assert len(cut) == 1 and "rollout.max_new_tokens=8" in cut[0]
    one_line = first_step_advice(cfg, 1, {"completion/truncated": 0.2, "reward/mean": 0.0})
    assert len(one_line) == 1 and "newline" in one_line[0] and "rollout.stop=[]" in one_line[0]
    assert first_step_advice(cfg, 1, {"completion/truncated": 0.5, "reward/mean": 0.3}) == []
    reasoning = validate(["data=gsm8k", "data.path=t"])
    assert first_step_advice(reasoning, 1, {"completion/truncated": 0.5, "reward/mean": 0.0}) == []


@pytest.mark.parametrize("app", ["eval", "generate"])
def test_environments_compose_for_eval_and_generate(app, capsys):
    cfg = validate(["env=calculator"], APPS[app])
    assert (cfg.env.name, cfg.data.name, cfg.rollout.max_new_tokens) == ("calculator", "calculator", 40)
    code, out = _run(capsys, app, "--help")
    groups = {line.split(":")[0] for line in out.splitlines()[out.splitlines().index("Config groups:") + 1:]}
    assert code == 0 and groups == {"model", "data", "rollout", "mesh", "env"}, out


def test_eval_of_a_run_evaluates_its_own_task(tmp_path):
    run = validate(["data=gsm8k", "data.path=t.jsonl", "rewards=[numeric_match]",
                    "rollout.temperature=0.6", "model=tiny"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(to_dict(run), sort_keys=False))
    ckpt = f"checkpoint={tmp_path}"
    cfg = validate([ckpt], APPS["eval"])
    assert (cfg.data.name, cfg.data.path, cfg.rewards.functions) == ("gsm8k", "t.jsonl", ("numeric_match",))
    assert (cfg.rollout.max_new_tokens, cfg.rollout.temperature) == (512, 0.6)
    inside = validate([ckpt, "rollout.max_new_tokens=99"], APPS["eval"]).rollout
    assert (inside.max_new_tokens, inside.temperature) == (99, 0.6)  # on top of the run's
    other = validate([ckpt, "data=countdown"], APPS["eval"])
    assert other.data.name == "countdown" and other.rewards.functions == ()  # the data's own
    env = validate([ckpt, "env=calculator"], APPS["eval"])
    assert (env.env.name, env.data.name, env.rollout.max_new_tokens) == ("calculator", "calculator", 40)


def test_check_runs_the_start_up_checks_and_exits(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out = _run(capsys, "check", "train", "model.dtype=float17")
    assert code == 2 and "model.dtype='float17' is not valid" in out
    code, out = _run(capsys, "check", "train", "processes=8")  # the preset's 4 prompts: raised
    assert code == 0 and ("train.batch_size: the preset's 4 prompts -> 8, the smallest count "
                          "that splits evenly over the 8 processes") in out, out
    code, out = _run(capsys, "check", "train", "processes=8", "train.batch_size=4")  # the user's
    assert code == 2 and out.strip().splitlines()[-1].endswith(
        "must split evenly over the 8 processes and the 8 batch shards of the trainer mesh; "
        "set train.batch_size=8 (or change mesh.data/mesh.fsdp/mesh.expert).")
    code, out = _run(capsys, "check", "train", "processes=8", "train.batch_size=8")
    assert code == 0 and "check passed" in out and "8 prompts x 8 over 8 process(es)" in out
    code, out = _run(capsys, "check", "train", "data=gsm8k", "data.path=missing.jsonl")
    assert code == 2 and out.strip().endswith(
        "data.path=missing.jsonl does not exist; point it at an existing path.")
    code, out = _run(capsys, "check", "train", "algo=sft", "model=tiny", "processes=2",
                     "train.batch_size=3", "train.eval_batch_size=4")
    assert code == 2 and "train.batch_size=3 rows" in out and "set train.batch_size=4" in out
    code, out = _run(capsys, "check", "generate", "env=tools", "env.tools=[no_such_pkg.m:f]")
    assert code == 2 and "could not be imported" in out
    code, out = _run(capsys, "check", "eval", f"checkpoint={tmp_path}")
    assert code == 2 and "holds no config.yaml" in out
    code, out = _run(capsys, "check", "train", "mesh.placement=split", "processes=2",
                     "devices=4", "mesh.rollout_devices=4", "train.batch_size=4",
                     "train.eval_batch_size=4")
    assert code == 0 and "4 rollout and 4 trainer devices" in out


def _fake_run(path, *overrides: str) -> None:
    """A run directory as a start leaves it (config.yaml, a checkpoint step), for `check`."""
    (path / "checkpoints" / "1").mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump(to_dict(validate(list(overrides))),
                                                     sort_keys=False))


def test_check_refuses_every_start_up_refusal_of_the_bad_input_tests(tmp_path, capsys, monkeypatch):
    """Each case of tests/test_early_exits.py that a start refuses before its first step
    (that test runs the real starts) is refused by `gpurl check train` with the same
    sentence: the two run one code path (`gpurl.train.preflight`)."""
    from test_early_exits import AFTER_START, CASES, TINY, write_inputs

    monkeypatch.chdir(tmp_path)
    write_inputs(tmp_path)
    _fake_run(tmp_path / "done", "algo=sft", *TINY)
    missed = []
    for name, (args, fragment) in CASES.items():
        if name in AFTER_START:
            continue
        args = [a.replace("{tmp}", str(tmp_path)) for a in args]
        if not any(a.startswith("run.dir=") for a in args):
            args.append(f"run.dir={tmp_path}/{name.replace(' ', '_')}")
        code, out = _run(capsys, "check", "train", *TINY, *args, "devices=1")  # as the starts
        last = out.strip().splitlines()[-1]
        if code != 2 or fragment not in last or not last.startswith("gpurl: error: "):
            missed.append(f"{name}: exit {code}, {last!r}")
    assert not missed, "\n".join(missed)


def test_check_counts_the_launchers_processes_and_refuses_what_plan_refuses(capsys):
    code, out = _run(capsys, "check", "train", "hydra/launcher=slurm",
                     "hydra.launcher.tasks_per_node=8", "train.batch_size=4")
    assert code == 2 and "over the 8 processes" in out.strip().splitlines()[-1], out
    code, out = _run(capsys, "check", "train", "hydra/launcher=slurm", "hydra.launcher.nodes=2",
                     "hydra.launcher.tasks_per_node=4", "train.batch_size=8")
    assert code == 0 and "job: 8 process(es) x 1 device(s)" in out, out
    code, out = _run(capsys, "check", "plan", "plan.target=h800")
    assert code == 2 and out.strip().endswith(
        "plan.target=h800 is not a GPU gpurl can compile for; use one of h100, h200, a100, v100.")


@pytest.mark.parametrize("devices,algo,works", [
    (3, "grpo", 6), (6, "grpo", 6), (8, "grpo", 8), (12, "grpo", 12),
    (3, "sft", 18), (6, "sft", 18), (12, "sft", 24)])
def test_a_batch_that_does_not_fit_the_devices_names_a_value_that_does(devices, algo, works, capsys):
    """The preset's batch named on N devices: one sentence naming train.batch_size with a
    value that `gpurl check` then passes; not named, the preset's batch is raised to that
    value by itself. The eval batch is rounded up to the batch shards by itself (an eval
    batch is a forward pass's width, not part of the figures)."""
    base = ["check", "train", f"algo={algo}", "model=tiny", f"devices={devices}"]
    preset = validate([f"algo={algo}"]).train
    code, out = _run(capsys, *base, f"train.batch_size={preset.batch_size}")  # named: kept
    last = out.strip().splitlines()[-1]
    assert code == 2 and last.endswith(f"set train.batch_size={works} (or change "
                                       f"mesh.data/mesh.fsdp/mesh.expert)."), last
    code, out = _run(capsys, *base, f"train.batch_size={works}")
    rounded = -(-preset.eval_batch_size // devices) * devices
    assert code == 0 and f"eval batch {rounded}" in out, out
    code, out = _run(capsys, *base)  # the preset's: raised to the same value, said so
    assert code == 0 and f"the preset's {preset.batch_size} " in out and f"-> {works}, " in out, out


def test_messages_that_lead_somewhere(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    code, out = _run(capsys, "check", "train", "model.checkpoint=runs/grpo")  # a mistyped path
    assert code == 2 and "runs/ holds no grpo" in out and "spelling" in out, out
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    code, out = _run(capsys, "check", "train", "algo=kd", "model=tiny", "algo.teacher=org/model")
    assert "algo.teacher: org/model (local, not the Hub id)" in out, out
    _fake_run(tmp_path / "run", *["model=tiny"])
    code, out = _run(capsys, "check", "train", f"model.checkpoint={tmp_path}/run")
    assert code == 2 and out.strip().endswith(
        f"model.checkpoint={tmp_path}/run is a gpurl run directory, not HF weights; export it "
        f"with `gpurl export checkpoint={tmp_path}/run out=DIR` and point model.checkpoint at "
        f"DIR, or continue the run itself with run.dir={tmp_path}/run.")


@pytest.mark.e2e
def test_the_advised_batches_start_on_3_6_8_and_12_devices(tmp_path):
    """The value the sentence names (6 on 3 or 6 devices, 12 on 12) starts a real run on
    that many host devices and trains a step, and so does the preset's batch on 8 (raised
    to 8 prompts by itself, as config.yaml records); all four at once."""
    import os
    import subprocess
    import sys

    from conftest import xla_flags

    runs = {}
    for devices, batch in ((3, 6), (6, 6), (8, None), (12, 12)):  # 8: the preset's, raised
        named = [f"train.batch_size={batch}"] if batch else []
        args = ["train", "algo=grpo", "model=tiny", *named, "train.steps=1",
                "data.num_eval=0", "train.save_final=false", "train.checkpoint_every=0",
                "logger.progress=false", f"run.dir={tmp_path}/d{devices}"]
        runs[devices] = subprocess.Popen(
            [sys.executable, "-m", "gpurl.cli", *args], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "XLA_FLAGS": xla_flags(devices)})
    for devices, run in runs.items():
        out = run.communicate(timeout=900)[0]
        assert run.returncode == 0 and (tmp_path / f"d{devices}" / "summary.json").exists(), \
            f"{devices} devices: {out[-2000:]}"
    assert yaml.safe_load((tmp_path / "d8" / "config.yaml").read_text())["train"]["batch_size"] == 8


def test_more_messages_that_lead_somewhere(capsys):
    code, out = _run(capsys, "check", "train", "mesh.placement=split", "devices=1")
    assert code == 2 and out.strip().endswith(
        "mesh.placement=split samples and trains on devices of their own, and this job has 1 "
        "device; use mesh.placement=colocated.")
    code, out = _run(capsys, "check", "train", "mesh.context=-1")  # mesh.data is -1 by default
    assert code == 2 and "set mesh.data=1 to let mesh.context fill them" in out, out
    code, out = _run(capsys, "check", "train", "rollout.ignore_eos=true")
    assert code == 0 and "warning: rollout.ignore_eos=true" in out, out
    code, out = _run(capsys, "check", "train", "train.suites=[gsm8k]")  # offline, not cached
    last = out.strip().splitlines()[-1]
    assert code == 2 and "hf download openai/gsm8k --repo-type dataset" in last, last
    assert "suite_path" not in last  # which train does not take
    code, out = _run(capsys, "check", "eval", "model=tiny", "suite=gsm8k")
    assert code == 2 and "suite_path" in out.strip().splitlines()[-1]  # which eval takes
