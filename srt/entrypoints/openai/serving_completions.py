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
    sglext_of,
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
    tokenizer: Any, entries: list, rows: list, text_offset: int, num_top: int
) -> CompletionLogprobs:
    """The legacy logprobs object for (logprob, id[, text]) entries and their top-logprob rows
    (None where there are none); offsets count from ``text_offset``."""
    tokens = [token_text(tokenizer, entry) for entry in entries]
    offsets = list(accumulate((len(t) for t in tokens), initial=text_offset))[:-1]
    top_logprobs = None
    if num_top > 0:
        top_logprobs = [
            None if row is None else {token_text(tokenizer, e): e[0] for e in row[:num_top]}
            for row in rows
        ]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[entry[0] for entry in entries],
        top_logprobs=top_logprobs,
        text_offset=offsets,
    )


def prompt_logprob_rows(meta_info: dict) -> tuple[list, list]:
    """The prompt's entries and top rows (echo); the first token has no logprob."""
    entries = meta_info.get("input_token_logprobs") or []
    rows = list(meta_info.get("input_top_logprobs") or [])
    return entries, rows + [None] * (len(entries) - len(rows))


class OpenAIServingCompletion(OpenAIServingBase):
    request_cls = CompletionRequest
    id_prefix = "cmpl-"

    def build_inputs(self, req: CompletionRequest, ctx: RequestContext) -> list[GenerateReqInput]:
        prompts = split_prompts(req.prompt)
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        params = req.sampling_params(max_tokens)
        echo_logprobs = req.echo and req.logprobs is not None
        return [
            GenerateReqInput(
                text=prompt if isinstance(prompt, str) else None,
                input_ids=None if isinstance(prompt, str) else list(prompt),
                sampling_params=dict(params),
                rid=ctx.rid(index, len(prompts)),
                return_logprob=req.logprobs is not None,
                logprob_start_len=0 if echo_logprobs else None,
                top_logprobs_num=req.logprobs or 0,
                stream=req.stream,
            )
            for index, prompt in enumerate(prompts)
        ]

    def _echo_text(self, req: CompletionRequest, choice: int) -> str:
        """The prompt of a choice, when echoed (choices are n per prompt)."""
        if not req.echo:
            return ""
        prompt = split_prompts(req.prompt)[choice // req.n]
        return prompt if isinstance(prompt, str) else self.tm.tokenizer.decode(prompt)

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
                    text=self._echo_text(req, index) + out["text"],
                    logprobs=self._logprobs(req, meta, 0, num_tokens, 0, echo=req.echo),
                    finish_reason=finish_reason(meta),
                )
            )
        metas = [out["meta_info"] for out in outs]
        response = self._response(ctx, choices, usage_of(metas, req.n))
        response.sglext = sglext_of(req, metas, req.n)
        return response

    async def stream_chunks(
        self,
        req: CompletionRequest,
        ctx: RequestContext,
        num_choices: int,
        outs: AsyncIterator[tuple[int, dict]],
    ) -> AsyncGenerator[CompletionResponse, None]:
        states = [ChoiceStream() for _ in range(num_choices)]
        echo_pending = [req.echo] * num_choices  # the prompt goes out with the first chunk
        unfinished = num_choices
        async for index, out in outs:
            state, meta = states[index], out["meta_info"]
            state.meta_info = meta
            reason = finish_reason(meta)
            echo, echo_pending[index] = echo_pending[index], False
            text = (self._echo_text(req, index) if echo else "") + state.text_delta(out["text"])
            logprobs = self._stream_logprobs(req, state, meta, echo)
            new_tokens = state.new_tokens(meta)
            # Every new token gets a chunk, even with empty text; the last one carries the
            # finish reason (as SGLang and vLLM send it), and a finish without news gets one.
            if not (text or logprobs is not None or new_tokens or reason is not None):
                continue
            choice = CompletionChoice(
                index=index, text=text, logprobs=logprobs, finish_reason=reason
            )
            chunk = self._response(ctx, [choice])
            if reason is not None:
                unfinished -= 1
                if not unfinished:  # SGLang's cache report rides on the last finish chunk
                    chunk.sglext = sglext_of(req, [s.meta_info for s in states], req.n)
            yield chunk
        if req.include_usage:
            yield self._response(ctx, [], usage_of([s.meta_info for s in states], req.n))

    def _stream_logprobs(
        self, req: CompletionRequest, state: ChoiceStream, meta: dict, echo: bool
    ) -> CompletionLogprobs | None:
        start, stop = state.new_logprob_range(meta)
        if req.logprobs is None or (start == stop and not echo):
            return None
        logprobs = self._logprobs(req, meta, start, stop, state.logprob_chars, echo)
        state.logprob_chars += sum(len(token) for token in logprobs.tokens)
        return logprobs

    def _logprobs(
        self,
        req: CompletionRequest,
        meta: dict,
        start: int,
        stop: int,
        text_offset: int,
        echo: bool = False,
    ) -> CompletionLogprobs | None:
        """Logprobs of output tokens [start, stop), after the prompt's with ``echo``."""
        if req.logprobs is None:
            return None
        entries = (meta.get("output_token_logprobs") or [])[start:stop]
        rows = top_rows(meta, start, stop)
        if echo:
            prompt_entries, prompt_rows = prompt_logprob_rows(meta)
            entries, rows = prompt_entries + entries, prompt_rows + rows
        tokenizer = self.tm.tokenizer
        return completion_logprobs(tokenizer, entries, rows, text_offset, req.logprobs)

    @staticmethod
    def _response(ctx: RequestContext, choices: list, usage: Any = None) -> CompletionResponse:
        return CompletionResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=choices, usage=usage
        )
