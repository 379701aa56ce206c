"""Faults on the emulated 2-node cluster, short: a killed rank, a link flap shorter than the
watchdog timeout and a link down for longer. The benchmark checks each outcome itself (errors
for the requests in flight, exit within the timeout + 5 s naming the peer, nothing left
behind; after the flap, every request finished) and exits non-zero otherwise. Needs root and
``ip netns``."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.benchmark_scripts import load_benchmark
from helpers.netns import netns_available

pytestmark = pytest.mark.slow  # starts processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not netns_available(), reason="needs root and ip netns")
def test_faults_end_cleanly(tmp_path, qwen3_moe_path):
    argv = [
        sys.executable, str(ROOT / "benchmark" / "emulated_faults.py"),
        "--model-path", qwen3_moe_path, "--link-rate", "unshaped", "--watchdog-timeout", "4",
        "--flap-seconds", "1.5", "--requests", "2", "--max-new-tokens", "400",
        "--out-dir", str(tmp_path),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = {row["fault"]: row for row in json.loads((tmp_path / "faults.json").read_text())}
    assert set(rows) == {"rank-kill", "link-flap", "link-down"}
    assert all(row["problems"] == [] for row in rows.values()), rows
    for fault in ("rank-kill", "link-down"):
        errors = [s["error"] for s in rows[fault]["streams"]]
        assert all("rank 1 (node 1)" in e for e in errors), errors
    assert all(s["tokens"] == 400 for s in rows["link-flap"]["streams"])


def test_a_zombie_is_not_left_running():
    """The leak check counts processes that still run: an exited child its parent has not
    reaped yet (init reaps the orphans of a stopped server a moment later) is not one."""
    netns = load_benchmark("netns")
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while netns._state(str(child.pid)) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert netns._state(str(child.pid)) == "Z"
    child.wait()
    assert netns._state(str(child.pid)) is None
