"""Block-FP8 linear layers on GPU, in Triton, as SGLang and DeepGEMM run them.

Weights as ``fp8.py`` keeps them: ``q`` e4m3fn ``[N, K]`` and per-row float32 scales ``[N,
ceil(K / G)]``. Two ways to multiply them, picked from the device by ``uses_w8a8``:

- W8A8 (sm89 and later, which have fp8 tensor cores): the activations quantized per token and
  group of G columns (``per_token_group_quant_fp8``), then every K group is one fp8 dot into a
  fresh float32 partial, scaled by the row's and the column's group scales and added to a
  float32 accumulator. One dot per group is DeepGEMM's promotion: Hopper's fp8 MMA accumulates
  with fewer bits than float32 (Triton leaves it so on sm90), so no dot spans two groups.
- weight-only (older GPUs, where Triton refuses the e4m3 type itself): the weights read as
  bytes and decoded in registers to x's dtype (exact: every e4m3 value is a float16 and a
  bfloat16), one dot per group in x's dtype with float32 accumulation, scaled by the weight
  row's group scale.

Both run the same inner loop, ``block_scaled_dot``, which the fused MoE shares
(``srt.layers.moe.fused_moe_triton_fp8``). Shapes follow from input shapes only: nothing reads
a device value on the host, so every call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from srt.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, num_groups

_SCALE_EPS = 1e-10  # the least activation scale: an all-zero group quantizes to zeros
_MIN_FP8_DOT_K = 32  # Triton's NVIDIA backend needs K >= 32 in an 8-bit dot


def uses_w8a8(device: torch.device, capability: tuple[int, int] | None = None) -> bool:
    """Whether fp8 layers on ``device`` run W8A8 (fp8 dots) rather than weight-only: a CUDA
    device of compute ``capability`` (None: its own) from 8.9 on. CPU tensors run in Triton's
    interpreter, which runs both; they take W8A8 unless ``capability`` says otherwise."""
    if capability is None:
        if device.type != "cuda":
            return True
        capability = torch.cuda.get_device_capability(device)
    return tuple(capability) >= (8, 9)


def fp8_block_k(group: int) -> int:
    """Columns per K step of the kernels: the group, or 32 (the least K of an 8-bit dot) when
    the group is smaller, each group of the step then one masked dot."""
    return max(group, _MIN_FP8_DOT_K)


def check_fp8_weight(q: torch.Tensor, scale: torch.Tensor, group: int) -> None:
    """Raise unless ``q`` [..., N, K] is e4m3fn and ``scale`` its float32 per-row scales
    [..., N, ceil(K / group)], ``group`` a power of two."""
    if q.dtype != FP8_DTYPE or scale.dtype != torch.float32:
        raise TypeError(f"fp8 weight {q.dtype} with {scale.dtype} scales")
    if group <= 0 or group & (group - 1):
        raise ValueError(f"group {group} is not a power of two")
    expected = (*q.shape[:-1], num_groups(q.shape[-1], group))
    if tuple(scale.shape) != expected:
        raise ValueError(f"scales {tuple(scale.shape)} for weight {tuple(q.shape)}: {expected}")


@triton.jit
def _round_to_e4m3(v):
    """float32 ``v`` (|v| ≤ 448) rounded to the nearest e4m3 value, ties to even, still float32,
    so that the cast to fp8 after it is exact. Triton's interpreter needs it: its own float32 →
    fp8 cast rounds ties up and drops the carry into the exponent (126.2 → 64). On GPU, where
    the cast is right, it costs this memory-bound kernel nothing and keeps one path."""
    biased_exponent = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF
    # e4m3's spacing at v is 2^(max(e, -6) - 3) (3 mantissa bits, no exponent under -6); adding
    # and subtracting 1.5 · 2^(that + 23) rounds v to it, as float32 adds round to nearest even.
    magic_biased_exponent = tl.maximum(biased_exponent, 127 - 6) + 20
    magic = ((magic_biased_exponent << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _per_token_group_quant_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [M, K] e4m3fn, contiguous
    s_ptr,  # [M, ceil(K / GROUP)] float32, contiguous
    K,
    num_k_groups,
    stride_xm,
    stride_xk,
    FP8_MAX: tl.constexpr,
    EPS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_PER_PROGRAM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)  # [GP]
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [GP, GROUP]
    ok = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols * stride_xk, mask=ok, other=0.0).to(tl.float32)
    # div_rn: correctly rounded, as torch divides (Triton's "/" is approximate on GPU).
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), axis=1), FP8_MAX), EPS)  # [GP]
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX)
    q = _round_to_e4m3(q)
    tl.store(q_ptr + row * K + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * num_k_groups + groups, scale, mask=groups < num_k_groups)


def per_token_group_quant_fp8(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantization: ``x`` [M, K] → (``q`` e4m3fn [M, K], ``scale`` float32
    [M, ceil(K / group)]), each row's group of ``group`` columns scaled by max(amax / 448,
    1e-10) and ``q = x / scale`` rounded to e4m3 (``x ≈ q · scale``)."""
    if x.dim() != 2 or group <= 0 or group & (group - 1):
        raise ValueError(f"x {tuple(x.shape)} must be 2-D and group {group} a power of two")
    m, k = x.shape
    ng = num_groups(k, group)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, ng, dtype=torch.float32, device=x.device)
    per_program = min(triton.next_power_of_2(max(ng, 1)), max(1, 1024 // group))
    grid = (m, triton.cdiv(ng, per_program))
    _per_token_group_quant_kernel[grid](
        x, q, scale, k, ng, x.stride(0), x.stride(1),
        FP8_MAX=FP8_MAX, EPS=_SCALE_EPS, GROUP=group, GROUPS_PER_PROGRAM=per_program,
    )  # fmt: skip
    return q, scale


@triton.jit
def _e4m3_bits_to_float32(bits):
    """e4m3fn bytes (uint8) → float32, exactly, with no fp8 type: sign, exponent and mantissa
    laid into a float16 whose exponent bias is 8 larger (subnormals included), times 2^8."""
    half = ((bits & 0x7F).to(tl.int16) << 7) | ((bits & 0x80).to(tl.int16) << 8)
    return half.to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def block_scaled_dot(
    acc,  # [BLOCK_M, BLOCK_N] float32
    a_ptrs,  # [BLOCK_M, BLOCK_K]: column 0 of the rows; e4m3 (W8A8) or 16/32-bit
    a_s_ptrs,  # [BLOCK_M]: the rows' group-0 scales, read only when W8A8
    b_ptrs,  # [BLOCK_K, BLOCK_N]: column 0 of the weight rows, used transposed; e4m3 or uint8
    b_s_ptrs,  # [BLOCK_N]: the weight rows' group-0 scales
    row_ok,  # [BLOCK_M]
    n_ok,  # [BLOCK_N]
    K,
    stride_ak,
    stride_bk,
    stride_ask,
    stride_bsk,
    GROUP: tl.constexpr,
    W8A8: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """acc + Σ_g (a_g · b_gᵀ) · a_scale[g] · b_scale[g] over the K groups g, one dot each."""
    offs_k = tl.arange(0, BLOCK_K)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = offs_k < K - kb * BLOCK_K
        for j in tl.static_range(BLOCK_K // GROUP):  # more than one only when GROUP < 32
            in_group = k_ok & (offs_k // GROUP == j)
            # A group past K (zero dot) reads the last group's scale: it has none of its own.
            g = tl.minimum(kb * (BLOCK_K // GROUP) + j, (K - 1) // GROUP)
            a = tl.load(a_ptrs, mask=row_ok[:, None] & in_group[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=in_group[:, None] & n_ok[None, :], other=0.0)
            b_s = tl.load(b_s_ptrs + g * stride_bsk, mask=n_ok, other=0.0)
            if W8A8:
                a_s = tl.load(a_s_ptrs + g * stride_ask, mask=row_ok, other=0.0)
                acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
            else:
                b = _e4m3_bits_to_float32(b).to(a.dtype)
                acc += tl.dot(a, b, input_precision=PRECISION) * b_s[None, :]
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _fp8_matmul_kernel(
    a_ptr,  # [M, K]: e4m3 activations (W8A8) or x
    a_s_ptr,  # [M, ceil(K / GROUP)] float32, read only when W8A8
    b_ptr,  # [N, K]: e4m3 weights (W8A8) or their bytes
    b_s_ptr,  # [N, ceil(K / GROUP)] float32
    c_ptr,  # [M, N]
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_bn,
    stride_bk,
    stride_bsn,
    stride_bsk,
    stride_cm,
    stride_cn,
    GROUP: tl.constexpr,
    W8A8: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_ok, n_ok = offs_m < M, offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = block_scaled_dot(
        acc, a_ptrs, a_s_ptr + offs_m * stride_asm, b_ptrs, b_s_ptr + offs_n * stride_bsn,
        row_ok, n_ok, K, stride_ak, stride_bk, stride_ask, stride_bsk,
        GROUP, W8A8, PRECISION, BLOCK_K,
    )  # fmt: skip
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _fp8_matmul(a, a_s, b, b_s, group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``_fp8_matmul_kernel`` on a [M, K], b [N, K] (e4m3 when ``a_s`` is given, else bytes)."""
    m, k, n = a.shape[0], a.shape[1], b.shape[0]
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    block_m = 16 if m <= 16 else 64  # decode batches: fewer padded rows
    w8a8 = a_s is not None
    a_s = a_s if w8a8 else b_s  # not read
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _fp8_matmul_kernel[grid](
        a, a_s, b, b_s, out, m, n, k,
        a.stride(0), a.stride(1), a_s.stride(0), a_s.stride(1), b.stride(0), b.stride(1),
        b_s.stride(0), b_s.stride(1), out.stride(0), out.stride(1),
        GROUP=group, W8A8=w8a8,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",  # tf32 would cut float32
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=fp8_block_k(group),
    )  # fmt: skip
    return out


def w8a8_block_matmul(
    x_q: torch.Tensor,
    x_s: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(x_q · x_s) @ (w_q · w_s)ᵀ, [M, N] in ``out_dtype``, on fp8 tensor cores (sm89+):
    x_q [M, K] e4m3 and x_s [M, ceil(K / G)] from ``per_token_group_quant_fp8``; w_q [N, K]
    e4m3 with per-row scales w_s [N, ceil(K / G)]."""
    check_fp8_weight(w_q, w_s, group)
    check_fp8_weight(x_q, x_s, group)
    if x_q.shape[1] != w_q.shape[1]:
        raise ValueError(f"x {tuple(x_q.shape)} and weight {tuple(w_q.shape)}: K differs")
    return _fp8_matmul(x_q, x_s, w_q, w_s, group, out_dtype)


def weight_only_fp8_matmul(
    x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, group: int
) -> torch.Tensor:
    """x @ (w_q · w_s)ᵀ, [M, N] in x's dtype, for GPUs without fp8 tensor cores: x [M, K]
    (16- or 32-bit), w_q [N, K] e4m3 with per-row scales w_s [N, ceil(K / G)]."""
    check_fp8_weight(w_q, w_s, group)
    if x.dim() != 2 or x.shape[1] != w_q.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(w_q.shape)}: K differs")
    return _fp8_matmul(x, None, w_q.view(torch.uint8), w_s, group, x.dtype)


def fp8_linear(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_s: torch.Tensor,
    group: int,
    bias: torch.Tensor | None = None,
    capability: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [..., K] @ (w_q · w_s)ᵀ (+ bias) → [..., N] in x's dtype: W8A8 where ``uses_w8a8``
    says so (x's device, or one of compute ``capability``), else weight-only. w_q [N, K]
    e4m3, w_s [N, ceil(K / G)] float32. No host synchronisation."""
    x2 = x.reshape(-1, x.shape[-1])  # [M, K]
    if uses_w8a8(x.device, capability):
        x_q, x_s = per_token_group_quant_fp8(x2, group)
        out = w8a8_block_matmul(x_q, x_s, w_q, w_s, group, x.dtype)
    else:
        out = weight_only_fp8_matmul(x2, w_q, w_s, group)
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], w_q.shape[0])
