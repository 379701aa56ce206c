"""Dual-batch overlap is exact, model level: every rank builds the same model twice (overlap off
and ``--enable-dbo``) in a real gloo world and replays the TBO tests' script through both, as
the scheduler runs it (proposal, MLP sync, forward or idle forward). Log-probabilities agree to
1e-5 (fp32) and greedy tokens are identical, step by step, for Qwen3-MoE, DeepSeek-V2 and
DeepSeek-V3 under DP attention, with the normal, low_latency and auto dispatchers, and without
DP attention (every rank runs the same batch and decides alone).

The thresholds sit on the script's edges (decode 3, prefill 6 tokens): a step where one group
decodes 2 sequences and one where a group extends 4 tokens run unsplit everywhere, the
neighbouring ones split. Every step's split is checked against vLLM's uniform rule on the
groups' token counts (an idle group, or one at or under half the largest count, stops
everyone), and the split steps must have handed over at the dispatchers' yields."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from helpers.overlap_script import MODELS, SCRIPT, assert_same, run_script, server_args
from helpers.run_ranks import run_ranks

from srt.batch_overlap.dual_batch_overlap import agree_dual_batch_overlap
from srt.batch_overlap.step_split import SplitConfig
from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.forward_batch_info import ForwardMode
from srt.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.slow  # starts processes

DECODE_THRESHOLD, PREFILL_THRESHOLD = 3, 6
# Per step of SCRIPT, per dp: does DBO split it (by the rule on every group's batch)?
EXPECTED_SPLIT = {2: [True, False, False, True, False, True, False, True], 1: [True] * 8}


def dbo_worker(rank: int, n: int, init_method: str, dp: int, runs: list) -> dict:
    torch.set_num_threads(1)
    parallel = init_parallel_state(n, rank, dp, dp > 1, "torch", "gloo", init_method)
    try:
        out = {}
        for mode, path, name in runs:
            for dbo in (False, True):
                args = server_args(
                    path, n, dp, "torch", deepep_mode=mode, max_dispatch_tokens_per_rank=64,
                    enable_dbo=dbo, dbo_decode_token_threshold=DECODE_THRESHOLD,
                    dbo_prefill_token_threshold=PREFILL_THRESHOLD,
                )  # fmt: skip
                runner = ModelRunner(args, parallel=parallel)
                out[mode, name, dbo] = run_script(runner, dp)
                wrapper = runner.model.run_body
                dbo_steps = {m: n for (o, m), n in runner.step_counts.items() if o == "dbo"}
                out[mode, name, dbo, "dbo"] = (dbo_steps, wrapper.num_yields)
                out[name, "moe_layers"] = sum(layer.is_moe for layer in runner.model.model.layers)
                wrapper.close()
        return out
    finally:
        parallel.destroy()


# (dp, mode, model): dp 2 is tp2-dp2 DP attention, dp 1 tp2 without it
RUNS = [
    (2, "normal", "tiny-qwen3-moe"),
    (2, "normal", "tiny-deepseek-v3"),
    (2, "low_latency", "tiny-deepseek-v2"),
    (2, "auto", "tiny-qwen3-moe"),
    (2, "auto", "tiny-deepseek-v3"),
    (1, "normal", "tiny-deepseek-v3"),
]


@pytest.fixture(scope="module")
def results(tiny_models) -> dict[int, list[dict]]:
    """Every rank's results per dp: one launch of the two ranks per world."""
    out = {}
    for dp in sorted({dp for dp, _, _ in RUNS}):
        runs = [(mode, tiny_models[name], name) for d, mode, name in RUNS if d == dp]
        out[dp] = run_ranks(dbo_worker, 2, dp, runs, timeout=600.0)
    return out


def test_every_model_is_covered():
    assert {name for dp, _, name in RUNS if dp == 2} == set(MODELS)
    assert {mode for dp, mode, _ in RUNS if dp == 2} == {"normal", "low_latency", "auto"}


@pytest.mark.parametrize("dp, mode, name", RUNS, ids=[f"dp{d}-{m}-{n}" for d, m, n in RUNS])
def test_dbo_equals_plain(results, dp, mode, name):
    expected = EXPECTED_SPLIT[dp]
    for rank, out in enumerate(results[dp]):
        (plain, plain_split), (dbo, dbo_split) = out[mode, name, False], out[mode, name, True]
        assert not any(plain_split), f"{name} rank {rank}: split with DBO off"
        assert dbo_split == expected, f"{name} rank {rank}"
        assert_same(dbo, plain, f"{mode} {name} rank {rank}")
        counts, yields = out[mode, name, True, "dbo"]
        assert sum(counts.values()) == sum(expected), counts
        assert out[mode, name, False, "dbo"] == ({}, 0)
        # handed over at the dispatchers: in each MoE layer, each micro-batch at its dispatch
        # and at its combine
        assert yields == 4 * out[name, "moe_layers"] * sum(expected), yields


# Each step's tokens per DP group (group 0, group 1), worked out by hand from SCRIPT.
TOKENS = [(16, 11), (3, 2), (3, 0), (10, 6), (6, 4), (45, 32), (8, 3), (8, 7)]


class _Batch(NamedTuple):
    """What ``SplitConfig.passes`` reads of a batch."""

    forward_mode: ForwardMode
    num_tokens: int


def script_steps(column: list) -> list[tuple[ForwardMode | None, int]]:
    """One DP group's column of SCRIPT as (mode, tokens) per step (None: no batch)."""
    num_seqs, out = 0, []
    for action in column:
        if action is None:
            out.append((None, 0))
        elif action[0] == "decode":
            out.append((ForwardMode.DECODE, num_seqs))
        else:
            kind, parts = action[0], action[1]
            chunks = [tokens for _, _, tokens in parts] if kind == "shared" else parts
            num_seqs += 0 if kind == "continue" else len(chunks)  # a continuation adds none
            out.append((ForwardMode.EXTEND, sum(map(len, chunks))))
    return out


def test_expected_split_follows_the_rule():
    """EXPECTED_SPLIT is srt's DBO rule (each group's threshold, then the uniform agreement)
    on the script's token counts, which are the hand-made table's."""
    config = SplitConfig("dbo", DECODE_THRESHOLD, PREFILL_THRESHOLD)
    groups = [script_steps([step[g] for step in SCRIPT]) for g in (0, 1)]
    assert list(zip(*[[n for _, n in steps] for steps in groups])) == TOKENS
    for dp, expected in EXPECTED_SPLIT.items():
        splits = []
        for step in zip(*groups[:dp]):
            rows = [(n, mode is not None and config.passes(_Batch(mode, n))) for mode, n in step]
            splits.append(agree_dual_batch_overlap(rows) is not None)
        assert splits == expected, dp
