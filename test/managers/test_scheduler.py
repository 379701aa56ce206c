"""Scheduler with the real tiny models: greedy outputs do not depend on batching, chunking,
mixed prefill/decode batches, prefix reuse, radix-cache on/off or retraction; aborts and
finishes leave no leaked slots."""

from __future__ import annotations

import argparse
import random
import time

import pytest

import srt
from srt.managers.io_struct import AbortReq, TokenizedGenerateReqInput
from srt.managers.schedule_policy import BURST_QUIET_S
from srt.managers.scheduler import Scheduler
from srt.sampling.sampling_params import SamplingParams
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


def _tokenized(rid: str, ids: list[int], max_new_tokens: int = 8) -> TokenizedGenerateReqInput:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    params.normalize(None)
    return TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=params)


def _step(scheduler: Scheduler, finished: dict[str, dict]) -> None:
    for out in scheduler.step():
        for rid, reason in zip(out.rids, out.finished_reasons):
            if reason is not None:
                finished[rid] = reason


def _record_batches(scheduler: Scheduler) -> tuple[dict, list]:
    """From now on, each batch's requests by rid and its (mode, extend lengths)."""
    reqs, shapes = {}, []
    get_next_batch = scheduler.get_next_batch

    def spy():
        batch = get_next_batch()
        if batch is not None:
            reqs.update((r.rid, r) for r in batch.reqs)
            shapes.append((batch.forward_mode.name, batch.extend_lens))
        return batch

    scheduler.get_next_batch = spy
    return reqs, shapes


def _run_until_idle(scheduler: Scheduler, finished: dict | None = None) -> dict[str, dict]:
    finished = {} if finished is None else finished
    for _ in range(1000):
        _step(scheduler, finished)
        if scheduler.is_idle():
            return finished
    raise AssertionError("scheduler did not become idle")


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
        scheduler.add_request(_tokenized(f"r{i}", ids + [1] * 20))
    finished: dict[str, dict] = {}
    _step(scheduler, finished)  # r0 is mid-chunk now
    assert scheduler.chunked_req is not None
    scheduler.abort_request(AbortReq(scheduler.chunked_req.rid))
    for _ in range(6):
        _step(scheduler, finished)
    running = [r.rid for r in scheduler.running_batch.reqs]
    waiting = [r.rid for r in scheduler.waiting_queue]
    assert running and waiting
    scheduler.abort_request(AbortReq(running[0]))
    scheduler.abort_request(AbortReq(waiting[-1]))
    _run_until_idle(scheduler, finished)
    assert finished["r0"]["type"] == "abort"
    assert finished[running[0]]["type"] == "abort" and finished[waiting[-1]]["type"] == "abort"
    assert sum(r["type"] == "length" for r in finished.values()) == 2
    scheduler.check_memory()
    state = scheduler.get_internal_state()
    assert state["num_running_reqs"] == 0 and state["num_protected_tokens"] == 0


def test_too_long_input_is_aborted(qwen3_moe_path):
    scheduler = Scheduler(ServerArgs(model_path=qwen3_moe_path, max_total_tokens=64))
    scheduler.add_request(_tokenized("long", list(range(3, 100))))
    scheduler.add_request(_tokenized("ok", [5, 6, 7]))
    finished = _run_until_idle(scheduler)
    assert finished["long"]["type"] == "abort" and "Input length" in finished["long"]["message"]
    assert finished["ok"] == {"type": "length", "length": 8}
    scheduler.check_memory()


def test_streaming_deltas_add_up(qwen3_moe_path):
    from transformers import AutoTokenizer

    from srt.managers.detokenizer import DetokenizerManager

    scheduler = Scheduler(ServerArgs(model_path=qwen3_moe_path, max_total_tokens=512))
    detok = DetokenizerManager(AutoTokenizer.from_pretrained(qwen3_moe_path))
    req = _tokenized("s", [5, 6, 7, 8], max_new_tokens=10)
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
        req = _tokenized(rid, [5, 6, 7, 8], max_new_tokens=10)
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


def test_wave_prefill_flag(qwen3_moe_path):
    """--wave-prefill is on where --burst-chunk-size defaults to a chunk and a wave can exceed a
    prefill batch; --burst-chunk-size -1 turns off the spread only; a wave that could not
    exceed a batch is refused; the CLI takes --wave-prefill / --no-wave-prefill."""
    cpu = dict(model_path=qwen3_moe_path, device="cpu")
    assert ServerArgs(**cpu).wave_prefill is True
    assert ServerArgs(**cpu, burst_chunk_size=-1).wave_prefill is True
    assert ServerArgs(**cpu, chunked_prefill_size=256).wave_prefill is False
    assert ServerArgs(**cpu, max_prefill_tokens=2048).wave_prefill is False
    tbo = ServerArgs(**cpu, overlap_mode="tbo", moe_a2a_backend="torch")
    assert tbo.wave_prefill is False
    assert ServerArgs(**cpu, wave_prefill=False).burst_chunk_size == 512
    with pytest.raises(ValueError, match="--wave-prefill: a wave needs --max-prefill-tokens"):
        ServerArgs(**cpu, chunked_prefill_size=-1, wave_prefill=True)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert parser.parse_args([]).wave_prefill is None
    assert parser.parse_args(["--wave-prefill"]).wave_prefill is True
    assert parser.parse_args(["--no-wave-prefill"]).wave_prefill is False


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


def _burst_batches(qwen3_moe_path, spread: int, num_early: int, num_burst: int = 3, **kwargs):
    """``num_early`` requests decode (12 tokens each) when ``num_burst`` prompts of 6 tokens
    arrive (3 are more than a batch of 16); the outputs of every request, the shapes of the
    steps after the early prefill, and the (spread, wave) batch counts."""
    args = ServerArgs(
        model_path=qwen3_moe_path,
        max_total_tokens=512,
        chunked_prefill_size=16,
        burst_chunk_size=spread,
        prefill_burst_hold_ms=0,
        disable_mixed_chunk=True,  # each prefill not spread in a batch of its own
        **kwargs,
    )
    scheduler = Scheduler(args)
    reqs, shapes = _record_batches(scheduler)
    for i in range(num_early):
        scheduler.add_request(_tokenized(f"early{i}", [5 + i, 6, 7], max_new_tokens=12))
    _step(scheduler, {})  # the early prefill; they decode from now on
    for i in range(num_burst):
        scheduler.add_request(_tokenized(f"b{i}", list(range(10 + i, 16 + i)), 4))
    _run_until_idle(scheduler)
    scheduler.check_memory()
    state = scheduler.get_internal_state()
    counts = state["num_spread_prefill_batches"], state["num_wave_prefill_batches"]
    return {rid: r.output_ids for rid, r in reqs.items()}, shapes[1:], counts


def test_burst_larger_than_a_batch_is_spread(qwen3_moe_path):
    """While as many requests decode as wait, waiting prompts that need more than one prefill
    batch go in MIXED batches of --burst-chunk-size, the running requests decoding in each,
    where they would otherwise be prefilled back to back; the outputs are the same."""
    outputs, shapes, counts = _burst_batches(qwen3_moe_path, -1, num_early=3)
    assert shapes[:3] == [("EXTEND", [6, 6, 4]), ("EXTEND", [2]), ("DECODE", [])]
    assert counts == (0, 0)
    spread_outputs, shapes, counts = _burst_batches(qwen3_moe_path, 8, num_early=3)
    # 8 tokens a batch, one per running request: b0, then b1, then b2 in chunks
    assert shapes[:3] == [
        ("MIXED", [5, 1, 1, 1]),
        ("MIXED", [1, 4, 1, 1, 1]),
        ("MIXED", [2, 2, 1, 1, 1, 1]),
    ]
    assert counts == (5, 0)  # the last 4 of b2 in two more
    assert spread_outputs == outputs


def test_burst_wave_is_one_batch(qwen3_moe_path):
    """While more requests wait than decode (a wave reaching a server that is nearly idle),
    a burst larger than a prefill batch is prefilled in one batch of up to
    --max-prefill-tokens: the one running stream pays one gap, and no stream started by a
    first batch waits for a second; the outputs are the same. It has a switch of its own:
    --burst-chunk-size -1 leaves it on, and under --no-wave-prefill the burst is spread."""
    outputs, shapes, counts = _burst_batches(qwen3_moe_path, -1, num_early=1, wave_prefill=False)
    assert shapes[:3] == [("EXTEND", [6, 6, 4]), ("EXTEND", [2]), ("DECODE", [])]
    assert counts == (0, 0)
    # --burst-chunk-size -1 turns off the spread only
    wave_outputs, shapes, counts = _burst_batches(
        qwen3_moe_path, -1, num_early=1, wave_prefill=True
    )
    assert shapes[:3] == [("EXTEND", [6, 6, 6]), ("DECODE", []), ("DECODE", [])]
    assert counts == (0, 1)
    assert wave_outputs == outputs
    # --no-wave-prefill: the same burst is spread, 8 tokens a batch with early decoding
    spread_outputs, shapes, counts = _burst_batches(qwen3_moe_path, 8, 1, wave_prefill=False)
    assert shapes[:3] == [("MIXED", [6, 1, 1]), ("MIXED", [5, 1, 1, 1]), ("MIXED", [5, 1, 1, 1])]
    assert counts == (3, 0)
    assert spread_outputs == outputs


def test_burst_counters_count_batches_not_attempts(qwen3_moe_path):
    """num_spread_prefill_batches and num_wave_prefill_batches count the batches formed, not
    the steps that were due one: while the running requests fill --max-running-requests, the
    burst waits and no decode step in between may count."""
    # 3 decode, 3 wait (18 tokens, more than a batch): a spread is due in each of the 11 decode
    # steps, but no request may join; once the 3 finish, more wait than decode: one wave.
    kwargs = dict(max_running_requests=3, wave_prefill=True)
    _, shapes, counts = _burst_batches(qwen3_moe_path, 8, num_early=3, **kwargs)
    assert shapes[:12] == [("DECODE", [])] * 11 + [("EXTEND", [6, 6, 6])]
    assert counts == (0, 1)
    # 4 decode, 5 wait (more than decode): a wave is due in each of the 11 decode steps; once
    # the 4 finish, four prompts go in one wave of 24 tokens, the fifth after them.
    kwargs = dict(num_burst=5, max_running_requests=4, wave_prefill=True)
    _, shapes, counts = _burst_batches(qwen3_moe_path, 8, num_early=4, **kwargs)
    assert shapes[:12] == [("DECODE", [])] * 11 + [("EXTEND", [6, 6, 6, 6])]
    assert counts == (0, 1)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_prefill_waits_for_the_rest_of_a_burst(qwen3_moe_path, monkeypatch):
    """While a request decodes, requests that keep arriving are not prefilled one by one: the
    running one decodes until none came for BURST_QUIET_S, then they are prefilled in one
    batch; never past --prefill-burst-hold-ms after the oldest arrived, nor when the waiting
    prompts fill a prefill batch, nor when nothing decodes."""
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    # Unmixed, so each step's shape shows the hold alone.
    args = ServerArgs(
        model_path=qwen3_moe_path,
        max_total_tokens=1024,
        chunked_prefill_size=64,
        disable_mixed_chunk=True,
    )
    scheduler = Scheduler(args)
    _, steps = _record_batches(scheduler)

    def arrive(rid: str, n: int, dt: float = 0.0) -> None:
        clock.now += dt
        scheduler.add_request(_tokenized(rid, list(range(5, 5 + n)), max_new_tokens=40))
        _step(scheduler, finished)

    finished: dict[str, dict] = {}
    arrive("first", 3)  # nothing decodes: prefilled at once
    arrive("a", 4, 0.001)
    arrive("b", 5, 0.004)
    clock.now += BURST_QUIET_S  # the burst is over
    _step(scheduler, finished)
    assert steps == [("EXTEND", [3]), ("DECODE", []), ("DECODE", []), ("EXTEND", [4, 5])]

    # Arrivals that never stop: held until 50 ms after the oldest waiting one arrived.
    del steps[:]
    for i in range(8):
        arrive(f"c{i}", 2, 1 / 128)  # c7 comes 54.7 ms after c0
    assert steps == [("DECODE", [])] * 7 + [("EXTEND", [2] * 8)]

    # A burst that fills a prefill batch (64 tokens here) waits for nothing.
    del steps[:]
    arrive("long", 64, 0.001)
    assert steps == [("EXTEND", [64])]
    assert scheduler.get_internal_state()["num_prefill_burst_holds"] == 9
    _run_until_idle(scheduler, finished)
    scheduler.check_memory()
    assert len(finished) == 12


def test_ranks_hold_alike_on_the_entry_rank_clock(qwen3_moe_path, monkeypatch):
    """Under TP every rank of a group must run the same batches. The burst hold reads the
    iteration clock that the loop hands every rank (the entry rank's), not the rank's own:
    here the second rank reaches its step 15 ms after it took the iteration's messages (a
    rank descheduled on a busy host), past BURST_QUIET_S, and still holds as the first does."""
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    # Unmixed, so each step's shape shows the hold alone.
    args = ServerArgs(
        model_path=qwen3_moe_path,
        max_total_tokens=1024,
        chunked_prefill_size=64,
        disable_mixed_chunk=True,
    )
    ranks = [(Scheduler(args), 0.0), (Scheduler(args), 0.015)]
    recorded = [_record_batches(scheduler)[1] for scheduler, _ in ranks]
    iterations = [(100.0, [("first", 3)]), (100.001, [("a", 4)]), (100.02, [])]
    for now, arrivals in iterations:
        for scheduler, lag in ranks:
            clock.now = now
            scheduler.begin_iteration(now)
            for rid, n in arrivals:
                scheduler.add_request(_tokenized(rid, list(range(5, 5 + n)), max_new_tokens=8))
            clock.now = now + lag
            _step(scheduler, {})
    assert recorded[0] == recorded[1] == [("EXTEND", [3]), ("DECODE", []), ("EXTEND", [4])]
    for scheduler, _ in ranks:
        _run_until_idle(scheduler)
        scheduler.check_memory()


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
        reqs, shapes = _record_batches(scheduler)
        early = _tokenized("early", [5, 6, 7], max_new_tokens=12)
        early.return_logprob = True
        scheduler.add_request(early)
        _step(scheduler, {})  # early's prefill; it decodes from now on
        late = _tokenized("late", list(range(10, 40)), max_new_tokens=4)
        late.return_logprob, late.logprob_start_len = True, 0
        scheduler.add_request(late)
        _run_until_idle(scheduler)
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
