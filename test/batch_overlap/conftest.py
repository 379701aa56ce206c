"""The multi-rank TBO tests share the distributed tests' helpers (run_ranks, SeqDriver)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
