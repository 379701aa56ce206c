"""Single-batch overlap is exact, model level: every rank builds the same model with SBO off
and on (``--moe-a2a-backend torch``, every ``--deepep-mode``) and replays the overlap script
(extends with and without cached prefixes, decodes, an idle DP group whose batch is empty);
log-probabilities agree to 1e-5 (fp32) and greedy tokens are identical, for Qwen3-MoE,
DeepSeek-V2 and DeepSeek-V3. Small batches leave some local experts of some ranks without
tokens, and three blocks over two local experts leave a block empty."""

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


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    num_blocks: int | None = None
    mode: str = "normal"

    def server_args(self, path: str, sbo: bool) -> ServerArgs:
        return server_args(
            path, self.tp, self.dp, "torch", deepep_mode=self.mode,
            enable_single_batch_overlap=sbo, sbo_num_blocks=self.num_blocks if sbo else None,
        )  # fmt: skip


def sbo_worker(rank: int, n: int, init_method: str, runs: list[tuple[Layout, dict]]) -> list:
    """Each (layout, paths) of ``runs`` in turn (one world: the same tp and dp), on one set of
    process groups; → one dict per run."""
    torch.set_num_threads(1)
    dp = runs[0][0].dp
    parallel = init_parallel_state(n, rank, dp, dp > 1, "torch", "gloo", init_method)
    try:
        outs = []
        for layout, paths in runs:
            out = {}
            for name, path in paths.items():
                for sbo in (False, True):
                    runner = ModelRunner(layout.server_args(path, sbo), parallel=parallel)
                    out[name, sbo] = run_script(runner, layout.dp)[0]
                    out[name, sbo, "counts"] = dict(runner.step_counts)
                    out[name, sbo, "experts"] = runner.model.model.layers[
                        -1
                    ].mlp.experts.num_local_experts
            outs.append(out)
        return outs
    finally:
        parallel.destroy()


LAYOUTS = [
    Layout(2, 1),
    Layout(4, 4, num_blocks=3),
    Layout(2, 2, num_blocks=1),
    Layout(2, 2, mode="low_latency"),
    # auto: the pair wire (normal) in extends, the row wire (low_latency) in decodes, on 4 ranks
    # with an empty block; the default block count per mode is at tp2 above.
    Layout(4, 4, num_blocks=3, mode="auto"),
]
_results: dict[Layout, list[dict]] = {}


def paths_for(tiny_models: dict[str, str], layout: Layout) -> dict[str, str]:
    models = MODELS if layout.num_blocks is None else MODELS[::2]
    return {name: tiny_models[name] for name in models}


def results_for(tiny_models: dict[str, str], layout: Layout) -> list[dict]:
    """Every rank's results of ``layout``. The layouts of one world run in one launch of its
    ranks, made by the first of them tested: starting the ranks costs more than a layout."""
    if layout not in _results:
        world = [lay for lay in LAYOUTS if (lay.tp, lay.dp) == (layout.tp, layout.dp)]
        runs = [(lay, paths_for(tiny_models, lay)) for lay in world]
        results = run_ranks(sbo_worker, layout.tp, runs, timeout=240.0 * len(runs))
        for i, lay in enumerate(world):
            _results[lay] = [outs[i] for outs in results]
    return _results.pop(layout)


@pytest.mark.parametrize(
    "layout",
    LAYOUTS,
    ids=lambda lay: f"tp{lay.tp}-dp{lay.dp}-blocks{lay.num_blocks or 'default'}-{lay.mode}",
)
def test_sbo_equals_plain(tiny_models, layout):
    paths = paths_for(tiny_models, layout)
    results = results_for(tiny_models, layout)
    for rank, out in enumerate(results):
        for name in paths:
            assert_same(out[name, True], out[name, False], f"{name} rank {rank}")
            counts = out[name, True, "counts"]
            assert counts and all(overlap == "sbo" for overlap, _ in counts), counts
            assert not any(overlap == "sbo" for overlap, _ in out[name, False, "counts"])
            assert layout.num_blocks != 3 or out[name, True, "experts"] == 2  # an empty block
            if layout.dp > 1 and (rank // (layout.tp // layout.dp)) % 2 == 1:
                assert counts["sbo", "idle"] == 1, counts  # the empty batch ran SBO
