"""One split for every overlap mode that runs a step as two micro-batches (TBO and DBO).

A step's overlap is one value, ``StepSplit`` (``srt.model_executor.forward_batch_info``), made
in three moves, all here:

1. ``plan_split``: this rank's proposal, by the configured rule (``SplitConfig.rule``): where
   its batch would split, or None when it is below its threshold or would leave a micro-batch
   empty. The thresholds are every rule's: ``--tbo-*-token-threshold`` or
   ``--dbo-*-token-threshold``, whichever mode is configured.
2. ``agree_split`` (under DP attention, inside the MLP sync): every group's micro-batch A
   tokens when all groups can split together, else None: TBO's rule
   (``agree_two_batch_overlap``) or DBO's uniform one (``agree_dual_batch_overlap``).
3. ``settle_split``: once ``StepOverlap`` has chosen the step's mode, the step's StepSplit:
   where this rank's batch splits when the mode is a split one, else the mode alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from srt.batch_overlap.dual_batch_overlap import (
    agree_dual_batch_overlap,
    split_at_token,
    uniform_split_token,
)
from srt.batch_overlap.two_batch_overlap import (
    DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
    agree_two_batch_overlap,
    propose_tbo_split,
)
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, StepSplit


@dataclass(frozen=True)
class SplitConfig:
    """How a step splits: ``rule`` "tbo" (SGLang's split points), "dbo" (vLLM's: half the
    tokens, the same token on every DP group) or None (no split mode is configured), and the
    configured mode's thresholds."""

    rule: str | None = None
    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD

    @classmethod
    def from_server_args(cls, server_args) -> SplitConfig:
        sa = server_args
        if sa.overlap_mode == "dbo":
            thresholds = sa.dbo_decode_token_threshold, sa.dbo_prefill_token_threshold
            return cls("dbo", *thresholds, sa.tbo_token_distribution_threshold)
        rule = "tbo" if "tbo" in sa.overlap_modes else None  # fixed, or one of auto's choices
        thresholds = sa.tbo_decode_token_threshold, sa.tbo_prefill_token_threshold
        return cls(rule, *thresholds, sa.tbo_token_distribution_threshold)

    def passes(self, batch: ForwardBatch) -> bool:
        """Whether the batch is worth splitting: an EXTEND or DECODE batch (a MIXED batch
        runs whole, and srt has no speculative decoding, whose split needs the draft length)
        of at least its kind's threshold tokens, and of two at least."""
        mode = batch.forward_mode
        if self.rule is None or mode not in (ForwardMode.EXTEND, ForwardMode.DECODE):
            return False
        extend = mode.is_extend()
        threshold = self.prefill_token_threshold if extend else self.decode_token_threshold
        return batch.num_tokens >= max(threshold, 2)


def plan_split(batch: ForwardBatch, config: SplitConfig) -> StepSplit | None:
    """This rank's proposal for its batch: where it would split, or None."""
    if not config.passes(batch):
        return None
    if config.rule == "dbo":
        token = uniform_split_token([batch.num_tokens])
        return None if token is None else split_at_token(batch, token)
    return propose_tbo_split(batch, config.token_distribution_threshold)


def agree_split(
    rule: str | None, rows: Sequence[tuple[ForwardMode, int, int | None]]
) -> list[int] | None:
    """The DP agreement over ``(forward_mode, num_tokens, proposed split token or None)`` per
    group: every group's micro-batch A tokens when the step can run split, else None."""
    if rule == "dbo":
        token = agree_dual_batch_overlap([(n, split is not None) for _, n, split in rows])
        return None if token is None else [token] * len(rows)
    if rule == "tbo" and agree_two_batch_overlap([(m, s is not None) for m, _, s in rows]):
        return [split or 0 for _, _, split in rows]
    return None


def settle_split(
    mode: str,
    batch: ForwardBatch,
    proposal: StepSplit | None,
    group_tokens: Sequence[int] | None = None,
) -> StepSplit:
    """The step's StepSplit once its ``mode`` is chosen (a split mode only where the batch can
    split: its ``proposal``, or under DP attention the agreed ``group_tokens``). An idle batch
    splits into two empty micro-batches; under DBO every group splits at the agreed token."""
    split = StepSplit(mode)
    if not split.is_split:
        return split
    groups = None if group_tokens is None else tuple(group_tokens)
    if batch.forward_mode.is_idle():
        return StepSplit(mode, 0, 0, groups)
    if mode == "dbo" and groups is not None:
        return split_at_token(batch, groups[0], groups)
    if proposal is None or proposal.mode != mode:
        raise ValueError(f"a {mode} step on a batch whose proposal is {proposal}")
    return StepSplit(mode, proposal.seq_index, proposal.token_index, groups)
