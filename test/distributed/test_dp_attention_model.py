"""DP attention and expert-parallel all-to-all, model level: every rank builds a ModelRunner
(fp32, tiny Qwen3-MoE and DeepSeek-V3) in a real gloo world; each attention-DP group replays its
own script of batches (different prompts and token counts, idle steps, an extend in one group
while another decodes), with the MLP sync before each step as the scheduler does it. The logits
of every group equal the single-rank ModelRunner's on the same batches.

Covered: tp=2 dp=2 with ``--moe-a2a-backend none`` (padded DP gather, LM head over the world
and over the group), torch normal / low_latency / auto (auto's low_latency capacity exceeded in
one decode step); tp=4 dp=4 torch; tp=4 dp=2 (attention-TP groups of 2: chunks, one of them
empty); tp=2 torch without DP attention (no sync; an empty chunk)."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.run_ranks import run_ranks
from helpers.seq_driver import SeqDriver
from safetensors.torch import save_file

from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.model_runner import ModelRunner
from srt.model_loader.weight_utils import iterate_safetensors
from srt.server_args import ServerArgs

pytestmark = pytest.mark.slow  # starts processes

TOLERANCE = 1e-5
MODELS = ("tiny-qwen3-moe", "tiny-deepseek-v3")
P0 = [[5, 77, 300, 12, 9], [44, 45, 46, 200, 310, 17, 8, 90, 91], [101, 3, 4]]
P1 = [[7, 8, 9, 10, 11, 12, 13]]  # one sequence: its decode leaves an attention-TP chunk empty
P2 = [[250, 90, 71, 6], [33, 2, 18, 401, 2, 3]]
# One column per DP group; row = step. None: the group has no batch (idle).
DP_SCRIPT = [
    [("extend", P0, None), ("extend", P1, 2)],  # group 1 wants input logprobs
    [("decode",), None],
    [None, ("decode",)],
    [("extend", P2, None), ("decode",)],  # an extend in the batch while group 1 decodes
    [("decode",), ("decode",)],
    [None, None],  # every group idle: nothing runs
]
PLAIN_SCRIPT = [[("extend", P1, None)], [("decode",)], [("extend", P0, 1)], [("decode",)]]


@dataclass(frozen=True)
class Layout:
    tp: int
    dp: int
    backend: str = "none"
    deepep_mode: str = "auto"
    capacity: int = 64
    dp_lm_head: bool = False

    def server_args(self, path: str, tp: int | None = None, **overrides) -> ServerArgs:
        kwargs = dict(
            model_path=path,
            dtype="float32",
            device="cpu",
            max_total_tokens=512,
            max_running_requests=8,
            chunked_prefill_size=64,
            tp_size=self.tp if tp is None else tp,
        )
        if tp is None:
            kwargs |= dict(
                dp_size=self.dp,
                enable_dp_attention=self.dp > 1,
                enable_dp_lm_head=self.dp_lm_head,
                moe_a2a_backend=self.backend,
                deepep_mode=self.deepep_mode,
                max_dispatch_tokens_per_rank=self.capacity,
            )
        return ServerArgs(**(kwargs | overrides))


def script_for(layout: Layout) -> list[list]:
    if layout.dp == 1:
        return PLAIN_SCRIPT
    return [[step[d % 2] for d in range(layout.dp)] for step in DP_SCRIPT]


def _numpy(out) -> tuple:
    extra = None if out.input_token_logits is None else out.input_token_logits.numpy()
    return out.next_token_logits.numpy(), extra


def run_group_script(runner: ModelRunner, layout: Layout, script: list[list]) -> list:
    """This rank's group's column of ``script``, as its scheduler would run it."""
    parallel = runner.parallel
    group = parallel.attn_dp_rank
    driver, results = SeqDriver(runner, salt=group), []
    for step in script:
        batch = driver.batch(step[group]) if step[group] else None
        out = runner.forward_step(batch)
        if batch is not None:
            results.append(_numpy(out))
        elif out is not None:  # an IDLE forward: another group has work
            assert layout.dp > 1 and out.next_token_logits.shape[0] == 0
    return results


def dp_worker(rank: int, n: int, init_method: str, layout_runs: list) -> list[dict]:
    """Each (layout, runs) of ``layout_runs`` in turn (one world: the same tp, dp and backend),
    on one set of process groups; → one dict per layout."""
    torch.set_num_threads(1)
    first = layout_runs[0][0]
    parallel = init_parallel_state(
        n, rank, first.dp, first.dp > 1, first.backend, "gloo", init_method
    )
    try:
        outs = []
        for layout, runs in layout_runs:
            out = {}
            for label, path, overrides in runs:
                runner = ModelRunner(layout.server_args(path, **overrides), parallel=parallel)
                out[label] = run_group_script(runner, layout, script_for(layout))
            outs.append(out)
        return outs
    finally:
        parallel.destroy()


@functools.cache
def reference(path: str, layout: Layout) -> tuple[list, ...]:
    """Single-rank logits of every group's column of the script."""
    script = script_for(layout)
    columns = []
    for group in range(layout.dp):
        runner = ModelRunner(layout.server_args(path, tp=1))
        driver = SeqDriver(runner, salt=group)
        steps = [step[group] for step in script if step[group]]
        columns.append([_numpy(runner.forward_step(driver.batch(a))) for a in steps])
    return tuple(columns)


def assert_close(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), what
    for i, ((next_got, in_got), (next_want, in_want)) in enumerate(zip(got, want)):
        assert (in_got is None) == (in_want is None), f"{what} step {i}"
        for name, a, b in (("logits", next_got, next_want), ("input logits", in_got, in_want)):
            if b is None:
                continue
            assert a.shape == b.shape, f"{what} step {i} {name}"
            diff = float(np.abs(a - b).max(initial=0.0))
            tolerance = TOLERANCE * max(1.0, float(np.abs(b).max(initial=0.0)))  # fp32 relative
            assert diff <= tolerance, f"{what} step {i} {name}: max diff {diff:.2e}"


def check_layout(tiny_models: dict[str, str], layout: Layout, extra_runs: list = ()) -> list:
    runs = [(name, tiny_models[name], {}) for name in MODELS] + list(extra_runs)
    if layout in A2A_LAYOUTS and not extra_runs:
        results = a2a_results(tiny_models, layout)
    else:
        launch = run_ranks(dp_worker, layout.tp, [(layout, runs)], timeout=120.0)
        results = [outs[0] for outs in launch]
    attn_tp = layout.tp // layout.dp
    for rank, out in enumerate(results):
        for label, path, _ in runs:
            want = reference(path, layout)[rank // attn_tp]
            assert_close(out[label], want, f"{label} rank {rank}")
    return results


A2A_LAYOUTS = [
    Layout(2, 2, "torch", "normal", dp_lm_head=True),
    Layout(2, 2, "torch", "low_latency"),
    Layout(2, 2, "torch", "auto", capacity=2),  # the 3-sequence decodes exceed it
    Layout(4, 4, "torch", "auto"),
    Layout(4, 2, "torch", "low_latency"),
    Layout(2, 1, "torch", "normal"),  # all-to-all without DP attention
]
_results: dict[Layout, list[dict]] = {}


def a2a_results(tiny_models: dict[str, str], layout: Layout) -> list[dict]:
    """Every rank's results of ``layout``, every model. The layouts of one world run in one
    launch of its ranks, made by the first of them tested: starting the ranks costs more than
    a layout."""
    if layout not in _results:
        key = (layout.tp, layout.dp, layout.backend)
        world = [lay for lay in A2A_LAYOUTS if (lay.tp, lay.dp, lay.backend) == key]
        runs = [(name, tiny_models[name], {}) for name in MODELS]
        results = run_ranks(
            dp_worker, layout.tp, [(lay, runs) for lay in world], timeout=120.0 * len(world)
        )
        for i, lay in enumerate(world):
            _results[lay] = [outs[i] for outs in results]
    return _results.pop(layout)


@pytest.mark.parametrize(
    "layout",
    A2A_LAYOUTS,
    ids=lambda layout: f"tp{layout.tp}-dp{layout.dp}-{layout.backend}-{layout.deepep_mode}",
)
def test_all_to_all_equals_single_rank(tiny_models, layout):
    check_layout(tiny_models, layout)


@pytest.fixture(scope="module")
def tied_qwen_path(tmp_path_factory, qwen3_moe_path) -> str:
    """The tiny Qwen3-MoE with tied word embeddings: no ``lm_head.weight`` in the checkpoint."""
    path = tmp_path_factory.mktemp("tied-qwen3-moe")
    config = json.loads((Path(qwen3_moe_path) / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": True}))
    tensors = dict(iterate_safetensors(qwen3_moe_path))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    return str(path)


def test_dp_gather_and_lm_head_over_world_or_group(tiny_models, tied_qwen_path):
    """tp=2 dp=2 ``--moe-a2a-backend none``; Qwen also with ``--enable-dp-lm-head``, and tied
    (the LM head over the world loads its own shard of the group-sharded embedding)."""
    layout = Layout(2, 2)
    qwen = ("qwen-dp-lm-head", tiny_models["tiny-qwen3-moe"], {"enable_dp_lm_head": True})
    tied = ("qwen-tied", tied_qwen_path, {})
    results = check_layout(tiny_models, layout, [qwen, tied])
    for out in results:
        for (a, _), (b, _) in zip(out["tiny-qwen3-moe"], out["qwen-dp-lm-head"]):
            assert float(np.abs(a - b).max(initial=0.0)) <= TOLERANCE


def test_dp_gather_with_attention_tp_groups(tiny_models):
    """tp=4 dp=2: groups of 2 ranks each send a chunk; group 1's decode leaves one empty."""
    check_layout(tiny_models, Layout(4, 2))
