"""Simulate a schedule: each rank runs its actions in order, an action starting when the rank is
free and its inputs are there; → each rank's timeline, its bubble (the makespan minus the
rank's busy time) and its peak live activations (micro-batch chunks whose forward has started
and whose backward, W included, has not ended). ``check`` proves a schedule valid.

Costs are per action of one stage (a chunk): F, B (a whole backward: input and weight
gradients), W (the weight-gradient part, so a split backward costs B − W), FB (an F&B pair run
overlapped; default F + B, no overlap), p2p (a message's transfer), a2a (the MoE all-to-all of
one forward or one backward, exposed in F and B alone; an F&B pair's cost says how much of its
two stays exposed). ``by_stage`` overrides them per action kind and stage (``cost_key``),
``by_action`` per action (its name) and ``by_message`` the transfer time per message
(``message_key``), for costs measured. Messages are asynchronous sends and blocking receives.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pipeline.schedules import Action, Comm, Compute, Pair, Schedule


class ScheduleError(ValueError):
    """A schedule that cannot run as written."""


def cost_key(action: Compute | Pair) -> str:
    """``F@s1``, ``B@s2``, ``Bi@s2`` (a split backward), ``W@s2``, ``FB@s0,s3`` (a pair)."""
    if isinstance(action, Pair):
        return f"FB@s{action.f.stage},s{action.b.stage}"
    return f"{action.kind}{'i' if action.split_w else ''}@s{action.stage}"


@dataclass(frozen=True)
class Costs:
    F: float = 1.0
    B: float = 2.0
    W: float = 1.0
    FB: float | None = None
    p2p: float = 0.0
    a2a: float = 0.0
    Bi: float | None = None  # a split backward (input gradient only); B − W when None
    by_stage: dict[str, float] = field(default_factory=dict)  # cost_key → cost
    by_action: dict[str, float] = field(default_factory=dict)  # str(action) → cost
    by_message: dict[str, float] = field(default_factory=dict)  # message_key → transfer time

    def of(self, action: Compute | Pair) -> float:
        if (cost := self.by_action.get(str(action))) is not None:
            return cost
        if (cost := self.by_stage.get(cost_key(action))) is not None:
            return cost
        if isinstance(action, Pair):
            return self.FB if self.FB is not None else self.of(action.f) + self.of(action.b)
        if action.kind == "F":
            return self.F + self.a2a
        if action.kind == "W":
            return self.W
        if action.split_w:
            return (self.B - self.W if self.Bi is None else self.Bi) + self.a2a
        return self.B + self.a2a


def message_key(what: str, stage: int, mb: int) -> str:
    """``act3@s1`` (stage 1's output for micro-batch 3), ``grad3@s2`` (the gradient of stage
    2's input): one message each, from the rank holding the stage."""
    return f"{what}{mb}@s{stage}"


@dataclass(frozen=True)
class Span:
    rank: int
    action: Compute | Pair
    start: float
    end: float


@dataclass
class Timeline:
    schedule: Schedule
    costs: Costs
    spans: list[Span] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max(s.end for s in self.spans)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.spans if s.rank == rank)

    def bubbles(self) -> list[float]:
        """Per rank: the makespan minus its busy time."""
        return [self.makespan - self.busy(r) for r in range(self.schedule.num_ranks)]

    def peak_activations(self) -> list[int]:
        """Per rank: the most (stage, micro-batch) activations held at once."""
        peaks = []
        for rank in range(self.schedule.num_ranks):
            events = []
            for s in (s for s in self.spans if s.rank == rank):
                for c in _parts(s.action):
                    if c.kind == "F":
                        events.append((s.start, 1))
                    elif c.kind == "W" or not c.split_w:
                        events.append((s.end, -1))
            live = peak = 0
            for _, delta in sorted(events):  # releases first at equal times
                live += delta
                peak = max(peak, live)
            peaks.append(peak)
        return peaks


def _parts(action: Compute | Pair) -> tuple[Compute, ...]:
    return (action.f, action.b) if isinstance(action, Pair) else (action,)


class _Run:
    """The simulation's state: when each computation ended, when each message arrives."""

    def __init__(self, schedule: Schedule, costs: Costs):
        self.s, self.costs = schedule, costs
        self.done: dict[tuple[str, int, int], float] = {}  # (kind, stage, mb) → end
        self.sent: dict[tuple[str, int, int, int], float] = {}  # (what, stage, mb, dst) → arrival
        self.received: dict[tuple[str, int, int], float] = {}  # (what, stage, mb) → at this rank

    def input_ready(self, rank: int, c: Compute) -> float | None:
        """When ``c``'s inputs are on ``rank``; None while one is missing."""
        last = self.s.num_stages - 1
        if c.kind == "F":
            if c.stage == 0:
                return 0.0
            return self._from(rank, "F", "act", c.stage - 1, c.mb)
        if c.kind == "W":
            return self.done.get(("B", c.stage, c.mb))
        own = self.done.get(("F", c.stage, c.mb))
        if own is None:
            return None
        if c.stage == last:
            return own
        grad = self._from(rank, "B", "grad", c.stage + 1, c.mb)
        return None if grad is None else max(own, grad)

    def _from(self, rank: int, kind: str, what: str, stage: int, mb: int) -> float | None:
        if self.s.stage_rank[stage] == rank:
            return self.done.get((kind, stage, mb))
        return self.received.get((what, stage, mb, rank))

    def step(self, rank: int, action: Action, clock: float) -> tuple[float, float] | None:
        """Run ``action`` on ``rank`` free at ``clock``: its start and end, or None if it must
        wait."""
        if isinstance(action, Comm):
            key = (action.what, action.stage, action.mb)
            if action.kind == "send":
                p2p = self.costs.by_message.get(message_key(*key), self.costs.p2p)
                self.sent[(*key, action.peer)] = clock + p2p
                return clock, clock
            arrival = self.sent.get((*key, rank))
            if arrival is None:
                return None
            self.received[(*key, rank)] = max(clock, arrival)
            return clock, max(clock, arrival)
        times = [self.input_ready(rank, c) for c in _parts(action)]
        if any(t is None for t in times):
            return None
        start = max(clock, *times)
        end = start + self.costs.of(action)
        for c in _parts(action):
            self.done[(c.kind, c.stage, c.mb)] = end
        return start, end


def simulate(schedule: Schedule, costs: Costs = Costs()) -> Timeline:
    """Run every rank's list; raises ScheduleError naming each rank's blocked action when no
    rank can go on (a deadlock)."""
    run, timeline = _Run(schedule, costs), Timeline(schedule, costs)
    pos = [0] * schedule.num_ranks
    clock = [0.0] * schedule.num_ranks
    while any(p < len(a) for p, a in zip(pos, schedule.ranks)):
        progressed = False
        for r, actions in enumerate(schedule.ranks):
            while pos[r] < len(actions):
                action = actions[pos[r]]
                ran = run.step(r, action, clock[r])
                if ran is None:
                    break
                start, end = ran
                if not isinstance(action, Comm):
                    timeline.spans.append(Span(r, action, start, end))
                clock[r], pos[r], progressed = end, pos[r] + 1, True
        if not progressed:
            blocked = [f"rank {r}: {a[p]}" for r, (p, a) in enumerate(zip(pos, schedule.ranks))
                       if p < len(a)]  # fmt: skip
            raise ScheduleError(f"{schedule.name}: deadlock; blocked: {'; '.join(blocked)}")
    return timeline


def check(schedule: Schedule) -> None:
    """Every stage's actions on its rank; every micro-batch's F and B once per stage (F alone
    in a ``forward_only`` schedule), W once exactly where its B was split, after it; every send
    matched by one receive between the right ranks; and the whole schedule runs to its end (no
    deadlock). Raises ScheduleError."""
    s, counts = schedule, Counter()
    kinds = ("F",) if s.forward_only else ("F", "B")
    messages: Counter = Counter()
    for rank, actions in enumerate(s.ranks):
        for a in actions:
            if isinstance(a, Comm):
                src, dst = (rank, a.peer) if a.kind == "send" else (a.peer, rank)
                if s.stage_rank[a.stage] != src:
                    raise ScheduleError(f"rank {rank}: {a} travels from a rank without s{a.stage}")
                messages[(a.what, a.stage, a.mb, src, dst)] += 1 if a.kind == "send" else -1
                continue
            for c in _parts(a):
                if s.stage_rank[c.stage] != rank:
                    raise ScheduleError(f"rank {rank} runs {c} of a stage it does not hold")
                counts[(c.kind, c.stage, c.mb)] += 1
                counts[("split", c.stage, c.mb)] += c.kind == "B" and c.split_w
    for stage in range(s.num_stages):
        for mb in range(s.num_microbatches):
            for kind in ("F", "B"):
                if counts[(kind, stage, mb)] != (kind in kinds):
                    n = counts[(kind, stage, mb)]
                    raise ScheduleError(f"{s.name}: {kind}{mb}@s{stage} runs {n} times")
            if counts[("W", stage, mb)] != counts[("split", stage, mb)]:
                raise ScheduleError(f"{s.name}: W{mb}@s{stage} without a split B, or missing")
    unmatched = {k: v for k, v in messages.items() if v}
    if unmatched:
        raise ScheduleError(f"{s.name}: sends without receives (or back): {unmatched}")
    simulate(schedule, Costs(1.0, 2.0, 1.0))
