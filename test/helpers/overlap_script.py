"""The script the overlap exactness tests replay on every rank, once per variant (overlap off
and on), as the scheduler runs it: the TBO proposal, the MLP sync, then a forward or an idle
forward. Built on SeqDriver."""

from __future__ import annotations

import numpy as np
import torch

from helpers.seq_driver import SeqDriver
from srt.model_executor.forward_batch_info import SPLIT_MODES
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


def server_args(path: str, tp: int, dp: int, backend: str, **overrides) -> ServerArgs:
    """fp32 on CPU, a small KV pool, DP attention when ``dp > 1``."""
    kwargs = dict(
        model_path=path,
        dtype="float32",
        device="cpu",
        max_total_tokens=1024,
        max_running_requests=16,
        chunked_prefill_size=64,
        tp_size=tp,
        dp_size=dp,
        enable_dp_attention=dp > 1,
        moe_a2a_backend=backend,
    )
    return ServerArgs(**(kwargs | overrides))


def logprobs(out) -> tuple:
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
        out = runner.forward_step(batch)
        if batch is None:  # another group has work (the script has no all-idle step)
            assert dp > 1 and out.next_token_logits.shape[0] == 0
            split.append(runner.step_overlap.mode in SPLIT_MODES)  # the settled mode
            continue
        results.append(logprobs(out))
        split.append(batch.split.is_split)
    return results, split


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
