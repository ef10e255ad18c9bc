"""`meshnet-gguf doctor`: argument handling and printing only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

if TYPE_CHECKING:
    from collections.abc import Callable

    from meshnet_gguf.common.setting_origins import SettingOrigin
    from meshnet_gguf.common.settings import NodeSettings
    from meshnet_gguf.hardware.report import HardwareReport
    from meshnet_gguf.llama.binary import BinaryInfo
    from meshnet_gguf.mesh.identity import NodeIdentity

# Exit codes: 0 nothing blocks serving (warnings may remain), 1 something does.
EXIT_BLOCKED = 1


def register(app: typer.Typer) -> None:
    @app.command()
    def doctor(
        gguf: Annotated[Optional[str], typer.Option(help="Model to check as `serve --gguf` takes it")] = None,
        quant: Annotated[Optional[str], typer.Option(help="Quant to check, e.g. UD-IQ3_XXS")] = None,
        demo: Annotated[bool, typer.Option("--demo", help="Check the demo model")] = False,
        host: Annotated[Optional[str], typer.Option(help="Public address the node would bind")] = None,
        port: Annotated[Optional[int], typer.Option(help="Public port the node would bind")] = None,
        llama_server: Annotated[Optional[Path], typer.Option(help="llama-server binary to check")] = None,
        download_dir: Annotated[Optional[Path], typer.Option(help="Where GGUF files are downloaded")] = None,
        tracker: Annotated[Optional[str], typer.Option(help="Tracker URL to compare clocks with")] = None,
        relay: Annotated[
            Optional[list[str]], typer.Option("--relay", help="Relay URL to attach a test work connection to (repeatable: each is checked)")
        ] = None,
        state_dir: Annotated[Optional[Path], typer.Option(help="Node state dir (its identity proves itself to the relay)")] = None,
        offline: Annotated[bool, typer.Option("--offline", help="Never contact the hub for model sizes")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON")] = False,
        pool_worker: Annotated[Optional[list[str]], typer.Option(help="Pool worker HOST:PORT[=BUDGET] to check (repeatable)")] = None,
    ) -> None:
        """Check that this box can serve, and how to fix it.

        Binary, GPUs, memory, disk, clock and port: each problem explained, with its fix.
        """
        from meshnet_gguf.common.settings import NodeSettings
        from meshnet_gguf.doctor.binary_choice import check_binary_choice
        from meshnet_gguf.doctor.checks import DoctorEnvironment, DoctorReport, run_doctor
        from meshnet_gguf.doctor.relay import check_relay
        from meshnet_gguf.prepare.pipeline import model_size

        given = dict(
            gguf=gguf, quant=quant, demo=demo, host=host, port=port, llama_server=llama_server,
            download_dir=download_dir, tracker=tracker, relay_url=relay, state_dir=state_dir, offline=offline,
            pool_workers=pool_worker,
        )  # fmt: skip
        flags = {k: v for k, v in given.items() if v is not None and v is not False and v != []}
        settings = NodeSettings(**flags)
        identity = doctor_identity(settings)
        environment = DoctorEnvironment(
            settings, model_size=lambda binary, hw: model_size(settings, binary, hw), pool=_pool_check(settings, identity)
        )
        fixture = settings.hardware_fixture
        if fixture is not None:
            # The box `serve` and `models` plan for (MESHNET_HARDWARE_FIXTURE), so all three print one figure.
            from meshnet_gguf.hardware.report import probe_configured

            environment.hardware = lambda binary: probe_configured(binary, fixture)
            typer.echo(f"warning: checking against the recorded machine {fixture}, not this one (MESHNET_HARDWARE_FIXTURE)", err=True)
        report = DoctorReport(
            run_doctor(environment).findings + tuple(check_binary_choice(settings)) + tuple(check_relay(settings, identity))
        )
        origins = _settings_origins(settings, flags)
        if as_json:
            typer.echo(json.dumps({**report.to_dict(), "settings": origins.as_json()}, indent=2))
        else:
            typer.echo(f"{origins.as_text()}\n{report.format_text()}")
        if report.blocking:
            raise typer.Exit(EXIT_BLOCKED)


class _Origins:
    """Where each setting came from, as doctor prints it: every one in JSON; in text the ones not at their
    default, one line each, and a count of the rest (fifty default lines would bury the findings)."""

    def __init__(self, origins: list[SettingOrigin]) -> None:
        self.origins = origins

    def as_json(self) -> dict[str, dict[str, str]]:
        return {o.name: {"value": o.value, "from": o.origin, "where": o.where} for o in self.origins}

    def as_text(self) -> str:
        chosen = [o for o in self.origins if o.origin != "default"]
        lines = ["settings (flag > environment > file > default):"]
        lines += [f"  {o.describe()}" for o in chosen]
        lines.append(f"  {len(self.origins) - len(chosen)} others at their default (doctor --json lists every one)")
        return "\n".join(lines)


def _settings_origins(settings: NodeSettings, flags: dict[str, object]) -> _Origins:
    from meshnet_gguf.common.setting_origins import setting_origins

    return _Origins(setting_origins(settings, flags))


def doctor_identity(settings: NodeSettings) -> NodeIdentity | None:
    """This node's key, read once for the pool check and the relay probe. Created only for a pool
    check, as `serve` would create it (the workers check its signature); the relay probe only reads it."""
    from meshnet_gguf.node import existing_node_key, node_key

    if settings.pool_workers:
        return node_key(settings)
    return existing_node_key(settings) if settings.relay_url else None


def _pool_check(settings: NodeSettings, identity: NodeIdentity | None) -> Callable[[BinaryInfo, HardwareReport], str] | None:
    """The pool workers' check with this node's key, as `serve` makes it."""
    if not settings.pool_workers or identity is None:
        return None
    from meshnet_gguf.node import pool_status_tokens
    from meshnet_gguf.prepare.pipeline import pool_summary

    return lambda binary, hardware: pool_summary(settings, pool_status_tokens(identity), binary, hardware)
