"""Whether this machine can make network namespaces (root and ``ip netns``), for the tests of
the emulated cluster."""

from __future__ import annotations

import os
import subprocess


def netns_available() -> bool:
    if os.geteuid() != 0:
        return False
    name = f"srt-probe-{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode:
        return False
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return True
