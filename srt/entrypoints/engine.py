"""The offline Engine: tokenizes, runs the scheduler loop in-process, detokenizes.

Thin on purpose: requests cross to the Scheduler as TokenizedGenerateReqInput and come back as
BatchTokenIDOutput → DetokenizerManager → BatchStrOutput, the io_struct messages a later
version sends over ZMQ between processes.
"""

from __future__ import annotations

import time
from typing import Any

from srt.managers.detokenizer import DetokenizerManager
from srt.managers.io_struct import (
    AbortReq,
    BatchStrOutput,
    GenerateReqInput,
    TokenizedGenerateReqInput,
)
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
from srt.server_args import ServerArgs


def _with_text(entries: list) -> list:
    """(logprob, id) pairs → (logprob, id, None); top-logprob rows alike (None stays None)."""
    out = []
    for entry in entries:
        if entry is None:
            out.append(None)
        elif isinstance(entry, list):
            out.append([(lp, tid, None) for lp, tid in entry])
        else:
            out.append((entry[0], entry[1], None))
    return out


class _RequestState:
    def __init__(self, obj: GenerateReqInput, created: float):
        self.obj, self.created = obj, created
        self.text, self.output_ids, self.finished_reason = "", [], None
        self.meta: dict[str, Any] = {}
        self.logprobs: dict[str, list] = {
            k: []
            for k in (
                "input_token_logprobs",
                "input_top_logprobs",
                "output_token_logprobs",
                "output_top_logprobs",
            )
        }

    def update(self, out: BatchStrOutput, i: int) -> None:
        self.text = out.output_strs[i]
        self.output_ids.extend(out.output_ids[i])
        self.finished_reason = out.finished_reasons[i]
        self.meta = {
            "prompt_tokens": out.prompt_tokens[i],
            "completion_tokens": out.completion_tokens[i],
            "cached_tokens": out.cached_tokens[i],
        }
        for key, values in self.logprobs.items():
            values.extend(getattr(out, key)[i])

    def result(self) -> dict:
        meta = {"id": self.obj.rid, "finish_reason": self.finished_reason, **self.meta}
        meta["e2e_latency"] = time.perf_counter() - self.created
        if self.obj.return_logprob:
            for key, values in self.logprobs.items():
                meta[key] = _with_text(values)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


class Engine:
    """``srt.Engine(**server_args)``: offline generation in this process."""

    def __init__(self, **kwargs: Any):
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.server_args.tokenizer_path)
        self.scheduler = Scheduler(self.server_args)
        self.detokenizer = DetokenizerManager(self.tokenizer)
        self.vocab_size = self.scheduler.model_config.vocab_size

    def generate(
        self,
        prompt: str | list[str] | list[int] | list[list[int]] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
    ) -> dict | list[dict]:
        """One prompt → one dict; a list of prompts → a list of dicts (SGLang's shapes)."""
        if prompt is not None and not isinstance(prompt, str) and _is_ids(prompt):
            prompt, input_ids = None, prompt
        obj = GenerateReqInput(
            text=prompt,
            input_ids=input_ids,
            sampling_params=sampling_params,
            return_logprob=return_logprob,
            logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num,
        )
        obj.normalize_batch_and_arguments()
        items = [obj[i] for i in range(obj.batch_size)]
        tokenized = [self._tokenize(item) for item in items]  # validates before scheduling
        results = self._run(items, tokenized)
        return results[0] if obj.is_single else results

    def _tokenize(self, obj: GenerateReqInput) -> TokenizedGenerateReqInput:
        input_ids = obj.input_ids
        if input_ids is None:
            input_ids = self.tokenizer.encode(obj.text)
        if not input_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"input_ids: token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        params = SamplingParams.from_dict(obj.sampling_params)
        params.verify(self.vocab_size)
        params.normalize(self.tokenizer)
        return TokenizedGenerateReqInput(
            rid=obj.rid,
            input_text=obj.text,
            input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=obj.return_logprob,
            logprob_start_len=obj.logprob_start_len,
            top_logprobs_num=obj.top_logprobs_num,
            stream=obj.stream,
        )

    def _run(self, items: list[GenerateReqInput], tokenized: list) -> list[dict]:
        now = time.perf_counter()
        states = {item.rid: _RequestState(item, now) for item in items}
        for req in tokenized:
            self.scheduler.add_request(req)
        pending = set(states)
        try:
            while pending:
                self._step(states, pending)
        except BaseException:
            for rid in pending:
                self.scheduler.abort_request(AbortReq(rid))
            raise
        return [states[item.rid].result() for item in items]

    def _step(self, states: dict, pending: set) -> None:
        steps_before = self.scheduler.num_forward_steps
        outputs = self.scheduler.step()
        for out in outputs:
            self._dispatch(self.detokenizer.handle_batch_token_id_out(out), states, pending)
        if not outputs and self.scheduler.num_forward_steps == steps_before:
            raise RuntimeError(f"scheduler made no progress with {len(pending)} requests pending")

    @staticmethod
    def _dispatch(out: BatchStrOutput, states: dict, pending: set) -> None:
        for i, rid in enumerate(out.rids):
            if rid in states:
                states[rid].update(out, i)
                if out.finished_reasons[i] is not None:
                    pending.discard(rid)

    def abort_request(self, rid: str) -> None:
        self.scheduler.abort_request(AbortReq(rid))

    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def get_server_info(self) -> dict:
        return {
            **{k: v for k, v in vars(self.server_args).items()},
            "internal_states": [self.scheduler.get_internal_state()],
        }

    def shutdown(self) -> None:
        self.scheduler = None  # type: ignore[assignment]

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _is_ids(prompt: Any) -> bool:
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, int) or (
        isinstance(first, list) and (not first or isinstance(first[0], int))
    )
