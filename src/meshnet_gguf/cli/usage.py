"""`meshnet-gguf usage`: what the node's ledger holds, and what reached the tracker."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated, Optional

import typer


def register(app: typer.Typer) -> None:
    @app.command()
    def usage(
        state_dir: Annotated[Optional[Path], typer.Option(envvar="MESHNET_STATE_DIR", help="The node's state directory")] = None,
        limit: Annotated[int, typer.Option(help="Show at most this many recent requests")] = 20,
        pending: Annotated[bool, typer.Option("--pending", help="Only receipts the tracker has not acknowledged")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    ) -> None:
        """List recent requests and the usage totals.

        From the node's usage ledger, whether reported to the tracker yet or not.
        """
        from meshnet_gguf.common.settings import default_state_dir
        from meshnet_gguf.mesh.ledger import LEDGER_FILE, UsageLedger

        path = (state_dir or default_state_dir()) / LEDGER_FILE
        if not path.exists():
            # Not an error: a node that has not served with a tracker yet simply has no ledger.
            note = f"no usage ledger at {path} yet: the node writes one when it serves with a tracker"
            typer.echo(json.dumps({"entries": [], "totals": None, "note": note}, indent=2) if as_json else note)
            return
        ledger = UsageLedger(path)
        try:
            entries = ledger.entries_sync(limit, pending_only=pending)
            totals = ledger.totals_sync()
        finally:
            ledger.close()
        if as_json:
            typer.echo(
                json.dumps(
                    {
                        "entries": [
                            {**e.record.model_dump(), "outbox": e.outbox_state, "reported_at": e.reported_at, "rejected": e.rejected}
                            for e in entries
                        ],
                        "totals": {**totals.usage.model_dump(), "reported": totals.reported, "pending": totals.pending, "rejected": totals.rejected},
                    },
                    indent=2,
                )
            )
            return
        typer.echo(f"{'when (UTC)':19}  {'request id':36}  {'prompt':>6}  {'compl':>6}  {'finish':9}  outbox")
        for e in entries:
            when = datetime.datetime.fromtimestamp(e.record.started_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            r = e.record
            typer.echo(f"{when:19}  {r.request_id[:36]:36}  {r.prompt_tokens:6}  {r.completion_tokens:6}  {r.finish_reason:9}  {e.outbox_state}")
        u = totals.usage
        typer.echo(
            f"\n{u.requests} requests, {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
            f"{u.completion_tokens} completion tokens, {u.errors} errors, {u.cancelled} cancelled"
        )
        typer.echo(f"receipts: {totals.reported} reported, {totals.pending} pending, {totals.rejected} rejected by the tracker")
