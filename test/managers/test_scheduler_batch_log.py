"""The scheduler's batch log (SGLang's 'Prefill batch' and 'Decode batch' lines): what each
field counts, on a schedule worked out by hand (a chunked prompt, a prefix-cache hit, a decode
interval that runs across requests)."""

from __future__ import annotations

import logging

from helpers.batch_log import decode_lines, prefill_lines
from helpers.scheduler_steps import run_until_idle, tokenized

from srt.managers.scheduler import Scheduler
from srt.server_args import ServerArgs


def test_prefill_and_decode_lines(qwen3_moe_path, caplog):
    args = ServerArgs(
        model_path=qwen3_moe_path,
        max_total_tokens=512,
        chunked_prefill_size=16,
        decode_log_interval=2,
        disable_mixed_chunk=True,
    )
    scheduler = Scheduler(args)
    long, short = list(range(5, 40)), list(range(5, 15))  # 35 tokens; the first 10 of them
    with caplog.at_level(logging.INFO, logger="srt.managers.scheduler_batch_log"):
        scheduler.add_request(tokenized("a", long, max_new_tokens=6))
        scheduler.add_request(tokenized("b", short, max_new_tokens=6))
        run_until_idle(scheduler)
        scheduler.add_request(tokenized("c", long, max_new_tokens=3))
        run_until_idle(scheduler)
    # (new seqs, new tokens, cached tokens, running, queued, pending tokens): a in chunks of
    # 16, 16 and 3, b waiting (10 tokens) and a's rest pending; b then hits the 9 tokens of
    # a's first chunk in the cache (a's own computed prefix is no hit); c hits all but one.
    assert prefill_lines(caplog.text) == [
        (1, 16, 0, 0, 1, 10 + 19),
        (1, 16, 0, 0, 1, 10 + 3),
        (2, 3 + 1, 9, 0, 0, 0),
        (1, 1, 34, 0, 0, 0),
    ]
    # a and b decode 5 steps (lines after steps 2 and 4), c continues the interval: a line
    # after its first step. KV in use: a's 35 + 2 and b's own 1 + 2; then + 2 each; c's 36.
    lines = decode_lines(caplog.text)
    assert [(running, kv) for running, kv, *_ in lines] == [(2, 37 + 3), (2, 44), (1, 36)]
    assert [usage for _, _, usage, *_ in lines] == [0.08, 0.09, 0.07]  # of 512 slots
    assert all(graph for _, _, _, graph, *_ in lines)  # replayed from CPU decode graphs
    assert all(tokens_per_s > 0 for *_, tokens_per_s, _ in lines)
    assert round(scheduler.get_internal_state()["last_gen_throughput"], 2) == lines[-1][4]
