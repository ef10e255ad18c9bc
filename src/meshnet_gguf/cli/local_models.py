"""`meshnet-gguf models --local` and `meshnet-gguf rm`: the models on disk, listed and removed.

Argument handling and printing only: the listing is `models/local_models`, what a running node holds
and when each model was last served is `models/in_use`.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

# Exit codes: 2 an operator-fixable refusal (nothing matches, a file in use), 1 the operator said no.
EXIT_REFUSED = 2
EXIT_DECLINED = 1


def local_rows(download_dir: Path, budget_bytes: int | None) -> list[dict[str, Any]]:
    """One dict per model on disk: what `models --local --json` prints and the table shows."""
    from meshnet_gguf.models.in_use import in_use, last_served
    from meshnet_gguf.models.local_models import local_models

    served = last_served(download_dir)
    rows = []
    for m in local_models(download_dir):
        rows.append({
            "model": m.model, "quant": m.quant, "bytes": m.total_bytes, "path": str(m.path), "files": len(m.files),
            "complete": m.complete, "in_use": in_use(m.path), "last_served": served.get(str(m.path)),
            # The weights alone against this box's memory: the plan (`models REPO`, `serve --dry-run`) adds KV and buffers.
            "fits": None if budget_bytes is None else m.total_bytes <= budget_bytes,
        })  # fmt: skip
    return rows


def print_local(download_dir: Path, budget_bytes: int | None, as_json: bool) -> None:
    from meshnet_gguf.common.units import format_bytes

    rows = local_rows(download_dir, budget_bytes)
    if as_json:
        typer.echo(json.dumps({"download_dir": str(download_dir), "models": rows}, indent=2))
        return
    if not rows:
        typer.echo(f"no models in {download_dir} yet: `meshnet-gguf pull MODEL[:QUANT]` fetches one")
        return
    table = [["MODEL", "QUANT", "SIZE", "LAST SERVED", "FITS", "PATH"]]
    for r in rows:
        table.append([
            r["model"], r["quant"], format_bytes(r["bytes"]), _served_cell(r),
            "?" if r["fits"] is None else ("yes" if r["fits"] else "no"), r["path"],
        ])  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        typer.echo("  ".join(cell.rjust(w) if i == 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip())
    typer.echo(f"\nin {download_dir}; FITS = its weights fit this box's memory (`models REPO` shows the whole plan)")


def _served_cell(row: dict[str, Any]) -> str:
    if row["in_use"]:
        return "now (a node runs it)"
    if row["last_served"] is None:
        return "never" if row["complete"] else "-"
    return datetime.datetime.fromtimestamp(row["last_served"]).strftime("%Y-%m-%d %H:%M")


def register(app: typer.Typer) -> None:
    @app.command("rm")
    def remove(
        model: Annotated[
            str, typer.Argument(help="MODEL[:QUANT] as `models --local` lists it (owner/name or a catalog id); every quant without :QUANT")
        ],
        download_dir: Annotated[Optional[Path], typer.Option(help="Where the models are")] = None,
        yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove without asking")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (needs --yes: nothing to ask)")] = False,
    ) -> None:
        """Remove a downloaded model from disk.

        Never a file a running node serves: each node holds a lock on its model's files.
        """
        from meshnet_gguf.common.settings import NodeSettings
        from meshnet_gguf.common.units import format_bytes
        from meshnet_gguf.models.catalog import load_catalog
        from meshnet_gguf.models.in_use import exclusively_held
        from meshnet_gguf.models.local_models import local_models, matching

        settings = NodeSettings(**({"download_dir": download_dir} if download_dir else {}))
        root = settings.download_dir
        if as_json and not yes:
            _refuse("--json removes without asking: add --yes", as_json=False)
        found = matching(local_models(root), model, load_catalog())
        if not found:
            _refuse(f"no model {model!r} in {root}: `meshnet-gguf models --local` lists what is there", as_json)
        total = sum(m.total_bytes for m in found)
        if not yes:
            for m in found:
                typer.echo(
                    f"  {m.spec}  {format_bytes(m.total_bytes)}  {m.path}" + (f" (+{len(m.files) - 1} shards)" if len(m.files) > 1 else "")
                )
            if not typer.confirm(f"remove {len(found)} model file set(s), {format_bytes(total)}?", default=False):
                typer.echo("nothing removed")
                raise typer.Exit(EXIT_DECLINED)
        files = [f for m in found for f in m.files]
        # Held exclusively from the check to the last unlink: no node can take the files in between.
        with exclusively_held(files) as free:
            if not free:
                busy = [m.spec for m in found if _busy(m.files)]
                _refuse(f"{', '.join(busy) or model} is in use by a running node: stop it first; nothing removed", as_json)
            for f in files:
                f.unlink(missing_ok=True)
        _prune_empty(found, root)
        if as_json:
            typer.echo(json.dumps({"removed": [{"model": m.model, "quant": m.quant, "bytes": m.total_bytes,
                                                "files": [str(f) for f in m.files]} for m in found], "bytes": total}, indent=2))  # fmt: skip
        else:
            typer.echo(f"removed {', '.join(m.spec for m in found)}: {format_bytes(total)} freed")


def _busy(files: tuple[Path, ...]) -> bool:
    from meshnet_gguf.models.in_use import exclusively_held

    with exclusively_held(list(files)) as free:
        return not free


def _prune_empty(removed: list[Any], root: Path) -> None:
    """Folders the removal emptied (a quant's folder, the repo's), up to the download dir; bookkeeping stays."""
    for m in removed:
        folder = m.path.parent
        while folder != root and root in folder.parents:
            try:
                folder.rmdir()  # only when empty
            except OSError:
                break
            folder = folder.parent


def _refuse(message: str, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"error": message}))
    else:
        typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_REFUSED)
