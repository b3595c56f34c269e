"""`gpurl generate`: sample completions from a preset, a checkpoint or a gpurl run and
print them. Each process generates and prints only the rows it holds."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from gpurl.config import ConfigError, GenerateConfig, ModelConfig
from gpurl.distributed import runtime
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models import Params, loading, model_spec
from gpurl.models.tokenizer import Tokenizer
from gpurl.rollout.decode import local_completions, stop_token_ids
from gpurl.rollout.prompts import encode_prompt
from gpurl.rollout.sampler import Sampler
from gpurl.train.restore import restore_run


def read_prompts(cfg: GenerateConfig) -> list[str | list[dict]]:
    """Prompt texts (or chat messages) from `prompt` or `prompts_file`."""
    if cfg.prompt is not None:
        return [cfg.prompt]
    path = Path(cfg.prompts_file)
    if not path.is_file():
        raise ConfigError(f"prompts_file={path} does not exist; point it to a jsonl or text file.")
    prompts: list[str | list[dict]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix != ".jsonl":
            prompts.append(line)
            continue
        try:
            row = json.loads(line)
            prompts.append(row["messages"] if "messages" in row else row["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ConfigError(f"{path}:{number} is not a JSON object with a \"prompt\" or "
                              f"\"messages\" key; fix that line.") from None
    if not prompts:
        raise ConfigError(f"prompts_file={path} holds no prompts; add one per line.")
    return prompts


def _model(cfg: GenerateConfig, sampler_for) -> tuple[ModelConfig, Sampler, Params]:
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

    def sampler_for(model_cfg: ModelConfig) -> Sampler:
        tokenizers["t"] = loading.load_tokenizer(model_cfg)
        return Sampler(model_spec(model_cfg), cfg.rollout, rollout_mesh(cfg.mesh),
                       cfg.mesh.sample_rules, pad_id=tokenizers["t"].pad_id,
                       stop_ids=stop_token_ids(tokenizers["t"], cfg.rollout.stop))

    model_cfg, sampler, params = _model(cfg, sampler_for)
    tokenizer = tokenizers["t"]
    prompts = read_prompts(cfg)
    rows = [encode_prompt(tokenizer, p, cfg.chat_template) for p in prompts for _ in range(cfg.n)]
    count = runtime.process_count()
    rows += [rows[-1]] * (-len(rows) % count)  # equal rows per process
    per = len(rows) // count
    start = runtime.process_index() * per
    seeds = [cfg.seed + start + i for i in range(per)]
    rollout = sampler.generate(params, rows[start:start + per], seeds)
    # Rows are laid out process by process, each padded to the sampler's batch bucket.
    done = local_completions(rollout, tokenizer, cfg.rollout.stop, num_rows=rollout.tokens.shape[0])
    local_rows = sorted(done)[:per]
    out = {start + i: done[row] for i, row in enumerate(local_rows) if start + i < len(prompts) * cfg.n}
    for row, (text, length, logprob) in sorted(out.items()):
        prompt = prompts[row // cfg.n]
        if row % cfg.n == 0 or row == min(out):
            shown = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            print(f"=== prompt {row // cfg.n} ({model_cfg.name}):\n{shown}", flush=True)
        print(f"--- sample {row % cfg.n + 1}/{cfg.n} ({length} tokens, logprob {logprob:.2f}):\n"
              f"{text}", flush=True)
    return out

