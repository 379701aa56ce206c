"""Child processes: spawn, ready handshake over a pipe, and a watchdog that takes the whole server
down (non-zero exit, naming the child) when one dies."""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing as mp
import os
import platform
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

logger = logging.getLogger(__name__)
_CTX = mp.get_context("spawn")


@dataclass
class Child:
    name: str
    process: mp.process.BaseProcess
    ready_reader: Connection | None


def freeze_startup_heap() -> None:
    """Collect once, then keep every object alive after start-up out of the garbage collector's
    reach (``gc.freeze``). Otherwise a full collection rescans the model's and the tokenizer's
    hundreds of thousands of objects (about 0.1 s for a small model) at whatever step triggers
    it. vLLM's engine core freezes its start-up heap the same way."""
    gc.collect()
    gc.freeze()


def yield_to_ranks_on_wakeup(pid: int | None = None) -> bool:
    """Put every thread of process ``pid`` (default: this one), and the threads they start
    later, under SCHED_BATCH: the same share of the CPU as before, but a wake-up no longer
    preempts the thread running on that core. For the front-end processes (HTTP,
    detokenizer, DP controller), which wake up for every step's output, when the ranks leave
    them a core in decode: the core they woke on was often a rank's, and its step waited for
    them (2 cores, small model: 0.19-0.31 preemptions of a decode step's main thread per
    step, 0.06-0.11 after). Where the ranks decode on every core it is left alone: a front end woken
    at a step's end preempts a rank between its parallel regions, one that waits for the
    scheduler tick preempts it inside one, and every thread of the region waits (2 cores, mid
    model: decode steps 2-22 % slower). Linux only; elsewhere, or if refused, nothing changes
    and False is returned."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid or 'self'}/task")]
        for tid in tids:
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    except OSError:
        return False
    return True


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_heap_pages() -> bool:
    """Serve every allocation from the heap and keep freed pages mapped for the next one
    (glibc malloc; elsewhere nothing changes and False is returned). By default glibc maps
    each block above its mmap threshold (which rises with use, up to 32 MiB) on its own and
    unmaps it when freed, and trims the heap's top once enough of it is free, so each step
    touches fresh pages again: 40 000 to 100 000 page faults, 0.15-0.3 s of kernel time, in
    one prefill of 16 x 128 tokens of a 1-GB model. vLLM's CPU guide preloads tcmalloc for the
    same reason. The process then holds its peak heap (up to 2 GiB of free pages at its
    top)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def start_child(name: str, target: Callable[..., None], *args: Any, ready: bool = True) -> Child:
    """Start ``target(*args, ready_writer)`` (or ``target(*args)``) in a spawned process."""
    reader, writer = _CTX.Pipe(duplex=False) if ready else (None, None)
    full_args = (*args, writer) if ready else args
    process = _CTX.Process(target=target, args=full_args, name=name, daemon=True)
    process.start()
    if writer is not None:
        writer.close()
    return Child(name, process, reader)


def wait_ready(children: list[Child], timeout: float | None = None) -> list[dict]:
    """Each child sends one dict: ``{"status": "ready", ...}`` or ``{"status": "error", ...}``.
    Returns them in ``children`` order. Waits on all children at once, so a child that fails
    or dies is reported at once even while others (e.g. its peer ranks, blocked in a
    rendezvous) never become ready."""
    infos: dict[int, dict] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    while len(infos) < len(children):
        pending = [i for i in range(len(children)) if i not in infos]
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        handles = [children[i].ready_reader for i in pending]
        handles += [children[i].process.sentinel for i in pending]
        if not wait(handles, remaining):
            names = ", ".join(children[i].name for i in pending)
            raise RuntimeError(f"{names} did not report ready in time")
        for i in pending:
            child = children[i]
            if child.ready_reader.poll():
                infos[i] = _read_ready(child)
            elif not child.process.is_alive():
                raise RuntimeError(
                    f"{child.name} exited during start-up (exit code {child.process.exitcode})"
                )
    return [infos[i] for i in range(len(children))]


def _read_ready(child: Child) -> dict:
    try:
        info = child.ready_reader.recv()
    except EOFError:
        child.process.join(1.0)
        raise RuntimeError(
            f"{child.name} exited during start-up (exit code {child.process.exitcode})"
        ) from None
    if info.get("status") != "ready":
        raise RuntimeError(f"{child.name} failed to start: {info.get('error')}")
    return info


def kill_children(children: list[Child], timeout: float = 3.0) -> None:
    for child in children:
        if child.process.is_alive():
            child.process.terminate()
    deadline = time.monotonic() + timeout
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
        if child.process.is_alive():
            child.process.kill()
            child.process.join(1.0)


class Watchdog:
    """Watches child sentinels from a thread. On an unexpected death it logs the child's name,
    calls ``on_death(name)``, stops the other children and, with ``exit_process``, exits this
    process with status 1."""

    def __init__(
        self,
        children: list[Child],
        on_death: Callable[[str], None] | None = None,
        exit_process: bool = True,
    ):
        self.children = children
        self.on_death = on_death
        self.exit_process = exit_process
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="srt-watchdog", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        sentinels = {c.process.sentinel: c for c in self.children}
        dead = wait(list(sentinels))
        if self.stopping:
            return
        child = sentinels[dead[0]]
        child.process.join(1.0)  # its exit code is set once joined
        logger.error(
            "child process %s (pid %d) died with exit code %s; shutting down",
            child.name,
            child.process.pid,
            child.process.exitcode,
        )
        if self.on_death is not None:
            self.on_death(child.name)
        kill_children(self.children, timeout=2.0)
        if self.exit_process:
            os._exit(1)


def set_parent_death_signal() -> None:
    """For children: get SIGKILL when the parent dies, so no child outlives the server, and
    leave Ctrl-C (SIGINT to the whole process group) to the parent, which stops the tree."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
