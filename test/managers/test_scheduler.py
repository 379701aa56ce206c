"""Scheduler with the real tiny models: greedy outputs do not depend on batching, chunking,
mixed prefill/decode batches, prefix reuse, radix-cache on/off or retraction; aborts and
finishes leave no leaked slots."""

from __future__ import annotations

import random

import pytest
from helpers.scheduler_steps import record_batches, run_until_idle, step, tokenized

import srt
from srt.managers.io_struct import AbortReq
from srt.managers.scheduler import Scheduler
from srt.server_args import ServerArgs

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
MODELS = ["tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3"]
# The tests that start engines of their own: one per KV-cache layout (Qwen3's per-head K/V,
# DeepSeek's MLA latent); what they vary is the scheduler's, not the model's. DeepSeek-V2
# (V3's attention and cache, another router) runs the reference engine's tests.
ENGINE_MODELS = ["tiny-qwen3-moe", "tiny-deepseek-v3"]


def make_prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def engine(path: str, **kwargs) -> srt.Engine:
    return srt.Engine(model_path=path, dtype="float32", **{"max_total_tokens": 4096, **kwargs})


def output_ids(eng: srt.Engine, prompts: list[list[int]], params: dict = GREEDY) -> list:
    return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]


@pytest.fixture(scope="module", params=MODELS)
def reference(request, tiny_models):
    """Each prompt alone on an empty cache: the reference greedy outputs."""
    path = tiny_models[request.param]
    eng = engine(path)
    prompts = make_prompts()
    alone = []
    for prompt in prompts:
        alone.append(eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"])
        assert eng.flush_cache()
    yield path, eng, prompts, alone
    eng.shutdown()


def test_batch_and_radix_hit_match_alone(assert_kv_pool_full, reference):
    _, eng, prompts, alone = reference
    assert output_ids(eng, prompts) == alone
    assert_kv_pool_full(eng)
    again = eng.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o["output_ids"] for o in again] == alone
    assert all(o["meta_info"]["cached_tokens"] == len(p) - 1 for o, p in zip(again, prompts))
    assert_kv_pool_full(eng)
    assert eng.flush_cache()


def test_shared_prefix_hit_matches_alone(assert_kv_pool_full, reference):
    _, eng, prompts, _ = reference
    base = make_prompts(1, seed=7)[0] + [11, 12, 13, 14, 15, 16, 17, 18]
    first = [base + p[:5] for p in prompts[:4]]
    solo = []
    for prompt in first:
        solo.append(eng.generate(input_ids=prompt, sampling_params=GREEDY)["output_ids"])
        eng.flush_cache()
    eng.generate(input_ids=first[0], sampling_params=GREEDY)
    outs = eng.generate(input_ids=first[1:], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == solo[1:]
    assert all(o["meta_info"]["cached_tokens"] >= len(base) for o in outs)
    assert_kv_pool_full(eng)


@pytest.mark.parametrize("reference", ENGINE_MODELS, indirect=True)
@pytest.mark.slow
def test_lpm_and_max_running_match_alone(assert_kv_pool_full, reference):
    """Chunking with and without the radix cache is covered below, retraction and all."""
    path, _, prompts, alone = reference
    with engine(path, schedule_policy="lpm", max_running_requests=5) as eng:
        assert output_ids(eng, prompts) == alone
        assert_kv_pool_full(eng)


def test_mixed_chunk_matches_alone(assert_kv_pool_full, reference):
    """--enable-mixed-chunk: the running requests decode inside the prefill chunks' batches
    (MIXED steps), with the same greedy outputs as each prompt alone."""
    path, _, prompts, alone = reference
    kwargs = dict(enable_mixed_chunk=True, chunked_prefill_size=16, max_running_requests=6)
    with engine(path, **kwargs) as eng:
        assert output_ids(eng, prompts) == alone
        state = eng.get_server_info()["internal_states"][0]
        assert state["num_non_tbo_steps"].get("mixed", 0) > 0, state
        assert_kv_pool_full(eng)


# Mixed batches are the CPU default (ServerArgs.mixes_decode_into_prefill): the cases that
# must retract turn them off.
UNMIXED = {"disable_mixed_chunk": True}
RETRACTION_CASES = {
    "unchunked": {"chunked_prefill_size": -1, **UNMIXED},
    "chunked": {"chunked_prefill_size": 8, **UNMIXED},
    "no-radix": {"chunked_prefill_size": 8, "disable_radix_cache": True, **UNMIXED},
    # Whole prompts in a few large chunks, so that the running requests fill the pool faster
    # than the prefills let them finish (in chunks of 8, none is retracted).
    "mixed": {"chunked_prefill_size": 64, "enable_mixed_chunk": True, "max_total_tokens": 100},
}


# Every case on Qwen3's cache; on DeepSeek's MLA cache the two that differ most (the suite's
# time is bounded: each cell starts an engine).
@pytest.mark.parametrize(
    "reference, kwargs",
    [("tiny-qwen3-moe", kwargs) for kwargs in RETRACTION_CASES.values()]
    + [("tiny-deepseek-v3", RETRACTION_CASES[name]) for name in ("unchunked", "mixed")],
    ids=[f"tiny-qwen3-moe-{name}" for name in RETRACTION_CASES]
    + ["tiny-deepseek-v3-unchunked", "tiny-deepseek-v3-mixed"],
    indirect=["reference"],
)
@pytest.mark.slow
def test_retraction_keeps_greedy_output(assert_kv_pool_full, reference, kwargs):
    path, _, prompts, alone = reference
    # No burst hold: its decode steps (wall-clock bound) would ease the pool's pressure.
    with engine(path, **{"max_total_tokens": 150, "prefill_burst_hold_ms": 0, **kwargs}) as eng:
        assert output_ids(eng, prompts) == alone
        state = eng.get_server_info()["internal_states"][0]
        assert state["num_retracted_reqs"] > 0, state
        if kwargs.get("enable_mixed_chunk"):  # a tight pool with decodes inside the prefills
            assert state["num_non_tbo_steps"].get("mixed", 0) > 0, state
        assert_kv_pool_full(eng)


def test_abort_running_waiting_and_chunked(qwen3_moe_path):
    args = ServerArgs(
        model_path=qwen3_moe_path,
        max_total_tokens=512,
        max_running_requests=2,
        chunked_prefill_size=8,
    )
    scheduler = Scheduler(args)
    prompts = make_prompts(5, seed=3)
    for i, ids in enumerate(prompts):
        scheduler.add_request(tokenized(f"r{i}", ids + [1] * 20))
    finished: dict[str, dict] = {}
    step(scheduler, finished)  # r0 is mid-chunk now
    assert scheduler.chunked_req is not None
    scheduler.abort_request(AbortReq(scheduler.chunked_req.rid))
    for _ in range(6):
        step(scheduler, finished)
    running = [r.rid for r in scheduler.running_batch.reqs]
    waiting = [r.rid for r in scheduler.waiting_queue]
    assert running and waiting
    scheduler.abort_request(AbortReq(running[0]))
    scheduler.abort_request(AbortReq(waiting[-1]))
    run_until_idle(scheduler, finished)
    assert finished["r0"]["type"] == "abort"
    assert finished[running[0]]["type"] == "abort" and finished[waiting[-1]]["type"] == "abort"
    assert sum(r["type"] == "length" for r in finished.values()) == 2
    scheduler.check_memory()
    state = scheduler.get_internal_state()
    assert state["num_running_reqs"] == 0 and state["num_protected_tokens"] == 0


def test_token_counts_split_prefill_into_cache_hits_and_computed(qwen3_moe_path):
    """What /metrics reports as cache_hit_rate and realtime_tokens: a chunked prompt's later
    chunks are computed tokens, not hits on its own earlier chunks; the same prompt again
    computes only its last token."""
    args = ServerArgs(model_path=qwen3_moe_path, max_total_tokens=512, chunked_prefill_size=8)
    scheduler = Scheduler(args)
    prompt = make_prompts(1, seed=5)[0][:3] + [1] * 17  # 20 tokens: chunks of 8, 8 and 4
    scheduler.add_request(tokenized("a", prompt))
    run_until_idle(scheduler)
    state = scheduler.get_internal_state()
    assert state["num_prefill_compute_tokens"] == 20 and state["num_prefill_cache_tokens"] == 0
    assert (state["last_prefill_cache_tokens"], state["last_prefill_compute_tokens"]) == (0, 4)
    scheduler.add_request(tokenized("b", prompt))
    run_until_idle(scheduler)
    state = scheduler.get_internal_state()
    assert state["num_prefill_compute_tokens"] == 21 and state["num_prefill_cache_tokens"] == 19
    assert (state["last_prefill_cache_tokens"], state["last_prefill_compute_tokens"]) == (19, 1)
    assert state["num_decode_tokens"] == 2 * 7  # 8 new tokens each, the first from the prefill


def test_too_long_input_is_aborted(qwen3_moe_path):
    scheduler = Scheduler(ServerArgs(model_path=qwen3_moe_path, max_total_tokens=64))
    scheduler.add_request(tokenized("long", list(range(3, 100))))
    scheduler.add_request(tokenized("ok", [5, 6, 7]))
    finished = run_until_idle(scheduler)
    assert finished["long"]["type"] == "abort" and "Input length" in finished["long"]["message"]
    assert finished["ok"] == {"type": "length", "length": 8}
    scheduler.check_memory()


def test_streaming_deltas_add_up(qwen3_moe_path):
    from transformers import AutoTokenizer

    from srt.managers.detokenizer import DetokenizerManager

    scheduler = Scheduler(ServerArgs(model_path=qwen3_moe_path, max_total_tokens=512))
    detok = DetokenizerManager(AutoTokenizer.from_pretrained(qwen3_moe_path))
    req = tokenized("s", [5, 6, 7, 8], max_new_tokens=10)
    req.stream = True
    scheduler.add_request(req)
    ids, texts = [], []
    while not scheduler.is_idle():
        for out in scheduler.step():
            text_out = detok.handle_batch_token_id_out(out)
            ids.extend(text_out.output_ids[0])
            texts.append(text_out.output_strs[0])
    assert len(texts) == 10 and len(ids) == 10
    assert all(texts[-1].startswith(t) for t in texts)
    assert texts[-1] == detok.tokenizer.decode(ids, skip_special_tokens=True)
    scheduler.check_memory()


def test_server_stream_interval_and_request_override(qwen3_moe_path):
    """--stream-interval 4: the first token at once, then every 4, the rest at the end; a
    request's own stream_interval wins."""
    args = ServerArgs(model_path=qwen3_moe_path, max_total_tokens=512, stream_interval=4)
    scheduler = Scheduler(args)
    for rid, own in (("server", None), ("own", 2)):
        req = tokenized(rid, [5, 6, 7, 8], max_new_tokens=10)
        req.sampling_params.stream_interval = own
        req.stream = True
        scheduler.add_request(req)
    sent: dict[str, list[int]] = {"server": [], "own": []}
    while not scheduler.is_idle():
        for out in scheduler.step():
            for rid, ids in zip(out.rids, out.output_ids):
                sent[rid].append(len(ids))
    assert sent["server"] == [1, 4, 4, 1]
    assert sent["own"] == [1, 2, 2, 2, 2, 1]
    scheduler.check_memory()


def test_stream_interval_flag_is_checked(qwen3_moe_path):
    with pytest.raises(ValueError, match="--stream-interval"):
        ServerArgs(model_path=qwen3_moe_path, stream_interval=0)
    with pytest.raises(ValueError, match="--prefill-burst-hold-ms: must be ≥ 0"):
        ServerArgs(model_path=qwen3_moe_path, prefill_burst_hold_ms=-1)
    with pytest.raises(ValueError, match="--burst-chunk-size: must be positive or -1"):
        ServerArgs(model_path=qwen3_moe_path, burst_chunk_size=0)
    with pytest.raises(ValueError, match="--burst-chunk-size: must be under a prefill batch"):
        ServerArgs(model_path=qwen3_moe_path, chunked_prefill_size=256, burst_chunk_size=256)
    assert ServerArgs(model_path=qwen3_moe_path, chunked_prefill_size=256).burst_chunk_size == -1
    assert ServerArgs(model_path=qwen3_moe_path, device="cpu").burst_chunk_size == 512
    tbo = ServerArgs(
        model_path=qwen3_moe_path, device="cpu", overlap_mode="tbo", moe_a2a_backend="torch"
    )
    assert tbo.burst_chunk_size == -1  # mixed batches run unsplit: no default spreading


def test_mixed_batches_default(qwen3_moe_path):
    """Mixed batches are the default on CPU without an overlap mode; the explicit flags win,
    and both at once is a start-up error naming the flag."""
    assert ServerArgs(model_path=qwen3_moe_path, device="cpu").mixes_decode_into_prefill
    off = ServerArgs(model_path=qwen3_moe_path, device="cpu", disable_mixed_chunk=True)
    assert not off.mixes_decode_into_prefill
    tbo = dict(device="cpu", overlap_mode="tbo", moe_a2a_backend="torch")
    assert not ServerArgs(model_path=qwen3_moe_path, **tbo).mixes_decode_into_prefill
    forced = ServerArgs(model_path=qwen3_moe_path, enable_mixed_chunk=True, **tbo)
    assert forced.mixes_decode_into_prefill
    with pytest.raises(ValueError, match="--disable-mixed-chunk: cannot be given with"):
        ServerArgs(model_path=qwen3_moe_path, enable_mixed_chunk=True, disable_mixed_chunk=True)


@pytest.mark.parametrize("model", ["qwen3_moe_path", "deepseek_v3_path"])
def test_mixed_batch_budget_and_logprobs(model, request):
    """MIXED steps: the prefill chunk leaves room for the running request's token, and every
    logprob equals the unmixed run's (prompt logprobs only for the prefilled request). MLA
    attends the running request's row on the cached latent, as its decode steps do."""
    runs = {}
    for mixed in (False, True):
        args = ServerArgs(
            model_path=request.getfixturevalue(model),
            max_total_tokens=512,
            chunked_prefill_size=12,
            enable_mixed_chunk=mixed,
            disable_mixed_chunk=not mixed,
            prefill_burst_hold_ms=0,  # late's prefill starts in the step after it arrives
        )
        scheduler = Scheduler(args)
        reqs, shapes = record_batches(scheduler)
        early = tokenized("early", [5, 6, 7], max_new_tokens=12)
        early.return_logprob = True
        scheduler.add_request(early)
        step(scheduler, {})  # early's prefill; it decodes from now on
        late = tokenized("late", list(range(10, 40)), max_new_tokens=4)
        late.return_logprob, late.logprob_start_len = True, 0
        scheduler.add_request(late)
        run_until_idle(scheduler)
        scheduler.check_memory()
        if mixed:  # 30 prompt tokens in chunks of 11, 11 and 8, each with early's token
            expected = [("MIXED", [11, 1]), ("MIXED", [11, 1]), ("MIXED", [8, 1])]
        else:
            expected = [("EXTEND", [12]), ("EXTEND", [12]), ("EXTEND", [6])]
        assert shapes[1:4] == expected
        runs[mixed] = reqs
    for rid in ("early", "late"):
        plain, mix = runs[False][rid], runs[True][rid]
        assert mix.output_ids == plain.output_ids
        for name in ("output_token_logprobs", "input_token_logprobs"):
            values = [v for v, _ in getattr(plain, name) if v is not None]
            mixed_values = [v for v, _ in getattr(mix, name) if v is not None]
            assert mixed_values == pytest.approx(values, abs=1e-5), (rid, name)
    assert len(runs[True]["late"].input_token_logprobs) == 30
    assert not runs[True]["early"].input_token_logprobs
