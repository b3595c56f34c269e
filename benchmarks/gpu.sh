#!/usr/bin/env bash
# One command for one H100 / H200, what a person checks on a new GPU machine, in under 8
# minutes, each measured figure beside its bound: the `gpu` test tier (cuDNN and
# Triton-compiled Pallas kernels vs xla, the real Gemma 3 270M's bf16 logits vs fp32; it must
# run, a skipped test fails the part), train-step MFU (gemma2b-sized, bf16), decode tokens/s of
# gemma2b- and qwen3_1_7b-sized random weights at 256 rows against the HBM bound and the GPU
# compiler's roofline of the same step, a GRPO step of a qwen3_1_7b-sized model (256
# sequences of 64 + 960 tokens, every row decoding in full, bf16, packed: rollout, prepare
# and train against their roofline times in the committed account of the same run, RL
# tokens/s per GPU, the train step's MFU), the real main job for 10 steps with its GRPO
# step breakdown, and the MoE grouped matmul (Pallas, Triton) against a dense matmul of the
# same useful flops; one summary table at the end, summary.json beside it. Each part has a
# time limit; a part that fails or runs out is reported and the next one runs.
#
#   benchmarks/gpu.sh [OUT_DIR]      # GPU: JSON + logs in OUT_DIR, a summary table at the end
#   benchmarks/gpu.sh --cpu-smoke    # the same pieces at tiny sizes on CPU (checks the script)
#
# Parts: pytest -m gpu (tests/test_gpu.py, tests/test_attention.py), benchmarks/train_step.py
# (MFU), benchmarks/decode.py (x2), benchmarks/rl_step.py (against benchmarks/accounts/),
# benchmarks/grpo_step.py (the main job through `gpurl train`), benchmarks/moe.py kernel.
# A machine without gpurl's dependencies: benchmarks/gpu_bundle.sh brings them.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3

SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
OUT=${1:-gpu-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
START=$SECONDS
# A second run on the same machine (a rerun after a failed part) compiles nothing again.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-${TMPDIR:-/tmp}/gpurl-jax-cache}
# This tree's gpurl for every part (scripts, pytest and `gpurl train` alike), before any
# other copy on the path (benchmarks/gpu_bundle.sh's env.sh puts its own first).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

ACCOUNTS=benchmarks/accounts
if [ $SMOKE = 1 ]; then
  export JAX_PLATFORMS=cpu
  # the scripts' own smoke forms (tests/test_benchmarks.py leaves these to this one)
  TRAIN_ARGS="--smoke"
  DECODE_GEMMA_ARGS="--smoke --account $ACCOUNTS/rl_step_tiny.json"
  DECODE_QWEN_ARGS="--smoke --account $ACCOUNTS/rl_step_tiny.json"
  RL_ARGS="--smoke"
  GRPO_ARGS="--smoke"
  MOE_ARGS="--rows 256 --d-model 128 --expert-width 64 --experts 8 --repeats 2"
  LIMITS=(120 600 300 300 300 300 120)
else
  # one GPU: the accounts are of one-GPU runs, and every part takes the devices it sees
  export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv -i "${CUDA_VISIBLE_DEVICES%%,*}" \
    | tee "$OUT/gpu.txt"
  TRAIN_ARGS=""  # train_step.py's defaults: gemma2b, bf16, batch 4 x 2048 tokens
  # 256 rows, prompts of 960 tokens + 64 new: every step near the accounts' 1,024-token context
  DECODE_GEMMA_ARGS="--model gemma2b --batch 256 --repeats 2 --account $ACCOUNTS/rl_step_gemma2b.json"
  DECODE_QWEN_ARGS="--model qwen3_1_7b --batch 256 --repeats 2 --account $ACCOUNTS/rl_step_qwen3_1_7b.json"
  RL_ARGS="--model qwen3_1_7b --steps 2"  # 256 x (64 + 960) tokens; the first step compiles
  GRPO_ARGS="--steps 10"  # the main job: GRPO on Gemma 3 270M (bf16 on GPU), 4 prompts x G=8
  MOE_ARGS=""  # qwen3_30b_a3b's experts: D 2048, F 768, 16 per device, 512 and 16,384 copies
  # seconds: 460 in all, the rest of 8 minutes for start-up (ceilings: the tier, the decode
  # and GRPO-step parts have never run on a GPU; the first GPU run sets them)
  LIMITS=(75 55 35 35 190 50 20)
fi

run_part() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit} s) ==="
  local t0=$SECONDS
  # KILL: `gpurl train` takes SIGTERM as "checkpoint and stop", which would outlast the limit
  timeout -s KILL "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s ==="
  echo "$name $((SECONDS - t0))" >> "$OUT/seconds.txt"
  [ $rc = 0 ] || echo "$name: exit $rc (137 = killed at the time limit)" >> "$OUT/failed.txt"
}

# shellcheck disable=SC2086  # the argument lists are meant to split
# tests/conftest.py defaults JAX_PLATFORMS to cpu (the suite's 4 host devices); the GPU
# tier names the GPU first, so its tests see it (and the CPU beside it for references).
TIER_PLATFORMS=cpu
[ $SMOKE = 1 ] || TIER_PLATFORMS=cuda,cpu
run_part gpu_tests "${LIMITS[0]}" env JAX_PLATFORMS=$TIER_PLATFORMS "$PY" -m pytest -q -rs \
  -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_attention.py
# On the GPU the tier must run: a skipped test (no GPU seen, no Gemma package) fails the part.
if [ $SMOKE = 0 ] && grep -Eq "[0-9]+ skipped" "$OUT/gpu_tests.log"; then
  echo "gpu_tests: tests skipped on the GPU (see gpu_tests.log)" >> "$OUT/failed.txt"
fi
run_part train_step "${LIMITS[1]}" "$PY" benchmarks/train_step.py $TRAIN_ARGS --json "$OUT/train_step.json"
run_part decode_gemma2b "${LIMITS[2]}" "$PY" benchmarks/decode.py $DECODE_GEMMA_ARGS \
  --json "$OUT/decode_gemma2b.json"
run_part decode_qwen3_1_7b "${LIMITS[3]}" "$PY" benchmarks/decode.py $DECODE_QWEN_ARGS \
  --json "$OUT/decode_qwen3_1_7b.json"
run_part rl_step "${LIMITS[4]}" "$PY" benchmarks/rl_step.py run $RL_ARGS --json "$OUT/rl_step.json"
run_part grpo_step "${LIMITS[5]}" "$PY" benchmarks/grpo_step.py $GRPO_ARGS --json "$OUT/grpo_step.json"
run_part moe_kernel "${LIMITS[6]}" "$PY" benchmarks/moe.py kernel $MOE_ARGS --json "$OUT/moe_kernel.json"

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
gpu = (out / "gpu.txt").read_text().splitlines()[1:2] if (out / "gpu.txt").exists() else ["cpu"]
from gpurl.plan.targets import GPUS  # each known GPU's dense bf16 peak, by nvidia-smi's name

name = gpu[0].split(",")[0].strip() if gpu else ""
peak = next((g.bf16_flops / 1e12 for g in GPUS.values() if g.description == name), None)
rows = []  # (measurement, measured, bound, measured against the bound, goal)


def row(*cells):
    rows.append([str(c) for c in cells])


def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


log = out / "gpu_tests.log"
summary = [l for l in log.read_text().splitlines() if " in " in l and ("passed" in l or "skipped" in l
           or "failed" in l)] if log.exists() else []
row("gpu test tier (cuDNN, Triton kernels, bf16 vs fp32 logits)",
    summary[-1].strip("= ") if summary else "did not run (see gpu_tests.log)", "", "",
    "all pass, none skipped")

if (ts := load("train_step")) is not None:
    for r in ts["rows"]:
        row(f"train step MFU, gemma2b-sized, bf16 ({r['attention']})",
            f"{r['tflops']:.1f} TFLOP/s ({r['mfu']:.1%} of the measured "
            f"{ts['matmul_tflops']:.1f} TFLOP/s matmul ceiling); {r['tokens_per_s']:.0f} tok/s",
            f"{peak} TFLOP/s bf16 peak" if peak else "",
            f"{r['tflops'] / peak:.1%}" if peak else "", ">= 40% of peak")
else:
    row("train step MFU", "not measured (see train_step.log)", "", "", ">= 40% of peak")
for name in ("decode_gemma2b", "decode_qwen3_1_7b"):
    if (d := load(name)) is None:
        row(f"decode, {name.split('_', 1)[1]}-sized", f"not measured (see {name}.log)", "", "", "")
        continue
    what = (f"decode tok/s, {d['model']}-sized, B={d['batch']}, {d['dtype']}, contexts "
            f"{d['prompt_tokens'] + 1}-{d['prompt_tokens'] + d['decode_steps']}")
    measured = f"{d['decode_tok_s']:,.0f} ({d['decode_step_ms']} ms/step)"
    if d.get("bound_tok_s"):
        row(what, measured, f"{d['bound_tok_s']:,.0f} (HBM bound, {d['peak_bw_tbs']} TB/s)",
            f"{d['fraction_of_bound']:.1%}", ">= 50%")
    else:
        row(what, measured, "n/a (unknown bandwidth)", "", ">= 50%")
    if d.get("account_tok_s"):
        row(f"{what}: the compiler's account", measured,
            f"{d['account_tok_s']:,.0f} ({d['account_step_ms']} ms/step roofline, "
            f"{d['account_unit']}, {d['account_on']})", f"{d['fraction_of_account']:.1%}", "")
if (r := load("rl_step")) is not None:
    head = f"GRPO step, {r['model']}-sized, {r['sequences']} x {r['length']} tokens"
    for phase in ("rollout", "prepare step", "train step"):
        row(f"{head}: {phase}", f"{r['measured_s'][phase]:.4g} s",
            f"{r['bound_s'][phase]:.4g} s roofline", f"{r['x_bound'][phase]:.2f}x the roofline", "")
    for phase in ("reward", "sync"):
        row(f"{head}: {phase} (host)", f"{r['measured_s'][phase]:.4g} s", "", "", "")
    row(f"{head}: RL tokens/s per GPU", f"{r['tokens_per_s_per_gpu']:,.0f}",
        f"{r['bound_tokens_per_s_per_gpu']:,.0f} (account, {r['bound_on']})",
        f"{r['tokens_per_s_per_gpu'] / r['bound_tokens_per_s_per_gpu']:.1%}", "")
    row(f"{head}: train step MFU", f"{r['train_mfu']:.1%}", "", "", ">= 40%")
else:
    row("GRPO step, qwen3_1_7b-sized", "not measured (see rl_step.log)", "", "", "")
if (g := load("grpo_step")) is not None:
    m, s = g["median_s"], g["share"]
    row(f"main job, {g.get('steps', '?')} steps: GRPO step (median)", f"{m['step']} s", "", "", "")
    for p in ("rollout", "reward", "train", "sync"):
        row(f"main job: {p}", f"{m[p]} s ({s[p]:.0%})", "", "", "")
    for k, v in g.get("mismatch", {}).items():  # the sampler against the trainer, bf16
        row(f"main job {k} (median)", f"{v:.3g}", "", "", "")
else:
    row("main job", "not measured (see grpo_step.log)", "", "", "")
if (k := load("moe_kernel")) is not None:
    for r in k["rows"]:
        if r["implementation"] != "dense matmul":
            row(f"MoE grouped matmul, {r['implementation']}, {r['rows']:,} copies, {r['pass']}",
                f"{r['tflops']:.1f} useful TFLOP/s", "a dense matmul's", f"{r['vs_dense']:.0%}",
                ">= 60%" if r["implementation"] == "pallas" else "")
else:
    row("MoE grouped matmul", "not measured (see moe_kernel.log)", "", "", ">= 60%")

print(f"\n## gpurl on {gpu[0] if gpu else 'unknown'}\n")
print("| measurement | measured | bound | against the bound | goal |")
print("| --- | ---: | ---: | ---: | ---: |")
for cells in rows:
    print("| " + " | ".join(cells) + " |")
failed = (out / "failed.txt").read_text().splitlines() if (out / "failed.txt").exists() else []
seconds = (out / "seconds.txt").read_text().split() if (out / "seconds.txt").exists() else []
(out / "summary.json").write_text(json.dumps(
    {"gpu": gpu[0] if gpu else None, "rows": rows, "failed": failed,
     "seconds": dict(zip(seconds[::2], map(int, seconds[1::2])))}, indent=1))
EOF
echo "gpu.sh: $((SECONDS - START)) s in all; results in $OUT"
if [ -f "$OUT/failed.txt" ]; then cat "$OUT/failed.txt"; exit 1; fi
