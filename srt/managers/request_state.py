"""Per-request state on the tokenizer side: accumulated text, ids and logprobs, and the
SGLang-shaped result dict built from them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from srt.managers.io_struct import BatchStrOutput, GenerateReqInput

LOGPROB_KEYS = (
    "input_token_logprobs",
    "input_top_logprobs",
    "output_token_logprobs",
    "output_top_logprobs",
)


def with_text(entries: list, text_of: Callable[[int], str | None]) -> list:
    """(logprob, id) pairs → (logprob, id, text); top-logprob rows alike (None stays None)."""
    out = []
    for entry in entries:
        if entry is None:
            out.append(None)
        elif isinstance(entry, list):
            out.append([(lp, tid, text_of(tid)) for lp, tid in entry])
        else:
            out.append((entry[0], entry[1], text_of(entry[1])))
    return out


class ReqState:
    def __init__(self, obj: GenerateReqInput, prompt_tokens: int, tokenizer: Any = None):
        self.obj = obj
        self.created = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_time: float | None = None
        self.event = asyncio.Event()
        self.finished = False
        self.abort_sent = False
        self.text, self.output_ids, self.finished_reason = "", [], None
        self.meta: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": 0,
            "cached_tokens": 0,
        }
        self.logprobs: dict[str, list] = {k: [] for k in LOGPROB_KEYS}
        self.tokenizer = tokenizer
        self.token_texts: dict[int, str] = {}  # return_text_in_logprobs: decoded once per id

    def update(self, out: BatchStrOutput, i: int) -> None:
        self.text = out.output_strs[i]
        self.output_ids.extend(out.output_ids[i])
        self.finished_reason = out.finished_reasons[i]
        self.finished = self.finished_reason is not None
        self.meta = {
            "prompt_tokens": out.prompt_tokens[i],
            "completion_tokens": out.completion_tokens[i],
            "cached_tokens": out.cached_tokens[i],
        }
        for key, values in self.logprobs.items():
            entries = getattr(out, key)
            if entries:
                values.extend(entries[i])

    def result(self) -> dict:
        meta = {"id": self.obj.rid, "finish_reason": self.finished_reason, **self.meta}
        if self.finished:
            meta["e2e_latency"] = time.perf_counter() - self.created
        if self.obj.return_logprob:
            text_of = self._token_text if self.obj.return_text_in_logprobs else _no_text
            for key, values in self.logprobs.items():
                meta[key] = with_text(values, text_of)
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}

    def _token_text(self, token_id: int) -> str:
        text = self.token_texts.get(token_id)
        if text is None:
            text = self.token_texts[token_id] = self.tokenizer.decode([token_id])
        return text


def _no_text(token_id: int) -> None:
    return None
