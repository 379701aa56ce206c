"""Messages between the tokenizer, scheduler and detokenizer (plain dataclasses, picklable).

Logprob entries travel as ``(logprob, token_id)`` pairs (logprob None for the first prompt
token); top-logprob entries as a list of such pairs per position (None for the first prompt
token). The tokenizer side adds the text when it builds ``meta_info``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from srt.sampling.sampling_params import SamplingParams

LogprobPair = tuple[float | None, int]
TopLogprobs = list[LogprobPair] | None


# SGLang's GenerateReqInput fields that srt does not implement, with the values (besides null)
# that leave them unused; clients such as sglang.bench_serving send some of them on every
# request. Any other value is refused with the field's name, never ignored.
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    **dict.fromkeys(
        """
        session_id input_embeds image_data video_data audio_data mm_hashes mm_content_hashes
        video_config watermark token_ids_logprob sampling_logprobs_mode modalities
        session_params lora_path lora_id custom_logit_processor positional_embed_overrides
        bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key decode_tp_size
        routed_dp_rank data_parallel_rank disagg_prefill_dp_rank kv_router_hint routing_key
        conversation_id http_worker_ipc max_thinking_tokens priority extra_key custom_labels
        external_trace_header received_time need_wait_for_mm_inputs num_items_assigned
        encoder_urls max_dynamic_patch min_dynamic_patch image_max_dynamic_patch
        video_max_dynamic_patch images_config mm_processor_kwargs multi_item_delimiter_indices
        token_indices_to_pool cache_salt kv_hints
        """.split(),
        (),
    ),
    **dict.fromkeys(
        """
        use_audio_in_video return_sampling_mask return_flat_raw_top_logprobs
        return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64
        return_hidden_states return_routed_experts return_indexer_topk background
        require_reasoning return_bytes return_entropy return_prompt_token_ids
        """.split(),
        (False,),
    ),
    "routed_experts_start_len": (0,),
}


# Whole-request flags of GenerateReqInput and their defaults (null means the default).
_FLAGS = {"stream": False, "return_text_in_logprobs": False, "log_metrics": True, "no_logs": False}


def is_unset(value: Any, unused: tuple) -> bool:
    """Null, one of the values that leave a field unused, or a list of such (one per prompt)."""
    if isinstance(value, list):
        return all(is_unset(v, unused) for v in value)
    return value is None or any(type(value) is type(u) and value == u for u in unused)


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


@dataclass
class GenerateReqInput:
    """A /generate request: one prompt or a batch (SGLang's fields)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False  # each logprob entry carries its token's text
    stream: bool = False
    log_metrics: bool = True  # False: left out of /metrics (health checks)
    no_logs: bool = False  # nothing of a request's content is logged in any case
    # Set by normalize_batch_and_arguments().
    is_single: bool = True
    batch_size: int = 1

    def normalize_batch_and_arguments(self) -> None:
        """Check the prompt fields and expand every per-request field to a list when batched."""
        self._check_prompt()
        n = self.batch_size
        self.sampling_params = self._expand("sampling_params", self.sampling_params, dict, {})
        self.return_logprob = self._expand("return_logprob", self.return_logprob, bool, False)
        self.logprob_start_len = self._expand("logprob_start_len", self.logprob_start_len, int, -1)
        self.top_logprobs_num = self._expand("top_logprobs_num", self.top_logprobs_num, int, 0)
        if self.rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
            self.rid = rids[0] if self.is_single else rids
        self.rid = self._expand("rid", self.rid, str, None)
        if len(set(self.rid)) != n:
            raise ValueError("rid: request ids in a batch must be distinct")
        for name, default in _FLAGS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
            elif not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")

    def _check_prompt(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("exactly one of text and input_ids must be given")
        if self.text is not None:
            if isinstance(self.text, str):
                self.is_single, self.text = True, [self.text]
            elif (
                isinstance(self.text, list)
                and self.text
                and all(isinstance(t, str) for t in self.text)
            ):
                self.is_single = False
            else:
                raise ValueError("text must be a string or a non-empty list of strings")
            self.batch_size = len(self.text)
            return
        if _is_token_list(self.input_ids) and self.input_ids:
            self.is_single, self.input_ids = True, [self.input_ids]
        elif (
            isinstance(self.input_ids, list)
            and self.input_ids
            and all(_is_token_list(x) and x for x in self.input_ids)
        ):
            self.is_single = False
        else:
            raise ValueError("input_ids must be a non-empty list of ints or of such lists")
        self.batch_size = len(self.input_ids)

    def _expand(self, name: str, value: Any, kind: type, default: Any) -> list:
        if value is None:
            return [default] * self.batch_size
        if isinstance(value, list):
            if self.is_single and kind is not list:
                raise ValueError(f"{name}: a list was given for a single prompt")
            if len(value) != self.batch_size:
                raise ValueError(
                    f"{name}: {len(value)} values for a batch of {self.batch_size} prompts"
                )
            items = value
        else:
            items = [value] * self.batch_size
        for item in items:
            ok = item is None or (
                isinstance(item, kind) and not (kind is int and isinstance(item, bool))
            )
            if not ok:
                raise ValueError(f"{name} must be {kind.__name__}, got {item!r}")
        return [default if item is None else item for item in items]

    def __getitem__(self, i: int) -> GenerateReqInput:
        """The i-th request of a normalized batch, as a single request."""
        return GenerateReqInput(
            text=None if self.text is None else self.text[i],
            input_ids=None if self.input_ids is None else self.input_ids[i],
            sampling_params=self.sampling_params[i],
            rid=self.rid[i],
            return_logprob=self.return_logprob[i],
            logprob_start_len=self.logprob_start_len[i],
            top_logprobs_num=self.top_logprobs_num[i],
            return_text_in_logprobs=self.return_text_in_logprobs,
            stream=self.stream,
            log_metrics=self.log_metrics,
            no_logs=self.no_logs,
        )


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    stream: bool = False


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool  # False when the scheduler was busy (the cache is flushed only when idle)


@dataclass
class ExpertDistributionReq:
    action: str  # start | stop | dump (the /…_expert_distribution_record routes)


@dataclass
class ExpertDistributionReqOutput:
    logical_count: list | None  # dump: this DP group's [layers, experts] counts
    error: str | None = None


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    state: dict  # Scheduler.get_internal_state()


@dataclass
class SchedulerFailure:
    """Entry rank → tokenizer manager, just before the rank exits: why (a hung step, a lost
    peer), so that the requests in flight end with that message."""

    message: str


@dataclass
class WakeUp:
    """DP controller → the groups a request did not go to: leave the idle poll now, since the
    group that got it needs every rank in the next MLP-sync step."""


@dataclass
class DpLoadReport:
    """An attention-DP group's entry rank → the DP controller, when its load changes."""

    dp_rank: int
    num_reqs: int  # running + waiting
    num_tokens: int  # tokens in use and still to prefill


@dataclass
class BatchTokenIDOutput:
    """One scheduler step's news for some requests: the token ids generated since the last
    message for that rid (``output_ids`` are deltas) and, once finished, the finish reason."""

    rids: list[str]
    finished_reasons: list[dict | None]
    output_ids: list[list[int]]  # new ids since the previous message of this rid
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    # Deltas as well; empty lists when logprobs were not asked for.
    input_token_logprobs: list[list[LogprobPair]] = field(default_factory=list)
    input_top_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
    output_token_logprobs: list[list[LogprobPair]] = field(default_factory=list)
    output_top_logprobs: list[list[TopLogprobs]] = field(default_factory=list)


@dataclass
class BatchStrOutput:
    """The detokenizer's answer to a BatchTokenIDOutput: ``output_strs`` is the whole text so
    far (stop strings trimmed once finished); other fields as in BatchTokenIDOutput."""

    rids: list[str]
    finished_reasons: list[dict | None]
    output_strs: list[str]
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    input_token_logprobs: list[list[LogprobPair]] = field(default_factory=list)
    input_top_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
    output_token_logprobs: list[list[LogprobPair]] = field(default_factory=list)
    output_top_logprobs: list[list[TopLogprobs]] = field(default_factory=list)
