"""Timelines of layer operations recorded by ``OperationObserver(record=True)``: a Chrome /
Perfetto trace (one row per micro-batch, one for the all-to-alls in flight) and a PNG of one
layer's stages (matplotlib), plus the all-to-all time of a step: ``bench_one_batch.py
--profile``'s output, and the start-up check of ``--profile`` there and in
``emulated_cluster.py``.

An all-to-all is "in flight" from the start of its launch operation (``dispatch_a`` /
``combine_a``) to the end of its wait (``dispatch_b`` / ``combine_b``); under two-batch overlap
the other micro-batch's operations run in between (under dual-batch overlap, inside the wait:
the thread yields there).
"""

from __future__ import annotations

import json
from pathlib import Path

from srt.layers.overlap.operations import OpEvent

# Two-batch overlap's micro-batches are A and B, dual-batch overlap's threads u0 and u1.
ROWS = {"plain": 1, "A": 1, "B": 2, "u0": 1, "u1": 2}
COMM_ROW = 3
PAIRS = (("dispatch_a", "dispatch_b", "dispatch"), ("combine_a", "combine_b", "combine"))


def comm_intervals(events: list[OpEvent]) -> list[tuple[str, str, int | None, float, float]]:
    """(track, "dispatch"/"combine", layer, start, end) of every all-to-all in flight."""
    starts, out = {}, []
    for e in events:
        for launch, wait, label in PAIRS:
            if e.name == launch:
                starts[e.track, e.layer_id, label] = e.start
            elif e.name == wait:
                out.append(
                    (e.track, label, e.layer_id, starts.pop((e.track, e.layer_id, label)), e.end)
                )
    return out


def comm_seconds(events: list[OpEvent]) -> float:
    """Time spent in the all-to-all operations themselves (launch and wait halves): on the
    unsplit path that is the step's communication time, T_comm."""
    names = {name for pair in PAIRS for name in pair[:2]}
    return sum(e.end - e.start for e in events if e.name in names)


def write_chrome_trace(path: Path, steps: dict[str, list[OpEvent]], rank: int = 0) -> None:
    """``steps``: label → events; each step is a process row group in the trace."""
    trace = []
    for pid, (label, events) in enumerate(steps.items()):
        if not events:
            continue
        t0 = min(e.start for e in events)

        def us(t: float, t0: float = t0) -> float:
            return (t - t0) * 1e6

        trace.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "args": {"name": f"rank {rank}: {label}"},
            }
        )
        for tid, name in (
            (1, "micro-batch A (or unsplit)"),
            (2, "micro-batch B"),
            (COMM_ROW, "all-to-all in flight"),
        ):
            trace.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
            )
        for e in events:
            trace.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": ROWS[e.track],
                    "ts": us(e.start),
                    "dur": us(e.end) - us(e.start),
                    "name": f"L{e.layer_id} {e.name}",
                    "cat": e.track,
                }
            )
        for track, label_, layer, start, end in comm_intervals(events):
            trace.append(
                {
                    "ph": "X",
                    "pid": pid,
                    "tid": COMM_ROW,
                    "ts": us(start),
                    "dur": us(end) - us(start),
                    "name": f"{track} L{layer} {label_}",
                    "cat": "comm",
                }
            )
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))


def matplotlib_missing() -> str | None:
    """Why ``--profile`` cannot draw its PNG timelines, or None; checked at start-up so that a
    long run does not fail at its first picture."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return f"--profile needs matplotlib for the PNG timelines ({e}): pip install -e '.[bench]'"
    return None


def plot_layer(path: Path, steps: dict[str, list[OpEvent]], layer_id: int) -> None:
    """One subplot per step: the operations of ``layer_id`` per micro-batch, and the
    all-to-alls in flight, on a millisecond axis."""
    if missing := matplotlib_missing():
        raise SystemExit(missing)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(steps), 1, figsize=(13, 2.6 * len(steps)), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for ax, (label, events) in zip(axes[:, 0], steps.items()):
        layer = [e for e in events if e.layer_id == layer_id]
        if not layer:
            continue
        t0 = min(e.start for e in layer)

        def ms(t: float, t0: float = t0) -> float:
            return (t - t0) * 1e3

        names = sorted({e.name for e in layer})
        for e in layer:
            color = colors[names.index(e.name) % len(colors)]
            y = 2 - ROWS[e.track]
            ax.broken_barh(
                [(ms(e.start), ms(e.end) - ms(e.start))],
                (y + 0.1, 0.8),
                facecolors=color,
                edgecolor="black",
                linewidth=0.3,
            )
            if ms(e.end) - ms(e.start) > 0.02 * (ms(max(x.end for x in layer))):
                ax.text(ms(e.start), y + 0.5, e.name, fontsize=6, va="center")
        for track, what, _, start, end in comm_intervals(layer):
            y = -1 + (0.45 if ROWS[track] == 2 else 0)
            ax.broken_barh(
                [(ms(start), ms(end) - ms(start))],
                (y + 0.05, 0.4),
                facecolors="tab:red" if what == "dispatch" else "tab:purple",
            )
            ax.text(ms(start), y + 0.25, f"{track} {what}", fontsize=6, va="center")
        rows = ["all-to-all in flight", "micro-batch B", "A / unsplit"]
        ax.set_yticks([-0.5, 0.5, 1.5], rows)
        ax.set_xlabel("ms")
        ax.set_title(f"{label}: layer {layer_id}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
