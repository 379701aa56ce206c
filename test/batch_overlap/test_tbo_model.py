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

import numpy as np
import pytest
import torch
from run_ranks import run_ranks
from seq_driver import SeqDriver

from srt.distributed.parallel_state import init_parallel_state
from srt.layers.dp_attention import apply_dp_sync, sync_dp_batch
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs

TOLERANCE = 1e-5
MODELS = ("tiny-qwen3-moe", "tiny-deepseek-v2", "tiny-deepseek-v3")
LONG = list(range(20, 60))
# One column per DP group (group d runs column d % 2); None: the group has no batch.
SCRIPT = [
    [("extend", [[5, 77, 300, 12, 9], [44, 45, 46, 200, 310, 17, 8, 90], [101, 3, 4]], None),
     ("extend", [[7, 8, 9, 10, 11, 12], [250, 90, 71, 6, 33]], 2)],  # input logprobs
    [("decode",), ("decode",)],
    [("decode",), None],  # group 1 idle: it runs an empty batch split in two
    [("continue", [[60, 61, 62, 63, 64, 65, 66], [70, 71, 72]]),
     ("continue", [[80, 81], [82, 83, 84, 85]])],  # next chunks of chunked prefills
    [("shared", [(0, 4, [90, 91, 92, 93]), (1, 6, [94, 95])]),
     ("shared", [(1, 3, [96, 97, 98]), (0, 5, [99])])],  # radix-cache hits
    [("extend", [[1, 2, 3], LONG, [4, 5]], None),
     ("extend", [LONG[:30], [6, 7]], None)],  # two-chunk: the long prompt is cut
    [("decode",), ("extend", [[8, 9, 10]], None)],  # modes differ: nobody splits
    [("decode",), ("decode",)],
]  # fmt: skip
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
        return ServerArgs(
            model_path=path,
            dtype="float32",
            device="cpu",
            max_total_tokens=1024,
            max_running_requests=16,
            chunked_prefill_size=64,
            tp_size=self.tp,
            dp_size=self.dp,
            enable_dp_attention=self.dp > 1,
            moe_a2a_backend=self.backend,
            deepep_mode=self.deepep_mode,
            max_dispatch_tokens_per_rank=64,
            enable_two_batch_overlap=tbo,
            tbo_decode_token_threshold=0,
            tbo_prefill_token_threshold=0,
        )


def _logprobs(out) -> tuple:
    extra = out.input_token_logits
    extra = None if extra is None else torch.log_softmax(extra, -1).numpy()
    return torch.log_softmax(out.next_token_logits, -1).numpy(), extra


def run_script(runner: ModelRunner, dp: int) -> tuple[list, list[bool]]:
    """This rank's group's column; → (per step of its own: log-probs; per step run: split?)."""
    parallel = runner.parallel
    group = parallel.attn_dp_rank
    driver, results, split = SeqDriver(runner, salt=group), [], []
    for step in SCRIPT:
        action = step[group % 2]
        batch = driver.batch(action) if action else None
        if dp > 1:
            if batch is not None:
                runner.plan_two_batch_overlap(batch)
            info = sync_dp_batch(parallel, batch)
            if batch is None:
                assert runner.forward_idle(info).next_token_logits.shape[0] == 0
                split.append(info.can_run_tbo)
                continue
            apply_dp_sync(batch, info)
        results.append(_logprobs(runner.forward(batch)))
        split.append(batch.can_run_tbo)
    return results, split


def tbo_worker(rank: int, n: int, init_method: str, layout: Layout, paths: dict) -> dict:
    torch.set_num_threads(1)
    parallel = init_parallel_state(
        n, rank, layout.dp, layout.dp > 1, layout.backend, "gloo", init_method
    )
    try:
        out = {}
        for name, path in paths.items():
            for tbo in (False, True):
                runner = ModelRunner(layout.server_args(path, tbo), parallel=parallel)
                out[name, tbo] = run_script(runner, layout.dp)
                out[name, tbo, "counts"] = dict(runner.forward_step_counts)
        return out
    finally:
        parallel.destroy()


def assert_same(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        for name, a, b in (("next", g[0], w[0]), ("input", g[1], w[1])):
            assert (a is None) == (b is None), f"{what} step {i} {name}"
            if b is None:
                continue
            diff = float(np.abs(a - b).max(initial=0.0))
            assert diff <= TOLERANCE, f"{what} step {i} {name} logprobs: max diff {diff:.2e}"
        assert (g[0].argmax(-1) == w[0].argmax(-1)).all(), f"{what} step {i}: greedy differs"


LAYOUTS = [
    Layout(2, 2, "torch", "normal"),
    Layout(2, 2, "torch", "low_latency"),
    Layout(4, 4, "torch", "auto"),
    Layout(4, 2, "torch", "low_latency"),  # attention-TP groups of 2: each child chunked
    Layout(2, 2, "none"),  # DP gather around the experts, per micro-batch
    Layout(2, 1, "torch", "normal"),  # no DP attention: every rank decides alike
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda lay: f"tp{lay.tp}-dp{lay.dp}-{lay.backend}-{lay.deepep_mode}"
)
def test_tbo_equals_unsplit(tiny_models, layout):
    every_model = layout.backend == "torch" and layout.tp == layout.dp  # tp2 dp2, tp4 dp4
    models = MODELS if every_model else MODELS[::2]
    paths = {name: tiny_models[name] for name in models}
    results = run_ranks(tbo_worker, layout.tp, layout, paths, timeout=240.0)
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
                assert counts[True, "idle"] == 1, counts  # the idle step ran split
