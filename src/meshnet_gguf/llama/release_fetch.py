"""Fetch llama.cpp's own release build of llama-server, check it here, and install it whole or not at all.

    the release's listing (API: latest, or a tag) ─► the assets for this box (release_backend), best first
      └─► per asset: download (size-bounded, against the listing's size and sha256) ─► unpack (release_archive)
            ─► llama-server inside? answers --help? serves a tiny model of these weight types here? (run_probe)
            ─► build.json beside it ─► the checked folder renamed into `binary.built_binary_dir(RELEASE_INSTALL)`
    an asset refused ─► the next backend's;  the site unreachable ─► `ReleaseUnavailable` at once

Seconds where a build from source takes minutes, and with a GPU backend (Vulkan,
ROCm). Nothing half-done is ever found: the folder is staged beside the install
(same filesystem), checked there, and swapped in by rename; a refusal removes it.
`ReleaseUnavailable` says in one line why nothing was installed, so the caller
(the node's self-heal, `meshnet-gguf fetch-llama-server`) can build from source instead.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from meshnet_gguf.llama.binary import (
    BINARY_NAME,
    BUILD_INFO_FILE,
    INSTALL_SOURCES,
    RELEASE_INSTALL,
    BinaryNotFound,
    built_binary_dir,
    probe_binary,
)
from meshnet_gguf.llama.release_archive import ArchiveRefused, server_folder, unpack
from meshnet_gguf.llama.release_assets import (
    LATEST,
    Release,
    ReleaseAsset,
    ReleaseSite,
    candidate_assets,
    machine_arch,
    parse_release,
    published_names,
    valid_tag,
)
from meshnet_gguf.llama.release_backend import release_backends
from meshnet_gguf.llama.run_probe import ALWAYS_PROBED, DEFAULT_PROBE_TYPES, RunProbe, probe_fresh, remember_probe

# A server that does not answer a connection in this long is not going to serve a download.
CONNECT_TIMEOUT_S = 10.0
# The longest wait for the next bytes (of the listing, or of a download under way).
READ_TIMEOUT_S = 60.0
# One whole download, start to end: the ROCm build is the largest asset, on a slow home link.
DOWNLOAD_TIMEOUT_S = 1800.0
# Upstream's Linux assets are 10-40 MB (CPU, Vulkan), the ROCm one a few hundred; 2 GiB only stops a runaway.
MAX_ARCHIVE_BYTES = 2 * 1024**3
# The API's answer for one release is tens of kB.
MAX_LISTING_BYTES = 4 * 1024**2
DOWNLOAD_CHUNK_BYTES = 1024 * 1024
STAGING_PREFIX = ".release-fetch-"


class ReleaseUnavailable(RuntimeError):
    """No release build was installed; the message says why in one line."""


class _AssetRefused(RuntimeError):
    """This asset cannot be used (missing, damaged, or does not run here); another one may."""


class _AssetMissing(_AssetRefused):
    """The site answered 404 for this asset name."""


@dataclass(frozen=True)
class FetchedRelease:
    binary: Path
    build: str  # the release's tag, e.g. "b7100"
    backend: str  # "vulkan", "rocm", "cpu"
    asset: str
    size: int
    seconds: float
    notes: tuple[str, ...] = ()

    def describe(self) -> str:
        return (
            f"{self.binary} (llama.cpp {self.build}, {self.backend}, from {self.asset}, {self.size / 1e6:.0f} MB in {self.seconds:.0f} s)"
        )


def fetch_release(
    *,
    tag: str = LATEST,
    backends: Sequence[str] | None = None,
    types: Iterable[str] = DEFAULT_PROBE_TYPES,
    install_root: Path | None = None,
    env: Mapping[str, str] | None = None,
    notes: Callable[[str], None] = lambda _line: None,
) -> FetchedRelease:
    """Install llama.cpp's release build for this box (see the module's picture); raises `ReleaseUnavailable`.

    `backends`: the builds to try, in order [default: `release_backends()`, ending with the CPU build].
    `types`: the weight types the fetched llama-server must run here before it is installed."""
    if not valid_tag(tag):
        raise ReleaseUnavailable(f"{tag!r} is not a llama.cpp release tag (e.g. b7100, or latest)")
    site = ReleaseSite.from_env(env)
    arch = machine_arch()
    if arch is None:
        raise ReleaseUnavailable("llama.cpp publishes no release build for this machine's architecture")
    chosen = list(backends) if backends else [choice.backend for choice in release_backends(env=env)]
    install_root = built_binary_dir(env, RELEASE_INSTALL) if install_root is None else install_root
    types = tuple(types)
    started = time.monotonic()
    timeout = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
    with httpx.Client(timeout=timeout, follow_redirects=True) as client:
        release = _read_release(client, site, tag, env)
        refused: list[str] = []
        for backend in chosen:
            names = candidate_assets(release, backend, arch)
            for name in names:
                try:
                    size, repaired = _install_asset(client, site, release, release.asset(name), backend, install_root, types, notes)
                except OSError as exc:  # the data folder cannot be written: no other asset would install either
                    raise ReleaseUnavailable(f"cannot install into {install_root}: {_one_line(exc)}") from exc
                except _AssetMissing:
                    continue
                except _AssetRefused as exc:
                    refused.append(str(exc) if str(exc).startswith(name) else f"{name}: {exc}")
                    notes(f"refused {name}: {exc}")
                    break  # the next backend's build
                seconds = time.monotonic() - started
                return FetchedRelease(install_root / BINARY_NAME, release.tag, backend, name, size, seconds, tuple(repaired))
            else:
                if names and release.assets is None:
                    refused.append(f"none of {', '.join(names)} is published")
    if refused:
        raise ReleaseUnavailable(f"release {release.tag}: " + "; ".join(refused))
    shown = ", ".join(published_names(release)[:12]) or "none"
    raise ReleaseUnavailable(f"release {release.tag} has no {'/'.join(chosen)} build for {arch} (its Linux and macOS assets: {shown})")


def _read_release(client: httpx.Client, site: ReleaseSite, tag: str, env: Mapping[str, str] | None) -> Release:
    """The release's tag and listing. For `latest` the listing is needed; for a tag, names are guessed without it."""
    url = site.release_url(tag)
    try:
        answer = client.get(url, headers=site.api_headers(env))
    except (httpx.RequestError, httpx.InvalidURL) as exc:
        raise ReleaseUnavailable(f"cannot reach {url}: {_one_line(exc)}") from exc
    if answer.status_code == 200 and len(answer.content) <= MAX_LISTING_BYTES:
        try:
            release = parse_release(answer.json())
        except ValueError:
            release = None
        if release is not None:
            return release
        problem = "an answer that is not a release"
    else:
        problem = f"HTTP {answer.status_code}"
    if tag == LATEST:
        raise ReleaseUnavailable(f"{url} answered {problem}")
    return Release(tag, None)  # a pinned tag: its asset names are known without the listing


def _install_asset(
    client: httpx.Client,
    site: ReleaseSite,
    release: Release,
    asset: ReleaseAsset,
    backend: str,
    install_root: Path,
    types: tuple[str, ...],
    notes: Callable[[str], None],
) -> tuple[int, list[str]]:
    """Download, unpack, check and install one asset; returns its size and the links repaired in it."""
    install_root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=install_root.parent))
    try:
        url = site.asset_url(release.tag, asset.name)
        notes(f"downloading {url}")
        archive = staging / asset.name
        size, digest = _download(client, url, archive, asset)
        try:
            repaired = unpack(archive, asset.name, staging / "unpacked")
            folder = server_folder(staging / "unpacked", asset.name)
        except ArchiveRefused as exc:
            raise _AssetRefused(str(exc)) from exc
        archive.unlink()
        for line in repaired:
            notes(line)
        probe = _check_runs(folder, asset.name, types)
        record = {
            "build": release.tag, "backend": backend, "source": f"llama.cpp release {asset.name}", "url": url,
            "sha256": digest, "bytes": size, "fetched_at": int(time.time()),
        }  # fmt: skip
        (folder / BUILD_INFO_FILE).write_text(json.dumps(record, indent=2))
        _swap_in(folder, install_root, staging)
        _remember(install_root, types, probe)
        return size, repaired
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _download(client: httpx.Client, url: str, dest: Path, asset: ReleaseAsset) -> tuple[int, str]:
    """Stream one asset to `dest`, bounded in size and time; returns its size and sha256."""
    deadline = time.monotonic() + DOWNLOAD_TIMEOUT_S
    limit_mb = MAX_ARCHIVE_BYTES // 1024**2
    digest = hashlib.sha256()
    size = 0
    try:
        with client.stream("GET", url) as answer:
            if answer.status_code == 404:
                raise _AssetMissing(f"{asset.name} is not published")
            if answer.status_code != 200:
                raise _AssetRefused(f"{url} answered HTTP {answer.status_code}")
            length = answer.headers.get("content-length", "")
            declared = int(length) if length.isdigit() else 0
            if max(declared, asset.size or 0) > MAX_ARCHIVE_BYTES:
                raise _AssetRefused(f"{asset.name} is {max(declared, asset.size or 0) // 1024**2} MB, above the {limit_mb} MB limit")
            with dest.open("wb") as out:
                for chunk in answer.iter_bytes(DOWNLOAD_CHUNK_BYTES):
                    size += len(chunk)
                    if size > MAX_ARCHIVE_BYTES:
                        raise _AssetRefused(f"{asset.name} is above the {limit_mb} MB limit")
                    if time.monotonic() > deadline:
                        raise _AssetRefused(f"{asset.name} took longer than {DOWNLOAD_TIMEOUT_S:.0f} s to download")
                    out.write(chunk)
                    digest.update(chunk)
    except (httpx.RequestError, httpx.InvalidURL) as exc:
        raise ReleaseUnavailable(f"downloading {url} failed: {_one_line(exc)}") from exc
    except OSError as exc:  # a full disk: no other asset would fit either
        raise ReleaseUnavailable(f"cannot write {dest}: {_one_line(exc)}") from exc
    if asset.size is not None and size != asset.size:
        raise _AssetRefused(f"{asset.name} came as {size} bytes where the release lists {asset.size} (cut short?)")
    if asset.sha256 is not None and digest.hexdigest() != asset.sha256:
        raise _AssetRefused(f"{asset.name}'s sha256 is {digest.hexdigest()}, not the release's {asset.sha256}")
    return size, digest.hexdigest()


def _check_runs(folder: Path, name: str, types: tuple[str, ...]) -> RunProbe:
    """The fetched llama-server must answer like one and serve a tiny model of these weight types here."""
    try:
        binary = probe_binary(folder / BINARY_NAME, f"llama.cpp release {name}", (folder,))
    except BinaryNotFound as exc:
        raise _AssetRefused(f"its llama-server does not run here: {_one_line(exc)}") from exc
    probe = probe_fresh(binary, types)
    if not probe.runs:
        kinds = ", ".join(t for t in probe.types if t not in ALWAYS_PROBED) or "float"
        if probe.illegal_instruction:
            raise _AssetRefused(f"its llama-server dies with SIGILL on this CPU running {kinds} weights")
        raise _AssetRefused(f"its llama-server does not serve a tiny {kinds} model here ({probe.died_with})")
    return probe


def _swap_in(folder: Path, install_root: Path, staging: Path) -> None:
    """Rename the checked folder into place; a previous install moves aside first and goes with the staging folder."""
    previous = staging / "previous"
    if install_root.exists() or install_root.is_symlink():
        os.replace(install_root, previous)
    try:
        os.replace(folder, install_root)
    except OSError:
        if previous.exists():
            os.replace(previous, install_root)
        raise


def _remember(install_root: Path, types: tuple[str, ...], probe: RunProbe) -> None:
    """The probe ran on this very file before it moved: keep its answer under its installed path."""
    try:
        binary = probe_binary((install_root / BINARY_NAME).resolve(), INSTALL_SOURCES[RELEASE_INSTALL], (install_root,))
    except BinaryNotFound:
        return
    remember_probe(binary, types, probe)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
