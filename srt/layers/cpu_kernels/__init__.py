"""CPU kernels in C for float32, each a checked torch op (``srt::…``): a linear layer over
weights packed in panels (``panel_linear``), the routed experts of a MoE layer in one call
(``fused_experts``) and RMSNorm with its residual add (``rms_norm``), in ``csrc/cpu_kernels.c``;
decode attention over the paged KV cache (``decode_attention``) and rotary embedding
(``rope``), in ``csrc/cpu_attention.c``; causal extend attention over the same cache
(``extend_attention``), in ``csrc/cpu_extend_attention.c``.

``build.py`` compiles and loads the library (where it cannot, ``available()`` is False and the
layers keep their PyTorch paths), ``checks.py`` says what each op requires of its arguments
and ``ops.py`` registers the ops and holds the functions the layers call.
"""

from __future__ import annotations

import torch

from srt.layers.cpu_kernels.build import load_library
from srt.layers.cpu_kernels.checks import PositionOutsideTable
from srt.layers.cpu_kernels.ops import (
    decode_attention,
    extend_attention,
    fused_experts,
    panel_linear,
    panel_width,
    rms_norm,
    rope,
)

__all__ = [
    "PositionOutsideTable",
    "available",
    "can_pack",
    "decode_attention",
    "extend_attention",
    "fused_experts",
    "pack_panels",
    "panel_linear",
    "panel_width",
    "rms_norm",
    "rope",
    "supports",
]


def available() -> bool:
    """Whether the kernels are built and fast on this CPU (see ``build.load_library``)."""
    return load_library() is not None


def supports(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run on weights of ``dtype`` on ``device``: float32 on CPU, with the
    kernels available. Dense layers (``can_pack``) and the experts
    (``srt.layers.moe.expert_kernel``) ask this one question."""
    return device.type == "cpu" and dtype == torch.float32 and available()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether a weight ``[N, K]`` (or stacked ``[E, N, K]``) fits the kernels (``supports``).
    The experts' kernel also needs whole panels (``expert_kernel.choose_expert_kernel``)."""
    return supports(weight.device, weight.dtype)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` → ``[..., ceil(N / P), K, P]`` for the kernels' panels of ``P`` columns:
    each panel's columns contiguous per k; columns past N (the last panel's) zero."""
    *lead, n, k = weight.shape
    p = panel_width()
    padded = -(-n // p) * p
    weight = weight.detach()
    if padded != n:
        weight = torch.cat((weight, weight.new_zeros(*lead, padded - n, k)), dim=-2)
    return weight.reshape(*lead, padded // p, p, k).transpose(-1, -2).contiguous()
