"""The MLP sync of DP attention: every step, every rank all-gathers (gloo, cpu group) one
:class:`SyncRow` describing its batch (or its lack of one), and from the rows every rank derives
the same :class:`DpSyncInfo`: per-group token counts, the global forward mode, the padding mode
and length of the gathered buffer, and the two-batch-overlap decision, unanimous by
construction (:func:`agree_two_batch_overlap`, or under dual-batch overlap vLLM's uniform rule,
``agree_dual_batch_overlap``). ``ModelRunner.forward_step`` runs it; a rank
whose group has no batch while others have one then runs an IDLE forward so the MoE and LM-head
collectives line up. It belongs to the step, not to the scheduler: the rows carry the step's
TBO plan and overlap measurement, and the CUDA-graph capture syncs its dummy batches the same
way; the scheduler only reads the outcome (``ModelRunner.last_dp_sync``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from srt.batch_overlap.dual_batch_overlap import agree_dual_batch_overlap, place_split
from srt.distributed.communication_op import all_gather_ints
from srt.layers.dp_attention import DpPaddingMode, dp_buffer_len
from srt.layers.logits_processor import num_logit_rows
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from srt.distributed.parallel_state import ParallelState


class SyncRow(NamedTuple):
    """What one rank brings to the sync (all ints, so one all-gather carries every row)."""

    num_tokens: int
    num_logit_rows: int  # LM-head rows
    is_extend: int
    forward_mode: int  # a ForwardMode value
    can_run_tbo: int  # this rank's two-batch-overlap proposal: can it split?
    tbo_split_token_index: int  # ... and where (0 when it cannot)

    @classmethod
    def of(cls, batch: ForwardBatch | None) -> SyncRow:
        if batch is None or batch.forward_mode.is_idle():
            return cls(0, 0, 0, int(ForwardMode.IDLE), 0, 0)
        mode, split = batch.forward_mode, batch.tbo_split_token_index
        return cls(
            batch.num_tokens,
            num_logit_rows(batch),
            int(mode.is_extend()),
            int(mode),
            int(split is not None),
            split or 0,
        )


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
    dbo_split_token: int | None = None  # dual-batch overlap: every group's split token
    max_extra: list[int] | None = None  # the elementwise max over ranks of their ``extra``

    @property
    def all_idle(self) -> bool:
        return self.global_forward_mode.is_idle()


def agree_two_batch_overlap(rows: list[tuple[ForwardMode, bool]]) -> bool:
    """The DP agreement of two-batch overlap over ``(forward_mode, local_can_run_tbo)`` per
    group: TBO only if every non-idle group can split and all non-idle groups are in the same
    mode; an idle group follows (it splits its empty batch in two); all idle → no TBO."""
    busy = [(mode, can) for mode, can in rows if not mode.is_idle()]
    return bool(busy) and all(can for _, can in busy) and len({m for m, _ in busy}) == 1


def dp_sync_info(group_rows: list[SyncRow], attn_tp_size: int, dbo: bool = False) -> DpSyncInfo:
    """The agreement from one row per attention-DP group (``dbo``: the split rule is dual-batch
    overlap's)."""
    rows = [SyncRow(*row) for row in group_rows]
    tokens = [row.num_tokens for row in rows]
    is_extend = any(row.is_extend for row in rows)
    if is_extend:
        mode = ForwardMode.EXTEND
    elif all(ForwardMode(row.forward_mode).is_idle() for row in rows):
        mode = ForwardMode.IDLE
    else:
        mode = ForwardMode.DECODE
    padding = DpPaddingMode.choose(is_extend, tokens)
    dbo_split = None
    if dbo:
        proposals = [(row.num_tokens, bool(row.can_run_tbo)) for row in rows]
        dbo_split = agree_dual_batch_overlap(proposals)
        tbo, splits = dbo_split is not None, [dbo_split or 0] * len(rows)
    else:
        tbo = agree_two_batch_overlap(
            [(ForwardMode(row.forward_mode), bool(row.can_run_tbo)) for row in rows]
        )
        splits = [row.tbo_split_token_index for row in rows]
    return DpSyncInfo(
        tokens,
        [row.num_logit_rows for row in rows],
        is_extend,
        mode,
        padding,
        dp_buffer_len(padding, tokens, attn_tp_size),
        tbo,
        splits if tbo else None,
        dbo_split,
    )


def sync_dp_batch(
    parallel: ParallelState,
    forward_batch: ForwardBatch | None,
    extra: Sequence[int] = (),
    dbo: bool = False,
) -> DpSyncInfo:
    """The MLP sync: one small all-gather over the world's gloo group. Every rank calls it every
    step, ``forward_batch`` None when its group has no batch. The ranks of an attention-TP group
    must bring the same batch (checked). ``extra``: ints of this rank's own that ride along
    (the same count on every rank), maxed over ranks (the auto overlap's step measurement)."""
    width = len(SyncRow._fields)
    gathered = all_gather_ints(parallel.world, [*SyncRow.of(forward_batch), *extra])
    rows = [SyncRow(*row[:width]) for row in gathered]
    size = parallel.attn_tp_size
    groups = [rows[d * size] for d in range(len(rows) // size)]
    for rank, row in enumerate(rows):
        if row != groups[rank // size]:
            raise RuntimeError(
                f"DP sync: rank {rank} brings batch {row} but its attention-TP group's first "
                f"rank brings {groups[rank // size]}; the ranks of a group run one batch"
            )
    info = dp_sync_info(groups, size, dbo)
    if extra:
        info.max_extra = [max(column) for column in zip(*(row[width:] for row in gathered))]
    return info


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
    elif info.dbo_split_token is not None:
        place_split(forward_batch, info.dbo_split_token)
