"""Options a user coming from llama.cpp or Ollama reaches for, answered with the one this CLI has.

click already suggests near spellings (`--prot` → `--port`); `-m file.gguf`, llama-server's
own flag for the model, is near nothing here, so it gets this hint instead.
"""

from __future__ import annotations

from typing import Any

# The model to serve is `--gguf` here; llama.cpp's tools and many wrappers call it -m / --model.
_MODEL_OPTIONS = frozenset({"-m", "--model"})
_MODEL_HINT = "the model is given with --gguf here: --gguf FILE.gguf (or a folder, owner/name[:QUANT], a catalog id)"


def add_hint(exc: Exception, command: Any) -> None:
    """Adds the hint to click's "No such option" for an option of another tool (click's error is kept)."""
    # typer ships its own copy of click: its exception is told by name, not class.
    if type(exc).__name__ != "NoSuchOption":
        return
    has_gguf = any(getattr(param, "name", None) == "gguf" for param in command.params)
    if has_gguf and getattr(exc, "option_name", None) in _MODEL_OPTIONS:
        exc.message = f"{exc.message}: {_MODEL_HINT}"  # type: ignore[attr-defined]
        exc.possibilities = None  # type: ignore[attr-defined]  # click's near spelling (--demo) is not what was meant


__all__ = ["add_hint"]
