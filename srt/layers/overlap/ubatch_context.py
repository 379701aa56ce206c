"""Dual-batch overlap's hand-over, as the layers see it: the context of the micro-batch a
thread runs, and the three calls a token dispatcher makes around its exchanges (``dbo_yield``,
``dbo_register_recv_hook``, ``dbo_maybe_run_recv_hook``).

Only one micro-batch's thread runs at a time; the other sleeps in ``dbo_yield``. A dispatcher
that has sent an exchange registers a receive hook (on CPU, the wait for the exchange) and
yields; the other thread computes up to its own next exchange, runs the hook it finds there
first and sends. Outside a DBO step the three calls do nothing, so a dispatcher calls them
unconditionally. The threads themselves are the executor's
(``srt.batch_overlap.ubatching``); this module sits below the layers and imports no executor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

NUM_UBATCHES = 2
_local = threading.local()  # .context: the UBatchContext of this thread while it runs one


class _Baton:
    """The turn between the contexts of one step: a lock per context, held while it is not
    that context's turn. Only the holder of the turn touches ``done``."""

    def __init__(self, n: int):
        self._wake = [threading.Lock() for _ in range(n)]
        for lock in self._wake:
            lock.acquire()
        self.done = [False] * n
        self.num_yields = 0
        self.contexts: list[UBatchContext] = []

    def _next(self, index: int) -> int | None:
        n = len(self.done)
        others = [(index + k) % n for k in range(1, n)]
        return next((j for j in others if not self.done[j]), None)

    def give(self, index: int) -> None:
        self._wake[index].release()

    def wait(self, index: int) -> None:
        self._wake[index].acquire()

    def pass_turn(self, index: int) -> None:
        other = self._next(index)
        if other is None:  # the others have finished: run on
            return
        self.num_yields += 1
        self.give(other)
        self.wait(index)

    def finish(self, index: int) -> None:
        self.done[index] = True
        other = self._next(index)
        if other is not None:
            self.give(other)


class UBatchContext:
    """One micro-batch of a DBO step: its forward batch, its place in the hand-over, the
    receive hook the other micro-batch left for it, and on CUDA its stream. Made only by
    ``make_ubatch_contexts``."""

    def __init__(self, index: int, batch: Any, baton: _Baton, stream: Any = None):
        self.index = index
        self.forward_batch = batch
        self.stream = stream  # torch.cuda.Stream on CUDA, else None
        self.recv_hook: Callable[[], None] | None = None
        self._baton = baton

    @property
    def track(self) -> str:
        """Its name in operation timelines."""
        return f"u{self.index}"

    def yield_(self) -> None:
        self._baton.pass_turn(self.index)

    def __enter__(self) -> UBatchContext:
        self._baton.wait(self.index)  # the first context starts with the turn
        _local.context = self
        return self

    def peer(self) -> UBatchContext:
        contexts = self._baton.contexts
        return contexts[(self.index + 1) % len(contexts)]

    def __exit__(self, exc_type, *exc) -> None:
        try:
            if exc_type is None:
                dbo_maybe_run_recv_hook()  # a wait left for us after our last exchange
        finally:
            _local.context = None
            self._baton.finish(self.index)


def make_ubatch_contexts(batches: list[Any], device: torch.device) -> list[UBatchContext]:
    """The contexts of one DBO step, one per micro-batch, the first one's turn first. On CUDA
    each gets a stream of its own (from the stream pool)."""
    if len(batches) != NUM_UBATCHES:
        raise ValueError(
            f"dual-batch overlap runs {NUM_UBATCHES} micro-batches, not {len(batches)}"
        )
    baton = _Baton(len(batches))
    cuda = device.type == "cuda"
    baton.contexts = [
        UBatchContext(i, b, baton, torch.cuda.Stream(device) if cuda else None)
        for i, b in enumerate(batches)
    ]
    baton.give(0)
    return baton.contexts


def end_step(contexts: list[UBatchContext]) -> int:
    """After a step's threads have joined: drop what its contexts still hold (a hook left for
    a context that had ended, which nobody runs now; the contexts and their baton refer to
    each other) and return the hand-overs made."""
    for ctx in contexts:
        ctx.recv_hook = None
    baton = contexts[0]._baton
    baton.contexts = []
    return baton.num_yields


def current_context() -> UBatchContext | None:
    return getattr(_local, "context", None)


def dbo_yield() -> None:
    """Hand the turn to the other micro-batch and sleep until it hands it back."""
    ctx = current_context()
    if ctx is not None:
        ctx.yield_()


def dbo_register_recv_hook(hook: Callable[[], None] | None) -> None:
    """Leave ``hook`` (the receive half of an exchange just sent) to the next micro-batch, which
    runs it at its next ``dbo_maybe_run_recv_hook``. On CUDA the hook runs on this micro-batch's
    stream (a stream-level wait must hold back this micro-batch's work, not the other's)."""
    ctx = current_context()
    if ctx is None or hook is None:
        return
    if ctx.stream is not None:
        stream, inner = ctx.stream, hook

        def hook() -> None:
            with torch.cuda.stream(stream):
                inner()

    ctx.peer().recv_hook = hook


def dbo_maybe_run_recv_hook() -> None:
    """Run the receive hook the other micro-batch left here, if any."""
    ctx = current_context()
    if ctx is not None and ctx.recv_hook is not None:
        hook, ctx.recv_hook = ctx.recv_hook, None
        hook()
