"""Point-to-point row exchanges on gloo, split by link direction.

One gloo process group streams one way at a time: a collective that loads both ways of a link
(an all-gather, an all-to-all) gets half of it each way. With two groups over the same ranks,
messages from a lower to a higher rank go on ``groups[0]`` and the others on ``groups[-1]``,
so each group's connection carries one direction and both directions of a link stream at once
(measured in ``srt.layers.moe.token_dispatcher.torch_a2a``).

gloo moves a payload only once its receiver has posted the receive, so every exchange here
posts its receives before its sends. A receive may be larger than the message (gloo accepts a
shorter one); the ragged token dispatchers rely on that, :class:`DuplexRows` does not (both
sides know every size).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class PendingWork:
    """Works in flight. ``wait`` may be called more than once (dual-batch overlap's receive
    hook waits before the owner does): a gloo receive waited twice would wait for a second
    message, so each work is waited once."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        works, self.works = self.works, []
        for work in works:
            work.wait()


class P2PExchange:
    """One isend and one irecv per peer, on a tag of its own (two exchanges between the same
    ranks in flight at once must differ in tag, or their messages match each other's).
    ``bytes_sent``: what this rank has sent to its peers so far."""

    def __init__(self, groups: Sequence[ProcessGroup], rank: int, size: int, tag: int = 0):
        self.groups, self.rank, self.size, self.tag = tuple(groups), rank, size, tag
        self.bytes_sent = 0

    def peers(self) -> list[int]:
        return [p for p in range(self.size) if p != self.rank]

    def launch(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor]) -> PendingWork:
        """``sends[p]``: the message for peer p; ``recvs[p]``: a buffer at least as large as
        what p sends here. Receives are posted first: gloo writes a payload as soon as its
        receiver is ready."""
        works = [
            dist.irecv(buf, group=self._group(peer, self.rank), group_src=peer, tag=self.tag)
            for peer, buf in recvs.items()
        ]
        self.bytes_sent += sum(msg.nbytes for msg in sends.values())
        works += [
            dist.isend(msg, group=self._group(self.rank, peer), group_dst=peer, tag=self.tag)
            for peer, msg in sends.items()
        ]
        return PendingWork(works)

    def _group(self, src: int, dst: int) -> ProcessGroup:
        return self.groups[0] if src < dst else self.groups[-1]


class DuplexRows:
    """Blocking row exchanges of known sizes between the ranks of two gloo groups (see the
    module docstring): an all-gather and an all-to-all of ``[n, ...]`` row blocks. Empty
    blocks are not sent."""

    def __init__(self, groups: Sequence[ProcessGroup], rank: int, size: int, tag: int):
        self.exchange = P2PExchange(groups, rank, size, tag)

    def all_gather(self, rows: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """Every rank's ``rows`` (``sizes[p]`` rows on rank p), concatenated in rank order."""
        ex = self.exchange
        if rows.shape[0] != sizes[ex.rank]:
            raise ValueError(f"{rows.shape[0]} rows, sizes say {sizes[ex.rank]}")
        out = rows.new_empty(sum(sizes), *rows.shape[1:])
        parts = out.split(list(sizes))
        recvs = {p: parts[p] for p in ex.peers() if sizes[p]}
        sends = {p: rows for p in ex.peers() if rows.shape[0]}
        pending = ex.launch(sends, recvs)
        parts[ex.rank].copy_(rows)
        pending.wait()
        return out

    def all_to_all(
        self, blocks: Sequence[torch.Tensor], recv_rows: Sequence[int]
    ) -> list[torch.Tensor]:
        """``blocks[p]`` goes to rank p; returns what every rank sent here (``recv_rows[p]``
        rows from rank p, the same trailing shape), in rank order."""
        ex, mine = self.exchange, blocks[self.exchange.rank]
        if mine.shape[0] != recv_rows[ex.rank]:
            raise ValueError(f"{mine.shape[0]} rows to itself, recv_rows say {recv_rows[ex.rank]}")
        out = [mine.new_empty(n, *mine.shape[1:]) for n in recv_rows]
        recvs = {p: out[p] for p in ex.peers() if recv_rows[p]}
        sends = {p: blocks[p].contiguous() for p in ex.peers() if blocks[p].shape[0]}
        pending = ex.launch(sends, recvs)
        out[ex.rank] = mine
        pending.wait()
        return out
