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

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: norm(x). With it: (norm(x + residual), x + residual). On CPU in
        float32 one call of the C kernel (``cpu_kernels.rms_norm``) does it all."""
        if x.dtype == torch.float32 and x.device.type == "cpu" and x.numel():
            lib = cpu_kernels.load_library()
            if lib is not None and self.weight.dtype == torch.float32:
                if residual is not None and residual.dtype != torch.float32:
                    residual = residual.float()
                return cpu_kernels.rms_norm(lib, x, self.weight, self.variance_epsilon, residual)
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
