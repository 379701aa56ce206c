"""``mla_attention_parts``: an extend batch's prompts and its one-token rows after a prefix
(a MIXED batch's decoding requests) as two parts, expanded and absorbed (the end-to-end check,
MLA's logprobs in MIXED steps, is in test/managers/test_scheduler.py)."""

from __future__ import annotations

from helpers.forward_batches import extend_batch

from srt.model_executor.forward_batch_info import ForwardMode, mla_attention_parts


def test_the_trailing_one_token_rows_become_a_decode_batch():
    # A prompt's one-token chunk after its prefix (the second row) attends as a decoding
    # request does: it joins the decode part.
    batch = extend_batch([0, 4, 9, 4], [6, 1, 1, 1], ForwardMode.MIXED)
    (extend, e0, e1, e_absorbed), (decode, d0, d1, d_absorbed) = mla_attention_parts(batch, False)
    assert (e0, e1, e_absorbed, d0, d1, d_absorbed) == (0, 6, False, 6, 9, True)
    assert extend.forward_mode == ForwardMode.EXTEND and decode.forward_mode == ForwardMode.DECODE
    assert extend.batch_size == 1 and extend.num_tokens == 6
    assert extend.extend_prefix_lens_cpu == [0] and extend.extend_seq_lens_cpu == [6]
    assert decode.batch_size == 3 and decode.seq_lens_cpu == [5, 10, 5]
    assert decode.input_ids.tolist() == [106, 107, 108]
    assert decode.out_cache_loc.tolist() == [1006, 1007, 1008]
    assert decode.positions.tolist() == [4, 9, 4]
    assert decode.req_pool_indices.tolist() == [11, 12, 13]
    assert decode.seq_lens.tolist() == [5, 10, 5]


def test_all_one_token_rows_attend_as_decode():
    """Prompts that the radix cache holds but for their last token: no EXTEND part."""
    batch = extend_batch([5, 6], [1, 1], ForwardMode.EXTEND)
    ((decode, start, end, absorbed),) = mla_attention_parts(batch, False)
    assert (start, end, absorbed) == (0, 2, True)
    assert decode.forward_mode == ForwardMode.DECODE and decode is not batch
    assert decode.batch_size == 2 and decode.seq_lens_cpu == [6, 7]


def test_no_split_without_a_one_token_tail():
    for prefix, new in (([3, 0], [4, 1]), ([0, 2], [3, 2])):
        batch = extend_batch(prefix, new, ForwardMode.MIXED)
        ((part, start, end, absorbed),) = mla_attention_parts(batch, False)
        assert part is batch and (start, end, absorbed) == (0, batch.num_tokens, False)


def test_decode_and_absorbing_backends_attend_whole_and_absorbed():
    batch = extend_batch([0, 4], [6, 1], ForwardMode.MIXED)
    ((part, _, _, absorbed),) = mla_attention_parts(batch, absorbed_extend=True)
    assert part is batch and absorbed
    ((part, _, _, absorbed),) = mla_attention_parts(batch, False, split=False)
    assert part is batch and not absorbed
