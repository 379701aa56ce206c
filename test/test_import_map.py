"""The package map of docs/architecture.md, read off the source: imports flow one way,
managers → model_executor → batch_overlap → models → layers → distributed / utils, with no
circle (``TYPE_CHECKING`` imports aside), and ``pipeline/`` uses only srt's building blocks.

Every ``import`` counts, inside functions too (a lazy import is still an arrow); ``from pkg
import submodule`` is an arrow to the submodule, not to ``pkg``. The root package ``srt`` (its
lazy ``Engine`` facade) is left out."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = "srt.model_executor.forward_batch_info"  # the step's data: every package reads it
# What the layers and models may not import: the planners and executors and all above them.
ABOVE_MODELS = ("srt.batch_overlap", "srt.model_executor", "srt.managers", "srt.entrypoints")
PIPELINE_MAY_USE = ("srt.layers", "srt.distributed", "srt.utils", "srt.batch_overlap.ubatching")


def module_files() -> dict[str, Path]:
    out = {}
    for package in ("srt", "pipeline"):
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _statements(node: ast.AST):
    """Every statement below ``node``, leaving out the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from _statements(stmt)
            continue
        yield child
        yield from _statements(child)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    found = set()
    for stmt in _statements(ast.parse(path.read_text())):
        if isinstance(stmt, ast.Import):
            found.update(alias.name for alias in stmt.names)
        elif isinstance(stmt, ast.ImportFrom):
            base = stmt.module or ""
            if stmt.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - stmt.level + 1]
                base = ".".join(here + ([base] if base else []))
            subs = [f"{base}.{a.name}" for a in stmt.names if f"{base}.{a.name}" in modules]
            found.update(subs if len(subs) == len(stmt.names) else [base, *subs])
    return {m for m in found if m in modules and m not in (name, "srt")}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def package_of(module: str) -> str:
    return module if module == DATA else ".".join(module.split(".")[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                found.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_in_a_circle(graph):
    assert cycles({m: deps for m, deps in graph.items() if m != "srt"}) == []


def test_packages_import_one_way(graph):
    packages: dict[str, set[str]] = {}
    for module, deps in graph.items():
        if module.startswith("srt."):
            here = package_of(module)
            packages.setdefault(here, set()).update(
                package_of(d) for d in deps if package_of(d) != here
            )
    assert cycles(packages) == []


def test_layers_and_models_import_no_planner_or_executor(graph):
    arrows = [
        (module, dep)
        for module, deps in graph.items()
        if module.startswith(("srt.layers", "srt.models"))
        for dep in deps
        if dep.startswith(ABOVE_MODELS) and dep != DATA
    ]
    assert arrows == []


def test_pipeline_uses_only_srt_building_blocks(graph):
    assert not [
        m
        for m, deps in graph.items()
        if m.startswith("srt") and any(d.startswith("pipeline") for d in deps)
    ]
    arrows = [
        (module, dep)
        for module, deps in graph.items()
        if module.startswith("pipeline")
        for dep in deps
        if dep.startswith("srt") and not dep.startswith(PIPELINE_MAY_USE)
    ]
    assert arrows == []


def test_the_map_sees_an_arrow_up(tmp_path):
    """The check itself: a lazy import from a layer up to a planner is found, a
    TYPE_CHECKING one is not."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import srt.managers.scheduler\n"
        "def f():\n    from srt.batch_overlap import step_split\n"
    )
    found = imports_of("srt.layers.probe", probe, module_files())
    assert found == {"srt.batch_overlap.step_split"}
