"""``--overlap-mode auto``: the overlap of each step (off, two-batch or single-batch) chosen from
measured cost.

Whether an overlap pays depends on the link, the model, the engine and the batch: hiding an
all-to-all costs extra compute (two passes over the expert weights for TBO, a combine in blocks
for SBO), so on a fast link or a small batch the plain step wins. The cost model learns the
step time of every mode from the steps it runs:

- a sample is one step: its kind (prefill / decode), its mode, its tokens (the most any
  attention-DP group brings, the size that decides a lock-step's time), its time and the time
  its dispatchers spent in the all-to-all (both the slowest rank's, see below);
- samples go to a cell per (kind, mode, power-of-two bucket of tokens), which keeps the last
  ``window`` of them and stands for their medians of tokens, time and all-to-all time: one
  step slowed by something else on the machine moves nothing, a change that lasts is followed
  once it is in most of the window;
- a mode's time at ``tokens`` is its cell in that bucket, moved along a slope fitted through
  its cells weighted by closeness in buckets; in a bucket without a cell, that line's value
  (``OverlapCostModel.predict``); flat below the first cell;
- an overlap is compared with the plain step as measured at the same time: each of its samples
  also records its time over the plain step's prediction at that moment, and where its bucket
  has such ratios, its prediction is the plain step's times their median. Everything on the
  machine (a client tokenising, other work) slows both alike, so a plain step measured under
  load is not weighed against an overlap measured at calibration on a quiet machine.
  Calibration's first pass is cold for whichever mode runs a size first, so its ratios are
  taken once it ends, from its medians.

At start-up (``calibration``) the server runs synthetic steps of every bucket up to its limits,
each mode three times (the median stands), so that the first requests meet a measured model.
``OverlapPolicy.choose`` then runs, for the coming step, among the modes it may run:
- a mode never run in this bucket, once (exploration), unless the plain step spends less than
  ``min_comm_share`` of its time in the all-to-all there: no overlap can win more than that;
- otherwise the fastest prediction, with hysteresis: a bucket starts from the plain step and
  keeps its mode unless another is predicted faster by more than ``margin``; an overlap's
  prediction counts ``off_preference`` more than the plain step's, so an overlap is entered
  only for a gain of about 10 % and left as soon as the plain step is predicted faster (the
  plain step is the safe choice when measurements are noisy and the modes close);
- every ``remeasure_every``-th step of a bucket, the other mode sampled longest ago, so
  estimates stay true as lengths and load change (the same pruning as exploration); the
  plain step always at that rate, an overlap less often the more it costs and the longer it
  stays behind: one predicted more than ``far_behind`` slower than the current mode waits
  ``far_remeasure_every`` steps of its bucket (each such sample costs its whole deficit), and
  each re-measure that leaves an overlap still behind doubles its wait, up to
  ``max_remeasure_every``; the wait starts over once it is predicted, or its newest sample
  measured, at least as fast as the current mode.

Every rank holds its own policy and must choose the same mode (the modes run different
collectives). It does: the inputs are the same everywhere, since the tokens and the modes a
step may run come from the MLP sync, and each step's measurement is the maximum over ranks
(exchanged on the next step's sync, ``step_overlap``), in whole microseconds. The policy holds
no clock and no randomness, so the same measurements give the same choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MODES = ("off", "tbo", "sbo")
KINDS = ("prefill", "decode")


def bucket_of(tokens: int) -> int:
    """The power-of-two bucket: 0 for 1 token, 1 for 2–3, 2 for 4–7, ..."""
    return max(0, int(tokens).bit_length() - 1)


def _median(values: list[float]) -> float:
    """The middle value; of an even count the lower middle one (an outlier is high)."""
    return sorted(values)[(len(values) - 1) // 2]


@dataclass
class CostCell:
    """The last ``window`` samples of one (kind, mode, bucket); the estimate is their medians."""

    window: int = 5
    samples: int = 0  # all ever observed
    last_step: int = -1  # the policy step of the last sample
    recent: list[tuple[int, float, float]] = field(default_factory=list)
    recent_vs_off: list[float] = field(default_factory=list)
    tokens: float = 0.0
    seconds: float = 0.0
    comm_seconds: float = 0.0
    vs_off: float | None = None  # an overlap's time over the plain step's (None: not known)

    def add(
        self, tokens: int, seconds: float, comm_seconds: float, step: int, vs_off: float | None
    ):
        self.recent = [*self.recent[1 - self.window :], (tokens, seconds, comm_seconds)]
        self.tokens, self.seconds, self.comm_seconds = (_median(list(c)) for c in zip(*self.recent))
        if vs_off is not None:
            self.recent_vs_off = [*self.recent_vs_off[1 - self.window :], vs_off]
            self.vs_off = _median(self.recent_vs_off)
        self.samples += 1
        self.last_step = step


class OverlapCostModel:
    """Step time per (kind, mode) as a function of tokens (see the module docstring)."""

    def __init__(self, window: int = 5):
        if window < 1:
            raise ValueError(f"a cost cell's window must hold a sample, got {window}")
        self.window = window
        self.cells: dict[tuple[str, str, int], CostCell] = {}

    def observe(
        self,
        kind: str,
        mode: str,
        tokens: int,
        seconds: float,
        comm_seconds: float,
        step: int,
        relative: bool = True,
    ) -> None:
        """``relative``: also record an overlap's ratio to the plain step's prediction."""
        off = self.predict(kind, "off", tokens) if mode != "off" and relative else None
        vs_off = seconds / off if off else None
        cell = self.cells.setdefault((kind, mode, bucket_of(tokens)), CostCell(self.window))
        cell.add(tokens, seconds, comm_seconds, step, vs_off)

    def seed_vs_off(self) -> None:
        """Each overlap cell without a ratio gets its time over the plain step's prediction."""
        for (kind, mode, _), cell in self.cells.items():
            off = self.predict(kind, "off", round(cell.tokens)) if mode != "off" else None
            if off and cell.vs_off is None:
                cell.recent_vs_off, cell.vs_off = [cell.seconds / off], cell.seconds / off

    def cell(self, kind: str, mode: str, bucket: int) -> CostCell | None:
        return self.cells.get((kind, mode, bucket))

    def predict(self, kind: str, mode: str, tokens: int) -> float | None:
        """Seconds of a ``mode`` step of ``tokens``; None when the mode never ran this kind.
        An overlap whose bucket holds ratios to the plain step: the plain step's prediction
        times their median. Otherwise the cell of ``tokens``' bucket, moved along the mode's
        slope to ``tokens``; without one, a line through the mode's cells. The slope and the
        line are least squares, weighted by closeness in buckets (Gaussian, one bucket wide) and
        samples (up to 4), so
        a noisy cell is smoothed by its neighbours. Flat below the smallest cell."""
        cells = [c for (k, m, _), c in self.cells.items() if k == kind and m == mode]
        if not cells:
            return None
        tokens = max(tokens, min(c.tokens for c in cells))
        own = self.cells.get((kind, mode, bucket_of(tokens)))
        if mode != "off" and own is not None and own.vs_off is not None:
            off = self.predict(kind, "off", tokens)
            if off is not None:
                return off * own.vs_off
        if len(cells) == 1:
            return cells[0].seconds * tokens / cells[0].tokens  # proportional above
        x = math.log2(tokens)
        w = [math.exp(-((math.log2(c.tokens) - x) ** 2) / 2) * min(c.samples, 4) for c in cells]
        total = sum(w)
        mean_n = sum(wi * c.tokens for wi, c in zip(w, cells)) / total
        mean_t = sum(wi * c.seconds for wi, c in zip(w, cells)) / total
        sxx = sum(wi * (c.tokens - mean_n) ** 2 for wi, c in zip(w, cells))
        sxy = sum(wi * (c.tokens - mean_n) * (c.seconds - mean_t) for wi, c in zip(w, cells))
        slope = max(0.0, sxy / sxx) if sxx > 0 else 0.0  # a step never gets faster with tokens
        if own is not None:
            return max(0.0, own.seconds + slope * (tokens - own.tokens))
        return mean_t + slope * (tokens - mean_n)

    def predict_newest(self, kind: str, mode: str, tokens: int) -> float:
        """``predict`` from an overlap's newest ratio to the plain step alone (one sample moves
        no median, but can show that a mode left behind is worth measuring again); infinite
        where there is none."""
        own = self.cells.get((kind, mode, bucket_of(tokens)))
        off = self.predict(kind, "off", tokens) if mode != "off" else None
        if own is None or not own.recent_vs_off or off is None:
            return math.inf
        return off * own.recent_vs_off[-1]

    def comm_share(self, kind: str, tokens: int) -> float | None:
        """The plain step's all-to-all share of its time in ``tokens``' bucket (None: not
        measured)."""
        cell = self.cell(kind, "off", bucket_of(tokens))
        if cell is None or cell.seconds <= 0:
            return None
        return cell.comm_seconds / cell.seconds

    def estimates(self) -> dict:
        """``{kind: {mode: [{tokens, seconds, comm_seconds, samples}, ...]}}`` by bucket."""
        out: dict = {}
        for (kind, mode, bucket), c in sorted(self.cells.items()):
            row = dict(bucket=bucket, tokens=round(c.tokens, 1), seconds=round(c.seconds, 6),
                       comm_seconds=round(c.comm_seconds, 6), samples=c.samples)  # fmt: skip
            if c.vs_off is not None:
                row["vs_off"] = round(c.vs_off, 4)
            out.setdefault(kind, {}).setdefault(mode, []).append(row)
        return out


@dataclass
class OverlapPolicy:
    """Chooses each step's overlap (see the module docstring). ``modes``: those the server is
    built for, in order of preference on a tie (``off`` first)."""

    modes: tuple[str, ...] = MODES
    margin: float = 0.05
    off_preference: float = 0.05  # an overlap's prediction counts this much more than off's
    remeasure_every: int = 16
    far_behind: float = 0.25
    far_remeasure_every: int = 64
    max_remeasure_every: int = 1024
    min_comm_share: float = 0.03
    model: OverlapCostModel = field(default_factory=OverlapCostModel)
    step: int = 0
    current: dict[tuple[str, int], str] = field(default_factory=dict)  # by (kind, bucket)
    visits: dict[tuple[str, int], int] = field(default_factory=dict)
    last_visit: dict[tuple[str, int, str], int] = field(default_factory=dict)  # by mode too
    misses: dict[tuple[str, int, str], int] = field(default_factory=dict)  # re-measures behind
    step_counts: dict[tuple[str, str], int] = field(default_factory=dict)  # (kind, mode) run
    num_explored: int = 0  # steps run to measure a mode rather than because it was best
    calibrating: bool = False  # start-up: each step runs the mode least sampled in its bucket
    num_calibration_steps: int = 0

    def __post_init__(self):
        unknown = set(self.modes) - set(MODES)
        if unknown or "off" not in self.modes:
            raise ValueError(f"overlap modes {self.modes}: need 'off', and only {MODES}")

    def choose(self, kind: str, tokens: int, allowed: set[str] | frozenset[str]) -> str:
        """The mode of the coming step of ``kind`` and ``tokens``; ``allowed``: the modes this
        step may run (``off`` always may; ``tbo`` only when the batch splits)."""
        if kind not in KINDS:
            raise ValueError(f"step kind {kind!r} is not one of {KINDS}")
        self.step += 1
        modes = [m for m in self.modes if m == "off" or m in allowed]
        if self.calibrating:
            self.num_calibration_steps += 1
            return self._least_sampled(kind, tokens, modes)
        mode, explored = self._decide(kind, tokens, modes)
        self.num_explored += explored
        self.step_counts[(kind, mode)] = self.step_counts.get((kind, mode), 0) + 1
        return mode

    def observe(self, kind: str, mode: str, tokens: int, seconds: float, comm_seconds: float):
        """A step's measurement. Calibration's samples count like serving's: the median of a
        cell's three passes drops the first one's first-use costs (fresh pages)."""
        relative = not self.calibrating
        self.model.observe(kind, mode, tokens, seconds, comm_seconds, self.step, relative)

    def end_calibration(self) -> None:
        self.calibrating = False
        self.model.seed_vs_off()

    def _worth_measuring(self, kind: str, tokens: int, modes: list[str]) -> list[str]:
        share = self.model.comm_share(kind, tokens)
        return [m for m in modes if m == "off" or share is None or share >= self.min_comm_share]

    def _least_sampled(self, kind: str, tokens: int, modes: list[str]) -> str:
        bucket = bucket_of(tokens)
        samples = {m: (c.samples if (c := self.model.cell(kind, m, bucket)) else 0) for m in modes}
        return min(self._worth_measuring(kind, tokens, modes), key=lambda m: samples[m])

    def _decide(self, kind: str, tokens: int, modes: list[str]) -> tuple[str, bool]:
        if len(modes) == 1:
            return modes[0], False
        bucket = bucket_of(tokens)
        key = (kind, bucket)
        visit = self.visits[key] = self.visits.get(key, 0) + 1
        mode, explored = self._decide_in_bucket(kind, tokens, modes, visit)
        self.last_visit[(kind, bucket, mode)] = visit
        return mode, explored

    def _decide_in_bucket(
        self, kind: str, tokens: int, modes: list[str], visit: int
    ) -> tuple[str, bool]:
        bucket = bucket_of(tokens)
        key = (kind, bucket)
        worth_measuring = self._worth_measuring(kind, tokens, modes)
        unmeasured = [m for m in worth_measuring if self.model.cell(kind, m, bucket) is None]
        if unmeasured:
            return unmeasured[0], True
        predicted = {m: self.model.predict(kind, m, tokens) for m in modes}
        bias = {m: 1.0 if m == "off" else 1.0 + self.off_preference for m in modes}
        known = {m: t * bias[m] for m, t in predicted.items() if t is not None}
        best = min(known, key=lambda m: (known[m], modes.index(m)))
        current = self.current.get(key, "off")  # a bucket starts from the plain step
        if current not in known or known[best] < known[current] * (1 - self.margin):
            current = best
        self.current[key] = current
        self.misses.pop((kind, bucket, current), None)
        if visit % self.remeasure_every == 0:
            # an overlap's wait starts over once it, or its newest sample, is level
            for m in known:
                newest = self.model.predict_newest(kind, m, tokens)
                if min(known[m], newest * bias[m]) <= known[current]:
                    self.misses.pop((kind, bucket, m), None)
            others = [
                m
                for m in worth_measuring
                if m != current
                and visit - self.last_visit.get((kind, bucket, m), 0)
                >= self._remeasure_wait(kind, bucket, m, known[m] / known[current])
            ]
            if others:
                mode = min(others, key=lambda m: self.model.cell(kind, m, bucket).last_step)
                if mode != "off":
                    self.misses[(kind, bucket, mode)] = self.misses.get((kind, bucket, mode), 0) + 1
                return mode, True
        return current, False

    def _remeasure_wait(self, kind: str, bucket: int, mode: str, behind: float) -> int:
        """Visits of its bucket that ``mode`` (not the current one) waits between re-measures;
        ``behind``: its prediction over the current mode's."""
        misses = self.misses.get((kind, bucket, mode), 0)
        if mode == "off" or (misses == 0 and behind <= 1 + self.far_behind):
            return 0  # the safe choice, and a close overlap, at every re-measuring step
        base = self.far_remeasure_every if behind > 1 + self.far_behind else self.remeasure_every
        return min(base << min(misses, 30), max(base, self.max_remeasure_every))

    def info(self) -> dict:
        """For ``/get_server_info``: steps per chosen mode, explorations, current choices and
        the cost model's cells."""
        return {
            "modes": list(self.modes),
            "num_steps": {f"{k}/{m}": n for (k, m), n in sorted(self.step_counts.items())},
            "num_explored_steps": self.num_explored,
            "num_calibration_steps": self.num_calibration_steps,
            "current": {f"{k}/{b}": m for (k, b), m in sorted(self.current.items())},
            "estimates": self.model.estimates(),
        }
