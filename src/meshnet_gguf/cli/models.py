"""`meshnet-gguf pull` (also `download`) and `meshnet-gguf models`: argument handling and printing only."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

if TYPE_CHECKING:
    from meshnet_gguf.common.settings import NodeSettings
    from meshnet_gguf.prepare.quant_table import ModelSize

DOWNLOAD_DIR_HELP = "Where GGUF files go, under owner/name/ with their original names"
# Exit code for an operator-fixable problem (unknown model, no space, gated...), as `serve` uses.
EXIT_SETUP_ERROR = 2


def _settings(**flags: Any) -> NodeSettings:
    """Flags the operator gave win; the rest comes from `MESHNET_*` env and the config file."""
    from meshnet_gguf.common.settings import NodeSettings

    return NodeSettings(**{k: v for k, v in flags.items() if v is not None and v is not False})


def _configure_logging(settings: NodeSettings) -> None:
    from meshnet_gguf.common.logs import configure_logging

    configure_logging(settings.log_format, settings.log_level)


def _table(rows: list[list[str]], right: set[int] = frozenset()) -> str:  # type: ignore[assignment]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in rows
    )


def register(app: typer.Typer) -> None:
    # `pull` as Ollama's habit names it; `download`, its first name, stays an alias.
    @app.command("pull")
    @app.command("download", hidden=True)
    def download(
        model: Annotated[str, typer.Argument(help="HF repo owner/name[:QUANT], catalog id, or a local file/directory to verify")],
        quant: Annotated[Optional[str], typer.Option(help="Quant to fetch, e.g. UD-IQ3_XXS")] = None,
        download_dir: Annotated[Optional[Path], typer.Option(help=DOWNLOAD_DIR_HELP)] = None,
        offline: Annotated[bool, typer.Option("--offline", help="Only check what is already on disk")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (the progress bar still goes to stderr)")] = False,
    ) -> None:
        """Download and verify a model, without serving it.

        Also `meshnet-gguf download`, its first name.

        The download resumes where it stopped and is checked against the hub's sha256.
        """
        from meshnet_gguf.hardware.report import machine_budget_bytes
        from meshnet_gguf.models.source import ModelResolutionError, resolve_model

        settings = _settings(gguf=model, quant=quant, download_dir=download_dir, offline=offline)
        _configure_logging(settings)
        try:
            resolved = resolve_model(settings, progress=True, budget=machine_budget_bytes)
        except ModelResolutionError as exc:
            if as_json:
                import json

                typer.echo(json.dumps({"error": str(exc)}))
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_SETUP_ERROR) from exc
        from meshnet_gguf.common.units import format_bytes

        if as_json:
            import json

            typer.echo(json.dumps({
                "model": resolved.label, "repo": resolved.repo_id, "quant": resolved.quant, "bytes": resolved.total_bytes,
                "files": [str(f) for f in resolved.shards], "verified": resolved.verified,
            }, indent=2))  # fmt: skip
            return
        check = "sha256 verified" if resolved.verified else "header checked (no published sha256 to verify against)"
        typer.echo(f"ready: {resolved.label}: {format_bytes(resolved.total_bytes)} in {len(resolved.shards)} file(s), {check}")
        typer.echo(f"first shard: {resolved.first_shard}")

    @app.command()
    def models(
        repo: Annotated[Optional[str], typer.Argument(help="A repo id, catalog id or directory to list quants of")] = None,
        download_dir: Annotated[Optional[Path], typer.Option(help=DOWNLOAD_DIR_HELP)] = None,
        offline: Annotated[bool, typer.Option("--offline", help="Use the listing saved by the last download")] = False,
        llama_server: Annotated[Optional[Path], typer.Option(help="llama-server binary (for the 'featured' check)")] = None,
        pool_worker: Annotated[
            Optional[list[str]], typer.Option(help="Pool worker HOST:PORT[=BUDGET] (repeatable): which quants the pool can load")
        ] = None,
        state_dir: Annotated[Optional[Path], typer.Option(help="Node state dir (its key reads the pool workers' status)")] = None,
        local: Annotated[bool, typer.Option("--local", help="The models on disk: quant, size, path, last served, whether it fits")] = False,
        as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output (with --local)")] = False,
    ) -> None:
        """List the catalog, a repo's quants, or local models.

        `--local` lists what is on disk instead of the catalog.

        Each with its size and what the launch plan needs on this box (weights, KV cache
        for the planned context, compute buffers, and the prompt cache on top).
        """
        from meshnet_gguf.common.units import format_bytes
        from meshnet_gguf.hardware.report import probe_configured
        from meshnet_gguf.llama.binary import local_llama_server
        from meshnet_gguf.models.catalog import load_catalog
        from meshnet_gguf.models.download import HubAccess
        from meshnet_gguf.models.source import ModelResolutionError
        from meshnet_gguf.prepare.plan import OperatorChoiceError, OperatorChoices
        from meshnet_gguf.prepare.quant_table import PlanRefused, catalog_quant_tables, listed_quant_table

        settings = _settings(
            download_dir=download_dir, offline=offline, llama_server=llama_server, pool_workers=pool_worker, state_dir=state_dir
        )
        binary = local_llama_server(settings.llama_server)
        try:
            hardware = probe_configured(binary, settings.hardware_fixture)
            operator = OperatorChoices.read(
                parallel=settings.parallel, ctx_size=settings.ctx_size, n_gpu_layers=settings.n_gpu_layers,
                llama_args=settings.llama_args,
            )  # fmt: skip
        except FileNotFoundError as exc:
            typer.echo(f"error: hardware_fixture (MESHNET_HARDWARE_FIXTURE): {exc}", err=True)
            raise typer.Exit(EXIT_SETUP_ERROR) from exc
        except OperatorChoiceError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_SETUP_ERROR) from exc
        capacity = hardware.capacity()
        if local:
            from meshnet_gguf.cli.local_models import print_local

            print_local(settings.download_dir, int(capacity.total_bytes), as_json)
            return
        if as_json:
            typer.echo("error: --json goes with --local (the catalog and repo tables are for reading)", err=True)
            raise typer.Exit(EXIT_SETUP_ERROR)
        pool_fits = _pool_fit(settings, binary, capacity)
        catalog = load_catalog()
        memory_line = (
            f"memory here: {capacity.describe()}\n"
            "NEEDS = weights + KV cache for CONTEXT tokens + compute buffers, as `serve` plans the launch on this box; "
            "CACHE = RAM the plan gives the prompt cache on top; >= marks a minimum (no plan: model shape unknown)"
        )
        try:
            if repo is not None:
                access = HubAccess.from_environment(offline=settings.offline)
                table = listed_quant_table(repo, settings.download_dir, access, catalog, hardware, operator, binary)
            else:
                tables = catalog_quant_tables(catalog, hardware, operator, binary)
        except (ModelResolutionError, PlanRefused) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_SETUP_ERROR) from exc

        if repo is not None:
            rows = [["QUANT", "SIZE", "SHARDS", "NEEDS", "CONTEXT", "CACHE", "FITS", "FILE"]]
            for row in table.rows:
                q = row.quant
                shards = str(q.shards) if q.complete else f"{q.shards} (incomplete)"
                rows.append([q.name, format_bytes(q.total_bytes), shards, *_cells(row.size), q.first_file])
            typer.echo(f"{table.offer.title} ({table.offer.source})")
            typer.echo(_table(rows, right={1, 2, 3, 4, 5}) if table.rows else "no GGUF models found")
            kv = "" if table.shape_known else "\n(KV cache unknown until downloaded: not counted)"
            typer.echo(f"\n{memory_line}{kv}")
            return

        rows = [["ID", "FEATURED", "QUANT", "SIZE", "SHARDS", "NEEDS", "CONTEXT", "CACHE", "FITS", *(["POOL"] if pool_fits else [])]]
        for entry, table in tables:
            # Featured: a llama-server is here and the plan fits at least one quant on this box.
            is_featured = binary is not None and any(row.size.fits for row in table.rows)
            for i, (q, row) in enumerate(zip(entry.quants, table.rows)):
                first = i == 0
                pooled = [_pool_cell(pool_fits, entry, q, row.size)] if pool_fits else []
                rows.append([
                    entry.id if first else "", ("yes" if is_featured else "no") if first else "",
                    q.name, format_bytes(q.total_bytes), str(q.shards), *_cells(row.size), *pooled,
                ])  # fmt: skip
        typer.echo(_table(rows, right={3, 4, 5, 6, 7}))
        if pool_fits:
            typer.echo(f"\nPOOL = the pooled plan holds it: {pool_fits.describe}")
        found = f"llama-server {binary.describe()}" if binary is not None else "no llama-server found"
        typer.echo(f"\n{memory_line}\n{found}")
        typer.echo("featured = a llama-server is available and at least one quant fits this machine")


def _cells(size: ModelSize) -> list[str]:
    """NEEDS, CONTEXT, CACHE and FITS of one quant, as the launch plan figures them."""
    from meshnet_gguf.common.units import format_bytes

    need = f"{'>=' if size.minimum else ''}{format_bytes(size.need_bytes)}"
    cache = format_bytes(size.prompt_cache_bytes) if size.prompt_cache_bytes else "-"
    return [need, str(size.ctx_size or "?"), cache, "yes" if size.fits else "no"]


class _PoolFit:
    """Which sizes the pool can hold, by the pooled plan's own test (`prepare.pool.pool_holds`)."""

    def __init__(self, members: Any, local_device: str | None, local_budget: int) -> None:
        from meshnet_gguf.common.units import format_bytes
        from meshnet_gguf.prepare.pool import worker_name

        self.members, self.local_device, self.local_budget = members, local_device, local_budget
        parts = [f"{worker_name(i)} {format_bytes(m.budget_bytes)}" for i, m in enumerate(members)]
        parts.append(
            f"this node's GPU {format_bytes(local_budget)}" if local_device else "this node's GPU: none (every layer on the workers)"
        )
        self.describe = ", ".join(parts)

    def __call__(self, weights_and_kv: int) -> bool:
        from meshnet_gguf.prepare.pool import pool_holds

        return pool_holds(self.members, self.local_device, self.local_budget, weights_and_kv)


def _pool_cell(pool_fits: _PoolFit, entry: Any, quant: Any, size: Any) -> str:
    """yes/no: the pooled plan holds this quant's weights and the KV cache of the context `serve` would plan
    (the figure `serve --pool-worker` places); `?` where the catalog has no shape to count the KV from."""
    from meshnet_gguf.prepare.memory import ModelFacts

    if entry.shape is None:
        return "?"
    facts = ModelFacts.from_catalog(entry, quant)
    to_place = facts.total_bytes + int(facts.kv_bytes_per_token() * (size.ctx_size or facts.context_length))
    return "yes" if pool_fits(to_place) else "no"


def _pool_fit(settings: NodeSettings, binary: Any, capacity: Any) -> _PoolFit | None:
    """The checked pool (the workers' status read with the node's key, as `serve` does), or None without one."""
    if not settings.pool_workers:
        return None
    from meshnet_gguf.node import node_key, pool_status_tokens
    from meshnet_gguf.prepare.pipeline import NodeSetupError, check_pool_workers

    if binary is None:
        typer.echo("error: a pool needs a llama-server here (its RPC protocol is checked against the workers')", err=True)
        raise typer.Exit(EXIT_SETUP_ERROR)
    try:
        members = check_pool_workers(settings, binary, pool_status_tokens(node_key(settings)))
    except NodeSetupError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(EXIT_SETUP_ERROR) from exc
    gpu = capacity.gpu_bytes if capacity.gpu_name else 0
    return _PoolFit(members, capacity.gpu_name if gpu else None, gpu)
