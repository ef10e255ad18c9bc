#!/usr/bin/env bash
# The node's own CPU a request on the lent H200's host (bench/request_cost.py, in process, no model),
# for a short prompt and an ~8,000-token one, its ledger on the host's disk and then in /dev/shm (what
# the disk's two synced commits a request cost the CPU); ROUNDS times, alternating, since the host's
# speed drifts. Same CARRY and setup as run_mesh_path.sh; from the repository root of the device's copy:
#   SRC=$PWD/src bash bench/gpu/run_request_cost.sh CARRY
# Writes $OUT/request_cost_p{0,8000}_r{N}.json, $OUT/request_cost_shm_p{0,8000}_r{N}.json and $OUT/run.log.
# PINNED=1: each run again pinned to one CPU (`taskset -c 0`), where the ledger's writer thread
# and the event loop wake each other without waking another (virtual) CPU.
# Locally: PY=.venv/bin/python SKIP_SETUP=1 PYTHONPATH=src ROUNDS=1 bash bench/gpu/run_request_cost.sh .
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/request-cost-out}
PY=${PY:-python3}
ROUNDS=${ROUNDS:-2}
REQUESTS=${REQUESTS:-2000}
BENCH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 3
for round in $(seq "$ROUNDS"); do
    for prompt in 0 8000; do
        for pin in "" ${PINNED:+pinned}; do
            run=(timeout --kill-after=5 90 ${pin:+taskset -c 0} $PY "$BENCH_DIR/request_cost.py" --requests "$REQUESTS" --prompt-tokens "$prompt")
            step "round $round, prompt tokens $prompt (0: a short chat), ledger on disk${pin:+, pinned to CPU 0}"
            "${run[@]}" --json "$OUT/request_cost${pin:+_pinned}_p${prompt}_r${round}.json" | tail -2
            step "round $round, prompt tokens $prompt, ledger in /dev/shm${pin:+, pinned to CPU 0}"
            TMPDIR=/dev/shm "${run[@]}" --modes meshed --json "$OUT/request_cost_shm${pin:+_pinned}_p${prompt}_r${round}.json" | tail -1
        done
    done
done
step "done"
