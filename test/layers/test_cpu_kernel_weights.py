"""The CPU GEMM kernels over bf16 and block-FP8 weights: bf16 is the float32 kernel over the
widened weight, bit for bit; fp8 (a sum per group of the raw e4m3 values, scaled once per
group) equals the product with the dequantized weight to float32's rounding, and gives a row
the same bits in any batch; for any row count, a partial last panel, K not a whole number of
groups and the small groups of tensor-parallel shards; and the checks refuse fp8 panels
without their scales or with scales of the wrong grid."""

from __future__ import annotations

import pytest
import torch

from srt.layers import cpu_kernels
from srt.layers.cpu_kernels import ops
from srt.layers.quantization import fp8

if not cpu_kernels.available():
    pytest.skip("no C compiler to build the kernels", allow_module_level=True)


def _fp8(n: int, k: int, group: int, lead=()) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 weight with per-row scales: blocks of 8 × 2·group, so rows and groups differ."""
    q, scale_inv = fp8.quantize_blocks(torch.randn(*lead, n, k) * 0.3, (8, 2 * group))
    return q, fp8.row_scales(scale_inv, n, k, (8, 2 * group), group)


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 70])
@pytest.mark.parametrize("n, k, group", [(40, 48, 16), (64, 100, 32), (7, 128, 128)])
def test_fp8_panel_linear_is_the_product_with_the_dequantized_weight(rows, n, k, group):
    torch.manual_seed(rows + n)
    q, scale = _fp8(n, k, group)
    x = torch.randn(rows, k)
    panels, scales = cpu_kernels.pack_panels(q), cpu_kernels.pack_scales(scale)
    got = cpu_kernels.panel_linear(x, panels, n, scales, group)
    exact = x.double() @ fp8.dequantize(q, scale, group).double().T
    torch.testing.assert_close(got, exact.float(), rtol=1e-5, atol=1e-5)
    alone = [cpu_kernels.panel_linear(x[i : i + 1], panels, n, scales, group) for i in range(rows)]
    assert torch.equal(got, torch.cat(alone))


def test_fp8_every_e4m3_value_with_tiny_activations_and_scales():
    """Every e4m3 value (subnormals included) times activations down to 1e-12 and scales down
    to 1e-8, whose products are normal float32 numbers: none may fall into float32's subnormal
    range inside the kernel either, where it would lose digits (and run on x86's slow
    assists)."""
    q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(16, 16)
    q = torch.where(q.float().isnan(), torch.zeros_like(q), q)
    scale = torch.logspace(-8, 0, 16).reshape(16, 1)
    x = torch.logspace(-12, 0, 3 * 16).reshape(3, 16)
    panels, scales = cpu_kernels.pack_panels(q), cpu_kernels.pack_scales(scale)
    got = cpu_kernels.panel_linear(x, panels, 16, scales, 16)
    exact = x.double() @ fp8.dequantize(q, scale, 16).double().T
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)


@pytest.mark.parametrize("rows", [1, 5, 70])
def test_bf16_panel_linear_is_float32_over_the_widened_weight(rows):
    w, x = torch.randn(72, 48).to(torch.bfloat16), torch.randn(rows, 48)
    got = cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(w), 72)
    assert torch.equal(got, cpu_kernels.panel_linear(x, cpu_kernels.pack_panels(w.float()), 72))


def _experts(dtype_or_group, experts=3, hidden=None, inter=None):
    p = cpu_kernels.panel_width()
    hidden, inter = hidden or 2 * p, inter or p
    if isinstance(dtype_or_group, torch.dtype):
        w13 = torch.randn(experts, 2 * inter, hidden).to(dtype_or_group)
        w2 = torch.randn(experts, hidden, inter).to(dtype_or_group)
        return (w13, w2), (None, None), (0, 0), (w13.float(), w2.float())
    g13, g2 = dtype_or_group
    (q13, s13), (q2, s2) = (
        _fp8(2 * inter, hidden, g13, (experts,)),
        _fp8(hidden, inter, g2, (experts,)),
    )
    dense = (fp8.dequantize(q13, s13, g13), fp8.dequantize(q2, s2, g2))
    scales = (cpu_kernels.pack_scales(s13), cpu_kernels.pack_scales(s2))
    return (q13, q2), scales, (g13, g2), dense


@pytest.mark.parametrize("weights", [torch.bfloat16, (32, 16), (16, 8)])
@pytest.mark.parametrize("tokens", [1, 6])
def test_fused_experts_over_bf16_and_fp8_equal_float32_over_their_values(weights, tokens):
    torch.manual_seed(tokens)
    (w13, w2), scales, groups, dense = _experts(weights)
    x, topk_w = torch.randn(tokens, w13.shape[2]), torch.rand(tokens, 2)
    ids = torch.randint(0, 4, (tokens, 2))  # expert 3 is another rank's
    packed = [cpu_kernels.pack_panels(w) for w in (w13, w2)]
    got = cpu_kernels.fused_experts(x, topk_w, ids, 0, *packed, scales, groups)
    reference = [cpu_kernels.pack_panels(w) for w in dense]
    expected = cpu_kernels.fused_experts(x, topk_w, ids, 0, *reference)
    if weights == torch.bfloat16:
        assert torch.equal(got, expected)
    else:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    alone = [
        cpu_kernels.fused_experts(x[t : t + 1], topk_w[t : t + 1], ids[t : t + 1], 0, *packed,
                                  scales, groups)
        for t in range(tokens)
    ]  # fmt: skip
    assert torch.equal(got, torch.cat(alone))


def test_fp8_checks_refuse_before_the_kernel_runs():
    q, scale = _fp8(40, 48, 16)
    panels, scales = cpu_kernels.pack_panels(q), cpu_kernels.pack_scales(scale)
    x = torch.randn(2, 48)
    with pytest.raises(ValueError, match="panels's scales and a group"):
        ops._panel_linear(x, panels, 40)
    with pytest.raises(ValueError, match=r"panels's scales .* are not"):
        ops._panel_linear(x, panels, 40, scales, 8)
    with pytest.raises(ValueError, match="are given for torch.bfloat16 panels"):
        ops._panel_linear(x, panels.to(torch.bfloat16), 40, scales, 16)
    with pytest.raises(ValueError, match="panels has dtype torch.float16"):
        ops._panel_linear(x, panels.to(torch.float16), 40)
    (w13, w2), scales, groups, _ = _experts((16, 16))
    ids, topk_w = torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 2)
    args = (torch.randn(1, w13.shape[2]), topk_w, ids, 0, cpu_kernels.pack_panels(w13))
    with pytest.raises(ValueError, match="w2_panels are torch.float32"):
        ops._fused_experts(*args, cpu_kernels.pack_panels(w2.float()), scales[0], None, 16, 0)


@pytest.mark.parametrize("value", [2.0**121, float("inf"), float("nan")])
def test_scales_the_kernels_cannot_represent_are_refused(value):
    cpu_kernels.pack_scales(torch.full((4, 2), 1e30))  # any real block's scale is in range
    with pytest.raises(ValueError, match="outside the CPU kernels' range"):
        cpu_kernels.pack_scales(torch.full((4, 2), value))


@pytest.fixture
def no_amx():
    """The bf16 GEMMs on FMAs, AMX's tiles (where this CPU has them) switched back on after."""
    cpu_kernels.use_amx(False)
    yield
    cpu_kernels.use_amx(True)


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 6, 70])
def test_bf16_activations_are_the_float32_gemm_on_their_values_rounded_once(weights, rows, no_amx):
    torch.manual_seed(rows)
    (w13, w2), scales, groups, _ = _experts(weights)
    x = torch.randn(rows, w13.shape[2]).bfloat16()
    panels, scale = cpu_kernels.pack_panels(w13[0]), scales[0]
    scale = None if scale is None else scale[0]
    linear = lambda x: cpu_kernels.panel_linear(x, panels, w13.shape[1], scale, groups[0])  # noqa: E731
    assert linear(x).dtype == torch.bfloat16
    assert torch.equal(linear(x), linear(x.float()).bfloat16())
    topk_w, ids = torch.rand(rows, 2), torch.randint(0, 4, (rows, 2))
    packed = [cpu_kernels.pack_panels(w) for w in (w13, w2)]
    experts = lambda x: cpu_kernels.fused_experts(x, topk_w, ids, 0, *packed, scales, groups)  # noqa: E731
    assert torch.equal(experts(x), experts(x.float()).bfloat16())


@pytest.fixture(params=[True, False], ids=["amx", "no-amx"])
def amx(request):
    """AMX's tiles on (where this CPU has them) and off."""
    cpu_kernels.use_amx(request.param)
    yield
    cpu_kernels.use_amx(True)


@pytest.mark.parametrize("k, group", [(96, 32), (41, 16)])  # 41: a group of 9, an odd last k
@pytest.mark.parametrize("rows", [1, 6, 70])
def test_fp8_weights_over_bf16_activations(k, group, rows, amx):
    """bf16 activations over fp8 weights (where the CPU has them: on AMX's tiles in groups of
    whole tile steps, else on AVX512-BF16's dot products, each group's weights as bf16, summed in
    an order of their own; the experts' activation rounded to bf16 between the two GEMMs):
    within bf16's rounding of the exact product, and a row's bits do not depend on the rows
    beside it (across the tiles' blocks of 16 rows and the linear's chunks of 64)."""
    torch.manual_seed(rows + k)
    q, scale = _fp8(72, k, group)
    panels, scales = cpu_kernels.pack_panels(q), cpu_kernels.pack_scales(scale)
    x = torch.randn(rows, k).bfloat16()
    linear = lambda x: cpu_kernels.panel_linear(x, panels, 72, scales, group)  # noqa: E731
    got = linear(x)
    exact = x.double() @ fp8.dequantize(q, scale, group).double().T
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2 * exact.abs().max())
    assert torch.equal(got, torch.cat([linear(x[i : i + 1]) for i in range(rows)]))
    (w13, w2), scales, groups, _ = _experts((32, 32))
    x, topk_w = torch.randn(rows, w13.shape[2]).bfloat16(), torch.rand(rows, 2)
    ids = torch.randint(0, 4, (rows, 2))
    packed = [cpu_kernels.pack_panels(w) for w in (w13, w2)]
    experts = lambda x, t, i: cpu_kernels.fused_experts(x, t, i, 0, *packed, scales, groups)  # noqa: E731
    got, reference = experts(x, topk_w, ids), experts(x.float(), topk_w, ids)
    torch.testing.assert_close(got.float(), reference, rtol=3e-2, atol=3e-2 * reference.abs().max())
    alone = [experts(x[t : t + 1], topk_w[t : t + 1], ids[t : t + 1]) for t in range(rows)]
    assert torch.equal(got, torch.cat(alone))


needs_amx = pytest.mark.skipif(not cpu_kernels.use_amx(), reason="no AMX on this CPU")


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 70])
def test_amx_bf16_gemms_agree_with_float32_and_give_a_row_the_same_bits_in_any_batch(rows):
    """bf16 × bf16 on AMX's tiles (their own order of sums; the experts' activation rounded to
    bf16 between the two GEMMs, as a bf16 model rounds it): within bf16's rounding of the
    float32 GEMMs, and a row's bits do not depend on the rows beside it, across the tiles'
    blocks of 16 rows."""
    torch.manual_seed(rows)
    (w13, w2), _, _, _ = _experts(torch.bfloat16, hidden=2 * 64, inter=64)
    x = torch.randn(rows, w13.shape[2]).bfloat16()
    panels = cpu_kernels.pack_panels(w13[0])
    got = cpu_kernels.panel_linear(x, panels, w13.shape[1])
    exact = x.double() @ w13[0].double().T
    torch.testing.assert_close(got.double(), exact, rtol=1e-2, atol=1e-2 * exact.abs().max())
    alone = [cpu_kernels.panel_linear(x[i : i + 1], panels, w13.shape[1]) for i in range(rows)]
    assert torch.equal(got, torch.cat(alone))
    topk_w, ids = torch.rand(rows, 2), torch.randint(0, 4, (rows, 2))
    packed = [cpu_kernels.pack_panels(w) for w in (w13, w2)]
    experts = lambda x, t, i: cpu_kernels.fused_experts(x, t, i, 0, *packed)  # noqa: E731
    got = experts(x, topk_w, ids)
    reference = experts(x.float(), topk_w, ids)
    torch.testing.assert_close(got.float(), reference, rtol=3e-2, atol=3e-2 * reference.abs().max())
    alone = [experts(x[t : t + 1], topk_w[t : t + 1], ids[t : t + 1]) for t in range(rows)]
    assert torch.equal(got, torch.cat(alone))
