"""Helpers shared by the OpenAI endpoints: errors, body parsing, SSE lines, finish reasons,
usage and per-choice stream bookkeeping."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, TypeVar

import orjson
from fastapi import Request, Response
from pydantic import BaseModel, ValidationError

from srt.entrypoints.openai.protocol import (
    CachedTokensDetails,
    ErrorResponse,
    PromptTokensDetails,
    SglExt,
    UsageInfo,
)
from srt.managers.tokenizer_manager import RETRY_AFTER_S

ModelT = TypeVar("ModelT", bound=BaseModel)
MAX_LISTED_ERRORS = 3
SSE_DONE = b"data: [DONE]\n\n"


async def sse_done() -> bytes:
    """A stream's closing [DONE], after one turn of the event loop: when one step finishes many
    streams, each writes its last token before any of them closes (a close is two more writes
    to the socket; closing each stream right after its last token would delay the next stream's
    last token by those writes)."""
    await asyncio.sleep(0)
    return SSE_DONE


class OpenAIError(Exception):
    """An error answered as OpenAI does: a JSON error object with an HTTP status."""

    def __init__(self, message: str, status_code: int = 400, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.status_code, self.err_type = message, status_code, err_type

    def to_model(self) -> ErrorResponse:
        return ErrorResponse(message=self.message, type=self.err_type, code=self.status_code)

    def response(self) -> Response:
        response = json_response(self.to_model(), self.status_code)
        if self.status_code == 503:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    def sse(self) -> bytes:
        """The in-stream form (``{"error": {...}}``) that the openai client raises on."""
        return b"data: " + orjson.dumps({"error": self.to_model().model_dump()}) + b"\n\n"


def json_response(model: BaseModel, status_code: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code, media_type="application/json")


def sse_line(model: BaseModel) -> bytes:
    return b"data: " + model.model_dump_json().encode() + b"\n\n"


async def parse_request(request: Request, model_cls: type[ModelT]) -> ModelT:
    """Validate the raw body ourselves, so bad JSON and bad types are a 400, not FastAPI's 422."""
    body = await request.body()
    try:
        return model_cls.model_validate_json(body, strict=True)
    except ValidationError as e:
        raise OpenAIError(validation_message(e)) from None


def validation_message(error: ValidationError) -> str:
    """One line naming each bad field; a value matching no member of a union is one entry."""
    entries: dict[str, list[str] | None] = {}  # text, or union path → member types
    for err in error.errors():
        if err["type"] == "json_invalid":
            return f"malformed JSON body: {err['msg']}"
        path, member = _split_union(err["loc"])
        if member is None:
            entries.setdefault(f"{path or 'request body'}: {err['msg']}", None)
        elif member not in entries.setdefault(path, []):
            entries[path].append(member)
    texts = [
        key if members is None else f"{key}: Input should be one of {', '.join(members)}"
        for key, members in entries.items()
    ]
    more = len(texts) - MAX_LISTED_ERRORS
    listed = "; ".join(texts[:MAX_LISTED_ERRORS])
    return f"{listed}; and {more} more" if more > 0 else listed


def _split_union(loc: tuple) -> tuple[str, str | None]:
    """(dotted path, union member) of an error location; pydantic names a union member by its
    type ('str', 'list[int]', 'ContentPart'), which no field name here looks like."""
    for i, part in enumerate(loc):
        if isinstance(part, str) and (part in _SCALAR_TAGS or "[" in part or part[:1].isupper()):
            return ".".join(str(p) for p in loc[:i]), part
    return ".".join(str(p) for p in loc), None


_SCALAR_TAGS = {"str", "int", "float", "bool", "none", "dict"}


def check_model(tm: Any, model: str | None) -> None:
    if model is None or model in (tm.served_model_name, tm.model_path):
        return
    raise OpenAIError(
        f"The model '{model}' does not exist; this server serves '{tm.served_model_name}'."
    )


def finish_reason(meta_info: dict) -> str | None:
    """SGLang's finish reason → OpenAI's; an aborted request becomes an error."""
    reason = meta_info.get("finish_reason")
    if reason is None:
        return None
    kind = reason.get("type")
    if kind == "abort":
        status = reason.get("status_code") or 400
        message = reason.get("message") or "the request was aborted"
        raise OpenAIError(message, status, reason.get("err_type") or _error_type(status))
    return "length" if kind == "length" else "stop"


def _error_type(status: int) -> str:
    return "BadRequestError" if status < 500 else "InternalServerError"


def usage_of(metas: list[dict], n: int = 1) -> UsageInfo:
    """Usage of the choices' final meta infos; with ``n`` samples per prompt (a prompt's
    samples together) each prompt counts once."""
    prompt = sum(meta.get("prompt_tokens", 0) for meta in metas[::n])
    cached = sum(meta.get("cached_tokens", 0) for meta in metas[::n])
    completion = sum(meta.get("completion_tokens", 0) for meta in metas)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def sglext_of(req: Any, metas: list[dict], n: int = 1) -> SglExt | None:
    """SGLang's response extension, when the request asked for cached-token details."""
    if not getattr(req, "return_cached_tokens_details", False):
        return None
    cached = sum(meta.get("cached_tokens", 0) for meta in metas[::n])
    return SglExt(cached_tokens_details=CachedTokensDetails(device=cached))


def token_text(tokenizer: Any, entry: Any) -> str:
    """The text of a (logprob, token_id, text) entry; decoded here when the runtime left it out."""
    text = entry[2] if len(entry) > 2 else None
    return text if text is not None else tokenizer.decode([entry[1]])


def top_rows(meta_info: dict, start: int, stop: int) -> list[list | None]:
    """Top-logprob rows for output positions [start, stop), None where the runtime has none."""
    rows = meta_info.get("output_top_logprobs") or []
    got = list(islice(rows, start, stop))
    return got + [None] * (stop - start - len(got))


@dataclass
class ChoiceStream:
    """What one streamed choice has sent so far, to turn cumulative outputs into deltas."""

    num_chars: int = 0
    num_tokens: int = 0
    num_logprobs: int = 0
    logprob_chars: int = 0  # text offset of the next logprob token (completions)
    meta_info: dict = field(default_factory=dict)

    def text_delta(self, text: str) -> str:
        delta = text[self.num_chars :]
        self.num_chars = max(self.num_chars, len(text))
        return delta

    def new_tokens(self, meta_info: dict) -> int:
        """Tokens generated since the last call. A token whose text the detokenizer holds back
        (an incomplete UTF-8 sequence, a special token) still gets its chunk, with empty text,
        as vLLM sends it: a client times each token's arrival by its chunk."""
        total = meta_info.get("completion_tokens") or 0
        new, self.num_tokens = total - self.num_tokens, max(self.num_tokens, total)
        return max(new, 0)

    def new_logprob_range(self, meta_info: dict) -> tuple[int, int]:
        start = self.num_logprobs
        self.num_logprobs = len(meta_info.get("output_token_logprobs") or [])
        return start, self.num_logprobs
