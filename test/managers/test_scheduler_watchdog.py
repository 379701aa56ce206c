"""The step watchdog and the peer heartbeats that name a failed rank, without processes: a
shared in-memory store stands for the rendezvous store, and the rank's exit is recorded."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from srt.distributed.heartbeat import PeerHeartbeat
from srt.managers.scheduler_watchdog import RankFailure, StepWatchdog

SILENT = 0.2  # seconds without a beat that count as silence in these tests


def heartbeats(world_size: int, ranks_per_node: int) -> list[PeerHeartbeat]:
    store = dist.HashStore()
    beats = [PeerHeartbeat(store, r, world_size, ranks_per_node) for r in range(world_size)]
    for key in beats[0].keys:
        store.add(key, 0)
    return beats


def test_heartbeat_names_the_rank_that_stopped() -> None:
    beats = heartbeats(4, ranks_per_node=2)
    for _ in range(2):
        for hb in beats:
            hb.beat()
    assert all(hb.describe(SILENT) is None for hb in beats)
    for _ in range(2):  # rank 2 (node 1) stops; the others see its last beat, then silence
        time.sleep(SILENT * 1.5)
        for r in (0, 1, 3):
            beats[r].beat()
    assert [r for r, _ in beats[0].silent_peers(SILENT)] == [2]
    assert beats[0].describe(SILENT).startswith("silent peers: rank 2 (node 1) for ")
    assert beats[3].describe(SILENT).startswith("silent peers: rank 2 (node 1)")


def test_heartbeat_of_a_rank_cut_off_from_the_store() -> None:
    """The rank whose own round trips stopped blames node 0, not the peers it cannot see."""
    beats = heartbeats(2, ranks_per_node=1)
    for _ in range(2):
        for hb in beats:
            hb.beat()
    for _ in range(2):  # rank 1's beats no longer get through
        time.sleep(SILENT * 1.5)
        beats[0].beat()
    assert beats[1].silent_peers(SILENT) == []
    assert "rank 0 (node 0, the rendezvous store's host) out of reach" in beats[1].describe(SILENT)
    assert beats[0].describe(SILENT).startswith("silent peers: rank 1 (node 1)")


class RecordedFailure(RankFailure):
    def __init__(self) -> None:
        super().__init__(rank=3)
        self.messages: list[str] = []
        self.fired = threading.Event()

    def exit(self, what: str, wait_for_peers: float = 0.0) -> None:
        self.messages.append(f"scheduler rank {self.rank}: {what}{self.peers(wait_for_peers)}")
        self.fired.set()


def test_step_watchdog_fires_on_a_step_that_does_not_finish() -> None:
    failure = RecordedFailure()
    label = ["forward step 7 (decode, 2 requests)"]
    watchdog = StepWatchdog(0.3, failure, lambda: label[0]).start()
    for _ in range(8):  # iterations that finish in time
        watchdog.begin()
        time.sleep(0.05)
    assert not failure.fired.is_set()
    watchdog.begin()  # this one hangs
    assert failure.fired.wait(5.0)
    assert failure.messages[0] == (
        "scheduler rank 3: forward step 7 (decode, 2 requests) did not finish in 0.3 s"
    )


def test_step_watchdog_is_quiet_before_the_first_iteration() -> None:
    failure = RecordedFailure()
    StepWatchdog(0.1, failure, lambda: "start-up").start()
    assert not failure.fired.wait(0.5)
