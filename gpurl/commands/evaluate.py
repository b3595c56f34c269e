"""`gpurl eval`: greedy accuracy and pass@k on the held-out prompts of a data config, for
a model preset, a checkpoint, or a gpurl run. The same code the training loop evaluates
with (`gpurl.rollout.rounds.Rounds.evaluate`), so the figures are comparable. With
`suite=...`, the standard suites instead (`gpurl.commands.eval_suites`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import jax

from gpurl.commands import eval_suites
from gpurl.config import ConfigError, EnvConfig, EvalConfig, ModelConfig
from gpurl.data.sources import default_rewards, load_prompts
from gpurl.distributed import layout, runtime
from gpurl.distributed.mesh import job_devices
from gpurl.models import loading, model_spec
from gpurl.models.spec import Params
from gpurl.models.tokenizer import Tokenizer
from gpurl.rewards import from_config as load_rewards
from gpurl.rollout.engine import Engine
from gpurl.rollout.rounds import Rounds, rollout_engine
from gpurl.rollout.suites import load_rows
from gpurl.serve.agents import AgentRunner
from gpurl.rollout.prompts import encode_prompts, prompt_tools
from gpurl.rollout.requests import prompt_width
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.preflight import eval_checks
from gpurl.train.restore import restore_run


def evaluate(cfg: EvalConfig, from_run: Sequence[str] = ()) -> dict[str, float]:
    """`from_run`: the sections of `cfg` the command line took from the run's config
    (`gpurl.cli.compose.inherit_run_task`); the first line says where each came from.
    With `cfg.suite`, the standard suites instead (`eval_suites`)."""
    runtime.initialize(cfg.distributed)
    eval_checks(cfg, *runtime.job_shape())  # what `gpurl check eval` runs, first
    # the suites' rows before any weights are read: a missing dataset stops at once
    rows = load_rows(cfg.suite, cfg.suite_path, cfg.limit) if cfg.suite else None
    step = None
    if cfg.checkpoint is not None:
        run_cfg, params = restore_run(cfg.checkpoint)
        step = _step(cfg.checkpoint)
        model_cfg, source = run_cfg.model, f"{cfg.checkpoint} (step {step})"
    else:
        model_cfg, params, source = loading.resolve(cfg.model), None, cfg.model.name
    if rows is not None:
        if runtime.is_main_process():
            print(f"[gpurl] evaluating {source} on {eval_suites.describe(cfg, rows)}", flush=True)
        tokenizer = loading.load_tokenizer(model_cfg)
        engine, params = _sampler(cfg, model_cfg, params, tokenizer, env=None)
        return eval_suites.run(cfg, rows, tokenizer, engine, params, source, step)
    if runtime.is_main_process():
        print(f"[gpurl] evaluating {source}: {_task(cfg, from_run)}", flush=True)
    _, eval_rows = load_prompts(cfg.data)
    if not eval_rows:
        raise ConfigError(f"data={cfg.data.name} has no held-out prompts; set data.num_eval > 0 "
                          f"or data.eval_path.")
    tokenizer = loading.load_tokenizer(model_cfg)
    prompts, skipped = encode_prompts(eval_rows, tokenizer, cfg.data.chat_template,
                                      cfg.data.max_len, "eval", prompt_tools(cfg.env))
    rewards = load_rewards(cfg.rewards, [] if cfg.env.on else default_rewards(cfg.data))
    engine, params = _sampler(cfg, model_cfg, params, tokenizer, cfg.env)
    agents = (AgentRunner(cfg.env, engine, tokenizer, engine.stop_ids, cfg.rollout)
              if cfg.env.agents else None)
    rounds = Rounds(engine, tokenizer, rewards, prompt_width(max(len(t) for t in prompts.tokens)),
                    cfg.env, agents)
    try:
        figures = rounds.evaluate(params, prompts, cfg.pass_k, cfg.batch_size, cfg.seed)
    finally:
        rounds.close()
    if runtime.is_main_process():
        print(f"[gpurl] eval of {source} on {len(prompts)} held-out {cfg.data.name} prompts "
              f"({skipped} longer than data.max_len skipped), correct = "
              f"{rewards[0].name} >= 1:", flush=True)
        for key, value in figures.items():
            print(f"  {key:<16} {value:.4f}", flush=True)
        if cfg.out:
            Path(cfg.out).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def _sampler(cfg: EvalConfig, model_cfg: ModelConfig, params: Params | None,
             tokenizer: Tokenizer, env: EnvConfig | None) -> tuple[Engine, Params]:
    """The rollout engine on the sampling mesh, and the weights placed for it: the run's
    (`params`), else the checkpoint's, else random ones (said so)."""
    spec = model_spec(model_cfg)
    mesh = layout.for_sampling(cfg.mesh, spec, job_devices())
    engine = rollout_engine(spec, tokenizer, cfg.rollout, mesh, env=env)
    if params is None:
        params = loading.load_params(model_cfg, spec, engine.stacked_shardings)
    if params is None:
        print(f"[gpurl] {model_cfg.name} has no checkpoint: evaluating random weights.", flush=True)
        params = jax.jit(lambda: spec.init(cfg.seed),
                         out_shardings=engine.stacked_shardings)()
    return engine, engine.place(params)


def _task(cfg: EvalConfig, from_run: Sequence[str]) -> str:
    """The task in one line, each part marked with where it came from."""
    origin = lambda section: " (the run's)" if section in from_run else ""  # noqa: E731
    r = cfg.rollout
    rewards = ", ".join(cfg.rewards.functions) or "the data's default"
    parts = [f"data={cfg.data.name}{origin('data')}",
             f"rollout max_new_tokens={r.max_new_tokens} stop={list(r.stop)} "
             f"temperature={r.temperature}{origin('rollout')}",
             f"rewards {rewards}{origin('rewards')}",
             f"env={cfg.env.name if cfg.env.on else 'none'}{origin('env')}"]
    return "; ".join(parts)


def _step(run_dir: str) -> int | None:
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", keep=1)
    try:
        return ckpt.latest_step()
    finally:
        ckpt.close()
