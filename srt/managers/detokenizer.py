"""Incremental detokenization (the DetokenizerManager's logic; in-process for now).

Per request it keeps the ids so far and two offsets, as SGLang: text is committed only when it
does not end in U+FFFD (an incomplete UTF-8 sequence split across byte-level tokens). When a
request finishes, the text is cut before a matched stop string or stop regex, and a matched
stop token is left out of the text (all of them kept, the text cut after the match, with
``no_stop_trim``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from srt.managers.io_struct import BatchStrOutput, BatchTokenIDOutput


@dataclass
class DecodeStatus:
    decode_ids: list[int] = field(default_factory=list)
    decoded_text: str = ""
    surr_offset: int = 0  # decoding starts here, so merges at the boundary decode right
    read_offset: int = 0  # ids before this are in decoded_text


class DetokenizerManager:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.decode_status: dict[str, DecodeStatus] = {}

    def handle_batch_token_id_out(self, recv: BatchTokenIDOutput) -> BatchStrOutput:
        texts = [self._handle_one(recv, i) for i in range(len(recv.rids))]
        return BatchStrOutput(
            rids=recv.rids,
            finished_reasons=recv.finished_reasons,
            output_strs=texts,
            output_ids=recv.output_ids,
            prompt_tokens=recv.prompt_tokens,
            completion_tokens=recv.completion_tokens,
            cached_tokens=recv.cached_tokens,
            input_token_logprobs=recv.input_token_logprobs,
            input_top_logprobs=recv.input_top_logprobs,
            output_token_logprobs=recv.output_token_logprobs,
            output_top_logprobs=recv.output_top_logprobs,
        )

    def _handle_one(self, recv: BatchTokenIDOutput, i: int) -> str:
        rid, finished = recv.rids[i], recv.finished_reasons[i]
        status = self.decode_status.setdefault(rid, DecodeStatus())
        status.decode_ids.extend(recv.output_ids[i])
        kwargs = {
            "skip_special_tokens": recv.skip_special_tokens[i],
            "spaces_between_special_tokens": recv.spaces_between_special_tokens[i],
        }
        if finished is None:
            return self._incremental(status, kwargs)
        del self.decode_status[rid]
        return self._final_text(status.decode_ids, finished, kwargs, recv.no_stop_trim[i])

    def _decode(self, ids: list[int], kwargs: dict) -> str:
        try:
            return self.tokenizer.decode(ids, **kwargs)
        except TypeError:  # tokenizers without spaces_between_special_tokens
            return self.tokenizer.decode(ids, skip_special_tokens=kwargs["skip_special_tokens"])

    def _incremental(self, s: DecodeStatus, kwargs: dict) -> str:
        surr_text = self._decode(s.decode_ids[s.surr_offset : s.read_offset], kwargs)
        read_text = self._decode(s.decode_ids[s.surr_offset :], kwargs)
        new_text = read_text[len(surr_text) :]
        if new_text and not new_text.endswith("\ufffd"):
            s.decoded_text += new_text
            s.surr_offset, s.read_offset = s.read_offset, len(s.decode_ids)
        return s.decoded_text

    def _final_text(self, ids: list[int], finished: dict, kwargs: dict, keep: bool) -> str:
        matched = finished.get("matched") if finished.get("type") == "stop" else None
        if isinstance(matched, int) and ids and ids[-1] == matched and not keep:
            ids = ids[:-1]
        text = self._decode(ids, kwargs)
        if not isinstance(matched, str) or not matched:
            return text
        if finished.get("regex"):
            found = re.search(matched, text)
            span = (found.start(), found.end()) if found else None
        else:
            pos = text.find(matched)
            span = (pos, pos + len(matched)) if pos != -1 else None
        if span is None:
            return text
        return text[: span[1]] if keep else text[: span[0]]
