"""Network namespaces through ``ip netns`` (iproute2; needs root): whether this machine can make
them, which exist, the processes inside one, and killing those. The emulated cluster
(``benchmark/cluster/emulated_network.py``) builds its nodes and links from these."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

from benchmark.common.process import is_running


def ip(*argv: str) -> None:
    """Run ``ip ARGV...``; a failure raises RuntimeError naming the command and its error."""
    r = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"ip {' '.join(argv)}: {r.stderr.strip() or r.returncode}")


def netns_available() -> bool:
    """Whether this process may make network namespaces (root, and ``ip netns`` works): tried
    with a namespace of its own, deleted at once."""
    if os.geteuid() != 0:
        return False
    name = f"srt-probe-{os.getpid()}"
    try:
        ip("netns", "add", name)
    except (OSError, RuntimeError):
        return False
    with contextlib.suppress(RuntimeError):
        ip("netns", "del", name)
    return True


def list_namespaces() -> list[str]:
    """The names of the existing network namespaces."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_exists(name: str) -> bool:
    return name in list_namespaces()


def netns_pids(ns: str) -> list[int]:
    """Every process in ``ns`` (``ip netns pids``), zombies included."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def live_pids(ns: str) -> list[int]:
    """The processes in ``ns`` that still run: no zombies (exited already, waiting for their
    parent, or init once orphaned, to reap them)."""
    return [pid for pid in netns_pids(ns) if is_running(pid)]


def kill_netns_pids(ns: str) -> None:
    """SIGKILL whatever still runs in ``ns`` (only for namespaces the caller created)."""
    for pid in netns_pids(ns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
