"""DP padding modes: REFERENCE.md's cases and the edges of the MAX_LEN rule."""

from __future__ import annotations

import pytest

from srt.layers.dp_attention import DpPaddingMode, dp_buffer_len


@pytest.mark.parametrize(
    "is_extend, tokens, expected",
    [
        (False, [8, 7, 6, 0], DpPaddingMode.MAX_LEN),  # REFERENCE: decode
        (True, [8192, 0, 0, 0, 0, 0, 0, 0], DpPaddingMode.SUM_LEN),  # REFERENCE: extend
        (True, [4, 4, 4, 4], DpPaddingMode.SUM_LEN),  # any extend → SUM_LEN
        (False, [8, 0, 0, 0], DpPaddingMode.SUM_LEN),  # 2·8 < 8·4: padding would waste most
        (False, [8, 8, 0, 0], DpPaddingMode.MAX_LEN),  # 2·16 == 8·4: the boundary is MAX_LEN
        (False, [0, 0, 0, 0], DpPaddingMode.MAX_LEN),  # all idle
    ],
)
def test_padding_mode(is_extend, tokens, expected):
    assert DpPaddingMode.choose(is_extend, tokens) is expected


def test_buffer_len_rounds_each_rank_to_attn_tp_size():
    assert dp_buffer_len(DpPaddingMode.MAX_LEN, [8, 7, 6, 0], 1) == 32
    assert dp_buffer_len(DpPaddingMode.MAX_LEN, [5, 3], 2) == 12  # 6 per rank
    assert dp_buffer_len(DpPaddingMode.SUM_LEN, [5, 3, 0], 4) == 12  # 8 + 4 + 0
    assert dp_buffer_len(DpPaddingMode.SUM_LEN, [], 2) == 0
