"""Single-batch overlap's CUDA path on one GPU: a one-rank nccl world with the SBO combine group
(limited CTAs), block combines on the alternate stream, the SM carve-out around the down GEMMs;
the blocked combine equals the plain one in every dispatch mode (fp32 through the Triton
kernel, ≤ 1e-5; bf16 through torch._grouped_mm on sm90+), and low_latency's (a decode under
``auto`` too) runs under ``forbid_host_sync`` with CUDA's sync debug mode set to error."""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers.run_ranks import free_port

from srt.distributed.parallel_state import init_parallel_state
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.moe.token_dispatcher.factory import create_dispatcher
from srt.layers.overlap.single_batch_overlap import CudaCombineStream, SmSplit
from srt.utils.sync_guard import forbid_host_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
HIDDEN, INTER, TOP_K, EXPERTS = 64, 96, 2, 8


@pytest.fixture(scope="module")
def parallel():
    state = init_parallel_state(
        1, 0, moe_a2a_backend="torch", backend="nccl",
        init_method=f"tcp://127.0.0.1:{free_port()}", sbo_combine_ctas=3,
    )  # fmt: skip
    yield state
    state.destroy()


def _inputs(num_tokens: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)]
    ids = torch.stack(rows) if rows else torch.empty(0, TOP_K, dtype=torch.int64)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    return hidden.cuda(), torch.rand(num_tokens, TOP_K, generator=gen).cuda(), ids.cuda()


def _blocked(dispatcher, experts: FusedMoE, inputs, is_extend: bool) -> torch.Tensor:
    dispatcher.dispatch_a(*inputs, is_extend=is_extend)
    hidden, weights, ids = dispatcher.dispatch_b()
    blocks = experts.up_project_blocks(hidden, weights, ids, dispatcher.overlap_args)
    dispatcher.combine_a_blocks(lambda i: experts.down_project_block(blocks, i))
    return dispatcher.combine_b()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_blocked_combine_on_the_alternate_stream(parallel, mode, dtype):
    assert parallel.moe_ep_combine is not None
    experts = FusedMoE(EXPERTS, HIDDEN, INTER).cuda()
    torch.nn.init.normal_(experts.w13_weight, std=0.2)
    torch.nn.init.normal_(experts.w2_weight, std=0.2)
    experts.to(dtype)
    dispatcher = create_dispatcher(
        "torch", mode, groups=parallel.moe_ep_device_groups, num_experts=EXPERTS, top_k=TOP_K,
        hidden_size=HIDDEN, dtype=dtype, max_dispatch_tokens_per_rank=64,
        device="cuda", sbo_num_blocks=3, combine_group=parallel.moe_ep_combine,
    )  # fmt: skip
    for seed, num_tokens in enumerate((0, 1, 37)):
        inputs, is_extend = _inputs(num_tokens, seed, dtype), seed % 2 == 0
        sync_free = mode == "low_latency" or (mode == "auto" and not is_extend)
        with forbid_host_sync("cuda") if sync_free else contextlib.nullcontext():
            out = _blocked(dispatcher, experts, inputs, is_extend)
        expected = experts(*inputs)
        assert out.shape == expected.shape and out.dtype == expected.dtype
        if num_tokens:
            # bf16: each block's partial sums are rounded to bf16 on the wire
            tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * expected.abs().max().item()
            assert (out.float() - expected.float()).abs().max().item() <= tolerance


def test_sm_split_and_carveout():
    device = torch.device("cuda", torch.cuda.current_device())
    split = SmSplit.for_device(device, None)
    props = torch.cuda.get_device_properties(device)
    assert split.total == props.multi_processor_count
    assert split.communicate == (32 if props.major == 10 else 3)
    stream = CudaCombineStream(device, split)
    before = torch._C._get_sm_carveout_experimental()
    with stream.compute_sms():
        assert torch._C._get_sm_carveout_experimental() == split.communicate
    assert torch._C._get_sm_carveout_experimental() == before
