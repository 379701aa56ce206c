"""The experts' kernel choice (``choose_expert_kernel``) per device, dtype and shapes; the
layouts ``FusedMoE.prepare_for_cpu`` makes for it; the pair sort every kernel starts from; and
``ExpertCompute``'s whole output against its block halves, for every kernel."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from srt.layers import cpu_kernels
from srt.layers.moe.expert_compute import compute_experts
from srt.layers.moe.expert_kernel import ExpertKernel, choose_expert_kernel
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.moe.sorted_pairs import expert_ends, sort_pairs

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
FITS = cpu_kernels.available()  # 128 is a whole number of panels of every width
TRITON = "triton" if importlib.util.find_spec("triton") else "loop"


@pytest.mark.parametrize(
    "device, dtype, hidden, inter, in_panels, expected",
    [
        (CPU, torch.float32, 128, 128, True, "cpu_kernel" if FITS else "grouped_mm"),
        (CPU, torch.float32, 128, 128, False, "grouped_mm"),  # torch's layout
        (CPU, torch.float32, 128, 48, True, "grouped_mm"),  # the gate splits a panel
        (CPU, torch.bfloat16, 128, 128, True, "cpu_kernel" if FITS else "grouped_mm"),
        (CPU, torch.bfloat16, 128, 48, True, "grouped_mm"),
        (CPU, torch.float8_e4m3fn, 128, 128, True, "cpu_kernel" if FITS else "loop"),
        (CPU, torch.float8_e4m3fn, 128, 48, True, "loop"),  # no grouped GEMM with scales
        (CPU, torch.float32, 12, 6, True, "loop"),  # rows not in 16-byte units
        (CPU, torch.float32, 512, 512, False, "loop"),  # 2 MiB of gate/up: the loop streams it
        (CUDA, torch.float32, 128, 128, True, TRITON),  # grouped_mm: bf16 only
        (CUDA, torch.float16, 128, 128, True, TRITON),
    ],
)
def test_choice(device, dtype, hidden, inter, in_panels, expected):
    assert choose_expert_kernel(device, dtype, hidden, inter, in_panels) is ExpertKernel(expected)


@pytest.mark.parametrize("hidden, inter", [(128, 128), (16, 8), (512, 512)])
def test_prepare_for_cpu_lays_out_what_its_kernel_reads(hidden, inter):
    moe = FusedMoE(4, hidden, inter)
    assert moe.kernel is choose_expert_kernel(CPU, torch.float32, hidden, inter, False)
    moe.prepare_for_cpu()
    kernel = choose_expert_kernel(CPU, torch.float32, hidden, inter)
    assert moe.kernel is kernel
    assert (moe.panels is not None) == (kernel is ExpertKernel.CPU_KERNEL)
    expect_packed = kernel is ExpertKernel.LOOP and torch.backends.mkldnn.is_available()
    assert (moe.packed is not None) == expect_packed


def test_sort_pairs_orders_by_local_expert_others_last():
    ids = torch.tensor([[5, 0], [-1, 4], [7, 5]])  # rank 1 of 2: experts 4..7 local
    pairs = sort_pairs(ids, start=4, num_local_experts=4)
    assert pairs.local.tolist() == [1, 4, 4, 0, 3, 1]
    assert pairs.order.tolist() == [3, 0, 5, 4, 1, 2]  # stable: pair 0 before pair 5
    assert pairs.sorted_local.tolist() == [0, 1, 1, 3, 4, 4]
    assert expert_ends(pairs.sorted_local, 4).tolist() == [1, 3, 3, 4]


FP8_KERNELS = [k for k in ExpertKernel if k is not ExpertKernel.GROUPED_MM]  # no scales there


@pytest.mark.parametrize(
    "kernel, fp8", [(k, False) for k in ExpertKernel] + [(k, True) for k in FP8_KERNELS]
)
def test_output_equals_the_sum_of_its_blocks(kernel, fp8):
    torch.manual_seed(0)
    moe = FusedMoE(8, 64, 64, ep_rank=1, ep_size=2)
    torch.nn.init.normal_(moe.w13_weight, std=0.2)
    torch.nn.init.normal_(moe.w2_weight, std=0.2)
    if fp8:
        moe.quantize_loaded((128, 128))
    if kernel is ExpertKernel.CPU_KERNEL:
        moe.prepare_for_cpu()
        if moe.panels is None:
            pytest.skip("no C kernels on this machine")
    x, ids, weights = torch.randn(9, 64), torch.randint(0, 8, (9, 3)), torch.rand(9, 3)
    ids[0, 1] = -1  # a slot masked by the dispatcher
    compute = compute_experts(moe, kernel, x, weights, ids)
    whole = compute.output()
    blocks = compute.row_sums(range(0, 1)) + compute.row_sums(range(1, 4))
    torch.testing.assert_close(whole, blocks, atol=1e-5, rtol=1e-5)
    if kernel is moe.kernel:
        assert torch.equal(moe(x, weights, ids), whole)
