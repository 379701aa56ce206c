"""DP attention: the token movement between attention-DP groups, and the padding of the
buffer that gathers them. The per-step agreement that sizes it (the MLP sync) is in
``srt.model_executor.dp_sync``.

Padding (SGLang's rules), for the buffer that gathers every group's tokens around a MoE without
an all-to-all backend:
- MAX_LEN: every rank pads to the longest rank; the gather is an all-gather and the return a
  reduce-scatter of equal chunks.
- SUM_LEN: one buffer of the summed length, each rank writing its slice; the exchange is an
  all-reduce.
SUM_LEN when any rank has an extend (lengths are skewed and padding to the max would be costly);
otherwise MAX_LEN when it wastes at most half the buffer (2·sum ≥ max·ranks), else SUM_LEN.

Chunks: a group's tokens are replicated on its attention-TP ranks after the attention
all-reduce. Rather than send them ``attn_tp_size`` times, each attention-TP rank contributes one
chunk: the group's count is rounded up to a multiple of ``attn_tp_size`` and rank ``r`` takes
rows ``[r·c, (r+1)·c)`` of the padded tokens (``c`` = padded / attn_tp_size), possibly fewer
real rows or none. An all-gather inside the attention-TP group puts them back together.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from srt.distributed.communication_op import (
    all_gather,
    all_gather_variable,
    all_reduce,
    pad_to,
    reduce_scatter,
)
from srt.distributed.group_coordinator import GroupCoordinator
from srt.distributed.p2p import DuplexRows
from srt.model_executor.forward_batch_info import ForwardBatch

if TYPE_CHECKING:
    from srt.distributed.parallel_state import ParallelState


class DpPaddingMode(Enum):
    MAX_LEN = auto()
    SUM_LEN = auto()

    def is_max_len(self) -> bool:
        return self is DpPaddingMode.MAX_LEN

    @classmethod
    def choose(cls, is_extend_in_batch: bool, global_num_tokens: list[int]) -> DpPaddingMode:
        if is_extend_in_batch:
            return cls.SUM_LEN
        max_len, sum_len = max(global_num_tokens, default=0), sum(global_num_tokens)
        return cls.MAX_LEN if 2 * sum_len >= max_len * len(global_num_tokens) else cls.SUM_LEN


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dp_buffer_len(mode: DpPaddingMode, global_num_tokens: list[int], attn_tp_size: int) -> int:
    """Tokens in the gathered buffer. Each rank's count is first rounded up to a multiple of
    ``attn_tp_size`` so the buffer splits evenly across the attention-TP ranks."""
    padded = [round_up(n, attn_tp_size) for n in global_num_tokens]
    if mode.is_max_len():
        return max(padded, default=0) * len(padded)
    return sum(padded)


# ---------------------------------------------------------------------------------- chunks
def chunk_sizes(num_tokens: int, attn_tp_size: int) -> list[int]:
    """Real rows of each attention-TP rank's chunk of a group's ``num_tokens`` tokens."""
    chunk = round_up(num_tokens, attn_tp_size) // attn_tp_size
    return [max(0, min(chunk, num_tokens - r * chunk)) for r in range(attn_tp_size)]


def attn_tp_chunk(hidden: torch.Tensor, attn_tp_rank: int, attn_tp_size: int) -> torch.Tensor:
    """This attention-TP rank's chunk of the group's rows (a view; possibly empty)."""
    chunk = round_up(hidden.shape[0], attn_tp_size) // attn_tp_size
    return hidden[attn_tp_rank * chunk : (attn_tp_rank + 1) * chunk]


def attn_tp_all_gather(group: GroupCoordinator, chunk: torch.Tensor, num_tokens: int):
    """The group's ``num_tokens`` rows back from every attention-TP rank's chunk."""
    return all_gather_variable(group, chunk, chunk_sizes(num_tokens, group.world_size))


def max_chunk_tokens(batch: ForwardBatch, attn_tp_size: int) -> int:
    """The largest chunk any rank holds this step (the same on every rank)."""
    return max(round_up(n, attn_tp_size) // attn_tp_size for n in batch.global_num_tokens())


class DpRowsGather:
    """Every DP group's rows on every rank, each attention-TP rank sending its chunk (the LM
    head without ``--enable-dp-lm-head``); ``own_rows`` takes this group's rows back out.

    On gloo (``parallel.world_device_groups``) both go point to point, split by link direction
    (``srt.distributed.p2p``), and the rows of a vocabulary-sharded result come back by an
    all-to-all: each rank receives only its group's rows of every rank's vocabulary slice,
    instead of an all-gather of every row's slices (1/T of the logits' bytes). Elsewhere the
    gathers are collectives."""

    P2P_TAG = 1 << 20  # apart from the token dispatchers' tags on the same groups

    def __init__(self, parallel: ParallelState):
        self.parallel = parallel
        groups = parallel.world_device_groups
        self.p2p = (
            DuplexRows(groups, parallel.rank, parallel.tp_size, self.P2P_TAG) if groups else None
        )

    def gather(self, rows: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
        if counts is None:
            raise RuntimeError("the LM head over the world needs the MLP sync (apply_dp_sync)")
        p = self.parallel
        sizes = [s for n in counts for s in chunk_sizes(n, p.attn_tp_size)]  # per world rank
        mine = attn_tp_chunk(rows, p.attn_tp_rank, p.attn_tp_size)
        if self.p2p is not None:
            return self.p2p.all_gather(mine, sizes)
        return all_gather_variable(p.world, mine, sizes)

    def own_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        start = sum(counts[: self.parallel.attn_dp_rank])
        return rows[start : start + counts[self.parallel.attn_dp_rank]]

    def own_rows_all_vocab(
        self, logits: torch.Tensor, counts: list[int], vocab_group: GroupCoordinator
    ) -> torch.Tensor:
        """``logits`` [every group's rows, this rank's vocabulary slice] → [this group's rows,
        every rank's slice in ``vocab_group`` order] (``vocab_group``: the world)."""
        p = self.parallel
        if self.p2p is None:
            return self.own_rows(all_gather(vocab_group, logits, dim=-1), counts)
        starts = [sum(counts[:d]) for d in range(len(counts))]
        group_of = [r // p.attn_tp_size for r in range(p.tp_size)]
        blocks = [logits[starts[d] : starts[d] + counts[d]] for d in group_of]
        mine = counts[p.attn_dp_rank]
        return torch.cat(self.p2p.all_to_all(blocks, [mine] * p.tp_size), dim=-1)


# ---------------------------------------------------------------------------------- MoE buffer
def _own_slot(parallel: ParallelState, batch: ForwardBatch) -> tuple[int, int, int]:
    """(offset in a SUM_LEN buffer, rows of a MAX_LEN block, real rows) of this rank's chunk."""
    counts, size, r = batch.global_num_tokens_cpu, parallel.attn_tp_size, parallel.attn_tp_rank
    if counts is None or batch.dp_padding_mode is None:
        raise RuntimeError("the DP gather needs the MLP sync (apply_dp_sync) on the batch")
    d = parallel.attn_dp_rank
    chunk = round_up(counts[d], size) // size
    offset = sum(round_up(n, size) for n in counts[:d]) + r * chunk
    block = max(round_up(n, size) for n in counts) // size
    return offset, block, chunk_sizes(counts[d], size)[r]


def dp_gather(parallel: ParallelState, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """This group's tokens ``[n, H]`` → the global buffer ``[global_dp_buffer_len, H]``, the
    same on every rank. MAX_LEN: block ``rank`` holds that rank's chunk, zero-padded; SUM_LEN:
    the groups' padded tokens one after the other."""
    offset, block, _ = _own_slot(parallel, batch)
    chunk = attn_tp_chunk(hidden, parallel.attn_tp_rank, parallel.attn_tp_size)
    if batch.dp_padding_mode.is_max_len():
        return all_gather(parallel.world, pad_to(chunk, block))
    buffer = hidden.new_zeros(batch.global_dp_buffer_len, hidden.shape[1])
    buffer[offset : offset + chunk.shape[0]] = chunk
    return all_reduce(parallel.world, buffer)


def dp_scatter(
    parallel: ParallelState, output: torch.Tensor, batch: ForwardBatch, num_tokens: int
) -> torch.Tensor:
    """The inverse of :func:`dp_gather` for partial sums: ``output`` (this rank's share of
    every token's result) is summed over the world and this group's ``num_tokens`` rows come
    back. MAX_LEN: reduce-scatter; SUM_LEN: all-reduce and this rank's slice (``output`` is
    consumed). Then an all-gather in the attention-TP group."""
    offset, _, rows = _own_slot(parallel, batch)
    if batch.dp_padding_mode.is_max_len():
        mine = reduce_scatter(parallel.world, output)[:rows]
    else:
        mine = all_reduce(parallel.world, output)[offset : offset + rows]
    return attn_tp_all_gather(parallel.attn_tp, mine, num_tokens)
