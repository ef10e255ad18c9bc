"""`meshnet-gguf hardware`: print what this machine offers llama-server (argument handling and printing only)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def hardware(
        as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON for machines")] = False,
        llama_server: Annotated[Optional[Path], typer.Option(help="llama-server whose devices to list")] = None,
    ) -> None:
        """Show CPU, RAM, GPUs and the GPU memory budget.

        Also the devices llama-server lists, where the honest GPU memory budget comes from, and each GPU or Vulkan
        driver this llama-server cannot use, with what would use it.
        """
        from meshnet_gguf.common.settings import NodeSettings
        from meshnet_gguf.hardware.report import format_table, probe_configured
        from meshnet_gguf.hardware.unused import find_unused, format_unused
        from meshnet_gguf.llama.binary import BinaryNotFound, find_llama_server

        try:
            binary = find_llama_server(llama_server)
        except BinaryNotFound as exc:
            # The machine's own facts are still worth printing; the report says the binary was not probed.
            typer.echo(f"warning: {str(exc).splitlines()[0]}", err=True)
            binary = None
        # MESHNET_HARDWARE_FIXTURE (a testing/diagnosis aid) shows a recorded machine instead of this one.
        fixture = NodeSettings().hardware_fixture
        try:
            report = probe_configured(binary, fixture)
        except FileNotFoundError as exc:
            typer.echo(f"error: hardware_fixture (MESHNET_HARDWARE_FIXTURE): {exc}", err=True)
            raise typer.Exit(2) from exc
        if fixture is not None:
            typer.echo(f"warning: showing the recorded machine {fixture}, not this one (MESHNET_HARDWARE_FIXTURE)", err=True)
        # A recorded machine's files (its ICDs, libraries, /dev/kfd) stand in for this one's here too.
        unused = find_unused(report, binary, fixture / "root" if fixture is not None else Path("/"))
        if as_json:
            data = {**report.to_dict(), "unused_gpus": [{**asdict(u), "line": u.line()} for u in unused]}
            typer.echo(json.dumps(data, indent=2, default=str))
        else:
            typer.echo(format_table(report))
            if unused:
                typer.echo(format_unused(unused))
