"""`meshnet-gguf service install|uninstall|status`: argument handling and printing only."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

if TYPE_CHECKING:
    import click

    from meshnet_gguf.common.settings import NodeSettings
    from meshnet_gguf.ops.unit import ServicePlan

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXIT_SERVICE_ERROR = 1
HEALTH_TIMEOUT_S = 3.0
# `serve` options that are not node settings (they only steer the command itself).
_SERVE_ONLY_OPTIONS = frozenset({"dry_run"})
# `serve` option names that differ from the NodeSettings field they set.
_SERVE_OPTION_FIELDS = {"llama_arg": "llama_args", "pool_worker": "pool_workers", "allowed_host": "allowed_hosts"}
# `serve` flags that turn a setting off.
_SERVE_NEGATING_FLAGS = {"no_build": "build"}


class ServeArgsError(ValueError):
    """The arguments after `service install` are not ones `serve` takes."""


def _sibling_command(ctx: typer.Context, name: str) -> click.Command:
    """The top-level `meshnet-gguf <name>` command, whose own parser checks the arguments."""
    root = ctx.find_root().command
    get_command = getattr(root, "get_command", None)
    command = get_command(ctx, name) if get_command is not None else None
    if command is None:
        raise ServeArgsError(f"this installation has no `{name}` command to install as a service")
    return command


def settings_from_serve_args(ctx: typer.Context, args: Sequence[str]) -> NodeSettings:
    """Parse `args` exactly as `meshnet-gguf serve` would, into the settings it would run with."""
    from meshnet_gguf.common.settings import NodeSettings

    serve = _sibling_command(ctx, "serve")
    # Parsing with serve's own command keeps one definition of its options; a bad
    # option fails here with serve's usage message.
    serve_ctx = serve.make_context("serve", list(args), parent=ctx)
    given: dict[str, Any] = {}
    for name, value in serve_ctx.params.items():
        if name in _SERVE_ONLY_OPTIONS or value is None or value is False or value == [] or value == ():
            continue
        if name in _SERVE_NEGATING_FLAGS:
            given[_SERVE_NEGATING_FLAGS[name]] = False
            continue
        if name == "gguf":  # the first model, and the models beside it, as `serve` splits them
            from meshnet_gguf.cli.serve import models_of_flags

            first, others = models_of_flags(list(value), demo=bool(serve_ctx.params.get("demo")))
            given.update({"gguf": first} if first else {}, **({"models": others} if others else {}))
            continue
        field = _SERVE_OPTION_FIELDS.get(name, name)
        if field not in NodeSettings.model_fields:
            raise ServeArgsError(f"serve option --{name.replace('_', '-')} has no node setting to store it in")
        given[field] = list(value) if isinstance(value, tuple) else value
    return NodeSettings(**given)


def with_the_chosen_llama_server(settings: NodeSettings, *, measure: bool = True) -> NodeSettings:
    """The settings with `llama_server` pinned to the llama-server the node would choose for its model.

    Where several installed ones run the model, the fastest by measurement (`prepare/binary_choice`): measured
    here once if no start has measured them yet (`measure`, the model on disk), so the service neither measures
    at boot nor switches binaries silently. Else the build made for this machine, when that is what the node would
    run: a service's user and environment differ from the operator's, and would otherwise fall back to the bundled
    build that this CPU cannot run."""
    from meshnet_gguf.llama.binary import BUILT_SOURCE, BinaryNotFound
    from meshnet_gguf.llama.runnable import BinaryCannotRun, runnable_llama_server

    if settings.llama_server is not None:
        return settings
    measured = _measured_choice(settings, measure=measure)
    if measured is not None:
        return settings.model_copy(update={"llama_server": measured})
    try:
        runnable = runnable_llama_server(None, dry_run=True)
    except (BinaryNotFound, BinaryCannotRun):
        return settings
    if runnable.build_needed or runnable.binary.source != BUILT_SOURCE:
        return settings
    return settings.model_copy(update={"llama_server": runnable.binary.path})


def _measured_choice(settings: NodeSettings, *, measure: bool) -> Path | None:
    """The fastest installed llama-server for the settings' model, by measurement; None when none was measured."""
    from meshnet_gguf.prepare.pipeline import NodeSetupError, prepare_launch

    if settings.gguf is None and not settings.demo:
        return None
    try:
        choice = prepare_launch(settings, dry_run=True, measure=measure).binary_choice
    except NodeSetupError:
        return None
    return choice.chosen.path if choice is not None and choice.by_measurement else None


def _check_worker_args(ctx: typer.Context, args: Sequence[str]) -> None:
    """Parse `args` as `meshnet-gguf worker` would: a bad option fails now, not at the first boot."""
    _sibling_command(ctx, "worker").make_context("worker", list(args), parent=ctx)


def _apply_or_exit(plan: ServicePlan, warning_label: str) -> None:
    """Carry out `plan`; a failure is printed and exits the command with EXIT_SERVICE_ERROR."""
    from meshnet_gguf.ops.unit import ServiceError, apply_plan

    try:
        apply_plan(plan)
    except (ServiceError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_SERVICE_ERROR) from exc
    for warning in plan.warnings:
        typer.echo(f"{warning_label}: {warning}", err=True)


def register(app: typer.Typer) -> None:
    service_app = typer.Typer(
        help="Run the node as a systemd service.\n\nIt starts at boot, reports readiness, has a watchdog and drains on stop.",
        no_args_is_help=True,
    )

    @service_app.command(
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
        epilog="Any `serve` option may follow, e.g.: service install --gguf owner/name:Q4_K_M --port 8080",
    )
    def install(
        ctx: typer.Context,
        user: Annotated[bool, typer.Option("--user", help="Install a user unit (systemctl --user) instead of a system one")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the files and commands, change nothing")] = False,
        start: Annotated[bool, typer.Option("--start/--no-start", help="Start the service now (it is enabled at boot either way)")] = True,
        worker: Annotated[bool, typer.Option("--worker", help="Install a pool worker (`worker` options follow) instead of a node")] = False,
    ) -> None:
        """Install the node as a systemd service.

        Writes a systemd unit and a config file for these `serve` settings, then enables it.
        """
        from meshnet_gguf.ops.unit import plan_install
        from meshnet_gguf.ops.worker_unit import plan_worker_install

        settings = None
        try:
            if worker:
                _check_worker_args(ctx, ctx.args)
                plan = plan_worker_install(ctx.args, user_mode=user, start=start)
            else:
                settings = with_the_chosen_llama_server(settings_from_serve_args(ctx, ctx.args), measure=not dry_run)
                plan = plan_install(settings, user_mode=user, start=start)
        except ServeArgsError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        if dry_run:
            typer.echo(plan.describe(settings), nl=False)
            return
        if not user and os.geteuid() != 0:
            typer.echo("error: a system service is installed as root (sudo), or use --user", err=True)
            raise typer.Exit(EXIT_SERVICE_ERROR)
        _apply_or_exit(plan, "warning")
        scope = "--user " if user else ""
        if worker:
            typer.echo(f"installed {plan.layout.unit_path}")
            typer.echo(f"follow it with: journalctl {scope}-u {plan.layout.unit_path.stem} -f")
            return
        typer.echo(f"installed {plan.layout.unit_path} with settings in {plan.layout.config_path}")
        typer.echo(f"follow it with: journalctl {scope}-u meshnet-gguf -f   ·   meshnet-gguf service status{' --user' if user else ''}")

    @service_app.command()
    def uninstall(
        user: Annotated[bool, typer.Option("--user", help="Remove the user unit instead of the system one")] = False,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be removed, change nothing")] = False,
    ) -> None:
        """Stop and remove the service.

        Disables it and removes its unit and config; models and state are kept.
        """
        from meshnet_gguf.ops.unit import plan_uninstall

        plan = plan_uninstall(user_mode=user)
        if dry_run:
            typer.echo(plan.describe(), nl=False)
            return
        _apply_or_exit(plan, "note")
        typer.echo(f"removed {plan.layout.unit_path}")

    @service_app.command()
    def status(
        user: Annotated[bool, typer.Option("--user", help="Ask the user service manager")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Print systemd's view and /health as JSON")] = False,
    ) -> None:
        """Show the service's state and the node's /health.

        What systemd says about the service, and what the node says of itself.
        """
        from meshnet_gguf.ops.unit import ServiceError, ServiceLayout, describe_status, service_status

        layout = ServiceLayout.user() if user else ServiceLayout.system()
        try:
            properties = service_status(layout)
        except ServiceError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_SERVICE_ERROR) from exc
        health = _node_health(*_installed_address(layout.config_path))
        if as_json:
            typer.echo(json.dumps({"systemd": properties, "health": health}, indent=2))
        else:
            typer.echo(describe_status(properties))
            if health is not None:
                typer.echo(f"  health:   {health.get('state')}" + (f" ({health['detail']})" if health.get("detail") else ""))
        if properties.get("ActiveState") != "active":
            raise typer.Exit(3)  # as `systemctl status` does for a unit that is not running

    app.add_typer(service_app, name="service")


def _installed_address(config_path: Path) -> tuple[str, int]:
    """Host and port from the installed config (readable to root and the service user), else defaults."""
    from meshnet_gguf.common.settings import NodeSettings

    defaults = NodeSettings.model_fields
    host, port = str(defaults["host"].default), int(defaults["port"].default)
    try:
        values = tomllib.loads(config_path.read_text())
    except (OSError, ValueError):
        return host, port
    return str(values.get("host", host)), int(values.get("port", port))


def _node_health(host: str, port: int) -> dict[str, Any] | None:
    """The node's /health body (any status), or None when nothing answers."""
    import urllib.error
    import urllib.request

    from meshnet_gguf.common.ports import wildcard_loopback

    host = wildcard_loopback(host) or host
    url = f"http://[{host}]:{port}/health" if ":" in host else f"http://{host}:{port}/health"
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as response:  # noqa: S310 (local URL)
            body = response.read()
    except urllib.error.HTTPError as exc:  # 503 while loading or draining still carries the report
        body = exc.read()
    except (OSError, ValueError):
        return None
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None
