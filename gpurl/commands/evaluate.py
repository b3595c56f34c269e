"""`gpurl eval`: greedy accuracy and pass@k on the held-out prompts of a data config, for
a model preset, a checkpoint, or a gpurl run. The same code the training loop evaluates
with (`gpurl.rollout.rounds.Rounds.evaluate`), so the figures are comparable."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from gpurl.config import ConfigError, EvalConfig
from gpurl.data.sources import default_rewards, load_prompts
from gpurl.distributed import layout, runtime
from gpurl.distributed.mesh import job_devices
from gpurl.models import loading, model_spec
from gpurl.rewards import from_config as load_rewards
from gpurl.rollout.rounds import Rounds, rollout_engine
from gpurl.rollout.prompts import encode_prompts
from gpurl.rollout.requests import prompt_width
from gpurl.train.checkpoint import Checkpointer
from gpurl.train.restore import restore_run


def evaluate(cfg: EvalConfig) -> dict[str, float]:
    runtime.initialize(cfg.distributed)
    if cfg.checkpoint is not None:
        run_cfg, params = restore_run(cfg.checkpoint)
        model_cfg, source = run_cfg.model, f"{cfg.checkpoint} (step {_step(cfg.checkpoint)})"
    else:
        model_cfg, params, source = loading.resolve(cfg.model), None, cfg.model.name
    spec = model_spec(model_cfg)
    tokenizer = loading.load_tokenizer(model_cfg)
    _, eval_rows = load_prompts(cfg.data)
    if not eval_rows:
        raise ConfigError(f"data={cfg.data.name} has no held-out prompts; set data.num_eval > 0 "
                          f"or data.eval_path.")
    prompts, skipped = encode_prompts(eval_rows, tokenizer, cfg.data.chat_template,
                                      cfg.data.max_len, "eval")
    rewards = load_rewards(cfg.rewards, [] if cfg.env.on else default_rewards(cfg.data))
    mesh = layout.for_sampling(cfg.mesh, spec, job_devices())
    engine = rollout_engine(spec, tokenizer, cfg.rollout, mesh, env=cfg.env)
    rounds = Rounds(engine, tokenizer, rewards, prompt_width(max(len(t) for t in prompts.tokens)),
                    cfg.env)
    if params is None:
        params = loading.load_params(model_cfg, spec, engine.stacked_shardings)
    if params is None:
        print(f"[gpurl] {model_cfg.name} has no checkpoint: evaluating random weights.", flush=True)
        params = jax.jit(lambda: spec.init(cfg.seed),
                         out_shardings=engine.stacked_shardings)()
    figures = rounds.evaluate(engine.place(params), prompts, cfg.pass_k, cfg.batch_size, cfg.seed)
    if runtime.is_main_process():
        print(f"[gpurl] eval of {source} on {len(prompts)} held-out {cfg.data.name} prompts "
              f"({skipped} longer than data.max_len skipped), correct = "
              f"{rewards[0].name} >= 1:", flush=True)
        for key, value in figures.items():
            print(f"  {key:<16} {value:.4f}", flush=True)
        if cfg.out:
            Path(cfg.out).write_text(json.dumps(figures, indent=2) + "\n")
    return figures


def _step(run_dir: str) -> str:
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", keep=1)
    try:
        return str(ckpt.latest_step())
    finally:
        ckpt.close()
