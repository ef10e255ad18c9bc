"""`meshnet-gguf fetch-llama-server`: install llama.cpp's own release build of llama-server, checked here."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

BACKEND_WORDS = "auto, vulkan, rocm, cpu, macos"


def register(app: typer.Typer) -> None:
    @app.command("fetch-llama-server")
    def fetch_llama_server(
        tag: Annotated[str, typer.Argument(help="A llama.cpp release tag, e.g. b7100")] = "latest",
        backend: Annotated[
            str, typer.Option(help=f"Which build: {BACKEND_WORDS} [auto: ROCm where installed, Vulkan where a GPU is, then CPU]")
        ] = "auto",
        install_dir: Annotated[
            Optional[Path],
            typer.Option(help="Where to install [default: $XDG_DATA_HOME/meshnet/llama-server-release, which the node searches]"),
        ] = None,
        force: Annotated[bool, typer.Option("--force", help="Fetch again even when a release build is installed")] = False,
    ) -> None:
        """Install llama.cpp's own release build of llama-server.

        Seconds where a build takes minutes, and with a GPU backend. Downloads the release asset for this box from GitHub (MESHNET_LLAMA_GITHUB and
        MESHNET_LLAMA_GITHUB_API name a mirror), checks it (archive, a llama-server inside,
        a tiny model served here) and installs it whole where the node finds it. Where
        no release can be fetched, build-llama-server builds one from source instead.
        """
        from meshnet_gguf.llama.binary import BINARY_NAME, RELEASE_INSTALL, built_binary_dir
        from meshnet_gguf.llama.release_assets import BACKENDS
        from meshnet_gguf.llama.release_fetch import ReleaseUnavailable, fetch_release

        if backend != "auto" and backend not in BACKENDS:
            typer.echo(f"error: --backend {backend}: one of {BACKEND_WORDS}", err=True)
            raise typer.Exit(2)
        target = install_dir or built_binary_dir(install=RELEASE_INSTALL)
        if (target / BINARY_NAME).is_file() and not force:
            typer.echo(f"already installed: {target / BINARY_NAME} (--force fetches again)")
            return
        try:
            fetched = fetch_release(
                tag=tag, backends=None if backend == "auto" else (backend,), install_root=target,
                notes=lambda line: typer.echo(line, err=True),
            )  # fmt: skip
        except ReleaseUnavailable as exc:
            typer.echo(f"error: {exc}. Fix: meshnet-gguf build-llama-server builds one from source instead", err=True)
            raise typer.Exit(1) from exc
        typer.echo(f"installed {fetched.describe()}")
        if install_dir is not None and install_dir != built_binary_dir(install=RELEASE_INSTALL):
            typer.echo(f"use it with: meshnet-gguf serve --llama-server {fetched.binary} ...  (or MESHNET_LLAMA_SERVER)")
        else:
            typer.echo("the node finds it by itself from now on")
