"""stream_timeline's pure parts and the trace it reads: srt's processes log each token's time
per stage, and the analysis counts a chunk's tokens and splits a long gap into its hops."""

from __future__ import annotations

from benchmark.serving import stream_timeline
from srt.utils import stream_trace


def test_trace_lines_are_written_only_when_enabled(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_trace, "_folder", None)
    stream_trace.record("scheduler", ["a"], [1])
    assert not stream_trace.enabled() and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(stream_trace, "_folder", str(tmp_path))
    monkeypatch.setattr(stream_trace, "_files", {})
    stream_trace.record("scheduler", ["a", "b"], [1, 3])
    trace = stream_timeline.load_trace(tmp_path)
    assert set(trace) == {("a", 1), ("b", 3)} and set(trace["a", 1]) == {"scheduler"}


def test_analysis_counts_tokens_per_chunk_and_splits_long_gaps():
    trace = {}
    for n in range(1, 6):  # a step every 10 ms; token 4's step took 40 ms
        t = 10.0 * n + (30.0 if n >= 4 else 0.0)
        trace[("r", n)] = {"scheduler": t, "detokenizer": t + 1, "tokenizer": t + 2, "http": t + 3}
    trace = {k: {s: v / 1e3 for s, v in stamps.items()} for k, stamps in trace.items()}
    # the client got tokens 1, 2, then 3 and 4 together, then 5 (and a finish chunk)
    arrivals = [(t / 1e3, "r", n) for t, n in ((14, 1), (24, 2), (74, 4), (84, 5), (85, 5))]
    a = stream_timeline.analyse(arrivals, trace)
    assert a["tokens_per_chunk"] == {1: 2, 2: 1}
    assert a["long_gaps"] == 1 and round(a["long_gap_step_ms"]) == 50
    assert {k: round(v) for k, v in a["long_gap_hops_ms"].items()} == {
        "scheduler->detokenizer": 1, "detokenizer->tokenizer": 1, "tokenizer->http": 1,
        "http->client": 1,
    }  # fmt: skip
