"""Unpack a downloaded llama.cpp release archive, trusting nothing in it.

Every member is checked before a byte is written: a regular file, a folder or a
link only; no absolute name, no `..`, nothing written through a link; a symlink
that points outside the archive (absolute, or up past its top) refuses the whole
archive; the member count and unpacked size are bounded. Symlinks are kept
(`libggml.so -> libggml.so.0`, as upstream packs them). A `.tar.gz` is unpacked by
`tarfile` (with its `data` filter too, where Python has it), an old `.zip` by
`zipfile`, its Unix modes and symlinks restored. Two known packaging faults are
repaired: a symlink a zip tool stored as a small text file naming its target, and
links named with the packer's `llama-bNNNN` prefix (ggml-org/llama.cpp#23115).

Any fault is an `ArchiveRefused` whose message is one line, naming the member.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path

from meshnet_gguf.llama.binary import BINARY_NAME

# Upstream's largest Linux assets unpack to a few hundred MB (ROCm's libraries); this only stops a bomb.
MAX_UNPACKED_BYTES = 8 * 1024**3
# A release holds a few dozen files; ten thousand is a malformed or hostile archive.
MAX_MEMBERS = 10_000
# A symlink a zip tool wrote as a file holds only its target's name.
STORED_LINK_MAX_BYTES = 256
COPY_CHUNK_BYTES = 1024 * 1024
_GZIP_MAGIC = b"\x1f\x8b"
_ZIP_MAGIC = b"PK\x03\x04"


class ArchiveRefused(RuntimeError):
    """The archive cannot be installed; the message says why in one line."""


def unpack(archive: Path, name: str, dest: Path) -> list[str]:
    """Unpack `archive` (shown as `name`) into the new folder `dest`; returns one line per link repaired."""
    dest.mkdir(parents=True)
    kind = _kind(archive, name)
    try:
        if kind == "zip":
            _unpack_zip(archive, name, dest)
        else:
            _unpack_tar(archive, name, dest)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
        raise ArchiveRefused(f"{name} is damaged or cut short ({_one_line(exc)})") from exc
    except OSError as exc:
        raise ArchiveRefused(f"cannot unpack {name}: {_one_line(exc)}") from exc
    return repair_links(dest)


def server_folder(root: Path, name: str) -> Path:
    """The folder holding the archive's llama-server (the shallowest one), with its libraries beside it."""
    found = sorted(
        (path for path in root.rglob(BINARY_NAME) if path.is_file() and not path.is_symlink()),
        key=lambda path: (len(path.relative_to(root).parts), str(path)),
    )
    if not found:
        held = sorted(str(p.relative_to(root)) for p in root.rglob("*"))[:8]
        raise ArchiveRefused(f"{name} holds no {BINARY_NAME} (it holds: {', '.join(held) or 'nothing'})")
    server = found[0]
    server.chmod(server.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return server.parent


def _kind(archive: Path, name: str) -> str:
    if name.endswith(".zip"):
        return "zip"
    if name.endswith((".tar.gz", ".tgz", ".tar")):
        return "tar"
    with archive.open("rb") as handle:
        magic = handle.read(4)
    if magic.startswith(_ZIP_MAGIC):
        return "zip"
    if magic.startswith(_GZIP_MAGIC):
        return "tar"
    raise ArchiveRefused(f"{name} is neither a .tar.gz nor a .zip")


def _parts(member: str, name: str) -> tuple[str, ...]:
    """A member's path as parts; refused when it is absolute or climbs out."""
    cleaned = member.replace("\\", "/")
    if cleaned.startswith("/") or (len(cleaned) > 1 and cleaned[1] == ":"):
        raise ArchiveRefused(f"{name}: member {member!r} has an absolute path")
    parts = tuple(part for part in cleaned.split("/") if part not in ("", "."))
    if ".." in parts:
        raise ArchiveRefused(f"{name}: member {member!r} leaves the archive's folder (..)")
    return parts


def _check_link(parts: tuple[str, ...], target: str, member: str, name: str) -> None:
    if target.startswith("/") or not target:
        raise ArchiveRefused(f"{name}: symlink {member!r} -> {target!r} points outside the archive")
    resolved = posixpath.normpath(posixpath.join("/".join(parts[:-1]) or ".", target))
    if resolved == ".." or resolved.startswith("../"):
        raise ArchiveRefused(f"{name}: symlink {member!r} -> {target!r} points outside the archive")


class _Walk:
    """What has been checked so far: the links (nothing may be written through one), the count and the size."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.links: set[tuple[str, ...]] = set()
        self.members = 0
        self.bytes = 0

    def member(self, member: str, size: int) -> tuple[str, ...]:
        self.members += 1
        if self.members > MAX_MEMBERS:
            raise ArchiveRefused(f"{self.name} holds more than {MAX_MEMBERS} members")
        self.bytes += max(size, 0)
        if self.bytes > MAX_UNPACKED_BYTES:
            raise ArchiveRefused(f"{self.name} unpacks to more than {MAX_UNPACKED_BYTES // 1024**3} GiB")
        parts = _parts(member, self.name)
        for depth in range(1, len(parts)):
            if parts[:depth] in self.links:
                raise ArchiveRefused(f"{self.name}: member {member!r} is written through the symlink {'/'.join(parts[:depth])!r}")
        return parts


def _unpack_tar(archive: Path, name: str, dest: Path) -> None:
    walk = _Walk(name)
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()  # reads to the end: a cut-short archive fails here, before anything is written
        for member in members:
            parts = walk.member(member.name, member.size)
            if member.issym():
                _check_link(parts, member.linkname, member.name, name)
                walk.links.add(parts)
            elif member.islnk():
                _parts(member.linkname, name)
            elif not (member.isfile() or member.isdir()):
                raise ArchiveRefused(f"{name}: member {member.name!r} is neither a file, a folder nor a link")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python without the extraction filters: every member was checked above
            tar.extractall(dest, members=members)


def _unpack_zip(archive: Path, name: str, dest: Path) -> None:
    walk = _Walk(name)
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        links: dict[tuple[str, ...], str] = {}
        for info in infos:
            parts = walk.member(info.filename, info.file_size)
            if stat.S_ISLNK(info.external_attr >> 16):
                target = zf.read(info).decode("utf-8", errors="replace")
                _check_link(parts, target, info.filename, name)
                walk.links.add(parts)
                links[parts] = target
        for info in infos:
            parts = _parts(info.filename, name)
            if not parts:
                continue
            target_path = dest.joinpath(*parts)
            if parts in links:
                target_path.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(links[parts], target_path)
            elif info.is_dir():
                target_path.mkdir(parents=True, exist_ok=True)
            else:
                target_path.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as source, target_path.open("wb") as out:
                    shutil.copyfileobj(source, out, COPY_CHUNK_BYTES)
                mode = stat.S_IMODE(info.external_attr >> 16) & 0o755
                if mode:
                    target_path.chmod(mode | stat.S_IRUSR)


def repair_links(root: Path) -> list[str]:
    """Mend the two packaging faults upstream archives are known to have; one line for each link mended."""
    repaired = []
    for path in _library_files(root):
        if path.is_symlink() or path.stat().st_size >= STORED_LINK_MAX_BYTES:
            continue
        target = path.read_bytes().decode("utf-8", errors="replace").strip()
        if target and "/" not in target and target != path.name and target.isprintable() and (path.parent / target).exists():
            path.unlink()
            path.symlink_to(target)
            repaired.append(f"restored the symlink {path.name} -> {target} (the archive stored it as a text file)")
    for path in sorted(root.rglob("*")):
        if not path.is_symlink() or path.exists():
            continue
        target = os.readlink(path)
        if "/" in target or not target.startswith("llama-b"):
            continue
        # llama-b9165ibggml.so.0 was meant as libggml.so.0: the prefix swallowed the name's first letters.
        rest = target[len("llama-b") :].lstrip("0123456789")
        matches = [p for p in path.parent.iterdir() if p != path and len(p.name) == len(rest) + 1 and p.name[1:] == rest]
        if len(matches) == 1:
            path.unlink()
            path.symlink_to(matches[0].name)
            repaired.append(f"repaired the broken symlink {path.name} -> {matches[0].name} (was -> {target})")
    return repaired


def _library_files(root: Path) -> Iterable[Path]:
    for path in sorted(root.rglob("*")):
        if path.is_file() and (path.name.startswith("lib") and ".so" in path.name or path.name.endswith(".dylib")):
            yield path


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
