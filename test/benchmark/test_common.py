"""benchmark.common, which the benchmarks and the end-to-end tests start and stop servers with:
the start-up wait fails fast naming what failed, and a stop takes a whole process group down,
grandchildren included (plain ``sleep`` processes, no server)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmark.common.process import descendants, is_running, stop_groups, wait_gone
from benchmark.common.server import ServerStartError, http_ok, wait_ready

# A process group: a shell that starts a grandchild and ignores SIGTERM, so only SIGKILL ends it.
STUBBORN = "trap '' TERM; sleep 60 & wait"


def test_wait_ready_names_the_process_that_exited(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("line 1\nTraceback: the reason\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(ServerStartError) as failure:
        wait_ready(lambda: False, {"node 1's server": proc}, timeout=30, log=log)
    message = str(failure.value)
    assert "node 1's server exited with code 3 during start-up" in message
    assert str(log) in message and "Traceback: the reason" in message


def test_wait_ready_times_out_naming_what_and_returns_once_ready():
    with pytest.raises(ServerStartError, match="the vllm server not ready after 0 s"):
        wait_ready(lambda: False, {}, timeout=0.3, what="the vllm server", period=0.05)
    answers = iter([False, False, True])
    assert wait_ready(lambda: next(answers), {}, timeout=30, period=0.01) < 30


def test_http_ok_is_false_without_a_server():
    assert not http_ok("http://127.0.0.1:9/health", timeout=0.5)


def test_stop_groups_kills_the_group_after_the_grace():
    proc = subprocess.Popen(["sh", "-c", STUBBORN], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(descendants(proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    tree = descendants(proc.pid)
    assert len(tree) == 2, tree  # the shell and its sleep
    start = time.monotonic()
    stop_groups([proc], grace=0.5)
    assert 0.5 <= time.monotonic() - start < 10
    assert proc.returncode is not None
    assert wait_gone(tree, timeout=5) == [] and not any(is_running(pid) for pid in tree)
