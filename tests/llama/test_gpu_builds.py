"""GPU builds of llama-server: which backend `auto` picks, for which card architectures, with what compiler, and
the compatibility patch that lets Vulkan compile against Debian 12's and Ubuntu 22.04's headers.

No NVIDIA or AMD card is here: nvidia-smi, nvcc, rocminfo, hipcc and hipconfig are small scripts on PATH that
answer as the real tools do (recorded from the lent H100 and from ROCm's documentation), and the build runs the
real CMake and compiler on the stand-in source of test_source_build. The real CUDA build is measured on the lent
GPU machine (bench/RESULTS.md); no ROCm build was run anywhere (README says so).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from meshnet_gguf.llama import gpu_toolchains
from meshnet_gguf.llama.binary import CUDA_INSTALL, ROCM_INSTALL, built_binary_dir
from meshnet_gguf.llama.build_checks import BuildError, choose_build
from meshnet_gguf.llama.gpu_toolchains import (
    cuda_architectures,
    cuda_toolchain,
    gfx_target_of_version,
    gfx_targets_from_rocminfo,
    rocm_toolchain,
)
from meshnet_gguf.llama.source_build import build_llama_server
from meshnet_gguf.llama.source_patches import VULKAN_LAYER_SETTINGS, PatchError, apply_patch
from support.stand_in_llama_source import CMAKE_LISTS, stand_in_sdist

NEEDS_BUILD_TOOLS = pytest.mark.skipif(
    any(shutil.which(tool) is None for tool in ("cmake", "ninja", "cc")),
    reason="needs cmake, ninja and a C compiler (apt-get install cmake ninja-build g++)",
)
# What nvidia-smi --query-gpu=compute_cap --format=csv,noheader printed on the lent H100 (one card).
H100_COMPUTE_CAP = "9.0\n"
# rocminfo's agent lines on a Strix Halo (Radeon 8060S): the CPU agent names no gfx target.
STRIX_HALO_ROCMINFO = """*******
Agent 1
*******
  Name:                    AMD RYZEN AI MAX+ 395 w/ Radeon 8060S
  Device Type:             CPU
*******
Agent 2
*******
  Name:                    gfx1151
  Marketing Name:          AMD Radeon Graphics
  Device Type:             GPU
      Name:                    amdgcn-amd-amdhsa--gfx1151
"""


def _tool(folder: Path, name: str, script: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)
    return path


@pytest.fixture
def bare_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH with the build tools and nothing of CUDA or ROCm, and no toolkit in the default homes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cmake", "ninja", "cc", "c++"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin")
    monkeypatch.setattr(gpu_toolchains, "CUDA_DEFAULT_HOMES", ())
    monkeypatch.setattr(gpu_toolchains, "ROCM_DEFAULT_HOMES", ())
    monkeypatch.setattr(gpu_toolchains, "KFD_TOPOLOGY", tmp_path / "no-kfd")
    for name in (*gpu_toolchains.CUDA_HOME_ENV_VARS, *gpu_toolchains.ROCM_HOME_ENV_VARS):
        monkeypatch.delenv(name, raising=False)
    real_which = shutil.which
    # /usr/bin may hold real tools of this machine that the box under test does not have.
    hidden = {"nvidia-smi", "nvcc", "rocminfo", "hipcc", "hipconfig", "glslc"}
    monkeypatch.setattr(
        shutil, "which", lambda tool, *a, **k: None if tool in hidden and not (bin_dir / tool).exists() else real_which(tool, *a, **k)
    )
    return bin_dir


def _nvidia_card(bin_dir: Path, *, nvcc: bool) -> Path | None:
    _tool(bin_dir, "nvidia-smi", f"printf '{H100_COMPUTE_CAP.strip()}\\n'\n")
    return _tool(bin_dir.parent / "cuda" / "bin", "nvcc", "echo 'Cuda compilation tools, release 13.0'\n") if nvcc else None


def _amd_card(bin_dir: Path, *, hipcc: bool) -> Path | None:
    listing = bin_dir.parent / "rocminfo.txt"
    listing.write_text(STRIX_HALO_ROCMINFO)
    _tool(bin_dir, "rocminfo", f"cat {listing}\n")
    if not hipcc:
        return None
    rocm = bin_dir.parent / "rocm"
    _tool(rocm / "bin", "hipconfig", f'case "$1" in -l) echo {rocm}/llvm/bin;; -R) echo {rocm};; esac\n')
    return _tool(rocm / "bin", "hipcc", "exit 0\n")


def test_compute_capabilities_and_gfx_targets_are_read_as_cmake_spells_them() -> None:
    assert cuda_architectures("9.0\n8.9\n9.0\n") == ("89", "90")
    assert cuda_architectures("[N/A]\n") == ()
    assert gfx_targets_from_rocminfo(STRIX_HALO_ROCMINFO) == ("gfx1151",)
    # The kernel's KFD topology: major, then minor and stepping in hex (MI210's gfx90a); a CPU node is 0.
    assert (gfx_target_of_version(110501), gfx_target_of_version(90010), gfx_target_of_version(0)) == ("gfx1151", "gfx90a", None)


def test_an_nvidia_card_with_nvcc_gets_a_cuda_build_for_its_own_architecture_only(bare_box: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc = _nvidia_card(bare_box, nvcc=True)
    assert nvcc is not None
    monkeypatch.setenv("CUDA_HOME", str(nvcc.parent.parent))  # NVIDIA's toolkit is not on PATH by default
    choices = choose_build(backend="auto")
    assert choices.backend == "cuda" and choices.falls_back_to_cpu
    assert choices.backend_flags == ("-DGGML_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}", "-DCMAKE_CUDA_ARCHITECTURES=90")


def test_an_nvidia_card_without_nvcc_says_what_to_install_and_builds_what_it_can(bare_box: Path) -> None:
    _nvidia_card(bare_box, nvcc=False)
    choices = choose_build(backend="auto")
    assert choices.backend in ("vulkan", "cpu")
    [line] = [n for n in choices.notes if n.startswith("no CUDA build:")]
    assert "an NVIDIA GPU is here but no CUDA compiler (nvcc)" in line and "nvidia-cuda-toolkit" in line
    with pytest.raises(BuildError, match=r"--backend cuda: an NVIDIA GPU is here but no CUDA compiler"):
        choose_build(backend="cuda")


def test_a_box_without_a_card_says_nothing_of_cuda_or_rocm(bare_box: Path) -> None:
    choices = choose_build(backend="auto")
    assert not [n for n in choices.notes if "CUDA" in n or "ROCM" in n]
    with pytest.raises(BuildError, match="--backend cuda: no NVIDIA GPU answers here"):
        choose_build(backend="cuda")
    with pytest.raises(BuildError, match="--backend rocm: no AMD GPU"):
        choose_build(backend="rocm")


def test_an_amd_card_with_hipcc_gets_a_rocm_build_with_rocms_clang(bare_box: Path) -> None:
    hipcc = _amd_card(bare_box, hipcc=True)
    assert hipcc is not None
    bare_box.joinpath("hipcc").symlink_to(hipcc)
    toolchain = rocm_toolchain()
    assert not isinstance(toolchain, str)
    rocm = hipcc.parent.parent
    assert toolchain.cmake_flags == ("-DGGML_HIP=ON", "-DGPU_TARGETS=gfx1151")
    assert toolchain.env == {"HIPCXX": str(rocm / "llvm" / "bin" / "clang"), "HIP_PATH": str(rocm)}
    assert choose_build(backend="auto").backend == "rocm"
    # A portable build is copied across a fleet: it never takes this box's GPU compiler, and says why once.
    portable = choose_build(backend="auto", portable=True)
    assert portable.backend in ("vulkan", "cpu") and "no ROCM build: --portable builds for any x86-64 CPU and leaves ROCM out" in " ".join(
        portable.notes
    )
    with pytest.raises(BuildError, match="--portable builds for any x86-64 CPU and leaves ROCM out"):
        choose_build(backend="rocm", portable=True)


def test_an_amd_card_without_hipcc_names_rocm(bare_box: Path) -> None:
    _amd_card(bare_box, hipcc=False)
    assert cuda_toolchain() == "no NVIDIA GPU answers here (nvidia-smi lists none)"
    [line] = [n for n in choose_build(backend="auto").notes if n.startswith("no ROCM build:")]
    assert "an AMD GPU (gfx1151) is here but no HIP compiler (hipcc)" in line


@NEEDS_BUILD_TOOLS
def test_a_cuda_build_configures_with_nvcc_and_installs_beside_the_cpu_build(
    bare_box: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvcc = _nvidia_card(bare_box, nvcc=True)
    assert nvcc is not None
    monkeypatch.setenv("CUDA_HOME", str(nvcc.parent.parent))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    # The stand-in source says what it was configured with (the real one would compile ggml-cuda with nvcc).
    cmake_lists = CMAKE_LISTS + 'message(STATUS "stand-in: GGML_CUDA=${GGML_CUDA} arch=${CMAKE_CUDA_ARCHITECTURES}")\n'
    result = build_llama_server(source=stand_in_sdist(tmp_path, cmake_lists=cmake_lists), backend="cuda", web_ui=False)
    install = built_binary_dir(install=CUDA_INSTALL)
    assert result.backend == "cuda" and result.binary == install / "llama-server"
    assert "stand-in: GGML_CUDA=ON arch=90" in (install / "build.log").read_text()
    assert json.loads((install / "build.json").read_text())["backend"] == "cuda"
    assert not built_binary_dir().exists()  # the CPU build's folder is left alone


@NEEDS_BUILD_TOOLS
def test_a_failed_rocm_build_chosen_by_auto_is_built_again_for_the_cpu_in_the_cpus_folder(
    bare_box: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hipcc = _amd_card(bare_box, hipcc=True)
    assert hipcc is not None
    bare_box.joinpath("hipcc").symlink_to(hipcc)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    cmake_lists = CMAKE_LISTS + 'if (GGML_HIP)\n    message(FATAL_ERROR "HIPCXX=$ENV{HIPCXX}: cannot find ROCm device library")\nendif()\n'
    notes: list[str] = []
    result = build_llama_server(source=stand_in_sdist(tmp_path, cmake_lists=cmake_lists), web_ui=False, notes=notes.append)
    assert result.backend == "cpu" and result.binary == built_binary_dir() / "llama-server"
    assert [n for n in notes if n.startswith("the ROCM build failed (configure failed") and n.endswith("building for the CPU instead")]
    assert f"HIPCXX={hipcc.parent.parent}/llvm/bin/clang" in (built_binary_dir() / "build.log").read_text()
    assert not built_binary_dir(install=ROCM_INSTALL).joinpath("llama-server").exists()


GGML_VULKAN_CPP_EXCERPT = (
    "    VkBool32 enable_best_practice = layer_settings;\n"
    "    std::vector<vk::LayerSettingEXT> settings = {\n"
    "        {\n"
    '            "VK_LAYER_KHRONOS_validation",\n'
    '            "validate_best_practices",\n'
    "            vk::LayerSettingTypeEXT::eBool32,\n"
    "            1,\n"
    "            &enable_best_practice\n"
    "        },\n"
    "    };\n"
    "    vk::LayerSettingsCreateInfoEXT layer_setting_info(settings);\n"
    "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);\n"
)


def test_the_vulkan_patch_guards_the_layer_settings_once_and_refuses_a_source_it_was_not_written_for(tmp_path: Path) -> None:
    source = tmp_path / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp"
    source.parent.mkdir(parents=True)
    source.write_text("int before;\n" + GGML_VULKAN_CPP_EXCERPT + "int after;\n")
    assert apply_patch(tmp_path, VULKAN_LAYER_SETTINGS) is True
    patched = source.read_text()
    assert patched.startswith("int before;\n#if VK_HEADER_VERSION >= 272\n" + GGML_VULKAN_CPP_EXCERPT + "#else\n")
    assert "(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n#endif\nint after;\n" in patched
    assert apply_patch(tmp_path, VULKAN_LAYER_SETTINGS) is False and source.read_text() == patched  # once only

    source.write_text("int moved_on;\n")
    with pytest.raises(PatchError, match="its anchor is in ggml/src/ggml-vulkan/ggml-vulkan.cpp 0 times"):
        apply_patch(tmp_path, VULKAN_LAYER_SETTINGS)
    source.write_text(GGML_VULKAN_CPP_EXCERPT * 2)
    with pytest.raises(PatchError, match="2 times"):
        apply_patch(tmp_path, VULKAN_LAYER_SETTINGS)
    assert source.read_text() == GGML_VULKAN_CPP_EXCERPT * 2  # nothing half-patched
