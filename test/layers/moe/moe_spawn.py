"""Run a function on N real rank processes (spawn, gloo on a free loopback port)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world_size: int, port: int, errors, args) -> None:
    torch.set_num_threads(1)  # N ranks share a few cores
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 180.0) -> None:
    """Call ``fn(rank, world_size, *args)`` on every rank; raise with the ranks' tracebacks if
    any failed or did not finish within ``timeout`` seconds."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, rank, world_size, port, errors, args))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
        procs[rank].join()
    failures = []
    with contextlib.suppress(queue.Empty):
        while True:
            rank, text = errors.get(timeout=0.2)
            failures.append(f"rank {rank}:\n{text}")
    codes = [p.exitcode for p in procs]
    if hung or failures or any(codes):
        raise AssertionError(f"ranks hung: {hung}, exit codes: {codes}\n" + "\n".join(failures))
