"""EPLB is exact, model level: two ranks (DP attention, torch all-to-all) build each tiny model
without EPLB, with a placement that moves every expert and gives two of them a second copy on
the other rank, and with live rebalancing (twice during the script, weights moved between the
ranks), in each overlap mode (off, and TBO, SBO and DBO on every step), and replay the overlap
tests' script through each; four ranks (attention-TP groups of two) do the same with four
copies for Qwen3-MoE and DeepSeek-V3, overlap off and TBO. Log-probabilities agree to 1e-5
(fp32), greedy tokens are identical, the copies did take tokens (the map was applied) and both
rebalances ran."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.overlap_script import MODELS, assert_same, run_script, server_args
from helpers.run_ranks import run_ranks

from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.slow  # starts processes

MODES = {
    "off": {},
    "tbo": dict(enable_two_batch_overlap=True, tbo_decode_token_threshold=0,
                tbo_prefill_token_threshold=0),
    "sbo": dict(enable_single_batch_overlap=True),
    "dbo": dict(enable_dbo=True, dbo_decode_token_threshold=0, dbo_prefill_token_threshold=0),
}  # fmt: skip


def placement(layers: int, experts: int, redundant: int) -> list[list[int]]:
    """Each layer: its experts shuffled over the first slots, then copies of experts spread
    over the shuffle (one from each rank's share at EP 2), so a rank holds a copy of an expert
    whose original is on another rank."""
    rows = []
    for layer in range(layers):
        perm = torch.randperm(experts, generator=torch.Generator().manual_seed(layer)).tolist()
        rows.append(perm + [perm[i * experts // redundant] for i in range(redundant)])
    return rows


def eplb_worker(
    rank: int, n: int, init_method: str, paths: dict, files: dict, modes: tuple
) -> dict:
    """EP ``n`` (= TP ``n``, DP attention in 2 groups), ``n`` redundant experts."""
    torch.set_num_threads(1)
    parallel = init_parallel_state(n, rank, 2, True, "torch", "gloo", init_method)
    # live: rebalanced from the routing counted after the 3rd and the 6th of the 8 steps
    live = dict(enable_eplb=True, eplb_rebalance_num_iterations=3, ep_num_redundant_experts=n)
    try:
        out = {}
        for name, path in paths.items():
            for mode in modes:
                static = dict(ep_num_redundant_experts=n, init_expert_location=files[name])
                for eplb, extra in ((False, {}), (True, static), ("live", live)):
                    args = server_args(path, n, 2, "torch", **MODES[mode], **extra)
                    runner = ModelRunner(args, parallel=parallel)
                    out[name, mode, eplb] = run_script(runner, 2)
                    if eplb is True:
                        out[name, mode, "copies"] = copies_used(runner)
                    if eplb == "live":
                        out[name, mode, "rebalances"] = runner.eplb.num_rebalances
        return out
    finally:
        parallel.destroy()


def copies_used(runner: ModelRunner) -> bool:
    """Whether some MoE layer's map sends a row to a copy other than an expert's first: run on
    the ids of the first expert that has two copies, for a few rows."""
    for layer in runner.model.model.layers:
        dispatch_map = getattr(layer.mlp, "dispatch_map", None)
        if dispatch_map is None:
            continue
        expert = int(torch.nonzero(dispatch_map.counts > 1)[0])
        picked = dispatch_map(torch.full((4, 1), expert, dtype=torch.long))
        return len(set(picked.flatten().tolist())) == 2
    return False


@pytest.mark.parametrize(
    "ep, models, modes",
    [(2, MODELS, tuple(MODES)), (4, MODELS[::2], ("off", "tbo"))],
    ids=["ep2", "ep4"],
)
def test_eplb_equals_the_plain_placement(tiny_models, tmp_path, ep, models, modes):
    paths = {name: tiny_models[name] for name in models}
    files = {}
    for name, path in paths.items():
        config = json.loads((Path(path) / "config.json").read_text())
        experts = config.get("num_experts") or config["n_routed_experts"]
        files[name] = str(tmp_path / f"{name}.json")
        rows = placement(config["num_hidden_layers"], experts, ep)
        (tmp_path / f"{name}.json").write_text(json.dumps({"physical_to_logical_map": rows}))
    results = run_ranks(eplb_worker, ep, paths, files, modes, timeout=600.0)
    for rank, out in enumerate(results):
        for name in paths:
            for mode in modes:
                plain, plain_split = out[name, mode, False]
                for eplb in (True, "live"):
                    got, split = out[name, mode, eplb]
                    what = f"{name} {mode} eplb={eplb} rank {rank}"
                    assert split == plain_split, what
                    assert (mode in ("tbo", "dbo")) == any(split), f"{what}: split?"
                    assert_same(got, plain, what)
                assert out[name, mode, "copies"], f"{name} {mode}: no copy took a row"
                assert out[name, mode, "rebalances"] == 2, f"{name} {mode}: not rebalanced"
