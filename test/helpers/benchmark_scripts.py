"""The scripts under benchmark/ as modules, for tests of their pure functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "benchmark"


def load_benchmark(name: str) -> ModuleType:
    """benchmark/<name>.py, imported under ``name`` (it puts benchmark/ on sys.path itself)."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
