#!/usr/bin/env bash
# One command for one H100 / H200, what a person checks on a new GPU machine, in under 8
# minutes: the `gpu` test tier (cuDNN and Triton-compiled Pallas attention vs xla, the real
# Gemma 3 270M's bf16 logits vs fp32), train-step MFU (gemma2b-sized, bf16), decode tokens/s
# against the HBM-bandwidth bound (gemma2b-sized random weights, batch 256, bf16), and the
# real main job for 10 steps with its GRPO step breakdown (rollout / reward / train / sync),
# and the MoE grouped matmul (Pallas, Triton) against a dense matmul of the same useful
# flops; one summary table at the end. Each part has a time limit; a part that fails or runs out
# is reported and the next one runs.
#
#   benchmarks/gpu.sh [OUT_DIR]      # GPU: JSON + logs in OUT_DIR, a summary table at the end
#   benchmarks/gpu.sh --cpu-smoke    # the same pieces at tiny sizes on CPU (checks the script)
#
# Parts: pytest -m gpu (tests/test_gpu.py, tests/test_attention.py), benchmarks/train_step.py
# (MFU), benchmarks/decode.py, benchmarks/grpo_step.py (the main job through `gpurl train`),
# benchmarks/moe.py kernel.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python

SMOKE=0
if [ "${1:-}" = "--cpu-smoke" ]; then SMOKE=1; shift; fi
OUT=${1:-gpu-bench-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
START=$SECONDS

if [ $SMOKE = 1 ]; then
  export JAX_PLATFORMS=cpu
  # the scripts' own smoke forms (tests/test_benchmarks.py leaves these three to this one)
  TRAIN_ARGS="--smoke"
  DECODE_ARGS="--smoke"
  GRPO_ARGS="--smoke"
  MOE_ARGS="--rows 256 --d-model 128 --expert-width 64 --experts 8 --repeats 2"
  LIMITS=(120 600 300 300 120)
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  TRAIN_ARGS=""  # train_step.py's defaults: gemma2b, bf16, batch 4 x 2048 tokens
  DECODE_ARGS="--model gemma2b --dtype bfloat16 --batch 256 --prompt-tokens 128 --new-tokens 128"
  GRPO_ARGS="--steps 10"  # the main job: GRPO on Gemma 3 270M (bf16 on GPU), 4 prompts x G=8
  MOE_ARGS=""  # qwen3_30b_a3b's experts: D 2048, F 768, 16 per device, 512 and 16,384 copies
  LIMITS=(90 140 80 150 40)  # seconds: 500 in all, leaving the rest of 9 minutes for start-up
fi

run_part() {  # name, limit seconds, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit} s) ==="
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s ==="
  [ $rc = 0 ] || echo "$name: exit $rc (124 = time limit)" >> "$OUT/failed.txt"
}

# shellcheck disable=SC2086  # the argument lists are meant to split
# tests/conftest.py defaults JAX_PLATFORMS to cpu (the suite's 4 host devices); the GPU
# tier names the GPU first, so its tests see it (and the CPU beside it for references).
TIER_PLATFORMS=cpu
[ $SMOKE = 1 ] || TIER_PLATFORMS=cuda,cpu
run_part gpu_tests "${LIMITS[0]}" env JAX_PLATFORMS=$TIER_PLATFORMS "$PY" -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_gpu.py tests/test_attention.py
run_part train_step "${LIMITS[1]}" "$PY" benchmarks/train_step.py $TRAIN_ARGS --json "$OUT/train_step.json"
run_part decode "${LIMITS[2]}" "$PY" benchmarks/decode.py $DECODE_ARGS --json "$OUT/decode.json"
run_part grpo_step "${LIMITS[3]}" "$PY" benchmarks/grpo_step.py $GRPO_ARGS --json "$OUT/grpo_step.json"
run_part moe_kernel "${LIMITS[4]}" "$PY" benchmarks/moe.py kernel $MOE_ARGS --json "$OUT/moe_kernel.json"

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
gpu = (out / "gpu.txt").read_text().splitlines()[1:2] if (out / "gpu.txt").exists() else ["cpu"]
PEAK_BF16 = {"H200": 989.4, "H100": 989.4}  # dense bf16 TFLOP/s (SXM datasheets)
peak = next((v for k, v in PEAK_BF16.items() if k in (gpu[0] if gpu else "")), None)
print(f"\n## gpurl on {gpu[0] if gpu else 'unknown'}\n")
print("| measurement | value | goal |")
print("| --- | ---: | ---: |")

def load(name):
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None

log = out / "gpu_tests.log"
summary = [l for l in log.read_text().splitlines() if " in " in l and ("passed" in l or "skipped" in l
           or "failed" in l)] if log.exists() else []
print(f"| gpu test tier (cuDNN, Triton kernels, bf16 vs fp32 logits) | "
      f"{summary[-1].strip('= ') if summary else 'did not run (see gpu_tests.log)'} | all pass |")

if (ts := load("train_step")) is not None:
    for r in ts["rows"]:
        vs_peak = f", {r['tflops'] / peak:.1%} of {peak} TFLOP/s peak" if peak else ""
        print(f"| train step MFU ({r['attention']}) | {r['mfu']:.1%} of the measured "
              f"{ts['matmul_tflops']:.1f} TFLOP/s matmul ceiling{vs_peak}; {r['tokens_per_s']:.0f} tok/s | >= 40% |")
else:
    print("| train step MFU | not measured (see train_step.log) | >= 40% |")
if (d := load("decode")) is not None:
    frac, bound = d.get("fraction_of_bound"), d.get("bound_tok_s")
    print(f"| decode tok/s, B={d['batch']} {d['dtype']} | {d['decode_tok_s']:.0f} "
          f"({d['decode_step_ms']} ms/step) | |")
    shown = f"{frac:.1%} of {bound:.0f} tok/s" if frac else "n/a (unknown bandwidth)"
    print(f"| decode fraction of the HBM bound | {shown} | >= 50% |")
else:
    print("| decode | not measured (see decode.log) | |")
if (g := load("grpo_step")) is not None:
    m, s = g["median_s"], g["share"]
    print(f"| main job, {g.get('steps', '?')} steps: GRPO step (median) | {m['step']} s | |")
    for p in ("rollout", "reward", "train", "sync"):
        print(f"| GRPO {p} | {m[p]} s ({s[p]:.0%}) | |")
    for k, v in g.get("mismatch", {}).items():  # the sampler against the trainer, bf16
        print(f"| main job {k} (median) | {v:.3g} | |")
else:
    print("| GRPO step | not measured (see grpo_step.log) | |")
if (k := load("moe_kernel")) is not None:
    for r in k["rows"]:
        if r["implementation"] != "dense matmul":
            print(f"| MoE grouped matmul, {r['implementation']}, {r['rows']:,} copies, {r['pass']} | "
                  f"{r['tflops']:.1f} useful TFLOP/s, {r['vs_dense']:.0%} of a dense matmul's | "
                  f"{'>= 60%' if r['implementation'] == 'pallas' else ''} |")
else:
    print("| MoE grouped matmul | not measured (see moe_kernel.log) | >= 60% |")
EOF
[ -f "$OUT/failed.txt" ] && cat "$OUT/failed.txt"
echo "gpu.sh: $((SECONDS - START)) s in all; results in $OUT"
