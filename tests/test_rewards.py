"""Reward functions: answer extraction, weighting, user functions, clear failures."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from gpurl.config import ConfigError
from gpurl.rewards import load, score
from gpurl.rewards.builtin import extract_answer


@pytest.mark.parametrize("text,mode,expected", [
    ("so the answer is \\boxed{42}. Also 7", "auto", "42"),
    ("step 3 then 5\n#### 1,234", "auto", "1,234"),
    ("12 apples and 19 pears", "auto", "19"),
    (" 19\n4 + 1 = 5", "first", "19"),
    ("no digits", "auto", None),
    ("-3.5 degrees", "auto", "-3.5"),
])
def test_extract_answer(text, mode, expected):
    assert extract_answer(text, mode) == expected


def test_weighted_sum_of_builtins():
    rewards = load(["numeric_match", "length_penalty"], [1.0, 2.0])
    total, parts = score(rewards, ["q"] * 3, ["= 19", "#### 20", "nothing"], {"answer": [19, 19, 5]})
    np.testing.assert_allclose(parts["numeric_match"], [1, 0, 0])
    np.testing.assert_allclose(total, [1 - 2 * 4 / 1000, -2 * 7 / 1000, -2 * 7 / 1000])


def test_user_function_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(
        "def shouty(prompts, completions, **meta):\n"
        "    return [float(c.isupper()) for c in completions]\n"
        "def broken(prompts, completions, answer, **meta):\n"
        "    return [1.0 / int(a) for a in answer]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("myrewards", None)
    total, _ = score(load(["myrewards:shouty"]), ["p", "p"], ["YES", "no"], {})
    np.testing.assert_allclose(total, [1.0, 0.0])
    with pytest.raises(RuntimeError, match=r"'myrewards:broken' raised ZeroDivisionError: .* on row 11;"):
        score(load(["myrewards:broken"]), ["p"] * 3, ["a"] * 3, {"answer": [1, 0, 2]}, first_row=10)


@pytest.mark.parametrize("name,expected", [
    ("numeric", "neither built in"),
    ("nosuchmodule_xyz:fn", "could not be imported"),
    ("gpurl.rewards.builtin:nothing", "could not be imported"),
])
def test_bad_names_are_one_sentence(name, expected):
    with pytest.raises(ConfigError, match=expected):
        load([name])


def test_wrong_number_of_values_is_reported():
    with pytest.raises(RuntimeError, match="returned 1 values for 2 completions"):
        score(load(["numeric_match"]), ["p", "p"], ["1", "2"], {"answer": [1]})
