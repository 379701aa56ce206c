"""Rotary position embedding: default and YaRN frequencies, NeoX (half-split) and GPT-J
(interleaved pairs) layouts."""

from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(config) -> dict:
    """The HF config's rope settings (``rope_parameters`` in transformers 5, else the legacy
    ``rope_scaling`` plus ``rope_theta``)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale_factor(rope_parameters: dict | None) -> float:
    """DeepSeek multiplies the softmax scale by mscale² when YaRN has ``mscale_all_dim``."""
    params = rope_parameters or {}
    if params.get("rope_type", params.get("type")) != "yarn" or not params.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2


def _yarn_inv_freq(
    dim: int, base: float, params: dict, max_position: int
) -> tuple[torch.Tensor, float]:
    factor = params.get("factor") or max_position / params["original_max_position_embeddings"]
    orig = params["original_max_position_embeddings"]
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        rotary_dim: int,
        max_position: int,
        rope_parameters: dict | None,
        is_neox_style: bool = True,
    ):
        super().__init__()
        params = dict(rope_parameters or {})
        base = float(params.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "yarn":
            inv_freq, self.attention_factor = _yarn_inv_freq(rotary_dim, base, params, max_position)
        elif rope_type == "default":
            inv_freq = 1.0 / base ** (
                torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
            )
            self.attention_factor = 1.0
        else:
            raise ValueError(f"unsupported rope type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, Hq, rotary_dim]; k [T, Hk, rotary_dim]."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos = (freqs.cos() * self.attention_factor).to(q.dtype)[:, None, :]
        sin = (freqs.sin() * self.attention_factor).to(q.dtype)[:, None, :]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.is_neox_style:
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
