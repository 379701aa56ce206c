"""Process-wide logging set-up."""

from __future__ import annotations

import logging


def configure_logging(level: str, prefix: str = "") -> None:
    tag = f"[{prefix}] " if prefix else ""
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format=f"%(asctime)s {tag}%(levelname)s %(name)s: %(message)s",
        force=True,
    )
