"""Single-batch overlap's blocked combine for the low_latency dispatcher (the row wire of
``srt.layers.overlap.single_batch_overlap``): fixed shapes, no host values, on every backend.

Wire: block b's combine is the unblocked low_latency combine's exchange, an all_to_all_single
of ``[ep·C, H]`` rows with equal splits of C (C = ``max_dispatch_tokens_per_rank``): row j of
the receiver's fixed dispatch buffer goes back into slot j of its sender's combine buffer,
holding that row's weighted outputs of the experts of block b, summed (zero where the row has
none of them, or is not a valid row). The sender adds each block's rows into an fp32
``[ep·C + 1, H]`` buffer as they arrive (the last row stays zero: what an unsent (token, rank)
pair gathers); ``combine_b`` gathers and sums each token's slots as the unblocked combine does,
so the result equals it up to the order of the sums.

Cost: every block sends the whole buffer, valid rows or not: ``num_blocks`` × the unblocked
low_latency combine's ``ep·C·H`` elements per rank, and more than that against gloo's ragged
unblocked combine, which sends only the valid rows. What it buys: no counts, no split sizes and
no value-dependent shape anywhere, so no host synchronisation on a GPU and a step that can be
captured in a CUDA graph (the pair wire of ``blocked_combine`` sends fewer bytes but needs each
block's split sizes on the host). gloo runs the same collectives (all_to_all_single with equal
splits), so the CPU tests run the code a GPU runs.

Buffers are allocated once: one receive buffer per block (a block's combine may still be in
flight while the next one is launched) and the accumulator.
"""

from __future__ import annotations

import torch

from srt.layers.moe.token_dispatcher.blocked_combine import BlockedCombine, BlockOrder
from srt.layers.overlap.single_batch_overlap import RowSumOverlapArgs


class FixedBlockedCombine(BlockOrder):
    """The row wire for a low_latency dispatcher of ``capacity`` rows per rank, with the
    blocks, exchange (the combine group's on CUDA) and combine stream of ``blocked``."""

    def __init__(self, blocked: BlockedCombine, capacity: int, device: torch.device | str):
        super().__init__(
            blocked.num_blocks, blocked.layout, blocked.fmt, blocked.exchange, blocked.stream
        )
        ep, h = self.layout.ep_size, self.fmt.hidden_size
        self.capacity, self._args = capacity, RowSumOverlapArgs(self.num_blocks)
        self._link_bytes = capacity * self.fmt.hidden_bytes  # the same on every rank
        self._recv = torch.zeros(
            self.num_blocks, ep * capacity, h, dtype=self.fmt.dtype, device=device
        )
        self._acc = torch.zeros(ep * capacity + 1, h, dtype=torch.float32, device=device)
        self._slots: tuple[torch.Tensor, int] | None = None

    def plan(self, combine_slot: torch.Tensor, num_tokens: int) -> None:
        """After a dispatch: ``combine_slot`` [T, ep], the combine buffer row of each (token,
        rank) pair (``ep·C``, the zero row, where the token did not go)."""
        self._acc.zero_()
        self._slots = (combine_slot, num_tokens)
        self.overlap_args = self._args

    def drop(self) -> None:
        """The step combines unblocked after all."""
        self.overlap_args = self._slots = None

    def launch(self, index: int, block_output: torch.Tensor) -> None:
        """Block ``index`` (in order, every one, on every rank); ``block_output`` [ep·C, H]:
        each dispatched row's weighted outputs of the block's experts, summed."""
        self._next_block(index)
        rows, c = self._recv.shape[1], self.capacity
        if tuple(block_output.shape) != (rows, self.fmt.hidden_size):
            raise ValueError(
                f"combine block {index}: {tuple(block_output.shape)}, expected "
                f"({rows}, {self.fmt.hidden_size}) as dispatch_b returned"
            )
        send = block_output.to(self.fmt.dtype).contiguous()
        recv, acc, splits = self._recv[index], self._acc[:-1], [c] * self.layout.ep_size
        self._alive.append(send)
        self.stream.submit(
            lambda: self.exchange.launch(recv, send, splits, splits, self._link_bytes),
            lambda: acc.add_(recv),
        )

    def finish(self) -> torch.Tensor:
        """Wait for every block; → ``[T, H]``: each token's slots summed, as the unblocked
        low_latency combine does (in fp32, rounded once)."""
        self._join()
        combine_slot, num_tokens = self._slots
        parts = self._acc.index_select(0, combine_slot.flatten())  # [T·ep, H]
        parts = parts.view(num_tokens, self.layout.ep_size, self.fmt.hidden_size)
        out = parts.sum(dim=1).to(self.fmt.dtype)
        self.drop()
        return out
