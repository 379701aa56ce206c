"""OpenAI-compatible API (/v1/models, /v1/completions, /v1/chat/completions)."""

from __future__ import annotations

from srt.entrypoints.openai.serving import add_openai_routes

__all__ = ["add_openai_routes"]
