"""`gpurl generate`: sample completions from a preset, a checkpoint or a gpurl run and
print them. Each process generates and prints only the rows it holds, through the rollout
engine (continuous batching); a `prompts_file` row may set its own `max_new_tokens`,
`temperature` and `seed`."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np

from gpurl.config import ConfigError, GenerateConfig, ModelConfig
from gpurl.distributed import layout, runtime
from gpurl.distributed.mesh import job_devices, rollout_mesh
from gpurl.models import Params, loading, model_spec
from gpurl.models.tokenizer import Tokenizer
from gpurl.data.sources import load_prompts, read_jsonl
from gpurl.rollout.decode import stop_token_ids, truncate
from gpurl.rollout.multiturn import EnvFactory, Episodes
from gpurl.rollout.prompts import encode_prompt, prompt_tools
from gpurl.rollout.engine import Engine
from gpurl.train.preflight import generate_checks, prompts_file_line
from gpurl.train.restore import restore_run


# Keys of a prompts_file row that override the rollout settings for that prompt.
ROW_SETTINGS = {"max_new_tokens": int, "temperature": float, "seed": int}


def read_prompts(cfg: GenerateConfig) -> list[tuple[str | list[dict], dict]]:
    """(prompt text or chat messages, the row's own settings) from `prompt` or `prompts_file`."""
    if cfg.prompt is not None:
        return [(cfg.prompt, {})]
    path = Path(cfg.prompts_file)
    prompts_file_line(str(path))  # (as `gpurl check generate`)
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
    params = loading.load_params(model_cfg, sampler.spec, sampler.stacked_shardings)
    if params is None:
        params = jax.jit(lambda: sampler.spec.init(cfg.seed), out_shardings=sampler.stacked_shardings)()
    return model_cfg, sampler, params


def generate(cfg: GenerateConfig) -> dict[int, tuple[str, int, float]]:
    runtime.initialize(cfg.distributed)
    generate_checks(cfg, *runtime.job_shape())  # what `gpurl check generate` runs, first
    tokenizers: dict[str, Tokenizer] = {}

    def sampler_for(model_cfg: ModelConfig) -> Engine:
        tokenizers["t"] = loading.load_tokenizer(model_cfg)
        spec = model_spec(model_cfg)
        mesh = layout.for_sampling(cfg.mesh, spec, job_devices())
        return Engine(spec, cfg.rollout, rollout_mesh(mesh),
                      cfg.mesh.sample_rules, pad_id=tokenizers["t"].pad_id,
                      stop_ids=stop_token_ids(tokenizers["t"], _stops(cfg),
                                              not cfg.rollout.ignore_eos))

    if cfg.env.agents:
        raise ConfigError("gpurl generate steps environments, not agents; run the agent against "
                          "`gpurl serve` to watch it play (docs/agents.md).")
    if cfg.env.on:
        return _trajectories(cfg, sampler_for, tokenizers)
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


def _stops(cfg: GenerateConfig) -> tuple[str, ...]:
    return tuple(cfg.rollout.stop) + (tuple(cfg.env.stop) if cfg.env.on else ())


def _env_rows(cfg: GenerateConfig) -> list[dict]:
    """Data rows of an environment: the prompt (file) rows with their metadata, or the
    first `num_prompts` held-out rows of `data`."""
    if cfg.prompt is not None:
        return [{"prompt": cfg.prompt}]
    if cfg.prompts_file is not None:
        if not cfg.prompts_file.endswith(".jsonl"):
            raise ConfigError(f"prompts_file={cfg.prompts_file} is not a .jsonl file; an "
                              f"environment reads each row's metadata (e.g. answer) from jsonl rows.")
        return read_jsonl(cfg.prompts_file, "prompts_file", need_completion=False)
    train, held_out = load_prompts(cfg.data)
    return (held_out or train)[:cfg.num_prompts]


def _trajectories(cfg: GenerateConfig, sampler_for,
                  tokenizers: dict[str, Tokenizer]) -> dict[int, tuple[str, int, float, float]]:
    """Multi-turn generation: each prompt's `n` trajectories with its environment, printed
    turn by turn (observations marked), with the environment's reward."""
    model_cfg, engine, params = _model(cfg, sampler_for)
    tokenizer = tokenizers["t"]
    rows = _env_rows(cfg)
    flat = [(rows[j], j * cfg.n + i) for j in range(len(rows)) for i in range(cfg.n)]
    count, rank = runtime.process_count(), runtime.process_index()
    per = -(-len(flat) // count)
    mine = flat[rank * per:(rank + 1) * per]
    tools = prompt_tools(cfg.env)  # the schemas a chat prompt shows
    requests = [engine.request(encode_prompt(tokenizer, row.get("messages") or row["prompt"],
                                             cfg.chat_template, tools), cfg.seed + i)
                for row, i in mine]
    episodes = Episodes(EnvFactory(cfg.env), tokenizer, _stops(cfg), cfg.env.max_tokens,
                        cfg.rollout.max_new_tokens, engine.routes_shape)
    requests = episodes.begin([row for row, _ in mine], [i for _, i in mine], requests)
    engine.generate(params, requests, resume=episodes.resume)
    out, records = {}, []
    for (row, i), traj in zip(mine, episodes.trajectories):
        if i % cfg.n == 0 or i == mine[0][1]:
            prompt = row.get("messages") or row["prompt"]
            shown = prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)
            print(f"=== prompt {i // cfg.n} ({model_cfg.name}, env {cfg.env.name}):\n{shown}", flush=True)
        reward = traj.reward(cfg.env)
        print(f"--- trajectory {i % cfg.n + 1}/{cfg.n}: {traj.turns} turns, reward {reward:g}"
              f"{' (ended by an error)' if traj.error else ''}, {traj.drawn} model tokens", flush=True)
        for is_model, ids in _spans(traj.tokens, traj.model):
            text = tokenizer.decode(ids)
            print(text if is_model else f"[env] {text}", end="" if text.endswith("\n") else "\n",
                  flush=True)
        model_lp = float(np.sum([lp for lp, m in zip(traj.logprobs, traj.model) if m]))
        out[i] = (tokenizer.decode(traj.tokens), len(traj.tokens), model_lp, reward)
        records.append({**row, "trajectory": [{"text": tokenizer.decode(ids), "train": m}
                                              for m, ids in _spans(traj.tokens, traj.model)],
                        "reward": reward, "turns": traj.turns})
    if cfg.record is not None:
        path = Path(cfg.record)
        if count > 1:
            path = path.with_name(f"{path.stem}-{rank}{path.suffix}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records),
                        encoding="utf-8")
        print(f"[gpurl] wrote {len(records)} trajectories to {path}", flush=True)
    return out


def _spans(tokens: list[int], model: list[bool]) -> list[tuple[bool, list[int]]]:
    """Runs of model tokens and of observation tokens, in order."""
    spans: list[tuple[bool, list[int]]] = []
    for t, m in zip(tokens, model):
        if spans and spans[-1][0] == m:
            spans[-1][1].append(t)
        else:
            spans.append((m, [t]))
    return spans
