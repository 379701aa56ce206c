"""Session fixtures: tiny HF checkpoints built once by launch/make_tiny_models.py and cached;
Triton's interpreter where there is no GPU."""

from __future__ import annotations

import os

import pytest
import torch
from make_tiny_models import ensure_tiny_models

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter. It is read when a
# kernel is defined, so it is set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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


def _assert_kv_pool_full(engine) -> None:
    state = engine.get_server_info()["internal_states"][0]
    assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0
    assert state["num_protected_tokens"] == 0
    assert state["num_free_tokens"] + state["num_evictable_tokens"] == state["max_total_num_tokens"]


@pytest.fixture
def assert_kv_pool_full():
    """Checks through the engine's internal state that no request is left and every KV slot is
    free or evictable from the prefix cache (nothing leaked)."""
    return _assert_kv_pool_full
