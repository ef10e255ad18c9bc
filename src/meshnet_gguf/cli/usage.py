"""`meshnet-gguf usage`: what the node served, from its state dir: the ledger of a node that served with a
tracker (and what reached the tracker), the journal of one that served standalone, or both."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

# The outbox column of a request a standalone node served: no tracker, so no receipt to report.
STANDALONE_OUTBOX = "standalone"


def register(app: typer.Typer) -> None:
    @app.command()
    def usage(
        state_dir: Annotated[Optional[Path], typer.Option(envvar="MESHNET_STATE_DIR", help="The node's state directory")] = None,
        limit: Annotated[int, typer.Option(help="Show at most this many recent requests")] = 20,
        pending: Annotated[bool, typer.Option("--pending", help="Only receipts the tracker has not acknowledged")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
    ) -> None:
        """List recent requests and the usage totals.

        Standalone requests from the node's usage journal; requests served with a tracker from its
        ledger, whether reported to the tracker yet or not.
        """
        from meshnet_gguf.common.settings import default_state_dir
        from meshnet_gguf.contract.protocol import UsageTotals
        from meshnet_gguf.mesh.ledger import LEDGER_FILE, UsageLedger
        from meshnet_gguf.serving.usage_journal import USAGE_JOURNAL_FILE, read_journal

        if limit < 0:
            typer.echo("error: --limit must be 0 or more", err=True)
            raise typer.Exit(2)
        root = state_dir or default_state_dir()
        ledger_path = root / LEDGER_FILE
        rows: list[tuple[Any, dict[str, Any]]] = []  # (UsageRecord, its outbox state and the ledger's fields)
        totals = UsageTotals()
        receipts: dict[str, int] | None = None
        unreadable = 0
        if ledger_path.exists():
            ledger = UsageLedger(ledger_path)
            try:
                entries = ledger.entries_sync(limit, pending_only=pending)
                ledger_totals = ledger.totals_sync()
            finally:
                ledger.close()
            rows += [(e.record, {"outbox": e.outbox_state, "reported_at": e.reported_at, "rejected": e.rejected}) for e in entries]
            _add(totals, ledger_totals.usage)
            receipts = {"reported": ledger_totals.reported, "pending": ledger_totals.pending, "rejected": ledger_totals.rejected}
        journal = None if pending else read_journal(root, limit)
        if journal is not None:
            rows += [(record, {"outbox": STANDALONE_OUTBOX}) for record in journal.latest]
            _add(totals, journal.totals)
            unreadable = journal.unreadable_lines
        if receipts is None and journal is None and not (pending and (root / USAGE_JOURNAL_FILE).exists()):
            # Not an error: a node that has not served a request yet has recorded nothing.
            note = f"no usage recorded in {root} yet: a node keeps it there once it has served a request"
            typer.echo(json.dumps({"entries": [], "totals": None, "note": note}, indent=2) if as_json else note)
            return
        rows.sort(key=lambda row: row[0].started_at, reverse=True)
        rows = rows[:limit]
        if as_json:
            document = {
                "entries": [{**record.model_dump(), **kept_fields} for record, kept_fields in rows],
                "totals": {**totals.model_dump(), **(receipts or {"reported": 0, "pending": 0, "rejected": 0})},
            }
            if unreadable:
                document["unreadable_journal_lines"] = unreadable
            typer.echo(json.dumps(document, indent=2))
            return
        typer.echo(f"{'when (UTC)':19}  {'request id':36}  {'prompt':>6}  {'compl':>6}  {'finish':9}  outbox")
        for r, kept_fields in rows:
            outbox = kept_fields["outbox"]
            when = datetime.datetime.fromtimestamp(r.started_at, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            typer.echo(f"{when:19}  {r.request_id[:36]:36}  {r.prompt_tokens:6}  {r.completion_tokens:6}  {r.finish_reason:9}  {outbox}")
        u = totals
        typer.echo(
            f"\n{u.requests} requests, {u.prompt_tokens} prompt tokens ({u.cached_tokens} cached), "
            f"{u.completion_tokens} completion tokens, {u.errors} errors, {u.cancelled} cancelled"
        )
        if receipts is not None:
            typer.echo(
                f"receipts: {receipts['reported']} reported, {receipts['pending']} pending, {receipts['rejected']} rejected by the tracker"
            )
        if journal is not None:
            typer.echo(f"standalone requests: {journal.totals.requests}, from {root / USAGE_JOURNAL_FILE}")
        if unreadable:
            typer.echo(f"warning: {unreadable} line(s) of the journal could not be read (cut by a full disk?) and are not counted")


def _add(totals: Any, more: Any) -> None:
    for field in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "cancelled"):
        setattr(totals, field, getattr(totals, field) + getattr(more, field))
