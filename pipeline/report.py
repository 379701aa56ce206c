"""A training run's figures from every rank's results (``pipeline/train.py``): step times,
costs, the bubbles measured against the simulator's, peak activations, bytes exchanged."""

from __future__ import annotations

import re
import statistics

from pipeline.simulator import Costs, simulate

WAITED_S = 50e-6  # a receive's wait longer than this waited for its message


def _cost_key(name: str) -> str:
    """A span's ``cost_key`` from its action's name (``Bi3@s2`` → ``Bi@s2``, ``(F3@s0&B1@s3)``
    → ``FB@s0,s3``)."""
    parts = [re.fullmatch(r"([A-Za-z]+)\d+@s(\d+)", p) for p in name.strip("()").split("&")]
    if len(parts) == 2:
        return f"FB@s{parts[0][2]},s{parts[1][2]}"
    return f"{parts[0][1]}@s{parts[0][2]}"


def _costs(ranks: list[dict], steps: range) -> tuple[dict, dict]:
    """The spans' durations by ``cost_key`` and by kind."""
    by_stage: dict[str, list[float]] = {}
    by_kind: dict[str, list[float]] = {}
    for r in ranks:
        for i in steps:
            for name, t0, t1 in r["spans"][i]:
                key = _cost_key(name)
                by_stage.setdefault(key, []).append(t1 - t0)
                by_kind.setdefault(key.split("@")[0], []).append(t1 - t0)
    return by_stage, by_kind


def message_times(ranks: list[dict], step: int, p2p: float) -> dict[str, float]:
    """Each message's transfer time in ``step``, from its send's post to its arrival, where
    every rank read the same clock (else none: the scalar ``p2p`` stands for all). A receive
    that waited saw the arrival; one that found its message there bounds it (the time of a
    message on a busy link, ``p2p``, at most that bound)."""
    if len({r["clock"] for r in ranks}) != 1:
        return {}
    sent = {k: t for r in ranks for k, t in r["sends"][step].items()}
    out = {}
    for r in ranks:
        for key, (t0, t1) in r["receives"][step].items():
            if key in sent:
                waited = t1 - t0 > WAITED_S
                out[key] = max(0.0, t1 - sent[key] if waited else min(p2p, t0 - sent[key]))
    return out


def summarize(cfg, ranks: list[dict]) -> dict:
    """The run's figures: each step's loss and time; from the steps after the first, the
    median step time, each computation kind's median cost, and per pipeline rank (of EP rank
    0) the bubble measured from its own timeline (the step's time minus its computing time)
    against two simulations of the schedule: ``replayed``, each step's every action and
    message taking what it measured in that step (``message_times``), so that only the waits
    the schedule implies are left to differ (the median over the steps); ``modelled``, every
    action of a kind and stage costing that kind's and stage's median, every message the time
    of one on a busy link (``p2p``). And the peak
    activations kept (bytes and chunks) against the simulator's peak chunks."""
    steps = range(1 if cfg.steps > 1 else 0, cfg.steps)
    seconds = [max(r["seconds"][i] for r in ranks) for i in range(cfg.steps)]
    pipeline_ranks = ranks[: cfg.pp]  # EP rank 0's
    by_stage, by_kind = _costs(pipeline_ranks, steps)
    median = statistics.median
    schedule, p2p = cfg.schedule(), ranks[0]["p2p"]
    replayed = [simulate(schedule, Costs(p2p=p2p, by_action={
        name: t1 - t0 for r in pipeline_ranks for name, t0, t1 in r["spans"][i]},
        by_message=message_times(pipeline_ranks, i, p2p))) for i in steps]  # fmt: skip
    modelled = simulate(schedule, Costs(p2p=p2p, by_stage={k: median(v) for k, v in
                                                             by_stage.items()}))  # fmt: skip
    per_rank = []
    for q, r in enumerate(pipeline_ranks):
        bubble = median(seconds[i] - sum(t1 - t0 for _, t0, t1 in r["spans"][i]) for i in steps)
        per_rank.append({
            "bubble": bubble, "replayed_bubble": median(t.bubbles()[q] for t in replayed),
            "modelled_bubble": modelled.bubbles()[q],
            "peak_bytes": max(r["peak_bytes"]), "peak_chunks": max(r["peak_chunks"]),
            "simulated_peak_chunks": modelled.peak_activations()[q],
            "a2a_bytes_per_step": median(r["a2a_bytes"][i] for i in steps),
        })  # fmt: skip
    return {
        "method": cfg.method, "pp": cfg.pp, "ep": cfg.ep, "num_microbatches":
        cfg.num_microbatches, "dw_detach": cfg.dw_detach, "fb_overlap": cfg.fb_overlap,
        "losses": [sum(r["losses"][i] for r in ranks) for i in range(cfg.steps)],
        "step_seconds": seconds, "median_step": median(seconds[i] for i in steps),
        "costs": {k: median(v) for k, v in by_kind.items()}, "p2p": p2p,
        "replayed_step": median(t.makespan for t in replayed), "modelled_step":
        modelled.makespan,
        "ranks": per_rank,
    }  # fmt: skip


def print_summary(s: dict) -> None:
    for i, (loss, sec) in enumerate(zip(s["losses"], s["step_seconds"])):
        print(f"step {i}: loss {loss:.6f}, {sec * 1e3:.1f} ms")
    costs = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in s["costs"].items())
    print(f"median costs (ms): {costs}; p2p {s['p2p'] * 1e3:.2f}; step {s['median_step'] * 1e3:.1f}"
          f" measured, {s['replayed_step'] * 1e3:.1f} replayed, {s['modelled_step'] * 1e3:.1f}"
          " modelled")  # fmt: skip
    for rank, r in enumerate(s["ranks"]):
        print(f"rank {rank}: bubble {r['bubble'] * 1e3:.1f} ms measured, "
              f"{r['replayed_bubble'] * 1e3:.1f} replayed, {r['modelled_bubble'] * 1e3:.1f} "
              f"modelled; peak activations "
              f"{r['peak_bytes'] / 2**20:.2f} MiB in {r['peak_chunks']} chunks "
              f"(simulated {r['simulated_peak_chunks']}); all-to-all "
              f"{r['a2a_bytes_per_step'] / 2**20:.2f} MiB a step")  # fmt: skip
