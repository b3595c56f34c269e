"""The standard suites (`gpurl.data.suites`) sampled by a rollout engine and scored on its
mesh: what `gpurl eval suite=...` reports, and what an RL run logs with `train.suites`.
Each suite's prompts are encoded once; every evaluation samples each problem n times at
the rollout temperature and reports avg@n and pass@k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpurl.config import RewardsConfig
from gpurl.data import suites
from gpurl.distributed.pins import agreed_pin
from gpurl.models.tokenizer import Tokenizer
from gpurl.rewards import Reward
from gpurl.rollout.engine import Engine
from gpurl.rollout.prompts import Prompts, encode_prompts
from gpurl.rollout.requests import prompt_width
from gpurl.rollout.rounds import Rounds

# Every problem counts (a skipped one would change the denominator): no prompt is too long.
_ANY_LENGTH = 2 ** 31


def load_rows(names: Any, path: str | None = None, limit: int = 0,
              offer_path: bool = True) -> dict[str, list[dict]]:
    """{suite: its gpurl rows} (`path`: a local copy of the one suite's split), read before
    any weights are loaded so that a missing dataset stops a command at once. Every process
    reads the commit of each suite's dataset that process 0 resolves (`agreed_pin`).
    `offer_path`: errors offer suite_path (gpurl eval), else filling the cache (train.suites)."""
    rows = {}
    for name in names:
        suite = suites.get(name)
        local = suites.local_copy(suite) if offer_path else suites.cache_step(suite)
        dataset = None if path else agreed_pin(suite.dataset, f"suite={name}'s dataset",
                                               "dataset", local)
        rows[name] = suites.load(suite, path, limit, dataset)
    return rows


class SuiteRunner:
    """Suites on one rollout engine: `run(params, ...)` -> {suite: figures}."""

    def __init__(self, rows: dict[str, list[dict]], tokenizer: Tokenizer, engine: Engine,
                 chat_template: bool, on_error: str = "stop", timeout_s: float = 0.0):
        self.parts: dict[str, tuple[str, Prompts, Rounds]] = {}
        for name, problems in rows.items():
            suite = suites.get(name)
            prompts, _ = encode_prompts(problems, tokenizer, chat_template, _ANY_LENGTH,
                                        f"suite={name}")
            scorer = Reward(name, suite.score, 1.0, on_error, timeout_s)
            width = prompt_width(max(map(len, prompts.tokens)))
            rounds = Rounds(engine, tokenizer, [scorer], width)
            self.parts[name] = (suite.dataset, prompts, rounds)

    def describe(self) -> str:
        return ", ".join(f"{name} ({len(prompts)} problems)"
                         for name, (_, prompts, _) in self.parts.items())

    def run(self, params: Any, samples: int, batch_rows: int, seed: int,
            dataset: str | None = None) -> dict[str, dict]:
        """{suite: {"dataset", "problems", "avg@n", "pass@1", "pass@2", ..., "cut"}}: "cut" is
        the share of completions cut at the token limit (each scored 0); `params` in the
        engine's layout; `dataset` names a local copy in place of the suite's Hub id."""
        out = {}
        for name, (hub_id, prompts, rounds) in self.parts.items():
            correct_PxG, cut_PxG = rounds.judged(params, prompts, samples, batch_rows, seed)
            figures = {"dataset": dataset or hub_id, "problems": len(prompts),
                       f"avg@{samples}": suites.avg_at_n(correct_PxG)}
            for k in suites.pass_ks(samples):
                figures[f"pass@{k}"] = suites.pass_at_k(correct_PxG, k)
            # completions that reached rollout.max_new_tokens: scored 0, whatever they held
            figures["cut"] = float(cut_PxG.mean())
            out[name] = figures
        return out


@dataclass(frozen=True)
class SuiteEvaluation:
    """A training run's `train.suites` on its rollout engine: called with parameters in the
    engine's layout, their figures as logged (`eval/<suite>/avg@n`, ...)."""

    runner: SuiteRunner
    samples: int
    batch_rows: int
    seed: int

    @classmethod
    def of(cls, train: Any, rows: dict[str, list[dict]], tokenizer: Tokenizer, engine: Engine,
           chat_template: bool, rewards: RewardsConfig) -> SuiteEvaluation:
        """`train`: the run's TrainConfig (suites_samples, the eval batch and the seed);
        `rows`: its suites' rows (`load_rows`)."""
        runner = SuiteRunner(rows, tokenizer, engine, chat_template, rewards.on_error,
                             rewards.timeout_s)
        return cls(runner, train.suites_samples, train.eval_batch_size, train.seed)

    def __call__(self, params: Any) -> dict[str, float]:
        return logged(self.runner.run(params, self.samples, self.batch_rows, self.seed))

    def __str__(self) -> str:
        return f"suites {self.runner.describe()} x {self.samples} sample(s)"


def logged(results: dict[str, dict]) -> dict[str, float]:
    """The figures as metrics: `eval/<suite>/avg@n`, `eval/<suite>/pass@k`."""
    return {f"eval/{name}/{key}": float(value) for name, figures in results.items()
            for key, value in figures.items() if key not in ("dataset", "problems")}
