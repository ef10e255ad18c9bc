"""The GPU compilers a llama-server build can use here, and the card architectures to build for.

A CUDA build wants nvcc and the compute capability of each NVIDIA card here
(`nvidia-smi`); a ROCm build wants hipcc (with `hipconfig`'s clang and ROCm root)
and each AMD card's gfx target (`rocminfo`, else the kernel's KFD topology). Only
the cards' own architectures are built, so the build stays minutes, not an hour.

Nothing here compiles anything: each finder says what it found, or in one line what
is missing and how to install it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# nvidia-smi, rocminfo and hipconfig answer in well under a second; a wedged driver must not hold a build.
QUERY_TIMEOUT_S = 20.0
# Where a CUDA toolkit puts nvcc when it is not on PATH: NVIDIA's packages install to /usr/local/cuda and do not
# touch PATH; $CUDA_HOME / $CUDA_PATH name another.
CUDA_HOME_ENV_VARS = ("CUDA_HOME", "CUDA_PATH")
CUDA_DEFAULT_HOMES = (Path("/usr/local/cuda"), Path("/opt/cuda"))
ROCM_HOME_ENV_VARS = ("ROCM_PATH", "HIP_PATH")
ROCM_DEFAULT_HOMES = (Path("/opt/rocm"),)
KFD_TOPOLOGY = Path("/sys/class/kfd/kfd/topology/nodes")
CUDA_INSTALL_HINT = (
    "install the CUDA toolkit (nvcc and cuBLAS): Debian/Ubuntu `apt-get install nvidia-cuda-toolkit`, or NVIDIA's "
    "cuda-toolkit package (it installs to /usr/local/cuda)"
)
ROCM_INSTALL_HINT = "install ROCm's HIP SDK (hipcc, hipBLAS, rocBLAS): AMD's `rocm` packages, which install to /opt/rocm"
_COMPUTE_CAP_RE = re.compile(r"^\s*(\d+)\.(\d+)\s*$")
_GFX_RE = re.compile(r"\b(gfx[0-9a-f]{3,4})\b")


@dataclass(frozen=True)
class GpuToolchain:
    """What a GPU build here needs: the compiler, the architectures, and CMake flags and environment for them."""

    backend: str  # "cuda" or "rocm"
    compiler: Path
    architectures: tuple[str, ...]  # "90", "89"; "gfx1151"
    cmake_flags: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        return f"{self.backend.upper()} with {self.compiler} for {', '.join(self.architectures)}"


def _run(argv: Sequence[str]) -> str | None:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, errors="replace", timeout=QUERY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _find_tool(name: str, env_vars: Sequence[str], homes: Sequence[Path], env: Mapping[str, str]) -> Path | None:
    on_path = shutil.which(name, path=env.get("PATH"))
    if on_path:
        return Path(on_path)
    for home in [*(Path(env[v]) for v in env_vars if env.get(v)), *homes]:
        candidate = home / "bin" / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_nvcc(env: Mapping[str, str] | None = None) -> Path | None:
    """nvcc on PATH, under $CUDA_HOME/$CUDA_PATH, or in /usr/local/cuda."""
    return _find_tool("nvcc", CUDA_HOME_ENV_VARS, CUDA_DEFAULT_HOMES, os.environ if env is None else env)


def find_hipcc(env: Mapping[str, str] | None = None) -> Path | None:
    """hipcc on PATH, under $ROCM_PATH/$HIP_PATH, or in /opt/rocm."""
    return _find_tool("hipcc", ROCM_HOME_ENV_VARS, ROCM_DEFAULT_HOMES, os.environ if env is None else env)


def cuda_architectures(nvidia_smi_csv: str) -> tuple[str, ...]:
    """`9.0\\n8.9\\n` (nvidia-smi --query-gpu=compute_cap --format=csv,noheader) -> ("89", "90"), each once."""
    found = {f"{m[1]}{m[2]}" for line in nvidia_smi_csv.splitlines() if (m := _COMPUTE_CAP_RE.match(line))}
    return tuple(sorted(found, key=int))


def nvidia_compute_capabilities() -> tuple[str, ...]:
    """The compute capability of each NVIDIA card here, as CMake spells it ("90"); () without a card or a driver."""
    if shutil.which("nvidia-smi") is None:
        return ()
    out = _run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    return cuda_architectures(out or "")


def gfx_targets_from_rocminfo(text: str) -> tuple[str, ...]:
    """The gfx targets rocminfo lists for its GPU agents ("gfx1151"); the CPU agents name none."""
    return tuple(sorted(set(_GFX_RE.findall(text))))


def gfx_target_of_version(version: int) -> str | None:
    """KFD's `gfx_target_version` 110501 -> "gfx1151" (major, minor and stepping, the last two in hex); 0 (a CPU node): None."""
    if version <= 0:
        return None
    major, minor, stepping = version // 10000, (version // 100) % 100, version % 100
    return f"gfx{major}{minor:x}{stepping:x}"


def amd_gfx_targets(topology: Path = KFD_TOPOLOGY) -> tuple[str, ...]:
    """Each AMD GPU's gfx target: from rocminfo when ROCm has it, else from the kernel's KFD topology."""
    if shutil.which("rocminfo") is not None:
        found = gfx_targets_from_rocminfo(_run(["rocminfo"]) or "")
        if found:
            return found
    targets = set()
    for properties in sorted(topology.glob("*/properties")):
        try:
            text = properties.read_text()
        except OSError:
            continue
        match = re.search(r"^gfx_target_version\s+(\d+)", text, re.MULTILINE)
        target = gfx_target_of_version(int(match[1])) if match else None
        if target:
            targets.add(target)
    return tuple(sorted(targets))


def cuda_toolchain(env: Mapping[str, str] | None = None, architectures: Sequence[str] | None = None) -> GpuToolchain | str:
    """A CUDA build's toolchain, or why there is none here (one line, with what to install)."""
    architectures = tuple(architectures) if architectures is not None else nvidia_compute_capabilities()
    if not architectures:
        return "no NVIDIA GPU answers here (nvidia-smi lists none)"
    nvcc = find_nvcc(env)
    if nvcc is None:
        return f"an NVIDIA GPU is here but no CUDA compiler (nvcc): {CUDA_INSTALL_HINT}"
    flags = ("-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}", f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(architectures)}")
    return GpuToolchain("cuda", nvcc, architectures, flags)


def rocm_toolchain(env: Mapping[str, str] | None = None, architectures: Sequence[str] | None = None) -> GpuToolchain | str:
    """A ROCm (HIP) build's toolchain, or why there is none here (one line, with what to install)."""
    env = os.environ if env is None else env
    architectures = tuple(architectures) if architectures is not None else amd_gfx_targets()
    if not architectures:
        return "no AMD GPU with ROCm's kernel driver here (no gfx target in rocminfo or the KFD topology)"
    hipcc = find_hipcc(env)
    if hipcc is None:
        return f"an AMD GPU ({', '.join(architectures)}) is here but no HIP compiler (hipcc): {ROCM_INSTALL_HINT}"
    # llama.cpp's build docs: HIPCXX is ROCm's clang (`hipconfig -l`), HIP_PATH its root (`hipconfig -R`).
    # hipconfig sits beside the real hipcc (distributions link /usr/bin/hipcc to ROCm's own).
    real_hipcc = hipcc.resolve()
    hipconfig = real_hipcc.with_name("hipconfig")
    clang_dir = _run([str(hipconfig), "-l"]) if hipconfig.is_file() else None
    rocm_root = _run([str(hipconfig), "-R"]) if hipconfig.is_file() else None
    rocm_home = Path(rocm_root.strip()) if rocm_root else real_hipcc.parent.parent
    clang = Path(clang_dir.strip()) / "clang" if clang_dir else rocm_home / "llvm" / "bin" / "clang"
    build_env = {"HIPCXX": str(clang), "HIP_PATH": str(rocm_home)}
    flags = ("-DGGML_HIP=ON", f"-DGPU_TARGETS={';'.join(architectures)}")
    return GpuToolchain("rocm", hipcc, architectures, flags, build_env)
