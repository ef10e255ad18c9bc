#!/usr/bin/env bash
# Proof of model on a second real backend (bench/bench_model_proof.py): the same weights answering on the lent GPU's
# Vulkan0 and on the CPU, judged by a CPU verifier, first for M (--honest: honest greedy answers never refused), then
# the full table of the tiny models (same weights, F16, Q8_0, another seed, a forger). The demo gemma is not carried
# (its 253 MB exceed what a call takes along), so both runs use the generated models. From the repository root:
#   SRC=$PWD/src bash bench/gpu/run_model_proof.sh CARRY
# (CARRY as in run_mesh_path.sh). About 4 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/model-proof-out}
PY=${PY:-python3}
HONEST=${HONEST:-200}
BENCH=$(dirname "${BASH_SOURCE[0]}")/../bench_model_proof.py
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 8
export PYTHONPATH="$PYTHONPATH:$(dirname "${BASH_SOURCE[0]}")/../../tests"
step "M: $HONEST honest greedy answers per backend (CPU against the GPU's Vulkan0)"
timeout --kill-after=10 200 $PY "$BENCH" --honest "$HONEST" --honest-demo 0 --skip-gemma --device Vulkan0 --vk-visible-devices '' --budget 3
step "the tiny models' table, the other backend the GPU's Vulkan0"
timeout --kill-after=10 150 $PY "$BENCH" --skip-gemma --device Vulkan0 --vk-visible-devices '' --cost-rounds 1
step "done"
