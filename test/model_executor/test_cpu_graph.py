"""CPU decode graphs (``srt.model_executor.cpu_graph``): a recorded decode forward, replayed,
gives the eager forward's logits bit for bit (padded buckets included, float32 and bfloat16,
MHA and MLA); the recorder replays what computes and skips what only shows memory; a forward
that reads a tensor's value on the host is refused at capture; the runner records graphs only
where a replay can hold the step."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.overlap_script import server_args
from helpers.seq_driver import SeqDriver

from srt.layers import cpu_kernels
from srt.model_executor.cpu_graph import CpuGraph, CpuGraphError
from srt.model_executor.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")

# 3 sequences (bucket 3), one more joins (4), 6 (bucket 6), then 9: above the largest (eager).
SCRIPT = [("extend", [[5, 77, 300], [44, 45, 46, 200], [101, 3]], None), ("decode",),
          ("decode",), ("extend", [[7, 8]], None), ("decode",), ("decode",),
          ("extend", [[9, 10, 11], [12]], None), ("decode",),
          ("extend", [[1, 2], [3], [4, 5, 6]], None), ("decode",)]  # fmt: skip


def _logits(runner: ModelRunner) -> list[torch.Tensor]:
    """Each step's logits, copied: a replay's are its graph's, which the next replay rewrites."""
    driver = SeqDriver(runner)
    return [runner.forward_step(driver.batch(a)).next_token_logits.float().clone() for a in SCRIPT]


@pytest.mark.parametrize(
    "model, dtype",
    [
        ("tiny-qwen3-moe", "float32"),
        ("tiny-qwen3-moe", "bfloat16"),
        ("tiny-deepseek-v3", "float32"),
    ],
)
def test_replay_equals_the_eager_forward_bit_for_bit(tiny_models, model, dtype):
    args = server_args(tiny_models[model], 1, 1, "none", dtype=dtype, cuda_graph_bs=[1, 3, 4, 6])
    runner = ModelRunner(args)
    assert runner.graph_runner is not None and not runner.graph_runner.eager
    got = _logits(runner)
    # decodes of 3, 3, 4, 4 and 6 sequences replayed, each from its own bucket; 9: eager
    assert runner.graph_runner.num_replays == 5
    want = _logits(ModelRunner(dataclasses.replace(args, disable_cuda_graph=True)))
    for step, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {step}: {(g - w).abs().max():.2e}"


def test_padding_rows_leave_the_real_rows(tiny_models):
    """Bucket 4 for 3 sequences: a padding row in every GEMM, attention and the experts. The
    C kernels give a row the same bits in any batch; this tiny model's experts (too narrow for
    the C kernel) run torch's grouped GEMM, whose sums may change with a group's row count."""
    args = server_args(tiny_models["tiny-qwen3-moe"], 1, 1, "none", cuda_graph_bs=[4])
    runner = ModelRunner(args)
    got = _logits(runner)
    assert runner.graph_runner.num_replays == 4  # 3 (padded), 3 (padded), 4, 4
    want = _logits(ModelRunner(dataclasses.replace(args, disable_cuda_graph=True)))
    for step, (g, w) in enumerate(zip(got, want)):
        g, w = torch.log_softmax(g, -1), torch.log_softmax(w, -1)
        assert (g - w).abs().max() <= 1e-5, f"step {step}: {(g - w).abs().max():.2e}"
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_the_recorder_replays_computation_and_keeps_views():
    x, y = torch.arange(6.0).reshape(2, 3), torch.ones(3)
    buf = torch.zeros(3)
    graph = CpuGraph()

    def forward():
        z = (x * 2).reshape(-1)[:3] + y  # mul, add: computed; reshape, slice: views
        buf.copy_(z)  # writes its argument
        return z.to(torch.float64), buf.view(1, 3)  # to: a copy; view: nothing to run

    out64, view = graph.capture(forward)
    x.add_(1)
    y.fill_(-1)
    again64, again_view = graph.replay()
    assert again64 is out64 and again_view is view
    assert again64.tolist() == [1.0, 3.0, 5.0]  # 2·(x + 1) - 1 over x's first row
    assert buf.tolist() == [1.0, 3.0, 5.0] and view.tolist() == [[1.0, 3.0, 5.0]]


def test_kernel_calls_replay_as_one_program_between_torch_ops():
    """Consecutive C calls run as one program (one step), in order with the torch ops around
    them; a kernel's index check that fails in a replay raises as the op would."""
    x, positions = torch.randn(3, 2, 8), torch.tensor([0, 5, 2])
    cos_sin, weight = torch.randn(16, 8), torch.rand(8)

    def forward():
        rotated = cpu_kernels.rope(x, positions, cos_sin, True)
        normed = cpu_kernels.rms_norm(rotated, weight, 1e-6)  # with rope: one program
        return cpu_kernels.rms_norm(normed * 2, weight, 1e-6)  # mul, then a second program

    graph = CpuGraph()
    graph.capture(forward)
    assert len(graph._steps) == 3
    x.add_(1)
    assert torch.equal(graph.replay(), forward())
    positions[1] = 16  # past the table
    with pytest.raises(ValueError, match="srt::rope: positions holds a position outside"):
        graph.replay()


def test_casts_and_embeddings_replay_in_the_program():
    """A cast between float32 and bf16 and an embedding's gather join the kernels' program
    (one step for the whole forward), with torch's bits; a bad index raises in the replay."""
    table, ids, positions = torch.randn(10, 8), torch.tensor([3, 7]), torch.tensor([0, 1])
    cos_sin = torch.randn(16, 4)

    def forward():
        rows = torch.nn.functional.embedding(ids, table).bfloat16()  # a gather, then a cast
        return cpu_kernels.rope(rows.view(2, 2, 4), positions, cos_sin, True).float()

    graph = CpuGraph()
    graph.capture(forward)
    assert len(graph._steps) == 1
    ids.copy_(torch.tensor([9, 0]))
    table.mul_(2)
    assert torch.equal(graph.replay(), forward())
    ids[1] = 10
    with pytest.raises(ValueError, match="srt::gather_rows: indices hold a row outside"):
        graph.replay()


def test_a_host_read_is_refused_at_capture():
    x = torch.ones(2)
    with pytest.raises(CpuGraphError, match="item"):
        CpuGraph().capture(lambda: x * x.sum().item())
    with pytest.raises(CpuGraphError, match="tolist"):  # no op the recorder sees
        CpuGraph().capture(lambda: x * len(x.tolist()))
    with pytest.raises(CpuGraphError, match="lift_fresh"):  # a tensor of Python values
        CpuGraph().capture(lambda: x * torch.tensor([1.0, 2.0]))
    CpuGraph().capture(lambda: x * 2)  # the recorder was released


def test_a_forward_that_reads_the_host_decodes_eagerly(tiny_models, tmp_path):
    """fp8 experts too narrow for the C kernel run one GEMM per expert, their row counts read
    on the host: the first decode finds it, runs eagerly, and the graphs are off."""
    from benchmark.common.fp8_checkpoint import quantize_checkpoint

    path = quantize_checkpoint(tiny_models["tiny-qwen3-moe"], str(tmp_path / "fp8"), (128, 128))
    args = server_args(path, 1, 1, "none")
    runner = ModelRunner(args)
    assert runner.graph_runner is not None  # a bucket is recorded by its first decode
    got = _logits(runner)
    assert runner.graph_runner is None and not runner.last_step_replayed_graph
    want = _logits(ModelRunner(dataclasses.replace(args, disable_cuda_graph=True)))
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_graphs_only_where_a_replay_holds_the_step(tiny_models):
    path = tiny_models["tiny-qwen3-moe"]
    assert (
        ModelRunner(server_args(path, 1, 1, "none", disable_cuda_graph=True)).graph_runner is None
    )
    native = server_args(path, 1, 1, "none", attention_backend="torch_native")
    assert ModelRunner(native).graph_runner is None  # its decode metadata is host values
    fp16_kv = server_args(path, 1, 1, "none", kv_cache_dtype="float16")
    assert ModelRunner(fp16_kv).graph_runner is None  # that cache decodes on SDPA


def test_the_expert_recorder_counts_replayed_decodes(tiny_models):
    """A single-rank server's routes record decode steps too: the graphs capture the count."""
    runner = ModelRunner(server_args(tiny_models["tiny-qwen3-moe"], 1, 1, "none"))
    recorder, driver = runner.expert_recorder, SeqDriver(runner)
    recorder.start()
    runner.forward_step(driver.batch(SCRIPT[0]))  # 9 prompt tokens
    prefill = recorder.counts.sum().item()
    runner.forward_step(driver.batch(("decode",)))  # 3 tokens, replayed
    assert runner.last_step_replayed_graph
    assert (recorder.counts.sum().item() - prefill) * 9 == prefill * 3 > 0
