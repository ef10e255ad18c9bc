"""Where each setting came from: a flag, the environment, the config file, or its default.

The order is the settings' own (flags win over `MESHNET_*`, which wins over the file), so the
origin named is the one whose value the node uses. `doctor` shows it.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from meshnet_gguf.common.config_file import config_file_path, flag_of, read_config_file
from meshnet_gguf.common.settings import ENV_PREFIX, NodeSettings

# Shown as set or not, never their value: doctor's output gets pasted into bug reports.
SECRET_SETTINGS = frozenset({"api_key", "metrics_key", "enrolment_secret"})
HIDDEN_VALUE = "(set, not shown)"


@dataclass(frozen=True)
class SettingOrigin:
    name: str
    value: str
    origin: str  # "flag", "environment", "file" or "default"
    where: str = ""  # the variable or the file, when there is one

    def describe(self) -> str:
        source = f"{self.origin} {self.where}".strip()
        return f"{self.name} = {self.value}  ({source})"


def setting_origins(settings: NodeSettings, flags: Collection[str], environ: Mapping[str, str] | None = None) -> list[SettingOrigin]:
    """Every setting with the value the node uses and where it came from; `flags` names those given as flags."""
    environ = os.environ if environ is None else environ
    variables = {name.upper() for name in environ}
    config = config_file_path(environ)
    in_file = read_config_file(config, NodeSettings.model_fields) if config is not None else {}
    origins = []
    for name in NodeSettings.model_fields:
        value = getattr(settings, name)
        shown = HIDDEN_VALUE if name in SECRET_SETTINGS and value else _shown(value)
        variable = f"{ENV_PREFIX}{name.upper()}"
        if name in flags:
            origins.append(SettingOrigin(name, shown, "flag", flag_of(name)))
        elif variable in variables:
            origins.append(SettingOrigin(name, shown, "environment", variable))
        elif name in in_file:
            origins.append(SettingOrigin(name, shown, "file", str(config)))
        else:
            origins.append(SettingOrigin(name, shown, "default"))
    return origins


def _shown(value: object) -> str:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, str):
        return repr(value)
    return "none" if value is None else str(value)


__all__ = ["HIDDEN_VALUE", "SECRET_SETTINGS", "SettingOrigin", "setting_origins"]
