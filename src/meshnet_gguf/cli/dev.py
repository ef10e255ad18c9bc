"""`meshnet-gguf dev ...`: reference services for trying and testing the node locally."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshnet_gguf.config import default_state_dir
from meshnet_gguf.protocol import DEFAULT_HEARTBEAT_INTERVAL_S, WELL_KNOWN_PATH

dev_app = typer.Typer(help="Reference Meshnet services for local use and tests.", no_args_is_help=True)


# The port the README's quick-start node uses; a node meshed beside it takes the next one.
_SUGGESTED_NODE_PORT = 8081


@dev_app.command()
def tracker(
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = 8000,
    state_dir: Annotated[Optional[Path], typer.Option(help="Tracker key and ledger [default: <node state dir>/tracker]")] = None,
    enrolment_secret: Annotated[
        Optional[str],
        typer.Option(
            envvar="MESHNET_TRACKER_ENROLMENT_SECRET",
            help="Nodes must present this to register [default: one generated and kept in the state dir]",
        ),
    ] = None,
    open_enrolment: Annotated[
        bool, typer.Option("--open", help="Let anyone register a node, without an enrolment secret (local experiments)")
    ] = False,
    allow_loopback: Annotated[
        bool, typer.Option(help="Accept nodes advertising loopback URLs (a mesh on this one machine)")
    ] = True,
    allow_private: Annotated[bool, typer.Option(help="Accept nodes advertising private (LAN) addresses")] = False,
    heartbeat_interval: Annotated[float, typer.Option(help="Seconds between node heartbeats")] = DEFAULT_HEARTBEAT_INTERVAL_S,
    log_level: Annotated[str, typer.Option(help="Log level")] = "INFO",
) -> None:
    """Run the reference tracker: registers nodes, signs single-hop routes, relays and bills."""
    import uvicorn

    from meshnet_gguf.reference.node_address import AddressPolicy
    from meshnet_gguf.reference.tracker import (
        MAX_REQUEST_HEADER_BYTES,
        Tracker,
        TrackerConfig,
        load_or_create_enrolment_secret,
    )

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # One line per health poll and relayed request would drown the tracker's own log.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    state = state_dir or default_state_dir() / "tracker"
    secret = None if open_enrolment else (enrolment_secret or load_or_create_enrolment_secret(state))
    config = TrackerConfig(
        state_dir=state,
        enrolment_secret=secret,
        open_enrolment=open_enrolment,
        addresses=AddressPolicy(allow_loopback=allow_loopback, allow_private=allow_private),
        heartbeat_interval_s=heartbeat_interval,
    )
    service = Tracker(config)
    url = f"http://{host}:{port}"
    typer.echo(f"tracker public key: {service.public_key_text}  (also at {url}{WELL_KNOWN_PATH})")
    if secret is None:
        typer.echo("enrolment: OPEN (--open): anyone who can reach this tracker may register a node")
    else:
        typer.echo("enrolment: nodes must present the enrolment secret (MESHNET_ENROLMENT_SECRET in the line below)")
    allowed = [kind for kind, on in (("loopback", allow_loopback), ("private", allow_private)) if on]
    typer.echo(f"node addresses: public{''.join(', ' + kind for kind in allowed)} allowed"
               + (" (loopback is for a mesh on this machine)" if allow_loopback else ""))
    env = f"MESHNET_TRACKER_PUBLIC_KEY={service.public_key_text}" + (f" MESHNET_ENROLMENT_SECRET={secret}" if secret else "")
    typer.echo("start a node with:")
    typer.echo(f"  {env} meshnet-gguf serve --tracker {url} --port {_SUGGESTED_NODE_PORT} --demo")
    # Lifespan on: it runs the health poller and the relay's HTTP client. h11 bounds the request
    # head it buffers (httptools takes any size); the app refuses oversized headers either way.
    uvicorn.run(
        service.app(), host=host, port=port, log_level=log_level.lower(), lifespan="on", access_log=False,
        http="h11", h11_max_incomplete_event_size=MAX_REQUEST_HEADER_BYTES,
    )  # fmt: skip


def register(app: typer.Typer) -> None:
    app.add_typer(dev_app, name="dev")
