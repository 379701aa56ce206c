"""``--moe-a2a-backend torch --deepep-mode normal``: exact variable split sizes.

dispatch_a: route the (token, rank) pairs; launch the count exchange, an all_to_all_single of a
small int64 ``[ep, ep]`` tensor (each rank sends its row counts to every rank, so every rank
learns the whole ``[src, dst]`` matrix: its receive sizes, and the largest link, which decides
the same way on every rank whether to split the payload by direction); pack the payload while
the counts travel; wait for the counts (the receive sizes are needed to allocate and launch the
payload: the only wait in an ``_a`` half, one small round trip); launch the payload
all_to_all_single async. dispatch_b waits for it.

Wire: rows sorted by destination rank, then token; one row per (token, rank) pair (see
``torch_a2a``). The receiver gets ``[R, H]`` rows with ``[R, k]`` masked ids and weights. Combine
sends the expert outputs ``[R, H]`` back with the split sizes reversed, and the sender sums them
per original token.

Single-batch overlap (``blocked``): dispatch_b also plans the blocked combine
(``blocked_combine``); the combine then goes out block by block (``combine_a_block``, one async
all-to-all per block of local experts, launched as each block's down-projection ends) and
combine_b waits for every block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from srt.layers.moe.token_dispatcher.base import DispatchOutput
from srt.layers.moe.token_dispatcher.blocked_combine import BlockedCombineDispatcher
from srt.layers.moe.token_dispatcher.torch_a2a import (
    DUPLEX_MIN_BYTES,
    DuplexAllToAll,
    EPLayout,
    PendingWork,
    PhaseGuard,
    RowFormat,
    check_inputs,
    largest_link,
    mask_for_rank,
)


class _Routed(NamedTuple):
    """What combine needs of one dispatch."""

    token_idx: torch.Tensor  # [S] source token of each sent row
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    link_rows: int  # the most rows any rank sends any other rank (same on every rank)
    num_tokens: int
    weights_dtype: torch.dtype
    ids_dtype: torch.dtype
    topk_ids: torch.Tensor  # [T, k] this rank's tokens' experts (for a blocked combine)


class TorchA2ANormalDispatcher(BlockedCombineDispatcher):
    """EP dispatcher over torch.distributed all_to_all_single with exact split sizes.

    ``groups``: one EP process group, or two over the same ranks for full duplex on gloo (lower
    → higher rank traffic on the first, higher → lower on the second). Counts use
    ``counts_group`` (the EP group's gloo CPU group) when given, else ``groups[0]``: on a group
    of their own they do not wait behind the other micro-batch's payload on the same
    connections (two-batch overlap launches one while the other is in flight).
    One instance serves one micro-batch; it keeps nothing shared with other instances."""

    def __init__(
        self,
        groups: Sequence[ProcessGroup],
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        dtype: torch.dtype,
        duplex_min_bytes: int = DUPLEX_MIN_BYTES,
        counts_group: ProcessGroup | None = None,
    ):
        self.layout = EPLayout(ep_rank, ep_size, num_experts)
        self.counts_group = counts_group
        self.fmt = RowFormat(hidden_size, dtype, top_k)
        self.exchange = DuplexAllToAll(groups, ep_rank, ep_size, duplex_min_bytes)
        self._guard = PhaseGuard()
        self._routed: _Routed | None = None
        self._pending: PendingWork | None = None
        self._recv: torch.Tensor | None = None
        self._send: torch.Tensor | None = None

    def dispatch_a(
        self,
        hidden_states: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        is_extend: bool | None = None,
        global_max_tokens: int | None = None,
    ) -> None:
        self._guard.enter("dispatch_a")
        check_inputs(self.fmt, hidden_states, topk_weights, topk_ids)
        dest, sends = self.layout.route(topk_ids)  # [T, k], [T, ep]
        counts_work, matrix = self._launch_counts(sends.sum(dim=0))
        rank_idx, token_idx = sends.t().nonzero(as_tuple=True)  # [S], by rank then token
        payload = self._pack(hidden_states, topk_weights, topk_ids, dest, rank_idx, token_idx)
        counts_work.wait()
        send_splits, recv_splits, link_rows = self._read_counts(matrix)
        self._recv = payload.new_empty(sum(recv_splits), self.fmt.row_bytes)
        self._pending = self.exchange.launch(
            self._recv, payload, recv_splits, send_splits, link_rows * self.fmt.row_bytes
        )
        self._routed = _Routed(
            token_idx,
            send_splits,
            recv_splits,
            link_rows,
            hidden_states.shape[0],
            topk_weights.dtype,
            topk_ids.dtype,
            topk_ids,
        )

    def _launch_counts(self, send_counts: torch.Tensor):
        """Every rank sends its ``[ep]`` row counts to every rank, so all learn the whole
        ``[src, dst]`` matrix: their own receive sizes and the size of the largest link."""
        ep, group = self.layout.ep_size, self.counts_group
        if group is None:
            group = self.exchange.groups[0]
        else:  # a gloo group of its own: the counts never queue behind a payload in flight
            send_counts = send_counts.cpu()
        matrix = send_counts.new_empty(ep, ep)
        work = dist.all_to_all_single(matrix, send_counts.repeat(ep, 1), group=group, async_op=True)
        return work, matrix

    def _read_counts(self, matrix: torch.Tensor) -> tuple[list[int], list[int], int]:
        rows = matrix.tolist()  # [src][dst]
        me = self.layout.ep_rank
        return rows[me], [row[me] for row in rows], largest_link(rows)

    def _pack(self, hidden, topk_weights, topk_ids, dest, rank_idx, token_idx) -> torch.Tensor:
        rows = torch.empty(
            token_idx.shape[0], self.fmt.row_bytes, dtype=torch.uint8, device=hidden.device
        )  # [S, row_bytes]
        row_hidden, row_weights, row_ids = self.fmt.views(rows)
        torch.index_select(hidden, 0, token_idx, out=row_hidden)  # straight into the rows
        local = dest[token_idx] == rank_idx[:, None]  # [S, k]
        weights, ids = mask_for_rank(topk_weights[token_idx], topk_ids[token_idx], local)
        row_weights.copy_(weights)
        row_ids.copy_(ids)
        return rows

    def dispatch_b(self) -> DispatchOutput:
        """Rows ``[R, H]`` by source rank then source token; ``hidden_states`` is a strided view
        of this call's own receive buffer (no copy, never reused)."""
        self._guard.enter("dispatch_b")
        self._pending.wait()
        hidden, weights, ids = self.fmt.views(self._recv)  # [R, H], [R, k], [R, k]
        self._pending = self._recv = None
        routed = self._routed
        if self.blocked is not None:
            self.blocked.plan(routed.topk_ids, ids, routed.recv_splits, routed.link_rows)
        return DispatchOutput(hidden, weights.to(routed.weights_dtype), ids.to(routed.ids_dtype))

    def combine_a(self, expert_output: torch.Tensor) -> None:
        self._guard.enter("combine_a")
        if self.blocked is not None:
            self.blocked.drop()  # an unblocked combine this time
        routed = self._routed
        expected = (sum(routed.recv_splits), self.fmt.hidden_size)
        if tuple(expert_output.shape) != expected:
            raise ValueError(f"expert_output {tuple(expert_output.shape)}, expected {expected}")
        send = expert_output.to(self.fmt.dtype).contiguous()
        self._recv = send.new_empty(sum(routed.send_splits), self.fmt.hidden_size)
        self._pending = self.exchange.launch(
            self._recv,
            send,
            routed.send_splits,
            routed.recv_splits,
            routed.link_rows * self.fmt.hidden_bytes,
        )
        self._send = send  # kept alive until the exchange is done

    def combine_b(self) -> torch.Tensor:
        """Sums in the hidden dtype: a token gets at most ep_size contributions, and the
        single-rank FusedMoE accumulates its top-k the same way."""
        self._guard.enter("combine_b")
        routed = self._routed
        if self.overlap_args is not None:
            out = self.blocked.finish()
        else:
            out = torch.zeros(
                routed.num_tokens, self.fmt.hidden_size, dtype=self.fmt.dtype,
                device=routed.token_idx.device,
            )  # fmt: skip
            self._pending.wait()
            out.index_add_(0, routed.token_idx, self._recv)  # [T, H]
        self._routed = self._pending = self._recv = self._send = None
        return out
