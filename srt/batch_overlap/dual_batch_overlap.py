"""Dual-batch overlap (DBO, vLLM's design): whether and where a step splits in two
micro-batches. The threads that run them are ``srt.batch_overlap.ubatching``; the children are
two-batch overlap's (``split_forward_batch``), so attention metadata, DP buffer lengths and the
dispatcher of each micro-batch are shared with TBO.

Whether (vLLM's rule): a batch splits only if it holds at least ``--dbo-decode-token-threshold``
tokens (a decode batch) or ``--dbo-prefill-token-threshold`` (a batch with a prefill); the
threshold check is every split mode's (``srt.batch_overlap.step_split``). The
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

from srt.model_executor.forward_batch_info import ForwardBatch, StepSplit


def uniform_split_token(num_tokens: Sequence[int]) -> int | None:
    """The split token of every group (``num_tokens``: each group's tokens, all of which
    passed their threshold), or None when some group's second micro-batch would be empty."""
    half = max(num_tokens, default=0) // 2
    if half == 0 or any(n <= half for n in num_tokens):
        return None
    return half


def split_at_token(
    batch: ForwardBatch, token: int, group_tokens: tuple[int, ...] | None = None
) -> StepSplit:
    """The DBO split of ``batch`` at ``token`` (0 < token < its tokens): the first sequence of
    the second micro-batch (with a cut, the sequence that is cut)."""
    if not 0 < token < batch.num_tokens:
        raise ValueError(f"a split at token {token} of a {batch.num_tokens}-token batch")
    seq = token
    if batch.forward_mode.is_extend():  # the sequence holding the token
        ends = list(itertools.accumulate(batch.extend_seq_lens_cpu))
        seq = next(i for i, end in enumerate(ends) if end > token)
    return StepSplit("dbo", seq, token, group_tokens)


def agree_dual_batch_overlap(rows: Sequence[tuple[int, bool]]) -> int | None:
    """The DP decision over ``(num_tokens, proposes)`` per group: the uniform split token, or
    None (no group splits)."""
    if not rows or not all(proposes for _, proposes in rows):
        return None
    return uniform_split_token([n for n, _ in rows])
