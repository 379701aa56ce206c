"""benchmark.common.op_timeline: an all-to-all is in flight from its launch to its wait, per
micro-batch, and the trace holds one row per micro-batch plus one for the all-to-alls."""

from __future__ import annotations

import json

import pytest

from benchmark.common.op_timeline import COMM_ROW, comm_intervals, comm_seconds, write_chrome_trace
from srt.layers.overlap.operations import OpEvent

# Two micro-batches of one layer: A's dispatch is in flight while B's attention runs.
EVENTS = [
    OpEvent("A", 3, "attn", 0.0, 1.0),
    OpEvent("A", 3, "dispatch_a", 1.0, 1.5),
    OpEvent("B", 3, "attn", 1.5, 2.5),
    OpEvent("A", 3, "dispatch_b", 2.5, 3.0),
    OpEvent("B", 3, "dispatch_a", 3.0, 3.25),
    OpEvent("B", 3, "dispatch_b", 3.25, 3.5),
]


def test_comm_intervals_span_launch_to_wait_per_micro_batch():
    assert comm_intervals(EVENTS) == [
        ("A", "dispatch", 3, 1.0, 3.0),
        ("B", "dispatch", 3, 3.0, 3.5),
    ]
    assert comm_seconds(EVENTS) == pytest.approx(0.5 + 0.5 + 0.25 + 0.25)


def test_chrome_trace_rows(tmp_path):
    path = tmp_path / "trace.json"
    write_chrome_trace(path, {"decode": EVENTS, "empty": []}, rank=1)
    trace = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert len(spans) == len(EVENTS) + 2  # every operation, and two all-to-alls in flight
    assert {e["tid"] for e in spans} == {1, 2, COMM_ROW}
    comm = [e for e in spans if e["tid"] == COMM_ROW]
    assert [(e["name"], e["ts"], e["dur"]) for e in comm] == [
        ("A L3 dispatch", 1e6, 2e6), ("B L3 dispatch", 3e6, 0.5e6)
    ]  # fmt: skip
    names = [e["args"]["name"] for e in trace if e["name"] == "process_name"]
    assert names == ["rank 1: decode"]  # a step without events has no rows
