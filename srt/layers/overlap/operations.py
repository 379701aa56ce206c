"""Layer operations: what a decoder layer's forward is made of.

A decoder layer exposes its forward as a list of small operations (``op_*`` methods). Each
operation reads and writes a ``LayerState``; the plain forward runs the list in order
(``execute_operations``). An operations list may hold ``YieldOperation`` markers, which cut it
into stages (``to_stages``): two-batch overlap's executor
(``srt.batch_overlap.two_batch_overlap``) runs two micro-batches' states through the same
stages, interleaved, so that one computes while the other's all-to-all, launched by an ``_a``
operation and awaited by its ``_b`` one, is in flight. This module sits below the layers that
use it and imports no executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from srt.layers.overlap.ubatch_context import current_context
from srt.model_executor.forward_batch_info import ForwardBatch

Operation = Callable[["LayerState"], None]


@dataclass
class LayerState:
    """What flows between a layer's operations.

    ``batch`` and ``positions`` are read-only context. Every other value is written once with
    ``put`` and consumed once with ``pop``; writing a key twice or leaving one behind is a bug
    that raises.
    """

    batch: ForwardBatch
    positions: torch.Tensor
    values: dict[str, Any] = field(default_factory=dict)

    def put(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if key in self.values:
                raise KeyError(f"layer state key {key!r} written twice")
            self.values[key] = value

    def pop(self, key: str) -> Any:
        if key not in self.values:
            raise KeyError(f"layer state key {key!r} read before it was written")
        return self.values.pop(key)

    def get(self, key: str) -> Any:
        if key not in self.values:
            raise KeyError(f"layer state key {key!r} read before it was written")
        return self.values[key]

    def take_outputs(self, *keys: str) -> tuple[Any, ...]:
        outputs = tuple(self.pop(k) for k in keys)
        if self.values:
            raise KeyError(f"layer state left over after the layer: {sorted(self.values)}")
        return outputs


class YieldOperation:
    """A stage boundary: under two-batch overlap the other micro-batch runs here."""

    def __repr__(self) -> str:
        return "YIELD"


@dataclass(frozen=True)
class ExecutionOperation:
    """One operation with its name and layer (for profiles and error messages)."""

    name: str
    fn: Operation
    layer_id: int | None = None

    def __call__(self, state: LayerState) -> None:
        self.fn(state)


OperationItem = ExecutionOperation | YieldOperation


class OperationObserver:
    """Watches every operation an executor runs: wraps it in a ``torch.profiler``
    ``record_function`` marker (``--enable-operation-profile``), and, with ``record`` on,
    keeps an :class:`OpEvent` per run for a timeline (``take_events``).

    On CPU an operation's interval is host time around its call. On CUDA the call only
    enqueues kernels, so the interval comes from a pair of CUDA events on the current stream
    instead: it ends when the operation's work (and any stream it waited for) has run, without
    a synchronisation that would change the overlap being measured. Device times are placed on
    the host clock through one reference event recorded after a synchronisation at the first
    recorded operation.
    """

    def __init__(self, record: bool = False):
        self.record = record
        self._events: list[OpEvent] = []
        self._pending: list[tuple[str, int | None, str, Any, Any]] = []
        self._reference: tuple[float, Any] | None = None  # (host seconds, CUDA event)

    def run(self, op: ExecutionOperation, state: LayerState, track: str) -> None:
        on_cuda = self.record and state.positions.is_cuda
        start = self._cuda_event() if on_cuda else time.perf_counter()
        with torch.profiler.record_function(f"{track}:L{op.layer_id}:{op.name}"):
            op(state)
        if not self.record:
            return
        if on_cuda:
            self._pending.append((track, op.layer_id, op.name, start, self._cuda_event()))
        else:
            self._events.append(OpEvent(track, op.layer_id, op.name, start, time.perf_counter()))

    def _cuda_event(self) -> Any:
        if self._reference is None:
            torch.cuda.synchronize()
            reference = torch.cuda.Event(enable_timing=True)
            reference.record()
            self._reference = (time.perf_counter(), reference)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take_events(self) -> list[OpEvent]:
        """The events recorded since the last call, in execution order (waits for the device
        when some were recorded on CUDA)."""
        if self._pending:
            torch.cuda.synchronize()
            host, reference = self._reference
            for track, layer_id, name, start, end in self._pending:
                t0 = host + reference.elapsed_time(start) / 1e3
                t1 = host + reference.elapsed_time(end) / 1e3
                self._events.append(OpEvent(track, layer_id, name, t0, t1))
            self._pending = []
        events, self._events = self._events, []
        return events


@dataclass(frozen=True)
class OpEvent:
    track: str  # "plain"; "A" / "B": two-batch overlap's micro-batches; "u0" / "u1": DBO's
    layer_id: int | None
    name: str
    start: float  # time.perf_counter() seconds
    end: float


def to_stages(operations: Sequence[OperationItem]) -> list[list[ExecutionOperation]]:
    """Cut at every YieldOperation: n markers give n + 1 stages (possibly empty)."""
    stages: list[list[ExecutionOperation]] = [[]]
    for op in operations:
        if isinstance(op, YieldOperation):
            stages.append([])
        else:
            stages[-1].append(op)
    return stages


def run_stage(
    stage: list[ExecutionOperation],
    state: LayerState,
    observer: OperationObserver | None,
    track: str,
) -> None:
    for op in stage:
        if observer is None:
            op(state)
        else:
            observer.run(op, state, track)


def execute_operations(
    state: LayerState,
    operations: Sequence[OperationItem],
    observer: OperationObserver | None = None,
) -> None:
    """The plain path: every operation once, in order; yields are ignored. In a dual-batch
    overlap thread the timeline's track is its micro-batch's."""
    ops = [op for op in operations if not isinstance(op, YieldOperation)]
    ctx = current_context()
    run_stage(ops, state, observer, "plain" if ctx is None else ctx.track)
