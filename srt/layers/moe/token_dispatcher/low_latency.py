"""``--moe-a2a-backend torch --deepep-mode low_latency``: fixed-capacity buffers, one collective
each way, no count exchange, fixed shapes and no host synchronisation (CUDA-graph friendly).

Wire, dispatch: every rank sends every other rank a block of ``1 + C`` rows (C =
``max_dispatch_tokens_per_rank``), all_to_all_single with equal splits. Row 0 of a block is a
header whose first 4 bytes hold the number of valid rows (int32); rows ``1..count`` are (token,
rank) pairs in token order (``torch_a2a`` row format); the rest are stale and ignored. The
receiver returns ``[ep_size·C, H]`` rows, block by source rank, with ids -1 and weights 0 on the
invalid rows, so FusedMoE skips them.

Wire, combine: the expert outputs ``[ep_size·C, H]`` go back in the same slots (equal splits, no
header: the sender knows where it put each token) and the sender sums its tokens' slots in fp32.

On gloo only the valid rows travel, both ways (``ragged``, the default there): dispatch sends
each peer its header and ``count`` rows into the peer's fixed block (point-to-point, the
receive posted for the whole block), and combine returns exactly those rows into the same
slots; the buffers, shapes and slots stay as above. Reading those counts waits for nothing (gloo
tensors live on the host), so it is allowed under ``forbid_host_sync``. On nccl, whose receives
must match the sizes sent, whole blocks travel; ``ragged=False`` makes gloo do the same
(constant message sizes and no host value anywhere in the dispatcher, for whole blocks on the
wire: the GPU's wire, on CPU).

Capacity: a rank sends a token at most once to each rank, so ``T ≤ C`` can never overflow and is
checked from shapes alone; only a larger batch costs a look at the counts.

Single-batch overlap (``blocked``): the dispatch is unchanged; the combine goes back block by
block of local experts on the row wire (``fixed_blocked_combine``), on every backend: each block
sends the whole ``[ep·C, H]`` buffer back with equal splits, each row holding its outputs of the
block's experts summed, and the sender adds the blocks up. Fixed shapes and no host value
(``num_blocks`` × the combine's bytes for it), so a GPU runs it without synchronising.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch.distributed import ProcessGroup

from srt.distributed.p2p import PendingWork
from srt.layers.moe.token_dispatcher.base import DispatchOutput
from srt.layers.moe.token_dispatcher.blocked_combine import BlockedCombine, BlockedCombineDispatcher
from srt.layers.moe.token_dispatcher.fixed_blocked_combine import FixedBlockedCombine
from srt.layers.moe.token_dispatcher.ragged import (
    HEADER_ROWS,
    exchanges,
    read_headers,
    write_headers,
)
from srt.layers.moe.token_dispatcher.torch_a2a import (
    DUPLEX_MIN_BYTES,
    DuplexAllToAll,
    EPLayout,
    PhaseGuard,
    RowFormat,
    check_inputs,
    mask_for_rank,
)
from srt.layers.overlap.ubatch_context import dbo_maybe_run_recv_hook
from srt.utils.sync_guard import allow_host_sync

# The ragged wire runs on gloo, whose tensors live on the host: reading its counts waits for
# nothing. On nccl whole blocks travel and nothing is read.
GLOO_ONLY = "gloo's ragged wire: counts of host tensors"


class _Slots(NamedTuple):
    """Where one dispatch put its tokens, for the combine."""

    combine_slot: torch.Tensor  # [T, ep] row of the combine buffer, ep·C (a zero row) if unsent
    num_tokens: int
    weights_dtype: torch.dtype
    ids_dtype: torch.dtype


class TorchA2ALowLatencyDispatcher(BlockedCombineDispatcher):
    """EP dispatcher with buffers of ``max_dispatch_tokens_per_rank`` rows per destination rank,
    allocated once per instance (one instance per micro-batch, so buffers never alias).

    ``groups``, ``tag``: as for the normal dispatcher (one, or two for full duplex on gloo).
    ``ragged``: on gloo, send only the valid rows (the default) or, False, whole blocks as on
    nccl (see the module docstring); ignored elsewhere."""

    def __init__(
        self,
        groups: Sequence[ProcessGroup],
        ep_rank: int,
        ep_size: int,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        dtype: torch.dtype,
        max_dispatch_tokens_per_rank: int,
        device: torch.device | str = "cpu",
        duplex_min_bytes: int = DUPLEX_MIN_BYTES,
        tag: int = 0,
        ragged: bool = True,
    ):
        if max_dispatch_tokens_per_rank < 1:
            raise ValueError("--max-dispatch-tokens-per-rank must be ≥ 1")
        self.layout = EPLayout(ep_rank, ep_size, num_experts)
        self.fmt = RowFormat(hidden_size, dtype, top_k)
        self.exchange = DuplexAllToAll(groups, ep_rank, ep_size, duplex_min_bytes)
        self.capacity = max_dispatch_tokens_per_rank
        self.p2p, self.p2p_back = (None, None)
        if ragged:
            self.p2p, self.p2p_back = exchanges(groups, ep_rank, ep_size, tag)
        self._counts: tuple[list[int], list[int]] | None = None  # ragged: (sent, received) rows
        self._back: PendingWork | None = None  # the combine's receives, posted at dispatch
        self._guard = PhaseGuard()
        self._slots: _Slots | None = None
        self._pending: PendingWork | None = None
        self._send: torch.Tensor | None = None
        self._init_buffers(torch.device(device))

    def _init_buffers(self, device: torch.device) -> None:
        self.device = device
        ep, c, rb = self.layout.ep_size, self.capacity, self.fmt.row_bytes
        self._send_buf = torch.zeros(ep * (c + 1), rb, dtype=torch.uint8, device=device)
        self._recv_buf = torch.zeros(ep * (c + 1), rb, dtype=torch.uint8, device=device)
        # the extra last row stays zero: what an unsent (token, rank) pair gathers at combine
        self._combine_buf = torch.zeros(
            ep * c + 1, self.fmt.hidden_size, dtype=self.fmt.dtype, device=device
        )
        self._ranks = torch.arange(ep, device=device)
        self._slot_pos = torch.arange(c, device=device)

    def enable_blocked(self, blocked: BlockedCombine) -> None:
        """Single-batch overlap: combines on the row wire (``FixedBlockedCombine``), with the
        blocks, exchange and combine stream of ``blocked``."""
        super().enable_blocked(FixedBlockedCombine(blocked, self.capacity, self.device))

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
        ep, c = self.layout.ep_size, self.capacity
        dest, sends = self.layout.route(topk_ids)  # [T, k], [T, ep]
        counts = sends.sum(dim=0)  # [ep]
        self._check_capacity(hidden_states.shape[0], counts)
        pos = sends.cumsum(dim=0) - 1  # [T, ep] slot of token t in the block for rank r
        send_slot = torch.where(sends, self._ranks * (c + 1) + 1 + pos, ep * (c + 1))  # [T, ep]
        self._pack(hidden_states, topk_weights, topk_ids, dest, send_slot, counts)
        if self.p2p is not None:
            with allow_host_sync(GLOO_ONLY):
                self._launch_ragged(counts.tolist())
        else:
            splits, link_bytes = [c + 1] * ep, (c + 1) * self.fmt.row_bytes
            self._pending = self.exchange.launch(
                self._recv_buf, self._send_buf, splits, splits, link_bytes
            )
        combine_slot = torch.where(sends, self._ranks * c + pos, ep * c)  # [T, ep]
        self._slots = _Slots(
            combine_slot, hidden_states.shape[0], topk_weights.dtype, topk_ids.dtype
        )

    def _blocks(self, buf: torch.Tensor, rows: int, counts: list[int], extra: int = 0) -> list:
        """The first ``extra + counts[r]`` rows of rank r's block of ``rows`` rows in ``buf``."""
        return [buf[r * rows : r * rows + extra + n] for r, n in enumerate(counts)]

    def _launch_ragged(self, counts: list[int]) -> None:
        """Each peer gets its header and valid rows; this rank's block is copied locally."""
        me, c1 = self.layout.ep_rank, self.capacity + HEADER_ROWS
        sends = self._blocks(self._send_buf, c1, counts, HEADER_ROWS)
        recvs = {p: self._recv_buf[p * c1 : (p + 1) * c1] for p in self.p2p.peers()}
        self._pending = self.p2p.launch({p: sends[p] for p in recvs}, recvs)
        self._recv_buf[me * c1 : me * c1 + sends[me].shape[0]].copy_(sends[me])
        self._counts = (counts, [])
        if self.blocked is None:  # the combine's receives, posted now (see ``ragged``)
            back = self._blocks(self._combine_buf, self.capacity, counts)
            self._back = self.p2p_back.launch({}, {p: back[p] for p in recvs if counts[p]})

    def _check_capacity(self, num_tokens: int, counts: torch.Tensor) -> None:
        if num_tokens <= self.capacity:
            return  # each token goes at most once to each rank
        worst = int(counts.max())
        if worst > self.capacity:
            raise RuntimeError(
                f"low_latency dispatch: EP rank {self.layout.ep_rank} would send {worst} tokens "
                f"to one rank, above --max-dispatch-tokens-per-rank={self.capacity}; raise "
                f"--max-dispatch-tokens-per-rank or use --deepep-mode normal or auto"
            )

    def _pack(self, hidden, topk_weights, topk_ids, dest, send_slot, counts) -> None:
        """Fill every slot of the send buffer by gathering (fixed shapes); slots past a block's
        count get arbitrary pairs, which the receiver ignores."""
        (t, k), ep, n = topk_ids.shape, self.layout.ep_size, self._send_buf.shape[0]
        if t:
            pair_of_slot = torch.zeros(n + 1, dtype=torch.int64, device=hidden.device)
            pairs = torch.arange(t * ep, device=hidden.device)  # pair (t, r) is t·ep + r
            pair_of_slot.index_copy_(0, send_slot.flatten(), pairs)  # [n + 1], n: unsent
            pair_of_slot = pair_of_slot[:n]
            local = dest[:, None, :] == self._ranks[None, :, None]  # [T, ep, k]
            weights, ids = mask_for_rank(
                topk_weights[:, None, :].expand(t, ep, k),
                topk_ids[:, None, :].expand(t, ep, k),
                local,
            )
            row_hidden, row_weights, row_ids = self.fmt.views(self._send_buf)
            torch.index_select(hidden, 0, pair_of_slot // ep, out=row_hidden)
            torch.index_select(weights.reshape(t * ep, k), 0, pair_of_slot, out=row_weights)
            torch.index_select(ids.reshape(t * ep, k), 0, pair_of_slot, out=row_ids)
        write_headers(self._send_buf, self._ranks * (self.capacity + HEADER_ROWS), counts)

    def dispatch_b(self) -> DispatchOutput:
        """Fixed shape ``[ep_size·C, H]``, block by source rank; fresh tensors (the receive
        buffer is reused by the next dispatch)."""
        self._guard.enter("dispatch_b")
        self._hand_over(self._pending)
        self._pending.wait()
        self._pending = None
        ep, c = self.layout.ep_size, self.capacity
        headers = self._recv_buf.view(ep, c + 1, -1)[:, 0]  # [ep, row_bytes]
        if self._counts is not None:  # host counts: the combine sends exactly these rows back
            with allow_host_sync(GLOO_ONLY):
                self._counts = (self._counts[0], read_headers(headers))
        counts = headers[:, :4].contiguous().view(torch.int32)  # [ep, 1], no host sync
        valid = self._slot_pos[None, :] < counts  # [ep, C]
        hidden, weights, ids = (
            x.view(ep, c + 1, -1)[:, 1:].reshape(ep * c, -1).contiguous()  # minus headers, copied
            for x in self.fmt.views(self._recv_buf)
        )
        invalid, slots = ~valid.view(ep * c, 1), self._slots
        ids = ids.masked_fill(invalid, -1)  # [ep·C, k]
        if self.blocked is not None:
            self.blocked.plan(slots.combine_slot, slots.num_tokens)
        return DispatchOutput(
            hidden,  # [ep·C, H]
            weights.masked_fill(invalid, 0.0).to(slots.weights_dtype),  # [ep·C, k]
            ids.to(slots.ids_dtype),
        )

    def combine_a(self, expert_output: torch.Tensor) -> None:
        dbo_maybe_run_recv_hook()
        self._guard.enter("combine_a")
        if self.blocked is not None:
            self.blocked.drop()  # an unblocked combine this time
        ep, c = self.layout.ep_size, self.capacity
        if tuple(expert_output.shape) != (ep * c, self.fmt.hidden_size):
            raise ValueError(
                f"expert_output {tuple(expert_output.shape)}, expected ({ep * c}, "
                f"{self.fmt.hidden_size}) as returned by dispatch_b"
            )
        self._send = expert_output.to(self.fmt.dtype).contiguous()  # alive until combine_b
        if self._counts is not None:
            self._combine_ragged()
            return
        splits, link_bytes = [c] * ep, c * self.fmt.hidden_bytes
        self._pending = self.exchange.launch(
            self._combine_buf[:-1], self._send, splits, splits, link_bytes
        )

    def _combine_ragged(self) -> None:
        """Exactly the rows each peer sent come back into the slots they left from."""
        (sent, received), c, me = self._counts, self.capacity, self.layout.ep_rank
        back = self._blocks(self._send, c, received)
        recvs = self._blocks(self._combine_buf, c, sent)
        peers = self.p2p.peers()  # both sides skip an empty message (gloo sends no 0 bytes)
        sends = {p: back[p] for p in peers if received[p]}
        if self._back is not None:  # receives posted at dispatch
            self._pending = PendingWork(self._back.works + self.p2p_back.launch(sends, {}).works)
        else:
            recv = {p: recvs[p] for p in peers if sent[p]}
            self._pending = self.p2p_back.launch(sends, recv)
        recvs[me].copy_(back[me])
        self._counts = self._back = None

    def combine_b(self) -> torch.Tensor:
        self._guard.enter("combine_b")
        self._hand_over(self._pending)
        if self.overlap_args is not None:
            self._slots = self._counts = self._back = None
            return self.blocked.finish()
        self._pending.wait()
        slots, ep, h = self._slots, self.layout.ep_size, self.fmt.hidden_size
        parts = self._combine_buf[slots.combine_slot.flatten()]  # [T·ep, H]
        # sum() accumulates reduced-precision dtypes in fp32 and rounds once
        out = parts.view(slots.num_tokens, ep, h).sum(dim=1)  # [T, H]
        self._slots = self._pending = self._send = None
        return out
