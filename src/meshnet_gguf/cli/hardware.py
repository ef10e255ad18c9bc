"""`meshnet-gguf hardware`: print what this machine offers llama-server (argument handling and printing only)."""

from __future__ import annotations

import json
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

        Also the devices llama-server lists, and where the honest GPU memory budget comes from.
        """
        from meshnet_gguf.common.settings import NodeSettings
        from meshnet_gguf.hardware.report import format_table, probe_configured
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
        if as_json:
            typer.echo(json.dumps(report.to_dict(), indent=2, default=str))
        else:
            typer.echo(format_table(report))
