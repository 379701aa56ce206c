"""The OpenAI-compatible routes, as a layer over a TokenizerManager."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request, Response

from srt.entrypoints.openai.serving_chat import OpenAIServingChat
from srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from srt.entrypoints.openai.serving_models import model_list, retrieve_model
from srt.entrypoints.openai.utils import OpenAIError, json_response


def add_openai_routes(app: FastAPI, tm: Any) -> None:
    """Register /v1/models, /v1/models/{id}, /v1/completions and /v1/chat/completions.

    ``tm`` needs ``generate_request(obj, request)`` (an async generator of SGLang-shaped
    outputs that raises ValueError for bad input), ``start_request(obj, request)`` (that
    generator, awaited until the request is submitted), ``tokenizer``, ``served_model_name``,
    ``model_path``, ``context_len``, ``tool_call_parser`` and ``expand_parallel_samples``.
    """
    completions = OpenAIServingCompletion(tm)
    chat = OpenAIServingChat(tm)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(model_list(tm))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> Response:
        try:
            return json_response(retrieve_model(tm, model_id))
        except OpenAIError as e:
            return e.response()

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        return await completions.handle(request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        return await chat.handle(request)
