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
    code, out = _run(capsys, "check", "train", "processes=8")  # the default batch of 4 prompts
    assert code == 2 and "multiples of the 8 batch shards" in out.strip().splitlines()[-1]
    code, out = _run(capsys, "check", "train", "processes=8", "train.batch_size=8")
    assert code == 0 and "check passed" in out and "8 prompts x 8 over 8 process(es)" in out
    code, out = _run(capsys, "check", "train", "data=gsm8k", "data.path=missing.jsonl")
    assert code == 2 and out.strip().endswith(
        "data.path=missing.jsonl does not exist; point it at an existing path.")
    code, out = _run(capsys, "check", "train", "algo=sft", "model=tiny", "processes=2",
                     "train.batch_size=3", "train.eval_batch_size=4")
    assert code == 2 and "micro-batch (3 rows)" in out and "2 batch shards" in out
    code, out = _run(capsys, "check", "generate", "env=tools", "env.tools=[no_such_pkg.m:f]")
    assert code == 2 and "could not be imported" in out
    code, out = _run(capsys, "check", "eval", f"checkpoint={tmp_path}")
    assert code == 2 and "holds no config.yaml" in out
    code, out = _run(capsys, "check", "train", "mesh.placement=split", "processes=2",
                     "devices=4", "mesh.rollout_devices=4", "train.batch_size=4",
                     "train.eval_batch_size=4")
    assert code == 0 and "4 rollout and 4 trainer devices" in out
