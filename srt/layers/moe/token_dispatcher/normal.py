"""``--moe-a2a-backend torch --deepep-mode normal``: exact variable split sizes.

On gloo with the step's bound (``global_max_tokens``, which the MLP sync gives every rank):
dispatch_a routes the (token, rank) pairs, packs each peer's rows behind a header row holding
their count, and posts one isend and one bounded irecv per peer (``ragged``): it never waits.
dispatch_b waits, reads the counts from the headers and concatenates the rows by source rank.

Otherwise (nccl, or a caller without the bound): dispatch_a launches a count exchange, an
all_to_all_single of a small int64 ``[ep, ep]`` tensor (each rank sends its row counts to
every rank, so every rank learns the whole ``[src, dst]`` matrix), packs the payload while the
counts travel, waits for them (the receive sizes are needed to allocate and launch the payload:
one small round trip) and launches the payload all_to_all_single async. dispatch_b waits.

Wire: rows sorted by destination rank, then token; one row per (token, rank) pair (see
``torch_a2a``). The receiver gets ``[R, H]`` rows with ``[R, k]`` masked ids and weights. Combine
sends the expert outputs ``[R, H]`` back with the split sizes reversed (both sides know them
after the dispatch), and the sender sums them per original token. Whether an exchange splits
by link direction is decided from a size every rank knows: the largest link of the count
matrix, or the bound on the ragged path.

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

from srt.distributed.p2p import PendingWork
from srt.layers.moe.token_dispatcher.base import DispatchOutput
from srt.layers.moe.token_dispatcher.blocked_combine import BlockedCombineDispatcher
from srt.layers.moe.token_dispatcher.ragged import (
    HEADER_ROWS,
    exchanges,
    read_headers,
    split_rows,
    write_headers,
)
from srt.layers.moe.token_dispatcher.torch_a2a import (
    DUPLEX_MIN_BYTES,
    DuplexAllToAll,
    EPLayout,
    PhaseGuard,
    RowFormat,
    check_inputs,
    largest_link,
    mask_for_rank,
)
from srt.layers.overlap.ubatch_context import dbo_maybe_run_recv_hook


class _Routed(NamedTuple):
    """What combine needs of one dispatch."""

    token_idx: torch.Tensor  # [S] source token of each sent row
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank (ragged: known at dispatch_b)
    link_rows: int  # a bound of the rows any rank sends any other rank (same on every rank)
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
    One instance serves one micro-batch (``tag``: its index, for the ragged messages); it keeps
    nothing shared with other instances."""

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
        tag: int = 0,
    ):
        self.layout = EPLayout(ep_rank, ep_size, num_experts)
        self.p2p, self.p2p_back = exchanges(groups, ep_rank, ep_size, tag)
        self._ragged: tuple[dict[int, torch.Tensor], torch.Tensor] | None = None
        self._back: tuple[torch.Tensor, PendingWork] | None = None  # combine receives posted
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
        blocked_combine: bool | None = None,
    ) -> None:
        dbo_maybe_run_recv_hook()
        self._guard.enter("dispatch_a")
        self._select_blocked(blocked_combine)
        check_inputs(self.fmt, hidden_states, topk_weights, topk_ids)
        dest, sends = self.layout.route(topk_ids)  # [T, k], [T, ep]
        if self.p2p is not None and global_max_tokens is not None:
            inputs = (hidden_states, topk_weights, topk_ids)
            self._dispatch_ragged(*inputs, dest, sends, global_max_tokens)
            return
        counts_work, matrix = self._launch_counts(sends.sum(dim=0))
        rank_idx, token_idx = sends.t().nonzero(as_tuple=True)  # [S], by rank then token
        payload = self._pack(hidden_states, topk_weights, topk_ids, dest, rank_idx, token_idx)
        counts_work.wait()
        send_splits, recv_splits, link_rows = self._read_counts(matrix)
        self._recv = payload.new_empty(sum(recv_splits), self.fmt.row_bytes)
        self._pending = self.exchange.launch(
            self._recv, payload, recv_splits, send_splits, link_rows * self.fmt.row_bytes
        )
        self._routed = self._route_info(hidden_states, topk_weights, topk_ids, token_idx,
                                        send_splits, recv_splits, link_rows)  # fmt: skip

    def _route_info(self, hidden, topk_weights, topk_ids, token_idx, send, recv, link) -> _Routed:
        return _Routed(
            token_idx, send, recv, link, hidden.shape[0], topk_weights.dtype, topk_ids.dtype,
            topk_ids,
        )  # fmt: skip

    def _dispatch_ragged(self, hidden, topk_weights, topk_ids, dest, sends, bound: int) -> None:
        """Each peer's rows behind a header, one isend and one irecv of ``bound`` rows per
        peer; the rows for this rank stay here."""
        if hidden.shape[0] > bound:
            raise ValueError(f"{hidden.shape[0]} tokens above the step's bound {bound}")
        rank_idx, token_idx = sends.t().nonzero(as_tuple=True)  # [S], by rank then token
        send_splits = sends.sum(dim=0).tolist()
        rows = self._pack(hidden, topk_weights, topk_ids, dest, rank_idx, token_idx, headers=True)
        blocks = split_rows(rows, [HEADER_ROWS + n for n in send_splits])
        recvs = {p: rows.new_empty(HEADER_ROWS + bound, rows.shape[1]) for p in self.p2p.peers()}
        me = self.layout.ep_rank
        self._pending = self.p2p.launch({p: blocks[p] for p in recvs}, recvs)
        self._ragged = (recvs, blocks[me])
        self._send = rows  # alive until the sends are done
        if self.blocked is None:  # the combine's receives, posted now (see ``ragged``)
            back = hidden.new_empty(token_idx.shape[0], self.fmt.hidden_size)  # [S, H]
            parts = split_rows(back, send_splits)
            posted = self.p2p_back.launch({}, {p: parts[p] for p in recvs if send_splits[p]})
            self._back = (back, posted)
        self._routed = self._route_info(hidden, topk_weights, topk_ids, token_idx, send_splits,
                                        None, bound)  # fmt: skip

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

    def _pack(
        self, hidden, topk_weights, topk_ids, dest, rank_idx, token_idx, headers: bool = False
    ) -> torch.Tensor:
        """``[S, row_bytes]`` rows by destination rank; with ``headers``, each rank's rows follow
        a header row holding their count (``[S + ep, row_bytes]``)."""
        ep, s = self.layout.ep_size, token_idx.shape[0]
        n = s + (ep * HEADER_ROWS if headers else 0)
        rows = torch.empty(n, self.fmt.row_bytes, dtype=torch.uint8, device=hidden.device)
        row_hidden, row_weights, row_ids = self.fmt.views(rows)
        local = dest[token_idx] == rank_idx[:, None]  # [S, k]
        weights, ids = mask_for_rank(topk_weights[token_idx], topk_ids[token_idx], local)
        if not headers:
            torch.index_select(hidden, 0, token_idx, out=row_hidden)  # straight into the rows
            row_weights.copy_(weights)
            row_ids.copy_(ids)
            return rows
        at = torch.arange(s, device=hidden.device) + (rank_idx + 1) * HEADER_ROWS  # [S]
        source = torch.zeros(n, dtype=token_idx.dtype, device=hidden.device)
        source[at] = token_idx  # header rows gather token 0 (overwritten below)
        if hidden.shape[0]:
            torch.index_select(hidden, 0, source, out=row_hidden)
        row_weights.index_copy_(0, at, weights)
        row_ids.index_copy_(0, at, ids)
        counts = torch.bincount(rank_idx, minlength=ep)  # [ep]
        header_at = torch.cumsum(counts, 0) - counts + torch.arange(ep, device=hidden.device)
        write_headers(rows, header_at, counts)
        return rows

    def dispatch_b(self) -> DispatchOutput:
        """Rows ``[R, H]`` by source rank then source token; ``hidden_states`` is a strided view
        of this call's own receive buffer (no copy, never reused)."""
        self._guard.enter("dispatch_b")
        self._hand_over(self._pending)
        self._pending.wait()
        if self._ragged is not None:
            self._recv = self._gather_ragged()
        hidden, weights, ids = self.fmt.views(self._recv)  # [R, H], [R, k], [R, k]
        self._pending = self._recv = self._send = None
        routed = self._routed
        if self.blocked is not None:
            self.blocked.plan(routed.topk_ids, ids, routed.recv_splits, routed.link_rows)
        return DispatchOutput(hidden, weights.to(routed.weights_dtype), ids.to(routed.ids_dtype))

    def _gather_ragged(self) -> torch.Tensor:
        """The received rows, by source rank, without headers; fills in the receive splits."""
        recvs, own = self._ragged
        me, peers = self.layout.ep_rank, sorted(recvs)
        counts = read_headers(torch.stack([recvs[p][0] for p in peers])) if peers else []
        splits = dict(zip(peers, counts))
        splits[me] = own.shape[0] - HEADER_ROWS
        parts = [own[HEADER_ROWS:] if p == me else recvs[p][HEADER_ROWS : HEADER_ROWS + splits[p]]
                 for p in range(self.layout.ep_size)]  # fmt: skip
        self._ragged = None
        self._routed = self._routed._replace(recv_splits=[splits[p] for p in sorted(splits)])
        return torch.cat(parts)

    def combine_a(self, expert_output: torch.Tensor) -> None:
        dbo_maybe_run_recv_hook()
        self._guard.enter("combine_a")
        if self.blocked is not None:
            self.blocked.drop()  # an unblocked combine this time
        routed = self._routed
        expected = (sum(routed.recv_splits), self.fmt.hidden_size)
        if tuple(expert_output.shape) != expected:
            raise ValueError(f"expert_output {tuple(expert_output.shape)}, expected {expected}")
        send = expert_output.to(self.fmt.dtype).contiguous()
        self._send = send  # kept alive until the exchange is done
        if self._back is not None:
            self._combine_ragged(send)
            return
        self._recv = send.new_empty(sum(routed.send_splits), self.fmt.hidden_size)
        self._pending = self.exchange.launch(
            self._recv,
            send,
            routed.send_splits,
            routed.recv_splits,
            routed.link_rows * self.fmt.hidden_bytes,
        )

    def _combine_ragged(self, send: torch.Tensor) -> None:
        """Each peer's rows go back into the receive it posted at dispatch; ours are copied."""
        (back, posted), routed, me = self._back, self._routed, self.layout.ep_rank
        rows_from = split_rows(send, routed.recv_splits)  # [recv_splits[p], H] per source p
        sends = {p: rows for p, rows in enumerate(rows_from) if p != me and rows.shape[0]}
        sent = self.p2p_back.launch(sends, {})
        split_rows(back, routed.send_splits)[me].copy_(rows_from[me])
        self._recv, self._pending, self._back = back, PendingWork(posted.works + sent.works), None

    def combine_b(self) -> torch.Tensor:
        """Sums in the hidden dtype: a token gets at most ep_size contributions, and the
        single-rank FusedMoE accumulates its top-k the same way."""
        self._guard.enter("combine_b")
        self._hand_over(self._pending)
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
