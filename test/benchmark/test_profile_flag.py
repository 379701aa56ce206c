"""``--profile`` of the emulated cluster and of bench_one_batch: refused at start-up, naming the
missing extra, when matplotlib is not installed (not after minutes of benchmarking)."""

from __future__ import annotations

import sys

import pytest

from benchmark.cluster import emulated_cluster
from benchmark.offline import bench_one_batch


def test_profile_without_matplotlib_is_refused_at_start(monkeypatch, capsys):
    monkeypatch.setattr(emulated_cluster, "matplotlib_missing", lambda: "--profile needs X")
    with pytest.raises(SystemExit) as exit_info:
        emulated_cluster.parse_args(["--quick", "--profile", "/tmp/p"])
    assert exit_info.value.code == 2
    assert "--profile needs X" in capsys.readouterr().err
    assert emulated_cluster.parse_args(["--quick"]).profile is None  # no --profile: no check


def test_profile_with_matplotlib_is_taken(monkeypatch):
    monkeypatch.setattr(emulated_cluster, "matplotlib_missing", lambda: None)
    assert emulated_cluster.parse_args(["--profile", "/tmp/p"]).profile == "/tmp/p"


def test_bench_one_batch_refuses_profile_without_matplotlib(monkeypatch, capsys):
    monkeypatch.setattr(bench_one_batch, "matplotlib_missing", lambda: "--profile needs Y")
    monkeypatch.setattr(sys, "argv", ["bench_one_batch.py", "--model-path", "m", "--profile", "d"])
    with pytest.raises(SystemExit) as exit_info:
        bench_one_batch.parse_args()
    assert exit_info.value.code == 2
    assert "--profile needs Y" in capsys.readouterr().err
