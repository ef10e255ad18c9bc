"""The house rules of docs/architecture.md, checked: a module imports only its own floor or below."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "src" / "meshnet_gguf"

FLOORS: dict[str, int] = {
    # 1: shared vocabulary, no I/O
    **dict.fromkeys(
        ["protocol", "sse", "errors", "retry", "signing", "gguf_names", "catalog", "ports", "node_part", "admission", "atomic_file"],
        1,
    ),
    # 2: one outside thing each (a file, a process, a socket, the hub, the database)
    **dict.fromkeys(
        [
            "config", "binary", "gguf_info", "gguf_convert", "hardware_sources", "hardware", "download",
            "ledger", "identity", "route_auth", "logs", "sd_notify", "load_progress", "usage_stats",
            "upstream_http", "cpu_compat", "metrics", "metering", "http_server", "devtools.tiny_model", "devtools.hf_server",
            "state_lock", "source_build",
        ],
        2,
    ),  # fmt: skip
    # 3: the working rooms
    **dict.fromkeys(
        [
            "memory_model", "launch_plan", "quant_advisor", "model_source", "supervisor", "proxy", "tracker_client",
            "billing", "meshnet_link", "doctor", "service",
        ],
        3,
    ),  # fmt: skip
    # 4: composition
    "launch": 4,
    "node": 4,
    "node_ops": 4,
}
REFERENCE_MAY_IMPORT = {"protocol", "sse", "errors", "retry", "signing"}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshnet_gguf."):
            found.add(node.module.removeprefix("meshnet_gguf."))
        elif isinstance(node, ast.Import):
            found.update(a.name.removeprefix("meshnet_gguf.") for a in node.names if a.name.startswith("meshnet_gguf."))
    return found


def _floor(module: str) -> int:
    if module == "cli" or module.startswith("cli."):
        return 5
    return FLOORS[module]


def test_every_module_has_a_floor() -> None:
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    unplaced = {
        m for m in modules
        if m not in FLOORS and not m.startswith(("cli", "reference")) and m not in ("__init__", "__main__", "devtools")
    }  # fmt: skip
    assert not unplaced, f"place these modules on a floor in this test and docs/architecture.md: {sorted(unplaced)}"


def test_no_module_imports_a_higher_floor() -> None:
    violations = []
    for path in PACKAGE.rglob("*.py"):
        module = _module_name(path)
        if module in ("__init__", "__main__", "devtools") or module.startswith("reference"):
            continue
        for target in _imports(path):
            if target.startswith("reference") or target in ("devtools",):
                continue
            if _floor(target) > _floor(module):
                violations.append(f"{module} (floor {_floor(module)}) imports {target} (floor {_floor(target)})")
    assert not violations, "\n".join(violations)


def test_reference_mesh_services_speak_only_the_shared_contract() -> None:
    for path in (PACKAGE / "reference").rglob("*.py"):
        foreign = {t for t in _imports(path) if not t.startswith("reference") and t not in REFERENCE_MAY_IMPORT}
        assert not foreign, f"{path.name} imports node internals: {sorted(foreign)}"


def test_proxy_and_supervisor_never_import_each_other() -> None:
    assert "supervisor" not in _imports(PACKAGE / "proxy.py")
    assert "proxy" not in _imports(PACKAGE / "supervisor.py")
