"""Dual-batch overlap's decisions: vLLM's thresholds at their edges, the uniform DP rule (split
at half the largest group's tokens; nobody splits when a group's second micro-batch would be
empty), where the split falls in a batch, and the flags."""

from __future__ import annotations

import pytest
import torch

from srt.batch_overlap.dual_batch_overlap import (
    agree_dual_batch_overlap,
    split_at_token,
    uniform_split_token,
)
from srt.batch_overlap.step_split import SplitConfig, plan_split
from srt.batch_overlap.two_batch_overlap import split_forward_batch
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.server_args import ServerArgs


def batch(lens: list[int], extend: bool) -> ForwardBatch:
    n = sum(lens) if extend else len(lens)
    extra = dict(extend_prefix_lens_cpu=[2] * len(lens), extend_seq_lens_cpu=list(lens))
    seq_lens = [2 + n for n in lens] if extend else list(lens)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE,
        batch_size=len(lens), input_ids=torch.arange(n), positions=torch.arange(n),
        req_pool_indices=torch.arange(len(lens)), seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=seq_lens, out_cache_loc=torch.arange(n), req_to_token_pool=None,
        token_to_kv_pool=None, **(extra if extend else {}),
    )  # fmt: skip


@pytest.mark.parametrize(
    "lens, extend, splits",
    [
        ([1] * 31, False, False),  # one under the decode threshold (32)
        ([1] * 32, False, True),
        ([511], True, False),  # one under the prefill threshold (512)
        ([512], True, True),
        ([300, 211], True, False),
    ],
)
def test_thresholds_edges(lens, extend, splits):
    b = batch(lens, extend)
    split = plan_split(b, SplitConfig("dbo"))
    assert (split is not None) == splits
    if splits:
        assert split.mode == "dbo" and split.token_index == b.num_tokens // 2


def test_off_never_splits():
    assert plan_split(batch([1] * 64, False), SplitConfig(None)) is None


@pytest.mark.parametrize(
    "rows, token",
    [
        ([(10, True), (7, True)], 5),  # both keep tokens past half the largest (5)
        ([(10, True), (5, True)], None),  # 5 ≤ 5: its second micro-batch would be empty
        ([(10, True), (0, False)], None),  # an idle group
        ([(10, True), (9, False)], None),  # one group under its threshold
        ([(1, True), (1, True)], None),  # half of 1 is 0
        ([(8, True)] * 4, 4),
        ([], None),
    ],
)
def test_uniform_rule(rows, token):
    assert agree_dual_batch_overlap(rows) == token


def test_uniform_split_token_is_padding_free():
    assert uniform_split_token([7, 4]) == 3  # vLLM pads to 7 and cuts at 3: 4 - 3 = 1 token left


def test_split_at_token_cuts_a_prompt_where_the_token_falls():
    b = batch([3, 4, 2], True)
    b.split = split_at_token(b, 5)  # inside the second prompt
    assert (b.split.seq_index, b.split.token_index) == (1, 5)
    a, c = split_forward_batch(b, 1)
    assert a.extend_seq_lens_cpu == [3, 2] and c.extend_seq_lens_cpu == [2, 2]
    assert c.extend_prefix_lens_cpu == [4, 2] and a.seq_lens_cpu == [5, 4]
    b.split = split_at_token(b, 3)  # on a boundary: no cut
    assert (b.split.seq_index, b.split.token_index) == (1, 3)
    a, c = split_forward_batch(b, 1)
    assert a.extend_seq_lens_cpu == [3] and c.extend_seq_lens_cpu == [4, 2]
    with pytest.raises(ValueError, match="a split at token 9 of a 9-token batch"):
        split_at_token(b, 9)


def test_children_carry_the_mode():
    b = batch([1] * 4, False)
    b.split = plan_split(b, SplitConfig("dbo", 0, 0))
    assert [c.split.mode for c in split_forward_batch(b, 1)] == ["dbo", "dbo"]


def make_args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="unused", device="cpu", **kwargs)


def test_flags():
    a2a = dict(tp_size=2, moe_a2a_backend="torch")
    args = make_args(enable_dbo=True, **a2a)
    assert args.overlap_mode == "dbo" and args.overlap_modes == ("dbo",)
    assert (args.dbo_decode_token_threshold, args.dbo_prefill_token_threshold) == (32, 512)
    args = make_args(overlap_mode="dbo", **a2a)
    assert args.enable_dbo and not args.enable_two_batch_overlap
    assert "dbo" not in make_args(overlap_mode="auto", **a2a).overlap_modes


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(enable_dbo=True, tp_size=2), "--enable-dbo needs an all-to-all between ranks"),
        (dict(enable_dbo=True, moe_a2a_backend="torch"), "--tp-size > 1"),
        (dict(enable_dbo=True, enable_two_batch_overlap=True, tp_size=2, moe_a2a_backend="torch"),
         "--enable-two-batch-overlap and --enable-dbo exclude each other"),
        (dict(overlap_mode="tbo", enable_dbo=True, tp_size=2, moe_a2a_backend="torch"),
         "--overlap-mode tbo and --enable-dbo"),
        (dict(dbo_decode_token_threshold=-1), "--dbo-decode-token-threshold: must be ≥ 0"),
    ],
)  # fmt: skip
def test_flag_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_args(**kwargs)
