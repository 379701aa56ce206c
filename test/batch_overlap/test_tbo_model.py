"""Two-batch overlap is exact, model level: every rank builds the same model twice (TBO off and
TBO on, thresholds 0 so every splittable step splits) in a real gloo world and replays the same
script through both, as the scheduler runs it (TBO proposal, MLP sync, forward or idle
forward). Log-probabilities agree to 1e-5 (fp32) and greedy tokens are identical, step by step,
for Qwen3-MoE, DeepSeek-V2 and DeepSeek-V3.

The script covers an extend without prefix (balanced split), decode, a step where one DP group
is idle (it splits its empty batch), the next chunk of a chunked prefill and radix-cache hits
(extends on a cached prefix), a two-chunk split (one long prompt among short ones: the long
one is cut between the micro-batches) and a step where the groups' modes differ (no TBO
anywhere). Which steps ran split is checked too, so the test fails if TBO silently never ran."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from helpers.overlap_script import MODELS, assert_same, run_script, server_args
from helpers.run_ranks import run_ranks

from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs

pytestmark = pytest.mark.slow  # starts processes

# Steps that run split in a multi-group layout (the idle step included), and without DP
# attention (group 0's column alone).
SPLIT_STEPS_DP = [True, True, True, True, True, True, False, True]
SPLIT_STEPS_PLAIN = [True, True, True, True, True, True, True, True]


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    backend: str
    deepep_mode: str = "normal"

    def server_args(self, path: str, tbo: bool) -> ServerArgs:
        return server_args(
            path, self.tp, self.dp, self.backend,
            deepep_mode=self.deepep_mode, max_dispatch_tokens_per_rank=64,
            enable_two_batch_overlap=tbo, tbo_decode_token_threshold=0,
            tbo_prefill_token_threshold=0,
        )  # fmt: skip


def tbo_worker(rank: int, n: int, init_method: str, runs: list[tuple[Layout, dict]]) -> list:
    """Each (layout, paths) of ``runs`` in turn (one world: the same tp, dp and backend), on one
    set of process groups; → one dict per run."""
    torch.set_num_threads(1)
    first = runs[0][0]
    parallel = init_parallel_state(
        n, rank, first.dp, first.dp > 1, first.backend, "gloo", init_method
    )
    try:
        outs = []
        for layout, paths in runs:
            out = {}
            for name, path in paths.items():
                for tbo in (False, True):
                    runner = ModelRunner(layout.server_args(path, tbo), parallel=parallel)
                    out[name, tbo] = run_script(runner, layout.dp)
                    out[name, tbo, "counts"] = dict(runner.step_counts)
            outs.append(out)
        return outs
    finally:
        parallel.destroy()


LAYOUTS = [
    Layout(2, 2, "torch", "normal"),
    Layout(2, 2, "torch", "low_latency"),
    Layout(4, 4, "torch", "auto"),
    Layout(4, 2, "torch", "low_latency"),  # attention-TP groups of 2: each child chunked
    Layout(2, 2, "none"),  # DP gather around the experts, per micro-batch
    Layout(2, 1, "torch", "normal"),  # no DP attention: every rank decides alike
]
_results: dict[Layout, list[dict]] = {}


def paths_for(tiny_models: dict[str, str], layout: Layout) -> dict[str, str]:
    # DeepSeek-V2 (the softmax router and q_proj of V3's family) in the two tp2-dp2 modes;
    # tp4-dp4 adds peers, not model code.
    every_model = layout.backend == "torch" and layout.tp == layout.dp == 2
    models = MODELS if every_model else MODELS[::2]
    return {name: tiny_models[name] for name in models}


def results_for(tiny_models: dict[str, str], layout: Layout) -> list[dict]:
    """Every rank's results of ``layout``. The layouts of one world run in one launch of its
    ranks, made by the first of them tested: starting the ranks costs more than a layout."""
    if layout not in _results:
        key = (layout.tp, layout.dp, layout.backend)
        world = [lay for lay in LAYOUTS if (lay.tp, lay.dp, lay.backend) == key]
        runs = [(lay, paths_for(tiny_models, lay)) for lay in world]
        results = run_ranks(tbo_worker, layout.tp, runs, timeout=240.0 * len(runs))
        for i, lay in enumerate(world):
            _results[lay] = [outs[i] for outs in results]
    return _results.pop(layout)


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda lay: f"tp{lay.tp}-dp{lay.dp}-{lay.backend}-{lay.deepep_mode}"
)
def test_tbo_equals_unsplit(tiny_models, layout):
    paths = paths_for(tiny_models, layout)
    results = results_for(tiny_models, layout)
    expected = SPLIT_STEPS_DP if layout.dp > 1 else SPLIT_STEPS_PLAIN
    for rank, out in enumerate(results):
        group = rank // (layout.tp // layout.dp)
        for name in paths:
            (plain, plain_split), (tbo, tbo_split) = out[name, False], out[name, True]
            assert not any(plain_split), f"{name} rank {rank}: split with TBO off"
            assert tbo_split == expected, f"{name} rank {rank} group {group}"
            assert_same(tbo, plain, f"{name} rank {rank}")
            counts = out[name, True, "counts"]
            if layout.dp > 1 and group % 2 == 1:
                assert counts["tbo", "idle"] == 1, counts  # the idle step ran split
