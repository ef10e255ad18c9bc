"""llama-server listens on a UNIX socket in a folder only the node's user can enter: no loopback
port exists for another local user to connect to, or to take first and impersonate llama-server."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import anyio
import psutil
import pytest

from meshnet_gguf.llama.child import (
    SOCKET_DIR_NAME,
    SOCKET_NAME,
    ChildFailed,
    ChildSpec,
    supports_unix_socket,
)
from meshnet_gguf.llama.supervisor import Supervisor
from support.supervisor_policies import QUICK

pytestmark = pytest.mark.anyio
OTHER_UID = 65534  # nobody
POLICY = QUICK


def _listening_inet(pid: int) -> list[psutil._common.pconn]:
    return [c for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def test_the_real_llama_server_listens_on_a_private_socket_and_no_port(real_llama, start_node, tiny_gguf) -> None:  # type: ignore[no-untyped-def]
    assert supports_unix_socket(real_llama)
    node = start_node("--gguf", str(tiny_gguf), "--ctx-size", "2048")
    node.wait_ready()
    pid = node.llama_pid()
    assert pid is not None
    argv = psutil.Process(pid).cmdline()
    socket_path = node.state_dir / SOCKET_DIR_NAME / SOCKET_NAME
    assert argv[argv.index("--host") + 1] == str(socket_path) and "--port" not in argv
    assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
    folder = os.stat(socket_path.parent)
    assert folder.st_uid == os.getuid() and stat.S_IMODE(folder.st_mode) == 0o700
    assert _listening_inet(pid) == []  # nothing on loopback to race for or to reach
    # And the node still answers through it.
    import httpx

    answer = httpx.post(node.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert answer.status_code == 200
    # A clean stop leaves no socket behind in the state dir (llama-server does not remove its own).
    node.signal(signal.SIGTERM)
    assert node.wait_exit() == 0
    assert not socket_path.exists()


@pytest.mark.parametrize("planted", ["foreign folder", "symlink"])
async def test_a_socket_folder_planted_by_someone_else_is_refused(fake_llama, tmp_path: Path, planted: str) -> None:  # type: ignore[no-untyped-def]
    if os.getuid() != 0 and planted == "foreign folder":
        pytest.skip("planting a folder owned by another user needs root")
    folder = tmp_path / SOCKET_DIR_NAME
    if planted == "foreign folder":
        folder.mkdir(mode=0o777)
        os.chown(folder, OTHER_UID, OTHER_UID)
    else:
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / SOCKET_NAME).write_text("someone else's file")
        folder.symlink_to(tmp_path / "elsewhere")
    supervisor = Supervisor(ChildSpec(fake_llama, ["--model", "m.gguf"]), POLICY, state_dir=tmp_path)
    with pytest.raises(ChildFailed, match="not a folder owned by this user"):
        with anyio.fail_after(10):
            await supervisor.run()
    assert supervisor.pid is None  # llama-server was never started
    if planted == "symlink":  # and nothing was removed through the planted link on the way out
        assert (tmp_path / "elsewhere" / SOCKET_NAME).read_text() == "someone else's file"


async def test_a_loose_socket_folder_is_tightened_and_a_stale_socket_removed(fake_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    folder = tmp_path / SOCKET_DIR_NAME
    folder.mkdir(mode=0o755)
    os.chmod(folder, 0o755)
    (folder / SOCKET_NAME).write_text("left by a killed run")
    supervisor = Supervisor(ChildSpec(fake_llama, ["--model", "m.gguf"]), POLICY, state_dir=tmp_path)
    async with anyio.create_task_group() as tg:
        tg.start_soon(supervisor.run)
        with anyio.fail_after(20):
            while supervisor.state != "ready":
                await anyio.sleep(0.05)
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(folder / SOCKET_NAME).st_mode)
        await supervisor.stop()
    assert not (folder / SOCKET_NAME).exists()  # a clean stop leaves no socket behind
