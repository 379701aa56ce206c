"""srt's DualPipeV order against DeepSeek's reference ``DualPipeV.step()`` (deepseek-ai/DualPipe,
``dualpipe/dualpipev.py``), derived here independently of ``make_schedule``.

The reference runs eight phases per rank r of PP, with chunk 0 the V's down arm and chunk 1 its
up arm, each chunk's forwards and backwards taking its micro-batches in order (one counter per
chunk and direction):

1. nF0, 2·(PP − r − 1) times: F0.
2. nF0F1, r + 1 times: F0, F1.
3. nB1W1F1, PP − r − 1 times: B1 split (zero bubble on), W, F1.
4. nF0B1F1B0, N − 2·PP + r + 1 times: the F&B pair (F0, B1), then the pair (F1, B0); on the
   last rank the first (F0, B1) runs as two lone computations, not overlapped.
5. nB1F1B0, PP − r − 1 times: B1, then the pair (F1, B0).
6. nB1B0, r + 1 times: B1, B0; from iteration ⌊(r + 1)/2⌋ on the backwards split, starting at
   that iteration's B1 on odd ranks and at its B0 on even ones.
7. nWB0, PP − r − 1 times: W, B0 split.
8. nW, r + 1 times: W.

A W runs the oldest pending weight gradient (``WeightGradStore`` is a FIFO); a pair's backward
never splits. The reference asserts N ≥ 2·PP and nothing more, so odd N is allowed.

srt's ``dualpipev`` with dW detach (``dw_detach=True``, ``--dualpipev-dw-detach``) must equal
this order exactly: every computation's kind, chunk and micro-batch, every B's split flag, and
which computations run as an F&B pair. Without dW detach srt deliberately differs (MindSpeed's
cool-down without ``--dualpipev-dw-detach``): the backwards of nB1B0 and nWB0 are whole, so
nWB0 is plain B0s and nW is empty; the warm-up's split B1 with its W at once stays. That
variant is checked against the same derivation with the cool-down's zero bubble off.
"""

from __future__ import annotations

from collections import deque

import pytest

from pipeline.schedules import Comm, Compute, Pair, make_schedule
from pipeline.simulator import check

# (kind, chunk, micro-batch, split) for a lone computation; ("FB", forward, backward) a pair
Op = tuple


class _Reference:
    """One rank's computations in the order DeepSeek's phase loop issues them."""

    def __init__(self, pp: int, n: int, rank: int, cooldown_split: bool):
        assert n >= 2 * pp, "DeepSeek's step() asserts num_chunks >= 2·num_ranks"
        self.pp, self.n, self.rank = pp, n, rank
        self.cooldown_split = cooldown_split
        self.next_f, self.next_b = [0, 0], [0, 0]
        self.store: deque[tuple[int, int]] = deque()  # (chunk, mb) of split Bs awaiting W
        self.ops: list[Op] = []

    def _f(self, chunk: int) -> Op:
        mb = self.next_f[chunk]
        self.next_f[chunk] += 1
        return ("F", chunk, mb, False)

    def _b(self, chunk: int, split: bool) -> Op:
        mb = self.next_b[chunk]
        self.next_b[chunk] += 1
        if split:
            self.store.append((chunk, mb))
        return ("B", chunk, mb, split)

    def forward(self, chunk: int) -> None:
        self.ops.append(self._f(chunk))

    def backward(self, chunk: int, split: bool = False) -> None:
        self.ops.append(self._b(chunk, split))

    def pair(self, f_chunk: int, b_chunk: int) -> None:
        f = self._f(f_chunk)  # the reference takes the forward's micro-batch first
        self.ops.append(("FB", f, self._b(b_chunk, False)))

    def weight(self) -> None:
        chunk, mb = self.store.popleft()  # an empty store is the reference's assertion error
        self.ops.append(("W", chunk, mb, False))

    def run(self) -> list[Op]:
        pp, r, last = self.pp, self.rank, self.rank == self.pp - 1
        zb_cool = self.cooldown_split
        for _ in range(2 * (pp - r - 1)):  # 1. nF0
            self.forward(0)
        for _ in range(r + 1):  # 2. nF0F1
            self.forward(0)
            self.forward(1)
        for _ in range(pp - r - 1):  # 3. nB1W1F1
            self.backward(1, split=True)
            self.weight()
            self.forward(1)
        for i in range(self.n - 2 * pp + r + 1):  # 4. nF0B1F1B0
            if i == 0 and last:
                self.forward(0)
                self.backward(1)
            else:
                self.pair(0, 1)
            self.pair(1, 0)
        for _ in range(pp - r - 1):  # 5. nB1F1B0
            self.backward(1)
            self.pair(1, 0)
        half, split = (r + 1) // 2, False
        for i in range(r + 1):  # 6. nB1B0
            if zb_cool and i == half and r % 2 == 1:
                split = True
            self.backward(1, split)
            if zb_cool and i == half and r % 2 == 0:
                split = True
            self.backward(0, split)
        for _ in range(pp - r - 1):  # 7. nWB0
            if zb_cool:
                self.weight()
            self.backward(0, split=zb_cool)
        if zb_cool:
            for _ in range(r + 1):  # 8. nW
                self.weight()
        assert not self.store, "the reference asserts the weight-gradient queue is empty"
        assert self.next_f == self.next_b == [self.n, self.n]
        return self.ops


def reference_order(pp: int, n: int, rank: int, cooldown_split: bool = True) -> list[Op]:
    return _Reference(pp, n, rank, cooldown_split).run()


def srt_order(pp: int, n: int, rank: int, dw_detach: bool) -> list[Op]:
    """srt's rank list with messages dropped, computations as ``reference_order`` writes them
    (the chunk from the stage: rank r holds stage r as chunk 0, 2·PP − 1 − r as chunk 1)."""
    schedule = make_schedule("dualpipev", pp, n, dw_detach=dw_detach)
    check(schedule)

    def op(c: Compute) -> Op:
        assert schedule.stage_rank[c.stage] == rank, c
        return (c.kind, schedule.chunk_of(c.stage), c.mb, c.split_w)

    out: list[Op] = []
    for a in schedule.ranks[rank]:
        if isinstance(a, Pair):
            out.append(("FB", op(a.f), op(a.b)))
        elif not isinstance(a, Comm):
            out.append(op(a))
    return out


def micro_batch_counts(pp: int) -> list[int]:
    """2·PP, 2·PP + 1 (the reference allows odd N), 3·PP and 16, where at least 2·PP."""
    return sorted({n for n in (2 * pp, 2 * pp + 1, 3 * pp, 16) if n >= 2 * pp})


CASES = [(pp, n) for pp in (2, 4, 8) for n in micro_batch_counts(pp)]


def _first_difference(ours: list[Op], theirs: list[Op]) -> str:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return f"at {i}: srt {a}, DeepSeek {b}"
    return f"lengths: srt {len(ours)}, DeepSeek {len(theirs)}"


@pytest.mark.parametrize("pp, n", CASES)
def test_dw_detach_follows_deepseek_step_exactly(pp, n):
    for rank in range(pp):
        ours, theirs = srt_order(pp, n, rank, dw_detach=True), reference_order(pp, n, rank)
        assert ours == theirs, (rank, _first_difference(ours, theirs))


@pytest.mark.parametrize("pp, n", CASES)
def test_without_dw_detach_only_the_cool_down_stays_whole(pp, n):
    for rank in range(pp):
        ours = srt_order(pp, n, rank, dw_detach=False)
        theirs = reference_order(pp, n, rank, cooldown_split=False)
        assert ours == theirs, (rank, _first_difference(ours, theirs))
        # and that is the only difference: DeepSeek's order with its cool-down Ws dropped and
        # every backward after the last forward whole
        full = reference_order(pp, n, rank)
        last_f = max(i for i, o in enumerate(full) if o[0] in ("F", "FB"))
        head, tail = full[: last_f + 1], full[last_f + 1 :]
        whole = [(k, c, m, False) for k, c, m, _ in tail if k != "W"]
        assert ours == head + whole, (rank, _first_difference(ours, head + whole))


def test_the_reference_derivation_itself():
    """Hand-worked cases of the derivation, PP 2, N 4: the last rank (r = 1) has no warm-up
    split, its first (F0, B1) unpaired, and, odd, splits nB1B0 from its second B1; the first
    rank (r = 0) splits B1 once in nB1W1F1 and, even, splits nB1B0 from its B0, whose W its
    nWB0 runs before its own B0."""
    assert reference_order(2, 4, 1) == [
        ("F", 0, 0, False), ("F", 1, 0, False), ("F", 0, 1, False), ("F", 1, 1, False),
        ("F", 0, 2, False), ("B", 1, 0, False), ("FB", ("F", 1, 2, False), ("B", 0, 0, False)),
        ("FB", ("F", 0, 3, False), ("B", 1, 1, False)),
        ("FB", ("F", 1, 3, False), ("B", 0, 1, False)),
        ("B", 1, 2, False), ("B", 0, 2, False), ("B", 1, 3, True), ("B", 0, 3, True),
        ("W", 1, 3, False), ("W", 0, 3, False),
    ]  # fmt: skip
    assert reference_order(2, 4, 0) == [
        ("F", 0, 0, False), ("F", 0, 1, False), ("F", 0, 2, False), ("F", 1, 0, False),
        ("B", 1, 0, True), ("W", 1, 0, False), ("F", 1, 1, False),
        ("FB", ("F", 0, 3, False), ("B", 1, 1, False)),
        ("FB", ("F", 1, 2, False), ("B", 0, 0, False)),
        ("B", 1, 2, False), ("FB", ("F", 1, 3, False), ("B", 0, 1, False)),
        ("B", 1, 3, False), ("B", 0, 2, True),
        ("W", 0, 2, False), ("B", 0, 3, True), ("W", 0, 3, False),
    ]  # fmt: skip
