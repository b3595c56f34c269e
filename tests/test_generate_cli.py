"""`gpurl generate`: prompts from the command line or a file, n samples each; clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gpurl.cli import APPS, validate
from gpurl.config import ConfigError
from gpurl.commands.generate import generate

TINY = ["model=tiny", "rollout.max_new_tokens=6", "rollout.temperature=0"]


@pytest.mark.slow
def test_command_line_prompt_with_spaces_and_equals_is_free_text():
    cfg = validate(["prompt=12 + 7 = it's", "n=3", "rollout.stop=[\\n]"], APPS["generate"])
    assert (cfg.prompt, cfg.n, cfg.model.name, cfg.rollout.stop) == ("12 + 7 = it's", 3, "gemma3_270m", ("\n",))
    out = subprocess.run([sys.executable, "-m", "gpurl.cli", "generate", *TINY,
                          "prompt=12 + 7 = it's", "n=2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("=== prompt 0 (tiny):\n12 + 7 = it's") == 1
    assert out.stdout.count("--- sample ") == 2
    greedy = [block.split("\n", 1)[1] for block in out.stdout.split("--- sample ")[1:]]
    assert greedy[0] == greedy[1]  # temperature 0: both samples are the greedy completion


@pytest.mark.slow
def test_prompts_file_rows_each_get_n_samples(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"{i} + 1 ="}) for i in range(3)) + "\n")
    out = generate(validate([*TINY, f"prompts_file={prompts}", "n=2"], APPS["generate"]))
    assert sorted(out) == list(range(6))
    assert all(0 < length <= 6 for _, length, _ in out.values())
    printed = capsys.readouterr().out
    assert [f"=== prompt {i} (tiny):\n{i} + 1 =" in printed for i in range(3)] == [True] * 3


@pytest.mark.parametrize("args,expected", [
    ([], 'give exactly one of prompt="..." or prompts_file=path.jsonl (or an environment, '
         'env=calculator, to use its data).'),
    (["prompt=x", "n=0"], "n=0 is not valid"),
    (["prompt=x", "nn=2"], "unknown config key 'nn'; did you mean 'n'?"),
])
def test_config_errors_are_one_sentence(args, expected):
    with pytest.raises(ConfigError) as info:
        validate([*TINY, *args], APPS["generate"])
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_missing_prompts_file_is_one_sentence(tmp_path):
    with pytest.raises(ConfigError, match="does not exist; point it to a jsonl or text file."):
        generate(validate([*TINY, f"prompts_file={tmp_path}/missing.jsonl"], APPS["generate"]))


@pytest.mark.slow
def test_prompts_file_rows_carry_their_own_limits_temperature_and_seed(tmp_path):
    rows = [{"prompt": "1 + 1 =", "max_new_tokens": 2},
            {"prompt": "1 + 1 =", "max_new_tokens": 9, "temperature": 1.0, "seed": 5},
            {"prompt": "1 + 1 =", "max_new_tokens": 9, "temperature": 1.0, "seed": 5},
            {"prompt": "1 + 1 ="}]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = generate(validate([*TINY, f"prompts_file={prompts}"], APPS["generate"]))
    assert 0 < out[0][1] <= 2 and 0 < out[1][1] <= 9 and 0 < out[3][1] <= 6
    assert out[1] == out[2]  # the same prompt, temperature and seed: the same sample
    assert out[3][0].startswith(out[0][0]) and out[0][1] <= out[3][1]  # greedy: a prefix
    prompts.write_text(json.dumps({"prompt": "x", "max_new_tokens": 0}) + "\n")
    with pytest.raises(ConfigError, match=r"p.jsonl:1 asks for max_new_tokens < 1") as info:
        generate(validate([*TINY, f"prompts_file={prompts}"], APPS["generate"]))
    assert "\n" not in str(info.value)
