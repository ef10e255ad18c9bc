#!/usr/bin/env bash
# What a meshed node's first token cannot go below on the lent machine (bench/mesh_floor.py): the
# route check, the synced ledger row, the writer thread's hop and the disk alone, each measured by
# itself, in the folder the node's ledger would use. Run from the repository root of the device's copy:
#   SRC=$PWD/src bash bench/gpu/run_mesh_floor.sh CARRY
# (CARRY as in run_mesh_path.sh; bench/ is read from the checkout). Ends within a minute or two.
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/mesh-floor-out}
PY=${PY:-python3}
CALLS=${CALLS:-2000}
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 4
step "the CPU this runs on"
lscpu | grep -E "Model name|^CPU\(s\)|MHz" ; cat /sys/fs/cgroup/cpu.max 2>/dev/null; uptime
step "mesh_floor ($CALLS calls a step)"
STATE=/tmp/xdg-state/meshnet-gguf
mkdir -p "$STATE"
timeout --kill-after=10 300 $PY "$(dirname "${BASH_SOURCE[0]}")/../mesh_floor.py" --dir "$STATE" --calls "$CALLS" --json "$OUT/mesh_floor.json"
step "done"
