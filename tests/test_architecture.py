"""The house rules of docs/architecture.md, checked: a module imports only its own floor or below."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "meshnet_gguf"

FLOORS: dict[str, int] = {
    # 1: shared vocabulary, no I/O
    **dict.fromkeys(
        ["protocol", "sse", "errors", "retry", "signing", "gguf_names", "catalog", "ports", "node_part", "admission", "atomic_file",
         "request_validation", "node_tls"],
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
            "billing", "meshnet_link", "doctor", "service", "relay_link", "relay_ops",
        ],
        3,
    ),  # fmt: skip
    # 4: composition
    "launch": 4,
    "node": 4,
    "node_ops": 4,
}
REFERENCE_MAY_IMPORT = {"protocol", "sse", "errors", "retry", "signing", "node_tls"}


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


# --- whole-package rules -------------------------------------------------------
ROOT_PACKAGE = "meshnet_gguf"
# What no comment or docstring may point at: texts a reader of this repository cannot open.
UNREADABLE_REFERENCES = re.compile(r"issue [0-9]|the design card", re.IGNORECASE)


def _all_modules() -> dict[str, Path]:
    """Every module of the package by dotted name below it ('' is the package's own __init__)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_edges(path: Path, modules: dict[str, Path], package: Path = PACKAGE) -> set[str]:
    """The package's modules `path` imports, wherever the import stands (top level, in a
    function, under TYPE_CHECKING), `from X import submodule` counted as the submodule."""
    here = path.relative_to(package).with_suffix("").parts[:-1]  # the package `path` is in
    found: set[str] = set()

    def add(dotted: str) -> None:
        if dotted == ROOT_PACKAGE or dotted.startswith(ROOT_PACKAGE + "."):
            name = dotted.removeprefix(ROOT_PACKAGE).removeprefix(".")
            if name in modules:
                found.add(name)

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = ".".join((ROOT_PACKAGE, *here[: len(here) - node.level + 1]))
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            add(module)
            for alias in node.names:
                add(f"{module}.{alias.name}")
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_anywhere_in_the_package() -> None:
    modules = _all_modules()
    graph = {name: _import_edges(path, modules) for name, path in modules.items()}
    cycles = _cycles(graph)
    assert not cycles, "modules that import each other, directly or round a loop:\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    # The check itself must be able to fail: a loop closed by an import inside a function.
    fake = tmp_path / ROOT_PACKAGE
    (fake / "sub").mkdir(parents=True)
    (fake / "a.py").write_text("from meshnet_gguf.sub import b\n")
    (fake / "sub" / "__init__.py").write_text("")
    (fake / "sub" / "b.py").write_text("def f():\n    from .. import a\n")
    modules = {"a": fake / "a.py", "sub": fake / "sub" / "__init__.py", "sub.b": fake / "sub" / "b.py"}
    graph = {name: _import_edges(path, modules, fake) for name, path in modules.items()}
    assert graph["a"] == {"sub", "sub.b"} and graph["sub.b"] == {"a"}
    assert _cycles(graph) == [["a", "sub.b"]]


def test_no_two_classes_share_a_name() -> None:
    defined: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    shared = {name: places for name, places in defined.items() if len(places) > 1}
    assert not shared, "one name, several classes: " + "; ".join(f"{n} in {', '.join(p)}" for n, p in sorted(shared.items()))


def test_no_comment_points_at_an_issue_or_the_design_card() -> None:
    hits = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*"))
        if path.is_file() and path.suffix in (".py", ".toml", ".md", ".txt")
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), start=1)
        if UNREADABLE_REFERENCES.search(line)
    ]
    assert not hits, "say the reason itself:\n" + "\n".join(hits)
