"""After ``Engine.shutdown()`` the host process must stay usable: collecting the Engine's garbage
must not block (a ZMQ context left open hangs in ``term()`` when the garbage collector destroys
it). Runs in a child process, so that a hang fails this test instead of the whole session."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # starts processes

GC_TIMEOUT_S = 10
SCRIPT = f"""
import faulthandler, gc, sys
import srt

engine = srt.Engine(model_path=sys.argv[1], dtype="float32", max_total_tokens=1024)
engine.generate("Hello", {{"max_new_tokens": 2}})
engine.shutdown()
del engine
faulthandler.dump_traceback_later({GC_TIMEOUT_S}, exit=True)  # a hang: traceback, exit 1
gc.collect()
faulthandler.cancel_dump_traceback_later()
print("collected", flush=True)
"""


def test_garbage_collection_after_shutdown_does_not_hang(qwen3_moe_path: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, qwen3_moe_path],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, (
        f"gc.collect() after Engine.shutdown() failed or hung for {GC_TIMEOUT_S} s:\n"
        + done.stderr[-4000:]
    )
    assert done.stdout.strip().splitlines()[-1] == "collected"
