"""DetokenizerManager (incremental, surrogate-safe, stop trimming) and GenerateReqInput."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from srt.managers.detokenizer import DetokenizerManager
from srt.managers.io_struct import BatchTokenIDOutput, GenerateReqInput

TEXT = "héllo 你好 🙂 wörld"


def _msg(
    rid: str, ids: list[int], finished: dict | None = None, skip: bool = True, trim: bool = True
):
    return BatchTokenIDOutput(
        rids=[rid],
        finished_reasons=[finished],
        output_ids=[ids],
        skip_special_tokens=[skip],
        spaces_between_special_tokens=[True],
        no_stop_trim=[not trim],
        prompt_tokens=[1],
        completion_tokens=[len(ids)],
        cached_tokens=[0],
    )


@pytest.fixture(scope="module")
def tokenizer(qwen3_moe_path):
    return AutoTokenizer.from_pretrained(qwen3_moe_path)


def test_incremental_never_emits_partial_characters(tokenizer):
    detok = DetokenizerManager(tokenizer)
    ids = tokenizer.encode(TEXT)
    texts = []
    for i, tid in enumerate(ids):
        last = i == len(ids) - 1
        finished = {"type": "length", "length": len(ids)} if last else None
        texts.append(detok.handle_batch_token_id_out(_msg("a", [tid], finished)).output_strs[0])
    assert all("\ufffd" not in t for t in texts)
    assert all(TEXT.startswith(t) for t in texts)
    assert texts[-1] == TEXT and "a" not in detok.decode_status


def test_stop_string_and_stop_token_trimmed(tokenizer):
    detok = DetokenizerManager(tokenizer)
    ids = tokenizer.encode("hello world, and more")
    out = detok.handle_batch_token_id_out(_msg("s", ids, {"type": "stop", "matched": "world"}))
    assert out.output_strs == ["hello "]
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    msg = _msg("t", ids[:2] + [eos], {"type": "stop", "matched": eos}, skip=False)
    assert detok.handle_batch_token_id_out(msg).output_strs == [tokenizer.decode(ids[:2])]


def test_skip_special_tokens(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = tokenizer.encode("hi") + [eos] + tokenizer.encode(" there")
    done = {"type": "length", "length": len(ids)}
    detok = DetokenizerManager(tokenizer)
    assert (
        "<|endoftext|>" not in detok.handle_batch_token_id_out(_msg("u", ids, done)).output_strs[0]
    )
    kept = detok.handle_batch_token_id_out(_msg("v", ids, done, skip=False)).output_strs[0]
    assert "<|endoftext|>" in kept


def test_generate_req_input_normalize():
    single = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 3})
    single.normalize_batch_and_arguments()
    assert single.is_single and single.batch_size == 1
    item = single[0]
    assert item.text == "hi" and item.logprob_start_len == -1 and item.top_logprobs_num == 0
    batch = GenerateReqInput(input_ids=[[1, 2], [3]], return_logprob=[True, False])
    batch.normalize_batch_and_arguments()
    assert not batch.is_single and batch[1].input_ids == [3] and batch[0].return_logprob
    assert batch[0].rid != batch[1].rid


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({}, "exactly one"),
        ({"text": "a", "input_ids": [1]}, "exactly one"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
        ({"text": 5}, "text"),
        ({"input_ids": [1, "x"]}, "input_ids"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"text": ["a", "b"], "rid": ["x", "x"]}, "rid"),
    ],
)
def test_generate_req_input_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GenerateReqInput(**kwargs).normalize_batch_and_arguments()
