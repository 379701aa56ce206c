"""Constrained requests through srt.Engine under memory pressure: with chunked prefill and
retraction, greedy constrained outputs equal those of a roomy engine, and every one of them
follows its regex (two-batch overlap: test/batch_overlap/test_overlap_e2e.py)."""

from __future__ import annotations

import random
import re

import pytest

import srt

pytestmark = pytest.mark.slow  # starts processes

pytest.importorskip("xgrammar")

# Long enough that the requests outgrow a small KV pool together.
REGEXES = [r"[0-9]{14,18}", r"(yes|no|maybe)( (yes|no|maybe)){4}!", r"[a-c]{6}-[0-9]{8,10}"]


def _run(path: str, prompts: list[list[int]], **kwargs) -> tuple[list[str], dict]:
    engine = srt.Engine(model_path=path, dtype="float32", **kwargs)
    try:
        params = [
            {"temperature": 0, "max_new_tokens": 20, "regex": REGEXES[i % len(REGEXES)]}
            for i in range(len(prompts))
        ]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        return [out["text"] for out in outs], engine.get_server_info()["internal_states"][0]
    finally:
        engine.shutdown()


def test_chunked_and_retracted_outputs_follow_the_grammar(qwen3_moe_path):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 12))] for _ in range(16)]
    roomy, _ = _run(qwen3_moe_path, prompts, max_total_tokens=4096)
    # Unmixed and without the burst hold (wall-clock bound), so that the pool runs out.
    tight, state = _run(
        qwen3_moe_path,
        prompts,
        max_total_tokens=100,
        chunked_prefill_size=16,
        disable_mixed_chunk=True,
        prefill_burst_hold_ms=0,
    )
    assert state["num_retracted_reqs"] > 0
    assert tight == roomy
    for i, text in enumerate(tight):
        assert re.fullmatch(REGEXES[i % len(REGEXES)], text), (i, text)
