"""`meshnet-gguf dev ...`: reference services for trying and testing the node locally."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer


dev_app = typer.Typer(help="Reference Meshnet services for local use and tests.", no_args_is_help=True)


@dev_app.command()
def tracker(
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8000,
    state_dir: Annotated[Optional[Path], typer.Option(help="Tracker key and ledger [default: <node state dir>/tracker]")] = None,
    enrolment_secret: Annotated[
        Optional[str], typer.Option(envvar="MESHNET_TRACKER_ENROLMENT_SECRET", help="Nodes must present this to register")
    ] = None,
    heartbeat_interval: Annotated[float, typer.Option(help="Seconds between node heartbeats")] = 10.0,  # protocol.DEFAULT_HEARTBEAT_INTERVAL_S; a literal so --help need not import pydantic (tests/test_cli_startup.py checks they match)
    log_level: Annotated[str, typer.Option(help="Log level")] = "INFO",
) -> None:
    """Run the reference tracker: registers nodes, signs single-hop routes, relays and bills."""
    import uvicorn

    from meshnet_gguf.config import default_state_dir
    from meshnet_gguf.protocol import WELL_KNOWN_PATH
    from meshnet_gguf.reference.tracker import Tracker, TrackerConfig

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per health poll and relayed request would drown the tracker's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = TrackerConfig(
        state_dir=state_dir or default_state_dir() / "tracker",
        enrolment_secret=enrolment_secret,
        heartbeat_interval_s=heartbeat_interval,
    )
    service = Tracker(config)
    url = f"http://{host}:{port}"
    typer.echo(f"tracker public key: {service.public_key_text}")
    typer.echo(f"  (also at {url}{WELL_KNOWN_PATH})")
    typer.echo(f"start a node with: MESHNET_TRACKER_PUBLIC_KEY={service.public_key_text} meshnet-gguf serve --tracker {url} ...")
    # Lifespan on: it runs the health poller and the relay's HTTP client.
    uvicorn.run(service.app(), host=host, port=port, log_level=log_level.lower(), lifespan="on", access_log=False)


def register(app: typer.Typer) -> None:
    app.add_typer(dev_app, name="dev")
