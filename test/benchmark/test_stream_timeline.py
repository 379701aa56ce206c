"""stream_timeline's pure parts and the trace it reads: srt's processes log each token's time
per stage (and each forward step with the time its threads waited for a core), and the
analysis counts a chunk's tokens, splits a long gap into its hops and names its step."""

from __future__ import annotations

import torch

from benchmark.serving import stream_timeline
from srt.utils import stream_trace


def test_trace_lines_are_written_only_when_enabled(tmp_path):
    stream_trace.start(None)
    stream_trace.record("scheduler", ["a"], [1])
    assert not stream_trace.enabled() and list(tmp_path.iterdir()) == []
    stream_trace.start(str(tmp_path))
    try:
        stream_trace.record("scheduler", ["a", "b"], [1, 3])
    finally:
        stream_trace.close()
    assert not stream_trace.enabled()
    trace = stream_timeline.load_trace(tmp_path)
    assert set(trace) == {("a", 1), ("b", 3)} and set(trace["a", 1]) == {"scheduler"}


def test_forward_steps_are_logged_with_their_wait_for_a_core(tmp_path):
    stream_trace.start(None)
    with stream_trace.forward_step("DECODE", 4, 4):
        pass
    assert list(tmp_path.iterdir()) == []
    stream_trace.start(str(tmp_path))
    try:
        stream_trace.record("scheduler", ["a"], [1])
        with stream_trace.forward_step("MIXED", 3, 130):
            sum(range(10_000))
    finally:
        stream_trace.close()
    ((end, mode, seqs, tokens, threads, wall, waited),) = stream_timeline.load_steps(tmp_path)
    assert (mode, seqs, tokens, threads) == ("MIXED", 3, 130, torch.get_num_threads())
    assert wall > 0 and (waited >= 0 or waited == -1)
    assert set(stream_timeline.load_trace(tmp_path)) == {("a", 1)}  # step lines are not tokens


def test_analysis_counts_tokens_per_chunk_and_splits_long_gaps():
    trace = {}
    for n in range(1, 6):  # a step every 10 ms; token 4's step took 40 ms
        t = 10.0 * n + (30.0 if n >= 4 else 0.0)
        trace[("r", n)] = {"scheduler": t, "detokenizer": t + 1, "tokenizer": t + 2, "http": t + 3}
    trace = {k: {s: v / 1e3 for s, v in stamps.items()} for k, stamps in trace.items()}
    # the client got tokens 1, 2, then 3 and 4 together, then 5 (and a finish chunk)
    arrivals = [(t / 1e3, "r", n) for t, n in ((14, 1), (24, 2), (74, 4), (84, 5), (85, 5))]
    steps = [  # (end, mode, sequences, tokens, threads, wall ms, waited ms)
        (t / 1e3, mode, 1, tokens, 1, wall, waited)
        for t, mode, tokens, wall, waited in (
            (10, "EXTEND", 8, 9.0, 0.0), (20, "DECODE", 1, 9.0, 0.0), (30, "DECODE", 1, 10.0, 0.5),
            (70, "MIXED", 9, 39.0, 30.0), (80, "DECODE", 1, 9.0, 0.0),
        )
    ]  # fmt: skip
    a = stream_timeline.analyse(arrivals, trace, steps)
    assert a["long_gap_forwards"] == {"mixed on 1": 1}
    assert (a["long_gap_forward_ms"], a["long_gap_waited_ms"]) == (39.0, 30.0)
    assert a["steps"]["decode on 1"] == {
        "steps": 3,
        "wall_median_ms": 9.0,
        "wall_max_ms": 10.0,
        "waited_ms": 0.5,
        "waited_in_longest_ms": 0.5,
    }  # fmt: skip (the arrivals span 14-85 ms: the first step falls outside)
    assert "mixed on 1 steps: 1" in stream_timeline.report(16, a)
    assert a["tokens_per_chunk"] == {1: 2, 2: 1}
    assert a["long_gaps"] == 1 and round(a["long_gap_step_ms"]) == 50
    assert {k: round(v) for k, v in a["long_gap_hops_ms"].items()} == {
        "scheduler->detokenizer": 1, "detokenizer->tokenizer": 1, "tokenizer->http": 1,
        "http->client": 1,
    }  # fmt: skip
