"""Per-token timestamps of streams across srt's processes, to find where the time between two
chunks of a stream goes (``benchmark/serving/stream_timeline.py`` reads them).

Off unless ``--stream-trace-dir`` (or the environment variable ``SRT_STREAM_TRACE``, its alias:
``srt.server_args_debug``) names a folder: each process calls ``start`` with it when it starts,
and then appends one line per request and message, ``time stage rid tokens``, to
``<folder>/<stage>-<pid>.log``: ``time`` is ``time.monotonic()`` (one clock for the processes
of a machine), ``tokens`` the request's output tokens so far. Stages: ``submitted`` (the HTTP
process sends the request to the scheduler) and ``received`` (the scheduler takes it in), both
with 0 tokens; ``scheduler`` (a step's output about to go to the detokenizer),
``detokenizer`` (its text about to go on), ``tokenizer`` (received by the HTTP process),
``http`` (a stream's chunk handed to the response).

And each rank's forward steps (``forward_step``), one line a step to ``<folder>/step-<pid>.log``:
``time step mode sequences tokens threads wall_ms waited_ms`` at the step's end (host time: on
CUDA, the launches); ``threads`` the intra-op threads it ran on, ``waited_ms`` how long this
process's threads, all together, waited for a core during it (their run-queue delay in Linux's
``/proc/self/task/*/schedstat``; -1 where that is not kept): what the step lost to the other
processes on its cores.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from typing import TextIO

_folder: str | None = None  # this process's trace folder, set by ``start``
_files: dict[str, TextIO] = {}


def start(folder: str | None) -> None:
    """Trace this process into ``folder`` (None: off); its files close at exit."""
    global _folder
    close()
    _folder = folder


def close() -> None:
    """Close this process's trace files and stop tracing."""
    global _folder
    for f in _files.values():
        f.close()
    _files.clear()
    _folder = None


atexit.register(close)


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


def _run_queue_delay_ns() -> int | None:
    """Time this process's threads have spent waiting for a core, all together (Linux)."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


def forward_step(mode: str, sequences: int, tokens: int) -> contextlib.AbstractContextManager:
    """Log the step run inside it (see the module docstring); off, an empty context."""
    if _folder is None:
        return contextlib.nullcontext()
    return _traced_step(mode, sequences, tokens)


@contextlib.contextmanager
def _traced_step(mode: str, sequences: int, tokens: int) -> Iterator[None]:
    import torch  # the ranks have it loaded; the front-end processes never get here

    waited0, start = _run_queue_delay_ns(), time.monotonic()
    yield
    end, waited1 = time.monotonic(), _run_queue_delay_ns()
    waited = (waited1 - waited0) / 1e6 if waited0 is not None and waited1 is not None else -1.0
    f = _files.get("step")
    if f is None:
        f = _files["step"] = open(os.path.join(_folder, f"step-{os.getpid()}.log"), "a")
    threads = torch.get_num_threads()
    wall = (end - start) * 1e3
    f.write(f"{end:.6f} step {mode} {sequences} {tokens} {threads} {wall:.3f} {waited:.3f}\n")
    f.flush()
