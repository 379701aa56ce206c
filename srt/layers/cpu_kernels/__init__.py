"""CPU kernels in C, each a checked torch op (``srt::…``): a linear layer over weights packed in
panels (``panel_linear``) and the routed experts of a MoE layer in one call (``fused_experts``),
float32 or bfloat16 activations over float32, bfloat16 or block-FP8 weights, and RMSNorm with
its residual add (``rms_norm``), in ``csrc/cpu_kernels.c`` and ``csrc/cpu_experts.c``; decode
attention over the paged KV cache (``decode_attention``) and rotary embedding (``rope``), in
``csrc/cpu_attention.c``; causal extend attention over the same cache (``extend_attention``),
in ``csrc/cpu_extend_attention.c``; the router's top-k (``select_experts``) and the cache's
write (``store_kv``), in ``csrc/cpu_router.c``. The norm, rope, router and attention take
float32 or bfloat16 activations and KV cache, computing in float32.

``build.py`` compiles and loads the library (where it cannot, ``available()`` is False and the
layers keep their PyTorch paths), ``checks.py`` says what each op requires of its arguments,
``ops.py`` registers the ops and holds the functions the layers call (the attention ones in
``attention_ops.py``).
"""

from __future__ import annotations

import torch

from srt.layers.cpu_kernels.attention_ops import decode_attention, extend_attention, store_kv
from srt.layers.cpu_kernels.build import load_library
from srt.layers.cpu_kernels.checks import ACT_TYPES, WEIGHT_TYPES, PositionOutsideTable
from srt.layers.cpu_kernels.ops import (
    fused_experts,
    panel_linear,
    panel_width,
    rms_norm,
    rope,
    select_experts,
)

__all__ = [
    "ACT_TYPES",
    "PositionOutsideTable",
    "available",
    "can_pack",
    "decode_attention",
    "extend_attention",
    "fused_experts",
    "pack_panels",
    "pack_scales",
    "panel_linear",
    "panel_width",
    "rms_norm",
    "rope",
    "select_experts",
    "store_kv",
    "supports",
    "use_amx",
]


def available() -> bool:
    """Whether the kernels are built and fast on this CPU (see ``build.load_library``)."""
    return load_library() is not None


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the GEMM kernels run on weights of ``dtype`` on ``device``: float32, bfloat16 or
    float8_e4m3fn (with scales) on CPU, with the kernels available. Dense layers
    (``can_pack``) and the experts (``srt.layers.moe.expert_kernel``) ask this one question.
    The other kernels (norm, rope, attention) take float32 or bfloat16 (``ACT_TYPES``)."""
    return device.type == "cpu" and dtype in WEIGHT_TYPES and available()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether a weight ``[N, K]`` (or stacked ``[E, N, K]``) fits the kernels (``supports``;
    bf16 in pairs along k: an even K). The experts' kernel also needs whole panels
    (``expert_kernel.choose_expert_kernel``)."""
    even = weight.dtype != torch.bfloat16 or weight.shape[-1] % 2 == 0
    return supports(weight.device, weight.dtype) and even


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` → ``[..., ceil(N / P), K, P]`` for the kernels' panels of ``P`` columns:
    each panel's columns contiguous per k; columns past N (the last panel's) zero. bf16 panels
    hold their weights in pairs along k instead, ``[K / 2][P][2]`` in the same shape (the
    layout AMX's tile multiply reads, ``csrc/cpu_amx.c``); their K must be even."""
    *lead, n, k = weight.shape
    p = panel_width()
    padded = -(-n // p) * p
    weight = weight.detach()
    if padded != n:
        weight = torch.cat((weight, weight.new_zeros(*lead, padded - n, k)), dim=-2)
    panels = weight.reshape(*lead, padded // p, p, k).transpose(-1, -2)
    if weight.dtype != torch.bfloat16:
        return panels.contiguous()
    if k % 2:
        raise ValueError(f"a bf16 weight's K must be even for the CPU kernels' panels, got {k}")
    pairs = panels.reshape(*lead, padded // p, k // 2, 2, p).transpose(-1, -2)
    return pairs.contiguous().reshape(*lead, padded // p, k, p)


def use_amx(enabled: bool | None = None) -> bool:
    """Whether the bf16 GEMMs run on AMX's tiles (where the CPU and the build have them:
    ``csrc/cpu_amx.c``); ``enabled`` switches them off or back on first (tests and benchmarks
    compare the two paths)."""
    lib = load_library()
    if lib is None:
        return False
    return bool(lib.srt_amx(-1 if enabled is None else int(enabled)))


# The fp8 kernels read an e4m3 byte as a float32 of its value · 2^-8 and multiply by the
# scale · 2^8 (csrc/cpu_kernels.c, widen_fp8): scales must stay below 2^120 for that and a
# group's sum (at most K · 448 · 2^-8 times an activation) to stay finite.
_FP8_SCALE_SHIFT = 2.0**8
FP8_MAX_SCALE = 2.0**120


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """Per-row fp8 scales ``[..., N, G]`` (``srt.layers.quantization.fp8``) → the kernels'
    ``[..., ceil(N / P), G, P]``, each times 2^8 (rows past N zero). Raises ValueError for a
    scale the kernels cannot represent (≥ 2^120, or not finite)."""
    top = scale.abs().max().item() if scale.numel() else 0.0
    if not top < FP8_MAX_SCALE:
        raise ValueError(f"an fp8 weight scale of {top} is outside the CPU kernels' range "
                         f"[0, {FP8_MAX_SCALE})")  # fmt: skip
    return pack_panels(scale.to(torch.float32) * _FP8_SCALE_SHIFT)
