"""Dual-batch overlap's thread executor (vLLM's DBO): each micro-batch runs the plain model
forward in a thread of its own, and the two threads hand the turn to each other at yields placed
in the token dispatchers, so that one computes while the other's all-to-all is in flight.

The hand-over the layers see (the micro-batch context and the dispatchers' yield and receive
hooks) is ``srt.layers.overlap.ubatch_context``; this module runs the threads. Every rank runs
the same sequence of sends, so the collectives of the two micro-batches line up across ranks as
under two-batch overlap.

``UBatchWrapper`` wraps a model ``(input_ids, positions, batch) → hidden``: on a batch whose
step runs DBO (``batch.split``, with the two children of ``batch.tbo_children``) it runs the model
once per child, each in its worker thread (two threads, started once and reused), and joins
them; any other batch goes straight to the model. It needs nothing from the model.
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from srt.layers.overlap.ubatch_context import (
    NUM_UBATCHES,
    UBatchContext,
    end_step,
    make_ubatch_contexts,
)
from srt.utils import sync_guard


class _ThreadSetup:
    """The calling thread's state a micro-batch's thread must share for one step: autograd
    and inference mode, intra-op threads (OpenMP's count is per thread), the host-sync guard,
    and on CUDA the device and the micro-batch's stream."""

    def __init__(self, device: torch.device):
        self.device = device
        self.inference = torch.is_inference_mode_enabled()
        self.grad = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.guard = sync_guard.active_guard()

    def enter(self, ctx: UBatchContext) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode(self.inference))
        stack.enter_context(torch.set_grad_enabled(self.grad))
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        if ctx.stream is not None:
            torch.cuda.set_device(self.device)
            stack.enter_context(torch.cuda.stream(ctx.stream))
        if self.guard is not None:
            stack.enter_context(sync_guard.forbid_host_sync(self.guard))
        return stack


def _serve(inbox: queue.SimpleQueue, outbox: queue.SimpleQueue) -> None:
    """A worker thread: runs ``(fn, ctx, setup)`` jobs until it gets None."""
    while (job := inbox.get()) is not None:
        outbox.put(_run_job(*job))
        del job  # hold nothing between steps


def _run_job(fn: Callable[[], Any], ctx: UBatchContext, setup: _ThreadSetup) -> Any:
    """``fn()`` inside the context, or the error it raised (the caller raises it)."""
    try:
        with ctx, setup.enter(ctx):
            return fn()
    except BaseException as error:
        return error


class _Worker:
    def __init__(self, name: str):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_serve, args=(self.inbox, self.outbox), name=name, daemon=True
        )
        self.thread.start()


def _stop(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.inbox.put(None)
    for worker in workers:
        if worker.thread is not threading.current_thread():
            worker.thread.join(timeout=10.0)


class UBatchThreads:
    """Two worker threads that run one job each per call, ping-ponging at the yields. They
    start at the first call and are reused; ``close`` (or the object's collection) stops them.
    ``num_steps`` / ``num_yields``: calls made and hand-overs made, for the benchmarks."""

    def __init__(self) -> None:
        self._workers: list[_Worker] = []
        self._finalizer: weakref.finalize | None = None
        self.num_steps = 0
        self.num_yields = 0

    def run(
        self, jobs: list[Callable[[], Any]], device: torch.device, batches: list | None = None
    ) -> list[Any]:
        """Each job in its worker thread, the first one's turn first; their results in order.
        ``batches``: what each context carries as its ``forward_batch``. An error in either
        thread is raised here (the other runs on alone to its end, so every rank's collectives
        still complete)."""
        contexts = make_ubatch_contexts(batches or [None] * len(jobs), device)
        setup = _ThreadSetup(device)
        main = torch.cuda.current_stream(device) if device.type == "cuda" else None
        for ctx in contexts:
            if ctx.stream is not None:
                ctx.stream.wait_stream(main)
        workers = self._start()
        for worker, job, ctx in zip(workers, jobs, contexts):
            worker.inbox.put((job, ctx, setup))
        outs = [worker.outbox.get() for worker in workers]
        for ctx in contexts:
            if ctx.stream is not None:
                main.wait_stream(ctx.stream)
        self.num_steps += 1
        self.num_yields += end_step(contexts)
        errors = [out for out in outs if isinstance(out, BaseException)]
        if errors:
            raise errors[0]
        return outs

    def _start(self) -> list[_Worker]:
        if not self._workers:
            self._workers = [_Worker(f"srt-ubatch-{i}") for i in range(NUM_UBATCHES)]
            self._finalizer = weakref.finalize(self, _stop, self._workers)
        return self._workers

    def close(self) -> None:
        """Stop the worker threads (a later call starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
        self._workers, self._finalizer = [], None


class UBatchWrapper:
    """Runs ``model`` once per micro-batch of a DBO step, each in its worker thread (see the
    module docstring), through ``UBatchThreads``. ``num_steps`` / ``num_yields``: DBO steps
    run and hand-overs made, for the benchmarks."""

    def __init__(self, model: Callable[..., torch.Tensor]):
        self.model = model
        self.threads = UBatchThreads()

    @property
    def num_steps(self) -> int:
        return self.threads.num_steps

    @property
    def num_yields(self) -> int:
        return self.threads.num_yields

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        children = batch.tbo_children
        if batch.split.mode != "dbo" or not children:
            return self.model(input_ids, positions, batch)
        return torch.cat(self.run(children))

    def run(self, batches: list) -> list[Any]:
        """``model`` on each batch, in the worker threads; the outputs in order."""
        jobs = [functools.partial(self.model, b.input_ids, b.positions, b) for b in batches]
        return self.threads.run(jobs, batches[0].input_ids.device, batches)

    def close(self) -> None:
        """Stop the worker threads (a later DBO step starts new ones)."""
        self.threads.close()
