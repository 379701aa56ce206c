"""Dual-batch overlap (DBO, vLLM's design): whether and where a step splits in two
micro-batches. The threads that run them are ``srt.batch_overlap.ubatching``; the children are
two-batch overlap's (``split_forward_batch``), so attention metadata, DP buffer lengths and the
dispatcher of each micro-batch are shared with TBO.

Whether (vLLM's rule): a batch splits only if it holds at least ``--dbo-decode-token-threshold``
tokens (a decode batch) or ``--dbo-prefill-token-threshold`` (a batch with a prefill). The
decision is uniform across DP groups: every group's batch must pass its threshold; the split is
then at half the largest group's tokens, the same token on every group, as if each group were
padded to the largest count and cut in the middle; and if any group would then have an empty
second micro-batch (its tokens ≤ that half, an idle group included), no group splits. srt
computes no padding tokens: the DP gathers take groups of unequal counts, so the second
micro-batches carry only their real tokens.

Where: at token ``split``. Decode: sequence ``split`` starts the second micro-batch. A batch
with a prefill: where ``split`` falls inside a sequence, that sequence is cut (the first
micro-batch computes its first part, the second continues it with a longer prefix), as TBO's
two-chunk split does.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@dataclass(frozen=True)
class DboConfig:
    """The DBO flags a ModelRunner needs."""

    enabled: bool = False
    decode_token_threshold: int = 32
    prefill_token_threshold: int = 512

    @classmethod
    def from_server_args(cls, server_args) -> DboConfig:
        return cls(
            server_args.overlap_mode == "dbo",
            server_args.dbo_decode_token_threshold,
            server_args.dbo_prefill_token_threshold,
        )

    def passes(self, batch: ForwardBatch) -> bool:
        """Whether this batch may split (its own threshold; an idle batch never)."""
        mode = batch.forward_mode
        if not self.enabled or mode not in (ForwardMode.EXTEND, ForwardMode.DECODE):
            return False
        threshold = (
            self.prefill_token_threshold if mode.is_extend() else self.decode_token_threshold
        )
        return batch.num_tokens >= threshold


def uniform_split_token(num_tokens: Sequence[int]) -> int | None:
    """The split token of every group (``num_tokens``: each group's tokens, all of which
    passed their threshold), or None when some group's second micro-batch would be empty."""
    half = max(num_tokens, default=0) // 2
    if half == 0 or any(n <= half for n in num_tokens):
        return None
    return half


def place_split(batch: ForwardBatch, token: int) -> None:
    """Set the batch's split at ``token`` (0 < token < its tokens): the first sequence of the
    second micro-batch (with a cut, the sequence that is cut)."""
    if not 0 < token < batch.num_tokens:
        raise ValueError(f"a split at token {token} of a {batch.num_tokens}-token batch")
    seq = token
    if batch.forward_mode.is_extend():  # the sequence holding the token
        ends = list(itertools.accumulate(batch.extend_seq_lens_cpu))
        seq = next(i for i, end in enumerate(ends) if end > token)
    batch.tbo_split_seq_index, batch.tbo_split_token_index = seq, token


def plan_dual_batch_overlap(batch: ForwardBatch, config: DboConfig) -> None:
    """This rank's proposal, as ``plan_two_batch_overlap``'s: a split at half its tokens when
    its threshold passes (None otherwise), and ``can_run_tbo`` (whether the step runs split:
    without DP attention this rank decides; under DP attention ``apply_dp_sync`` replaces the
    split by the uniform one, or clears it)."""
    batch.tbo_split_seq_index = batch.tbo_split_token_index = None
    batch.can_run_tbo = False
    if not config.passes(batch):
        return
    token = uniform_split_token([batch.num_tokens])
    if token is None:
        return
    place_split(batch, token)
    batch.can_run_tbo = True


def agree_dual_batch_overlap(rows: Sequence[tuple[int, bool]]) -> int | None:
    """The DP decision over ``(num_tokens, proposes)`` per group: the uniform split token, or
    None (no group splits)."""
    if not rows or not all(proposes for _, proposes in rows):
        return None
    return uniform_split_token([n for n, _ in rows])
