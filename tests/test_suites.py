"""The standard suites of `gpurl eval suite=...`: each suite's converter and scorer on fixture
rows in its published column layout (answers checked by hand), the GPQA shuffle, the
avg@n and pass@k estimators against a direct count, and one `gpurl eval suite=gsm8k` run
of the tiny model that writes the results table."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math

import numpy as np
import pytest

from gpurl.cli import APPS, main, validate
from gpurl.config import ConfigError
from gpurl.data import suites

# openai/gsm8k (main, test): question, answer with the final "#### x" line.
GSM8K = [
    {"question": "Janet's ducks lay 16 eggs per day. She eats three for breakfast every "
                 "morning and bakes muffins for her friends every day with four. She sells "
                 "the remainder at the farmers' market daily for $2 per fresh duck egg. How "
                 "much in dollars does she make every day at the farmers' market?",
     "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = "
               "$<<9*2=18>>18 every day at the farmer's market.\n#### 18"},
    {"question": "A company pays $1,250 to each of 2 workers. How much does it pay?",
     "answer": "1,250 * 2 = <<1250*2=2500>>2,500\n#### 2,500"},
]
# HuggingFaceH4/MATH-500 (test): problem, solution, answer, subject, level, unique_id.
MATH500 = [
    {"problem": "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates.  "
                "Enter your answer in the form $(r,\\theta),$ where $r > 0$ and "
                "$0 \\le \\theta < 2 \\pi.$",
     "solution": "We have that $r = \\sqrt{0^2 + 3^2} = 3.$ ... $\\boxed{\\left( 3, "
                 "\\frac{\\pi}{2} \\right)}.$",
     "answer": "\\left( 3, \\frac{\\pi}{2} \\right)", "subject": "Precalculus", "level": 2,
     "unique_id": "test/precalculus/807.json"},
    {"problem": "What is $\\frac{3}{6}$ in lowest terms?", "solution": "$\\boxed{\\frac{1}{2}}$",
     "answer": "\\frac{1}{2}", "subject": "Prealgebra", "level": 1,
     "unique_id": "test/prealgebra/1.json"},
]
# HuggingFaceH4/aime_2024 and yentinglin/aime_2025 (train): id, problem, solution, answer.
AIME2024 = [{"id": 60, "problem": "Every morning Aya goes for a $9$-kilometer-long walk and "
             "stops at a coffee shop afterwards. ... Find the number of minutes the walk takes "
             "her, including the $t$ minutes spent in the coffee shop.",
             "solution": "...", "answer": "204", "url": "https://artofproblemsolving.com/",
             "year": "2024"}]
AIME2025 = [{"id": "I-1", "problem": "Find the sum of all integer bases $b>9$ for which "
             "$17_b$ is a divisor of $97_b$.", "solution": "", "answer": 70,
             "url": "https://artofproblemsolving.com/", "year": 2025}]
# Idavidrein/gpqa (gpqa_diamond, train): the correct answer first, three incorrect ones.
GPQA = [{"Question": "Which gas makes up most of Earth's atmosphere by volume?",
         "Correct Answer": "Nitrogen", "Incorrect Answer 1": "Oxygen",
         "Incorrect Answer 2": " Argon\n", "Incorrect Answer 3": "Carbon dioxide",
         "Record ID": "rec0"}]


def _score(name: str, completions: list[str], answer: str) -> list[float]:
    return suites.get(name).score([""] * len(completions), completions,
                                  [answer] * len(completions))


def test_registry_has_each_suite_with_its_published_source():
    got = {s.name: (s.dataset, s.subset, s.split) for s in suites.SUITES.values()}
    assert got == {"gsm8k": ("openai/gsm8k", "main", "test"),
                   "math500": ("HuggingFaceH4/MATH-500", None, "test"),
                   "aime2024": ("HuggingFaceH4/aime_2024", None, "train"),
                   "aime2025": ("yentinglin/aime_2025", None, "train"),
                   "gpqa_diamond": ("Idavidrein/gpqa", "gpqa_diamond", "train")}
    with pytest.raises(ConfigError, match="suite='gsm9k' is not valid; use one of: gsm8k, "):
        suites.get("gsm9k")


def test_gsm8k_rows_and_scores():
    rows = [suites.get("gsm8k").convert(r, i, 0) for i, r in enumerate(GSM8K)]
    assert [r["answer"] for r in rows] == ["18", "2500"]
    assert rows[0]["prompt"] == (GSM8K[0]["question"] + "\nPlease reason step by step, and put "
                                 "your final answer within \\boxed{}.")
    assert _score("gsm8k", ["9 * 2 = 18, so \\boxed{18}.", "So she makes $18.\n#### 18",
                            "\\boxed{\\$18}", "\\boxed{16}"], "18") == [1.0, 1.0, 1.0, 0.0]
    assert _score("gsm8k", ["\\boxed{2,500}", "\\boxed{2500.0}"], "2500") == [1.0, 1.0]


def test_math500_latex_equivalent_answers():
    rows = [suites.get("math500").convert(r, i, 0) for i, r in enumerate(MATH500)]
    assert [r["answer"] for r in rows] == ["\\left( 3, \\frac{\\pi}{2} \\right)", "\\frac{1}{2}"]
    assert rows[1]["prompt"].startswith("What is $\\frac{3}{6}$ in lowest terms?\nPlease reason")
    assert _score("math500", ["\\boxed{(3, \\frac{\\pi}{2})}", "\\boxed{(3, \\pi)}"],
                  rows[0]["answer"]) == [1.0, 0.0]
    assert _score("math500", ["\\boxed{0.5}", "\\boxed{\\dfrac{1}{2}}", "\\boxed{\\frac12}",
                              "\\boxed{2}"], rows[1]["answer"]) == [1.0, 1.0, 1.0, 0.0]


def test_aime_rows_and_thinking_traces():
    a24 = suites.get("aime2024").convert(AIME2024[0], 0, 0)
    a25 = suites.get("aime2025").convert(AIME2025[0], 0, 0)
    assert (a24["answer"], a25["answer"]) == ("204", "70")  # b + 7 divides 56: b = 21, 49
    traces = [
        "<think>17_b = b + 7, so \\boxed{28}? No: b + 7 | 56.</think>b = 21, 49: \\boxed{70}",
        "b + 7 divides 56, so maybe \\boxed{28}.</think>\\boxed{70}",  # trace opened by the prompt
        "<think>the sum is \\boxed{70}</think>So the answer is \\boxed{28}.",
        "<think>the sum is \\boxed{70}, I think",  # never closed: no answer given
    ]
    assert _score("aime2025", traces, a25["answer"]) == [1.0, 1.0, 0.0, 0.0]
    assert suites.final_text("no trace \\boxed{1}") == "no trace \\boxed{1}"
    assert suites.final_text("<think>a</think>b</think>c") == "c"
    assert suites.final_text("<think>open") is None


def test_gpqa_shuffle_is_fixed_and_points_at_the_correct_option():
    suite = suites.get("gpqa_diamond")
    first, again = suite.convert(GPQA[0], 7, suite.seed), suite.convert(GPQA[0], 7, suite.seed)
    assert first == again
    letter = first["answer"]
    assert f"\n{letter}) Nitrogen" in first["prompt"] and ")  Argon" not in first["prompt"]
    assert first["prompt"].startswith("Answer the following multiple choice question. The last "
                                      "line of your response should be of the following format: "
                                      "'Answer: $LETTER'")
    assert first["prompt"].count("Nitrogen") == 1 and "\nD) " in first["prompt"]
    # the permutation depends on the row: the correct letter is not always the same
    letters = {suite.convert(GPQA[0], i, suite.seed)["answer"] for i in range(24)}
    assert letters == set("ABCD")
    options, at = suites.shuffled_options(GPQA[0], 7, suite.seed)
    assert options["ABCD".index(at)] == "Nitrogen" and sorted(options) == sorted(
        ["Nitrogen", "Oxygen", "Argon", "Carbon dioxide"])


def test_gpqa_letter_extraction_and_score():
    wrong = next(c for c in "ABCD" if c != "C")
    completions = ["Nitrogen is 78%.\nAnswer: C", "answer: c", f"Answer: {wrong}\nAnswer: $C$",
                   "so \\boxed{C}", f"<think>Answer: C</think>Answer: {wrong}",
                   "I am not sure.", "<think>Answer: C"]
    assert [suites.choice_letter(c) for c in completions] == ["C", "C", "C", "C", wrong, None, None]
    assert suites.score_choice([""] * 7, completions, ["C"] * 7) == [1, 1, 1, 1, 0, 0, 0]
    # a word after "Answer:" is no letter: "Definitely" is not D
    assert suites.choice_letter("Answer: Definitely not A.\nAnswer: (B)") == "B"
    assert suites.choice_letter("Answer: Definitely.") is None


@pytest.mark.parametrize("completion,letter", [
    ("**Answer:** C", "C"), ("Answer: **C**", "C"), ("Answer: \\(C\\)", "C"),
    ("Answer: $\\text{C}$", "C"), ("Answer:\nC", "C"), ("Answer: $\\boxed{\\text{C}}$", "C"),
    ("*Answer*: `C`", "C"), ("Answer: \\mathrm{C}.", "C"),
    # an article is no letter: the earlier answer stands, or none was given
    ("ANSWER: C\nAnswer: a subtle point", "C"), ("Answer: A subtle point.", None),
    ("Answer: A", "A"), ("Answer: (A) Nitrogen", "A")])
def test_gpqa_letters_in_markdown_and_latex_wrappers(completion, letter):
    """Letters written the ways models format them are read as simple-evals reads them
    once its normalize_response has dropped the wrappers."""
    assert suites.choice_letter(completion) == letter


def test_load_reads_a_local_copy_or_the_hub(tmp_path, monkeypatch):
    pytest.importorskip("pyarrow")
    import datasets

    gsm = tmp_path / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps(r) + "\n" for r in GSM8K))
    assert [r["answer"] for r in suites.load(suites.get("gsm8k"), str(gsm))] == ["18", "2500"]
    assert len(suites.load(suites.get("gsm8k"), str(gsm), limit=1)) == 1
    gpqa = tmp_path / "gpqa_diamond.parquet"
    datasets.Dataset.from_list(GPQA).to_parquet(str(gpqa))
    suite = suites.get("gpqa_diamond")
    assert suites.load(suite, str(gpqa)) == [suite.convert(GPQA[0], 0, suite.seed)]
    # the Hub's HuggingFaceH4/MATH-500 (one test.jsonl), from a cache laid out as
    # huggingface_hub writes it (offline: conftest sets HF_HUB_OFFLINE=1)
    from hub_server import Repo, commit_id, lay_out_cache

    from gpurl import hub
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub._snapshot.cache_clear()
    files = {"test.jsonl": "".join(json.dumps(r) + "\n" for r in MATH500).encode()}
    lay_out_cache(tmp_path / "hf" / "hub", "dataset", "HuggingFaceH4/MATH-500",
                  Repo({commit_id(files): files}, {"main": commit_id(files)}))
    assert [r["answer"] for r in suites.load(suites.get("math500"))] == [
        r["answer"] for r in MATH500]
    with pytest.raises(ConfigError, match=r"^suite=aime2024's dataset=HuggingFaceH4/aime_2024 is "
                                          r"not in the Hugging Face cache .* or set suite_path to "
                                          r"a local copy of its train split\.$"):
        suites.load(suites.get("aime2024"))
    with pytest.raises(ConfigError, match=r"has no 'problem' column; suite=aime2024 rows have "):
        suites.load(suites.get("aime2024"), str(gsm))


def _direct_pass_at_k(correct: np.ndarray, k: int) -> float:
    """The mean over problems of 1 - C(n - c, k) / C(n, k), by exact integer counts."""
    n = correct.shape[1]
    return float(np.mean([1 - math.comb(n - int(c), k) / math.comb(n, k) for c in correct.sum(1)]))


def test_estimators_against_a_direct_count():
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 8, 64):
        correct = rng.random((20, n)) < rng.random((20, 1))
        correct[0], correct[-1] = False, True  # none and all correct
        assert suites.avg_at_n(correct) == pytest.approx(np.mean([row.mean() for row in correct]))
        for k in range(1, n + 1):
            assert suites.pass_at_k(correct, k) == pytest.approx(_direct_pass_at_k(correct, k),
                                                                 abs=1e-12)
    # pass@k by enumeration: the share of k-subsets of the samples holding a correct one
    row = np.array([[True, False, False, True, False]])
    for k in range(1, 6):
        subsets = list(itertools.combinations(range(5), k))
        assert suites.pass_at_k(row, k) == pytest.approx(
            np.mean([row[0, list(s)].any() for s in subsets]))
    assert suites.pass_at_k(row, 1) == pytest.approx(suites.avg_at_n(row))
    assert [suites.pass_ks(n) for n in (1, 2, 6, 8)] == [[1], [1, 2], [1, 2, 4, 6], [1, 2, 4, 8]]
    with pytest.raises(ValueError, match="needs 1 <= k <= n"):
        suites.pass_at_k(row, 6)


# A DeepSeek-R1-Distill-style template: the generation prompt opens the thinking trace.
R1_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")


def test_unfinished_completions_score_zero_and_are_counted_cut():
    """Whether a completion is finished comes from what its prompt opened and how it ended
    (a stop id or string, not the token limit): the math reward and the suites' scorer give
    an unfinished one 0, whatever number it ends on, and the scorer's CUT column marks those
    cut at the limit. Prompts rendered through a template that opens `<think>` say so."""
    import jax
    from jax.sharding import Mesh

    from gpurl.models.tokenizer import byte_tokenizer
    from gpurl.rewards import Reward
    from gpurl.rewards.builtin import math_verify
    from gpurl.rollout.prompts import encode_prompts
    from gpurl.rollout.scoring import CUT, RowContext, ShardedScorer

    tok = byte_tokenizer()
    rows = [{"prompt": "What is 9 + 9?", "answer": "18"}]
    opened = encode_prompts(rows, _with_template(tok, R1_TEMPLATE), True, 1024, "test")[0].opened
    assert opened == (True,) and encode_prompts(rows, tok, True, 1024, "test")[0].opened == (False,)
    # (completion, ended on a stop id, its prompt opened a trace) -> finished
    cases = [("I computed 18 but ran out of", False, False),   # cut at the token limit
             ("I computed 18.", True, False),                   # finished
             ("so 18, or maybe 18", True, True),                # the prompt's trace never closed
             ("9 + 9 = 18</think>The answer is 18.", True, True),  # closed: finished
             ("<think>18", True, False),                        # its own trace left open
             ("The answer is 18. Stop", False, False)]          # ended at a stop string
    want = [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    encoded = [tok.encode(text) for text, _, _ in cases]
    n = max(map(len, encoded))
    tokens = np.asarray([t + [tok.pad_id] * (n - len(t)) for t in encoded], np.int32)
    scorer = ShardedScorer(Mesh(np.asarray(jax.devices()[:1]), ("data",)),
                           [Reward("math_verify", math_verify), Reward("suite", suites.score_math)],
                           tok, ("Stop",))
    ids = np.arange(len(cases), dtype=np.int32)
    context = RowContext(rows, len(cases), ids, tokens, np.asarray(list(map(len, encoded))),
                         np.asarray([c[1] for c in cases]), np.asarray([c[2] for c in cases]))
    out = np.asarray(scorer(jax.numpy.asarray(ids), context))
    np.testing.assert_array_equal(out[:, 1], want)  # the math reward
    np.testing.assert_array_equal(out[:, 2], want)  # the suites' scorer
    np.testing.assert_array_equal(out[:, CUT], [1, 0, 0, 0, 0, 0])
    # called outside a rollout (no `finished`), a completion counts as finished
    assert math_verify(["q"], ["I computed 18 but ran out of"], ["18"]) == [1.0]


def _with_template(tok, template):
    from gpurl.models.tokenizer import Tokenizer

    return Tokenizer(tok.tok, tok.eos_id, tok.pad_id, tok.bos_id, chat_template=template)


def test_suite_command_line():
    assert validate(["suite=math500"], APPS["eval"]).suite == ("math500",)
    cfg = validate(["suite=[gsm8k,aime2025]", "num_samples=4", "limit=3"], APPS["eval"])
    assert (cfg.suite, cfg.num_samples, cfg.limit) == (("gsm8k", "aime2025"), 4, 3)
    with pytest.raises(ConfigError, match="name exactly one suite with it"):
        validate(["suite=[gsm8k,aime2025]", "suite_path=x.jsonl"], APPS["eval"])
    with pytest.raises(ConfigError, match="suite='aime2026' is not valid; use one of: gsm8k"):
        validate(["suite=[gsm8k,aime2026]"], APPS["eval"])


@pytest.mark.slow
def test_gpurl_eval_suite_writes_the_results_table(tmp_path, capsys, monkeypatch):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in GSM8K * 2))
    # The random model answers nothing: a scorer that passes the first problem's samples
    # shows that each row's answer reaches the scorer and the counts reach the table.
    seen = []

    def first_correct(prompts, completions, answer, **_):
        seen.extend(answer)
        return [float(a == "18") for a in answer]

    monkeypatch.setitem(suites.SUITES, "gsm8k",
                        dataclasses.replace(suites.SUITES["gsm8k"], score=first_correct))
    main(["eval", "model=tiny", "suite=gsm8k", f"suite_path={data}", "limit=2",
          "num_samples=2", "rollout.max_new_tokens=8", f"out={tmp_path / 'out'}"])
    printed = capsys.readouterr().out
    assert "| suite | dataset | problems | avg@2 | pass@1 | pass@2 | cut |" in printed
    results = json.loads((tmp_path / "out" / "gsm8k.json").read_text())
    assert {"model", "step", "num_samples", "temperature", "max_new_tokens",
            "suites"} <= results.keys()
    figures = results["suites"]["gsm8k"]
    assert figures.keys() == {"dataset", "problems", "avg@2", "pass@1", "pass@2", "cut"}
    assert 0.0 <= figures["cut"] <= 1.0  # (the share of completions cut at 8 tokens)
    assert (figures["problems"], results["num_samples"]) == (2, 2)
    assert [figures[k] for k in ("avg@2", "pass@1", "pass@2")] == [0.5, 0.5, 0.5]
    assert sorted(seen) == ["18", "18", "2500", "2500"]
    table = (tmp_path / "out" / "gsm8k.md").read_text()
    assert table.splitlines()[-1].startswith(f"| gsm8k | {data} | 2 | ")


SUMS = [{"question": "1 + 1?", "answer": "so 2\n#### 2"},
        {"question": "2 + 2?", "answer": "so 4\n#### 4"}]


@pytest.mark.e2e
def test_an_rl_run_logs_the_suites_in_every_logger(tmp_path, monkeypatch):
    """train.suites=[gsm8k] in a GRPO run: the suite's Hub dataset (openai/gsm8k, read from a
    Hugging Face cache laid out here, offline) is sampled before step 1 and every
    train.suites_every steps (not at every held-out evaluation), and logged as eval/gsm8k/avg@n and
    eval/gsm8k/pass@k in metrics.jsonl, TensorBoard and summary.json."""
    from conftest import TINY_MODEL, make_config
    from hub_server import Repo, commit_id, lay_out_cache
    from test_hub import CARD, _parquet
    from test_plots import _tensorboard_scalars

    from gpurl import hub
    from gpurl.train.loop import train
    from gpurl.train.metrics import TENSORBOARD_DIR

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    hub._snapshot.cache_clear()
    files = {"README.md": CARD.encode(), "main/test-00000-of-00001.parquet": _parquet(SUMS),
             "main/train-00000-of-00001.parquet": _parquet(SUMS)}
    lay_out_cache(tmp_path / "hf" / "hub", "dataset", "openai/gsm8k",
                  Repo({commit_id(files): files}, {"main": commit_id(files)}))
    run_dir = tmp_path / "run"
    cfg = make_config(algo={"name": "grpo", "num_generations": 4},
                      model=dict(TINY_MODEL, tokenizer="bytes"),
                      data={"name": "arithmetic", "max_len": 16, "num_train": 16, "num_eval": 4},
                      logger={"name": "tensorboard", "progress": False},
                      rollout={"max_new_tokens": 4},
                      train={"steps": 2, "batch_size": 4, "eval_every": 1, "eval_batch_size": 8,
                             "eval_pass_k": 0, "suites": ("gsm8k",), "suites_every": 2,
                             "suites_samples": 2},
                      run={"dir": str(run_dir)})
    summary = train(cfg)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ("eval/gsm8k/avg@2", "eval/gsm8k/pass@1", "eval/gsm8k/pass@2")
    assert [r["step"] for r in rows if keys[0] in r] == [0, 2]
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 1, 2]
    for row in rows:
        if keys[0] in row:
            assert all(0.0 <= row[k] <= 1.0 for k in keys) and row[keys[1]] == row[keys[0]]
    scalars = _tensorboard_scalars(run_dir / TENSORBOARD_DIR)
    assert [step for step, _ in scalars["eval/gsm8k/avg@2"]] == [0, 2]
    assert set(keys) <= summary.keys() and set(keys) <= summary["start"].keys()
