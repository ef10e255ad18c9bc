"""The house rules of docs/architecture.md, checked: a module imports only its own floor or below."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "src" / "meshnet_gguf"

# The areas, each a package whose __init__ says its job, and the areas each may import.
# Read bottom to top: an area uses only what stands above it in this table, so no two areas
# can import each other. `node` is the composition root (meshnet_gguf/node/), `cli` the typer
# commands; `reference` holds the reference tracker and relay, two services in two folders that speak only
# the shared contract and never import each other (checked below).
AREA_MAY_IMPORT: dict[str, set[str]] = {
    "common": set(),
    "contract": {"common"},
    "models": {"common", "contract"},
    "llama": {"common", "contract", "models"},
    "hardware": {"common", "contract", "models", "llama"},
    "prepare": {"common", "contract", "models", "llama", "hardware"},
    "serving": {"common", "contract", "llama"},
    "mesh": {"common", "contract", "serving"},
    # ops runs beside a serving node and never prepares a launch; doctor runs the preparation dry and checks the
    # mesh. The two stand side by side: neither imports the other.
    "ops": {"common", "contract", "models", "llama", "hardware", "serving", "mesh"},
    "doctor": {"common", "contract", "models", "llama", "hardware", "prepare", "mesh"},
    "devtools": {"common", "contract", "models"},
    "proof": {"common", "contract"},
    "reference": {"common", "contract"},
    "node": {"common", "contract", "models", "llama", "hardware", "prepare", "serving", "mesh", "ops", "proof"},
    "cli": {
        "common",
        "contract",
        "models",
        "llama",
        "hardware",
        "prepare",
        "serving",
        "mesh",
        "ops",
        "doctor",
        "devtools",
        "reference",
        "node",
        "proof",
    },
}
# Modules outside any area: the package's own __init__ and `python -m meshnet_gguf`.
NO_AREA = {"__init__", "__main__"}


def _area(relative: Path) -> str:
    """`serving/proxy.py` -> serving; `node/root.py` -> node (a top-level module would be its own area)."""
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imported_areas(path: Path) -> dict[str, set[str]]:
    """area -> the dotted modules of it that `path` imports, wherever the import stands."""
    found: dict[str, set[str]] = {}
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(ROOT_PACKAGE + "."):
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith(ROOT_PACKAGE + ".")]
        for name in names:
            parts = name.split(".")[1:]
            found.setdefault(parts[0], set()).add(".".join(parts))
    return found


def test_every_module_lives_in_an_area_and_every_area_says_its_job_and_its_imports() -> None:
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.stem in NO_AREA and len(relative.parts) == 1:
            continue
        assert _area(relative) in AREA_MAY_IMPORT, f"{relative}: place it in an area (a folder) and in AREA_MAY_IMPORT"
    for area in AREA_MAY_IMPORT:
        init = PACKAGE / area / "__init__.py"
        if init.exists():
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert "May import" in doc, f"{area}/__init__.py: say the area's job and what it may import ('May import ...')"


def test_no_area_imports_one_it_may_not() -> None:
    violations = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.stem in NO_AREA and len(relative.parts) == 1:
            continue
        area = _area(relative)
        for target, modules in _imported_areas(path).items():
            if target != area and target not in AREA_MAY_IMPORT[area]:
                violations.append(f"{relative} ({area}) imports {', '.join(sorted(modules))} ({target})")
    assert not violations, "\n".join(violations)


def test_the_area_table_has_no_loop() -> None:
    graph = {area: set(allowed) for area, allowed in AREA_MAY_IMPORT.items()}
    assert not _cycles(graph), _cycles(graph)


def test_serving_knows_nothing_of_preparation_the_mesh_or_the_cli() -> None:
    # The rules a reader leans on most, spelled out (the table above implies them).
    for forbidden in ("prepare", "mesh", "cli", "ops"):
        assert forbidden not in AREA_MAY_IMPORT["serving"]
    assert AREA_MAY_IMPORT["reference"] == {"common", "contract"}
    # ops runs beside a serving node; preparing a launch (and doctor, which runs it dry) is no part of it.
    assert "prepare" not in AREA_MAY_IMPORT["ops"] and "doctor" not in AREA_MAY_IMPORT["ops"]
    # doctor checks preparation and the mesh, not ops: the two never import each other.
    assert "ops" not in AREA_MAY_IMPORT["doctor"]


def test_proxy_and_supervisor_never_import_each_other() -> None:
    assert "serving" not in _imported_areas(PACKAGE / "llama" / "supervisor.py")
    assert "llama.supervisor" not in _imported_areas(PACKAGE / "serving" / "proxy.py").get("llama", set())


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


def test_the_tracker_and_the_relay_never_import_each_other() -> None:
    """Two services in two folders of `reference`: each speaks to the other only through the contract."""
    modules = _all_modules()
    services = {"reference.tracker": "reference.relay", "reference.relay": "reference.tracker"}
    for service, other in services.items():
        mine = {name: path for name, path in modules.items() if name == service or name.startswith(service + ".")}
        assert mine, f"{service}: no modules"
        for name, path in mine.items():
            crossing = {t for t in _import_edges(path, modules) if t == other or t.startswith(other + ".")}
            assert not crossing, f"{name} imports {sorted(crossing)}: the tracker and the relay share only the contract"


def test_the_service_check_sees_a_crossing(tmp_path: Path) -> None:
    fake = tmp_path / "meshnet_gguf"
    (fake / "reference" / "relay").mkdir(parents=True)
    (fake / "reference" / "tracker").mkdir(parents=True)
    (fake / "reference" / "relay" / "server.py").write_text("")
    (fake / "reference" / "tracker" / "app.py").write_text("def f():\n    from ..relay import server\n")
    modules = {"reference.relay.server": fake / "reference" / "relay" / "server.py",
               "reference.tracker.app": fake / "reference" / "tracker" / "app.py"}  # fmt: skip
    assert _import_edges(fake / "reference" / "tracker" / "app.py", modules, fake) == {"reference.relay.server"}


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
    assert not cycles, "modules that import each other, directly or round a loop:\n" + "\n".join(" <-> ".join(c) for c in cycles)


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
