"""llama.cpp's own release builds: where they are published and what their files are called.

No I/O here but reading the environment: the URLs of a release and its assets, and
which asset names to try for a backend, from the release's listing when it could
be read, else guessed as upstream names them.

Asset names, as llama.cpp's release workflow (`.github/workflows/release.yml`, its
"Pack artifacts" steps) publishes them for Linux (and macOS):

    cpu     llama-<tag>-bin-ubuntu-<x64|arm64|s390x>.tar.gz
    vulkan  llama-<tag>-bin-ubuntu-vulkan-<x64|arm64>.tar.gz
    rocm    llama-<tag>-bin-ubuntu-rocm-<ROCm major.minor>-x64.tar.gz   (7.2, later 7.14)
    macos   llama-<tag>-bin-macos-<arm64|x64>.tar.gz

`.tar.gz` (a top folder `llama-<tag>/`, symlinks stored) replaced `.zip` for Linux and
macOS around b7100 (late 2025); older tags ship the same stem as `.zip` with a
`build/bin/` folder. The Linux CPU and Vulkan builds carry every x86-64 CPU variant
(`GGML_CPU_ALL_VARIANTS`, picked at run time), so they run on any x86-64 CPU. The ROCm
name carries the ROCm version, so it is read from the listing (newest first).
"""

from __future__ import annotations

import os
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEFAULT_REPO = "ggml-org/llama.cpp"
DEFAULT_GITHUB = "https://github.com"
DEFAULT_GITHUB_API = "https://api.github.com"
# Mirrors and tests point these elsewhere (a release server on loopback).
REPO_ENV_VAR = "MESHNET_LLAMA_REPO"
GITHUB_ENV_VAR = "MESHNET_LLAMA_GITHUB"
GITHUB_API_ENV_VAR = "MESHNET_LLAMA_GITHUB_API"
# Sent to GitHub's own API only (never to a mirror), to lift its rate limit.
TOKEN_ENV_VAR = "GITHUB_TOKEN"
LATEST = "latest"

CPU, VULKAN, ROCM, MACOS = "cpu", "vulkan", "rocm", "macos"
BACKENDS = (CPU, VULKAN, ROCM, MACOS)
# The arches upstream builds each backend for.
BACKEND_ARCHES = {CPU: ("x64", "arm64", "s390x"), VULKAN: ("x64", "arm64"), ROCM: ("x64",), MACOS: ("arm64", "x64")}
_STEMS = {
    CPU: "llama-{tag}-bin-ubuntu-{arch}",
    VULKAN: "llama-{tag}-bin-ubuntu-vulkan-{arch}",
    ROCM: "llama-{tag}-bin-ubuntu-rocm-{rocm}-{arch}",
    MACOS: "llama-{tag}-bin-macos-{arch}",
}
ARCHIVE_SUFFIXES = (".tar.gz", ".zip")
# ROCm versions guessed, newest first, only when the release's listing cannot be read.
ROCM_VERSIONS_GUESS = ("7.14", "7.2")
_MACHINE_ARCHES = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64", "s390x": "s390x"}
_TAG_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_SHA256_RE = re.compile(r"sha256:(?P<hex>[0-9a-f]{64})")


@dataclass(frozen=True)
class ReleaseSite:
    """Where releases are published: GitHub, or a mirror named by the environment."""

    repo: str = DEFAULT_REPO
    download_base: str = DEFAULT_GITHUB
    api_base: str = DEFAULT_GITHUB_API

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReleaseSite:
        env = os.environ if env is None else env
        return cls(
            repo=env.get(REPO_ENV_VAR) or DEFAULT_REPO,
            download_base=(env.get(GITHUB_ENV_VAR) or DEFAULT_GITHUB).rstrip("/"),
            api_base=(env.get(GITHUB_API_ENV_VAR) or DEFAULT_GITHUB_API).rstrip("/"),
        )

    def release_url(self, tag: str) -> str:
        """The API's answer for one release (`latest`, or a tag): its tag and its assets."""
        which = LATEST if tag == LATEST else f"tags/{tag}"
        return f"{self.api_base}/repos/{self.repo}/releases/{which}"

    def asset_url(self, tag: str, asset: str) -> str:
        return f"{self.download_base}/{self.repo}/releases/download/{tag}/{asset}"

    def api_headers(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        env = os.environ if env is None else env
        headers = {"Accept": "application/vnd.github+json"}
        token = env.get(TOKEN_ENV_VAR)
        if token and self.api_base == DEFAULT_GITHUB_API:
            headers["Authorization"] = f"Bearer {token}"
        return headers


@dataclass(frozen=True)
class ReleaseAsset:
    name: str
    size: int | None = None
    sha256: str | None = None  # the listing's digest, where it gives one


@dataclass(frozen=True)
class Release:
    tag: str
    # None: the listing could not be read, so asset names are guessed.
    assets: tuple[ReleaseAsset, ...] | None

    def asset(self, name: str) -> ReleaseAsset:
        for asset in self.assets or ():
            if asset.name == name:
                return asset
        return ReleaseAsset(name)


def valid_tag(tag: str) -> bool:
    """A release tag (`b7100`) or `latest`: it goes into a URL's path, so nothing else."""
    return _TAG_RE.fullmatch(tag) is not None


def parse_release(answer: object) -> Release | None:
    """The API's JSON for one release, or None when it is not one."""
    if not isinstance(answer, dict) or not isinstance(answer.get("tag_name"), str) or not valid_tag(answer["tag_name"]):
        return None
    assets = []
    for entry in answer.get("assets") or ():
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            continue
        size = entry.get("size")
        digest = _SHA256_RE.fullmatch(str(entry.get("digest") or ""))
        assets.append(ReleaseAsset(entry["name"], size if isinstance(size, int) and size >= 0 else None, digest["hex"] if digest else None))
    return Release(answer["tag_name"], tuple(assets))


def machine_arch(machine: str | None = None) -> str | None:
    """Upstream's word for this machine's architecture (`x64`, `arm64`, `s390x`), or None."""
    return _MACHINE_ARCHES.get((machine or platform.machine()).lower())


def candidate_assets(release: Release, backend: str, arch: str) -> list[str]:
    """The asset names to try for a backend, most likely first: those the listing has, else guessed."""
    if arch not in BACKEND_ARCHES.get(backend, ()):
        return []
    if backend == ROCM:
        return _rocm_assets(release, arch)
    stem = _STEMS[backend].format(tag=release.tag, arch=arch)
    names = [stem + suffix for suffix in ARCHIVE_SUFFIXES]
    if release.assets is None:
        return names
    published = {asset.name for asset in release.assets}
    return [name for name in names if name in published]


def _rocm_assets(release: Release, arch: str) -> list[str]:
    if release.assets is None:
        stems = [_STEMS[ROCM].format(tag=release.tag, rocm=version, arch=arch) for version in ROCM_VERSIONS_GUESS]
        return [stem + suffix for stem in stems for suffix in ARCHIVE_SUFFIXES]
    pattern = re.compile(
        re.escape(f"llama-{release.tag}-bin-ubuntu-rocm-")
        + r"(?P<version>\d+(?:\.\d+)*)"
        + re.escape(f"-{arch}")
        + r"(?P<suffix>\.tar\.gz|\.zip)"
    )
    found = []
    for asset in release.assets:
        match = pattern.fullmatch(asset.name)
        if match:
            version = tuple(int(part) for part in match["version"].split("."))
            found.append((version, ARCHIVE_SUFFIXES.index(match["suffix"]), asset.name))
    # Newest ROCm first; for one version, .tar.gz before .zip (two stable sorts).
    found.sort(key=lambda item: item[1])
    found.sort(key=lambda item: item[0], reverse=True)
    return [name for *_, name in found]


def published_names(release: Release, words: Sequence[str] = ("-ubuntu-", "-macos-")) -> list[str]:
    """The release's Linux and macOS asset names, to show when none fits."""
    return [asset.name for asset in release.assets or () if any(word in asset.name for word in words)]
