"""`gpurl generate`: sample completions from a preset, a checkpoint or a gpurl run and
print them. Each process generates and prints only the rows it holds, through the rollout
engine (continuous batching); a `prompts_file` row may set its own `max_new_tokens`,
`temperature` and `seed`."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from gpurl.config import ConfigError, GenerateConfig, ModelConfig
from gpurl.distributed import runtime
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models import Params, loading, model_spec
from gpurl.models.tokenizer import Tokenizer
from gpurl.rollout.decode import stop_token_ids, truncate
from gpurl.rollout.prompts import encode_prompt
from gpurl.rollout.engine import Engine
from gpurl.train.restore import restore_run


# Keys of a prompts_file row that override the rollout settings for that prompt.
ROW_SETTINGS = {"max_new_tokens": int, "temperature": float, "seed": int}


def read_prompts(cfg: GenerateConfig) -> list[tuple[str | list[dict], dict]]:
    """(prompt text or chat messages, the row's own settings) from `prompt` or `prompts_file`."""
    if cfg.prompt is not None:
        return [(cfg.prompt, {})]
    path = Path(cfg.prompts_file)
    if not path.is_file():
        raise ConfigError(f"prompts_file={path} does not exist; point it to a jsonl or text file.")
    prompts: list[tuple[str | list[dict], dict]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append((line, {}))
            continue
        try:
            row = json.loads(line)
            prompt = row["messages"] if "messages" in row else row["prompt"]
            own = {k: cast(row[k]) for k, cast in ROW_SETTINGS.items() if row.get(k) is not None}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise ConfigError(f"{path}:{number} is not a JSON object with a \"prompt\" or "
                              f"\"messages\" key (and numbers for "
                              f"{', '.join(ROW_SETTINGS)}); fix that line.") from None
        if own.get("max_new_tokens", 1) < 1 or own.get("temperature", 0.0) < 0:
            raise ConfigError(f"{path}:{number} asks for max_new_tokens < 1 or a negative "
                              f"temperature; fix that line.")
        prompts.append((prompt, own))
    if not prompts:
        raise ConfigError(f"prompts_file={path} holds no prompts; add one per line.")
    return prompts


def _model(cfg: GenerateConfig, sampler_for) -> tuple[ModelConfig, Engine, Params]:
    if cfg.checkpoint is not None:
        run_cfg, params = restore_run(cfg.checkpoint)
        model_cfg = run_cfg.model
        return model_cfg, sampler_for(model_cfg), params
    model_cfg = loading.resolve(cfg.model)
    sampler = sampler_for(model_cfg)
    params = loading.load_params(model_cfg, sampler.spec, sampler.param_shardings)
    if params is None:
        params = jax.jit(lambda: sampler.spec.init(cfg.seed), out_shardings=sampler.param_shardings)()
    return model_cfg, sampler, params


def generate(cfg: GenerateConfig) -> dict[int, tuple[str, int, float]]:
    runtime.initialize(cfg.distributed)
    tokenizers: dict[str, Tokenizer] = {}

    def sampler_for(model_cfg: ModelConfig) -> Engine:
        tokenizers["t"] = loading.load_tokenizer(model_cfg)
        return Engine(model_spec(model_cfg), cfg.rollout, rollout_mesh(cfg.mesh),
                      cfg.mesh.sample_rules, pad_id=tokenizers["t"].pad_id,
                      stop_ids=stop_token_ids(tokenizers["t"], cfg.rollout.stop))

    model_cfg, engine, params = _model(cfg, sampler_for)
    tokenizer = tokenizers["t"]
    prompts = read_prompts(cfg)
    rows = [(encode_prompt(tokenizer, p, cfg.chat_template), own, j * cfg.n + i)
            for j, (p, own) in enumerate(prompts) for i in range(cfg.n)]
    count, rank = runtime.process_count(), runtime.process_index()
    per = -(-len(rows) // count)  # consecutive rows per process; the last may hold fewer
    mine = list(enumerate(rows))[rank * per:(rank + 1) * per]
    requests = [engine.request(ids, own.get("seed", cfg.seed) + (i if "seed" not in own else i % cfg.n),
                               own.get("max_new_tokens"), own.get("temperature"))
                for row, (ids, own, i) in mine]
    done = engine.generate(params, requests)
    out = {}
    for (row, _), c in zip(mine, done):
        text = truncate(tokenizer.decode(c.tokens.tolist()), cfg.rollout.stop)
        out[row] = (text, len(c.tokens), float(c.logprobs.sum()))
    for row, (text, length, logprob) in sorted(out.items()):
        prompt = prompts[row // cfg.n][0]
        if row % cfg.n == 0 or row == min(out):
            shown = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            print(f"=== prompt {row // cfg.n} ({model_cfg.name}):\n{shown}", flush=True)
        print(f"--- sample {row % cfg.n + 1}/{cfg.n} ({length} tokens, logprob {logprob:.2f}):\n"
              f"{text}", flush=True)
    return out
