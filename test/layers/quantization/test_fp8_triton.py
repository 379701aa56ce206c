"""The block-FP8 Triton kernels (W8A8 and weight-only GEMMs, activation quantization, the fused
MoE on fp8 experts) against torch references on the dequantized weights.

Without a GPU they run in Triton's interpreter (numpy), which runs fp8 dots, so both paths are
checked here whatever the device; every case is tiny."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined

pytest.importorskip("triton")

from srt.layers.moe.fused_moe_triton import Fp8Scales, fused_experts_triton  # noqa: E402
from srt.layers.quantization.fp8 import FP8_DTYPE, dequantize, quantize_rows  # noqa: E402
from srt.layers.quantization.fp8_triton import (  # noqa: E402
    fp8_block_k,
    fp8_linear,
    per_token_group_quant_fp8,
    uses_w8a8,
    w8a8_block_matmul,
    weight_only_fp8_matmul,
)
from srt.utils.sync_guard import forbid_host_sync  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
AMPERE, HOPPER = (8, 0), (9, 0)
# W8A8 needs fp8 dots: everywhere in the interpreter, from sm89 on a GPU.
needs_fp8 = pytest.mark.skipif(
    DEVICE == "cuda" and not uses_w8a8(torch.device(DEVICE)), reason="no fp8 tensor cores"
)
# (group, K): a group under 32 (two per K step), K not a multiple of the group, one K step.
GROUP_K = [(16, 72), (32, 72), (64, 100)]


def _quant_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """per_token_group_quant_fp8 in torch: scale = max(amax / 448, 1e-10), q = x / scale."""
    m, k = x.shape
    padded = x.float().new_zeros(m, -(-k // group) * group)
    padded[:, :k] = x.float()
    groups = padded.view(m, -1, group)
    scale = (groups.abs().amax(dim=-1) / 448.0).clamp(min=1e-10)  # [M, ceil(K / G)]
    q = (groups / scale[..., None]).clamp(-448.0, 448.0).view(m, -1)[:, :k].to(FP8_DTYPE)
    return q, scale


def _weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 weight [N, K] in srt's format, its rows of very different magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen) * 4
    q, scale = quantize_rows(w, block=(16, 64), group=group)
    return q.to(DEVICE), scale.to(DEVICE)


def _x(m: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen)).to(DEVICE, dtype)


def test_choice_of_kernel_by_capability():
    cuda = torch.device("cuda")
    assert not uses_w8a8(cuda, AMPERE) and not uses_w8a8(cuda, (8, 6))
    assert uses_w8a8(cuda, (8, 9)) and uses_w8a8(cuda, HOPPER)
    assert uses_w8a8(torch.device("cpu"))  # the interpreter
    assert [fp8_block_k(g) for g in (8, 16, 32, 128)] == [32, 32, 32, 128]


@needs_fp8
@pytest.mark.parametrize("group,k", GROUP_K)
def test_quant_matches_reference_and_round_trips(group, k):
    x = _x(33, 2 * k, seed=group)[:, ::2]  # strided columns
    x[3] = 0  # an all-zero row: scale eps, q zero
    q, scale = per_token_group_quant_fp8(x, group)
    q_ref, scale_ref = _quant_reference(x.cpu(), group)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert torch.equal(scale.cpu(), scale_ref) and torch.equal(q.cpu().float(), q_ref.float())
    assert (scale[3] == 1e-10).all() and (q[3].float() == 0).all()
    error = (dequantize(q, scale, group) - x).abs()
    assert (error <= scale.repeat_interleave(group, dim=1)[:, :k] * 16 + 1e-12).all()  # ≤ ulp/2


@needs_fp8
def test_quant_rounds_ties_to_even_and_carries():
    """Every e4m3 value, the midpoints between neighbours (ties) and the floats either side of
    them, in groups whose 448 pins the scale to 1: q is torch's own cast."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = values[~values.isnan()].unique()  # sorted, subnormals included
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    body = torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])
    body = torch.cat([body, body.new_zeros(-body.numel() % 15)]).view(-1, 15)
    x = torch.cat([torch.full_like(body[:, :1], 448.0), body], dim=1).view(1, -1).to(DEVICE)
    q, scale = per_token_group_quant_fp8(x, 16)
    assert (scale == 1).all()
    assert torch.equal(q.cpu().float(), x.cpu().to(FP8_DTYPE).float())  # -0 may come out 0


@needs_fp8
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("group,k", GROUP_K)
def test_w8a8_matches_quantized_reference(m, group, k):
    n = 72  # two column blocks of 64, the second partial
    w_q, w_s = _weight(n, k, group, seed=k)
    x = _x(m, k, seed=m)
    x_q, x_s = per_token_group_quant_fp8(x, group)
    out = w8a8_block_matmul(x_q, x_s, w_q, w_s, group, torch.float32)
    w = dequantize(w_q, w_s, group)
    expected = dequantize(x_q, x_s, group) @ w.T
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5 * expected.abs().max().item())
    exact = x @ w.T  # activation quantization costs a few percent, no more
    assert (out - exact).norm() < 0.08 * exact.norm()


@needs_fp8
def test_w8a8_writes_out_dtype():
    w_q, w_s = _weight(40, 64, 32, seed=0)
    x_q, x_s = per_token_group_quant_fp8(_x(5, 64, seed=0), 32)
    out = w8a8_block_matmul(x_q, x_s, w_q, w_s, 32, torch.float16)
    expected = dequantize(x_q, x_s, 32) @ dequantize(w_q, w_s, 32).T
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("group,k", GROUP_K)
def test_weight_only_matches_dequantized_reference(m, group, k):
    w_q, w_s = _weight(72, k, group, seed=k)
    x = _x(m, k, seed=m)
    expected = x @ dequantize(w_q, w_s, group).T
    out = weight_only_fp8_matmul(x, w_q, w_s, group)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_weight_only_float16():
    """16-bit activations (float16: the interpreter's tl.dot cannot read bfloat16)."""
    w_q, w_s = _weight(40, 72, 16, seed=1)
    x = _x(9, 72, seed=1, dtype=torch.float16)
    out = weight_only_fp8_matmul(x, w_q, w_s, 16)
    assert out.dtype == torch.float16
    expected = x.float() @ dequantize(w_q, w_s, 16).T
    torch.testing.assert_close(out.float(), expected, rtol=1e-3, atol=1e-2)


@needs_fp8
def test_fp8_linear_picks_by_capability_without_sync():
    w_q, w_s = _weight(40, 72, 32, seed=2)
    bias = torch.randn(40).to(DEVICE)
    x = _x(6, 72, seed=2).view(2, 3, 72)
    with forbid_host_sync(DEVICE):
        old = fp8_linear(x, w_q, w_s, 32, bias, capability=AMPERE)
        new = fp8_linear(x, w_q, w_s, 32, bias, capability=HOPPER)
    assert old.shape == new.shape == (2, 3, 40)
    x2 = x.view(6, 72)
    assert torch.equal(old.view(6, 40), weight_only_fp8_matmul(x2, w_q, w_s, 32) + bias)
    quantized = w8a8_block_matmul(*per_token_group_quant_fp8(x2, 32), w_q, w_s, 32, x.dtype)
    assert torch.equal(new.view(6, 40), quantized + bias)
    assert not torch.equal(old, new)  # the two paths really differ


def test_rejects_wrong_scales():
    w_q, w_s = _weight(40, 72, 32, seed=3)
    with pytest.raises(ValueError, match="scales"):
        weight_only_fp8_matmul(_x(2, 72, seed=3), w_q, w_s[:, :2], 32)
    with pytest.raises(TypeError):
        weight_only_fp8_matmul(_x(2, 72, seed=3), w_q.float(), w_s, 32)


# The MoE: 8 experts, 4 on this rank from START; TOP_K distinct ids per token.
NUM_EXPERTS, NUM_LOCAL, START, TOP_K, HIDDEN, INTER = 8, 4, 4, 2, 40, 48
EMPTY = START + 2  # a local expert no token picks


def _topk_ids(num_tokens: int, seed: int) -> torch.Tensor:
    """Ids of local experts and of other ranks' (outside [START, START + 4)), none EMPTY; even
    tokens pick START first (then one at random), odd ones two at random."""
    gen = torch.Generator().manual_seed(seed)
    choices = torch.tensor([e for e in range(NUM_EXPERTS) if e not in (START, EMPTY)])
    ids = torch.full((num_tokens, TOP_K), START)
    for t in range(num_tokens):
        ids[t, 1 - t % 2 :] = choices[torch.randperm(len(choices), generator=gen)[: 1 + t % 2]]
    return ids.to(DEVICE)


def _moe_reference(x, w13, w2, weights, ids, quantize_act: tuple[int, int] | None):
    """The loop over (token, slot) on dequantized weights; ``quantize_act``: the groups of x and
    of the activation, quantized as the W8A8 kernel does (None: weight-only)."""
    if quantize_act:
        x = dequantize(*_quant_reference(x, quantize_act[0]), quantize_act[0])
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(TOP_K):
            e = int(ids[t, k]) - START
            if 0 <= e < NUM_LOCAL:
                gate, up = (w13[e] @ x[t]).chunk(2)
                act = (torch.nn.functional.silu(gate) * up)[None]
                if quantize_act:
                    act = dequantize(*_quant_reference(act, quantize_act[1]), quantize_act[1])
                out[t] += weights[t, k] * (w2[e] @ act[0])
    return out


def _experts(group13: int, group2: int):
    w13_q, w13_s = _weight(NUM_LOCAL * 2 * INTER, HIDDEN, group13, seed=5)
    w2_q, w2_s = _weight(NUM_LOCAL * HIDDEN, INTER, group2, seed=6)
    w13 = (w13_q.view(NUM_LOCAL, 2 * INTER, HIDDEN), w13_s.view(NUM_LOCAL, 2 * INTER, -1))
    return w13, (w2_q.view(NUM_LOCAL, HIDDEN, INTER), w2_s.view(NUM_LOCAL, HIDDEN, -1))


@pytest.mark.parametrize("capability", [AMPERE, pytest.param(HOPPER, marks=needs_fp8)])
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_moe_fp8_matches_dequantized_loop(capability, num_tokens):
    groups = (16, 32)  # w13's K (40) and w2's (48) groups differ, as after a TP split
    (w13_q, w13_s), (w2_q, w2_s) = _experts(*groups)
    x, ids = _x(num_tokens, HIDDEN, seed=num_tokens), _topk_ids(num_tokens, seed=num_tokens)
    weights = torch.rand(num_tokens, TOP_K).to(DEVICE)
    fp8_13 = Fp8Scales(w13_s, groups[0], capability)
    fp8_2 = Fp8Scales(w2_s, groups[1], capability)
    with forbid_host_sync(DEVICE):
        out = fused_experts_triton(
            x, w13_q, w2_q, weights, ids, START, w13_fp8=fp8_13, w2_fp8=fp8_2
        )
    w13, w2 = dequantize(w13_q, w13_s, groups[0]), dequantize(w2_q, w2_s, groups[1])
    w8a8 = capability == HOPPER
    expected = _moe_reference(x, w13, w2, weights, ids, groups if w8a8 else None)
    # W8A8: the activation's fp8 rounding may fall the other way on a last-bit difference.
    tol = 2e-3 if w8a8 else 1e-5
    torch.testing.assert_close(out, expected, rtol=0, atol=tol * expected.abs().max().item())
    if w8a8:
        exact = _moe_reference(x, w13, w2, weights, ids, None)
        assert (out - exact).norm() < 0.08 * exact.norm()
