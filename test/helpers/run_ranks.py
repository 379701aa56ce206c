"""Run a function on N real rank processes that share a gloo world on a free loopback port.
Shared by the multi-rank tests.

The ranks are forked from a fork server that imported torch and srt once (Python's
``forkserver`` start method, a fresh interpreter that has run no torch op, so no OpenMP pool is
forked): a spawned rank spends seconds importing them, and the suite starts many ranks. Each
rank takes the caller's environment as it is at the call (what a library read when the fork
server imported it, such as OpenMP's variables, stays the fork server's).

``run_ranks(worker, n, *args)`` calls ``worker(rank, n, init_method, *args)`` in each process and
returns the ranks' return values (plain picklable data, in rank order). The worker initialises
torch.distributed itself (usually through ``init_parallel_state(..., init_method=init_method)``);
the process group is destroyed in a ``finally`` whatever happens. If a rank raises or dies, the
others are terminated at once and the error carries every traceback; nothing hangs past
``timeout``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from benchmark.common.process import free_port

__all__ = ["free_port", "run_ranks"]

HOST = "127.0.0.1"
# What every rank imports anyway; the fork server imports these once (an ImportError is skipped).
PRELOAD = ["torch", "torch.distributed", "srt.model_executor.model_runner"]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def _rank_main(worker: Callable[..., Any], rank: int, n: int, init_method: str, args, results, env):
    os.environ.clear()
    os.environ.update(env)
    try:
        value = worker(rank, n, init_method, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list, results, n: int, deadline: float) -> tuple[dict, dict]:
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    while len(values) + len(errors) < n and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=0.05)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            for r in dead:
                if r not in values and r not in errors:
                    errors[r] = f"rank {r} died with exit code {procs[r].exitcode}"
            if errors:
                break
            continue
        (values if ok else errors)[rank] = payload
        if not ok:
            break
    return values, errors


def _stop(procs: list, graceful: bool) -> None:
    """Join finished ranks; kill the rest (peers of a failed rank may block in a collective)."""
    deadline = time.monotonic() + (10.0 if graceful else 0.0)
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def run_ranks(worker: Callable[..., Any], n: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """``worker`` must be a module-level function (it is pickled by name)."""
    results = _CTX.Queue()
    init_method = f"tcp://{HOST}:{free_port(HOST)}"
    env = dict(os.environ)
    procs = [
        _CTX.Process(target=_rank_main, args=(worker, r, n, init_method, args, results, env))
        for r in range(n)
    ]
    for p in procs:
        p.start()
    values, errors = {}, {}
    try:
        values, errors = _collect(procs, results, n, time.monotonic() + timeout)
    finally:
        _stop(procs, graceful=len(values) == n)
    if errors or len(values) < n:
        missing = [r for r in range(n) if r not in values and r not in errors]
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise AssertionError(f"multi-rank run failed (no result from {missing}):\n{report}")
    return [values[r] for r in range(n)]
