"""POST /v1/chat/completions: messages → the model's chat template → token ids → a reply.

The template is rendered as text and then tokenized without special tokens, because the
template already holds them (a BOS added again by ``encode`` would be a second one).
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from srt.constrained.grammar import KINDS
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
    FunctionCall,
    ToolCall,
    ToolCallDelta,
)
from srt.entrypoints.openai.serving_base import OpenAIServingBase, RequestContext
from srt.entrypoints.openai.tool_calls import (
    ToolCallOut,
    ToolCallStream,
    active_tools,
    forced_tools,
    parse_tool_calls,
    tool_call_ebnf,
)
from srt.entrypoints.openai.utils import (
    ChoiceStream,
    OpenAIError,
    finish_reason,
    sglext_of,
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
    "tool": "tool",
}


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: a role, a plain-text content, and an
    assistant's tool calls or a tool's call id."""
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
        entry = {"role": role, "content": content or ""}
        if message.tool_calls:  # templates take the arguments as a dict
            entry["tool_calls"] = [_template_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _template_call(call: Any) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise ValueError(f"tool call {call.id}: arguments are not JSON") from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}


def chat_prompt_ids(
    tokenizer: Any,
    messages: list[ChatMessage],
    template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    conversation = message_dicts(messages)
    kwargs = dict(template_kwargs or {})
    if tools:
        kwargs["tools"] = [{"type": "function", "function": tool} for tool in tools]
    try:
        text = tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True, **kwargs
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
        tools = active_tools(req.tools, req.tool_choice)
        if tools and self.tm.tool_call_parser is None:
            raise ValueError(
                "tools need a tool-call parser: start the server with --tool-call-parser"
            )
        input_ids = chat_prompt_ids(
            self.tm.tokenizer, req.messages, req.chat_template_kwargs, tools
        )
        params = req.sampling_params(self._max_new_tokens(req, len(input_ids)))
        forced = forced_tools(tools, req.tool_choice)
        if forced:
            if any(params.get(kind) for kind in KINDS):
                raise ValueError("a forced tool_choice cannot be combined with another grammar")
            params["ebnf"] = tool_call_ebnf(forced)
        return [
            GenerateReqInput(
                input_ids=input_ids,
                sampling_params=params,
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
        names = {tool["name"] for tool in active_tools(req.tools, req.tool_choice)}
        choices = []
        for index, out in enumerate(outs):
            meta = out["meta_info"]
            num_tokens = len(meta.get("output_token_logprobs") or [])
            reason = finish_reason(meta)
            content, calls = parse_tool_calls(out["text"], names) if names else (out["text"], [])
            if req.parallel_tool_calls is False:
                calls = calls[:1]
            choices.append(
                ChatCompletionChoice(
                    index=index,
                    message=ChatResponseMessage(
                        content=content, tool_calls=[_tool_call(c) for c in calls] or None
                    ),
                    logprobs=self._logprobs(req, meta, 0, num_tokens),
                    finish_reason="tool_calls" if calls else reason,
                )
            )
        return ChatCompletionResponse(
            id=ctx.request_id,
            created=ctx.created,
            model=ctx.model,
            choices=choices,
            sglext=sglext_of(req, [out["meta_info"] for out in outs], req.n),
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
        names = {tool["name"] for tool in active_tools(req.tools, req.tool_choice)}
        calls = [ToolCallStream(names) for _ in range(num_choices)] if names else None
        for index in range(num_choices):
            yield self._chunk(ctx, index, DeltaMessage(role="assistant", content=""))
        unfinished = num_choices
        async for index, out in outs:
            state, meta = states[index], out["meta_info"]
            state.meta_info = meta
            reason = finish_reason(meta)
            text = state.text_delta(out["text"])
            start, stop = state.new_logprob_range(meta)
            logprobs = self._logprobs(req, meta, start, stop) if start < stop else None
            new_tokens = state.new_tokens(meta)
            if calls is None:
                # a new token gets its chunk even with empty text; the last one rides the finish
                if text or logprobs is not None or (new_tokens and reason is None):
                    yield self._chunk(ctx, index, DeltaMessage(content=text), logprobs)
            else:
                one = req.parallel_tool_calls is False
                for delta in _tool_stream_deltas(calls[index], text, reason is not None, one):
                    yield self._chunk(ctx, index, delta, logprobs)
                    logprobs = None
                if reason is not None and calls[index].num_calls:
                    reason = "tool_calls"
            if reason is not None:
                unfinished -= 1
                chunk = self._chunk(ctx, index, DeltaMessage(), reason=reason)
                if not unfinished:  # SGLang's cache report rides on the last finish chunk
                    chunk.sglext = sglext_of(req, [s.meta_info for s in states], req.n)
                yield chunk
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


def _tool_call(call: ToolCallOut, index: int | None = None) -> ToolCall:
    function = FunctionCall(name=call.name, arguments=call.arguments)
    if index is None:
        return ToolCall(id=call.id, function=function)
    return ToolCallDelta(id=call.id, function=function, index=index)


def _tool_stream_deltas(
    stream: ToolCallStream, text: str, finished: bool, only_one: bool
) -> list[DeltaMessage]:
    """The deltas of one streamed choice's new text: its plain text, then each call it
    completed (indexed from 0 in the choice; with ``only_one``, the first call only)."""
    plain, calls = stream.feed(text)
    if finished:
        plain += stream.finish()
    deltas = [DeltaMessage(content=plain)] if plain else []
    first = stream.num_calls - len(calls)
    if only_one:
        calls = calls[: max(1 - first, 0)]
    deltas += [
        DeltaMessage(tool_calls=[_tool_call(call, first + i)]) for i, call in enumerate(calls)
    ]
    return deltas
