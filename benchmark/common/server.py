"""Start a server and wait until it is ready; stop it and clean up after it.

``wait_ready`` is the one start-up wait: it polls a readiness probe (usually ``http_ok`` of
the server's health route) while watching the server's processes, and fails fast, naming the
failure (which process exited with which code, or the timeout) with the tail of the log.
``ServerProcess`` is one ``python -m launch_server`` on a free loopback port, its output in a
log file; ``ServerProcess.start`` waits until it is healthy (retrying when its port was taken
meanwhile) and ``ServerProcess.running`` also stops it. The benchmarks and the end-to-end tests
(``test/helpers/server_process.py``, with the tests' defaults) start srt through it. Servers
started some other way (in a network namespace, vLLM's) use ``wait_ready`` and
``benchmark.common.process.stop_groups`` directly.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from benchmark.common.process import child_pids, free_port, ipc_dirs

HOST = "127.0.0.1"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0
POLL_PERIOD_S = 0.2
LOG_TAIL_CHARS = 6000


class ServerStartError(RuntimeError):
    """A server did not become ready: one of its processes exited, or the timeout passed. The
    message names which, and holds the tail of its log."""


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether a GET of ``url`` answers 200 (any connection error: not yet)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):
        return False


def log_tail(path: Path | None, chars: int = LOG_TAIL_CHARS) -> str:
    """The last ``chars`` characters of a log file ('' when there is none)."""
    if path is None or not path.exists():
        return ""
    return path.read_text(errors="replace")[-chars:]


def _failure(message: str, log: Path | None) -> ServerStartError:
    if log is None:
        return ServerStartError(message)
    return ServerStartError(f"{message}; log {log}:\n{log_tail(log)}")


def wait_ready(
    probe: Callable[[], bool],
    procs: Mapping[str, subprocess.Popen],
    timeout: float = START_TIMEOUT_S,
    *,
    what: str = "the server",
    log: Path | None = None,
    period: float = POLL_PERIOD_S,
) -> float:
    """Poll ``probe()`` until it is true; returns the seconds it took. ``procs`` names the
    processes that make up the server. Raises ``ServerStartError`` as soon as one of them exits
    (naming it and its exit code), or when ``what`` is not ready after ``timeout`` s, with the
    tail of ``log``."""
    start = time.monotonic()
    while True:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise _failure(f"{name} exited with code {proc.returncode} during start-up", log)
        if probe():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise _failure(f"{what} not ready after {timeout:.0f} s", log)
        time.sleep(period)


class ServerProcess:
    """One ``python -m launch_server --model-path MODEL --port PORT ARGS...`` process on a free
    loopback port, stdout and stderr in ``log_path`` (a temporary file unless given)."""

    start_timeout_s = START_TIMEOUT_S

    def __init__(self, model_path: str, *args: str, log_path: Path | None = None):
        self.port = free_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix="srt-server-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self.ipc_dirs: set[str] = set()  # the server's private IPC directory, once healthy
        argv = [sys.executable, "-m", "launch_server", "--model-path", model_path]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*argv, "--port", str(self.port), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    @classmethod
    def start(cls, model_path: str, *args: str, attempts: int = 3, **kw) -> ServerProcess:
        """Start a server and wait until it is healthy; retries (on another port) when the
        free port was taken between choosing it and binding it."""
        for attempt in range(attempts):
            server = cls(model_path, *args, **kw)
            try:
                server.wait_healthy()
                return server
            except ServerStartError:  # its message holds the log
                server.stop()
                if "address already in use" not in server.log().lower() or attempt == attempts - 1:
                    raise
                server.remove_log()
        raise AssertionError("unreachable")

    @classmethod
    @contextlib.contextmanager
    def running(cls, model_path: str, *args: str, **kw) -> Iterator[ServerProcess]:
        """A started server, stopped (and its log removed) on exit; its log is printed when
        the body raises (pytest shows it with the failure)."""
        server = cls.start(model_path, *args, **kw)
        try:
            yield server
        except BaseException:
            print(server.log())
            raise
        finally:
            server.stop()
            server.remove_log()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self, start: int = 0) -> str:
        """The log from byte ``start`` on."""
        with open(self.log_path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def log_tail(self) -> str:
        return log_tail(self.log_path)

    def wait_healthy(self, timeout: float | None = None) -> None:
        """Poll /health until 200 (``start_timeout_s`` by default); fail fast, with the log,
        when the process exits. Records the server's IPC directory for ``stop``."""
        timeout = self.start_timeout_s if timeout is None else timeout
        probe = lambda: http_ok(self.url + "/health")
        wait_ready(probe, {"server": self.proc}, timeout, what="server", log=self.log_path)
        self.ipc_dirs = ipc_dirs(self.pid)

    def children(self) -> list[int]:
        return child_pids(self.pid)

    def wait_exit(self, timeout: float) -> int | None:
        """The exit code, or None when still running after ``timeout`` s."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL (of the server and its children) after ``timeout`` s; returns
        the exit code of the graceful stop, or None when it had to be killed. Removes the IPC
        directory a killed server leaves behind."""
        code = self.proc.poll()
        if code is None:
            self.proc.send_signal(signal.SIGTERM)
            code = self.wait_exit(timeout)
        if code is None:
            for pid in [self.pid, *self.children()]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait(10)
        for path in self.ipc_dirs:
            shutil.rmtree(path, ignore_errors=True)
        return code

    def remove_log(self) -> None:
        self.log_path.unlink(missing_ok=True)
