"""The MLP sync of DP attention: every step, every rank all-gathers (gloo, cpu group) one
:class:`SyncRow` describing its batch (or its lack of one), and from the rows every rank derives
the same :class:`DpSyncInfo`: per-group token counts, the global forward mode, the padding mode
and length of the gathered buffer, and whether the step can run split into two micro-batches
(TBO or DBO), unanimous by construction (``srt.batch_overlap.step_split.agree_split``).
``ModelRunner.forward_step`` runs it; a rank
whose group has no batch while others have one then runs an IDLE forward so the MoE and LM-head
collectives line up. It belongs to the step, not to the scheduler: the rows carry the step's
split proposal and overlap measurement, and the CUDA-graph capture syncs its dummy batches the same
way; the scheduler only reads the outcome (``ModelRunner.last_dp_sync``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from srt.batch_overlap.step_split import agree_split
from srt.distributed.communication_op import all_gather_ints
from srt.layers.dp_attention import DpPaddingMode, dp_buffer_len
from srt.layers.logits_processor import num_logit_rows
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, StepSplit

if TYPE_CHECKING:
    from srt.distributed.parallel_state import ParallelState


class SyncRow(NamedTuple):
    """What one rank brings to the sync (all ints, so one all-gather carries every row)."""

    num_tokens: int
    num_logit_rows: int  # LM-head rows
    is_extend: int
    forward_mode: int  # a ForwardMode value
    can_split: int  # this rank's split proposal: can it split?
    split_token: int  # ... and where (0 when it cannot)

    @classmethod
    def of(cls, batch: ForwardBatch | None, proposal: StepSplit | None = None) -> SyncRow:
        if batch is None or batch.forward_mode.is_idle():
            return cls(0, 0, 0, int(ForwardMode.IDLE), 0, 0)
        mode = batch.forward_mode
        return cls(
            batch.num_tokens,
            num_logit_rows(batch),
            int(mode.is_extend()),
            int(mode),
            int(proposal is not None),
            0 if proposal is None else proposal.token_index,
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
    split_tokens: list[int] | None = None  # can run split: each group's micro-batch A tokens
    max_extra: list[int] | None = None  # the elementwise max over ranks of their ``extra``

    @property
    def all_idle(self) -> bool:
        return self.global_forward_mode.is_idle()

    @property
    def can_split(self) -> bool:
        return self.split_tokens is not None


def dp_sync_info(
    group_rows: list[SyncRow], attn_tp_size: int, split_rule: str | None = None
) -> DpSyncInfo:
    """The agreement from one row per attention-DP group (``split_rule``: ``SplitConfig.rule``,
    how the step splits into micro-batches, None for no split)."""
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
    proposals = [
        (ForwardMode(row.forward_mode), row.num_tokens, row.split_token if row.can_split else None)
        for row in rows
    ]
    return DpSyncInfo(
        tokens,
        [row.num_logit_rows for row in rows],
        is_extend,
        mode,
        padding,
        dp_buffer_len(padding, tokens, attn_tp_size),
        agree_split(split_rule, proposals),
    )


def sync_dp_batch(
    parallel: ParallelState,
    forward_batch: ForwardBatch | None,
    proposal: StepSplit | None = None,
    extra: Sequence[int] = (),
    split_rule: str | None = None,
) -> DpSyncInfo:
    """The MLP sync: one small all-gather over the world's gloo group. Every rank calls it every
    step, ``forward_batch`` None when its group has no batch; ``proposal``: this rank's split
    (``plan_split``). The ranks of an attention-TP group must bring the same batch (checked).
    ``extra``: ints of this rank's own that ride along (the same count on every rank), maxed
    over ranks (the auto overlap's step measurement)."""
    width = len(SyncRow._fields)
    mine = SyncRow.of(forward_batch, proposal)
    gathered = all_gather_ints(parallel.world, [*mine, *extra])
    rows = [SyncRow(*row[:width]) for row in gathered]
    size = parallel.attn_tp_size
    groups = [rows[d * size] for d in range(len(rows) // size)]
    for rank, row in enumerate(rows):
        if row != groups[rank // size]:
            raise RuntimeError(
                f"DP sync: rank {rank} brings batch {row} but its attention-TP group's first "
                f"rank brings {groups[rank // size]}; the ranks of a group run one batch"
            )
    info = dp_sync_info(groups, size, split_rule)
    if extra:
        info.max_extra = [max(column) for column in zip(*(row[width:] for row in gathered))]
    return info


def apply_dp_sync(forward_batch: ForwardBatch, info: DpSyncInfo, split: StepSplit) -> None:
    """The agreement onto this rank's batch, with the step's ``split`` (``settle_split``)."""
    forward_batch.global_num_tokens_cpu = list(info.global_num_tokens)
    forward_batch.global_num_tokens_for_logprob_cpu = list(info.global_num_tokens_for_logprob)
    forward_batch.global_forward_mode = info.global_forward_mode
    forward_batch.is_extend_in_batch = info.is_extend_in_batch
    forward_batch.dp_padding_mode = info.padding_mode
    forward_batch.global_dp_buffer_len = info.global_dp_buffer_len
    forward_batch.split = split
