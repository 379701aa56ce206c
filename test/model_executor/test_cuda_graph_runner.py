"""The CUDA-graph runner's logic on CPU: "captured" callables run eagerly over the runner's
static buffers (``eager=True``), with the Triton attention backend under Triton's interpreter.
Decode through the buckets (padded batches included, with two-batch overlap captured in the
bucket's graph) equals the plain eager forward of the torch-native backend in fp32, on one rank
and on two with DP attention and the ``low_latency`` all-to-all (every group padded to one
bucket, an idle group replaying padding rows only; TBO, and SBO with its blocked combine); a
batch above the largest bucket decodes eagerly; the flags resolve to their buckets."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.overlap_script import server_args
from helpers.run_ranks import run_ranks
from helpers.seq_driver import SeqDriver

from srt.distributed.parallel_state import init_parallel_state
from srt.model_executor.cuda_graph_runner import CudaGraphRunner
from srt.model_executor.model_runner import ModelRunner
from srt.server_args import ServerArgs
from srt.server_args_checks import cuda_graph_batch_sizes

BUCKETS = [1, 2, 4]
# Decode 3 sequences (bucket 4: one padding row), then 5 (above the buckets: eager).
SCRIPT = [("extend", [[5, 77, 300], [44, 45, 46, 200], [101, 3]], None), ("decode",),
          ("decode",), ("extend", [[7, 8], [9, 10, 11]], None), ("decode",)]  # fmt: skip


def _logprobs(runner: ModelRunner) -> list[np.ndarray]:
    driver, out = SeqDriver(runner), []
    for action in SCRIPT:
        logits = runner.forward_step(driver.batch(action)).next_token_logits
        out.append(torch.log_softmax(logits, -1).numpy())
    return out


def test_bucket_replay_equals_eager_forward(tiny_models):
    """One rank, TBO captured in the buckets' graphs (MLA's absorbed attention, under DP
    attention, is below: the interpreter is slow, so each case is run once)."""
    overrides = dict(
        enable_two_batch_overlap=True, tbo_decode_token_threshold=0, tbo_prefill_token_threshold=0
    )
    path = tiny_models["tiny-qwen3-moe"]
    want = _logprobs(ModelRunner(server_args(path, 1, 1, "torch", **overrides)))
    runner = ModelRunner(server_args(path, 1, 1, "torch", attention_backend="triton", **overrides))
    runner.graph_runner = graphs = CudaGraphRunner(runner, BUCKETS, eager=True)
    assert graphs.graphs[4].batch.split.mode == "tbo"  # both micro-batches in one "graph"
    got = _logprobs(runner)
    assert graphs.num_replays == 2  # the two decodes of 3 sequences; 5 ran eagerly
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, step
        assert np.abs(g - w).max() <= 1e-5, f"step {step}: {np.abs(g - w).max():.2e}"
        assert (g.argmax(-1) == w.argmax(-1)).all()


# One column per DP group; None: the group has no batch (group 1 idle while group 0 decodes).
DP_SCRIPT = [
    [SCRIPT[0], ("extend", [[8, 9, 10], [11, 12]], None)],
    [("decode",), ("decode",)],  # 3 and 2 sequences: both groups at bucket 4
    [("decode",), None],  # group 1 replays padding rows only
    [SCRIPT[3], None],
    [("decode",), ("decode",)],  # 5 sequences in group 0: every group eager
]


OVERLAPS = {
    "tbo": dict(
        enable_two_batch_overlap=True, tbo_decode_token_threshold=0, tbo_prefill_token_threshold=0
    ),
    "sbo": dict(enable_single_batch_overlap=True, sbo_num_blocks=3),
}


def dp_worker(rank: int, n: int, init_method: str, cases: list[tuple[str, str]]) -> list[dict]:
    """Each (path, overlap) of ``cases`` in turn, on one set of process groups."""
    torch.set_num_threads(1)
    parallel = init_parallel_state(n, rank, n, True, "torch", "gloo", init_method)
    try:
        outs = []
        for path, overlap in cases:
            out = {}
            for graphs in (False, True):
                sa = server_args(
                    path, n, n, "torch", deepep_mode="low_latency",
                    max_dispatch_tokens_per_rank=64,
                    attention_backend="triton" if graphs else "auto", **OVERLAPS[overlap],
                )  # fmt: skip
                runner = ModelRunner(sa, parallel=parallel)
                if graphs:
                    runner.graph_runner = CudaGraphRunner(runner, BUCKETS, eager=True)
                driver, logprobs = SeqDriver(runner, salt=rank), []
                for step in DP_SCRIPT:
                    action = step[rank]
                    logits = runner.forward_step(driver.batch(action) if action else None)
                    logprobs.append(torch.log_softmax(logits.next_token_logits, -1).numpy())
                out[graphs] = logprobs
            out["replays"] = runner.graph_runner.num_replays
            out["counts"] = dict(runner.step_counts)
            outs.append(out)
        return outs
    finally:
        parallel.destroy()


DP_CASES = [("tiny-qwen3-moe", "tbo"), ("tiny-deepseek-v3", "sbo")]
DP_TOLERANCE = 3e-5
_dp_results: dict[tuple[str, str], list[dict]] = {}


def dp_results(tiny_models: dict[str, str], case: tuple[str, str]) -> list[dict]:
    """Every rank's results of ``case``. Both cases run in one launch of the two ranks, made by
    the first tested: starting the ranks costs more than a case."""
    if case not in _dp_results:
        cases = [(tiny_models[model], overlap) for model, overlap in DP_CASES]
        results = run_ranks(dp_worker, 2, cases, timeout=300 * len(cases))
        for i, each in enumerate(DP_CASES):
            _dp_results[each] = [outs[i] for outs in results]
    return _dp_results.pop(case)


@pytest.mark.slow  # starts rank processes
@pytest.mark.parametrize("model,overlap", DP_CASES)
def test_dp_attention_buckets_equal_eager(tiny_models, model, overlap):
    results = dp_results(tiny_models, (model, overlap))
    for rank, out in enumerate(results):
        assert out["replays"] == 2, rank  # steps 2 and 3, idle group included
        for step, (g, w) in enumerate(zip(out[True], out[False])):
            assert g.shape == w.shape, (rank, step)
            # Triton's attention against the C kernels' (whose sums follow the host's vector
            # width): a few float32 ulps of logprobs near -10, where one ulp is about 1e-6.
            assert np.abs(g - w).max(initial=0.0) <= DP_TOLERANCE, (rank, step)
            assert (g.argmax(-1) == w.argmax(-1)).all(), (rank, step)
    # the idle group's replay ran the overlap captured in the bucket's graph
    assert results[1]["counts"][overlap, "idle"] >= 1


def test_buckets_and_padding(tiny_models):
    runner = ModelRunner(server_args(tiny_models["tiny-qwen3-moe"], 1, 1, "none"))
    graphs = CudaGraphRunner(runner, [4, 1, 2], eager=True)
    assert [graphs.bucket(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    driver = SeqDriver(runner)
    runner.forward_step(driver.batch(SCRIPT[0]))
    batch = driver.batch(("decode",))
    assert graphs.can_run(batch)
    graphs._fill(batch, 3, 4)
    assert graphs.seq_lens[:4].tolist() == [*batch.seq_lens.tolist(), 1]
    assert graphs.out_cache_loc[3] == 0 and graphs.req_pool_indices[3] == 0  # the dummy slot


def test_cuda_graph_flags_resolve():
    assert cuda_graph_batch_sizes(None, None, 20) == [1, 2, 4, 8, 16]
    assert cuda_graph_batch_sizes(None, 24, 256) == [1, 2, 4, 8, 16, 24]
    assert cuda_graph_batch_sizes([3, 1, 3], None, 256) == [1, 3]
    with pytest.raises(ValueError, match="--cuda-graph-bs"):
        cuda_graph_batch_sizes([128], 64, 256)
    # CPU: every size to 8, then by 4 to 16 (a padding row costs a CPU its experts' reads)
    assert ServerArgs(model_path="m", device="cpu").cuda_graph_bs == [*range(1, 9), 12, 16]
    assert ServerArgs(model_path="m", device="cpu", cuda_graph_max_bs=6).cuda_graph_bs == [
        *range(1, 7)
    ]
