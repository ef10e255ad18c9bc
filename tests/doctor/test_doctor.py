"""`doctor` on recorded machines (tests/fixtures/hardware) and on real sockets, files and servers."""

from __future__ import annotations

import email.utils
import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshnet_gguf.cli import app
from meshnet_gguf.common.ports import free_local_port
from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.contract.protocol import WELL_KNOWN_PATH
from meshnet_gguf.hardware.report import HardwareReport
from meshnet_gguf.llama.run_probe import RunProbe
from meshnet_gguf.llama.build_checks import missing_tools
from meshnet_gguf.llama.binary import BinaryInfo, BinaryNotFound
from meshnet_gguf.models.tiny_model import write_tiny_model
from meshnet_gguf.doctor.checks import (
    DoctorEnvironment,
    DoctorReport,
    Finding,
    check_clock,
    check_port,
    run_doctor,
)
from meshnet_gguf.prepare.pipeline import ModelSize, model_size
from meshnet_gguf.hardware.unused import BUILD_CUDA, BUILD_VULKAN, GLVND_PACKAGES
from support.hardware_fixtures import FIXTURES, fixture_binary, load_box, recorded_build

GB = 1000**3


def _environment(
    report: HardwareReport,
    *,
    root: Path,
    size: ModelSize | None = None,
    free: int = 500 * GB,
    access: Callable[[Path, int], bool] = lambda path, mode: True,
    binary: BinaryInfo | None = None,
    **settings: object,
) -> DoctorEnvironment:
    values: dict[str, object] = {"gguf": "some/model:Q4_K_M", "port": free_local_port()}
    values.update(settings)
    return DoctorEnvironment(
        NodeSettings(**values),  # type: ignore[arg-type]
        root=root,
        find_binary=lambda s: binary or fixture_binary(),
        run_probe=lambda binary: RunProbe(runs=True, web_ui=True, types=("F16", "F32", "Q8_0")),
        hardware=lambda binary: report,
        model_size=lambda binary, hardware: size,
        free_bytes=lambda directory: free,
        access=access,
    )


def _only(report: DoctorReport, check: str) -> list[Finding]:
    return [f for f in report.findings if f.check == check]


def _copy_root(box: str, tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(FIXTURES / box / "root", root)
    return root


# --- GPUs --------------------------------------------------------------------------


def test_names_the_missing_libglvnd_case_and_prints_the_fix(tmp_path: Path) -> None:
    """nvidia-smi sees the GPU, a Vulkan llama-server lists `(none)`, and libGLX is absent (FACTS.md)."""
    box = "nvidia-rtx4090"
    binary = recorded_build(tmp_path, "vulkan")
    report = load_box(box, list_devices="llama-server-no-vulkan.txt", binary=binary)
    doctor = run_doctor(_environment(report, root=FIXTURES / box / "root", binary=binary))
    nvidia = [f for f in _only(doctor, "gpu") if "RTX 4090" in f.summary]
    assert len(nvidia) == 1
    finding = nvidia[0]
    assert finding.status == "warn"
    assert "Vulkan lists no device for it" in finding.summary
    assert "libglvnd" in finding.summary and "libGLX.so.0" in finding.summary
    assert f"apt install {GLVND_PACKAGES}" in finding.fix and BUILD_CUDA in finding.fix
    text = doctor.format_text()
    assert "fix: install the GL vendor libraries: apt install libglvnd0" in text
    assert not doctor.blocking  # it serves, on the CPU: a warning, not a stop


def test_an_nvidia_card_beside_a_cpu_build_is_named_with_the_cuda_build(tmp_path: Path) -> None:
    box = "nvidia-rtx4090"
    binary = recorded_build(tmp_path, "cpu")
    report = load_box(box, list_devices="llama-server-no-vulkan.txt", binary=binary)
    doctor = run_doctor(_environment(report, root=FIXTURES / box / "root", binary=binary))
    [finding] = [f for f in _only(doctor, "gpu") if f.status == "warn"]
    assert finding.summary.startswith("NVIDIA GeForce RTX 4090: this llama-server has no CUDA and no Vulkan")
    assert finding.fix.startswith(f"{BUILD_CUDA} (needs the CUDA toolkit's nvcc")
    assert "\n" not in finding.summary and "\n" not in finding.fix


def test_debian_12_with_mesa_and_a_cpu_build_names_the_drivers_and_llvmpipe(tmp_path: Path) -> None:
    box = "debian12-zen4-mesa"
    binary = recorded_build(tmp_path, "cpu")
    doctor = run_doctor(_environment(load_box(box, binary=binary), root=FIXTURES / box / "root", binary=binary))
    gpu = _only(doctor, "gpu")
    assert gpu[0] == Finding("gpu", "ok", "no GPU in this machine: models run on the CPU")
    drivers = [f for f in gpu if f.status == "warn"]
    assert [f.summary.split(" (")[0] for f in drivers] == ["radeon_icd.x86_64.json", "intel_hasvk_icd.x86_64.json, intel_icd.x86_64.json"]
    assert all(f.fix.startswith(BUILD_VULKAN) for f in drivers)
    [lvp] = [f for f in gpu if "llvmpipe" in f.summary]
    assert lvp.status == "ok" and "software rasterizer, no faster than the CPU" in lvp.summary and lvp.fix == ""


def test_working_gpu_is_ok(tmp_path: Path) -> None:
    box = "nvidia-rtx4090"
    binary = recorded_build(tmp_path, "vulkan")
    doctor = run_doctor(_environment(load_box(box, binary=binary), root=FIXTURES / box / "root", binary=binary))
    gpu = _only(doctor, "gpu")
    assert any(f.status == "ok" and "Vulkan0" in f.summary for f in gpu)
    assert all(f.status == "ok" and "is used by llama-server" in f.summary for f in gpu)  # nothing unused to name


def test_amd_box_without_render_node_access(tmp_path: Path) -> None:
    root = _copy_root("strix-halo-128", tmp_path)
    (root / "dev/dri").mkdir(parents=True)
    (root / "dev/dri/renderD128").write_bytes(b"")
    (root / "dev/kfd").write_bytes(b"")
    denied = {root / "dev/dri/renderD128", root / "dev/kfd"}
    doctor = run_doctor(_environment(load_box("strix-halo-128"), root=root, access=lambda path, mode: Path(path) not in denied))
    gpu = _only(doctor, "gpu")
    render = next(f for f in gpu if "renderD128" in f.summary)
    kfd = next(f for f in gpu if "/dev/kfd" in f.summary)
    for finding in (render, kfd):
        assert finding.status == "warn"
        assert "usermod -aG render,video" in finding.fix


def test_amd_box_with_access_has_no_device_findings(tmp_path: Path) -> None:
    root = _copy_root("strix-halo-128", tmp_path)
    (root / "dev/dri").mkdir(parents=True)
    (root / "dev/dri/renderD128").write_bytes(b"")
    doctor = run_doctor(_environment(load_box("strix-halo-128"), root=root))
    assert [f.status for f in _only(doctor, "gpu")] == ["ok"]


# --- memory and disk --------------------------------------------------------------------


def test_model_too_big_blocks_serving() -> None:
    report = load_box("cpu-only")
    size = ModelSize("big/model:Q8_0", 90 * GB, False, 92 * GB)
    doctor = run_doctor(_environment(report, root=FIXTURES / "cpu-only" / "root", size=size))
    memory = _only(doctor, "memory")[0]
    assert memory.status == "fail" and "92.0 GB" in memory.summary
    assert "smaller quant" in memory.fix
    assert doctor.blocking


def test_gtt_limit_below_the_chosen_quant() -> None:
    box = "strix-halo-80"
    report = load_box(box)
    capacity = report.capacity()
    need = capacity.gpu_bytes + 5 * GB
    assert need < capacity.total_bytes  # fits the box, not the GPU's GTT window
    size = ModelSize("big/model:UD-Q3_K_XL", need - 2 * GB, True, need)
    memory = _only(run_doctor(_environment(report, root=FIXTURES / box / "root", size=size)), "memory")[0]
    assert memory.status == "warn"
    assert "GTT" in memory.summary
    assert "ttm.pages_limit=" in memory.fix and "reboot" in memory.fix


def test_model_that_fits_the_gpu_is_ok() -> None:
    box = "strix-halo-128"
    size = ModelSize("m:Q4_K_M", 60 * GB, True, 70 * GB)
    memory = _only(run_doctor(_environment(load_box(box), root=FIXTURES / box / "root", size=size)), "memory")[0]
    assert memory.status == "ok" and "Radeon" in memory.summary


def test_disk_too_small_for_the_download_blocks() -> None:
    size = ModelSize("m:Q4_K_M", 60 * GB, False, 62 * GB)
    doctor = run_doctor(_environment(load_box("strix-halo-128"), root=FIXTURES / "strix-halo-128" / "root", size=size, free=20 * GB))
    disk = _only(doctor, "disk")[0]
    assert disk.status == "fail" and "--download-dir" in disk.fix
    assert doctor.blocking


def test_disk_need_not_hold_a_model_already_there() -> None:
    size = ModelSize("/models/m.gguf", 60 * GB, True, 62 * GB)
    doctor = run_doctor(_environment(load_box("strix-halo-128"), root=FIXTURES / "strix-halo-128" / "root", size=size, free=1 * GB))
    assert _only(doctor, "disk")[0].status == "ok"


def test_model_size_of_a_real_local_split_model(tmp_path: Path) -> None:
    third = write_tiny_model(tmp_path / "tiny.gguf", split_max_tensors=5).with_name("tiny-00003-of-00005.gguf")
    settings = NodeSettings(gguf=str(third), download_dir=tmp_path / "models")
    size = model_size(settings, fixture_binary(), load_box("cpu-only"))
    assert size is not None and size.local and size.label == "tiny"
    assert size.total_bytes == sum(p.stat().st_size for p in tmp_path.glob("tiny-0000*-of-00005.gguf"))
    assert size.need_bytes > size.total_bytes  # KV cache and compute buffers on top
    assert size.fits and size.placement == "cpu"


def test_model_size_of_the_catalog_demo_without_the_network(tmp_path: Path) -> None:
    size = model_size(NodeSettings(demo=True, offline=True, download_dir=tmp_path), fixture_binary(), load_box("cpu-only"))
    assert size is not None and not size.local
    assert 100_000_000 < size.total_bytes < 1_000_000_000


def test_a_model_on_disk_is_not_to_download_and_doctor_prints_the_plans_figures(tmp_path: Path) -> None:
    """The demo on disk: doctor says so, and its memory figure is the dry run's, byte for byte."""
    from meshnet_gguf.prepare.pipeline import prepare_with, read_request

    models = tmp_path / "models"
    write_tiny_model(models / "demo" / "gemma-3-270m-q4_k_m.gguf")  # where the demo is assembled
    settings = NodeSettings(demo=True, offline=True, download_dir=models)
    box = load_box("cpu-only")
    size = model_size(settings, fixture_binary(), box)
    assert size is not None and size.local

    doctor = run_doctor(_environment(box, root=FIXTURES / "cpu-only" / "root", size=size, demo=True, gguf=None))
    assert "on disk" in _only(doctor, "model")[0].summary and "to download" not in doctor.format_text()

    dry_run = prepare_with(read_request(settings), settings, fixture_binary(), box, dry_run=True)
    assert dry_run.plan is not None
    assert size.need_bytes == dry_run.plan.memory.need_bytes and size.ctx_size == dry_run.plan.ctx_size
    assert size.prompt_cache_bytes == dry_run.plan.memory.prompt_cache


def _missing(settings: NodeSettings) -> object:
    raise BinaryNotFound("No llama-server found. Looked in:\n  PATH: no llama-server on PATH")


_DIES_HERE = RunProbe(runs=False, died_with="SIGILL", types=("F16", "F32", "Q8_0"))


def test_missing_binary_blocks_serving_when_the_node_may_not_build() -> None:
    env = _environment(load_box("cpu-only"), root=FIXTURES / "cpu-only" / "root", build=False)
    env.find_binary = _missing  # type: ignore[assignment]
    doctor = run_doctor(env)
    binary = _only(doctor, "binary")[0]
    assert binary.status == "fail" and "meshnet-gguf[llama]" in binary.fix
    assert doctor.blocking


@pytest.mark.skipif(bool(missing_tools()), reason="the build tools are not installed here (apt-get install cmake ninja-build g++)")
def test_missing_binary_is_a_warning_when_serve_builds_one() -> None:
    env = _environment(load_box("cpu-only"), root=FIXTURES / "cpu-only" / "root")
    env.find_binary = _missing  # type: ignore[assignment]
    doctor = run_doctor(env)
    binary = _only(doctor, "binary")[0]
    assert binary.status == "warn" and "builds a llama-server for this machine" in binary.explanation
    assert not doctor.blocking


def test_binary_that_dies_on_this_cpu_blocks_serving_with_no_build() -> None:
    env = _environment(load_box("cpu-only"), root=FIXTURES / "cpu-only" / "root", build=False)
    env.run_probe = lambda binary: _DIES_HERE
    doctor = run_doctor(env)
    binary = _only(doctor, "binary")[0]
    assert binary.status == "fail" and "SIGILL" in binary.summary and "--no-build" in binary.explanation
    assert "meshnet-gguf build-llama-server" in binary.fix
    assert doctor.blocking


def test_binary_chosen_by_the_operator_that_dies_here_blocks_serving(tmp_path: Path) -> None:
    env = _environment(load_box("cpu-only"), root=FIXTURES / "cpu-only" / "root", llama_server=tmp_path / "llama-server")
    env.run_probe = lambda binary: _DIES_HERE
    binary = _only(run_doctor(env), "binary")[0]
    assert binary.status == "fail" and "--llama-server" in binary.explanation


@pytest.mark.skipif(bool(missing_tools()), reason="the build tools are not installed here (apt-get install cmake ninja-build g++)")
def test_a_binary_that_dies_here_is_a_warning_that_serve_heals() -> None:
    # `serve` builds a llama-server for this machine first, so doctor says so, with the time, and does not block.
    env = _environment(load_box("cpu-only"), root=FIXTURES / "cpu-only" / "root", gguf=None, demo=True)
    env.run_probe = lambda binary: _DIES_HERE
    doctor = run_doctor(env)
    binary = _only(doctor, "binary")[0]
    assert binary.status == "warn" and "SIGILL" in binary.summary
    assert "builds a llama-server for this machine before it serves" in binary.explanation and "minutes" in binary.explanation
    assert "meshnet-gguf build-llama-server" in binary.fix
    assert not doctor.blocking


def test_doctor_says_what_the_binary_can_do() -> None:
    env = _environment(load_box("cpu-only"), root=FIXTURES / "cpu-only" / "root")
    binary = _only(run_doctor(env), "binary")[0]
    assert binary.status == "ok" and "web UI" in binary.summary and "RPC" in binary.summary


# --- clock against a real HTTP server ------------------------------------------------------


class _DateHandler(BaseHTTPRequestHandler):
    send_date = True
    date_age_s = 0.0  # how old the Date it sends is (uvicorn renews its Date once a second)

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        self.send_response_only(200)
        if self.send_date:
            self.send_header("Date", email.utils.formatdate(time.time() - self.date_age_s, usegmt=True))
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def tracker_server() -> Iterator[tuple[str, list[str]]]:
    seen: list[str] = []

    class Handler(_DateHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.path)
            super().do_GET()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def tracker(tracker_server: tuple[str, list[str]]) -> tuple[str, list[str]]:
    tracker_server[1].clear()
    return tracker_server


@pytest.mark.parametrize(("offset_s", "status"), [(0.0, "ok"), (4.5, "warn"), (-30.0, "fail"), (3600.0, "fail")])
def test_clock_skew_against_the_tracker(tracker: tuple[str, list[str]], offset_s: float, status: str) -> None:
    url, seen = tracker
    env = DoctorEnvironment(NodeSettings(tracker=url), clock=lambda: time.time() + offset_s)
    finding = check_clock(env)[0]
    assert finding.status == status, finding
    assert seen == [WELL_KNOWN_PATH]
    if status != "ok":
        assert "timedatectl set-ntp true" in finding.fix
        assert ("ahead of" if offset_s > 0 else "behind") in finding.summary


@pytest.mark.parametrize("date_age_s", [0.0, 0.5, 0.99])
def test_a_tracker_on_this_machine_agrees_however_old_its_date_header(date_age_s: float) -> None:
    """Same clock, Date whole seconds and up to a second stale (as uvicorn sends it): no skew is reported."""

    class Stale(_DateHandler):
        pass

    Stale.date_age_s = date_age_s
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stale)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        finding = check_clock(DoctorEnvironment(NodeSettings(tracker=f"http://127.0.0.1:{server.server_address[1]}")))[0]
    finally:
        server.shutdown()
        server.server_close()
    assert finding.status == "ok" and "agrees with the tracker's" in finding.summary, finding


def test_unreachable_tracker_fails() -> None:
    env = DoctorEnvironment(NodeSettings(tracker=f"http://127.0.0.1:{free_local_port()}"))
    finding = check_clock(env)[0]
    assert finding.status == "fail" and "did not answer" in finding.summary


def test_no_tracker_no_clock_check() -> None:
    assert check_clock(DoctorEnvironment(NodeSettings()))[0].status == "skip"


# --- port -----------------------------------------------------------------------------------


def test_port_in_use_names_the_holder() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        finding = check_port(DoctorEnvironment(NodeSettings(port=port)))[0]
    assert finding.status == "fail"
    assert f"pid {os.getpid()}" in finding.summary
    assert "--port" in finding.fix


def test_free_port_is_ok() -> None:
    assert check_port(DoctorEnvironment(NodeSettings(port=free_local_port())))[0].status == "ok"


# --- CLI on this machine --------------------------------------------------------------------


def test_cli_json_and_exit_code(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "tiny.gguf")
    port = free_local_port()
    args = ["doctor", "--gguf", str(model), "--port", str(port), "--download-dir", str(tmp_path), "--json"]
    result = CliRunner().invoke(app, [*args, "--llama-server", str(tmp_path / "no-such-llama-server")])
    assert result.exit_code == 1
    parsed = json.loads(result.stdout)
    assert parsed["ok"] is False
    assert [f["status"] for f in parsed["findings"] if f["check"] == "binary"] == ["fail"]
    assert {f["check"] for f in parsed["findings"]} >= {"binary", "gpu", "memory", "disk", "clock", "port"}
