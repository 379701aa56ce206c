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
  other computes.

Gradients accumulate in the parameters' ``.grad`` over the micro-batches, as a single process
running them one by one. The executor also tallies the activations its forwards keep for their
backwards (the tensors autograd saves, parameters left out, each storage once per chunk): a
chunk's count from its F until its whole B or its W, the rank's peak over the step in bytes
and in chunks.
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
from pipeline.schedules import Comm, Compute, Pair, Schedule
from pipeline.simulator import message_key
from srt.batch_overlap.ubatching import UBatchThreads


@dataclass
class StepRecord:
    """What one rank did in a step: its loss share and each computation's host interval."""

    loss: float = 0.0
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    peak_bytes: int = 0  # activations kept for backwards, at most at once
    peak_chunks: int = 0  # chunks (stage, micro-batch) holding them, at most at once
    # message_key → a send's post time, or a receive's wait (start, end); host clock
    sends: dict[str, float] = field(default_factory=dict)
    receives: dict[str, tuple[float, float]] = field(default_factory=dict)


class RankExecutor:
    """``stages``: this rank's stage modules by global stage index; ``shape``: a micro-batch's
    activations ``[batch, seq, hidden]`` (the same for every micro-batch); ``peers``: the
    global rank of each pipeline rank (identity by default); ``num_total``: the micro-batches
    the step's mean loss is over (all EP ranks' together; the rank's own by default)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, Stage], shape,
                 peers: list[int] | None = None, fb_overlap: bool = False,
                 num_total: int | None = None):  # fmt: skip
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.shape, self.peers = tuple(shape), peers or list(range(schedule.num_ranks))
        self.last = schedule.num_stages - 1
        self.num_total = num_total
        self.threads = UBatchThreads() if fb_overlap else None
        self._params = {p.untyped_storage().data_ptr() for st in stages.values()
                        for p in st.parameters()}  # fmt: skip

    def _tag(self, what: str, stage: int, mb: int) -> int:
        return ((what == "grad") * self.schedule.num_stages + stage) * 4096 + mb

    def step(self, ids: list[torch.Tensor], labels: list[torch.Tensor]) -> StepRecord:
        """One training step's forward and backward over the micro-batches ``ids`` / ``labels``
        (gradients accumulate; the caller steps the optimizer)."""
        self._ids, self._labels = ids, labels
        self._n = self.num_total or len(ids)
        self._inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # F output, for a local next stage
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}  # input gradient per (stage, mb)
        self._weights: dict[tuple[int, int], Callable[[], None]] = {}  # deferred W
        self._live: dict[tuple[int, int], int] = {}  # activation bytes per (stage, mb)
        self._sends, record = [], StepRecord()
        self._record = record
        self._recvs = self._post_receives()
        for action in self.schedule.ranks[self.rank]:
            if isinstance(action, Comm):
                self._comm(action)
            elif isinstance(action, Pair) and self.threads is not None:
                start = time.perf_counter()
                # the backward first: its first exchange (the last layer's combine) comes at
                # once, and the forward's attention computes while it is in flight
                jobs = [functools.partial(self._backward, action.b),
                        functools.partial(self._forward, action.f)]  # fmt: skip
                self.threads.run(jobs, torch.device("cpu"))
                record.spans.append((str(action), start, time.perf_counter()))
            else:
                for c in (action.f, action.b) if isinstance(action, Pair) else (action,):
                    self._timed(c)
        for work, _tensor in self._sends:
            work.wait()
        if self._weights:
            raise RuntimeError(f"rank {self.rank}: W never run for {sorted(self._weights)}")
        return record

    def close(self) -> None:
        if self.threads is not None:
            self.threads.close()

    def _comm(self, c: Comm) -> None:
        tag, key = self._tag(c.what, c.stage, c.mb), message_key(c.what, c.stage, c.mb)
        if c.kind == "send":
            store = self._outputs if c.what == "act" else self._grads
            tensor = store.pop((c.stage, c.mb)).contiguous()
            self._record.sends[key] = time.perf_counter()
            work = dist.isend(tensor, self.peers[c.peer], tag=tag)
            self._sends.append((work, tensor))  # the tensor lives until the send is done
            return
        work, buf = self._recvs.pop((c.what, c.stage, c.mb))
        start = time.perf_counter()
        work.wait()
        self._record.receives[key] = (start, time.perf_counter())
        self._inbox[(c.what, c.stage, c.mb)] = buf

    def _post_receives(self) -> dict:
        """Every receive of the step, posted at its start: gloo moves a message once its
        receive is posted, so a receive posted only when its computation is next would expose
        the whole transfer; posted early, it arrives while the rank computes."""
        out = {}
        for c in self.schedule.ranks[self.rank]:
            if isinstance(c, Comm) and c.kind == "recv":
                buf = torch.empty(self.shape, dtype=torch.float32)
                tag = self._tag(c.what, c.stage, c.mb)
                out[(c.what, c.stage, c.mb)] = (dist.irecv(buf, self.peers[c.peer], tag=tag), buf)
        return out

    def _timed(self, c: Compute) -> None:
        start = time.perf_counter()
        {"F": self._forward, "B": self._backward, "W": self._weight}[c.kind](c)
        self._record.spans.append((str(c), start, time.perf_counter()))

    def _input(self, what: str, stage: int, mb: int) -> torch.Tensor:
        if self.schedule.stage_rank[stage] == self.rank:  # the neighbour stage is here
            return self._outputs.pop((stage, mb)) if what == "act" else self._grads.pop((stage, mb))
        return self._inbox.pop((what, stage, mb))

    def _forward(self, c: Compute) -> None:
        if c.stage == 0:
            inp = self._ids[c.mb]
        else:
            inp = self._input("act", c.stage - 1, c.mb).detach().requires_grad_()
        seen: set[int] = set()

        def pack(t: torch.Tensor) -> torch.Tensor:
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self._params and ptr not in seen:
                seen.add(ptr)
                self._live[key] = self._live.get(key, 0) + t.untyped_storage().nbytes()
                self._note_peak()
            return t

        key = (c.stage, c.mb)
        self._live[key] = 0
        self._note_peak()
        if c.stage:  # the received activation is kept as the stage's input
            seen.add(inp.untyped_storage().data_ptr())
            self._live[key] = inp.untyped_storage().nbytes()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.stages[c.stage](inp)
            if c.stage == self.last:
                out = loss_fn(out, self._labels[c.mb], self._n)
        if c.stage == self.last:
            self._record.loss += float(out.detach())
        else:
            self._outputs[key] = out.detach()
        self._saved[key] = (inp, out)
        self._note_peak()

    def _note_peak(self) -> None:
        record = self._record
        record.peak_bytes = max(record.peak_bytes, sum(self._live.values()))
        record.peak_chunks = max(record.peak_chunks, len(self._live))

    def _backward(self, c: Compute) -> None:
        inp, out = self._saved.pop((c.stage, c.mb))
        grad = None if c.stage == self.last else self._input("grad", c.stage + 1, c.mb)
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
            self._weights[(c.stage, c.mb)] = w
        else:
            torch.autograd.backward(out, grad)
            self._live.pop((c.stage, c.mb))
        if needs_input:
            self._grads[(c.stage, c.mb)] = inp.grad

    def _weight(self, c: Compute) -> None:
        self._weights.pop((c.stage, c.mb))()
        self._live.pop((c.stage, c.mb))
