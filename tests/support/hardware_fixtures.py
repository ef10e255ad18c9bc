"""Recorded machines (tests/fixtures/hardware/<box>/) and model facts shared by the hardware, plan and advisor tests.

Each box holds `root/` (the sysfs and proc files the probes read) and
`commands/<name>.txt` (what `llama-server --list-devices`, `nvidia-smi` and
`rocminfo` printed there). A command without a file was not installed.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from meshnet_gguf.hardware.report import HardwareReport, probe_hardware
from meshnet_gguf.hardware.sources import RecordedCommands
from meshnet_gguf.llama.binary import BUILD_INFO_FILE, BinaryInfo
from meshnet_gguf.models.catalog import load_catalog
from meshnet_gguf.prepare.memory import ModelFacts
from meshnet_gguf.prepare.plan import OperatorChoices
from meshnet_gguf.prepare.quant_advisor import QuantOption

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hardware"
# What release b10434 of llama-server printed for --help.
RECORDED_HELP = FIXTURES / "llama-server-help-b10434.txt"
BOXES = ("strix-halo-128", "strix-halo-128-carveout-64", "strix-halo-80", "nvidia-rtx4090", "cpu-only")


def write_recorded_llama(directory: Path) -> Path:
    """A `llama-server` in `directory` that answers --version and --help as release b10434 did; a dry run never starts it."""
    path = directory / "llama-server"
    path.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        '  --version) echo "version: 10434 (recorded)" >&2 ;;\n'
        f'  --help) cat "{RECORDED_HELP}" ;;\n'
        '  *) echo "recorded llama-server: only --version and --help" >&2; exit 1 ;;\n'
        "esac\n"
    )
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def recorded_build(directory: Path, backend: str) -> BinaryInfo:
    """The recorded llama-server in `directory` with the build record `build-llama-server` writes beside its builds
    (`build.json`, its "backend": cpu, vulkan, cuda or rocm): what the binary was built to drive."""
    directory.mkdir(parents=True, exist_ok=True)
    path = write_recorded_llama(directory)
    (directory / BUILD_INFO_FILE).write_text(json.dumps({"build": "b11434", "backend": backend}))
    return BinaryInfo(path=path, source="fixture", version="fixture", build="b11434", help_text=RECORDED_HELP.read_text())


def require_software_vulkan() -> None:
    """Skip unless Mesa's lavapipe ICD is installed (CI installs Debian's mesa-vulkan-drivers)."""
    icd_dirs = (Path("/usr/share/vulkan/icd.d"), Path("/etc/vulkan/icd.d"))
    if not any(p.name.startswith("lvp_icd") for d in icd_dirs for p in d.glob("*.json")):
        pytest.skip("no software Vulkan driver (Debian: apt install mesa-vulkan-drivers)")


def fixture_binary(help_file: str = "llama-server-help-b10434.txt") -> BinaryInfo:
    """A BinaryInfo with a recorded `--help`; its path is only a name for the recorded command runner."""
    return BinaryInfo(
        path=Path("llama-server"),
        source="fixture",
        version="fixture",
        build=None,
        help_text=(FIXTURES / help_file).read_text(),
    )


def load_box(box: str, *, list_devices: str | None = None, binary: BinaryInfo | None = None) -> HardwareReport:
    """Probe a recorded box; `list_devices` swaps in another recorded `--list-devices` output of that box."""
    commands = FIXTURES / box / "commands"
    replace = {"llama-server": commands / list_devices} if list_devices else None
    return probe_hardware(
        binary or fixture_binary(),
        root=FIXTURES / box / "root",
        run=RecordedCommands(commands, replace=replace),
        platform="linux",
    )


def deepseek_quants() -> list[QuantOption]:
    entry = load_catalog().get("deepseek-v4-flash")
    assert entry is not None, "the catalog lost its DeepSeek-V4-Flash entry"
    return [QuantOption(q.name, q.total_bytes, q.shards) for q in entry.quants]


def deepseek_facts(quant: str) -> ModelFacts:
    """DeepSeek-V4-Flash as the catalog describes it: its sizes, context and model shape
    (43 layers, one shared KV head of 512 dims), shard 1 under `models/`."""
    entry = load_catalog().get("deepseek-v4-flash")
    assert entry is not None and entry.shape is not None, "the catalog lost DeepSeek-V4-Flash or its model shape"
    q = entry.quant(quant)
    assert q is not None, f"catalog has no {quant}"
    return ModelFacts.from_catalog(entry, q, path=Path("models") / q.first_file)


def dense_facts(name: str, total_bytes: int, layers: int, kv_heads: int, head_dim: int, context: int) -> ModelFacts:
    return ModelFacts(
        name=name,
        total_bytes=total_bytes,
        block_count=layers,
        head_count_kv=kv_heads,
        head_dim_k=head_dim,
        head_dim_v=head_dim,
        context_length=context,
        path=Path("models") / f"{name}.gguf",
    )


def choices(
    *, parallel: int = 4, ctx_size: int | None = None, n_gpu_layers: str | None = None, llama_args: tuple[str, ...] = ()
) -> OperatorChoices:
    """The operator's choices as `serve` reads them from its flags (defaults: `serve`'s own)."""
    return OperatorChoices.read(parallel=parallel, ctx_size=ctx_size, n_gpu_layers=n_gpu_layers, llama_args=llama_args)
