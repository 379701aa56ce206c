"""The emulated cluster end to end, minimal: two namespaces over a 1 Gbit/s tbf link, the tiny
model, one batch size, a short serving run; it prints its summary line and leaves no
namespace, link or process behind. Needs root and ``ip netns``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.netns import netns_available

pytestmark = pytest.mark.slow  # starts processes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not netns_available(), reason="needs root and ip netns")
def test_quick_run_cleans_up(tmp_path, qwen3_moe_path):
    argv = [
        sys.executable, str(ROOT / "benchmark" / "emulated_cluster.py"), "--nodes", "2",
        "--link-rate", "1gbit", "--quick", "--model-path", qwen3_moe_path, "--batch-size", "8",
        "--num-prompts", "4", "--serving-output-len", "8", "--serving-runs", "1",
        "--out-dir", str(tmp_path), "--timeout", "240",
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(
        r"summary: tbo_decode_speedup=\S+ tbo_prefill_speedup=\S+ sbo_decode_speedup=\S+ "
        r"hidden_fraction=\S+ serving_auto_vs_off=\S+ serving_auto_vs_best=\S+",
        summary,
    ), summary
    assert (tmp_path / "results.md").exists()
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not re.search(r"srtnet-\d+-\d+", namespaces), namespaces  # nodes, hub, links
    leftovers = subprocess.run(
        ["pgrep", "-f", f"{qwen3_moe_path}.*--nnodes 2"], capture_output=True, text=True
    ).stdout
    assert leftovers == "", leftovers


def test_srt_args_reach_every_node_command():
    sys.path.insert(0, str(ROOT / "benchmark"))
    import emulated_cluster

    args = emulated_cluster.parse_args(
        ["--quick", "--model-path", "/m", "--srt-args=--enable-dp-lm-head --log-level debug"]
    )
    cluster = type("Cluster", (), {"addrs": ["10.0.0.1", "10.0.0.2"]})()
    flags = emulated_cluster._parallel_flags(args, cluster, 1)
    assert flags[-3:] == ["--enable-dp-lm-head", "--log-level", "debug"]
    assert flags[flags.index("--node-rank") + 1] == "1"
