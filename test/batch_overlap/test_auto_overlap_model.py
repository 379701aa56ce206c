"""--overlap-mode auto is exact, model level: every rank replays the overlap script with overlap
off and with auto (calibrated at start-up as a server is), where the policy is replaced by one
that runs the allowed modes in turn, so consecutive steps switch between off, TBO and SBO;
log-probabilities agree with the plain run to 1e-5 (fp32), greedy tokens are identical, and all
three modes ran. With and without DP attention (there the step measurements travel on their own
all-gather), where the calibrated policies of all ranks agree."""

from __future__ import annotations

import pytest
import torch
from helpers.overlap_script import assert_same, run_script, server_args
from helpers.run_ranks import run_ranks

from srt.batch_overlap.overlap_policy import OverlapPolicy
from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.slow  # starts processes


class CyclingPolicy(OverlapPolicy):
    """Runs the modes a step may run in turn, whatever the timings: every switch happens."""

    def choose(self, kind, tokens, allowed):
        self.step += 1
        modes = [m for m in self.modes if m == "off" or m in allowed]
        mode = modes[self.step % len(modes)]
        self.step_counts[(kind, mode)] = self.step_counts.get((kind, mode), 0) + 1
        return mode


def auto_worker(rank: int, n: int, init_method: str, dp: int, paths: dict) -> dict:
    torch.set_num_threads(1)
    parallel = init_parallel_state(n, rank, dp, dp > 1, "torch", "gloo", init_method)
    try:
        out = {}
        for name, path in paths.items():
            for mode in ("off", "auto"):
                args = server_args(path, n, dp, "torch", deepep_mode="normal", overlap_mode=mode)
                runner = ModelRunner(args, parallel=parallel)
                policy = runner.step_overlap.policy
                if policy is not None:
                    out[name, "calibrated"] = policy.info()
                    runner.step_overlap.policy = CyclingPolicy(policy.modes)
                out[name, mode] = run_script(runner, dp)[0]
                out[name, mode, "counts"] = dict(runner.step_counts)
        return out
    finally:
        parallel.destroy()


# One model per layout, each family once: the policy, its calibration and the switches are
# model-blind; every family's TBO and SBO are exact at model level (test_tbo_model, test_sbo_model).
@pytest.mark.parametrize(
    "dp, model",
    [(2, "tiny-qwen3-moe"), (1, "tiny-deepseek-v3")],
    ids=["dp-attention", "no-dp-attention"],
)
def test_auto_equals_plain(tiny_models, dp, model):
    paths = {model: tiny_models[model]}
    results = run_ranks(auto_worker, 2, dp, paths, timeout=240.0)
    assert len(results) == 2
    for rank, out in enumerate(results):
        assert_same(out[model, "auto"], out[model, "off"], f"{model} rank {rank}")
        counts = out[model, "auto", "counts"]
        ran = {overlap for overlap, _ in counts}
        assert ran == {"off", "tbo", "sbo"}, counts
    # The real policies, after start-up: calibrated on timings, and rank 1's is rank 0's.
    first, second = (out[model, "calibrated"] for out in results)
    assert first["num_calibration_steps"] > 0 and first["estimates"], first
    assert second == first
