"""srt: an SGLang-style serving runtime for Mixture-of-Experts models."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import srt` stays cheap (no torch / transformers import).
    if name == "Engine":
        from srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'srt' has no attribute {name!r}")
