"""POST /v1/chat/completions: messages → the model's chat template → token ids → a reply.

The template is rendered as text and then tokenized without special tokens, because the
template already holds them (a BOS added again by ``encode`` would be a second one).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from srt.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
)
from srt.entrypoints.openai.serving_base import OpenAIServingBase, RequestContext
from srt.entrypoints.openai.utils import (
    ChoiceStream,
    OpenAIError,
    finish_reason,
    token_text,
    top_rows,
    usage_of,
)
from srt.managers.io_struct import GenerateReqInput

# OpenAI's "developer" role is the newer name of "system", which chat templates know.
SUPPORTED_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
}


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Messages as the chat template expects them: a role and a plain-text content."""
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, message in enumerate(messages):
        role = SUPPORTED_ROLES.get(message.role)
        if role is None:
            raise ValueError(f"messages[{i}].role: '{message.role}' is not supported")
        content = message.content
        if isinstance(content, list):
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ValueError(
                        f"messages[{i}].content: only text parts are supported, got '{part.type}'"
                    )
            content = "".join(part.text for part in content)
        out.append({"role": role, "content": content or ""})
    return out


def chat_prompt_ids(
    tokenizer: Any, messages: list[ChatMessage], template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    conversation = message_dicts(messages)
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **(template_kwargs or {})
        )
    except Exception as e:  # no template, or the template refuses the conversation (jinja)
        raise OpenAIError(f"cannot apply the chat template: {e}") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_logprobs(
    tokenizer: Any, meta_info: dict, start: int, stop: int, num_top: int
) -> ChatLogprobs:
    entries = (meta_info.get("output_token_logprobs") or [])[start:stop]
    content = []
    for entry, row in zip(entries, top_rows(meta_info, start, stop)):
        tops = [ChatTopLogprob(**_logprob_fields(tokenizer, e)) for e in (row or [])[:num_top]]
        content.append(ChatTokenLogprob(**_logprob_fields(tokenizer, entry), top_logprobs=tops))
    return ChatLogprobs(content=content)


def _logprob_fields(tokenizer: Any, entry: Any) -> dict[str, Any]:
    text = token_text(tokenizer, entry)
    return {"token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8"))}


class OpenAIServingChat(OpenAIServingBase):
    request_cls = ChatCompletionRequest
    id_prefix = "chatcmpl-"

    def build_inputs(
        self, req: ChatCompletionRequest, ctx: RequestContext
    ) -> list[GenerateReqInput]:
        input_ids = chat_prompt_ids(self.tm.tokenizer, req.messages, req.chat_template_kwargs)
        return [
            GenerateReqInput(
                input_ids=input_ids,
                sampling_params=req.sampling_params(self._max_new_tokens(req, len(input_ids))),
                rid=ctx.rid(0, 1),
                return_logprob=req.logprobs,
                top_logprobs_num=req.top_logprobs or 0,
                stream=req.stream,
            )
        ]

    def _max_new_tokens(self, req: ChatCompletionRequest, prompt_len: int) -> int:
        if req.max_completion_tokens is not None:
            return req.max_completion_tokens
        if req.max_tokens is not None:
            return req.max_tokens
        # OpenAI's default: as long as the context allows.
        room = self.tm.context_len - prompt_len
        if room <= 0:
            raise ValueError(
                f"the prompt has {prompt_len} tokens, which leaves no room in the model's "
                f"context of {self.tm.context_len} tokens"
            )
        return room

    def build_response(
        self, req: ChatCompletionRequest, ctx: RequestContext, outs: list[dict]
    ) -> ChatCompletionResponse:
        choices = []
        for index, out in enumerate(outs):
            meta = out["meta_info"]
            num_tokens = len(meta.get("output_token_logprobs") or [])
            choices.append(
                ChatCompletionChoice(
                    index=index,
                    message=ChatResponseMessage(content=out["text"]),
                    logprobs=self._logprobs(req, meta, 0, num_tokens),
                    finish_reason=finish_reason(meta),
                )
            )
        return ChatCompletionResponse(
            id=ctx.request_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            usage=usage_of([out["meta_info"] for out in outs], req.n),
        )

    async def stream_chunks(
        self,
        req: ChatCompletionRequest,
        ctx: RequestContext,
        num_choices: int,
        outs: AsyncIterator[tuple[int, dict]],
    ) -> AsyncGenerator[ChatCompletionStreamResponse, None]:
        states = [ChoiceStream() for _ in range(num_choices)]
        for index in range(num_choices):
            yield self._chunk(ctx, index, DeltaMessage(role="assistant", content=""))
        async for index, out in outs:
            state, meta = states[index], out["meta_info"]
            state.meta_info = meta
            reason = finish_reason(meta)
            text = state.text_delta(out["text"])
            start, stop = state.new_logprob_range(meta)
            logprobs = self._logprobs(req, meta, start, stop) if start < stop else None
            if text or logprobs is not None:
                yield self._chunk(ctx, index, DeltaMessage(content=text), logprobs)
            if reason is not None:
                yield self._chunk(ctx, index, DeltaMessage(), reason=reason)
        if req.include_usage:
            usage = usage_of([state.meta_info for state in states], req.n)
            yield ChatCompletionStreamResponse(
                id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[], usage=usage
            )

    def _logprobs(
        self, req: ChatCompletionRequest, meta: dict, start: int, stop: int
    ) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return chat_logprobs(self.tm.tokenizer, meta, start, stop, req.top_logprobs or 0)

    @staticmethod
    def _chunk(
        ctx: RequestContext,
        index: int,
        delta: DeltaMessage,
        logprobs: ChatLogprobs | None = None,
        reason: str | None = None,
    ) -> ChatCompletionStreamResponse:
        choice = ChatCompletionStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=reason
        )
        return ChatCompletionStreamResponse(
            id=ctx.request_id, created=ctx.created, model=ctx.model, choices=[choice]
        )
