"""The command line: composition, overrides, help, and one-sentence errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpurl.cli import validate
from gpurl.config import ConfigError, Config


def _gpurl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpurl.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_overrides_compose_into_frozen_config():
    cfg = validate(["model.d_model=32", "train.steps=7", "optim.lr=3e-4", "rollout.mode=one_ahead",
                    "data=jsonl", "data.path=/tmp/x.jsonl", "mesh.train_rules.embed=[tp]"])
    assert isinstance(cfg, Config)
    assert (cfg.model.d_model, cfg.train.steps, cfg.optim.lr) == (32, 7, 3e-4)
    assert cfg.rollout.mode == "one_ahead"
    assert cfg.data.name == "jsonl" and cfg.data.max_len == 512  # group option's own values
    assert cfg.mesh.train_rules["embed"] == ("tp",)
    assert cfg.run.dir == "runs/grpo-gemma3_270m-jsonl"  # interpolated, the same on every process
    with pytest.raises(Exception):
        cfg.train.steps = 3  # frozen


def test_defaults_are_the_main_job_and_presets_carry_published_values():
    cfg = validate([])
    assert (cfg.algo.name, cfg.model.name, cfg.data.name, cfg.data.few_shot) == (
        "grpo", "gemma3_270m", "arithmetic", 4)
    assert cfg.rollout.stop == ("\n",) and cfg.optim.lr == 1e-6 and cfg.optim.freeze == ("^embed$",)
    assert (cfg.algo.beta, cfg.algo.epsilon, cfg.algo.loss_agg) == (0.04, 0.2, "seq_mean_token_mean")
    gspo = validate(["algo=gspo"]).algo
    assert (gspo.importance, gspo.epsilon, gspo.clip_high, gspo.beta) == ("sequence", 3e-4, 4e-4, 0.0)
    dapo = validate(["algo=dapo"]).algo
    assert (dapo.clip_high, dapo.loss_agg, dapo.dynamic_sampling, dapo.beta) == (
        0.28, "token_mean", True, 0.0)
    drgrpo = validate(["algo=drgrpo"]).algo
    assert (drgrpo.advantage, drgrpo.loss_agg) == ("drgrpo", "seq_mean_token_sum_norm")
    rloo = validate(["algo=rloo"]).algo
    assert (rloo.advantage, rloo.kl_in_reward) == ("rloo", True)
    sft = validate(["algo=sft", "model=tiny", "data=arithmetic", "optim=adamw", "train=default"])
    assert (sft.algo.name, sft.optim.lr, sft.data.few_shot) == ("sft", 1e-3, 0)
    cfg = validate(["rewards=[numeric_match,boxed_format]", "reward_weights=[1.0,0.5]"])
    assert cfg.rewards.functions == ("numeric_match", "boxed_format") and cfg.rewards.weights == (1.0, 0.5)
    with pytest.raises(ConfigError, match="2 rewards but 1 reward_weights"):
        validate(["rewards=[numeric_match,boxed_format]", "reward_weights=[1.0]"])


def test_eval_command_composes():
    from gpurl.cli import APPS
    from gpurl.config import EvalConfig

    cfg = validate(["checkpoint=runs/x", "pass_k=8", "data=countdown"], APPS["eval"])
    assert isinstance(cfg, EvalConfig) and cfg.pass_k == 8 and cfg.data.name == "countdown"
    with pytest.raises(ConfigError, match="unknown config key 'pass_kk'"):
        validate(["pass_kk=3"], APPS["eval"])


@pytest.mark.parametrize("override,expected", [
    ("train.stepz=3", "unknown config key 'train.stepz'; did you mean 'train.steps'?"),
    ("train.steps=abc", "bad value for 'train.steps'"),
    ("model=tinyy", "model=tinyy is not a known option; use one of: gemma2_2b, "),
    ("optim.decay=linear", "optim.decay='linear' is not valid; use one of: cosine, constant."),
    ("model.num_kv_heads=3", "model.num_heads=4 is not a multiple of model.num_kv_heads=3"),
    ("mesh.train_rules.embed=[fsdpp]", "mesh.train_rules names unknown mesh axes ['fsdpp']"),
    ("algo.ratio_mask=tokens", "algo.ratio_mask='tokens' is not valid; use one of: off, token, "
                               "sequence, geometric."),
    ("algo.ratio_mask_low=1.5", "algo.ratio_mask_low=1.5 and algo.ratio_mask_high=5.0 must "
                                "bracket 1"),
])
def test_bad_overrides_fail_with_one_sentence(override, expected):
    with pytest.raises(ConfigError, match=None) as info:
        validate([override])
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_sweep_values_are_each_validated():
    with pytest.raises(ConfigError, match="optim.lr"):
        validate(["optim.lr=1e-3,abc"])
    assert validate(["optim.lr=1e-3,3e-3"]).optim.lr == 1e-3


def test_process_reports_typo_in_one_line_and_exit_code_2():
    out = _gpurl("train", "train.stepz=3")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "gpurl: error: unknown config key 'train.stepz'; did you mean 'train.steps'? "
        "run `gpurl train --cfg job` to list every key."]


@pytest.mark.slow
def test_help_lists_groups_and_cfg_prints_config():
    help_text = _gpurl("train", "--help").stdout
    for group in ("algo:", "model:", "data:", "optim:", "train:", "rollout:", "mesh:",
                  "logger:", "run:"):
        assert group in help_text
    job = _gpurl("train", "--cfg", "job", "train.steps=9")
    assert job.returncode == 0
    assert "steps: 9" in job.stdout and "mode: sync" in job.stdout
    assert "unknown command 'trian'" in _gpurl("trian").stderr
