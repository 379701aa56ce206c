"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2·d] (gate | up) → silu(gate) · up, [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


class SiluAndMul(nn.Module):
    """``silu_and_mul`` as a module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
