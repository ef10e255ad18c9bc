"""Doctor's word on which installed llama-server serves the model, as `serve` would choose it.

The choice is `serve --dry-run`'s (the pipeline run with nothing downloaded, built or measured):
the fastest by the figures kept from an earlier start, or why nothing was measured (the operator's
choice, the only one installed, not measured yet). Its own check, beside `checks.check_binary`,
which says whether the binary found runs at all.
"""

from __future__ import annotations

from meshnet_gguf.common.settings import NodeSettings
from meshnet_gguf.doctor.checks import Finding
from meshnet_gguf.llama.binary import chosen_by_operator
from meshnet_gguf.llama.runnable import every_runnable_installed
from meshnet_gguf.llama.speed_choice import NOT_MEASURED_YET as NO_FIGURES_YET
from meshnet_gguf.llama.speed_choice import BinaryChoice

CHECK = "binary choice"
NOT_MEASURED_YET = (
    "serving measures each of them once with this model before it is ready (each loads the model once: that first "
    "start takes longer), keeps the figures, and serves with the fastest"
)


def check_binary_choice(settings: NodeSettings) -> list[Finding]:
    """Which llama-server `serve` would run this model with, its figures and the others'."""
    from meshnet_gguf.prepare.pipeline import NodeSetupError, prepare_launch

    if settings.gguf is None and not settings.demo:
        if chosen_by_operator(settings.llama_server):
            return []
        installed = every_runnable_installed()
        if len(installed) < 2:
            return []
        names = ", ".join(str(r.binary.path) for r in installed)
        return [Finding(CHECK, "ok", f"{len(installed)} installed llama-servers run models here: {names}", "", NOT_MEASURED_YET)]
    try:
        choice = prepare_launch(settings, dry_run=True).binary_choice
    except NodeSetupError as exc:
        return [Finding(CHECK, "skip", "no plan to choose a llama-server for", str(exc).splitlines()[0])]
    return [] if choice is None else [_finding(choice)]


def _finding(choice: BinaryChoice) -> Finding:
    others = "; ".join(line.strip() for line in choice.lines()[1:])
    if choice.by_measurement or not choice.measured:
        return Finding(CHECK, "ok", f"serving uses {choice.chosen.path}: {choice.how}", others)
    if all(entry.capability is not None or entry.why_not == NO_FIGURES_YET for entry in choice.measured):
        return Finding(CHECK, "ok", f"serving starts with {choice.chosen.path} unless another is faster", others, NOT_MEASURED_YET)
    return Finding(CHECK, "warn", f"serving uses {choice.chosen.path}: {choice.how}", others)


__all__ = ["check_binary_choice"]
