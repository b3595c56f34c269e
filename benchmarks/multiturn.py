"""Multi-turn rollouts with and without the prefix cache, on the real Gemma 3 270M (fp32).

An environment with long observations (a tool that answers every turn with
`--obs-tokens` tokens of text, as a search or a file read does) runs `--turns` turns per
trajectory: the engine decodes a turn of up to `--turn-tokens` tokens, the environment's
reply is appended and the trajectory is queued again (`Engine.generate(resume=...)`, the
path `env=...` takes). `--rows` trajectories (`--group` completions of each prompt) run
at once. Each engine (`rollout.prefix_cache` true / false) does one warm-up call (it
compiles there), then `--repeats` timed calls, interleaved; the table reports the median
rollout seconds, the prefill tokens computed against the tokens new at each turn (the
prompt once per group, then each trajectory's observation), and the cache's hit rate.
Rows sample at temperature 1 with their own seeds (so a group's trajectories differ), and
the greedy tokens of both engines are checked equal first (log-probs to float32 rounding).

    python benchmarks/multiturn.py                     # Gemma 3 270M, 8 turns
    python benchmarks/multiturn.py --smoke             # tiny random model: the script runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from typing import Any, Sequence


sys.path.insert(0, str(Path(__file__).resolve().parent))

TOOL_TEXT = ("Result: the archive lists the following entries, each with its size in bytes "
             "and the date it was last changed; entries marked with a star were changed by "
             "the current user. ") * 8


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=8, help="turns per trajectory")
    p.add_argument("--rows", type=int, default=8, help="trajectories at once")
    p.add_argument("--group", type=int, default=4, help="completions per prompt")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--obs-tokens", type=int, default=64, help="tokens of each observation")
    p.add_argument("--turn-tokens", type=int, default=24, help="tokens the model writes per turn")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per engine (median)")
    p.add_argument("--smoke", "--cpu-smoke", action="store_true",
                   help="tiny random model, 3 turns of a few tokens: checks the script runs")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_multiturn.json"))
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.turns, args.rows, args.group, args.repeats = 3, 4, 2, 1
        args.prompt_tokens, args.obs_tokens, args.turn_tokens = 12, 10, 4
    if args.rows % args.group:
        p.error("--rows must be a multiple of --group.")
    return args


def load(smoke: bool) -> tuple[Any, Any, Any, Any, list[int], list[int]]:
    """(spec, mesh, rules, params, prompt tokens, observation tokens)."""
    if smoke:
        import jax

        from gpurl.config import MeshConfig, ModelConfig
        from gpurl.distributed.mesh import rollout_mesh, tree_shardings
        from gpurl.models import model_spec

        spec, mesh_cfg = model_spec(ModelConfig(name="tiny", dtype="float32", param_dtype="float32")), MeshConfig()
        mesh, rules = rollout_mesh(mesh_cfg), mesh_cfg.sample_rules
        params = jax.jit(spec.init, static_argnums=0, out_shardings=tree_shardings(
            spec.abstract_params, spec.logical_axes, rules, mesh))(0)
        vocab = spec.cfg.vocab_size
        return (spec, mesh, rules, params, [int(x) % vocab for x in range(3, 3 + 200)],
                [int(x) % vocab for x in range(7, 207)])
    from generate import load_gpurl  # benchmarks/generate.py
    from gpurl.models.gguf import default_gemma3_270m_path
    from gpurl.models.gguf_tokenizer import tokenizer_from_gguf

    path = default_gemma3_270m_path()
    tokenizer = tokenizer_from_gguf(path)
    spec, mesh, rules, params = load_gpurl(path)
    prompt = [tokenizer.bos_id] + tokenizer.encode("Question: which entries of the archive "
                                                   "changed this week? Think step by step. " * 8)
    return spec, mesh, rules, params, prompt, tokenizer.encode(TOOL_TEXT)


def run(engine: Any, params: Any, prompts: list[list[int]], seeds: list[int],
        observation: list[int], turns: int, temperature: float | None = None
        ) -> tuple[list[list[int]], float, dict, list[float]]:
    """One multi-turn rollout: (each trajectory's tokens, seconds, the engine's counts,
    the log-probs of every turn's tokens in the order they finished)."""
    from gpurl.rollout.requests import Request

    done_turns: dict[int, int] = {}
    last: dict[int, Request] = {}

    def resume(i: int, c: Any) -> Request | None:
        logprobs.extend(c.logprobs.tolist())
        done_turns[i] = done_turns.get(i, 0) + 1
        if done_turns[i] == turns:
            return None
        r = last.get(i, first[i])
        last[i] = dataclasses.replace(r, prompt=r.prompt + tuple(int(t) for t in c.tokens)
                                      + tuple(observation), offset=r.offset + len(c.tokens))
        return last[i]

    logprobs: list[float] = []
    first = [engine.request(p, s, temperature=temperature) for p, s in zip(prompts, seeds)]
    t0 = time.perf_counter()
    out = engine.generate(params, first, resume=resume)
    seconds = time.perf_counter() - t0
    trajectories = [list(last.get(i, first[i]).prompt) + c.tokens.tolist() for i, c in enumerate(out)]
    return trajectories, seconds, dict(engine.stats), logprobs


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from gpurl.config import RolloutConfig
    from gpurl.rollout.engine import Engine

    spec, mesh, rules, params, prompt, obs = load(args.smoke)
    observation = (obs * (args.obs_tokens // max(len(obs), 1) + 1))[:args.obs_tokens]
    prompts = [prompt[:args.prompt_tokens - 1] + [100 + g] for g in range(args.rows // args.group)
               for _ in range(args.group)]
    seeds = list(range(args.rows))
    cfg = RolloutConfig(max_new_tokens=args.turn_tokens, temperature=1.0, slots=args.rows,
                        block_size=16, decode_chunk=8)
    engines = {name: Engine(spec, dataclasses.replace(cfg, prefix_cache=on), mesh, rules,
                            stop_ids=(), pad_id=0) for name, on in (("cache", True), ("none", False))}
    new = (args.prompt_tokens * (args.rows // args.group)
           + args.rows * (args.turns - 1) * args.obs_tokens)
    # greedy first (it compiles most programs): the cache changes no token, and log-probs
    # only by float32 rounding (sampled tokens can flip where a draw falls that close to a
    # boundary between two tokens, so the timed calls are not compared token for token)
    greedy = {name: run(engine, params, prompts, seeds, observation, args.turns, 0.0)
              for name, engine in engines.items()}
    assert greedy["cache"][0] == greedy["none"][0], "the prefix cache changed a greedy token"
    logprob_diff = float(np.abs(np.subtract(greedy["cache"][3], greedy["none"][3])).max())
    print(f"  greedy: tokens equal, log-probs within {logprob_diff:.1e}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in engines}
    counts: dict[str, dict] = {}
    for repeat in range(args.repeats + 1):  # the first sampled call of each compiles the rest
        for name, engine in engines.items():
            _, seconds, counts[name], _ = run(engine, params, prompts, seeds, observation,
                                              args.turns)
            if repeat:
                times[name].append(seconds)
            print(f"  {name:5s} call {repeat}: {seconds:.2f} s", flush=True)
    rows = []
    for name in engines:
        c = counts[name]
        rows.append({"prefix_cache": name == "cache", "rollout_s": statistics.median(times[name]),
                     "prefill_tokens": int(c["prefill_tokens"]), "new_tokens": new,
                     "prefill_per_new": c["prefill_tokens"] / new,
                     "hit_rate": c["cached_tokens"] / max(c["sequence_tokens"], 1),
                     "prefill_s": c["prefill_s"], "decode_s": c["decode_s"]})
    speedup = rows[1]["rollout_s"] / rows[0]["rollout_s"]
    print(f"\n{args.turns} turns, {args.rows} trajectories ({args.group} per prompt), prompt "
          f"{args.prompt_tokens}, observations {args.obs_tokens}, turns of {args.turn_tokens} "
          f"tokens ({'tiny model' if args.smoke else 'Gemma 3 270M fp32'}, sampled, "
          f"median of {args.repeats})")
    print("| prefix cache | rollout s | prefill s | decode s | prefill tokens | / new tokens | hit rate |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {'on' if r['prefix_cache'] else 'off'} | {r['rollout_s']:.2f} | {r['prefill_s']:.2f} "
              f"| {r['decode_s']:.2f} | {r['prefill_tokens']:,} | {r['prefill_per_new']:.2f} "
              f"| {r['hit_rate']:.2f} |")
    print(f"\nrollout with the cache: {speedup:.2f}x faster; greedy tokens equal, log-probs "
          f"within {logprob_diff:.1e}")
    Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "speedup": speedup,
                                           "greedy_logprob_diff": logprob_diff}, indent=1))


if __name__ == "__main__":
    main()
