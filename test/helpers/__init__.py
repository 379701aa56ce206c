"""Helpers shared by the test modules (importable because ``pyproject.toml`` puts ``test/`` on
pytest's ``pythonpath``): rank processes, server processes, engine outputs and the drivers
that step a ModelRunner by hand."""
