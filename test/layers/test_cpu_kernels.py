"""The CPU kernels (``srt.layers.cpu_kernels``): the experts' kernel equals the experts computed
in PyTorch and gives a token the same result bit for bit whatever batch it comes in; linear
layers on panels equal ``F.linear``; RMSNorm equals PyTorch's; the kernels stay off where
asked."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from srt.layers import cpu_kernels
from srt.layers.layernorm import RMSNorm
from srt.layers.linear import PanelWeight, ReplicatedLinear, linear, pack_weight
from srt.layers.moe.fused_moe import FusedMoE

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(), reason="no C compiler to build the kernel"
)
HIDDEN, INTER = 128, 128  # w13 [256, 128], w2 [128, 128]: several panels each


def _experts(ep_rank: int = 0, ep_size: int = 1) -> tuple[FusedMoE, FusedMoE]:
    """The same experts twice: as loaded (PyTorch) and packed for the kernel."""
    torch.manual_seed(ep_rank)
    plain, packed = (FusedMoE(8, HIDDEN, INTER, ep_rank=ep_rank, ep_size=ep_size) for _ in "ab")
    torch.nn.init.normal_(plain.w13_weight, std=0.1)
    torch.nn.init.normal_(plain.w2_weight, std=0.1)
    packed.load_state_dict(plain.state_dict())
    packed.prepare_for_cpu()
    assert packed.panels is not None and plain.panels is None
    return plain, packed


@pytest.mark.parametrize("num_tokens", [0, 1, 5, 37])
@pytest.mark.parametrize("ep_rank", [0, 1])
def test_kernel_equals_pytorch(num_tokens, ep_rank):
    plain, packed = _experts(ep_rank, ep_size=2)  # this rank holds experts 4·rank .. 4·rank+3
    x = torch.randn(num_tokens, HIDDEN)
    ids = torch.randint(0, 8, (num_tokens, 3))
    if num_tokens:
        ids[0] = torch.tensor([4, 5, 6]) - 4 * ep_rank  # all of them on the other rank
        ids[-1, 0] = -1  # a slot masked by the dispatcher
    weights = torch.rand(num_tokens, 3)
    out = packed(x, weights, ids)
    torch.testing.assert_close(out, plain(x, weights, ids), atol=1e-5, rtol=1e-5)
    if num_tokens:
        assert torch.equal(out[0], torch.zeros(HIDDEN))


def test_a_token_gets_the_same_bits_in_any_batch():
    _, packed = _experts()
    x = torch.randn(24, HIDDEN)
    ids = torch.randint(0, 8, (24, 2))
    weights = torch.rand(24, 2)
    whole = packed(x, weights, ids)
    halves = torch.cat([packed(x[:7], weights[:7], ids[:7]), packed(x[7:], weights[7:], ids[7:])])
    assert torch.equal(whole, halves)
    alone = torch.cat([packed(x[i : i + 1], weights[i : i + 1], ids[i : i + 1]) for i in range(24)])
    assert torch.equal(whole, alone)


def test_one_expert_projection_equals_matmul():
    plain, packed = _experts()
    x = torch.randn(6, HIDDEN)
    for e in range(8):
        torch.testing.assert_close(
            packed.expert_linear(x, e, 0), x @ plain.w13_weight[e].T, atol=1e-5, rtol=1e-5
        )
        act = torch.randn(6, INTER)
        torch.testing.assert_close(
            packed.expert_linear(act, e, 1), act @ plain.w2_weight[e].T, atol=1e-5, rtol=1e-5
        )


def test_off_by_environment_or_without_compiler(monkeypatch):
    try:
        monkeypatch.setenv("SRT_CPU_KERNELS", "0")
        cpu_kernels.load_library.cache_clear()
        assert cpu_kernels.load_library() is None
        monkeypatch.delenv("SRT_CPU_KERNELS")
        monkeypatch.setenv("CC", "/nonexistent/cc")
        cpu_kernels.load_library.cache_clear()
        assert cpu_kernels.load_library() is None
        moe = FusedMoE(8, HIDDEN, INTER)
        moe.prepare_for_cpu()
        assert moe.panels is None  # the PyTorch path, oneDNN layouts where available
    finally:
        cpu_kernels.load_library.cache_clear()


def test_experts_whose_gate_does_not_fill_panels_stay_in_pytorch():
    inter = cpu_kernels.panel_width() * 3 // 2
    experts = FusedMoE(4, HIDDEN, inter)  # w13: 3 whole panels, but gate and up split one
    experts.prepare_for_cpu()
    assert experts.panels is None


def test_unfit_shapes_and_dtypes_are_not_packed():
    assert cpu_kernels.panel_width() in (32, 64)  # 4 vectors of 8 or 16 floats
    assert not cpu_kernels.can_pack(torch.zeros(2, 128, 64, dtype=torch.float16))
    assert cpu_kernels.can_pack(torch.zeros(2, 128, 64, dtype=torch.bfloat16))
    assert cpu_kernels.can_pack(torch.zeros(2, 100, 64))


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 64, 97])
def test_linear_on_panels_equals_f_linear(rows):
    torch.manual_seed(rows)
    layer = ReplicatedLinear(96, 128, bias=True)
    torch.nn.init.normal_(layer.weight, std=0.1)
    torch.nn.init.normal_(layer.bias)
    layer.prepare_for_cpu()
    assert isinstance(layer.packed_weight, PanelWeight)
    x = torch.randn(rows, 2, 96)  # leading dimensions kept
    expected = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(rows)])
    assert torch.equal(layer(x), alone)  # a row's bits do not depend on its batch
    half = x.to(torch.bfloat16)  # another dtype falls back to F.linear
    out = linear(half, layer.weight.to(torch.bfloat16), None, layer.packed_weight)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("out_features", [5, 20, 100, 129])
def test_weights_that_do_not_fill_panels_pad_the_last_one(out_features):
    """The last panel's columns, whatever its width, also when the rows are shared out in
    chunks (a router's few columns over a prefill's rows)."""
    torch.manual_seed(out_features)
    weight = torch.randn(out_features, 48)
    packed = pack_weight(weight)
    assert isinstance(packed, PanelWeight)
    for rows in (1, 6, 33, 130):
        x = torch.randn(rows, 48)
        out = linear(x, weight, packed=packed)
        assert out.shape == (rows, out_features) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, weight), atol=1e-5, rtol=1e-5)
        alone = torch.cat([linear(x[i : i + 1], weight, packed=packed) for i in range(rows)])
        assert torch.equal(out, alone)


def test_rms_norm_equals_pytorch_on_views_and_with_residual():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    norm.prepare_for_cpu()
    assert norm.in_kernel
    qkv = torch.randn(5, 12 * 64)
    heads = qkv[:, : 8 * 64].reshape(-1, 8, 64)  # a split QKV's heads: rows not contiguous
    latent = torch.randn(5, 64 + 32)[:, :64]  # MLA's latent sliced off a wider row
    for x in (heads, latent, torch.randn(64), torch.randn(3, 64)):
        torch.testing.assert_close(norm(x), norm._norm(x), atol=1e-5, rtol=1e-5)
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    out, total = norm(x, residual)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(out, norm._norm(x + residual), atol=1e-5, rtol=1e-5)
    assert torch.equal(norm(x[2:3]), norm(x)[2:3])  # a row's bits do not depend on its batch


def test_bf16_rms_norm_rounds_where_pytorch_does():
    torch.manual_seed(0)
    norm = RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    torch.nn.init.normal_(norm.weight)
    norm.prepare_for_cpu()
    assert norm.in_kernel
    qkv = torch.randn(5, 12 * 64).bfloat16()
    for x in (qkv[:, : 8 * 64].reshape(-1, 8, 64), torch.randn(3, 64).bfloat16()):
        out = norm(x)
        assert out.dtype == torch.bfloat16
        # The sum of squares runs in another order than torch's mean: an ulp of bf16 at most.
        torch.testing.assert_close(out, norm._norm(x), atol=0, rtol=2**-7)
    x, residual = torch.randn(7, 64).bfloat16(), torch.randn(7, 64).bfloat16()
    out, total = norm(x, residual)
    assert torch.equal(total, x + residual)  # the add rounded to bf16, as torch's
    torch.testing.assert_close(out, norm._norm(x + residual), atol=0, rtol=2**-7)
