"""Helpers shared by the test modules (importable because ``pyproject.toml`` puts ``test/`` on
pytest's ``pythonpath``): rank processes, server processes (a test-facing layer over
``benchmark.common``, which the benchmarks use too), engine outputs and the drivers that step a
ModelRunner by hand."""
