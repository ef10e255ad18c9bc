"""The `meshnet-gguf` command line. Each module in this package registers its own commands."""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="meshnet-gguf",
    help="Serve GGUF models through llama-server as a whole-model Meshnet node.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

# Each module exposes `register(app)`. Listed, not discovered, so the help order is deliberate.
_COMMAND_MODULES = [
    "serve",
]

for _name in _COMMAND_MODULES:
    importlib.import_module(f"{__name__}.{_name}").register(app)


def main() -> None:
    app()
