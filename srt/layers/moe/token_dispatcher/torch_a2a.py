"""Shared parts of the ``--moe-a2a-backend torch`` dispatchers (normal and low_latency).

Experts are contiguous blocks: rank ``r`` owns ``[r·E_local, (r+1)·E_local)``. A token travels
once to every rank that owns at least one of its top-k experts (a "(token, rank) pair"), with
its top-k row masked for that rank: ids of other ranks' experts become -1 and their weights 0,
so ``FusedMoE`` on the receiver computes exactly that rank's share, and the sender sums the
shares it gets back.

Wire row (bytes, one per pair): ``hidden [H]·dtype | pad to 4 | weights [k] fp32 | ids [k]
int32 | pad to the dtype's item size``. Packing everything into one uint8 row means one
collective per payload instead of three, and keeps routing weights in fp32 whatever the hidden
dtype.

Full duplex: over a real link one gloo process group carries one direction at a time, so an
all-to-all, which loads both ways of every link, gets half the link each way. Giving dispatch
and combine a group each does not help (each all-to-all still loads both ways of its group).
With two groups, :class:`DuplexAllToAll` splits a large exchange by link direction instead:
traffic from a lower to a higher rank on ``groups[0]``, from higher to lower on ``groups[1]``,
so each group streams one way and both ways of a link are busy at once. Measured with
benchmark/kernel/bench_dispatch.py over a 1 Gbit/s link: 0.48 Gbit/s each way on one group,
0.49 with a dispatch and a combine group, 0.94 split by direction. A small exchange stays on
one group: the second collective costs more latency than it saves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from srt.distributed.p2p import PendingWork

_PHASES = ("dispatch_a", "dispatch_b", "combine_a", "combine_b")
# an exchange splits by direction from this many bytes on one link: the crossover measured over
# a 1 Gbit/s link, about 300 KiB (below it the second collective costs more latency than it
# saves); two-batch overlap's half-size exchanges sit just above it (docs/distributed.md)
DUPLEX_MIN_BYTES = 256 << 10


@dataclass(frozen=True)
class EPLayout:
    ep_rank: int
    ep_size: int
    num_experts: int

    def __post_init__(self) -> None:
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} outside [0, {self.ep_size})")
        if self.num_experts % self.ep_size:
            raise ValueError(f"{self.num_experts} experts cannot be split over {self.ep_size}")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    def route(self, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (dest [T, k]: owner rank of each choice, ep_size for masked ids < 0;
        sends [T, ep_size] bool: token t goes to rank r)."""
        dest = torch.div(topk_ids, self.num_local_experts, rounding_mode="floor")  # [T, k]
        dest = dest.masked_fill(topk_ids < 0, self.ep_size)  # [T, k]
        sends = torch.zeros(
            topk_ids.shape[0], self.ep_size + 1, dtype=torch.bool, device=topk_ids.device
        )
        sends.scatter_(1, dest, True)  # [T, ep + 1]
        return dest, sends[:, : self.ep_size]  # [T, k], [T, ep]


class RowFormat:
    """Byte layout of one wire row; see the module docstring. Every field starts at a multiple
    of its item size and rows are a multiple of the largest, so a ``[S, row_bytes]`` uint8
    buffer reads as three strided typed views with no copy."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, top_k: int):
        self.hidden_size, self.dtype, self.top_k = hidden_size, dtype, top_k
        self.hidden_bytes = hidden_size * dtype.itemsize
        self.weights_at = _round_up(self.hidden_bytes, 4)
        self.ids_at = self.weights_at + 4 * top_k
        self.row_bytes = _round_up(self.ids_at + 4 * top_k, max(4, dtype.itemsize))

    def views(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """rows [S, row_bytes] uint8 → hidden [S, H] dtype, weights [S, k] fp32, ids [S, k]
        int32: strided views sharing the rows' memory."""
        return (
            rows[:, : self.hidden_bytes].view(self.dtype),
            rows[:, self.weights_at : self.ids_at].view(torch.float32),
            rows[:, self.ids_at : self.ids_at + 4 * self.top_k].view(torch.int32),
        )


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def mask_for_rank(
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, local: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Wire weights (fp32, 0 where not ``local``) and ids (int32, -1 where not ``local``)."""
    weights = topk_weights.float().masked_fill(~local, 0.0)
    ids = topk_ids.to(torch.int32).masked_fill(~local, -1)
    return weights, ids


def check_inputs(
    fmt: RowFormat, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> None:
    t = hidden.shape[0]
    if hidden.dim() != 2 or hidden.shape[1] != fmt.hidden_size or hidden.dtype != fmt.dtype:
        raise ValueError(
            f"hidden_states {tuple(hidden.shape)} {hidden.dtype}, dispatcher built for "
            f"[T, {fmt.hidden_size}] {fmt.dtype}"
        )
    for name, x in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if tuple(x.shape) != (t, fmt.top_k):
            raise ValueError(f"{name} {tuple(x.shape)}, expected ({t}, {fmt.top_k})")


class DuplexAllToAll:
    """``all_to_all_single`` over rows (dim 0) with per-rank split sizes, launched async, on one
    group or split by link direction over two (see the module docstring).

    The split costs a second collective per exchange, which only pays when the link is busy
    long enough: it is used when the largest amount one rank sends to one other rank is at
    least ``duplex_min_bytes`` (a faster link moves the crossover up). Callers pass that
    amount, the same on every rank."""

    def __init__(
        self,
        groups: Sequence[ProcessGroup],
        ep_rank: int,
        ep_size: int,
        duplex_min_bytes: int = DUPLEX_MIN_BYTES,
    ):
        if len(groups) not in (1, 2):
            raise ValueError(f"expected one or two process groups, got {len(groups)}")
        for group in groups:
            if dist.get_world_size(group) != ep_size or dist.get_rank(group) != ep_rank:
                raise ValueError(
                    f"process group of size {dist.get_world_size(group)} with this rank at "
                    f"{dist.get_rank(group)} does not match ep_size {ep_size}, ep_rank {ep_rank}"
                )
        self.groups, self.rank, self.size = tuple(groups), ep_rank, ep_size
        self.duplex_min_bytes = duplex_min_bytes

    def launch(
        self,
        output: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        link_bytes: int,
    ) -> PendingWork:
        """``link_bytes``: the largest number of bytes any rank sends to any other rank in this
        exchange; it must be the same on every rank (it picks the collectives)."""
        if len(self.groups) == 1 or link_bytes < self.duplex_min_bytes:
            return PendingWork([self._a2a(0, output, inp, out_splits, in_splits)])
        r, zeros = self.rank, [0] * self.size
        in_lo, out_lo = sum(in_splits[:r]), sum(out_splits[:r])
        out_hi = out_lo + out_splits[r]
        # groups[0]: lower → higher rank (and self); groups[1]: higher → lower
        up_in = zeros[:r] + in_splits[r:]
        up_out = out_splits[: r + 1] + zeros[r + 1 :]
        down_in = in_splits[:r] + zeros[r:]
        down_out = zeros[: r + 1] + out_splits[r + 1 :]
        up = self._a2a(0, output[:out_hi], inp[in_lo:], up_out, up_in)
        down = self._a2a(1, output[out_hi:], inp[:in_lo], down_out, down_in)
        return PendingWork([up, down])

    def _a2a(self, g: int, output, inp, out_splits: list[int], in_splits: list[int]):
        return dist.all_to_all_single(
            output, inp, out_splits, in_splits, group=self.groups[g], async_op=True
        )


def largest_link(count_matrix: list[list[int]]) -> int:
    """The largest off-diagonal entry of ``[src][dst]`` counts (self traffic crosses no link)."""
    return max(
        (n for s, row in enumerate(count_matrix) for d, n in enumerate(row) if s != d), default=0
    )


class PhaseGuard:
    """Enforces dispatch_a → dispatch_b → combine_a → combine_b on one instance."""

    def __init__(self) -> None:
        self._next = 0

    def enter(self, phase: str) -> None:
        expected = _PHASES[self._next]
        if phase != expected:
            raise RuntimeError(f"dispatcher {phase} called where {expected} was expected")
        self._next = (self._next + 1) % len(_PHASES)
