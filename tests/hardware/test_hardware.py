"""Hardware probes against machines recorded as sysfs/proc trees and command outputs, and the real binary here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnet_gguf.common.units import GiB, MiB
from meshnet_gguf.hardware.report import LIST_DEVICES_TIMEOUT_S, probe_hardware
from meshnet_gguf.hardware.sources import RecordedCommands, parse_list_devices, parse_nvidia_smi
from meshnet_gguf.llama.binary import BinaryInfo
from meshnet_gguf.llama.features import BinaryFeatures
from support.hardware_fixtures import FIXTURES, fixture_binary, load_box, require_software_vulkan


def test_strix_halo_128_is_a_unified_vulkan_and_rocm_gpu_with_an_honest_budget() -> None:
    report = load_box("strix-halo-128")

    assert len(report.gpus) == 1
    gpu = report.gpus[0]
    assert (gpu.vendor, gpu.kind, gpu.unified) == ("amd", "integrated", True)
    assert "Strix Halo" in gpu.labels
    assert gpu.pci_id == "1002:1586" and gpu.gfx_target == "gfx1151"
    assert set(gpu.backends) >= {"vulkan", "rocm"}
    assert [d.name for d in gpu.llama_devices] == ["Vulkan0"]
    # carve-out still free + the GTT that RAM can back (RAM, not the 124 GiB GTT, is the tighter limit here):
    # mem_info_vram_total 536,870,912 - mem_info_vram_used 167,772,160 = 369,098,752 B free carve-out;
    # MemAvailable 129,874,512 kB x 1024 = 132,991,500,288 B, less the 4 GiB (4,294,967,296 B) reserve
    # = 128,696,532,992; together 129,065,631,744 B.
    assert gpu.budget_bytes == 129_065_631_744
    assert gpu.budget_bytes < gpu.memory_total_bytes  # never what Vulkan says
    assert report.primary_gpu() is gpu
    assert report.capacity().gpu_bytes == gpu.budget_bytes

    summary = report.summary()
    assert "Strix Halo" in summary and "Vulkan0" in summary and "unified" in summary
    assert "CPU only" not in summary and "CPU mode" not in summary
    assert report.cpu.model.startswith("AMD RYZEN AI MAX+ 395")
    assert (report.cpu.physical_cores, report.cpu.logical_cores) == (16, 32)


def test_large_carve_out_does_not_believe_the_vulkan_sum() -> None:
    """64 GiB carve-out + 110 GiB GTT on a 128 GiB box: Vulkan claims 174 GiB, which has crashed machines."""
    report = load_box("strix-halo-128-carveout-64")
    gpu = report.gpus[0]

    assert gpu.memory_total_bytes == 178176 * MiB  # the false sum, kept for the record
    # carve-out 68,719,476,736 - 188,743,680 used = 68,530,733,056 B; RAM: MemAvailable 63,488,000 kB
    # = 65,011,712,000 B - 4 GiB reserve = 60,716,744,704 B; together 129,247,477,760 B.
    assert gpu.budget_bytes == 129_247_477_760
    assert gpu.budget_bytes < 128 * GiB - 4 * GiB  # never more than the box, less its reserve
    assert any("174.0 GiB" in note and "honest budget" in note for note in report.notes)


def test_80_gb_strix_halo_at_the_default_gtt_limit_says_how_to_raise_it() -> None:
    report = load_box("strix-halo-80")
    gpu = report.gpus[0]

    assert "Strix Halo" in gpu.labels and gpu.unified
    # the GTT limit, not RAM, binds here: carve-out 536,870,912 - 157,286,400 used = 379,584,512 B
    # + mem_info_gtt_total 41,607,495,680 B = 41,987,080,192 B.
    assert gpu.budget_bytes == 41_987_080_192
    capacity = report.capacity()
    assert capacity.gpu_bytes == gpu.budget_bytes < capacity.total_bytes  # the rest can stay on the CPU side
    assert any("ttm.pages_limit=" in note for note in report.notes)


def test_discrete_nvidia_is_preferred_over_the_desktop_igpu() -> None:
    report = load_box("nvidia-rtx4090")

    by_vendor = {g.vendor: g for g in report.gpus}
    nvidia, igpu = by_vendor["nvidia"], by_vendor["amd"]
    assert (nvidia.kind, nvidia.unified) == ("discrete", False)
    assert nvidia.name == "NVIDIA GeForce RTX 4090"
    assert set(nvidia.backends) == {"cuda", "vulkan"}
    # nvidia-smi's free memory, 23,871 MiB = 25,030,557,696 B, less 1 GiB kept for the driver and display
    assert nvidia.budget_bytes == 23_956_815_872
    assert [d.name for d in nvidia.llama_devices] == ["Vulkan0"]
    assert (igpu.kind, igpu.unified, [d.name for d in igpu.llama_devices]) == ("integrated", True, ["Vulkan1"])
    assert igpu.budget_bytes > nvidia.budget_bytes  # larger, and still not the one to use
    assert report.primary_gpu() is nvidia


def test_nvidia_seen_by_nvidia_smi_but_not_by_llama_server_is_no_gpu_to_plan_for() -> None:
    """Why it is unused and what would use it is `hardware.unused`'s line (tests/hardware/test_unused_gpus.py)."""
    report = load_box("nvidia-rtx4090", list_devices="llama-server-no-vulkan.txt")

    assert report.llama_devices == ()
    assert report.primary_gpu() is None
    assert report.capacity().gpu_bytes == 0
    assert [g.name for g in report.gpus if g.vendor == "nvidia"] == ["NVIDIA GeForce RTX 4090"]


def test_cpu_box_ignores_the_bmc_console_and_says_cpu_only() -> None:
    report = load_box("cpu-only")

    assert report.gpus == ()  # the ASPEED card under /sys/class/drm is no compute device
    assert report.llama_devices == ()
    assert report.capacity().gpu_bytes == 0
    # MemAvailable 63,112,400 kB = 64,627,097,600 B, less the 4 GiB (4,294,967,296 B) reserve
    assert report.capacity().total_bytes == 60_332_130_304
    assert "CPU only" in report.summary()
    assert (report.cpu.physical_cores, report.cpu.logical_cores) == (32, 64)


def test_missing_or_hung_sources_are_reported_never_fatal(tmp_path: Path) -> None:
    runner = RecordedCommands(tmp_path, timeouts=["llama-server", "nvidia-smi", "rocminfo"])
    report = probe_hardware(fixture_binary(), root=tmp_path, run=runner, platform="linux")

    assert report.gpus == () and report.llama_devices is None
    assert report.probes["llama-server --list-devices"] == f"timed out after {LIST_DEVICES_TIMEOUT_S:.0f} s"
    assert report.probes["nvidia-smi"].startswith("timed out")
    assert report.probes["sysfs drm"] == "absent"
    assert report.probes["/proc/meminfo"] == "absent"
    # every command got a time limit
    assert [call[0][0] for call in runner.calls] == ["llama-server", "nvidia-smi", "rocminfo"]


def test_a_gpu_whose_binary_was_not_probed_still_counts(tmp_path: Path) -> None:
    box = FIXTURES / "strix-halo-128"
    report = probe_hardware(None, root=box / "root", run=RecordedCommands(box / "commands"), platform="linux")

    assert report.llama_devices is None
    assert report.probes["llama-server --list-devices"].startswith("skipped")
    gpu = report.primary_gpu()
    assert gpu is not None and gpu.unified and "Strix Halo" in gpu.labels
    assert gpu.budget_bytes < 124 * GiB  # still capped by RAM without the driver's figure


def test_list_devices_parsing_skips_noise_and_none() -> None:
    text = (
        "ggml_vulkan: Found 2 Vulkan devices:\n"
        "Available devices:\n"
        "  Vulkan0: Radeon 8060S Graphics (RADV GFX1151) (127488 MiB, 126812 MiB free)\n"
        "  ROCm0: AMD Radeon Graphics (124000 MiB, 123000 MiB free)\n"
    )
    devices = parse_list_devices(text)
    assert [(d.name, d.backend, d.vendor) for d in devices] == [("Vulkan0", "vulkan", "amd"), ("ROCm0", "rocm", "amd")]
    assert devices[0].description == "Radeon 8060S Graphics (RADV GFX1151)"
    assert devices[0].total_bytes == 127488 * MiB and devices[0].free_bytes == 126812 * MiB
    assert parse_list_devices("Available devices:\n  (none)\n") == ()


def test_nvidia_smi_parsing_counts_columns_from_the_right() -> None:
    gpus = parse_nvidia_smi("0, NVIDIA RTX 6000 Ada Generation, 49140, 48000, 00000000:41:00.0, 550.54.14\n")
    assert [(g.name, g.total, g.free) for g in gpus] == [("NVIDIA RTX 6000 Ada Generation", 49140 * MiB, 48000 * MiB)]


def test_json_report_round_trips() -> None:
    data = json.loads(json.dumps(load_box("strix-halo-128").to_dict()))
    assert data["gpus"][0]["unified"] is True
    assert data["gpus"][0]["llama_devices"][0]["backend"] == "vulkan"
    assert data["capacity"]["description"].startswith("this box can give the GPU")


# --------------------------------------------------------------------------- this machine, the real binary


@pytest.mark.real_llama
def test_real_list_devices_sees_llvmpipe_as_vulkan0(real_llama: BinaryInfo, real_llama_features: BinaryFeatures) -> None:
    require_software_vulkan()
    if not real_llama_features.vulkan:
        pytest.skip(f"{real_llama.describe()} was built without Vulkan (see build-llama-server's note on the headers)")
    report = probe_hardware(real_llama, device_env={"GGML_VK_VISIBLE_DEVICES": "0"})

    assert report.llama_devices, report.probes
    device = report.llama_devices[0]
    assert device.name == "Vulkan0" and device.backend == "vulkan"
    assert "llvmpipe" in device.description and device.total_bytes > 0
    software = next(g for g in report.gpus if g.llama_devices and g.llama_devices[0] == device)
    assert software.kind == "software"
    assert report.primary_gpu() is None or report.primary_gpu() is not software  # never chosen on its own
    assert report.llama_devices_env == {"GGML_VK_VISIBLE_DEVICES": "0"}


def test_hardware_command_prints_table_and_json() -> None:
    from meshnet_gguf.cli import app

    runner = CliRunner()
    table = runner.invoke(app, ["hardware"])
    assert table.exit_code == 0, table.output
    assert "RAM" in table.output and "capacity" in table.output
    as_json = runner.invoke(app, ["hardware", "--json"])
    assert as_json.exit_code == 0, as_json.output
    data = json.loads(as_json.stdout)
    assert data["ram_total_bytes"] > 0 and "gpus" in data and "probes" in data


def test_ram_falls_back_to_psutil_where_proc_meminfo_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    # macOS and some sandboxes have no /proc/meminfo; psutil then reads the OS's own figures.
    from meshnet_gguf.hardware import sources as hardware_sources

    monkeypatch.setattr(hardware_sources, "read_meminfo", lambda root: None)
    log = hardware_sources.SourceLog()
    total, available = hardware_sources.read_memory(Path("/"), log)
    assert total > 0 and 0 < available <= total
    assert log.status["/proc/meminfo"] == "absent; used psutil"
