"""Two-batch overlap on one batch: the local proposal and its thresholds, the children (with
the two-chunk fix-ups and the DP fields), the DP agreement, the flags' validation."""

from __future__ import annotations

import pytest
import torch
from helpers.forward_batches import extend_batch

from srt.batch_overlap.step_split import SplitConfig, plan_split, settle_split
from srt.batch_overlap.two_batch_overlap import agree_two_batch_overlap, split_forward_batch
from srt.layers.dp_attention import DpPaddingMode
from srt.model_executor.dp_sync import apply_dp_sync, dp_sync_info
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.server_args import ServerArgs

ALWAYS = SplitConfig("tbo", decode_token_threshold=0, prefill_token_threshold=0)


def planned(batch: ForwardBatch, config: SplitConfig = ALWAYS) -> ForwardBatch:
    """``batch`` with its own proposal as the step's split (the step runs TBO)."""
    batch.split = plan_split(batch, config)
    return batch


def decode_batch(bs: int) -> ForwardBatch:
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=bs,
        input_ids=torch.arange(bs),
        positions=torch.arange(bs) + 7,
        req_pool_indices=torch.arange(bs),
        seq_lens=torch.arange(bs) + 8,
        seq_lens_cpu=list(range(8, 8 + bs)),
        out_cache_loc=torch.arange(bs),
        req_to_token_pool=None,
        token_to_kv_pool=None,
    )


def test_thresholds_decide_locally():
    config = SplitConfig("tbo", decode_token_threshold=32, prefill_token_threshold=512)
    for batch, splits in ((decode_batch(31), False), (decode_batch(32), True)):
        assert (plan_split(batch, config) is not None) is splits
    small, large = extend_batch([0, 0], [200, 311]), extend_batch([0, 0], [200, 312])
    for batch, splits in ((small, False), (large, True)):
        assert (plan_split(batch, config) is not None) is splits
    assert plan_split(extend_batch([0, 0], [600, 600]), SplitConfig(None)) is None


def test_a_batch_whose_child_would_be_empty_does_not_split():
    assert plan_split(decode_batch(1), ALWAYS) is None
    assert plan_split(extend_batch([0], [1]), ALWAYS) is None
    no_cut = extend_batch([0], [40])  # threshold 0: no two-chunk split of one sequence
    assert plan_split(no_cut, SplitConfig("tbo", 0, 0, token_distribution_threshold=0)) is None


def test_decode_children_halve_the_sequences():
    batch = planned(decode_batch(5))
    a, b = split_forward_batch(batch, attn_tp_size=2)
    assert (a.batch_size, b.batch_size) == (2, 3)
    assert a.seq_lens_cpu == [8, 9] and b.seq_lens_cpu == [10, 11, 12]
    assert b.positions.tolist() == [9, 10, 11] and b.out_cache_loc.tolist() == [2, 3, 4]
    assert (a.tbo_subbatch_index, b.tbo_subbatch_index) == (0, 1)
    assert (a.tbo_parent_token_range, b.tbo_parent_token_range) == ((0, 2), (2, 5))
    assert a.global_forward_mode == ForwardMode.DECODE


def test_two_chunk_children_cut_the_long_sequence():
    """[3 (prefix 2), 40 (prefix 5), 2]: the balanced split leaves 3 of 45 tokens left, so the
    40-token sequence is cut at the middle token (22): A keeps its first 19 new tokens, B
    continues it with a prefix of 5 + 19."""
    batch = planned(extend_batch([2, 5, 0], [3, 40, 2]))
    assert (batch.split.mode, batch.split.seq_index, batch.split.token_index) == ("tbo", 1, 22)
    a, b = split_forward_batch(batch, attn_tp_size=1)
    assert a.extend_seq_lens_cpu == [3, 19] and a.extend_prefix_lens_cpu == [2, 5]
    assert a.seq_lens_cpu == [5, 24] and a.seq_lens.tolist() == [5, 24]
    assert b.extend_seq_lens_cpu == [21, 2] and b.extend_prefix_lens_cpu == [24, 0]
    assert b.seq_lens_cpu == [45, 2]
    assert a.req_pool_indices.tolist() == [10, 11] and b.req_pool_indices.tolist() == [11, 12]
    assert b.positions[0].item() == 24  # the cut sequence goes on where A stopped
    assert torch.equal(torch.cat([a.input_ids, b.input_ids]), batch.input_ids)
    assert torch.equal(torch.cat([a.out_cache_loc, b.out_cache_loc]), batch.out_cache_loc)


def test_children_get_their_own_dp_fields():
    """Two groups: this one (5 decode tokens, split 2 | 3) and one with 9 (split 4 | 5)."""
    rows = [[5, 5, 0, int(ForwardMode.DECODE), 1, 2], [9, 9, 0, int(ForwardMode.DECODE), 1, 4]]
    info = dp_sync_info(rows, attn_tp_size=1, split_rule="tbo")
    assert info.split_tokens == [2, 4]
    batch = decode_batch(5)
    proposal = plan_split(batch, ALWAYS)
    apply_dp_sync(batch, info, settle_split("tbo", batch, proposal, info.split_tokens))
    a, b = split_forward_batch(batch, attn_tp_size=1)
    assert a.global_num_tokens_cpu == [2, 4] and b.global_num_tokens_cpu == [3, 5]
    assert a.dp_padding_mode == DpPaddingMode.MAX_LEN and a.global_dp_buffer_len == 8
    assert b.global_dp_buffer_len == 10


def test_an_idle_rank_splits_into_two_empty_children():
    rows = [[0, 0, 0, int(ForwardMode.IDLE), 0, 0], [40, 2, 1, int(ForwardMode.EXTEND), 1, 20]]
    info = dp_sync_info(rows, attn_tp_size=1, split_rule="tbo")
    assert info.can_split
    idle = ForwardBatch.idle(None, None, torch.device("cpu"))
    apply_dp_sync(idle, info, settle_split("tbo", idle, None, info.split_tokens))
    a, b = split_forward_batch(idle, attn_tp_size=1)
    assert a.num_tokens == b.num_tokens == 0
    assert a.forward_mode == b.forward_mode == ForwardMode.IDLE
    assert a.global_forward_mode == ForwardMode.EXTEND  # follows the others' strategy
    assert a.global_num_tokens_cpu == [0, 20] and b.global_num_tokens_cpu == [0, 20]


def test_dp_agreement_is_unanimous():
    E, D, I = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.IDLE  # noqa: E741
    assert agree_two_batch_overlap([(D, True), (D, True)])
    assert not agree_two_batch_overlap([(D, True), (D, False)])  # one below its threshold
    assert not agree_two_batch_overlap([(E, True), (D, True)])  # modes differ
    assert agree_two_batch_overlap([(E, True), (I, False)])  # idle follows
    assert not agree_two_batch_overlap([(I, False), (I, False)])  # all idle


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap needs an all-to-all"),
        (dict(tbo_token_distribution_threshold=0.6), "--tbo-token-distribution-threshold"),
        (dict(tbo_decode_token_threshold=-1), "--tbo-decode-token-threshold"),
        (dict(tbo_prefill_token_threshold=-5), "--tbo-prefill-token-threshold"),
    ],
)
def test_invalid_flags_are_refused(qwen3_moe_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path=qwen3_moe_path, device="cpu", **kwargs)


def test_tbo_with_dp_attention_and_no_all_to_all_is_accepted(qwen3_moe_path):
    args = ServerArgs(
        model_path=qwen3_moe_path,
        device="cpu",
        tp_size=2,
        dp_size=2,
        enable_dp_attention=True,
        enable_two_batch_overlap=True,
    )
    assert args.enable_two_batch_overlap
