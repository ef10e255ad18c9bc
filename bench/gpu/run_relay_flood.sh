#!/usr/bin/env bash
# The relay under a flood of strangers on the lent machine's many cores (bench/bench_relay_flood.py --pin): the relay
# alone on one CPU, the node and the honest streams on another, the flood on the rest, so the honest streams pay only
# for the relay's own work on the strangers. Runs IPv4 (1,000 /24s of 127/8), the decoy control (the same flood at a
# second relay on the relay's CPU) and IPv6 (1,000 /64s of a ULA /48 made local on lo). No GPU is used. From the
# repository root of the device's copy:
#   SRC=$PWD/src bash bench/gpu/run_relay_flood.sh CARRY
# (CARRY as in run_mesh_path.sh, for the wheels). About 2 minutes.
set -uo pipefail
export PYTHONUNBUFFERED=1
CARRY=$(cd "${1:-.}" && pwd)
OUT=${OUT:-/tmp/relay-flood-out}
PY=${PY:-python3}
FLOOD_ARGS=${FLOOD_ARGS:---networks 1000 --rounds 3 --concurrency 800}
BENCH=$(dirname "${BASH_SOURCE[0]}")/../bench_relay_flood.py
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
start_run_log
setup_device 4
step "the CPU this runs on"
lscpu | grep -E "Model name|^CPU\(s\)|MHz"; cat /sys/fs/cgroup/cpu.max 2>/dev/null; uptime
ulimit -n "$(ulimit -Hn)"
if ! command -v ip >/dev/null && [ -d "$CARRY/ipr" ]; then
    # The IPv6 run makes a /48 local on lo with iproute2; a bare machine may lack it: CARRY/ipr holds Debian's iproute2
    # and its libraries (apt-get download iproute2 libmnl0 libbpf1 libxtables12 libelf1 libcap2 libdb5.3), unpacked aside.
    # Its libraries are given to `ip` alone, through a wrapper, never to the Python processes of the bench.
    for f in "$CARRY"/ipr/*.deb; do dpkg -x "$f" /tmp/ipr; done
    mkdir -p /tmp/ipr/wrap
    printf '#!/bin/sh\nLD_LIBRARY_PATH=/tmp/ipr/usr/lib/x86_64-linux-gnu:/tmp/ipr/lib/x86_64-linux-gnu exec /tmp/ipr/bin/ip "$@"\n' >/tmp/ipr/wrap/ip
    chmod +x /tmp/ipr/wrap/ip
    export PATH="/tmp/ipr/wrap:$PATH"
fi
for run in ${RUNS:-ipv4: decoy:--flood-decoy ipv6:--ipv6}; do
    name=${run%%:*}; extra=${run#*:}
    step "flood, $name (--pin $extra $FLOOD_ARGS)"
    # shellcheck disable=SC2086
    timeout --kill-after=10 200 $PY "$BENCH" --pin $extra $FLOOD_ARGS >"$OUT/flood_$name.md" 2>"$OUT/flood_$name.json"
    echo "exit $?"; sed -n '7,12p;$p' "$OUT/flood_$name.md"; tail -2 "$OUT/flood_$name.md"
done
step "done"
