"""Start and stop a real srt server (``python -m launch_server``) on a free loopback port, and
read its state over HTTP. Shared by the end-to-end tests of the HTTP server."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

HOST = "127.0.0.1"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
LOG_TAIL_CHARS = 6000


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One ``python -m launch_server`` process; stdout and stderr go to a temporary log file."""

    def __init__(self, model_path: str, *extra_args: str):
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        fd, log_path = tempfile.mkstemp(prefix="srt-server-", suffix=".log")
        os.close(fd)
        self.log_path = Path(log_path)
        self.ipc_dirs: set[str] = set()  # the server's private IPC directory, once healthy
        args = ["--model-path", model_path, "--port", str(self.port), "--dtype", "float32"]
        args += ["--max-total-tokens", "4096", *extra_args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "launch_server", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self, start: int = 0) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_tail(self) -> str:
        return self.log()[-LOG_TAIL_CHARS:]

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        """Poll /health until 200; fail fast (with the log) when the process exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.proc.returncode} during start-up:\n"
                    + self.log_tail()
                )
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    self.ipc_dirs = ipc_dirs(self.pid)
                    return
            time.sleep(0.2)
        raise RuntimeError(f"server not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def children(self) -> list[int]:
        return child_pids(self.pid)

    def wait_exit(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` s; returns the exit code of the graceful
        stop, or None when it had to be killed."""
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            code = self.wait_exit(timeout)
        if code is None:
            for pid in [self.pid, *self.children()]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)
        for path in self.ipc_dirs:  # left behind when the server did not shut down cleanly
            shutil.rmtree(path, ignore_errors=True)
        return code

    def remove_log(self) -> None:
        self.log_path.unlink(missing_ok=True)


def start_server(model_path: str, *extra_args: str, attempts: int = 3) -> ServerProcess:
    """Start a server and wait until it is healthy; retries when the free port was taken
    between choosing it and binding it."""
    for attempt in range(attempts):
        server = ServerProcess(model_path, *extra_args)
        try:
            server.wait_healthy()
            return server
        except RuntimeError:  # its message holds the log
            server.stop()
            port_taken = "address already in use" in server.log().lower()
            server.remove_log()
            if not port_taken or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_server(model_path: str, *extra_args: str) -> Iterator[ServerProcess]:
    """A started server, stopped (and its log removed) on exit."""
    server = start_server(model_path, *extra_args)
    try:
        yield server
    except BaseException:
        print(server.log())  # pytest shows it with the failure
        raise
    finally:
        server.stop()
        server.remove_log()


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (every thread's children), from /proc."""
    pids: list[int] = []
    for path in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in path.read_text().split()]
    return sorted(set(pids))


def ipc_dirs(pid: int) -> set[str]:
    """Temporary directories holding the unix sockets that ``pid`` has open (srt's private IPC
    directory)."""
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


def is_running(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of ``pids`` runs; returns those still running after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    alive = [pid for pid in pids if is_running(pid)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [pid for pid in alive if is_running(pid)]
    return alive


# ------------------------------------------------------------------------------ HTTP state
def server_info(url: str, headers: dict[str, str] | None = None) -> dict:
    response = httpx.get(url + "/get_server_info", headers=headers, timeout=30.0)
    response.raise_for_status()
    return response.json()


def internal_state(url: str) -> dict:
    return server_info(url)["internal_states"][0]


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """Poll /get_server_info until no request runs or waits; returns that internal state."""
    deadline = time.monotonic() + timeout
    while True:
        state = internal_state(url)
        if state["num_running_reqs"] == state["num_waiting_reqs"] == 0:
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still running after {timeout} s: {state}")
        time.sleep(0.1)


def assert_pool_full(state: dict) -> None:
    """No request left and every KV slot free or evictable from the prefix cache."""
    assert state["num_running_reqs"] == state["num_waiting_reqs"] == 0, state
    assert state["num_protected_tokens"] == 0, state
    total = state["num_free_tokens"] + state["num_evictable_tokens"]
    assert total == state["max_total_num_tokens"], state
