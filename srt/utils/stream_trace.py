"""Per-token timestamps of streams across srt's processes, to find where the time between two
chunks of a stream goes (``benchmark/serving/stream_timeline.py`` reads them).

Off unless the environment variable ``SRT_STREAM_TRACE`` names a folder when a process starts;
then each process appends one line per request and message, ``time stage rid tokens``, to
``<folder>/<stage>-<pid>.log``: ``time`` is ``time.monotonic()`` (one clock for the processes
of a machine), ``tokens`` the request's output tokens so far. Stages: ``submitted`` (the HTTP
process sends the request to the scheduler) and ``received`` (the scheduler takes it in), both
with 0 tokens; ``scheduler`` (a step's output about to go to the detokenizer),
``detokenizer`` (its text about to go on), ``tokenizer`` (received by the HTTP process),
``http`` (a stream's chunk handed to the response).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import TextIO

ENV = "SRT_STREAM_TRACE"
_folder = os.environ.get(ENV) or None
_files: dict[str, TextIO] = {}


def enabled() -> bool:
    return _folder is not None


def record(stage: str, rids: Sequence[str], tokens: Sequence[int]) -> None:
    if _folder is None:
        return
    f = _files.get(stage)
    if f is None:
        f = _files[stage] = open(os.path.join(_folder, f"{stage}-{os.getpid()}.log"), "a")
    now = time.monotonic()
    f.write("".join(f"{now:.6f} {stage} {rid} {n}\n" for rid, n in zip(rids, tokens)))
    f.flush()
