"""Reward functions: answer extraction, weighting, user functions, clear failures."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from gpurl.config import ConfigError
from gpurl.rewards import load, score
from gpurl.rewards.builtin import extract_answer, math_verify, numeric_match


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


# (completion, gold answer, math_verify, numeric_match)
ANSWER_TABLE = [
    (r"so the answer is \boxed{\frac{1}{2}}", "0.5", 1.0, 0.0),
    (r"so the answer is \boxed{\frac{1}{2}}", "1/2", 1.0, 0.0),
    (r"half: $\frac{1}{2}$", "0.5", 1.0, 0.0),
    ("The answer is 0.5", r"\frac{1}{2}", 1.0, 0.0),
    ("x = 0.5", "1/2", 1.0, 0.0),
    ("She pays 12 dollars.", "12", 1.0, 1.0),
    ("She pays $12.", "12", 1.0, 1.0),
    (r"The side is $12 \text{ cm}$.", "12", 1.0, 1.0),
    (r"The side is \boxed{12 \text{ cm}}", "12", 1.0, 1.0),
    ("The area is 12 cm^2", "12", 1.0, 0.0),
    ("The answer is 1,000", "1000", 1.0, 1.0),
    ("The answer is 1000", "1,000", 1.0, 1.0),
    (r"\boxed{1,000}", "1000", 1.0, 1.0),
    ("#### 1 000", "1000", 1.0, 0.0),
    ("The temperature drops to -5 degrees", "-5", 1.0, 1.0),
    (r"\boxed{-5}", -5, 1.0, 1.0),
    ("The answer is 7", "8", 0.0, 0.0),
    ("no digits here", "5", 0.0, 0.0),
    ("The answer is 72. Check: 72 - 3 = 69", "72", 0.0, 0.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0, 0.0),
    (r"\boxed{[1, 2)}", "[1,2)", 1.0, 0.0),
    (r"\boxed{\{1, 2\}}", r"\{2, 1\}", 1.0, 0.0),
    ("50%", "50", 1.0, 1.0),
    ("50%", "0.5", 1.0, 0.0),
    (r"\boxed{\text{(A)}}", "A", 1.0, 0.0),
    (r"\boxed{1e3}", "1000", 0.0, 1.0),
    ("0.0000001", 1e-07, 1.0, 1.0),
    ("She sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", "72", 1.0, 1.0),
    ("She sold 72 clips.\n#### 72\nQuestion: 3 more?", 72, 1.0, 1.0),
]


@pytest.mark.parametrize("completion,gold,want_math_verify,want_numeric", ANSWER_TABLE)
def test_math_verify_against_numeric_match(completion, gold, want_math_verify, want_numeric):
    """Both read `\\boxed{}`, then `#### x`, then the last number, and drop units, `$` and
    thousands separators. math_verify also matches LaTeX and plain fractions (`\\frac{1}{2}`,
    `1/2`, on either side: numeric_match scores any fraction 0), radicals, sets, intervals,
    percentages (`50%` is 50 and 0.5) and `\\text{}` answers, and drops units with powers
    (`12 cm^2` is 12: numeric_match reads 2) and spaced thousands (`1 000`); it reads `1e3`
    as 1*e*3, numeric_match as 1000. Neither tells the answer from a later check
    (`72. Check: 72 - 3 = 69` is 69)."""
    assert math_verify([""], [completion], [gold]) == [want_math_verify]
    assert numeric_match([""], [completion], [gold]) == [want_numeric]


def test_math_verify_off_the_main_thread():
    # math-verify's own timeouts use SIGALRM, which raises ValueError outside the main thread
    completions = [r"\boxed{\frac{1}{2}}", "#### 72", "#### 71"]
    golds = ["0.5", "72", "72"]
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(v=math_verify(["p"] * 3, completions,
                                                                      golds)))
    thread.start()
    thread.join(60)
    assert out["v"] == [1.0, 1.0, 0.0]
    total, _ = score(load(["math_verify"], timeout_s=60), [""] * 3, completions, {"answer": golds})
    np.testing.assert_array_equal(total, [1, 1, 0])


def test_math_verify_drops_numbers_too_big_to_evaluate():
    # sympy would build 9^(9^9) in one GIL-holding call that no timeout stops: run in a
    # subprocess, so that a regression fails here instead of hanging the suite
    completions = [r"\boxed{9^{9^{9}}}", r"\boxed{9^{9^{9}}}", r"\boxed{(10^9)!}"]
    golds = ["5", "9^{9^{9}}", "5"]  # the same text still matches, as strings
    code = (f"from gpurl.rewards.builtin import math_verify\n"
            f"print(math_verify([''] * 3, {completions!r}, {golds!r}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "[0.0, 1.0, 0.0]", run.stderr
    # and without math-verify's two warnings that its own timeouts are off (issue 66)
    assert "Timeout is disabled" not in run.stderr, run.stderr


def test_math_verify_without_the_package_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install math-verify"):
        math_verify([""], ["1"], ["1"])


def test_first_line_match_reads_the_first_line_blind_to_case_and_spaces():
    from gpurl.rewards.builtin import first_line_match

    assert first_line_match(["p"] * 4, [" Top Left\nbottom left", "top right", " bottom",
                                        "\ntop left"],
                            answer=["top left", "top left", "bottom left", "top left"]
                            ) == [1.0, 0.0, 0.0, 1.0]
