"""A schedule's simulated timeline as a picture: one row per rank, time across, each action a
box numbered by its micro-batch; chunk 0 and chunk 1 (the V's two arms, or VPP's chunks) in
two colours, forwards light, backwards dark, weight gradients grey, F&B pairs framed (the way
MindSpeed draws DualPipeV). Needs matplotlib."""

from __future__ import annotations

from pathlib import Path

from pipeline.schedules import Pair
from pipeline.simulator import Timeline

COLOURS = {  # (chunk, kind) → colour
    (0, "F"): "#9ecae1", (0, "B"): "#3182bd", (1, "F"): "#fdae6b", (1, "B"): "#e6550d",
}  # fmt: skip


def draw(timeline: Timeline, path: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = timeline.schedule
    fig, ax = plt.subplots(figsize=(max(8.0, timeline.makespan * 0.25), 0.6 * s.num_ranks + 1))
    for span in timeline.spans:
        parts = [span.action.f, span.action.b] if isinstance(span.action, Pair) else [span.action]
        width = (span.end - span.start) / len(parts)
        for i, c in enumerate(parts):
            chunk = min(s.chunk_of(c.stage), 1)
            colour = "#bdbdbd" if c.kind == "W" else COLOURS[(chunk, c.kind)]
            x = span.start + i * width
            ax.broken_barh([(x, width)], (s.num_ranks - 1 - span.rank, 0.9), facecolors=colour,
                           edgecolor="white", linewidth=0.5)  # fmt: skip
            ax.text(x + width / 2, s.num_ranks - 0.55 - span.rank, str(c.mb), ha="center",
                    va="center", fontsize=6)  # fmt: skip
        if isinstance(span.action, Pair):
            ax.broken_barh([(span.start, span.end - span.start)],
                           (s.num_ranks - 1 - span.rank, 0.9), facecolors="none",
                           edgecolor="black", linewidth=1.2)  # fmt: skip
    ax.set_yticks([s.num_ranks - 0.55 - r for r in range(s.num_ranks)],
                  [f"rank {r}" for r in range(s.num_ranks)])  # fmt: skip
    ax.set_xlabel("time (cost units)")
    ax.set_title(title or f"{s.name}: PP {s.num_ranks}, {s.num_microbatches} micro-batches")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
