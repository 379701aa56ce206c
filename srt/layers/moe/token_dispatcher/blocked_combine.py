"""Single-batch overlap's combine, block by block, for the ``torch`` dispatchers: the wires and
the layout are in ``srt.layers.overlap.single_batch_overlap``.

``BlockedCombine`` is the pair wire (the normal mode's): only the block's (token, expert) pairs
travel, with split sizes both sides derive on the host from the ids (``compute_overlap_args``:
``nonzero``, ``bincount``, host lists), so it synchronises on a GPU, as the normal mode's count
exchange does anyway. The low_latency mode combines on the row wire instead
(``fixed_blocked_combine``: fixed shapes, no host values). Either is planned by its dispatcher
in ``dispatch_b``; ``combine_a_block`` launches one block, ``combine_b`` finishes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed import ProcessGroup

from srt.layers.moe.token_dispatcher.base import TokenDispatcher
from srt.layers.moe.token_dispatcher.torch_a2a import (
    DuplexAllToAll,
    EPLayout,
    PhaseGuard,
    RowFormat,
)
from srt.layers.overlap.single_batch_overlap import (
    CombineOverlapArgs,
    CudaCombineStream,
    DownGemmOverlapArgs,
    HostCombineStream,
    RowSumOverlapArgs,
    compute_overlap_args,
    make_combine_stream,
)


class BlockOrder:
    """What every blocked combine shares: its blocks, exchange and combine stream, and the
    order of its calls (every block launched in order, on every rank, then one finish)."""

    overlap_args: DownGemmOverlapArgs | RowSumOverlapArgs | None = None  # the planned dispatch's

    def __init__(
        self,
        num_blocks: int,
        layout: EPLayout,
        fmt: RowFormat,
        exchange: DuplexAllToAll,
        stream: HostCombineStream | CudaCombineStream,
    ):
        if num_blocks < 1:
            raise ValueError(f"--sbo-num-blocks must be ≥ 1, got {num_blocks}")
        self.num_blocks, self.layout, self.fmt = num_blocks, layout, fmt
        self.exchange, self.stream = exchange, stream
        self._alive: list[torch.Tensor] = []  # block buffers, kept until the join
        self._launched = 0

    def _next_block(self, index: int) -> None:
        if self.overlap_args is None:
            raise RuntimeError("combine_a_block without a planned blocked combine")
        if index != self._launched:
            raise RuntimeError(f"combine block {index} launched after {self._launched}")
        self._launched += 1

    def _join(self) -> None:
        """Wait for every block (on CUDA: the compute stream waits for the combine stream)."""
        if self._launched != self.num_blocks:
            raise RuntimeError(f"combine_b after {self._launched} of {self.num_blocks} blocks")
        self.stream.join()
        self._alive, self._launched = [], 0


class BlockedCombine(BlockOrder):
    """One dispatcher's blocked combines on the pair wire, one dispatch at a time.

    ``exchange``: the dispatcher's all-to-all; on CUDA ``combine_group`` (the EP group whose
    nccl CTAs are limited to the communication SMs), when given, replaces it."""

    def __init__(
        self,
        num_blocks: int,
        layout: EPLayout,
        fmt: RowFormat,
        exchange: DuplexAllToAll,
        device: torch.device | str = "cpu",
        communicate_sms: int | None = None,
        combine_group: ProcessGroup | None = None,
    ):
        if combine_group is not None:
            exchange = DuplexAllToAll([combine_group], layout.ep_rank, layout.ep_size)
        stream = make_combine_stream(device, communicate_sms)
        super().__init__(num_blocks, layout, fmt, exchange, stream)
        self._combine_args: CombineOverlapArgs | None = None
        self._link_bytes = 0
        self._out: torch.Tensor | None = None

    def plan(
        self,
        sent_topk_ids: torch.Tensor,
        recv_topk_ids: torch.Tensor,
        recv_splits: list[int],
        link_rows: int,
    ) -> None:
        """After a dispatch. ``link_rows``: the dispatch's largest link in rows, the same on
        every rank: it decides whether a block's exchange splits by link direction
        (``DuplexAllToAll``), identically everywhere."""
        layout = self.layout
        self._combine_args, self.overlap_args = compute_overlap_args(
            self.num_blocks,
            layout.num_local_experts,
            layout.ep_rank,
            layout.ep_size,
            sent_topk_ids,
            recv_topk_ids,
            recv_splits,
        )
        self._link_bytes = link_rows * self.fmt.hidden_bytes
        num_tokens, device = sent_topk_ids.shape[0], sent_topk_ids.device
        self._out = torch.zeros(
            num_tokens, self.fmt.hidden_size, dtype=self.fmt.dtype, device=device
        )

    def drop(self) -> None:
        """The step combines unblocked after all (e.g. SBO off for this layer's caller)."""
        self.overlap_args = self._combine_args = self._out = None

    def launch(self, index: int, block_output: torch.Tensor) -> None:
        """Block ``index`` (blocks in order, every one of them, on every rank); ``block_output``
        [P, H]: the block's weighted pair outputs in the order of ``overlap_args``."""
        self._next_block(index)
        send_splits = self.overlap_args.send_splits[index]
        recv_splits = self._combine_args.recv_splits[index]
        token_idx, out = self._combine_args.token_idx[index], self._out
        send = block_output.to(self.fmt.dtype).contiguous()
        if send.shape[0] != sum(send_splits):
            raise ValueError(
                f"combine block {index}: {send.shape[0]} rows, expected {sum(send_splits)}"
            )
        recv = send.new_empty(sum(recv_splits), self.fmt.hidden_size)
        self._alive += [send, recv]
        self.stream.submit(
            lambda: self.exchange.launch(recv, send, recv_splits, send_splits, self._link_bytes),
            lambda: out.index_add_(0, token_idx, recv),
        )

    def finish(self) -> torch.Tensor:
        """Wait for every block; → ``[T, H]``, each token's expert outputs summed."""
        self._join()
        out = self._out
        self.drop()
        return out


class BlockedCombineDispatcher(TokenDispatcher):
    """A ``torch`` dispatcher that can combine block by block: single-batch overlap's entry
    points. Subclasses own ``_guard`` (their PhaseGuard), call ``_select_blocked`` first in
    ``dispatch_a``, plan ``blocked`` in ``dispatch_b`` when it is set, drop it in an unblocked
    ``combine_a`` and finish it in ``combine_b``."""

    blocked: BlockOrder | None = None  # this dispatch's (None: an unblocked combine)
    _blocked_combine: BlockOrder | None = None  # the one attached, if any
    _guard: PhaseGuard

    def enable_blocked(self, blocked: BlockOrder) -> None:
        """Single-batch overlap: dispatches plan a blocked combine (unless one says not to)."""
        self._blocked_combine = self.blocked = blocked

    def _select_blocked(self, blocked_combine: bool | None) -> None:
        if blocked_combine and self._blocked_combine is None:
            raise RuntimeError("blocked_combine=True on a dispatcher without a blocked combine")
        self.blocked = None if blocked_combine is False else self._blocked_combine

    @property
    def overlap_args(self) -> DownGemmOverlapArgs | RowSumOverlapArgs | None:
        """This dispatch's blocked-combine layout (SBO), for the experts' down-projection."""
        return None if self.blocked is None else self.blocked.overlap_args

    def combine_a_block(self, index: int, block_output: torch.Tensor) -> None:
        """SBO: launch block ``index``'s combine; see ``BlockedCombine.launch``."""
        if self.overlap_args is None:
            raise RuntimeError("combine_a_block needs a dispatcher with a blocked combine")
        if index == 0:
            self._guard.enter("combine_a")
        self.blocked.launch(index, block_output)

    def combine_a_blocks(self, compute_block: Callable[[int], torch.Tensor]) -> None:
        """SBO: for each block in order, ``compute_block(index)`` (its down-projection, with
        the communication SMs left free on CUDA), then launch its combine."""
        with self.blocked.stream.compute_sms():
            for index in range(self.blocked.num_blocks):
                self.combine_a_block(index, compute_block(index))
