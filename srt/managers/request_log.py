"""--log-requests: the tokenizer manager logs a line when it sends a request to the scheduler
and one when the request ends, with as much of the request as --log-requests-level says
(SGLang's levels):

    0  the request id and its token counts; at the end also the cached tokens, the finish
       reason and the latency (seconds since the request was received)
    1  also the sampling parameters
    2  also the prompt and the output, each cut to its first 2048 characters (a prompt given
       as token ids: its first 2048 ids)
    3  also the whole prompt and output

A request sent with ``no_logs`` logs level 0 whatever the flag says. Texts are logged as Python
literals, so that a line stays one line. A request that ends without finishing (its client
went away, or the server failed) logs ``finish_reason=None``::

    Receive: rid='3f2a…', prompt_tokens=12
    Finish: rid='3f2a…', prompt_tokens=12, completion_tokens=8, cached_tokens=0,
        finish_reason={'type': 'length', 'length': 8}, latency=0.412
"""

from __future__ import annotations

import logging
import time

from srt.managers.request_state import ReqState

logger = logging.getLogger(__name__)
PARTIAL_CHARS = 2048  # level 2: characters (or token ids) kept of a prompt or output


class RequestLog:
    def __init__(self, level: int):
        self.level = level

    def received(self, state: ReqState) -> None:
        parts = [f"rid={state.obj.rid!r}", f"prompt_tokens={state.meta['prompt_tokens']}"]
        logger.info("Receive: %s", ", ".join(parts + self._content(state, with_output=False)))

    def finished(self, state: ReqState) -> None:
        """When the request's last output arrived, or when it was dropped unfinished."""
        meta = state.meta
        parts = [
            f"rid={state.obj.rid!r}",
            f"prompt_tokens={meta['prompt_tokens']}",
            f"completion_tokens={meta['completion_tokens']}",
            f"cached_tokens={meta['cached_tokens']}",
            f"finish_reason={state.finished_reason!r}",
            f"latency={time.perf_counter() - state.created:.3f}",
        ]
        logger.info("Finish: %s", ", ".join(parts + self._content(state, with_output=True)))

    def _content(self, state: ReqState, with_output: bool) -> list[str]:
        obj = state.obj
        level = 0 if obj.no_logs else self.level
        parts = []
        if level >= 1:
            parts.append(f"sampling_params={obj.sampling_params!r}")
        if level >= 2:
            keep = PARTIAL_CHARS if level == 2 else None
            if obj.text is not None:
                parts.append(f"text={obj.text[:keep]!r}")
            else:
                parts.append(f"input_ids={obj.input_ids[:keep]!r}")
            if with_output:
                parts.append(f"output={state.text[:keep]!r}")
        return parts
