"""GET /v1/models and /v1/models/{id}: the one model this server serves."""

from __future__ import annotations

from typing import Any

from srt.entrypoints.openai.protocol import ModelCard, ModelList
from srt.entrypoints.openai.utils import OpenAIError


def model_card(tm: Any) -> ModelCard:
    return ModelCard(id=tm.served_model_name, root=tm.model_path, max_model_len=tm.context_len)


def model_list(tm: Any) -> ModelList:
    return ModelList(data=[model_card(tm)])


def retrieve_model(tm: Any, model_id: str) -> ModelCard:
    if model_id not in (tm.served_model_name, tm.model_path):
        raise OpenAIError(f"The model '{model_id}' does not exist.", 404, "NotFoundError")
    return model_card(tm)
