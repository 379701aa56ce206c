"""Run one rank's part of a schedule on torch.distributed (gloo on CPU, nccl on CUDA).

Each action of the rank's list, in order:
- a receive waits for its ``irecv`` (all of the step's are posted at its start; the schedule
  places the wait right before the computation that needs it); a send posts ``isend``
  (waited at the end of the step);
- F runs the stage's forward with autograd, the last stage adding the loss;
- B runs its backward: a whole one with ``torch.autograd.backward`` (input and weight
  gradients), a split one (``split_w``) for the input gradient only, its weight gradients
  deferred to the W that names it (DeepSeek's ``WeightGradStore``: a store of pending
  closures; the split is torch's ``stage_backward_input`` / ``stage_backward_weight``, which
  keeps the gradients reaching the nodes where weights join, so that W runs only the weights'
  own operations);
- an F&B pair runs its forward then its backward, or with ``fb_overlap`` (``--moe-fb-overlap``)
  the two in the ubatch threads of dual-batch overlap, the backward first, handing over at
  every MoE all-to-all (``pipeline/ep.py``), so that one's exchange is in flight while the
  other computes. The pair takes its own messages (``fold_pair_messages``): each half waits
  for its receive in its thread, the forward's a hand-over point as an exchange is (the
  backward computes on while the activation is in flight), and posts its send the moment it
  ends, so that it crosses the link under the other half's compute.

Gradients accumulate in the parameters' ``.grad`` over the micro-batches, as a single process
running them one by one. ``step(..., forward_only=True)`` evaluates instead: the schedule's
forwards alone (``schedules.forward_schedule``) under ``torch.no_grad``, nothing kept for a
backward and no gradient touched, each micro-batch's loss in the record.

The executor also tallies the activations its forwards keep for their backwards (the tensors
autograd saves, parameters left out, each storage once per chunk): a chunk's count from its F
until its whole B or its W, the rank's peak over the step in bytes and in chunks.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from pipeline.model import Stage, loss_fn
from pipeline.schedules import Action, Comm, Compute, Pair, Schedule, forward_schedule
from pipeline.simulator import message_key
from srt.batch_overlap.ubatching import UBatchThreads
from srt.distributed.p2p import PendingWork
from srt.layers.overlap.ubatch_context import (
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
)


@dataclass
class StepRecord:
    """What one rank did in a step: its loss share and each computation's host interval."""

    loss: float = 0.0
    losses: dict[int, float] = field(default_factory=dict)  # micro-batch → its share (last stage)
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    peak_bytes: int = 0  # activations kept for backwards, at most at once
    peak_chunks: int = 0  # chunks (stage, micro-batch) holding them, at most at once
    # message_key → a send's post time, or a receive's wait (start, end); host clock
    sends: dict[str, float] = field(default_factory=dict)
    receives: dict[str, tuple[float, float]] = field(default_factory=dict)


Chunk = tuple[int, int]  # (stage, micro-batch)


@dataclass
class StepState:
    """One step's inputs and what its actions hand each other, made afresh for every step."""

    ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    num_total: int  # the micro-batches the mean loss is over
    recv_works: dict[tuple[str, int, int], tuple]  # every irecv (work, buffer), posted at start
    send_works: list[tuple] = field(default_factory=list)  # (work, tensor), waited at the end
    inbox: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # received
    outputs: dict[Chunk, torch.Tensor] = field(default_factory=dict)  # F output to send or pass
    saved: dict[Chunk, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # F's
    grads: dict[Chunk, torch.Tensor] = field(default_factory=dict)  # input gradient
    weights: dict[Chunk, Callable[[], None]] = field(default_factory=dict)  # deferred W
    live: dict[Chunk, int] = field(default_factory=dict)  # activation bytes kept
    record: StepRecord = field(default_factory=StepRecord)

    def note_peak(self) -> None:
        record = self.record
        record.peak_bytes = max(record.peak_bytes, sum(self.live.values()))
        record.peak_chunks = max(record.peak_chunks, len(self.live))


# A message's tag is (direction, stage) × MAX_MICROBATCHES + micro-batch: unique while the
# micro-batches stay below the bound, and a tag must fit a signed 32-bit integer (gloo's)
MAX_MICROBATCHES = 4096
MAX_STAGES = 2**31 // (2 * MAX_MICROBATCHES)


@dataclass
class PairWithMessages:
    """Under fb-overlap, an F&B pair and its own messages by half: the receive each half waits
    for in its thread, and the send it posts as it ends."""

    pair: Pair
    recvs: dict[Compute, Comm] = field(default_factory=dict)
    sends: dict[Compute, Comm] = field(default_factory=dict)


def _half_of(pair: Pair, m: Action) -> Compute | None:
    """The half of ``pair`` whose input the receive ``m`` brings or whose output the send ``m``
    carries; None for anything else."""
    if not isinstance(m, Comm):
        return None
    for c in (pair.f, pair.b):
        what, step = ("act", -1) if c.kind == "F" else ("grad", 1)
        if (m.what, m.stage, m.mb) == (what, c.stage + step * (m.kind == "recv"), c.mb):
            return c
    return None


def fold_pair_messages(actions: list[Action]) -> list:
    """A rank's actions with each pair's receives (right before it) and sends (right after)
    taken into it as a ``PairWithMessages``."""
    out: list = []
    for a in actions:
        last = out[-1] if out else None
        if isinstance(a, Pair):
            item = PairWithMessages(a)
            while out and (c := _half_of(a, out[-1])) is not None and out[-1].kind == "recv":
                item.recvs[c] = out.pop()
            out.append(item)
        elif isinstance(last, PairWithMessages) and (c := _half_of(last.pair, a)) is not None:
            last.sends[c] = a  # a pair's own receive cannot follow it: this is its send
        else:
            out.append(a)
    return out


def check_message_tags(schedule: Schedule) -> None:
    """Refuse a schedule whose messages' tags would collide or overflow."""
    if schedule.num_microbatches > MAX_MICROBATCHES:
        raise ValueError(f"{schedule.num_microbatches} micro-batches: the executor's message "
                         f"tags allow at most {MAX_MICROBATCHES}")  # fmt: skip
    if schedule.num_stages > MAX_STAGES:
        raise ValueError(f"{schedule.num_stages} stages: the executor's message tags allow at "
                         f"most {MAX_STAGES}")  # fmt: skip


class RankExecutor:
    """``stages``: this rank's stage modules by global stage index; ``shape``: a micro-batch's
    activations ``[batch, seq, hidden]`` (the same for every micro-batch); ``peers``: the
    global rank of each pipeline rank (identity by default); ``num_total``: the micro-batches
    the step's mean loss is over (all EP ranks' together; the rank's own by default)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, Stage], shape,
                 peers: list[int] | None = None, fb_overlap: bool = False,
                 num_total: int | None = None):  # fmt: skip
        check_message_tags(schedule)
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.forwards = forward_schedule(schedule)
        self.shape, self.peers = tuple(shape), peers or list(range(schedule.num_ranks))
        self.last = schedule.num_stages - 1
        self.num_total = num_total
        self.threads = UBatchThreads() if fb_overlap else None
        actions = schedule.ranks[rank]
        self.actions = fold_pair_messages(actions) if fb_overlap else actions
        self._params = {p.untyped_storage().data_ptr() for st in stages.values()
                        for p in st.parameters()}  # fmt: skip

    def _tag(self, what: str, stage: int, mb: int) -> int:
        return ((what == "grad") * self.schedule.num_stages + stage) * MAX_MICROBATCHES + mb

    def step(self, ids: list[torch.Tensor], labels: list[torch.Tensor],
             forward_only: bool = False) -> StepRecord:  # fmt: skip
        """One training step's forward and backward over the micro-batches ``ids`` / ``labels``
        (gradients accumulate; the caller steps the optimizer); with ``forward_only`` their
        forwards alone, without autograd (evaluation: the record's ``losses``)."""
        schedule = self.forwards if forward_only else self.schedule
        st = StepState(ids, labels, self.num_total or len(ids), self._post_receives(schedule))
        with torch.set_grad_enabled(not forward_only):
            for action in schedule.ranks[self.rank] if forward_only else self.actions:
                if isinstance(action, Comm):
                    self._comm(st, action)
                elif isinstance(action, PairWithMessages):
                    self._overlapped(st, action)
                else:
                    for c in (action.f, action.b) if isinstance(action, Pair) else (action,):
                        self._timed(st, c)
        for work, _tensor in st.send_works:
            work.wait()
        if st.weights:
            raise RuntimeError(f"rank {self.rank}: W never run for {sorted(st.weights)}")
        return st.record

    def close(self) -> None:
        if self.threads is not None:
            self.threads.close()

    def _overlapped(self, st: StepState, item: PairWithMessages) -> None:
        """The pair's halves in the two threads, the backward first (its first exchange, the
        last layer's combine, comes at once, and the forward's attention computes while it is
        in flight). Its span starts once the backward has its gradient."""
        start: list[float] = []

        def half(c: Compute) -> None:
            if (recv := item.recvs.get(c)) is not None:
                self._comm(st, recv, handover=c.kind == "F")
            if c.kind == "B":
                start.append(time.perf_counter())
            {"F": self._forward, "B": self._backward}[c.kind](st, c)
            if (send := item.sends.get(c)) is not None:
                self._comm(st, send)  # posted now: it travels while the other half computes

        pair = item.pair
        jobs = [functools.partial(half, pair.b), functools.partial(half, pair.f)]
        self.threads.run(jobs, torch.device("cpu"))
        st.record.spans.append((str(pair), start[0], time.perf_counter()))

    def _comm(self, st: StepState, c: Comm, handover: bool = False) -> None:
        """Post a send, or wait for a receive; with ``handover`` (a pair's forward) the wait is
        a hand-over point, as an exchange is: the other half's exchange in flight is waited,
        this wait left to it, and it computes on until its next exchange."""
        tag, key = self._tag(c.what, c.stage, c.mb), message_key(c.what, c.stage, c.mb)
        if c.kind == "send":
            store = st.outputs if c.what == "act" else st.grads
            tensor = store.pop((c.stage, c.mb)).contiguous()
            st.record.sends[key] = time.perf_counter()
            work = dist.isend(tensor, self.peers[c.peer], tag=tag)
            st.send_works.append((work, tensor))  # the tensor lives until the send is done
            return
        work, buf = st.recv_works.pop((c.what, c.stage, c.mb))
        if handover:
            dbo_maybe_run_recv_hook()
            dbo_register_recv_hook(work.wait)
            dbo_yield()
        start = time.perf_counter()
        work.wait()
        st.record.receives[key] = (start, time.perf_counter())
        st.inbox[(c.what, c.stage, c.mb)] = buf

    def _post_receives(self, schedule: Schedule) -> dict:
        """Every receive of the step, posted at its start: gloo moves a message once its
        receive is posted, so a receive posted only when its computation is next would expose
        the whole transfer; posted early, it arrives while the rank computes."""
        out = {}
        for c in schedule.ranks[self.rank]:
            if isinstance(c, Comm) and c.kind == "recv":
                buf = torch.empty(self.shape, dtype=torch.float32)
                tag = self._tag(c.what, c.stage, c.mb)
                work = PendingWork([dist.irecv(buf, self.peers[c.peer], tag=tag)])  # waited once
                out[(c.what, c.stage, c.mb)] = (work, buf)
        return out

    def _timed(self, st: StepState, c: Compute) -> None:
        start = time.perf_counter()
        {"F": self._forward, "B": self._backward, "W": self._weight}[c.kind](st, c)
        st.record.spans.append((str(c), start, time.perf_counter()))

    def _input(self, st: StepState, what: str, stage: int, mb: int) -> torch.Tensor:
        if self.schedule.stage_rank[stage] == self.rank:  # the neighbour stage is here
            return st.outputs.pop((stage, mb)) if what == "act" else st.grads.pop((stage, mb))
        return st.inbox.pop((what, stage, mb))

    def _forward(self, st: StepState, c: Compute) -> None:
        keep = torch.is_grad_enabled()  # else evaluation: nothing kept for a backward
        if c.stage == 0:
            inp = st.ids[c.mb]
        else:
            inp = self._input(st, "act", c.stage - 1, c.mb).detach().requires_grad_(keep)
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._params and ptr not in seen:
                seen.add(ptr)
                st.live[key] = st.live.get(key, 0) + t.untyped_storage().nbytes()
                st.note_peak()
            return t

        key = (c.stage, c.mb)
        st.live[key] = 0
        st.note_peak()
        if c.stage:  # the received activation is kept as the stage's input
            seen.add(inp.untyped_storage().data_ptr())
            st.live[key] = inp.untyped_storage().nbytes()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.stages[c.stage](inp)
            if c.stage == self.last:
                out = loss_fn(out, st.labels[c.mb], st.num_total)
        if c.stage == self.last:
            st.record.losses[c.mb] = float(out.detach())
            st.record.loss += st.record.losses[c.mb]
        else:
            st.outputs[key] = out.detach()
        if keep:
            st.saved[key] = (inp, out)
        else:
            st.live.pop(key)
        st.note_peak()

    def _backward(self, st: StepState, c: Compute) -> None:
        inp, out = st.saved.pop((c.stage, c.mb))
        grad = None if c.stage == self.last else self._input(st, "grad", c.stage + 1, c.mb)
        needs_input = c.stage > 0
        if c.split_w:
            params = [p for p in self.stages[c.stage].parameters() if p.requires_grad]
            if needs_input:
                # torch's zero-bubble split: the input gradient now, the gradients reaching
                # the nodes where weights join kept, so W runs only the weights' own ops (a W
                # that backpropagated from the output again would redo the chunk's backward,
                # its all-to-alls included)
                _, groups = stage_backward_input([out], None if grad is None else [grad], [inp],
                                                 params)  # fmt: skip
                w = functools.partial(stage_backward_weight, params, groups)
            else:  # token ids in: the whole backward is weight gradients
                w = functools.partial(torch.autograd.backward, out, grad, inputs=params)
            st.weights[(c.stage, c.mb)] = w
        else:
            torch.autograd.backward(out, grad)
            st.live.pop((c.stage, c.mb))
        if needs_input:
            st.grads[(c.stage, c.mb)] = inp.grad

    def _weight(self, st: StepState, c: Compute) -> None:
        st.weights.pop((c.stage, c.mb))()
        st.live.pop((c.stage, c.mb))
