"""The scheduler's burst policy (``BurstPolicy``): the hold while a burst arrives, the wave
and the spread of a burst larger than a prefill batch, their counters and their flags."""

from __future__ import annotations

import argparse
import time

import pytest
from helpers.scheduler_steps import record_batches, run_until_idle, step, tokenized

from srt.managers.schedule_policy import BURST_QUIET_S
from srt.managers.scheduler import Scheduler
from srt.server_args import ServerArgs


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
    reqs, shapes = record_batches(scheduler)
    for i in range(num_early):
        scheduler.add_request(tokenized(f"early{i}", [5 + i, 6, 7], max_new_tokens=12))
    step(scheduler, {})  # the early prefill; they decode from now on
    for i in range(num_burst):
        scheduler.add_request(tokenized(f"b{i}", list(range(10 + i, 16 + i)), 4))
    run_until_idle(scheduler)
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


def _hold_args(path: str) -> ServerArgs:
    """Unmixed, so each step's shape shows the hold alone."""
    return ServerArgs(
        model_path=path, max_total_tokens=1024, chunked_prefill_size=64, disable_mixed_chunk=True
    )


def test_prefill_waits_for_the_rest_of_a_burst(qwen3_moe_path, monkeypatch):
    """While a request decodes, requests that keep arriving are not prefilled one by one: the
    running one decodes until none came for BURST_QUIET_S, then they are prefilled in one
    batch; never past --prefill-burst-hold-ms after the oldest arrived, nor when the waiting
    prompts fill a prefill batch, nor when nothing decodes."""
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    args = _hold_args(qwen3_moe_path)
    scheduler = Scheduler(args)
    _, steps = record_batches(scheduler)

    def arrive(rid: str, n: int, dt: float = 0.0) -> None:
        clock.now += dt
        scheduler.add_request(tokenized(rid, list(range(5, 5 + n)), max_new_tokens=40))
        step(scheduler, finished)

    finished: dict[str, dict] = {}
    arrive("first", 3)  # nothing decodes: prefilled at once
    arrive("a", 4, 0.001)
    arrive("b", 5, 0.004)
    clock.now += BURST_QUIET_S  # the burst is over
    step(scheduler, finished)
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
    run_until_idle(scheduler, finished)
    scheduler.check_memory()
    assert len(finished) == 12


def test_ranks_hold_alike_on_the_entry_rank_clock(qwen3_moe_path, monkeypatch):
    """Under TP every rank of a group must run the same batches. The burst hold reads the
    iteration clock that the loop hands every rank (the entry rank's), not the rank's own:
    here the second rank reaches its step 15 ms after it took the iteration's messages (a
    rank descheduled on a busy host), past BURST_QUIET_S, and still holds as the first does."""
    clock = FakeClock()
    monkeypatch.setattr(time, "monotonic", clock)
    args = _hold_args(qwen3_moe_path)
    ranks = [(Scheduler(args), 0.0), (Scheduler(args), 0.015)]
    recorded = [record_batches(scheduler)[1] for scheduler, _ in ranks]
    iterations = [(100.0, [("first", 3)]), (100.001, [("a", 4)]), (100.02, [])]
    for now, arrivals in iterations:
        for scheduler, lag in ranks:
            clock.now = now
            scheduler.begin_iteration(now)
            for rid, n in arrivals:
                scheduler.add_request(tokenized(rid, list(range(5, 5 + n)), max_new_tokens=8))
            clock.now = now + lag
            step(scheduler, {})
    assert recorded[0] == recorded[1] == [("EXTEND", [3]), ("DECODE", []), ("EXTEND", [4])]
    for scheduler, _ in ranks:
        run_until_idle(scheduler)
        scheduler.check_memory()
