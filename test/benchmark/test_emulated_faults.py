"""Faults on the emulated 2-node cluster, lean: a link flap shorter than the watchdog timeout
and a link down for longer, the two faults only a network can make (a killed or hung rank is
covered on one node by test/entrypoints/test_server_lifecycle.py and test_server_faults.py).
The benchmark checks each outcome itself (errors for the requests in flight, exit within the
timeout + 5 s naming the peer, nothing left behind; after the flap, every request finished and
a clean stop) and exits non-zero otherwise. Needs root and ``ip netns``."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from benchmark.common.netns import netns_available
from benchmark.common.process import is_running, process_state

TOKENS = 200  # per stream: in flight at the fault, and past the flap


@pytest.mark.slow  # starts a 2-node server per fault
@pytest.mark.skipif(not netns_available(), reason="needs root and ip netns")
def test_faults_end_cleanly(tmp_path, qwen3_moe_path):
    argv = [
        sys.executable, "-m", "benchmark.cluster.emulated_faults", "--faults", "link-flap",
        "link-down", "--model-path", qwen3_moe_path, "--link-rate", "unshaped",
        "--watchdog-timeout", "4", "--flap-seconds", "1.5", "--requests", "2",
        "--max-new-tokens", str(TOKENS), "--out-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {row["fault"]: row for row in json.loads((tmp_path / "faults.json").read_text())}
    assert set(rows) == {"link-flap", "link-down"}
    assert all(row["problems"] == [] for row in rows.values()), rows
    errors = [s["error"] for s in rows["link-down"]["streams"]]
    assert all("rank 1 (node 1)" in e for e in errors), errors
    assert all(s["tokens"] == TOKENS for s in rows["link-flap"]["streams"])


def test_a_zombie_is_not_left_running():
    """The leak check counts processes that still run: an exited child its parent has not
    reaped yet (init reaps the orphans of a stopped server a moment later) is not one."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while process_state(child.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_state(child.pid) == "Z" and not is_running(child.pid)
    child.wait()
    assert process_state(child.pid) is None
