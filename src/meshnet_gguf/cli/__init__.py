"""The `meshnet-gguf` command line: argument handling and printing, the work done by the areas the commands call
(`dev_mesh` alone runs processes of its own: a tracker, a relay and a node for `dev mesh`). Each module in this
package registers its own commands.

May import: every area.
"""

from __future__ import annotations

import importlib

import typer

from meshnet_gguf import __version__
from meshnet_gguf.cli.help_text import tidy_help

app = typer.Typer(
    name="meshnet-gguf",
    help="Serve GGUF models through llama-server as a whole-model Meshnet node.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    # Plain click help: rendering it with rich would import rich for every --help (~0.2 s).
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"meshnet-gguf {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit"),
) -> None:
    """Serve GGUF models through llama-server as a whole-model Meshnet node."""


# Each module exposes `register(app)`. Listed, not discovered, so the help order is deliberate.
_COMMAND_MODULES = [
    "serve",
    "ps",
    "hardware",
    "models",
    "local_models",
    "usage",
    "dev",
    "service",
    "doctor",
    "build",
    "fetch",
    "worker",
]

for _name in _COMMAND_MODULES:
    importlib.import_module(f"{__name__}.{_name}").register(app)

tidy_help(app)


def main() -> None:
    try:
        app()
    except Exception as exc:
        # A setting from a flag, MESHNET_* or the TOML file that cannot be, or a config file that
        # cannot be read as written: one line, no traceback.
        # Recognised by name so that --help never imports pydantic.
        if type(exc).__name__ == "ConfigFileError":
            typer.echo(f"error: {exc}", err=True)
            raise SystemExit(2) from None
        if type(exc).__name__ != "ValidationError" or not type(exc).__module__.startswith("pydantic"):
            raise
        from meshnet_gguf.common.settings import describe_settings_error

        typer.echo(f"error: {describe_settings_error(exc)}", err=True)
        raise SystemExit(2) from None
