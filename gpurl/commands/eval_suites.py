"""`gpurl eval suite=...`: the standard suites (`gpurl.data.suites`). Each suite's problems
are sampled `num_samples` times at rollout.temperature by the rollout engine, scored on the
rollout mesh by the suite's scorer (`Rounds.correct`, as held-out prompts are), and
reported as avg@n and pass@k: printed, and written as a markdown table and a JSON file
into `out`, else the run directory's eval/ (`checkpoint=RUN`)."""

from __future__ import annotations

import json
from pathlib import Path

from gpurl.config import EvalConfig
from gpurl.distributed import runtime
from gpurl.models.spec import Params
from gpurl.models.tokenizer import Tokenizer
from gpurl.rollout.engine import Engine
from gpurl.rollout.suites import SuiteRunner, logged

# Below this many new tokens, or stopping at a newline, no worked solution fits.
_WORKED_TOKENS = 256


def describe(cfg: EvalConfig, rows: dict[str, list[dict]]) -> str:
    """The task in one line: suites and sizes, samples, and the rollout that draws them."""
    r = cfg.rollout
    sizes = ", ".join(f"{name} ({len(problems)} problems)" for name, problems in rows.items())
    return (f"{sizes}; {cfg.num_samples} sample(s) each at temperature={r.temperature} "
            f"top_p={r.top_p}, max_new_tokens={r.max_new_tokens}, chat template "
            f"{'on' if cfg.data.chat_template else 'off'}")


def run(cfg: EvalConfig, rows: dict[str, list[dict]], tokenizer: Tokenizer, engine: Engine,
        params: Params, source: str, step: int | None) -> dict[str, float]:
    """Samples and scores every suite of `rows`; returns {"<suite>/<figure>": value}, and
    prints and writes the results table (main process)."""
    if runtime.is_main_process() and (cfg.rollout.max_new_tokens < _WORKED_TOKENS
                                      or "\n" in cfg.rollout.stop):
        print(f"[gpurl] rollout.max_new_tokens={cfg.rollout.max_new_tokens} stop="
              f"{list(cfg.rollout.stop)} leaves no room for a worked solution; use rollout="
              f"reasoning rollout.max_new_tokens=4096 (docs/evaluation.md).", flush=True)
    runner = SuiteRunner(rows, tokenizer, engine, cfg.data.chat_template, cfg.rewards.on_error,
                         cfg.rewards.timeout_s)
    results = runner.run(params, cfg.num_samples, cfg.batch_size, cfg.seed, cfg.suite_path)
    if runtime.is_main_process():
        _report(cfg, results, source, step)
    return logged(results)


def _report(cfg: EvalConfig, results: dict[str, dict], source: str, step: int | None) -> None:
    """Prints the markdown table; writes it and the JSON beside it into `out`, else the run
    directory's eval/ (`checkpoint=RUN`), named by the suites (and the step)."""
    r = cfg.rollout
    header = {"model": source, "step": step, "num_samples": cfg.num_samples,
              "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k,
              "max_new_tokens": r.max_new_tokens, "chat_template": cfg.data.chat_template,
              "seed": cfg.seed, "limit": cfg.limit}
    table = markdown(header, results)
    print(table, end="", flush=True)
    where = Path(cfg.out) if cfg.out else (Path(cfg.checkpoint) / "eval" if cfg.checkpoint
                                           else None)
    if where is None:
        return
    where.mkdir(parents=True, exist_ok=True)
    stem = "+".join(results) + (f"-step{step}" if step is not None else "")
    (where / f"{stem}.md").write_text(table)
    (where / f"{stem}.json").write_text(json.dumps({**header, "suites": results}, indent=2) + "\n")
    print(f"[gpurl] results: {where / stem}.md and .json", flush=True)


def markdown(header: dict, results: dict[str, dict]) -> str:
    """The results table: one row per suite, its figures as fractions of 1."""
    keys = [k for k in next(iter(results.values())) if k not in ("dataset", "problems")]
    lines = [f"# gpurl eval: {header['model']}", "",
             f"{header['num_samples']} sample(s) per problem at temperature "
             f"{header['temperature']} (top_p {header['top_p']}, top_k {header['top_k']}), "
             f"{header['max_new_tokens']} new tokens at most, chat template "
             f"{'on' if header['chat_template'] else 'off'}, seed {header['seed']}.", "",
             "| suite | dataset | problems | " + " | ".join(keys) + " |",
             "|---|---|---:|" + "---:|" * len(keys)]
    for name, figures in results.items():
        cells = [name, figures["dataset"], str(figures["problems"])]
        lines.append("| " + " | ".join(cells + [f"{figures[k]:.4f}" for k in keys]) + " |")
    return "\n".join(lines) + "\n"
