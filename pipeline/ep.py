"""Expert parallelism inside a pipeline stage, for training: the all-to-all as an autograd
function, and the hand-over points of ``--moe-fb-overlap``.

The ranks at one pipeline position form an EP group and split every MoE layer's experts in
contiguous blocks (rank ``d`` owns ``[d·E_local, (d+1)·E_local)``); each runs its own
micro-batches (data parallel), so everything but the experts is replicated and its gradients
are summed over the group after the step. A token's top-k choices travel as k rows, each to
the rank owning that expert (dispatch), carrying the expert's local index in one extra column;
the owner runs its experts and sends the rows back (combine); the sender weights and sums them.
The backward of an exchange is the reverse exchange of the gradients.

Every exchange, forward or backward, is a hand-over point in the sense of dual-batch overlap
(``srt.layers.overlap.ubatch_context``): it first runs the receive hook the other thread left,
sends, leaves its own wait as the other thread's hook, and yields. With ``--moe-fb-overlap`` the
executor runs an F&B pair's forward and backward in the two ubatch threads, so one's exchange
is in flight while the other computes; outside such a pair the calls do nothing. A group of one
rank exchanges nothing but still hands over, so the interleaving is the same at any EP size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from srt.distributed.p2p import PendingWork
from srt.layers.moe.token_dispatcher.torch_a2a import DuplexAllToAll
from srt.layers.overlap.ubatch_context import (
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
)


@dataclass
class EPGroup:
    """This rank's place in its EP group (no ``groups``: a group of one) and the bytes it has
    exchanged (sent to other ranks plus kept, forward and backward)."""

    rank: int = 0
    size: int = 1
    groups: tuple[ProcessGroup, ...] = ()  # payloads (one, or two split by link direction)
    counts_group: ProcessGroup | None = None  # the row counts' exchange, beside the payloads
    bytes_exchanged: int = 0
    num_exchanges: int = 0

    def __post_init__(self) -> None:
        # srt's exchange over one group, or over two by link direction (a gloo group carries
        # one direction of a link at a time); every payload here splits, the same on all ranks
        self.a2a = DuplexAllToAll(self.groups, self.rank, self.size, 0) if self.groups else None


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int], ep: EPGroup):
    """Rows of ``x`` (``in_splits[d]`` for rank d, in rank order) out, ``out_splits[d]`` rows
    from rank d in: one ``all_to_all_single``, with the hand-over around it."""
    dbo_maybe_run_recv_hook()  # the other thread's exchange lands before this one goes
    ep.bytes_exchanged += x.numel() * x.element_size()
    ep.num_exchanges += 1
    if ep.a2a is None:
        out, work = x.clone(), PendingWork([])
    else:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        work = ep.a2a.launch(out, x.contiguous(), out_splits, in_splits, link_bytes=0)
    dbo_register_recv_hook(work.wait)
    dbo_yield()
    work.wait()
    return out


class AllToAll(torch.autograd.Function):
    """``exchange`` forward, the reverse exchange of the gradient backward."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], ep: EPGroup):
        ctx.splits, ctx.ep = (out_splits, in_splits), ep
        return exchange(x, out_splits, in_splits, ep)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return exchange(grad.contiguous(), in_splits, out_splits, ctx.ep), None, None, None


def exchange_counts(send: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """Each rank's row count for every rank → the counts every rank sends here. Blocking and
    without a hand-over (nothing to compute between it and its payload), on a group of its own
    so that it does not queue behind the other thread's payload in flight."""
    if ep.counts_group is None:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ep.counts_group)
    return recv


def dispatch_combine(flat, weights, ids, num_local: int, ep: EPGroup, experts) -> torch.Tensor:
    """The MoE output of the tokens ``flat [T, H]`` routed to ``ids [T, k]`` with ``weights``:
    rows out to the experts' owners, ``experts(rows, local_ids)`` there, and back."""
    t, k = ids.shape
    dest = (ids // num_local).flatten()  # owner rank of each (token, choice)
    order = torch.argsort(dest, stable=True)
    send = torch.bincount(dest, minlength=ep.size)
    recv = exchange_counts(send, ep)
    send_splits, recv_splits = send.tolist(), recv.tolist()
    local_ids = (ids.flatten() % num_local)[order]
    rows = torch.cat([flat[order // k], local_ids.to(flat.dtype)[:, None]], dim=1)
    got = AllToAll.apply(rows, recv_splits, send_splits, ep)
    out = experts(got[:, :-1], got[:, -1].long())
    back = AllToAll.apply(out, send_splits, recv_splits, ep)  # in ``order``
    pairs = back[torch.argsort(order)].view(t, k, -1)
    return (pairs * weights[..., None].to(pairs.dtype)).sum(1)
