"""The forward watchdog of a scheduler rank (SGLang's ``--watchdog-timeout``) and the rank's
way out when it fails.

Every iteration of the scheduler loop is bounded: a busy one runs a forward step, an idle one
waits at most a second for messages and then runs its broadcast (and, under DP attention, the
MLP sync). A thread checks that the current iteration started less than ``timeout`` seconds
ago. When one does not finish in time, or a collective fails (a peer's connection broke, a
gloo receive timed out), the rank ends the server: it logs which rank, which step and which
peers went silent (``PeerHeartbeat``), tells the tokenizer manager (entry ranks) so that the
requests in flight end with that message, and exits with status 1. Its parent sees the exit
and takes the rest of the node down; the other nodes' collectives fail and they follow.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import zmq

from srt.distributed.heartbeat import PeerHeartbeat
from srt.managers.io_struct import SchedulerFailure
from srt.utils.ipc import Sender

logger = logging.getLogger(__name__)
PEER_WAIT_S = 3.0  # after a broken connection: how long the heartbeats may take to name it


class RankFailure:
    """How this rank reports its failure and exits."""

    def __init__(
        self,
        rank: int,
        heartbeat: PeerHeartbeat | None = None,
        tokenizer_endpoint: str | None = None,
    ):
        self.rank, self.heartbeat = rank, heartbeat
        self.tokenizer_endpoint = tokenizer_endpoint  # entry ranks only
        self.lock = threading.Lock()

    def peers(self, wait: float) -> str:
        if self.heartbeat is None:
            return ""
        found = self.heartbeat.wait_for_silence(wait) if wait else self.heartbeat.describe()
        return f"; {found}" if found else "; every peer still beats"

    def exit(self, what: str, wait_for_peers: float = 0.0) -> None:
        """Report ``what`` went wrong (with the silent peers) and end the process."""
        with self.lock:  # the watchdog thread and the loop may fail at once
            message = f"scheduler rank {self.rank}: {what}{self.peers(wait_for_peers)}"
            logger.error("%s; exiting", message)
            if self.tokenizer_endpoint is not None:
                self._tell_tokenizer(message)
            logging.shutdown()
            os._exit(1)

    def _tell_tokenizer(self, message: str) -> None:
        """A fresh socket: the loop's own may be mid-use in the hung thread."""
        context = zmq.Context()
        try:
            socket = Sender(context, self.tokenizer_endpoint).socket
            socket.setsockopt(zmq.SNDTIMEO, 1000)  # never hang here: the peer may be gone
            socket.send_pyobj(SchedulerFailure(message))
            time.sleep(0.3)  # let the I/O thread deliver it before the process ends
        except zmq.ZMQError as e:
            logger.error("could not tell the tokenizer manager: %s", e)


class StepWatchdog:
    """Fails the rank when one loop iteration takes longer than ``timeout`` seconds."""

    def __init__(self, timeout: float, failure: RankFailure, label: Callable[[], str]):
        self.timeout, self.failure, self.label = timeout, failure, label
        self.started: float | None = None
        self.thread = threading.Thread(target=self._run, name="srt-step-watchdog", daemon=True)

    def start(self) -> StepWatchdog:
        self.thread.start()
        return self

    def begin(self) -> None:
        self.started = time.monotonic()

    def _run(self) -> None:
        period = min(1.0, self.timeout / 10)
        while True:
            time.sleep(period)
            started = self.started
            if started is not None and time.monotonic() - started > self.timeout:
                self.failure.exit(f"{self.label()} did not finish in {self.timeout:g} s")
