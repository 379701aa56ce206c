"""Session fixtures: tiny HF checkpoints built once by launch/make_tiny_models.py and cached."""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
GENERATOR = REPO / "launch" / "make_tiny_models.py"
sys.path.insert(0, str(GENERATOR.parent))

from make_tiny_models import MODEL_NAMES, make_tiny_models  # noqa: E402


def tiny_model_root() -> Path:
    return Path(os.environ.get("SRT_TINY_MODEL_DIR") or REPO / ".cache" / "tiny-models")


def build_tiny_models(root: Path) -> dict[str, str]:
    """Build into root unless a finished build of this generator version is there already.

    The marker holds the generator's hash and is written last, so a half-written or stale
    directory is rebuilt; the file lock lets concurrent pytest processes share one build.
    """
    root.mkdir(parents=True, exist_ok=True)
    marker = root / ".complete"
    version = hashlib.sha256(GENERATOR.read_bytes()).hexdigest()
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not marker.exists() or marker.read_text() != version:
            marker.unlink(missing_ok=True)
            make_tiny_models(str(root))
            marker.write_text(version)
    return {name: str(root / name) for name in MODEL_NAMES}


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, str]:
    return build_tiny_models(tiny_model_root())


@pytest.fixture(scope="session")
def qwen3_moe_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["tiny-qwen3-moe"]


@pytest.fixture(scope="session")
def deepseek_v2_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["tiny-deepseek-v2"]


@pytest.fixture(scope="session")
def deepseek_v3_path(tiny_models: dict[str, str]) -> str:
    return tiny_models["tiny-deepseek-v3"]
