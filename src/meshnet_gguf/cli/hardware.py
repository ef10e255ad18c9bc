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
        llama_server: Annotated[
            Optional[Path], typer.Option(help="llama-server whose devices to list [env: MESHNET_LLAMA_SERVER]")
        ] = None,
    ) -> None:
        """Show CPU, RAM, GPUs, the llama-server devices and the honest GPU memory budget."""
        from meshnet_gguf.binary import BinaryNotFound, find_llama_server
        from meshnet_gguf.hardware import format_table, probe_hardware

        try:
            binary = find_llama_server(llama_server)
        except BinaryNotFound as exc:
            # The machine's own facts are still worth printing; the report says the binary was not probed.
            typer.echo(f"warning: {str(exc).splitlines()[0]}", err=True)
            binary = None
        report = probe_hardware(binary)
        if as_json:
            typer.echo(json.dumps(report.to_dict(), indent=2, default=str))
        else:
            typer.echo(format_table(report))
