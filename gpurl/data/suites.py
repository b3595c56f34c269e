"""The standard evaluation suites of `gpurl eval suite=NAME`: GSM8K, MATH-500, AIME 2024,
AIME 2025 and GPQA-Diamond, each a `Suite` record (its Hub dataset, its customary prompt,
a converter from a published row to gpurl's {"prompt", "answer"} row, and its scorer), and
the estimators the results table reports (avg@n, unbiased pass@k).

A scorer is a reward function (`gpurl.rewards`: `(prompts, completions, answer,
finished) -> floats`), so the rollout's sharded scorer runs it like any other. Every scorer
first drops a thinking trace (`final_text`): reasoning models think inside
`<think>...</think>`, and a boxed guess inside the trace is not the answer; a completion
cut at the token limit or left thinking scores 0 (`gpurl.rewards.thinking`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from gpurl.config import ConfigError
from gpurl.config.checks import lookup
from gpurl.data.layouts import expect_str
from gpurl.data.sources import gsm8k_answer
from gpurl.data.tables import columns, open_hub, open_table
from gpurl.rewards.builtin import math_verify
from gpurl.rewards.thinking import final_text, unfinished_zero

# The instruction of DeepSeek-R1's usage recommendations (huggingface.co/deepseek-ai/
# DeepSeek-R1, "Usage Recommendations": in the user turn, as here) and of Qwen2.5-Math's
# chain-of-thought evaluation (github.com/QwenLM/Qwen2.5-Math, "qwen25-math-cot": there a
# system message), after the problem.
MATH_PROMPT = "{problem}\nPlease reason step by step, and put your final answer within \\boxed{{}}."

# openai/simple-evals `common.py` QUERY_TEMPLATE_MULTICHOICE, the zero-shot template
# DeepSeek-V3 and -R1 report GPQA-Diamond with.
CHOICE_PROMPT = (
    "Answer the following multiple choice question. The last line of your response should "
    "be of the following format: 'Answer: $LETTER' (without quotes) where LETTER is one of "
    "ABCD. Think step by step before answering.\n\n{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}")
LETTERS = "ABCD"
# simple-evals' ANSWER_PATTERN_MULTICHOICE ("Answer: X", any case), or a boxed letter, read
# after markdown and LaTeX wrappers are dropped (`_plain`, as simple-evals' normalize_response
# does: "**Answer:** C", "Answer: $\text{C}$", "Answer: \(C\)"), with the letter allowed on
# the next line. simple-evals takes the first match; the last is taken here, as its prompt
# asks for the answer on the last line and a reasoning model may write "Answer: A" while
# weighing the options. "A" or "a" followed on its line by a lowercase word is an article
# ("Answer: a subtle point"), not a letter.
_CHOICE = re.compile(r"(?i:answer)[ \t]*:\s*\(?([A-Da-d])\)?(?![A-Za-z0-9])|\\boxed\{([A-Da-d])\}")
_ARTICLE = re.compile(r"[ \t]+[a-z]")
# LaTeX commands whose argument is the text itself, and marks that only format
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mathit|mathsf|texttt)\{([^{}]*)\}")
_FORMAT_MARKS = ("**", "__", "*", "`", "\\(", "\\)", "\\[", "\\]", "\\$", "$")

# A published row, its index in the table and the suite's shuffle seed -> gpurl's row.
Convert = Callable[[dict, int, int], dict]
Scorer = Callable[..., list[float]]


@dataclass(frozen=True)
class Suite:
    """One benchmark: where its rows are published, how they become prompts, how a
    completion is scored."""

    name: str
    dataset: str  # Hub id of the published rows
    subset: str | None  # the dataset's config name
    split: str
    columns: tuple[str, ...]  # the columns a published row must have
    convert: Convert
    score: Scorer  # a reward function: 1.0 for a correct completion, else 0.0
    seed: int = 0  # multiple choice: options are shuffled per row from (seed, row index)


def score_math(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
               finished: Sequence[bool] | None = None, **_: Any) -> list[float]:
    """math-verify's judgment of the answer after the thinking trace (`final_text`); an
    unclosed trace, or an unfinished completion (`gpurl.rewards.thinking`), scores 0."""
    finals = [final_text(c) for c in completions]
    answered = [i for i, f in enumerate(finals) if f is not None]
    scores = [0.0] * len(completions)
    judged = math_verify([prompts[i] for i in answered], [finals[i] for i in answered],
                         [answer[i] for i in answered]) if answered else []
    for i, score in zip(answered, judged):
        scores[i] = score
    return unfinished_zero(scores, finished)


def _plain(text: str) -> str:
    """`text` without markdown emphasis, code marks, math delimiters and text-style LaTeX
    commands (their argument kept), so a letter so wrapped reads as the bare letter."""
    text = _LATEX_TEXT.sub(r"\1", text)
    for mark in _FORMAT_MARKS:
        text = text.replace(mark, "")
    return text


def choice_letter(completion: str) -> str | None:
    """The option letter a completion picks (the last `Answer: X` or `\\boxed{X}`, any
    case, in plain text: `_plain`), after its thinking trace; None when it picks none."""
    text = _plain(final_text(completion) or "")
    letters = [m.group(1) or m.group(2) for m in _CHOICE.finditer(text)
               if not (m.group(1) in ("A", "a") and _ARTICLE.match(text, m.end()))]
    return letters[-1].upper() if letters else None


def score_choice(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[Any],
                 finished: Sequence[bool] | None = None, **_: Any) -> list[float]:
    """1.0 when the picked letter (`choice_letter`) is the correct option's and the
    completion is finished (`gpurl.rewards.thinking`)."""
    return unfinished_zero([float(choice_letter(c) == a) for c, a in zip(completions, answer)],
                           finished)


def _text(row: dict, column: str, index: int) -> str:
    expect_str(row.get(column), f"row {index}: {column!r}")
    return row[column]


def _from_gsm8k(row: dict, index: int, seed: int) -> dict:
    """openai/gsm8k {"question", "answer": "...reasoning... #### 1,234"} -> answer "1234"."""
    return {"prompt": MATH_PROMPT.format(problem=_text(row, "question", index)),
            "answer": gsm8k_answer(_text(row, "answer", index), f"row {index}")}


def _from_math(row: dict, index: int, seed: int) -> dict:
    """MATH-500 and AIME rows {"problem", "answer"} (AIME answers may be integers)."""
    answer = row.get("answer")
    if answer is None or str(answer).strip() == "":
        raise ConfigError(f'row {index} has no "answer"; give every row its final answer.')
    return {"prompt": MATH_PROMPT.format(problem=_text(row, "problem", index)),
            "answer": str(answer).strip()}


def shuffled_options(row: dict, index: int, seed: int) -> tuple[list[str], str]:
    """(the four options in the order shown, the correct one's letter): GPQA publishes the
    correct answer first, so the order is a permutation drawn from (seed, row index), the
    same on every run and every process."""
    options = [_text(row, "Correct Answer", index).strip()]
    options += [_text(row, f"Incorrect Answer {i}", index).strip() for i in (1, 2, 3)]
    order = np.random.default_rng([seed, index]).permutation(len(options))
    return [options[i] for i in order], LETTERS[int(np.flatnonzero(order == 0)[0])]


def _from_gpqa(row: dict, index: int, seed: int) -> dict:
    """Idavidrein/gpqa {"Question", "Correct Answer", "Incorrect Answer 1".."3"} -> the
    shuffled multiple-choice prompt; answer: the correct option's letter."""
    shown, letter = shuffled_options(row, index, seed)
    prompt = CHOICE_PROMPT.format(question=_text(row, "Question", index).strip(),
                                  **dict(zip(LETTERS, shown)))
    return {"prompt": prompt, "answer": letter}


_MATH_COLUMNS = ("problem", "answer")
SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("gsm8k", "openai/gsm8k", "main", "test", ("question", "answer"), _from_gsm8k,
          score_math),
    Suite("math500", "HuggingFaceH4/MATH-500", None, "test", _MATH_COLUMNS, _from_math,
          score_math),
    Suite("aime2024", "HuggingFaceH4/aime_2024", None, "train", _MATH_COLUMNS, _from_math,
          score_math),
    # yentinglin/aime_2025: AIME 2025 I and II (30 rows) in one split and aime_2024's layout;
    # lighteval's aime25 task reads it. (opencompass/AIME2025 splits I and II into two
    # configs with a "question" column.)
    Suite("aime2025", "yentinglin/aime_2025", None, "train", _MATH_COLUMNS, _from_math,
          score_math),
    # Gated on the Hub: accept its terms and set HF_TOKEN once to download it.
    Suite("gpqa_diamond", "Idavidrein/gpqa", "gpqa_diamond", "train",
          ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
           "Incorrect Answer 3"), _from_gpqa, score_choice),
)}


def local_copy(suite: Suite) -> str:
    """The alternative to the Hub that errors about a suite's dataset offer."""
    return f"set suite_path to a local copy of its {suite.split} split"


def cache_step(suite: Suite) -> str:
    """The alternative for train.suites (which reads the cache only): filling it."""
    return (f"fill the cache on a machine with internet (`hf download {suite.dataset} "
            f"--repo-type dataset`, docs/offline.md) and copy it to this one")


def get(name: str) -> Suite:
    """The suite `name`, or one sentence naming the valid ones."""
    return lookup(SUITES, name, "suite")


def load(suite: Suite, path: str | None = None, limit: int = 0,
         dataset: str | None = None) -> list[dict]:
    """gpurl rows of `suite`: from its Hub dataset (`dataset`: the id pinned to a commit,
    `gpurl.distributed.pins`), or from `path` (a local copy of the published split: jsonl,
    parquet, csv, ...); `limit` > 0 keeps the first `limit`."""
    if path:
        table, source = open_table(path, "suite_path", suite.split), path
    else:
        table = open_hub(dataset or suite.dataset, suite.split, suite.subset,
                         f"suite={suite.name}'s dataset", local_copy(suite))
        source = suite.dataset
    missing = [c for c in suite.columns if c not in columns(table)]
    if missing:
        raise ConfigError(f"{source} has no {', '.join(repr(c) for c in missing)} column; "
                          f"suite={suite.name} rows have {', '.join(suite.columns)}.")
    count = min(limit, len(table)) if limit else len(table)
    rows = []
    for i in range(count):
        try:
            rows.append(suite.convert(table[i], i, suite.seed))
        except ConfigError as e:
            raise ConfigError(f"{source} {e}") from None
    return rows


def pass_ks(samples: int) -> list[int]:
    """The k of pass@k reported for `samples` per problem: 1, the powers of two below it,
    and `samples` itself."""
    ks = [2 ** i for i in range(samples.bit_length())]
    return ks + ([samples] if ks[-1] != samples else [])


def avg_at_n(correct_PxG: np.ndarray) -> float:
    """avg@n: the share of correct samples of each problem, averaged over the problems
    (every problem has the same n samples, so it is the mean of all of them)."""
    return float(np.mean(correct_PxG))


def pass_at_k(correct_PxG: np.ndarray, k: int) -> float:
    """pass@k averaged over the problems, with the unbiased estimator of Chen et al. 2021
    ("Evaluating Large Language Models Trained on Code", eq. 1): of n samples of which c
    are correct, 1 - C(n - c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k / i)
    (their numerically stable form: no binomial overflows)."""
    n = correct_PxG.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples per problem.")
    wrong_P = n - np.sum(correct_PxG, axis=1)
    i_G = np.arange(1, n + 1)
    factors_PxG = np.where(i_G[None] > wrong_P[:, None], 1.0 - k / i_G[None], 1.0)
    return float(np.mean(np.where(wrong_P < k, 1.0, 1.0 - np.prod(factors_PxG, axis=1))))
