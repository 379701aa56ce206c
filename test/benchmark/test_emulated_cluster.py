"""The emulated cluster end to end, lean: two namespaces over a 1 Gbit/s tbf link, the tiny
model, one batch size and one repeat of the TBO and DBO comparisons (SBO's runs the same
harness), then a serving phase of two modes (off and auto: two servers up at once, auto's
choices read back) with one short burst each; it prints its summary line and leaves no
namespace, link or process behind. Needs root and ``ip netns``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from benchmark.cluster import emulated_cluster, emulated_serving
from benchmark.cluster.emulated_network import cluster_namespaces
from benchmark.common.netns import netns_available

NUMBER = r"-?\d+\.\d{3}"  # summary_line's "{:.3f}": no nan, no inf
SUMMARY = re.compile(
    "summary: "
    + " ".join(
        f"{key}={NUMBER}"
        for key in (
            "tbo_decode_speedup", "tbo_prefill_speedup", "dbo_decode_speedup",
            "dbo_prefill_speedup", "hidden_fraction", "serving_auto_vs_off",
            "serving_auto_vs_best",
        )
    )
)  # fmt: skip


@pytest.mark.slow  # starts a 2-node server per mode
@pytest.mark.skipif(not netns_available(), reason="needs root and ip netns")
def test_quick_run_cleans_up(tmp_path, qwen3_moe_path):
    argv = [
        sys.executable, "-m", "benchmark.cluster.emulated_cluster", "--nodes", "2",
        "--link-rate", "1gbit", "--quick", "--model-path", qwen3_moe_path, "--batch-size", "4",
        "--repeat", "1", "--one-batch-modes", "tbo", "dbo", "--serving-modes", "off", "auto",
        "--num-prompts", "4",
        "--serving-output-len", "8", "--serving-runs", "1", "--out-dir", str(tmp_path),
        "--timeout", "240",
    ]  # fmt: skip
    before = cluster_namespaces()  # a run killed earlier may have left its own behind
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert SUMMARY.fullmatch(summary), summary
    assert (tmp_path / "results.md").exists()
    assert cluster_namespaces() - before == set()  # nodes, hub, links
    leftovers = subprocess.run(
        ["pgrep", "-f", f"{qwen3_moe_path}.*--nnodes 2"], capture_output=True, text=True
    ).stdout
    assert leftovers == "", leftovers


def test_srt_args_reach_every_node_command():
    args = emulated_cluster.parse_args(
        ["--quick", "--model-path", "/m", "--srt-args=--enable-dp-lm-head --log-level debug"]
    )
    cluster = type("Cluster", (), {"addrs": ["10.0.0.1", "10.0.0.2"]})()
    flags = emulated_serving.parallel_flags(args, cluster, 1)
    assert flags[-3:] == ["--enable-dp-lm-head", "--log-level", "debug"]
    assert flags[flags.index("--node-rank") + 1] == "1"


def test_summary_gives_the_serving_ratios_of_the_modes_served():
    rec = lambda tput: {"output_throughput": tput}
    both = {"off": rec(100.0), "tbo": rec(150.0), "auto": rec(120.0)}
    assert emulated_cluster.serving_auto_ratios(both) == pytest.approx(
        {"serving_auto_vs_off": 1.2, "serving_auto_vs_best": 0.8}
    )
    assert emulated_cluster.serving_auto_ratios({"tbo": rec(60.0), "auto": rec(120.0)}) == {
        "serving_auto_vs_best": 2.0
    }
    assert emulated_cluster.serving_auto_ratios({"off": rec(1.0), "tbo": rec(2.0)}) == {}


def rows(speedup: float, comm_seconds: float = 1.0) -> list[dict]:
    """A one-batch comparison's off and on rows at batch size 4."""
    off = {"batch_size": 4, "variant": "x_off", "prefill_latency": 2.0,
           "median_decode_latency": 1.0, "prefill_comm_seconds": comm_seconds,
           "decode_comm_seconds": comm_seconds / 2}  # fmt: skip
    on = {"batch_size": 4, "variant": "x_on", "prefill_latency": 1.0,
          "median_decode_latency": 0.5, "decode_speedup": speedup,
          "prefill_speedup": speedup}  # fmt: skip
    return [off, on]


def test_summary_pattern_takes_finite_numbers_only():
    """The end-to-end run's check: the line of a run that measured, not one with a nan (no
    all-to-all time measured, say)."""
    rec = lambda tput: {"output_throughput": tput}
    serving = {"off": rec(10.0), "tbo": rec(12.0), "auto": rec(11.0)}
    point = {"tbo": rows(1.5), "dbo": rows(1.25), "serving": serving}
    assert SUMMARY.fullmatch(emulated_cluster.summary_line(point, 4))
    point["tbo"] = rows(1.5, comm_seconds=0.0)  # no all-to-all time: hidden_fraction nan
    line = emulated_cluster.summary_line(point, 4)
    assert "hidden_fraction=nan" in line and not SUMMARY.fullmatch(line), line


def test_summary_names_the_modes_compared():
    rec = lambda tput: {"output_throughput": tput}
    point = {"tbo": rows(1.5), "dbo": rows(1.25), "serving": {"off": rec(10.0), "dbo": rec(11.0)}}
    assert emulated_cluster.summary_line(point, 4) == (
        "summary: tbo_decode_speedup=1.500 tbo_prefill_speedup=1.500 dbo_decode_speedup=1.250 "
        "dbo_prefill_speedup=1.250 hidden_fraction=1.000 serving_dbo_vs_off=1.100"
    )
