"""Pipeline schedules as data: for PP ranks and N micro-batches, each rank's ordered actions.

A model is cut into ``num_stages`` stages; ``stage_rank`` says which rank holds each. An action
is a computation (``Compute``: F forward, B backward, W weight gradient; ``Pair``: a forward
and a backward of different micro-batches run overlapped, F&B) or a message (``Comm``: the
activation a stage sends to the next, or the gradient it sends to the previous). A backward
with ``split_w`` computes the input gradient only; its W comes later on the same rank.

- ``one_f_one_b``: PipeDream-flush 1F1B, stage s on rank s; rank r runs PP − r − 1 forwards,
  then one forward and one backward in turn, then the rest of the backwards.
- ``interleaved_1f1b``: Megatron's interleaved schedule (VPP), v chunks per rank, stage
  c·PP + r on rank r; forwards go round the chunks PP micro-batches at a time, backwards the
  chunks in reverse; rank r warms up with (PP − r − 1)·2 + (v − 1)·PP forwards. N must be a
  multiple of PP.
- ``dualpipev``: DeepSeek's DualPipeV (the V of DualPipe cut in half): 2·PP stages, rank r
  holds stage r (chunk 0) and stage 2·PP − 1 − r (chunk 1), so the first and the last stage
  share rank 0 and the middle two rank PP − 1. Its eight phases per rank are the reference
  implementation's: nF0, nF0F1, nB1W1F1 (warm-up: the backward split, its W at once), the main
  phase nF0B1F1B0 of F&B pairs, nB1F1B0, nB1B0, nWB0, nW. With ``dw_detach`` the cool-down's
  backwards split too (the second half of nB1B0, every one of nWB0), their W deferred to fill
  the bubbles; without it they are whole backwards. N ≥ 2·PP.

``forward_schedule(schedule)`` (``make_schedule(..., forward_only=True)``) keeps a schedule's
forwards for evaluation, as DeepSeek's ``DualPipeV.step(..., forward_only=True)``: every rank's
F in the schedule's order, an F&B pair reduced to its F, and the activations' messages; no B, W
or gradient message.
"""

from __future__ import annotations

import argparse
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# DualPipeV's cool-down backwards whole unless asked (MindSpeed's ``--dualpipev-dw-detach`` is
# off unless given); the one default, which the command line, ``make_schedule`` and the
# training config share
DEFAULT_DW_DETACH = False


@dataclass(frozen=True)
class Compute:
    kind: str  # "F", "B" or "W"
    stage: int
    mb: int
    split_w: bool = False  # a B that leaves its weight gradient to a later W

    def __str__(self) -> str:
        return f"{self.kind}{'i' if self.split_w else ''}{self.mb}@s{self.stage}"


@dataclass(frozen=True)
class Pair:
    """F&B: the forward ``f`` and the backward ``b`` of two micro-batches, overlapped."""

    f: Compute
    b: Compute

    def __str__(self) -> str:
        return f"({self.f}&{self.b})"


@dataclass(frozen=True)
class Comm:
    kind: str  # "send" or "recv"
    what: str  # "act" (stage's output, forward) or "grad" (gradient of stage's input)
    stage: int  # the stage whose output / input gradient travels
    mb: int
    peer: int

    def __str__(self) -> str:
        return f"{self.kind}-{self.what}{self.mb}@s{self.stage}:{self.peer}"


Action = Compute | Pair | Comm


@dataclass
class Schedule:
    name: str
    num_ranks: int
    num_microbatches: int
    num_stages: int
    stage_rank: list[int]  # per stage, the rank that holds it
    ranks: list[list[Action]] = field(default_factory=list)
    forward_only: bool = False  # forwards alone (evaluation): no B, W or gradient message

    def computes(self, rank: int) -> list[Compute]:
        """The rank's computations in order, pairs unfolded (forward first)."""
        out: list[Compute] = []
        for a in self.ranks[rank]:
            if isinstance(a, Pair):
                out += [a.f, a.b]
            elif isinstance(a, Compute):
                out.append(a)
        return out

    def chunk_of(self, stage: int) -> int:
        """0 or 1 under DualPipeV (the V's two arms), the chunk index under VPP, 0 for 1F1B."""
        rank = self.stage_rank[stage]
        return sorted(s for s, r in enumerate(self.stage_rank) if r == rank).index(stage)


class _Builder:
    """One rank's list, with the messages its computations need attached."""

    def __init__(self, schedule: Schedule, rank: int):
        self.s, self.rank, self.out = schedule, rank, []
        self.pending_w: deque[Compute] = deque()

    def _recv(self, c: Compute) -> list[Comm]:
        last = self.s.num_stages - 1
        if c.kind == "F" and c.stage > 0 and self.s.stage_rank[c.stage - 1] != self.rank:
            return [Comm("recv", "act", c.stage - 1, c.mb, self.s.stage_rank[c.stage - 1])]
        if c.kind == "B" and c.stage < last and self.s.stage_rank[c.stage + 1] != self.rank:
            return [Comm("recv", "grad", c.stage + 1, c.mb, self.s.stage_rank[c.stage + 1])]
        return []

    def _send(self, c: Compute) -> list[Comm]:
        last = self.s.num_stages - 1
        if c.kind == "F" and c.stage < last and self.s.stage_rank[c.stage + 1] != self.rank:
            return [Comm("send", "act", c.stage, c.mb, self.s.stage_rank[c.stage + 1])]
        if c.kind == "B" and c.stage > 0 and self.s.stage_rank[c.stage - 1] != self.rank:
            return [Comm("send", "grad", c.stage, c.mb, self.s.stage_rank[c.stage - 1])]
        return []

    def compute(self, c: Compute) -> None:
        self.out += [*self._recv(c), c, *self._send(c)]
        if c.split_w:
            self.pending_w.append(c)

    def pair(self, f: Compute, b: Compute) -> None:
        self.out += [*self._recv(f), *self._recv(b), Pair(f, b), *self._send(f), *self._send(b)]
        if b.split_w:
            self.pending_w.append(b)

    def weight(self) -> None:
        """The oldest deferred weight gradient (DeepSeek's WeightGradStore is a FIFO)."""
        if self.pending_w:
            b = self.pending_w.popleft()
            self.out.append(Compute("W", b.stage, b.mb))


def _build(schedule: Schedule, per_rank: Callable[[_Builder], None]) -> Schedule:
    for rank in range(schedule.num_ranks):
        builder = _Builder(schedule, rank)
        per_rank(builder)
        if builder.pending_w:
            raise AssertionError(f"rank {rank}: weight gradients never run: {builder.pending_w}")
        schedule.ranks.append(builder.out)
    return schedule


def _check_sizes(pp: int, n: int) -> None:
    if pp < 1 or n < 1:
        raise ValueError(f"pipeline size {pp} and micro-batches {n} must be at least 1")


def one_f_one_b(pp: int, n: int) -> Schedule:
    _check_sizes(pp, n)
    schedule = Schedule("1f1b", pp, n, pp, list(range(pp)))

    def per_rank(b: _Builder) -> None:
        s, warmup = b.rank, min(pp - b.rank - 1, n)
        for m in range(warmup):
            b.compute(Compute("F", s, m))
        for i in range(n - warmup):
            b.compute(Compute("F", s, warmup + i))
            b.compute(Compute("B", s, i))
        for m in range(n - warmup, n):
            b.compute(Compute("B", s, m))

    return _build(schedule, per_rank)


def interleaved_1f1b(pp: int, n: int, v: int) -> Schedule:
    _check_sizes(pp, n)
    if v < 2:
        raise ValueError(f"interleaved 1F1B needs at least 2 chunks per rank, got {v}")
    if n % pp:
        raise ValueError(f"interleaved 1F1B: micro-batches ({n}) must be a multiple of PP ({pp})")
    schedule = Schedule("vpp", pp, n, pp * v, [s % pp for s in range(pp * v)])
    total = n * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        return (chunk if forward else v - 1 - chunk), (k // (pp * v)) * pp + k % pp

    def per_rank(b: _Builder) -> None:
        warmup = min((pp - b.rank - 1) * 2 + (v - 1) * pp, total)

        def step(kind: str, k: int) -> None:
            chunk, m = chunk_mb(k, kind == "F")
            b.compute(Compute(kind, chunk * pp + b.rank, m))

        for k in range(warmup):
            step("F", k)
        for k in range(total - warmup):
            step("F", warmup + k)
            step("B", k)
        for k in range(total - warmup, total):
            step("B", k)

    return _build(schedule, per_rank)


def dualpipev(pp: int, n: int, *, dw_detach: bool) -> Schedule:
    _check_sizes(pp, n)
    if n < 2 * pp:
        raise ValueError(f"DualPipeV needs at least 2·PP = {2 * pp} micro-batches, got {n}")
    stages = [*range(pp), *reversed(range(pp))]
    schedule = Schedule("dualpipev" + ("-dw" if dw_detach else ""), pp, n, 2 * pp, stages)

    def per_rank(b: _Builder) -> None:
        r = b.rank
        stage = (r, 2 * pp - 1 - r)
        fwd, bwd = [0, 0], [0, 0]  # next micro-batch per chunk

        def f(chunk: int) -> Compute:
            fwd[chunk] += 1
            return Compute("F", stage[chunk], fwd[chunk] - 1)

        def bw(chunk: int, split: bool = False) -> Compute:
            bwd[chunk] += 1
            return Compute("B", stage[chunk], bwd[chunk] - 1, split_w=split)

        for _ in range((pp - r - 1) * 2):  # nF0
            b.compute(f(0))
        for _ in range(r + 1):  # nF0F1
            b.compute(f(0))
            b.compute(f(1))
        for _ in range(pp - r - 1):  # nB1W1F1: the warm-up's backwards always split
            b.compute(bw(1, split=True))
            b.weight()
            b.compute(f(1))
        for i in range(n - 2 * pp + r + 1):  # nF0B1F1B0
            if i == 0 and r == pp - 1:  # not overlapped: the V's tip depends on itself
                b.compute(f(0))
                b.compute(bw(1))
            else:
                b.pair(f(0), bw(1))
            b.pair(f(1), bw(0))
        for _ in range(pp - r - 1):  # nB1F1B0
            b.compute(bw(1))
            b.pair(f(1), bw(0))
        split = False
        for i in range(r + 1):  # nB1B0: the second half split (dw_detach)
            split = split or (dw_detach and i == (r + 1) // 2 and r % 2 == 1)
            b.compute(bw(1, split))
            split = split or (dw_detach and i == (r + 1) // 2 and r % 2 == 0)
            b.compute(bw(0, split))
        for _ in range(pp - r - 1):  # nWB0
            b.weight()
            b.compute(bw(0, dw_detach))
        while b.pending_w:  # nW
            b.weight()

    return _build(schedule, per_rank)


def forward_schedule(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` in its order: each rank's F (a pair's forward in the
    pair's place) and activation messages. The order stays deadlock-free: it drops only
    actions and the waits on them."""

    def keep(a: Action) -> Action | None:
        if isinstance(a, Pair):
            return a.f
        if isinstance(a, Comm):
            return a if a.what == "act" else None
        return a if a.kind == "F" else None

    ranks = [[k for a in actions if (k := keep(a)) is not None] for actions in schedule.ranks]
    return Schedule(schedule.name + "-forward", schedule.num_ranks, schedule.num_microbatches,
                    schedule.num_stages, schedule.stage_rank, ranks, forward_only=True)  # fmt: skip


def make_schedule(
    method: str,
    pp: int,
    n: int,
    v: int = 1,
    dw_detach: bool = DEFAULT_DW_DETACH,
    forward_only: bool = False,
) -> Schedule:
    """``--schedules-method`` {1f1b, vpp, dualpipev} with its options; ``forward_only``: its
    forwards alone (``forward_schedule``)."""
    if method == "1f1b":
        schedule = one_f_one_b(pp, n)
    elif method == "vpp":
        schedule = interleaved_1f1b(pp, n, v)
    elif method == "dualpipev":
        if v > 1:
            raise ValueError("DualPipeV is incompatible with virtual pipeline stages (VPP)")
        schedule = dualpipev(pp, n, dw_detach=dw_detach)
    else:
        raise ValueError(f"--schedules-method {method!r}: one of 1f1b, vpp, dualpipev")
    return forward_schedule(schedule) if forward_only else schedule


def add_schedule_args(parser: argparse.ArgumentParser, pp: int, n: int) -> None:
    """MindSpeed's flags for a schedule (``pp``, ``n``: the defaults)."""
    parser.add_argument("--schedules-method", choices=["1f1b", "vpp", "dualpipev"], default="1f1b")
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=pp)
    parser.add_argument("--num-micro-batches", type=int, default=n)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--dualpipev-dw-detach", action="store_true", default=DEFAULT_DW_DETACH)


def schedule_from_args(args: argparse.Namespace) -> Schedule:
    return make_schedule(
        args.schedules_method, args.pipeline_model_parallel_size, args.num_micro_batches,
        args.virtual_pipeline_model_parallel_size, args.dualpipev_dw_detach,
    )  # fmt: skip
