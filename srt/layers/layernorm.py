"""RMSNorm with an optional fused residual add (computed in float32, as HF does)."""

from __future__ import annotations

import torch
from torch import nn

from srt.layers import cpu_kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps
        self.in_kernel = False  # set by prepare_for_cpu where the CPU kernels run this norm

    def prepare_for_cpu(self) -> None:
        """Once loaded, on CPU: run float32 and bfloat16 norms in one C call
        (``cpu_kernels.rms_norm``)."""
        w = self.weight
        in_kernel = w.dtype in cpu_kernels.ACT_TYPES
        self.in_kernel = in_kernel and cpu_kernels.supports(w.device, w.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual). Once
        ``prepare_for_cpu`` found the CPU kernels, input of the weight's dtype takes one C call."""
        dtype = self.weight.dtype
        if self.in_kernel and x.dtype == dtype and x.numel():
            if residual is None or residual.dtype == dtype:
                return cpu_kernels.rms_norm(x, self.weight, self.variance_epsilon, residual)
        if residual is not None:
            x = x + residual
            residual = x
        out = self._norm(x)
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * h.to(dtype)
