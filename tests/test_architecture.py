"""The rules the layout promises, checked on the source: import direction, no transformers or file I/O in
methods, nothing importing stages, explicit registration, module sizes, tests that stand alone."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvresearch.runs import PACKAGE_DIR

REPO = PACKAGE_DIR.parent
MODULES = sorted(PACKAGE_DIR.rglob("*.py"))
# Floors, bottom up: a module imports from its own floor or below, never above.
FLOORS = {
    "errors": 0,
    "progress": 0,
    "tracking": 0,
    "prompts": 0,
    "stats": 0,
    "generation": 0,
    "ops": 1,
    "runs": 1,
    "data": 1,
    "models": 1,
    "benchmarks": 1,
    "capture": 2,
    "sharding": 2,
    "experiment": 2,
    "surrogate": 2,
    "methods": 3,
    "answering": 3,
    "extraction": 3,
    "evaluation": 3,
    "fidelity": 3,
    "budget_search": 3,
    "lmeval": 3,
    "stages": 4,
    "device_check": 4,
    "device_steps": 4,
    "speed": 4,
    "sizing": 4,
    "device_wheels": 0,
    "reports": 2,
    "studies": 5,
    "bench": 5,
}
FILE_IO = {
    "open",
    "read_text",
    "write_text",
    "read_bytes",
    "write_bytes",
    "load",
    "save",
    "from_pretrained",
    "load_file",
    "save_file",
    "load_dataset",
    "mkdir",
    "unlink",
    "Path",
}


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.append(node.module)
    return found


def part(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@pytest.mark.parametrize("path", [m for m in MODULES if m.name != "__init__.py"], ids=lambda p: p.stem)
def test_imports_run_downward_only(path: Path) -> None:
    floor = FLOORS[part(path)]
    for name in imports(path):
        if name.startswith("kvresearch."):
            target = name.split(".")[1]
            assert FLOORS[target] <= floor, f"{path.relative_to(REPO)} imports {name} from a higher floor"


def test_only_models_imports_transformers_and_methods_do_no_file_io() -> None:
    for path in MODULES:
        if part(path) not in ("models", "bench"):  # a bench may time transformers' own cache as the reference
            assert not [n for n in imports(path) if n.split(".")[0] == "transformers"], path
    for path in sorted((PACKAGE_DIR / "methods").glob("*.py")):
        calls = {
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call)
        }
        assert not calls & FILE_IO, f"{path.name} calls {sorted(calls & FILE_IO)}"


def test_nothing_imports_stages_and_modules_stay_short() -> None:
    for path in [*MODULES, *sorted((REPO / "scripts").glob("*.py"))]:
        if part(path) != "stages" if path.is_relative_to(PACKAGE_DIR) else True:
            assert not [n for n in imports(path) if n.startswith("kvresearch.stages")], path
    long = {str(p.relative_to(REPO)): n for p in MODULES if (n := len(p.read_text().splitlines())) >= 400}
    assert not long, long
    for stage in (PACKAGE_DIR / "stages").glob("*.py"):
        assert len(stage.read_text().splitlines()) <= 80, stage


def test_no_test_imports_another_test_module() -> None:
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for name in imports(path):
            assert not (name.startswith("tests.") and name != "tests.helpers"), f"{path.name} imports {name}"


def test_importing_the_cache_registers_nothing_until_asked() -> None:
    code = (
        "import kvresearch.models.ragged_attention as c\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as A\n"
        "assert c.IMPLEMENTATION not in A\n"
        "c.register_ragged_attention()\n"
        "assert c.IMPLEMENTATION in A\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr


def module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from a import b`` counts b when b is a module)."""
    known = {module_name(p) for p in MODULES}
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in known}
            elif isinstance(node, ast.ImportFrom) and node.module in known:
                subs = {f"{node.module}.{a.name}" for a in node.names} & known
                edges |= subs or {node.module}
        graph[module_name(path)] = edges - {module_name(path)}
    return graph


def test_the_import_graph_has_no_circle() -> None:
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(nxt) :], nxt]))
            if nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert "kvresearch.runs.runner" in graph["kvresearch.runs"]  # the graph sees package re-exports


def test_scripts_stay_entry_points_and_conf_names_no_run_id() -> None:
    scripts = sorted((REPO / "scripts").glob("*.py"))
    assert sum(len(p.read_text().splitlines()) for p in scripts) < 600
    names = {p.stem for p in scripts}
    for path in scripts:
        assert not [n for n in imports(path) if n.split(".")[0] in names], f"{path.name} imports another script"
    run_id = re.compile(r"(?<![0-9a-zA-Z])[0-9a-f]{8}(?![0-9a-zA-Z])")
    for path in [REPO / "Makefile", *sorted((REPO / "conf").rglob("*.yaml"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            found = [m for m in run_id.findall(code) if not m.isdigit()]
            assert not found, f"{path.relative_to(REPO)}:{number} names a run by id {found}: name it by stage/step"
