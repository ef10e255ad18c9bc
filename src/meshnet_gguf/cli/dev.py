"""`meshnet-gguf dev ...`: reference services for trying and testing the node locally."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from meshnet_gguf.common.gc_pauses import freeze_startup_objects

dev_app = typer.Typer(help="Reference Meshnet services for local use and tests.", no_args_is_help=True)

DEFAULT_TRACKER_PORT = 8000
DEFAULT_RELAY_PORT = 8001


# The port the README's quick-start node uses; a node meshed beside it takes the next one.
_SUGGESTED_NODE_PORT = 8081


@dev_app.command()
def tracker(
    host: Annotated[str, typer.Option(help="Address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = DEFAULT_TRACKER_PORT,
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
    allow_loopback: Annotated[bool, typer.Option(help="Accept nodes advertising loopback URLs (a mesh on this one machine)")] = True,
    allow_private: Annotated[bool, typer.Option(help="Accept nodes advertising private (LAN) addresses")] = False,
    heartbeat_interval: Annotated[
        float, typer.Option(help="Seconds between node heartbeats")
    ] = 10.0,  # protocol.DEFAULT_HEARTBEAT_INTERVAL_S; a literal so --help need not import pydantic (tests/cli/test_cli_startup.py checks they match)
    health_poll_interval: Annotated[Optional[float], typer.Option(help="Seconds between health polls of each node [default: 5]")] = None,
    verifier: Annotated[
        Optional[list[str]],
        typer.Option(
            help="MODEL=URL: a node this tracker trusts to audit answers of MODEL, run with serve --verifier (repeatable; none: no audits)"
        ),
    ] = None,
    audit_rate: Annotated[float, typer.Option(help="Fraction of settled answers audited (new nodes: 0.25 of their first 50)")] = 0.03,
    log_level: Annotated[str, typer.Option(help="Log level")] = "INFO",
) -> None:
    """Run the reference tracker.

    It registers nodes, signs single-hop routes, forwards requests and bills them.
    """
    import uvicorn

    from meshnet_gguf.common.settings import default_state_dir
    from meshnet_gguf.contract.protocol import WELL_KNOWN_PATH
    from meshnet_gguf.reference.tracker.node_address import AddressPolicy
    from meshnet_gguf.reference.tracker.app import Tracker
    from meshnet_gguf.reference.tracker.config import TrackerConfig
    from meshnet_gguf.reference.tracker.enrolment import ENROLMENT_SECRET_FILE, load_or_create_enrolment_secret
    from meshnet_gguf.reference.tracker.request_io import MAX_REQUEST_HEADER_BYTES

    _configure_logging(log_level)
    extra: dict[str, object] = {} if health_poll_interval is None else {"health_poll_interval_s": health_poll_interval}
    if verifier:
        from meshnet_gguf.reference.tracker.audits import AuditPolicy

        named = [item.split("=", 1) for item in verifier]
        if any(len(pair) != 2 or not all(pair) for pair in named):
            raise typer.BadParameter("--verifier takes MODEL=URL")
        extra.update(verifiers=dict(named), audit_policy=AuditPolicy(rate=audit_rate))  # type: ignore[arg-type]
    state = state_dir or default_state_dir() / "tracker"
    secret_path = state / ENROLMENT_SECRET_FILE
    generated_now = not open_enrolment and not enrolment_secret and not secret_path.exists()
    secret = None if open_enrolment else (enrolment_secret or load_or_create_enrolment_secret(state))
    config = TrackerConfig(
        state_dir=state,
        enrolment_secret=secret,
        open_enrolment=open_enrolment,
        addresses=AddressPolicy(allow_loopback=allow_loopback, allow_private=allow_private),
        heartbeat_interval_s=heartbeat_interval,
        **extra,  # type: ignore[arg-type]
    )
    service = Tracker(config)
    url = f"http://{host}:{port}"
    typer.echo(f"tracker public key: {service.public_key_text}  (also at {url}{WELL_KNOWN_PATH})")
    if secret is None:
        typer.echo("enrolment: OPEN (--open): anyone who can reach this tracker may register a node")
    elif enrolment_secret:
        typer.echo("enrolment: nodes must present the enrolment secret you gave this tracker (not printed)")
    else:
        typer.echo(f"enrolment: nodes must present the enrolment secret kept in {secret_path} (mode 0600)")
    allowed = [kind for kind, on in (("loopback", allow_loopback), ("private", allow_private)) if on]
    typer.echo(
        f"node addresses: public{''.join(', ' + kind for kind in allowed)} allowed"
        + (" (loopback is for a mesh on this machine)" if allow_loopback else "")
    )
    # A secret is printed at most once: when it was made just now and the output is a terminal, not a log.
    if secret is None:
        shown = ""
    elif enrolment_secret:
        shown = " MESHNET_ENROLMENT_SECRET=<the secret you set>"
    elif generated_now and sys.stdout.isatty():
        shown = f" MESHNET_ENROLMENT_SECRET={secret}"
        typer.echo(f"a new enrolment secret was made and stored in {secret_path}; it is shown below this once")
    else:
        shown = f' MESHNET_ENROLMENT_SECRET="$(cat {secret_path})"'
    env = f"MESHNET_TRACKER_PUBLIC_KEY={service.public_key_text}" + shown
    typer.echo("start a node with:")
    typer.echo(f"  {env} meshnet-gguf serve --tracker {url} --port {_SUGGESTED_NODE_PORT} --demo")
    # Lifespan on: it runs the health poller and the relay's HTTP client. The node's httptools
    # protocol bounds the request head it buffers (and costs a streamed event far less than h11,
    # which bounds it too); the app refuses oversized headers either way.
    from meshnet_gguf.serving import http_server

    guarded = getattr(http_server, "GuardedHttpToolsProtocol", None)
    freeze_startup_objects()
    uvicorn.run(
        service.app(), host=host, port=port, log_level=log_level.lower(), lifespan="on", access_log=False, log_config=None,
        http=guarded or "h11", h11_max_incomplete_event_size=MAX_REQUEST_HEADER_BYTES,
    )  # fmt: skip


@dev_app.command()
def relay(
    host: Annotated[str, typer.Option(help="Address to listen on (nodes and trackers both dial it)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on")] = DEFAULT_RELAY_PORT,
    ping_interval: Annotated[
        float, typer.Option(help="Seconds between a node's pings (at most 20)", max=20)
    ] = 10.0,  # relay_wire.RELAY_PING_INTERVAL_S, a literal for the same reason (checked by the same test)
    max_idle_work: Annotated[Optional[int], typer.Option(help="Idle work connections kept per node [default: 16]", min=1)] = None,
    trust_tracker_key: Annotated[
        Optional[list[str]],
        typer.Option("--trust-tracker-key", help="Public key of a tracker whose CONNECT tokens this relay honours (repeatable)"),
    ] = None,
    open_relay: Annotated[bool, typer.Option("--open", help="Trust no tracker: anyone may CONNECT and attach (local experiments)")] = False,
    public_url: Annotated[
        Optional[str], typer.Option(help="The URL nodes and trackers know this relay by [default: http://HOST:PORT]")
    ] = None,
    tls_certificate: Annotated[Optional[Path], typer.Option(help="Serve https: PEM certificate chain for the relay's host name")] = None,
    tls_key: Annotated[Optional[Path], typer.Option(help="The key of --tls-certificate (PEM)")] = None,
    ipv4_network_prefix: Annotated[
        int, typer.Option(help="Count IPv4 sources per this prefix: 32 (one address) or 24 (a hosting range); IPv6 counts per /64")
    ] = 32,  # relay_networks.DEFAULT_IPV4_NETWORK_PREFIX; RelayConfig refuses anything but 32 or 24
    stranger_tries_per_s: Annotated[
        Optional[float],
        typer.Option(
            help="Relay-wide connections a second from networks no trusted tracker or admitted node uses (new nodes and"
            " floods alike; a burst of 8 s of it); raise it to admit many new nodes at once [default: 128]",
            min=0.01,
        ),
    ] = None,
    state_dir: Annotated[
        Optional[Path], typer.Option(help="Where the relay remembers the nodes trackers admitted [default: <node state dir>/relay]")
    ] = None,
    log_level: Annotated[str, typer.Option(help="Log level")] = "INFO",
) -> None:
    """Run the reference relay for nodes behind NAT.

    Nodes dial in; trackers reach them with CONNECT <node_id>:443.
    """
    import anyio

    from meshnet_gguf.contract.signing import KeyFormatError, parse_public_key
    from meshnet_gguf.reference.relay.server import Relay
    from meshnet_gguf.reference.relay.config import RelayConfig, relay_stranger_burst
    from meshnet_gguf.common.settings import default_state_dir
    from meshnet_gguf.common.ports import is_wildcard
    from meshnet_gguf.reference.relay.networks import IPV4_NETWORK_PREFIXES

    keys = tuple(trust_tracker_key or ())
    if bool(keys) == open_relay:
        typer.echo("error: give --trust-tracker-key KEY (the tracker prints it at start), or --open", err=True)
        raise typer.Exit(2)
    if is_wildcard(host) and not public_url:
        # Attach proofs and CONNECT tokens name the relay by the URL nodes dial; a wildcard address is no such URL.
        typer.echo(f"error: listening on {host or 'every address'}, give --public-url (the URL nodes and trackers dial)", err=True)
        raise typer.Exit(2)
    for key in keys:
        try:
            parse_public_key(key)
        except KeyFormatError as exc:
            typer.echo(f"error: --trust-tracker-key {key!r}: {exc}", err=True)
            raise typer.Exit(2) from exc
    if ipv4_network_prefix not in IPV4_NETWORK_PREFIXES:
        typer.echo(f"error: --ipv4-network-prefix must be one of {', '.join(map(str, IPV4_NETWORK_PREFIXES))}", err=True)
        raise typer.Exit(2)
    _configure_logging(log_level)
    extra: dict[str, object] = {} if max_idle_work is None else {"max_idle_work": max_idle_work}
    if stranger_tries_per_s is not None:
        extra["relay_stranger_connections_per_s"] = stranger_tries_per_s
        extra["relay_stranger_connection_burst"] = relay_stranger_burst(stranger_tries_per_s)
    config = RelayConfig(
        host=host, port=port, ping_interval_s=ping_interval, ping_timeout_s=ping_interval,
        trusted_tracker_keys=keys, public_url=public_url, **extra,  # type: ignore[arg-type]
        tls_certificate_file=str(tls_certificate) if tls_certificate else None, tls_key_file=str(tls_key) if tls_key else None,
        ipv4_network_prefix=ipv4_network_prefix, state_dir=str(state_dir or default_state_dir() / "relay"),
    )  # fmt: skip
    url = public_url or f"{'https' if tls_certificate else 'http'}://{host}:{port}"
    typer.echo(f"relay on {url}: start a node with meshnet-gguf serve --relay {url} ...")
    if keys:
        typer.echo(f"CONNECT and tunnels: only for {len(keys)} trusted tracker key(s)")
    else:
        typer.echo("CONNECT and tunnels: OPEN (--open): anyone who reaches this relay may use it")
    # SIGTERM (systemd, `dev mesh`, kill) stops it as Ctrl-C does, exiting 0 like the tracker and the node.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        relay_service = Relay(config)
        freeze_startup_objects()
        anyio.run(relay_service.serve, backend_options={"use_uvloop": importlib.util.find_spec("uvloop") is not None})
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        typer.echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
        raise typer.Exit(2) from exc


def _configure_logging(log_level: str) -> None:
    """The node's log format for the reference services and uvicorn's lines too (one handler on the root logger).

    `MESHNET_LOG_FORMAT` chooses as it does for the node: text at a terminal, JSON lines under systemd.
    It also quiets httpx: a line per health poll and forwarded request would drown the tracker's own log.
    """
    from meshnet_gguf.common.logs import configure_logging

    chosen = os.environ.get("MESHNET_LOG_FORMAT", "auto")
    configure_logging(chosen if chosen in ("auto", "text", "json") else "auto", log_level.upper())  # type: ignore[arg-type]


@dev_app.command()
def mesh(
    demo: Annotated[bool, typer.Option("--demo", help="Serve the demo model (gemma-3-270m, `demo` extra)")] = False,
    gguf: Annotated[Optional[str], typer.Option(help="Serve this model instead of the demo")] = None,
    tracker_port: Annotated[
        int, typer.Option(help="Tracker port: the OpenAI base URL clients use (0: any free port)")
    ] = DEFAULT_TRACKER_PORT,
    relay_port: Annotated[int, typer.Option(help="Relay port (0: any free port)")] = DEFAULT_RELAY_PORT,
    state_dir: Annotated[
        Optional[Path], typer.Option(help="Keys, ledgers and logs, kept after exit [default: <node state dir>/mesh]")
    ] = None,
    download_dir: Annotated[Optional[Path], typer.Option(help="Where the node keeps models [default: the node's]")] = None,
) -> None:
    """Run a whole local mesh in one command.

    A tracker, a relay, and a node reachable only through the relay.
    """
    from meshnet_gguf.cli.dev_mesh import run_mesh
    from meshnet_gguf.common.logs import configure_logging
    from meshnet_gguf.common.settings import NodeSettings, default_state_dir
    from meshnet_gguf.prepare.pipeline import NodeSetupError, read_request, runnable_binary

    if demo == (gguf is not None):
        typer.echo("error: give exactly one of --demo or --gguf", err=True)
        raise typer.Exit(2)

    def runnable_llama_server() -> str | None:
        """A llama-server that runs this model here, before anything starts: when one must be built, its
        progress shows on this terminal, not in the node's log behind a timeout."""
        configure_logging("auto", "INFO")
        try:
            settings = NodeSettings(demo=demo, gguf=gguf)
            runnable_binary(settings, read_request(settings).source, dry_run=False)
        except NodeSetupError as exc:
            return str(exc)
        return None

    code = run_mesh(
        before_start=runnable_llama_server,
        model_args=["--demo"] if demo else ["--gguf", str(gguf)],
        tracker_port=tracker_port,
        relay_port=relay_port,
        state_dir=state_dir or default_state_dir() / "mesh",
        download_dir=download_dir,
        echo=typer.echo,
    )
    raise typer.Exit(code)


def register(app: typer.Typer) -> None:
    app.add_typer(dev_app, name="dev")
