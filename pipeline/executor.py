"""Run one rank's part of a schedule on torch.distributed (gloo on CPU, nccl on CUDA).

Each action of the rank's list, in order: a receive posts ``irecv`` and waits (the schedule
places it right before the computation that needs it); a send posts ``isend`` (waited at the
end of the step); F runs the stage's forward with autograd, the last stage adding the loss; B
runs its backward: a whole one with ``torch.autograd.backward`` (input and weight gradients), a
split one (``split_w``) for the input gradient only (``inputs=[input]``, the graph kept), its
weight gradients deferred to the W that names it (DeepSeek's ``WeightGradStore``: a store of
pending closures); an F&B pair runs its forward then its backward. Gradients accumulate in the
parameters' ``.grad`` over the micro-batches, as a single process running them one by one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeline.model import Stage, loss_fn
from pipeline.schedules import Comm, Compute, Pair, Schedule


@dataclass
class StepRecord:
    """What one rank did in a step: its loss share and each computation's host interval."""

    loss: float = 0.0
    spans: list[tuple[str, float, float]] = field(default_factory=list)


class RankExecutor:
    """``stages``: this rank's stage modules by global stage index; ``shape``: a micro-batch's
    activations ``[batch, seq, hidden]`` (the same for every micro-batch)."""

    def __init__(self, schedule: Schedule, rank: int, stages: dict[int, Stage], shape, group=None):
        self.schedule, self.rank, self.stages = schedule, rank, stages
        self.shape, self.group = tuple(shape), group
        self.last = schedule.num_stages - 1

    def _tag(self, what: str, stage: int, mb: int) -> int:
        return ((what == "grad") * self.schedule.num_stages + stage) * 4096 + mb

    def step(self, ids: list[torch.Tensor], labels: list[torch.Tensor]) -> StepRecord:
        """One training step's forward and backward over the micro-batches ``ids`` / ``labels``
        (gradients accumulate; the caller steps the optimizer)."""
        self._ids, self._labels, self._n = ids, labels, len(ids)
        self._inbox: dict[tuple[str, int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # F output, for a local next stage
        self._saved: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}  # input gradient per (stage, mb)
        self._weights: dict[tuple[int, int], Callable[[], None]] = {}  # deferred W
        self._sends, record = [], StepRecord()
        self._record = record
        for action in self.schedule.ranks[self.rank]:
            if isinstance(action, Comm):
                self._comm(action)
            else:
                for c in (action.f, action.b) if isinstance(action, Pair) else (action,):
                    self._timed(c)
        for work, _tensor in self._sends:
            work.wait()
        if self._weights:
            raise RuntimeError(f"rank {self.rank}: W never run for {sorted(self._weights)}")
        return record

    def _comm(self, c: Comm) -> None:
        tag = self._tag(c.what, c.stage, c.mb)
        if c.kind == "send":
            store = self._outputs if c.what == "act" else self._grads
            tensor = store.pop((c.stage, c.mb)).contiguous()
            work = dist.isend(tensor, c.peer, group=self.group, tag=tag)
            self._sends.append((work, tensor))  # the tensor lives until the send is done
            return
        buf = torch.empty(self.shape, dtype=torch.float32)
        dist.irecv(buf, c.peer, group=self.group, tag=tag).wait()
        self._inbox[(c.what, c.stage, c.mb)] = buf

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
        out = self.stages[c.stage](inp)
        if c.stage == self.last:
            out = loss_fn(out, self._labels[c.mb], self._n)
            self._record.loss += float(out.detach())
        else:
            self._outputs[(c.stage, c.mb)] = out.detach()
        self._saved[(c.stage, c.mb)] = (inp, out)

    def _backward(self, c: Compute) -> None:
        inp, out = self._saved.pop((c.stage, c.mb))
        grad = None if c.stage == self.last else self._input("grad", c.stage + 1, c.mb)
        needs_input = c.stage > 0
        if c.split_w:
            if needs_input:
                torch.autograd.backward(out, grad, inputs=[inp], retain_graph=True)
            params = [p for p in self.stages[c.stage].parameters() if p.requires_grad]
            self._weights[(c.stage, c.mb)] = lambda: torch.autograd.backward(
                out, grad, inputs=params
            )
        else:
            torch.autograd.backward(out, grad)
        if needs_input:
            self._grads[(c.stage, c.mb)] = inp.grad

    def _weight(self, c: Compute) -> None:
        self._weights.pop((c.stage, c.mb))()
