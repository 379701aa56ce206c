"""DP attention: padding modes (SGLang's examples and the edges of the MAX_LEN rule), the MLP
sync's global mode and padding, LM-head row counts, attention-TP chunks, the IDLE forward."""

from __future__ import annotations

import pytest
import torch

from srt.distributed.parallel_state import ParallelState
from srt.layers.dp_attention import DpPaddingMode, attn_tp_chunk, chunk_sizes, dp_buffer_len
from srt.layers.logits_processor import num_logit_rows
from srt.model_executor.dp_sync import SyncRow, apply_dp_sync, dp_sync_info, sync_dp_batch
from srt.model_executor.forward_batch_info import NO_SPLIT, ForwardBatch, ForwardMode
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs


@pytest.mark.parametrize(
    "is_extend, tokens, expected",
    [
        (False, [8, 7, 6, 0], DpPaddingMode.MAX_LEN),  # SGLang's example: decode
        (True, [8192, 0, 0, 0, 0, 0, 0, 0], DpPaddingMode.SUM_LEN),  # SGLang's example: extend
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


# ---------------------------------------------------------------------------------- MLP sync
def _batch(mode: ForwardMode, lens: list[int], logprob_starts: list[int] | None = None):
    num_tokens = sum(lens) if mode.is_extend() else len(lens)
    ids = torch.zeros(num_tokens, dtype=torch.int64)
    batch = ForwardBatch(mode, len(lens), ids, ids, ids, ids, lens, ids, None, None)
    if mode.is_extend():
        batch.extend_seq_lens_cpu = lens
    if logprob_starts is not None:
        batch.return_logprob, batch.extend_logprob_start_lens_cpu = True, logprob_starts
    return batch


IDLE, EXTEND, DECODE = (int(m) for m in (ForwardMode.IDLE, ForwardMode.EXTEND, ForwardMode.DECODE))


@pytest.mark.parametrize(
    "rows, attn_tp, mode, padding, buffer_len",
    [
        (
            [[0, 0, 0, IDLE, 0, 0], [0, 0, 0, IDLE, 0, 0]],
            1,
            ForwardMode.IDLE,
            DpPaddingMode.MAX_LEN,
            0,
        ),
        (
            [[7, 2, 1, EXTEND, 0, 0], [0, 0, 0, IDLE, 0, 0]],
            2,
            ForwardMode.EXTEND,
            DpPaddingMode.SUM_LEN,
            8,
        ),
        (
            [[7, 2, 1, EXTEND, 0, 0], [3, 3, 0, DECODE, 0, 0]],
            2,
            ForwardMode.EXTEND,
            DpPaddingMode.SUM_LEN,
            12,
        ),
        (
            [[3, 3, 0, DECODE, 0, 0], [2, 2, 0, DECODE, 0, 0]],
            2,
            ForwardMode.DECODE,
            DpPaddingMode.MAX_LEN,
            8,
        ),
        (
            [[3, 3, 0, DECODE, 0, 0], [0, 0, 0, IDLE, 0, 0]],
            1,
            ForwardMode.DECODE,
            DpPaddingMode.MAX_LEN,
            6,
        ),
    ],
)
def test_sync_info_global_mode_and_padding(rows, attn_tp, mode, padding, buffer_len):
    info = dp_sync_info(rows, attn_tp)
    assert info.global_num_tokens == [r[0] for r in rows]
    assert info.global_num_tokens_for_logprob == [r[1] for r in rows]
    assert info.global_forward_mode is mode and info.all_idle == mode.is_idle()
    assert info.is_extend_in_batch == mode.is_extend()
    assert (info.padding_mode, info.global_dp_buffer_len) == (padding, buffer_len)


def test_sync_on_one_rank_and_apply():
    parallel = ParallelState.single_rank()
    assert sync_dp_batch(parallel, None).all_idle
    batch = _batch(ForwardMode.EXTEND, [4, 3], logprob_starts=[1, 3])
    assert SyncRow.of(batch) == SyncRow(7, 5, 1, int(ForwardMode.EXTEND), 0, 0)
    info = sync_dp_batch(parallel, batch)
    assert info.global_num_tokens == [7]
    assert info.global_num_tokens_for_logprob == [2 + 3]  # last tokens + rows 1..3 of seq 0
    assert batch.global_num_tokens() == [7] and batch.global_is_extend()  # local before apply
    apply_dp_sync(batch, info, NO_SPLIT)
    assert batch.global_num_tokens_cpu == [7] and batch.global_forward_mode is ForwardMode.EXTEND
    assert batch.is_extend_in_batch and batch.dp_padding_mode is DpPaddingMode.SUM_LEN
    assert batch.global_dp_buffer_len == 7


def test_decode_follows_the_global_extend():
    batch = _batch(ForwardMode.DECODE, [5, 6])
    assert not batch.global_is_extend()
    rows = [[2, 2, 0, DECODE, 0, 0], [9, 1, 1, EXTEND, 0, 0]]
    apply_dp_sync(batch, dp_sync_info(rows, 1), NO_SPLIT)
    assert batch.global_is_extend() and batch.global_num_tokens() == [2, 9]


def test_num_logit_rows():
    assert num_logit_rows(_batch(ForwardMode.DECODE, [5, 6, 7])) == 3
    assert num_logit_rows(_batch(ForwardMode.EXTEND, [5, 6, 7])) == 3
    assert num_logit_rows(_batch(ForwardMode.EXTEND, [5, 6], logprob_starts=[0, 6])) == 2 + 5
    idle = ForwardBatch.idle(None, None, torch.device("cpu"))
    assert (idle.forward_mode, idle.batch_size, idle.num_tokens) == (ForwardMode.IDLE, 0, 0)
    assert num_logit_rows(idle) == 0


@pytest.mark.parametrize(
    "num_tokens, attn_tp, sizes",
    [
        (5, 2, [3, 2]),
        (1, 2, [1, 0]),
        (0, 4, [0, 0, 0, 0]),
        (8, 4, [2, 2, 2, 2]),
        (5, 4, [2, 2, 1, 0]),
    ],
)
def test_attention_tp_chunks(num_tokens, attn_tp, sizes):
    assert chunk_sizes(num_tokens, attn_tp) == sizes
    rows = torch.arange(num_tokens)
    chunks = [attn_tp_chunk(rows, r, attn_tp) for r in range(attn_tp)]
    assert [len(c) for c in chunks] == sizes
    assert torch.equal(torch.cat(chunks), rows)


def test_idle_forward_and_sample(qwen3_moe_path):
    runner = ModelRunner(
        ServerArgs(model_path=qwen3_moe_path, dtype="float32", max_total_tokens=64)
    )
    idle = ForwardBatch.idle(runner.req_to_token_pool, runner.token_to_kv_pool, runner.device)
    out = runner.forward(idle)
    assert out.next_token_logits.shape == (0, runner.model_config.vocab_size)
    assert runner.sample(out, idle).shape == (0,)
    assert runner.forward_step(None) is None  # no batch and no DP attention: nothing runs
