"""The TOML file named by `MESHNET_CONFIG`, read so that a mistake in it is an error, never a silence.

- a file that is not there is an error (a typo in the path must not serve with defaults);
- a syntax error is one line with the file, line and column;
- an unknown key is an error naming the nearest valid one;
- a key may be written as the setting (`ctx_size`) or with dashes as the flag is (`ctx-size`):
  the example file's header suggests both, and both mean the same setting.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

CONFIG_FILE_ENV = "MESHNET_CONFIG"
# Flags of `serve` whose name is not their key's: the file is told the key when it names the flag.
KEY_OF_FLAG = {
    "relay": "relay_url",
    "drain_grace": "drain_grace_s",
    "pool_worker": "pool_workers",
    "llama_arg": "llama_args",
    "allowed_host": "allowed_hosts",
    "no_build": "build",
}
# How close a typo must be to a key for the error to suggest it (difflib's ratio).
_SUGGESTION_CUTOFF = 0.6
_TOML_POSITION = re.compile(r"\s*\(at line (?P<line>\d+), column (?P<column>\d+)\)$")


class ConfigFileError(ValueError):
    """The config file cannot be used as written; the message is one line an operator can act on."""


def config_file_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """The file `MESHNET_CONFIG` names, or None when it names none (unset or empty)."""
    named = (os.environ if environ is None else environ).get(CONFIG_FILE_ENV)
    return Path(named) if named else None


def read_config_file(path: Path, keys: Iterable[str]) -> dict[str, Any]:
    """The file's settings by key (dashed keys under their setting's name); `ConfigFileError` for any mistake."""
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigFileError(f"{CONFIG_FILE_ENV} names {path}, which does not exist") from None
    except IsADirectoryError:
        raise ConfigFileError(f"{CONFIG_FILE_ENV} names {path}, which is a folder, not a TOML file") from None
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{path}: not UTF-8 text (byte {exc.start}); a TOML file is UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(_syntax_error(path, exc)) from None
    return _checked_keys(path, data, frozenset(keys))


def _syntax_error(path: Path, exc: tomllib.TOMLDecodeError) -> str:
    message = str(exc).splitlines()[0] if str(exc) else "not valid TOML"
    line, column = getattr(exc, "lineno", None), getattr(exc, "colno", None)
    found = _TOML_POSITION.search(message)
    if found:  # tomllib before 3.14 carries the position in its message only
        line, column = int(found["line"]), int(found["column"])
        message = message[: found.start()]
    where = f"{path}:{line}:{column}" if line is not None else str(path)
    return f"{where}: TOML syntax error: {message}"


def _checked_keys(path: Path, data: Mapping[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    written_as: dict[str, str] = {}
    for written, value in data.items():
        key = written.replace("-", "_")
        if key not in keys and isinstance(value, dict):
            raise ConfigFileError(f"{path}: unknown table [{written}]: the settings are top-level keys, with no [table] above them")
        if key not in keys:
            raise ConfigFileError(f"{path}: unknown key {written!r}{_suggestion(key, keys)}")
        if key in settings:
            raise ConfigFileError(f"{path}: {key} is set twice (as {written_as[key]!r} and {written!r}); keep one")
        settings[key], written_as[key] = value, written
    return settings


def flag_of(key: str) -> str:
    """The flag that sets a key, as an operator types it (`relay_url` is set by --relay)."""
    flag = next((f for f, k in KEY_OF_FLAG.items() if k == key and not f.startswith("no_")), key)
    return "--" + flag.replace("_", "-")


def _suggestion(key: str, keys: frozenset[str]) -> str:
    if KEY_OF_FLAG.get(key) in keys:
        return f": that is the flag --{key.replace('_', '-')}; in the file its key is {KEY_OF_FLAG[key]}"
    nearest = difflib.get_close_matches(key, sorted(keys), n=1, cutoff=_SUGGESTION_CUTOFF)
    if nearest:
        return f": did you mean {nearest[0]}?"
    return " (docs/meshnet-gguf.example.toml lists every key)"


__all__ = ["CONFIG_FILE_ENV", "KEY_OF_FLAG", "ConfigFileError", "config_file_path", "flag_of", "read_config_file"]
