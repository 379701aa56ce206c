"""POST /v1/completions: prompts (text or token ids, one or several) → text completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from itertools import accumulate
from typing import Any

from srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from srt.entrypoints.openai.serving_base import OpenAIServingBase, RequestContext
from srt.entrypoints.openai.utils import (
    ChoiceStream,
    finish_reason,
    token_text,
    top_rows,
    usage_of,
)
from srt.managers.io_struct import GenerateReqInput

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for the legacy completions API


def split_prompts(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's prompt forms → one entry per prompt (a string or a list of token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompt must not be empty")
    return prompts


def completion_logprobs(
    tokenizer: Any, meta_info: dict, start: int, stop: int, text_offset: int, num_top: int
) -> CompletionLogprobs:
    """The legacy logprobs object for output tokens [start, stop); offsets count from the
    start of the completion text (echo is not supported)."""
    entries = (meta_info.get("output_token_logprobs") or [])[start:stop]
    tokens = [token_text(tokenizer, entry) for entry in entries]
    offsets = list(accumulate((len(t) for t in tokens), initial=text_offset))[:-1]
    top_logprobs = None
    if num_top > 0:
        top_logprobs = [
            None if row is None else {token_text(tokenizer, e): e[0] for e in row[:num_top]}
            for row in top_rows(meta_info, start, stop)
        ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[entry[0] for entry in entries],
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


class OpenAIServingCompletion(OpenAIServingBase):
    request_cls = CompletionRequest
    id_prefix = "cmpl-"

    def build_inputs(self, req: CompletionRequest, ctx: RequestContext) -> list[GenerateReqInput]:
        prompts = split_prompts(req.prompt)
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = req.sampling_params(max_tokens)
        return [
            GenerateReqInput(
                text=prompt if isinstance(prompt, str) else None,
                input_ids=None if isinstance(prompt, str) else list(prompt),
                sampling_params=dict(params),
                rid=ctx.rid(index, len(prompts)),
                return_logprob=req.logprobs is not None,
                top_logprobs_num=req.logprobs or 0,
                stream=req.stream,
            )
            for index, prompt in enumerate(prompts)
        ]

    def build_response(
        self, req: CompletionRequest, ctx: RequestContext, outs: list[dict]
    ) -> CompletionResponse:
        choices = []
        for index, out in enumerate(outs):
            meta = out["meta_info"]
            num_tokens = len(meta.get("output_token_logprobs") or [])
            choices.append(
                CompletionChoice(
                    index=index,
                    text=out["text"],
                    logprobs=self._logprobs(req, meta, 0, num_tokens, 0),
                    finish_reason=finish_reason(meta),
                )
            )
        return self._response(ctx, choices, usage_of([out["meta_info"] for out in outs]))

    async def stream_chunks(
        self,
        req: CompletionRequest,
        ctx: RequestContext,
        num_choices: int,
        outs: AsyncIterator[tuple[int, dict]],
    ) -> AsyncGenerator[CompletionResponse, None]:
        states = [ChoiceStream() for _ in range(num_choices)]
        async for index, out in outs:
            state, meta = states[index], out["meta_info"]
            state.meta_info = meta
            reason = finish_reason(meta)
            text = state.text_delta(out["text"])
            logprobs = self._stream_logprobs(req, state, meta)
            if text or logprobs is not None:
                yield self._response(
                    ctx, [CompletionChoice(index=index, text=text, logprobs=logprobs)]
                )
            if reason is not None:
                yield self._response(
                    ctx, [CompletionChoice(index=index, text="", finish_reason=reason)]
                )
        if req.include_usage:
            yield self._response(ctx, [], usage_of([state.meta_info for state in states]))

    def _stream_logprobs(
        self, req: CompletionRequest, state: ChoiceStream, meta: dict
    ) -> CompletionLogprobs | None:
        start, stop = state.new_logprob_range(meta)
        if req.logprobs is None or start == stop:
            return None
        logprobs = self._logprobs(req, meta, start, stop, state.logprob_chars)
        state.logprob_chars += sum(len(token) for token in logprobs.tokens)
        return logprobs

    def _logprobs(
        self, req: CompletionRequest, meta: dict, start: int, stop: int, text_offset: int
    ) -> CompletionLogprobs | None:
        if req.logprobs is None:
            return None
        tokenizer = self.tm.tokenizer
        return completion_logprobs(tokenizer, meta, start, stop, text_offset, req.logprobs)

    @staticmethod
    def _response(ctx: RequestContext, choices: list, usage: Any = None) -> CompletionResponse:
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )
