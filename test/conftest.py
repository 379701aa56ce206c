"""Session fixtures: tiny HF checkpoints built once by launch/make_tiny_models.py and cached."""

from __future__ import annotations

import pytest
from make_tiny_models import ensure_tiny_models


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, str]:
    return ensure_tiny_models()


@pytest.fixture(scope="session")
def qwen3_moe_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["tiny-qwen3-moe"]


@pytest.fixture(scope="session")
def deepseek_v2_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["tiny-deepseek-v2"]


@pytest.fixture(scope="session")
def deepseek_v3_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["tiny-deepseek-v3"]
