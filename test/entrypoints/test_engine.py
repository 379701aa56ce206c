"""srt.Engine end to end on the tiny models (CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import srt

pytestmark = pytest.mark.slow  # starts processes

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def eng(qwen3_moe_path):
    engine = srt.Engine(model_path=qwen3_moe_path, dtype="float32", max_total_tokens=2048)
    yield engine
    engine.shutdown()


def test_shapes_single_and_batch(assert_kv_pool_full, eng):
    out = eng.generate(PROMPT, {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 5}
    assert meta["completion_tokens"] == len(out["output_ids"]) == 5
    assert (
        meta["prompt_tokens"] == len(eng.tokenizer_manager.tokenizer.encode(PROMPT))
        and meta["e2e_latency"] > 0
    )
    outs = eng.generate([PROMPT, "hello"], {"max_new_tokens": 3, "temperature": 0})
    assert isinstance(outs, list) and len(outs) == 2
    assert outs[0]["output_ids"] == out["output_ids"][: len(outs[0]["output_ids"])]
    ids_out = eng.generate(
        input_ids=eng.tokenizer_manager.tokenizer.encode(PROMPT),
        sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert ids_out["output_ids"] == out["output_ids"]
    assert_kv_pool_full(eng)


def test_unknown_server_arg_is_type_error():
    with pytest.raises(TypeError, match="not_a_flag"):
        srt.Engine(not_a_flag=1)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 2.0}, "top_p"),
        ({"max_new_token": 5}, "max_new_token"),
        ({"top_k": "5"}, "top_k"),
    ],
)
def test_bad_sampling_params_raise_before_scheduling(assert_kv_pool_full, eng, params, field):
    with pytest.raises(ValueError, match=field):
        eng.generate([PROMPT, "second"], [{"max_new_tokens": 2}, params])
    assert_kv_pool_full(eng)


def test_bad_request_shapes(assert_kv_pool_full, eng):
    with pytest.raises(ValueError):
        eng.generate(None, {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="sampling_params"):
        eng.generate([PROMPT, "b"], [{"max_new_tokens": 2}])


def test_seeded_sampling_reproducible(assert_kv_pool_full, eng):
    params = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 42, "ignore_eos": True}
    first = eng.generate(PROMPT, params)["output_ids"]
    batch = eng.generate(["other prompt", PROMPT], [{**params, "sampling_seed": 7}, params])
    assert batch[1]["output_ids"] == first
    assert eng.generate(PROMPT, params)["output_ids"] == first


def test_top_k_one_equals_greedy(assert_kv_pool_full, eng):
    greedy = eng.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    top1 = eng.generate(PROMPT, {"max_new_tokens": 8, "top_k": 1, "ignore_eos": True})
    assert top1["output_ids"] == greedy["output_ids"]


def test_stop_string_trimmed(assert_kv_pool_full, eng):
    full = eng.generate(PROMPT, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True})
    text = full["text"]
    stop = text[4:7]
    assert stop.strip(), f"generated text too short: {text!r}"
    out = eng.generate(
        PROMPT, {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True, "stop": [stop]}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.find(stop)]
    assert out["output_ids"] == full["output_ids"][: len(out["output_ids"])]


def test_stop_token_id(assert_kv_pool_full, eng):
    full = eng.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    stop_id = full["output_ids"][3]
    out = eng.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_id]})
    first = full["output_ids"].index(stop_id)
    assert out["output_ids"] == full["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_too_long_input_rejected_and_engine_keeps_working(assert_kv_pool_full, eng):
    info = eng.get_server_info()
    with pytest.raises(ValueError, match="more than the maximum input length"):
        eng.generate(input_ids=[5] * (info["max_req_input_len"] + 1))
    with pytest.raises(ValueError, match="maximum context length"):
        eng.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": info["context_len"]})
    ok = eng.generate(PROMPT, {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert ok["meta_info"]["completion_tokens"] == 2
    assert_kv_pool_full(eng)


@pytest.mark.parametrize("start", [0, 4])
def test_logprobs_match_separate_forward(assert_kv_pool_full, eng, qwen3_moe_path, start):
    prompt = eng.tokenizer_manager.tokenizer.encode(PROMPT)
    eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1})  # cache the prompt
    out = eng.generate(
        input_ids=prompt,
        sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        return_logprob=True,
        logprob_start_len=start,
        top_logprobs_num=3,
    )
    meta, ids = out["meta_info"], out["output_ids"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == len(ids)
    model = AutoModelForCausalLM.from_pretrained(qwen3_moe_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids[:-1]])).logits[0]
    ref = torch.log_softmax(logits.float(), -1)  # row t predicts token t + 1
    for i, (lp, tid, text) in enumerate(meta["output_token_logprobs"]):
        assert tid == ids[i] and text is None
        assert abs(lp - ref[len(prompt) - 1 + i, tid].item()) < 1e-4
    top = meta["output_top_logprobs"][0]
    assert [t[1] for t in top] == ref[len(prompt) - 1].topk(3).indices.tolist()
    inputs = meta["input_token_logprobs"]
    assert [t[1] for t in inputs] == prompt[start:]
    if start == 0:
        assert inputs[0][0] is None and meta["input_top_logprobs"][0] is None
    for j, (lp, tid, _) in enumerate(inputs):
        pos = start + j
        if pos > 0:
            assert abs(lp - ref[pos - 1, tid].item()) < 1e-4
    assert len(meta["input_top_logprobs"]) == len(inputs)
    assert_kv_pool_full(eng)


def test_logprobs_with_chunked_prefill(assert_kv_pool_full, eng, qwen3_moe_path):
    kwargs = {"model_path": qwen3_moe_path, "dtype": "float32", "max_total_tokens": 1024}
    assert eng.flush_cache()  # the plain engine: the prompt is prefilled whole, uncached
    plain, chunked = eng, srt.Engine(**kwargs, chunked_prefill_size=4)
    args = {
        "input_ids": list(range(10, 40)),
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 3,
    }
    a, b = plain.generate(**args), chunked.generate(**args)
    assert a["output_ids"] == b["output_ids"]
    lp_a = [x[0] for x in a["meta_info"]["input_token_logprobs"]]
    lp_b = [x[0] for x in b["meta_info"]["input_token_logprobs"]]
    assert len(lp_a) == 27 and torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), atol=1e-4)
    assert_kv_pool_full(chunked)
    assert_kv_pool_full(plain)
    chunked.shutdown()


def test_flush_cache_and_server_info(assert_kv_pool_full, eng):
    eng.generate(PROMPT, {"max_new_tokens": 2})
    info = eng.get_server_info()
    assert info["internal_states"][0]["num_evictable_tokens"] > 0
    assert eng.flush_cache()
    assert eng.get_server_info()["internal_states"][0]["num_evictable_tokens"] == 0


def test_engine_holds_any_batch(eng):
    """The bound on queued requests is the server's (503s for HTTP clients); the Engine takes
    whole batches, whatever their size, unless asked for a bound."""
    assert eng.tokenizer_manager.max_in_flight >= 2**62
