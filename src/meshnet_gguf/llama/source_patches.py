"""Compatibility patches applied to llama.cpp's source before configuring, each only where it is needed.

A distribution's packages can be older than what llama.cpp assumes. The one patch
here lets the Vulkan backend compile against the Vulkan headers of Debian 12
(1.3.239) and Ubuntu 22.04 (1.3.204): ggml-vulkan.cpp at b11434 hands the
validation layer a setting through VK_EXT_layer_settings (`vk::LayerSettingEXT`,
first in Vulkan-Headers 1.3.272), the only use of that extension, and unguarded.
The patch puts that block under `#if VK_HEADER_VERSION >= 272` and, below it,
creates the instance without the setting: the validation layer (loaded only when a
developer installs it) keeps its defaults; nothing on the compute path changes.

Each patch finds its anchor exactly once or refuses with a message naming the file,
so a llama.cpp whose source moved on fails loudly before configuring instead of
compiling something half-patched; a tree already patched is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

PATCH_MARKER = "meshnet-gguf compatibility patch"


class PatchError(RuntimeError):
    """A patch's anchor is not in the source exactly once: this source is not the one it was written for."""


@dataclass(frozen=True)
class SourcePatch:
    name: str
    file: str  # relative to llama.cpp's top folder
    anchor: str
    replacement: str
    why: str  # one line for the build log


_LAYER_SETTINGS_BLOCK = """    VkBool32 enable_best_practice = layer_settings;
    std::vector<vk::LayerSettingEXT> settings = {
        {
            "VK_LAYER_KHRONOS_validation",
            "validate_best_practices",
            vk::LayerSettingTypeEXT::eBool32,
            1,
            &enable_best_practice
        },
    };
    vk::LayerSettingsCreateInfoEXT layer_setting_info(settings);
    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);
"""

VULKAN_LAYER_SETTINGS = SourcePatch(
    name="vulkan-headers-before-1.3.272",
    file="ggml/src/ggml-vulkan/ggml-vulkan.cpp",
    anchor=_LAYER_SETTINGS_BLOCK,
    replacement=(
        "#if VK_HEADER_VERSION >= 272\n"
        + _LAYER_SETTINGS_BLOCK
        + "#else\n"
        + f"    // {PATCH_MARKER}: these Vulkan headers predate VK_EXT_layer_settings (1.3.272); the validation\n"
        + "    // layer, when a developer installs one, runs with its default settings.\n"
        + "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);\n"
        + "#endif\n"
    ),
    why="the validation layer's one setting (VK_EXT_layer_settings, Vulkan-Headers 1.3.272) is compiled only where the headers have it",
)


def apply_patch(tree: Path, patch: SourcePatch) -> bool:
    """Apply `patch` to the llama.cpp folder `tree`; False when it was already applied. Raises `PatchError`."""
    path = tree / patch.file
    try:
        text = path.read_text()
    except OSError as exc:
        raise PatchError(f"patch {patch.name}: cannot read {patch.file}: {exc}") from exc
    if patch.replacement in text:
        return False
    found = text.count(patch.anchor)
    if found != 1:
        raise PatchError(
            f"patch {patch.name}: its anchor is in {patch.file} {found} times, not once: this llama.cpp source is not the one "
            "the patch was written for"
        )
    partial = path.with_name(path.name + ".patching")
    partial.write_text(text.replace(patch.anchor, patch.replacement))
    partial.replace(path)
    return True
