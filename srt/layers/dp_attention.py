"""DP attention: the per-step MLP sync and the token movement between attention-DP groups.

Sync: every step, every rank all-gathers (gloo, cpu group) its batch's shape: tokens, LM-head
rows, extend or not, forward mode, and its two-batch-overlap proposal (can it split, and where).
From that every rank derives the same :class:`DpSyncInfo`: per-group counts, the global forward
mode, the padding mode, the buffer length and the TBO decision (``agree_two_batch_overlap``).
A rank whose group has no batch runs an IDLE one so that the MoE and LM-head collectives line
up.

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

from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from srt.distributed.communication_op import (
    all_gather,
    all_gather_ints,
    all_gather_variable,
    all_reduce,
    pad_to,
    reduce_scatter,
)
from srt.distributed.group_coordinator import GroupCoordinator
from srt.layers.logits_processor import num_logit_rows
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

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


# ---------------------------------------------------------------------------------- the sync
@dataclass
class DpSyncInfo:
    """The outcome of one MLP sync; the same on every rank."""

    global_num_tokens: list[int]  # per attention-DP group
    global_num_tokens_for_logprob: list[int]  # LM-head rows per group
    is_extend_in_batch: bool
    global_forward_mode: ForwardMode  # IDLE if every group is idle, EXTEND if any extends
    padding_mode: DpPaddingMode
    global_dp_buffer_len: int
    can_run_tbo: bool = False
    tbo_split_tokens: list[int] | None = None  # per group, its first micro-batch's tokens

    @property
    def all_idle(self) -> bool:
        return self.global_forward_mode.is_idle()


def _sync_row(batch: ForwardBatch | None) -> list[int]:
    if batch is None or batch.forward_mode.is_idle():
        return [0, 0, 0, int(ForwardMode.IDLE), 0, 0]
    mode, split = batch.forward_mode, batch.tbo_split_token_index
    return [
        batch.num_tokens,
        num_logit_rows(batch),
        int(mode.is_extend()),
        int(mode),
        int(split is not None),
        split or 0,
    ]


def agree_two_batch_overlap(rows: list[tuple[ForwardMode, bool]]) -> bool:
    """The DP agreement of two-batch overlap over ``(forward_mode, local_can_run_tbo)`` per
    group: TBO only if every non-idle group can split and all non-idle groups are in the same
    mode; an idle group follows (it splits its empty batch in two); all idle → no TBO."""
    busy = [(mode, can) for mode, can in rows if not mode.is_idle()]
    return bool(busy) and all(can for _, can in busy) and len({m for m, _ in busy}) == 1


def dp_sync_info(group_rows: list[list[int]], attn_tp_size: int) -> DpSyncInfo:
    """``group_rows``: per attention-DP group ``[num_tokens, num_tokens_for_logprob,
    is_extend, forward_mode, local_can_run_tbo, tbo_split_token_index]``, as gathered by
    :func:`sync_dp_batch`."""
    tokens = [row[0] for row in group_rows]
    is_extend = any(row[2] for row in group_rows)
    if is_extend:
        mode = ForwardMode.EXTEND
    elif all(ForwardMode(row[3]).is_idle() for row in group_rows):
        mode = ForwardMode.IDLE
    else:
        mode = ForwardMode.DECODE
    padding = DpPaddingMode.choose(is_extend, tokens)
    tbo = agree_two_batch_overlap([(ForwardMode(row[3]), bool(row[4])) for row in group_rows])
    return DpSyncInfo(
        tokens,
        [row[1] for row in group_rows],
        is_extend,
        mode,
        padding,
        dp_buffer_len(padding, tokens, attn_tp_size),
        tbo,
        [row[5] for row in group_rows] if tbo else None,
    )


def sync_dp_batch(parallel: ParallelState, forward_batch: ForwardBatch | None) -> DpSyncInfo:
    """The MLP sync: one small all-gather over the world's gloo group. Every rank calls it every
    step, ``forward_batch`` None when its group has no batch. The ranks of an attention-TP group
    must bring the same batch (checked)."""
    rows = all_gather_ints(parallel.world, _sync_row(forward_batch))
    size = parallel.attn_tp_size
    groups = [rows[d * size] for d in range(len(rows) // size)]
    for rank, row in enumerate(rows):
        if row != groups[rank // size]:
            raise RuntimeError(
                f"DP sync: rank {rank} brings batch {row} but its attention-TP group's first "
                f"rank brings {groups[rank // size]}; the ranks of a group run one batch"
            )
    return dp_sync_info(groups, size)


def apply_dp_sync(forward_batch: ForwardBatch, info: DpSyncInfo) -> None:
    forward_batch.global_num_tokens_cpu = list(info.global_num_tokens)
    forward_batch.global_num_tokens_for_logprob_cpu = list(info.global_num_tokens_for_logprob)
    forward_batch.global_forward_mode = info.global_forward_mode
    forward_batch.is_extend_in_batch = info.is_extend_in_batch
    forward_batch.dp_padding_mode = info.padding_mode
    forward_batch.global_dp_buffer_len = info.global_dp_buffer_len
    forward_batch.can_run_tbo = info.can_run_tbo
    forward_batch.global_tbo_split_tokens_cpu = info.tbo_split_tokens
    if forward_batch.forward_mode.is_idle() and info.can_run_tbo:
        forward_batch.tbo_split_seq_index = forward_batch.tbo_split_token_index = 0


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
    head without ``--enable-dp-lm-head``); ``own_rows`` takes this group's rows back out."""

    def __init__(self, parallel: ParallelState):
        self.parallel = parallel

    def gather(self, rows: torch.Tensor, counts: list[int] | None) -> torch.Tensor:
        if counts is None:
            raise RuntimeError("the LM head over the world needs the MLP sync (apply_dp_sync)")
        p = self.parallel
        sizes = [s for n in counts for s in chunk_sizes(n, p.attn_tp_size)]  # per world rank
        mine = attn_tp_chunk(rows, p.attn_tp_rank, p.attn_tp_size)
        return all_gather_variable(p.world, mine, sizes)

    def own_rows(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        start = sum(counts[: self.parallel.attn_dp_rank])
        return rows[start : start + counts[self.parallel.attn_dp_rank]]


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
