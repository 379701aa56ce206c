"""benchmark/cluster/link_cpu.py: /proc/stat read per core, and a short exchange over a shaped
link that moves bytes both ways, reports every core and leaves no namespace behind (root and
``ip netns``)."""

from __future__ import annotations

import re

import pytest

from benchmark.cluster import link_cpu
from benchmark.cluster.emulated_network import cluster_namespaces
from benchmark.common.netns import netns_available

STAT = """cpu  10 0 10 100 0 0 0 0 0 0
cpu0 {} 1 {} 50 0 {} {} 0 0 0
cpu1 5 0 5 50 0 0 0 0 0 0
intr 12345
"""


def test_cpu_seconds_per_core_from_proc_stat(tmp_path):
    tick = link_cpu.os.sysconf("SC_CLK_TCK")
    before, after = tmp_path / "a", tmp_path / "b"
    before.write_text(STAT.format(100, 200, 0, 10))
    after.write_text(STAT.format(100 + tick, 200 + 2 * tick, tick, 10 + 3 * tick))
    a, b = link_cpu.cpu_times(str(before)), link_cpu.cpu_times(str(after))
    assert sorted(a) == ["cpu0", "cpu1"]  # the all-cores line left out
    busy = link_cpu.busy_per_core(a, b)
    assert busy["cpu0"] == pytest.approx({"user": 1.0, "system": 2.0, "softirq": 4.0})
    assert busy["cpu1"] == {"user": 0.0, "system": 0.0, "softirq": 0.0}


@pytest.mark.slow
@pytest.mark.skipif(not netns_available(), reason="needs root and ip netns")
def test_exchange_over_a_shaped_link_reports_each_core():
    before = cluster_namespaces()  # a run killed earlier may have left its own behind
    result = link_cpu.measure("1gbit", 64 << 10, 0.3)
    assert result["mib_each_way"] > 0 and result["seconds"] >= 0.3
    assert {"cpu0", "cpu1"} <= set(result["cores"])
    assert sum(sum(t.values()) for t in result["cores"].values()) > 0
    text = link_cpu.report("1gbit", result)
    assert re.search(r"cpu0: \d+% busy; ms per MiB sent and received: [\d.]+ \(user", text)
    assert cluster_namespaces() - before == set()
