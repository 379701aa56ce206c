"""The OpenAI wire format: request models (with SGLang's sampling extras) and response and
stream-chunk models for /v1/completions, /v1/chat/completions and /v1/models.

Unknown request fields are ignored, as OpenAI does. Fields of features this server does not
implement (OpenAI's and SGLang's extras) are accepted at the values that leave them unused and
refused by ``check_supported``, naming them, when set to anything else.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from srt.managers.io_struct import is_unset

MAX_TOP_LOGPROBS = 20

# SGLang's request extras that srt does not implement, with the values that leave them unused.
_UNSUPPORTED_EXTRAS: dict[str, tuple] = {
    **dict.fromkeys(
        """
        lora_path session_id session_params custom_params
        custom_logit_processor watermark images_config mm_processor_kwargs data_parallel_rank
        rid extra_key cache_salt priority custom_labels sampling_logprobs_mode reasoning_effort
        thinking task max_dynamic_patch min_dynamic_patch video_config input_ids
        """.split(),
        (),
    ),
    **dict.fromkeys(
        """
        return_hidden_states return_routed_experts
        return_spec_tokens_details return_token_ids return_prompt_token_ids return_meta_info
        return_input_ids_in_sglext return_output_ids_in_sglext return_sampling_mask
        return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64
        continue_final_message use_audio_in_video
        """.split(),
        (False,),
    ),
    "routed_experts_start_len": (0,),
    # Only read with a reasoning parser, which this server has none of: any value is a no-op.
    "separate_reasoning": (True, False),
    "stream_reasoning": (True, False),
}


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIBaseModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBaseModel):
    type: str
    json_schema: JsonSchemaFormat | None = None

    def grammar(self) -> dict[str, str]:
        """The sampling parameter that constrains the output to this format."""
        if self.type == "text":
            return {}
        if self.type == "json_object":
            return {"json_schema": '{"type": "object"}'}
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise ValueError("response_format of type json_schema needs json_schema.schema")
            return {"json_schema": json.dumps(self.json_schema.schema_)}
        raise ValueError(f"response_format of type '{self.type}' is not supported")


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat: the model, streaming, and sampling."""

    model_config = ConfigDict(extra="allow")  # kept, so check_supported sees SGLang's extras
    unsupported_extras: ClassVar[dict[str, tuple]] = _UNSUPPORTED_EXTRAS

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # SGLang's extras.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    stop_regex: str | list[str] | None = None
    no_stop_trim: bool | None = None
    response_format: ResponseFormat | None = None
    return_cached_tokens_details: bool = False  # SGLang: sglext.cached_tokens_details
    # SGLang's constraints (structured output), besides response_format.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_supported(self) -> None:
        """Raise ValueError for a feature this server does not implement."""
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        extras = self.model_extra or {}
        refused = sorted(
            name
            for name, unused in self.unsupported_extras.items()
            if name in extras and not is_unset(extras[name], unused)
        )
        if refused:
            raise ValueError(f"not supported by this server: {', '.join(refused)}")
        if self.response_format is not None:
            self.response_format.grammar()  # raises for a type or schema it cannot follow

    def sampling_params(self, max_new_tokens: int | None) -> dict[str, Any]:
        """SGLang's sampling_params dict; unset fields are left to the runtime's defaults."""
        params = {
            "max_new_tokens": max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_new_tokens": self.min_tokens,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "sampling_seed": self.seed,
            "stop_regex": self.stop_regex,
            "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias,
            "n": self.n if self.n > 1 else None,
            "json_schema": self.json_schema,
            "regex": self.regex,
            "ebnf": self.ebnf,
        }
        if self.response_format is not None:
            for name, value in self.response_format.grammar().items():
                if params[name] is not None:
                    raise ValueError(f"response_format and {name} cannot both be given")
                params[name] = value
        return {name: value for name, value in params.items() if value is not None}


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of > 1 is not supported (best_of={self.best_of})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class FunctionDef(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCall(OpenAIBaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(OpenAIBaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: int


class ChatMessage(OpenAIBaseModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the template

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions or self.function_call not in (None, "none", "auto"):
            raise ValueError("functions and function_call are not supported; use tools")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        names = [tool.function.name for tool in self.tools or ()]
        if (
            isinstance(self.tool_choice, NamedToolChoice)
            and self.tool_choice.function.name not in names
        ):
            raise ValueError(f"tool_choice: no tool named '{self.tool_choice.function.name}'")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ValueError("top_logprobs requires logprobs to be true")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ValueError(
                    f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"
                )


# ---------------------------------------------------------------------------- responses
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CachedTokensDetails(OpenAIBaseModel):
    """SGLang's split of cached prompt tokens by cache tier: srt has one, the KV cache in the
    model's memory ("device")."""

    device: int = 0
    host: int = 0


class SglExt(OpenAIBaseModel):
    """SGLang's extension object on responses (``return_cached_tokens_details``)."""

    cached_tokens_details: CachedTokensDetails | None = None


class _OptionalUsage(OpenAIBaseModel):
    """Stream chunks carry ``usage`` only in the final usage chunk; the key is left out
    elsewhere, and so is SGLang's ``sglext`` unless asked for. Subclasses declare ``usage``
    last, where OpenAI puts it."""

    @model_serializer(mode="wrap")
    def _drop_empty_usage(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for key in ("usage", "sglext"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class CompletionLogprobs(OpenAIBaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float | None] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class CompletionResponse(_OptionalUsage):
    """A whole completion, and also one stream chunk (OpenAI uses the same object)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    sglext: SglExt | None = None
    usage: UsageInfo | None = None


class ChatTopLogprob(OpenAIBaseModel):
    token: str
    logprob: float | None
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_no_calls(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionResponse(_OptionalUsage):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    sglext: SglExt | None = None
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class ChatCompletionStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None


class ChatCompletionStreamResponse(_OptionalUsage):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    sglext: SglExt | None = None
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "srt"
    root: str
    max_model_len: int


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorResponse(OpenAIBaseModel):
    object: Literal["error"] = "error"
    message: str
    type: str
    code: int
