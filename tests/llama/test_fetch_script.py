"""scripts/fetch_llama_server.sh, run for real: asset names, dry runs, errors, and installs.

There is no internet here, so downloads are exercised through file:// mirrors
(MESHNET_LLAMA_GITHUB / MESHNET_LLAMA_GITHUB_API) and local archives built below,
laid out like the upstream ones: current .tar.gz assets hold `llama-<tag>/...`,
old .zip assets `build/bin/...`; both carry `libggml.so -> libggml.so.0`.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from meshnet_gguf.llama.binary import find_llama_server

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fetch_llama_server.sh"
GH = "https://github.com/ggml-org/llama.cpp/releases/download"
API = "https://api.github.com/repos/ggml-org/llama.cpp/releases"

# A stand-in llama-server: answers --version/--help like the real one, and like the real
# one it cannot start when the libggml.so symlink next to it is missing or dangling.
FAKE_SERVER = b"""#!/bin/sh
here=$(dirname "$0")
[ -e "$here/libggml.so" ] || { echo "error while loading shared libraries: libggml.so" >&2; exit 127; }
case "$1" in
  --version) echo "version: 9999 (fakecommit)"; echo "built with fake for test" ;;
  --help)
    echo "----- common params -----"
    echo "-h,    --help, --usage                    print usage and exit"
    echo "--port PORT                               port to listen (default: 8080)" ;;
  *) echo "unexpected: $*" >&2; exit 1 ;;
esac
"""
LIB = b"\x7fELF fake shared object" + bytes(300)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MESHNET_", "GITHUB_TOKEN"))}
    env.update(HOME=str(tmp_path / "home"), MESHNET_LLAMA_DIR=str(tmp_path / "install"), **extra)
    return env


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], env=_env(tmp_path, **env), capture_output=True, text=True, timeout=30, check=False)


def last_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


# ---------------------------------------------------------------- archives like upstream's


def _add_tar(tar: tarfile.TarFile, name: str, data: bytes = b"", *, mode: int = 0o644, link: str | None = None) -> None:
    info = tarfile.TarInfo(name)
    if link is not None:
        info.type, info.linkname, info.mode = tarfile.SYMTYPE, link, 0o777
        tar.addfile(info)
    else:
        info.size, info.mode = len(data), mode
        tar.addfile(info, io.BytesIO(data))


def make_tar_gz(path: Path, top: str = "llama-b9999", *, link_target: str = "libggml.so.0", server: bool = True) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        tar.addfile(_dir_info(top))
        if server:
            _add_tar(tar, f"{top}/llama-server", FAKE_SERVER, mode=0o755)
        _add_tar(tar, f"{top}/libggml.so.0", LIB, mode=0o755)
        _add_tar(tar, f"{top}/libggml.so", link=link_target)
        _add_tar(tar, f"{top}/LICENSE", b"MIT\n")
    return path


def _dir_info(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = tarfile.DIRTYPE, 0o755
    return info


def make_zip(path: Path, top: str = "build/bin", *, symlink_attr: bool = True) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data, mode in ((f"{top}/llama-server", FAKE_SERVER, 0o755), (f"{top}/libggml.so.0", LIB, 0o755)):
            info = zipfile.ZipInfo(name)
            info.create_system, info.external_attr = 3, (stat.S_IFREG | mode) << 16
            zf.writestr(info, data)
        link = zipfile.ZipInfo(f"{top}/libggml.so")
        link.create_system = 3
        # Without the S_IFLNK bits the link is a plain file holding its target's name,
        # as zips made by tools without symlink support store it.
        link.external_attr = ((stat.S_IFLNK | 0o777) if symlink_attr else (stat.S_IFREG | 0o644)) << 16
        zf.writestr(link, "libggml.so.0")
    return path


def assert_installed(binary: Path) -> None:
    assert binary.is_absolute() and binary.name == "llama-server"
    assert os.access(binary, os.X_OK)
    lib_link = binary.parent / "libggml.so"
    assert lib_link.is_symlink(), "symlink was not kept"
    assert os.readlink(lib_link) == "libggml.so.0"
    assert lib_link.resolve() == (binary.parent / "libggml.so.0").resolve()
    info = find_llama_server(binary, env={"PATH": "/nonexistent"})
    assert info.version == "9999" and info.supports("--port")


# ---------------------------------------------------------------- names and dry runs


@pytest.fixture
def no_curl(tmp_path: Path) -> dict[str, str]:
    """PATH whose curl records any call, to prove a dry run stays off the network."""
    bin_dir = tmp_path / "trap-bin"
    bin_dir.mkdir()
    trap = bin_dir / "curl"
    trap.write_text(f'#!/bin/sh\ntouch "{tmp_path}/curl-called"\nexit 99\n')
    trap.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize(
    ("args", "asset"),
    [
        (["cpu", "b6500", "--arch", "x64"], "llama-b6500-bin-ubuntu-x64.tar.gz"),
        (["cpu", "b6500", "--arch", "arm64"], "llama-b6500-bin-ubuntu-arm64.tar.gz"),
        (["vulkan", "b6500", "--arch", "x64"], "llama-b6500-bin-ubuntu-vulkan-x64.tar.gz"),
        (["vulkan", "b6500", "--arch=arm64"], "llama-b6500-bin-ubuntu-vulkan-arm64.tar.gz"),
        (["rocm", "b6500", "--rocm-version", "7.2"], "llama-b6500-bin-ubuntu-rocm-7.2-x64.tar.gz"),
        (["macos", "b6500"], "llama-b6500-bin-macos-arm64.tar.gz"),
        (["macos", "b6500", "--arch", "x64"], "llama-b6500-bin-macos-x64.tar.gz"),
    ],
)
def test_dry_run_prints_the_release_asset_url(tmp_path: Path, no_curl: dict[str, str], args: list[str], asset: str) -> None:
    done = run(tmp_path, *args, "--dry-run", **no_curl)
    assert done.stdout.splitlines() == [f"{GH}/b6500/{asset}"], done.stderr
    assert not (tmp_path / "curl-called").exists() and not (tmp_path / "install").exists()


def test_dry_run_arch_from_environment_and_host(tmp_path: Path, no_curl: dict[str, str]) -> None:
    done = run(tmp_path, "macos", "b6500", "--dry-run", MESHNET_LLAMA_ARCH="x64", **no_curl)
    assert last_line(done).endswith("/llama-b6500-bin-macos-x64.tar.gz")
    host = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine)
    if host:
        assert last_line(run(tmp_path, "vulkan", "b6500", "--dry-run", **no_curl)).endswith(f"-vulkan-{host}.tar.gz")


def test_dry_run_latest_names_the_api_then_the_asset(tmp_path: Path, no_curl: dict[str, str]) -> None:
    done = run(tmp_path, "vulkan", "--dry-run", "--arch", "x64", **no_curl)
    assert done.stdout.splitlines() == [f"{API}/latest", f"{GH}/<latest>/llama-<latest>-bin-ubuntu-vulkan-x64.tar.gz"]
    assert not (tmp_path / "curl-called").exists()


def test_dry_run_rocm_reads_the_rocm_version_from_the_asset_list(tmp_path: Path, no_curl: dict[str, str]) -> None:
    done = run(tmp_path, "rocm", "b6500", "--dry-run", **no_curl)
    api, url = done.stdout.splitlines()
    assert api == f"{API}/tags/b6500"
    assert url.startswith(f"{GH}/b6500/llama-b6500-bin-ubuntu-rocm-") and url.endswith("-x64.tar.gz")
    assert "--rocm-version" in done.stderr


@pytest.mark.parametrize(
    ("asset", "expected"),
    [
        ("llama-{tag}-bin-ubuntu-vulkan-x64.zip", "llama-b6500-bin-ubuntu-vulkan-x64.zip"),
        ("my-custom-build.tar.gz", "my-custom-build.tar.gz"),
    ],
)
def test_asset_override(tmp_path: Path, no_curl: dict[str, str], asset: str, expected: str) -> None:
    done = run(tmp_path, "vulkan", "b6500", "--asset", asset, "--dry-run", **no_curl)
    assert done.stdout.splitlines() == [f"{GH}/b6500/{expected}"]
    # --asset also lifts the arch table: a combination upstream lacks is allowed when named.
    done = run(tmp_path, "rocm", "b6500", "--arch", "arm64", "--asset", asset, "--dry-run", **no_curl)
    assert done.returncode == 0, done.stderr


def test_help(tmp_path: Path) -> None:
    done = run(tmp_path, "--help")
    assert done.returncode == 0 and "Usage:" in done.stdout and "--dry-run" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["gpu"], "unknown backend 'gpu'"),
        (["cuda", "b6500", "--dry-run"], "unknown backend 'cuda'"),
        ([], "missing BACKEND"),
        (["--dry-run"], "missing BACKEND"),
        (["cpu", "b1", "b2"], "too many arguments"),
        (["cpu", "b6500;rm"], "bad BUILD"),
        (["cpu", "--bogus"], "unknown option: --bogus"),
        (["cpu", "--dest"], "--dest needs a value"),
        (["rocm", "--arch", "arm64", "--dry-run"], "no rocm build for arch 'arm64'"),
        (["cpu", "--sha256", "abc", "--dry-run"], "64 hex digits"),
        (["cpu", "--asset", "../evil.tar.gz", "--dry-run"], "bare file name"),
        (["cpu", "--archive", "/nonexistent/x.tar.gz"], "no readable file"),
    ],
)
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    done = run(tmp_path, *args)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and done.stdout == ""


# ---------------------------------------------------------------- installing local archives


def test_tar_gz_install_keeps_symlinks_and_prints_the_binary(tmp_path: Path) -> None:
    archive = make_tar_gz(tmp_path / "llama-b9999-bin-ubuntu-vulkan-x64.tar.gz")
    done = run(tmp_path, "vulkan", "--archive", str(archive))
    assert len(done.stdout.splitlines()) == 1, "only the path may go to stdout"
    binary = Path(last_line(done))
    # Build taken from the file name, default folder, single top folder flattened.
    assert binary == (tmp_path / "install").resolve() / "b9999-vulkan" / "llama-server"
    assert_installed(binary)
    assert (binary.parent / ".meshnet-fetch").read_text().count("binary=llama-server") == 1
    # Installing again replaces our own install.
    assert Path(last_line(run(tmp_path, "vulkan", "--archive", str(archive)))) == binary


@pytest.mark.parametrize("extractor", ["python3", "unzip", None])
def test_zip_install_keeps_symlinks(tmp_path: Path, extractor: str | None) -> None:
    if extractor and not shutil.which(extractor):
        pytest.skip(f"{extractor} is not installed")
    archive = make_zip(tmp_path / "llama-b4000-bin-ubuntu-x64.zip")
    env = {"MESHNET_FETCH_UNZIP": extractor} if extractor else {}
    dest = (tmp_path / "opt").resolve() / "llama"
    binary = Path(last_line(run(tmp_path, "cpu", "b4000", "--archive", str(archive), "--dest", str(dest), **env)))
    assert binary == dest / "bin" / "llama-server"  # old layout build/bin/, "build" flattened
    assert_installed(binary)


def test_zip_link_stored_as_text_file_is_restored(tmp_path: Path) -> None:
    archive = make_zip(tmp_path / "old.zip", symlink_attr=False)
    done = run(tmp_path, "cpu", "b4000", "--archive", str(archive))
    assert "restored symlink" in done.stderr
    assert_installed(Path(last_line(done)))


def test_link_mangled_by_the_packer_is_repaired(tmp_path: Path) -> None:
    # ggml-org/llama.cpp#23115: b9165 shipped libggml.so -> llama-b9165ibggml.so.0
    archive = make_tar_gz(tmp_path / "llama-b9165-bin-ubuntu-vulkan-x64.tar.gz", "llama-b9165", link_target="llama-b9165ibggml.so.0")
    done = run(tmp_path, "vulkan", "--archive", str(archive))
    assert "repaired broken symlink" in done.stderr
    assert_installed(Path(last_line(done)))


def test_sha256_is_checked(tmp_path: Path) -> None:
    archive = make_tar_gz(tmp_path / "llama-b9999-bin-ubuntu-x64.tar.gz")
    good = hashlib.sha256(archive.read_bytes()).hexdigest()
    assert_installed(Path(last_line(run(tmp_path, "cpu", "--archive", str(archive), "--sha256", good.upper()))))
    done = run(tmp_path, "cpu", "--archive", str(archive), "--sha256", "0" * 64, "--dest", str(tmp_path / "bad"))
    assert done.returncode == 1 and "SHA-256 mismatch" in done.stderr
    assert not (tmp_path / "bad").exists()


def test_archive_type_from_content_and_archive_dry_run(tmp_path: Path, no_curl: dict[str, str]) -> None:
    archive = make_tar_gz(tmp_path / "download.bin")
    done = run(tmp_path, "cpu", "b9999", "--archive", str(archive), "--dry-run", **no_curl)
    assert done.stdout.splitlines() == [archive.resolve().as_uri()] and not (tmp_path / "install").exists()
    binary = Path(last_line(run(tmp_path, "cpu", "--archive", str(archive))))
    assert binary == (tmp_path / "install").resolve() / "local-cpu" / "llama-server"  # no tag in the name: "local"
    assert_installed(binary)


def test_archive_without_llama_server_fails(tmp_path: Path) -> None:
    archive = make_tar_gz(tmp_path / "llama-b9999-bin-ubuntu-x64.tar.gz", server=False)
    done = run(tmp_path, "cpu", "--archive", str(archive))
    assert done.returncode == 1 and "contains no llama-server" in done.stderr and done.stdout == ""


def test_never_replaces_a_folder_it_did_not_make(tmp_path: Path) -> None:
    archive = make_tar_gz(tmp_path / "llama-b9999-bin-ubuntu-x64.tar.gz")
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    done = run(tmp_path, "cpu", "--archive", str(archive), "--dest", str(precious))
    assert done.returncode == 1 and "refusing to replace" in done.stderr
    assert (precious / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------- downloads through file:// mirrors


@pytest.fixture
def mirror(tmp_path: Path) -> dict[str, object]:
    if not shutil.which("curl"):
        pytest.skip("curl is not installed")
    gh, api = tmp_path / "gh", tmp_path / "api"
    downloads = gh / "ggml-org" / "llama.cpp" / "releases" / "download"
    releases = api / "repos" / "ggml-org" / "llama.cpp" / "releases"
    (releases / "tags").mkdir(parents=True)

    def publish(tag: str, *assets: str, latest: bool = False) -> None:
        (downloads / tag).mkdir(parents=True, exist_ok=True)
        for name in assets:
            if name.endswith(".zip"):
                make_zip(downloads / tag / name)
            else:
                make_tar_gz(downloads / tag / name, f"llama-{tag}")
        body = json.dumps(
            {
                "tag_name": tag,
                "assets": [{"name": n, "browser_download_url": f"https://github.com/x/y/releases/download/{tag}/{n}"} for n in assets],
            },
            indent=2,
        )
        (releases / "tags" / tag).write_text(body)
        if latest:
            (releases / "latest").write_text(body)

    return {
        "env": {"MESHNET_LLAMA_GITHUB": gh.as_uri(), "MESHNET_LLAMA_GITHUB_API": api.as_uri()},
        "publish": publish,
        "downloads": downloads,
    }


def test_latest_is_resolved_downloaded_and_then_reused(tmp_path: Path, mirror: dict) -> None:
    mirror["publish"]("b9999", "llama-b9999-bin-ubuntu-vulkan-x64.tar.gz", "llama-b9999-bin-macos-arm64.tar.gz", latest=True)
    done = run(tmp_path, "vulkan", "--arch", "x64", **mirror["env"])
    binary = Path(last_line(done))
    assert binary == (tmp_path / "install").resolve() / "b9999-vulkan" / "llama-server"
    assert_installed(binary)
    assert len(done.stdout.splitlines()) == 1
    # A second call finds the install and downloads nothing.
    shutil.rmtree(mirror["downloads"])
    again = run(tmp_path, "vulkan", "--arch", "x64", **mirror["env"])
    assert Path(last_line(again)) == binary and "already installed" in again.stderr


def test_rocm_takes_the_newest_published_rocm_build(tmp_path: Path, mirror: dict) -> None:
    names = [f"llama-b9999-bin-ubuntu-rocm-{v}-x64.tar.gz" for v in ("7.2", "7.14", "7.9")]
    mirror["publish"]("b9999", *names, "llama-b9999-bin-ubuntu-x64.tar.gz")
    done = run(tmp_path, "rocm", "b9999", **mirror["env"])
    assert_installed(Path(last_line(done)))
    assert "rocm-7.14-x64.tar.gz" in done.stderr
    marker = (Path(last_line(done)).parent / ".meshnet-fetch").read_text()
    assert "asset=llama-b9999-bin-ubuntu-rocm-7.14-x64.tar.gz" in marker


def test_old_builds_fall_back_to_zip(tmp_path: Path, mirror: dict) -> None:
    mirror["publish"]("b4000", "llama-b4000-bin-ubuntu-x64.zip")
    done = run(tmp_path, "cpu", "b4000", "--arch", "x64", **mirror["env"])
    binary = Path(last_line(done))
    assert binary == (tmp_path / "install").resolve() / "b4000-cpu" / "bin" / "llama-server"
    assert_installed(binary)


def test_missing_asset_is_a_clear_failure(tmp_path: Path, mirror: dict) -> None:
    mirror["publish"]("b9999", "llama-b9999-bin-ubuntu-x64.tar.gz", latest=True)
    done = run(tmp_path, "vulkan", "--arch", "x64", **mirror["env"])
    assert done.returncode == 1 and done.stdout == ""
    assert "no asset named llama-b9999-bin-ubuntu-vulkan-x64.tar.gz" in done.stderr
    assert "llama-b9999-bin-ubuntu-x64.tar.gz" in done.stderr and "--asset" in done.stderr
    done = run(tmp_path, "vulkan", "b1234", "--arch", "x64", **mirror["env"])
    assert done.returncode == 1 and "download failed" in done.stderr
