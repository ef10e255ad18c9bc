"""The models a node serves beside its first: one `ModelEntry` each, from a repeated `--gguf` or the TOML file's
`[[models]]` tables.

The first `--gguf` (or `gguf = ...`, or `--demo`) is the node's first model: planned, launched and supervised
as a node with one model always was, and never unloaded. Each entry here is one more model, with its own
quant, context and slots; it is loaded on its first request and unloaded after `idle_unload_s` idle,
unless `pinned` (loaded at start, never unloaded). On the command line an entry is one string:

    --gguf FILE_OR_REPO[:QUANT][,quant=Q][,ctx=N][,slots=N][,alias=NAME][,idle=SECONDS][,gpu-layers=N][,pin]
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The short keys a `--gguf` entry takes after its model, by the entry's field they set.
FLAG_KEYS = {
    "quant": "quant",
    "ctx": "ctx_size",
    "ctx-size": "ctx_size",
    "slots": "parallel",
    "parallel": "parallel",
    "alias": "alias",
    "idle": "idle_unload_s",
    "gpu-layers": "n_gpu_layers",
    "pin": "pinned",
    "pinned": "pinned",
}
ENTRY_SEPARATOR = ","


class ModelEntry(BaseModel):
    """One more model to serve: where it comes from and how it runs (None: planned, as the first model's are)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gguf: str = Field(min_length=1, description="GGUF file, folder, HF repo owner/name[:QUANT] or catalog id")
    quant: str | None = None
    ctx_size: int | None = Field(None, ge=0, description="Its context (all its slots); None: planned from memory")
    # One slot by default: a model that comes and goes serves a few requests, and each slot costs KV cache.
    parallel: int = Field(1, ge=1, le=256, description="Its llama-server slots")
    alias: str | None = Field(None, description="The name requests use; None: the name the node gives its file")
    pinned: bool = Field(False, description="Loaded at start and never unloaded (the first model always is)")
    idle_unload_s: float | None = Field(None, gt=0, description="Unloaded after this long without a request; None: the node's default")
    n_gpu_layers: str | None = Field(None, description="'all', 'auto' or a count; None: planned")


def parse_model_flag(text: str) -> ModelEntry:
    """A `--gguf` value after the first: `SOURCE[,key=value...][,pin]`; ValueError naming what it cannot read."""
    source, *options = [part.strip() for part in text.split(ENTRY_SEPARATOR)]
    fields: dict[str, object] = {"gguf": source}
    for option in options:
        key, has_value, value = option.partition("=")
        field = FLAG_KEYS.get(key.strip().lower())
        if field is None:
            raise ValueError(f"--gguf {text!r}: unknown option {key!r} (known: {', '.join(sorted(FLAG_KEYS))})")
        if field == "pinned":
            fields[field] = not has_value or value.strip().lower() in ("1", "true", "yes")
        elif not value.strip():
            raise ValueError(f"--gguf {text!r}: {key} needs a value ({key}=...)")
        else:
            fields[field] = value.strip()
    try:
        return ModelEntry.model_validate(fields)
    except ValidationError as exc:  # said as the flag's problem, not as a node setting's
        error = exc.errors()[0]
        where = ".".join(str(part) for part in error["loc"])
        raise ValueError(f"--gguf {text!r}: {where}: {error['msg']}") from None


__all__ = ["ENTRY_SEPARATOR", "FLAG_KEYS", "ModelEntry", "parse_model_flag"]
