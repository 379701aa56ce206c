"""Two-batch overlap: where to split a batch into two micro-batches (SGLang's rules, names and
keywords, see REFERENCE.md).

- Decode and target-verify split the sequences in half (each sequence has the same number of
  tokens: 1, or the draft length).
- Extend uses the balanced split (the sequence boundary minimising |left − right| tokens) unless
  its left share falls outside ``[threshold, 1 − threshold]``; then the two-chunk split cuts the
  sequence that straddles the middle token, so both children get half the tokens: child A keeps
  the first part of that sequence, child B continues it with a longer prefix.
- ``token_distribution_threshold`` is ``--tbo-token-distribution-threshold`` (0 turns the
  two-chunk split off). It is an explicit argument: no global server-args dictionary.
"""

from __future__ import annotations

from collections.abc import Sequence

from srt.model_executor.forward_batch_info import ForwardMode

DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD = 0.48


def compute_split_seq_index(
    forward_mode: ForwardMode,
    num_tokens: int,
    extend_lens: Sequence[int] | None,
    token_num_per_seq: int | None,
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
) -> int:
    """The first sequence of child B (with the two-chunk split, the sequence that is cut)."""
    if forward_mode == ForwardMode.EXTEND:
        if extend_lens is None:
            raise ValueError("an extend split needs extend_lens")
        if is_two_chunk_split_enabled(extend_lens, token_distribution_threshold):
            return _split_array_by_cum_less_than_half(extend_lens)
        return _split_array_by_balanced_sum(extend_lens)
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        if not token_num_per_seq:
            raise ValueError(f"a {forward_mode.name} split needs token_num_per_seq")
        return (num_tokens // token_num_per_seq) // 2
    if forward_mode.is_idle():
        if num_tokens:
            raise ValueError(f"an IDLE batch has no tokens, got {num_tokens}")
        return 0
    raise ValueError(f"two-batch overlap cannot split a {forward_mode.name} batch")


def compute_split_token_index(
    split_seq_index: int,
    forward_mode: ForwardMode,
    extend_seq_lens: Sequence[int] | None,
    token_num_per_seq: int | None,
    token_distribution_threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD,
) -> int:
    """The first token of child B."""
    if forward_mode == ForwardMode.EXTEND:
        if extend_seq_lens is None:
            raise ValueError("an extend split needs extend_seq_lens")
        if is_two_chunk_split_enabled(extend_seq_lens, token_distribution_threshold):
            return sum(extend_seq_lens) // 2
        return sum(extend_seq_lens[:split_seq_index])
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        return split_seq_index * token_num_per_seq
    if forward_mode.is_idle():
        if split_seq_index:
            raise ValueError(f"an IDLE batch splits at 0, got {split_seq_index}")
        return 0
    raise ValueError(f"two-batch overlap cannot split a {forward_mode.name} batch")


def is_two_chunk_split_enabled(extend_lens: Sequence[int], threshold: float) -> bool:
    """Whether the balanced split is too lopsided, so one sequence must be cut in two. Not when
    child A would hold more sequences than tokens (every sequence needs at least one)."""
    if not 0 <= threshold <= 0.5:
        raise ValueError(f"--tbo-token-distribution-threshold {threshold} must be in [0, 0.5]")
    if threshold == 0 or not extend_lens:
        return False
    total = sum(extend_lens)
    left = sum(extend_lens[: _split_array_by_balanced_sum(extend_lens)])
    if threshold * total <= left <= (1 - threshold) * total:
        return False
    return _split_array_by_cum_less_than_half(extend_lens) + 1 <= total // 2


def _split_array_by_balanced_sum(lens: Sequence[int]) -> int:
    """Index i in 1..len-1 minimising |sum(lens[:i]) − sum(lens[i:])|; ties go to the later
    index and the scan stops at the first increase. 0 when there is at most one sequence."""
    total, left, best, best_diff = sum(lens), 0, 0, None
    for i in range(1, len(lens)):
        left += lens[i - 1]
        diff = abs(2 * left - total)
        if best_diff is not None and diff > best_diff:
            break
        best, best_diff = i, diff
    return best


def _split_array_by_cum_less_than_half(lens: Sequence[int]) -> int:
    """The first index whose inclusive prefix sum exceeds half the tokens."""
    half, left = sum(lens) // 2, 0
    for i, n in enumerate(lens):
        left += n
        if left > half:
            return i
    return 0
