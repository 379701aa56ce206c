"""Peer heartbeats through torch.distributed's rendezvous store, to name the rank that failed.

A collective that fails or hangs does not say which peer is to blame: gloo reports a reset
connection or a timed-out receive. So every rank bumps its own counter in the store (hosted by
rank 0's process on node 0) every ``interval`` seconds from a daemon thread, and reads the
others' back, remembering on its own clock when each last moved. A rank whose counter stopped
is dead, stopped, or cut off from node 0; a rank whose own round trip to the store stopped has
lost node 0. Counters, not timestamps, so that the nodes' clocks need not agree.
"""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

logger = logging.getLogger(__name__)
HEARTBEAT_INTERVAL_S = 0.5
SILENT_AFTER_S = 2.0  # four missed beats


class PeerHeartbeat:
    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        ranks_per_node: int,
        interval: float = HEARTBEAT_INTERVAL_S,
    ):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.ranks_per_node, self.interval = ranks_per_node, interval
        self.keys = [f"srt/heartbeat/{r}" for r in range(world_size)]
        now = time.monotonic()
        self.counts: list[bytes | None] = [None] * world_size
        self.last_moved = [now] * world_size  # when each rank's counter last changed
        self.last_round_trip = now  # this rank's last completed store round trip
        self.thread = threading.Thread(target=self._run, name="srt-heartbeat", daemon=True)

    @classmethod
    def from_default_group(cls, ranks_per_node: int) -> PeerHeartbeat:
        store = dist.distributed_c10d._get_default_store()
        return cls(store, dist.get_rank(), dist.get_world_size(), ranks_per_node)

    def start(self) -> PeerHeartbeat:
        for key in self.keys:
            self.store.add(key, 0)  # every key exists before anyone reads them all
        self.thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.beat()
            except Exception as e:  # the store is gone (rank 0 exited): the beats stop
                logger.debug("heartbeat stopped: %s", e)
                return
            time.sleep(self.interval)

    def beat(self) -> None:
        """One round: bump this rank's counter, read everyone's."""
        self.store.add(self.keys[self.rank], 1)
        counts = self.store.multi_get(self.keys)
        now = time.monotonic()
        for r, count in enumerate(counts):
            if count != self.counts[r]:
                self.counts[r], self.last_moved[r] = count, now
        self.last_round_trip = now

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def silent_peers(self, silent_after: float = SILENT_AFTER_S) -> list[tuple[int, float]]:
        """(rank, seconds) of the other ranks whose counter has not moved for ``silent_after``
        seconds, while this rank still reached the store."""
        now = time.monotonic()
        if now - self.last_round_trip >= silent_after:
            return []  # this rank is the one cut off: it knows nothing newer
        return [
            (r, now - moved)
            for r, moved in enumerate(self.last_moved)
            if r != self.rank and now - moved >= silent_after
        ]

    def describe(self, silent_after: float = SILENT_AFTER_S) -> str | None:
        """Who went silent, in words; None when every peer still beats."""
        store_silence = time.monotonic() - self.last_round_trip
        if store_silence >= silent_after:
            return (
                f"rank 0 (node 0, the rendezvous store's host) out of reach for "
                f"{store_silence:.1f} s"
            )
        peers = self.silent_peers(silent_after)
        if not peers:
            return None
        return "silent peers: " + ", ".join(
            f"rank {r} (node {self.node_of(r)}) for {s:.1f} s" for r, s in peers
        )

    def wait_for_silence(self, timeout: float) -> str | None:
        """After a peer's connection broke: wait (at most ``timeout``) until the heartbeats
        show who stopped; the description, or None if every peer still beats."""
        deadline = time.monotonic() + timeout
        while (found := self.describe()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        return found
