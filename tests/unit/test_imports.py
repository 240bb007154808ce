"""The package's import graph: no cycles, and Redis only behind the protocol room.

Every import counts, wherever it sits: module level, inside a function, or under `TYPE_CHECKING`. A cycle hidden in
a function still ties two modules together, and it is how the launcher once reached into the CLI's privates.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("shared", "services", "functions", "bench")
PROTOCOL = "jetroll.shared.protocol"


def package_modules() -> dict[str, Path]:
    modules = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = ("jetroll", *path.relative_to(ROOT).with_suffix("").parts)
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """Every dotted name an import statement in the module names, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {module: {name for name in imported_names(module, path) if name in modules and name != module}
            for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for succ in edges:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph[succ]))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_relative_and_function_local_imports_are_edges(tmp_path: Path) -> None:
    source = tmp_path / "mod.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sibling import X\n"
                      "def f():\n    import jetroll.shared.seeds\n")
    names = imported_names("jetroll.shared.rl.mod", source)
    assert {"jetroll.shared.rl.sibling", "jetroll.shared.rl.sibling.X", "jetroll.shared.seeds"} <= names


def test_the_package_has_no_import_cycles() -> None:
    graph = import_graph()
    assert len(graph) > 50  # the walk found the package
    assert cycles(graph) == []


def test_only_the_protocol_room_imports_redis() -> None:
    offenders = sorted(module for module, path in package_modules().items()
                       if not module.startswith(PROTOCOL) and any(name == "redis" or name.startswith("redis.")
                               for name in imported_names(module, path)))
    assert offenders == []


@pytest.mark.integration  # a fresh interpreter, to see what an import loads
def test_the_algorithm_room_loads_without_redis() -> None:
    """Every module of `jetroll.shared.rl`, imported in a fresh interpreter, loads neither redis-py nor the bus:
    transitive imports count (batch.py once reached redis through the ledger for a sort key)."""
    code = ("import importlib, pkgutil, sys\nimport jetroll.shared.rl as rl\n"
            "names = [m.name for m in pkgutil.iter_modules(rl.__path__)]\n"
            "for name in names: importlib.import_module(f'jetroll.shared.rl.{name}')\n"
            "print(len(names), 'redis' in sys.modules, 'jetroll.shared.protocol.bus' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    num_modules, has_redis, has_bus = run.stdout.split()
    assert int(num_modules) >= 5 and (has_redis, has_bus) == ("False", "False"), run.stdout


def test_the_layers_point_down() -> None:
    """`functions/` (the rewards) imports `shared/` (a gymnasium reward replays its task), so `shared/` never imports
    `functions/`: a job's entry hands the rewards in (functions/scoring.py). Nor does either import a service or a
    bench."""
    above = {"jetroll.shared": ("jetroll.functions", "jetroll.services", "jetroll.bench"),
             "jetroll.functions": ("jetroll.services", "jetroll.bench")}
    upward = sorted((module, name) for module, names in import_graph().items() for name in names
                    for layer, higher in above.items()
                    if module.startswith(f"{layer}.") and name.startswith(higher))
    assert upward == []


def test_no_service_imports_another() -> None:
    """The five services meet only through the protocol: what two of them share lives in `shared/`."""
    services = ("controller", "rollout", "reward", "trainer", "env")

    def service_of(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "services" and parts[2] in services else None

    crossings = sorted((module, name) for module, names in import_graph().items() for name in names
                       if service_of(module) and service_of(name) and service_of(module) != service_of(name))
    assert crossings == []


def folder_of(module: str) -> str:
    """A module's room: its package below `jetroll.shared` / `jetroll.services` (a module directly there, such as
    `jetroll.shared.seeds`, is a room of its own)."""
    parts = module.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else module


def test_the_rooms_have_no_import_cycles() -> None:
    """Folder level: config, model and tasks once imported each other through different modules, which no
    module-level cycle shows."""
    folders: dict[str, set[str]] = {}
    for module, names in import_graph().items():
        edges = folders.setdefault(folder_of(module), set())
        edges.update(folder_of(name) for name in names if folder_of(name) != folder_of(module))
    for targets in list(folders.values()):
        for target in targets:
            folders.setdefault(target, set())
    assert {"jetroll.shared.config", "jetroll.shared.model", "jetroll.shared.tasks"} <= set(folders)
    assert cycles(folders) == []


@pytest.mark.integration  # a fresh interpreter, to see what an import loads
def test_no_service_loads_another_even_transitively() -> None:
    """Each service's modules, imported in a fresh interpreter, load no module of another service."""
    code = ("import importlib, pkgutil, sys\nservice = sys.argv[1]\n"
            "package = importlib.import_module(f'jetroll.services.{service}')\n"
            "for m in pkgutil.walk_packages(package.__path__, f'jetroll.services.{service}.'):\n"
            "    importlib.import_module(m.name)\n"
            "print(' '.join(sorted({name.split('.')[2] for name in sys.modules if name.startswith('jetroll.services.')"
            " and name.count('.') >= 2})))")
    for service in ("controller", "rollout", "reward", "trainer", "env"):
        run = subprocess.run([sys.executable, "-c", code, service], capture_output=True, text=True, timeout=180,
                             check=True)
        assert run.stdout.split() == [service], (service, run.stdout)


def test_no_test_module_imports_another() -> None:
    """Shared test code lives in helper modules (factories, harnesses), so a test module can move or go alone."""
    test_modules = {path.stem for path in (ROOT / "tests").rglob("test_*.py")}
    offenders = []
    for path in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names
                          if name.rsplit(".", 1)[-1] in test_modules]
    assert len(test_modules) > 50 and offenders == []


def test_no_service_names_the_timing_engine() -> None:
    """The benches' timing model plugs in behind the engine factory (`shared/engine/factory.py`) and the config's
    `runs_model`: the services drive every engine alike and never ask for it by name. `timing/` metric names and an
    event's `timings` are other words."""
    timing = re.compile(r"\b[Tt]iming(?![s/])")
    offenders = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                 for path in sorted((ROOT / "services").rglob("*.py")) if "bench" not in path.parts
                 for number, line in enumerate(path.read_text().splitlines(), 1) if timing.search(line)]
    assert offenders == []
