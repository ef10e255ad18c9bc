"""`meshnet-gguf ps`: the models a running node serves now: state, process, memory, idle time, requests.

It reads the node's `/status.json` on its own listener (the address and key from the node's settings: flags,
`MESHNET_*`, the TOML file), as the operator's page does: loopback needs no more, a standalone node with an
API key wants it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Optional

import typer

# A node on this machine answers its status in milliseconds; longer means it is not there.
PS_TIMEOUT_S = 5.0
# Exit status when no node answers at the address (as `service status` says a unit is not running).
EXIT_NO_NODE = 3
# RSS: what the model's llama-server holds in RAM now; PLANNED: its share of memory in the launch plan (GPU included).
_COLUMNS = ("MODEL", "STATE", "PINNED", "PID", "RSS", "PLANNED", "IDLE", "REQUESTS", "LOADS")


def register(app: typer.Typer) -> None:
    @app.command()
    def ps(
        host: Annotated[Optional[str], typer.Option(help="The node's address (default: its settings')")] = None,
        port: Annotated[Optional[int], typer.Option(help="The node's port (default: its settings')")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print the node's models as JSON")] = False,
    ) -> None:
        """List the models a running node serves.

        Each model with its state (loaded now or not), process, memory, idle time and requests.
        """
        from meshnet_gguf.common.settings import NodeSettings

        settings = NodeSettings()
        document = node_status(host or settings.host, port or settings.port, settings.api_key)
        if document is None:
            typer.echo(f"error: no node answers at {host or settings.host}:{port or settings.port}", err=True)
            raise typer.Exit(EXIT_NO_NODE)
        models = document.get("models")
        if not isinstance(models, list):
            health = document.get("health") or {}
            models = [{"alias": health.get("model"), "state": health.get("state"), "pinned": True}]
        if as_json:
            typer.echo(json.dumps(models, indent=2))
            return
        typer.echo(models_table(models))


def node_status(host: str, port: int, api_key: str | None) -> dict[str, Any] | None:
    """The node's `/status.json`, or None when nothing answers there (an error status is said as an Exit)."""
    import urllib.error
    import urllib.request

    from meshnet_gguf.common.ports import wildcard_loopback

    host = wildcard_loopback(host) or host
    url = f"http://[{host}]:{port}/status.json" if ":" in host else f"http://{host}:{port}/status.json"
    request = urllib.request.Request(url, headers={"authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=PS_TIMEOUT_S) as response:  # noqa: S310 (the node's own address)
            body = response.read()
    except urllib.error.HTTPError as exc:
        typer.echo(f"error: the node at {host}:{port} answered {exc.code}: {exc.read()[:300].decode(errors='replace')}", err=True)
        raise typer.Exit(2) from None
    except (OSError, ValueError):
        return None
    parsed = json.loads(body)
    return parsed if isinstance(parsed, dict) else None


def models_table(models: list[dict[str, Any]]) -> str:
    """One row per model, columns aligned; a failed model's reason under its row."""
    rows = [_COLUMNS]
    errors: list[str] = []
    for model in models:
        rows.append(
            (
                str(model.get("alias")),
                str(model.get("state")),
                "yes" if model.get("pinned") else "no",
                str(model.get("pid") or "-"),
                _bytes(model.get("rss_bytes")),
                _bytes(model.get("memory_bytes")),
                _seconds(model.get("idle_s")),
                str(model.get("requests") if model.get("requests") is not None else "-"),
                str(model.get("loads") if model.get("loads") is not None else "-"),
            )
        )
        if model.get("error"):
            errors.append(f"{model.get('alias')}: {str(model['error']).splitlines()[0]}")
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines + errors)


def _bytes(value: object) -> str:
    from meshnet_gguf.common.units import format_bytes

    return format_bytes(value) if isinstance(value, int) else "-"


def _seconds(value: object) -> str:
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value:.0f} s" if value < 120 else f"{value / 60:.0f} min"
