"""emulated_pipeline's pure parts: the table and the summary compare each run with the 1F1B
run of its own round, and the bubble error is the replay's gap over a run's ranks."""

from __future__ import annotations

from benchmark.cluster import emulated_pipeline as ep


def _result(name: str, round_: str, step: float, bubbles=((0.5, 0.4), (0.3, 0.3))) -> dict:
    ranks = [{"bubble": b, "replayed_bubble": r, "modelled_bubble": r, "peak_bytes": 2**20,
              "peak_chunks": 2, "simulated_peak_chunks": 2} for b, r in bubbles]  # fmt: skip
    return {"name": name, "round": round_, "median_step": step, "costs": {"F": 0.1},
            "ranks": ranks}  # fmt: skip


def test_ratios_are_taken_within_a_round():
    results = [_result("1f1b", "1", 8.0), _result("dualpipev-fb", "1", 6.4),
               _result("dualpipev-fb", "2", 7.0), _result("1f1b", "2", 7.7)]  # fmt: skip
    line = ep.summary_line(results)
    assert "dualpipev_fb_vs_1f1b=1.175" in line  # the median of 1.25 and 1.1
    assert "bubble_error=0.143" in line  # (0.8 - 0.7) / 0.7
    rows = ep.table(results).splitlines()
    assert "| dualpipev-fb (1) | 6400 | 1.25× |" in rows[3] and "1.10×" in rows[4]
