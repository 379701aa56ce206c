"""Processes seen through /proc, and stopping them: free ports, process state and trees, the
multiprocessing children of a server, the private IPC directory it leaves behind, and the
graceful-then-forced stop of whole process groups."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = [
    "child_pids",
    "descendants",
    "free_port",
    "ipc_dirs",
    "is_running",
    "process_state",
    "spawned_children",
    "start_ticks",
    "stop_groups",
    "wait_gone",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now: srt's own helper, imported on first use so that this
    module (and the small helper processes that import it) stays free of srt's dependencies."""
    from srt.utils.ipc import free_port as srt_free_port

    return srt_free_port(host)


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def process_state(pid: int | str) -> str | None:
    """The state letter of ``pid`` (``R``, ``S``, ``Z``...), or None when it is gone."""
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def is_running(pid: int | str) -> bool:
    """True while the process exists and is not a zombie (exited, waiting to be reaped)."""
    return process_state(pid) not in (None, "Z")


def start_ticks(pid: int | str) -> int | None:
    """When ``pid`` started, in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def wait_gone(pids: Sequence[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs; returns those still running after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    alive = [pid for pid in pids if is_running(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if is_running(pid)]
    return alive


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's children), from /proc."""
    pids: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in path.read_text().split()]
    return sorted(set(pids))


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it, parents before their children."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop(0))
        todo += child_pids(tree[-1])
    return tree


def spawned_children(pid: int) -> list[int]:
    """The direct children of ``pid`` that multiprocessing spawned, in start order: a server's
    scheduler ranks first, then (DP attention) its DP controller, then its detokenizer."""
    spawned = []
    for kid in child_pids(pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{kid}/cmdline").read_bytes():
                spawned.append((start_ticks(kid) or 0, kid))
    return [kid for _, kid in sorted(spawned)]


def ipc_dirs(pid: int) -> set[str]:
    """Temporary directories holding the unix sockets that ``pid`` has open (srt's private IPC
    directory), to remove when the server did not shut down cleanly."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:[") : -1])
    dirs = set()
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]:
            fields = line.split()
            if len(fields) >= 8 and fields[6] in inodes:
                dirs.add(os.path.dirname(fields[7]))
    return {path for path in dirs if os.path.dirname(path) == tempfile.gettempdir()}


def _group_gone(proc: subprocess.Popen) -> bool:
    """Whether nothing is left of the process group that ``proc`` leads (reaping ``proc``)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return True
    return False


def _signal_groups(procs: Sequence[subprocess.Popen], sig: int) -> None:
    for proc in procs:
        if not _group_gone(proc):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)


def _wait_groups(procs: Sequence[subprocess.Popen], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_group_gone(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def stop_groups(
    procs: Sequence[subprocess.Popen], sig: int = signal.SIGTERM, grace: float = 30.0
) -> None:
    """Stop processes started with ``start_new_session=True`` together with everything they
    started: ``sig`` to each whole process group (in the order given: a multi-node server's
    node 0 first, the others follow its lifetime), SIGKILL to the groups still there after
    ``grace`` s, and each leader reaped."""
    _signal_groups(procs, sig)
    if not _wait_groups(procs, grace):
        _signal_groups(procs, signal.SIGKILL)
        _wait_groups(procs, 10.0)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(1.0)
