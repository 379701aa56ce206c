"""TBO split indices: the cases of SGLang's own unit test and edge cases."""

from __future__ import annotations

import pytest

from srt.batch_overlap.two_batch_overlap import (
    compute_split_seq_index,
    compute_split_token_index,
    is_two_chunk_split_enabled,
)
from srt.model_executor.forward_batch_info import ForwardMode


def split(mode: ForwardMode, lens=None, num_tokens=0, per_seq=None, threshold=0.48):
    num_tokens = sum(lens) if lens is not None else num_tokens
    seq = compute_split_seq_index(
        forward_mode=mode,
        num_tokens=num_tokens,
        extend_lens=lens,
        token_num_per_seq=per_seq,
        token_distribution_threshold=threshold,
    )
    token = compute_split_token_index(
        split_seq_index=seq,
        forward_mode=mode,
        extend_seq_lens=lens,
        token_num_per_seq=per_seq,
        token_distribution_threshold=threshold,
    )
    return seq, token


@pytest.mark.parametrize("num_tokens, expected", [(0, (0, 0)), (100, (50, 50)), (99, (49, 49))])
def test_decode_reference(num_tokens, expected):
    assert split(ForwardMode.DECODE, num_tokens=num_tokens, per_seq=1) == expected


@pytest.mark.parametrize(
    "lens, expected",
    [
        ([], (0, 0)),
        ([42], (0, 21)),
        ([42, 999], (1, 520)),
        ([4096] * 4, (2, 8192)),
        ([1, 4095, 4096, 4096, 4096], (3, 8192)),
        ([1, 1, 1, 1, 99999], (4, 50001)),
    ],
)
def test_extend_reference(lens, expected):
    assert split(ForwardMode.EXTEND, lens) == expected


def test_target_verify_splits_whole_drafts():
    assert split(ForwardMode.TARGET_VERIFY, num_tokens=5 * 4, per_seq=4) == (2, 8)


def test_idle_and_one_sequence():
    assert split(ForwardMode.IDLE) == (0, 0)
    assert split(ForwardMode.EXTEND, [1]) == (0, 0)  # one token: nothing to cut
    assert split(ForwardMode.DECODE, num_tokens=1, per_seq=1) == (0, 0)


def test_balanced_split_ties_go_to_the_later_index():
    assert split(ForwardMode.EXTEND, [3, 2, 2, 3]) == (2, 5)
    assert split(ForwardMode.EXTEND, [2, 1, 1, 2]) == (2, 3)
    assert split(ForwardMode.EXTEND, [6, 1, 6, 1]) == (2, 7)  # the scan stops at the increase


def test_one_huge_sequence_among_short_ones_is_cut():
    lens = [10, 3000, 10, 10]
    seq, token = split(ForwardMode.EXTEND, lens)
    assert (seq, token) == (1, 1515)  # the long sequence straddles the middle token


def test_threshold_zero_disables_the_two_chunk_split():
    assert split(ForwardMode.EXTEND, [42, 999], threshold=0) == (1, 42)
    assert split(ForwardMode.EXTEND, [42], threshold=0) == (0, 0)
    assert not is_two_chunk_split_enabled([42, 999], 0)


def test_no_two_chunk_split_when_child_a_would_have_more_sequences_than_tokens():
    # the cut sequence would be the third: A would hold 3 sequences but only 2 tokens
    assert (
        not is_two_chunk_split_enabled([1, 1, 2, 0, 0], 0.48)
        or split(ForwardMode.EXTEND, [1, 1, 2, 0, 0])[1] >= 3
    )


def test_bad_inputs():
    with pytest.raises(ValueError, match="must be in"):
        is_two_chunk_split_enabled([1, 2], 0.6)
    with pytest.raises(ValueError, match="MIXED"):
        split(ForwardMode.MIXED, [1, 2])
    with pytest.raises(ValueError, match="token_num_per_seq"):
        split(ForwardMode.DECODE, num_tokens=4)
