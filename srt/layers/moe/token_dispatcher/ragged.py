"""Ragged exchanges on gloo: each rank sends each peer only its valid rows, and nobody waits
for a count before its payload leaves.

gloo's point-to-point receive accepts a message shorter than the buffer it was posted with.
So a sender puts the number of rows in a header row ahead of them and posts one ``isend`` per
peer, while the receiver posts one ``irecv`` per peer with room for an upper bound of rows that
both sides know without talking (the most tokens any rank dispatches this step, which the MLP
sync already told every rank; or the low_latency capacity), and reads the real counts from the
headers once the data is in. The launch half of a dispatch therefore never waits for the
network, and only valid rows cross a link (DeepEP's low-latency kernels likewise write only the
rows each expert receives into fixed-size slots).

Directions: messages from a lower to a higher rank go on ``groups[0]``, the others on
``groups[-1]``, so with two groups each group's connection carries one direction and both
directions of a link stream at once (see ``torch_a2a``).

gloo moves a payload only once its receiver has posted the receive (a rendezvous: "ready to
send", "ready to receive", then the bytes). A combine knows its sizes at dispatch time (each
rank gets back exactly the rows it sent), so its receives are posted then, and the expert
outputs leave the moment combine_a sends them instead of a rendezvous later, behind whatever
else the link carries.

nccl has no such receive (sizes must match), so CUDA keeps exact sizes learnt from a count
exchange (normal) and whole fixed blocks (low_latency).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from srt.distributed.p2p import P2PExchange

HEADER_ROWS = 1  # row 0 of a message: its first 4 bytes hold the number of rows after it


def exchanges(groups: Sequence[ProcessGroup], rank: int, size: int, tag: int):
    """(dispatch, combine) exchanges of one micro-batch on gloo, each with a tag of its own;
    ``(None, None)`` elsewhere."""
    if not (groups and all(dist.get_backend(g) == "gloo" for g in groups)):
        return None, None
    return P2PExchange(groups, rank, size, 2 * tag), P2PExchange(groups, rank, size, 2 * tag + 1)


def split_rows(rows: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
    """``rows`` cut into consecutive blocks of ``sizes`` rows (plain slices: each may be
    written in place)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [rows[s : s + n] for s, n in zip(starts, sizes)]


def write_headers(rows: torch.Tensor, at: torch.Tensor, counts: torch.Tensor) -> None:
    """Rows ``at`` of ``rows`` [n, row_bytes] uint8 become headers holding ``counts``."""
    rows[at, :4] = counts.to(torch.int32).view(torch.uint8).view(-1, 4)


def read_headers(headers: torch.Tensor) -> list[int]:
    """The counts in ``headers`` [n, row_bytes] uint8 rows."""
    return headers[:, :4].contiguous().view(torch.int32).flatten().tolist()
