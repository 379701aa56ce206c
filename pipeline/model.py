"""A small MoE language model to train through the pipeline schedules, cut into stages.

Each block is causal self-attention then a sparse MoE MLP routed by srt's ``select_experts``
(Qwen3-MoE's softmax top-k; or DeepSeek-V3's sigmoid scores with a correction bias and a
shared expert), normed by srt's ``RMSNorm``; the experts run as a loop over experts, which
autograd differentiates; ``MoE.shard`` keeps one EP rank's block of experts and sends tokens
to their owners (``pipeline/ep.py``). ``build_model`` makes the whole model from one seed and
``split_stages`` cuts its blocks into ``num_stages`` equal runs: stage 0 also embeds, the last
also norms and projects to the vocabulary. Every rank builds it alike and keeps its own
stages, so parameter names (``blocks.3.moe.w1``) are the same everywhere and match the
unsplit reference's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.ep import EPGroup, dispatch_combine
from srt.layers.layernorm import RMSNorm
from srt.layers.moe.topk import TopKConfig, select_experts


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 64
    hidden: int = 32
    heads: int = 4
    layers: int = 8
    experts: int = 8
    top_k: int = 2
    intermediate: int = 48
    shape: str = "qwen3_moe"  # or "deepseek_v3"


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, e = cfg.hidden, cfg.intermediate, cfg.experts
        self.gate = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.randn(e, i, h) * h**-0.5)
        self.w3 = nn.Parameter(torch.randn(e, i, h) * h**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, h, i) * i**-0.5)
        v3 = cfg.shape == "deepseek_v3"
        self.topk = TopKConfig(cfg.top_k, "sigmoid" if v3 else "softmax", renormalize=True)
        self.bias = nn.Parameter(torch.zeros(e), requires_grad=False) if v3 else None
        self.shared = nn.Sequential(nn.Linear(h, i, bias=False), nn.SiLU(),
                                    nn.Linear(i, h, bias=False)) if v3 else None  # fmt: skip

        self.ep: EPGroup | None = None

    def shard(self, ep: EPGroup) -> None:
        """Keep this rank's block of experts and exchange tokens over ``ep``."""
        num = self.w1.shape[0]
        if num % ep.size:
            raise ValueError(f"{num} experts do not split over an EP group of {ep.size}")
        lo, hi = ep.rank * num // ep.size, (ep.rank + 1) * num // ep.size
        for name in ("w1", "w3", "w2"):
            setattr(self, name, nn.Parameter(getattr(self, name).detach()[lo:hi].clone()))
        self.ep = ep

    def _experts(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(rows)
        for e in range(self.w1.shape[0]):
            (idx,) = (local_ids == e).nonzero(as_tuple=True)
            if idx.numel():
                h = rows[idx]
                y = (F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())) @ self.w2[e].t()
                out = out.index_add(0, idx, y)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [T, H]
        weights, ids = select_experts(self.gate(flat), self.topk, self.bias)  # [T, k]
        if self.ep is not None:
            out = dispatch_combine(flat, weights, ids, self.w1.shape[0], self.ep, self._experts)
            if self.shared is not None:
                out = out + self.shared(flat)
            return out.view_as(x)
        out = torch.zeros_like(flat)
        for e in range(self.w1.shape[0]):
            token, slot = (ids == e).nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            h = flat[token]
            y = (F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())) @ self.w2[e].t()
            out = out.index_add(0, token, y * weights[token, slot, None].to(y.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.o = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        b, t, h = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        a = F.scaled_dot_product_attention(*(y.transpose(1, 2) for y in (q, k, v)), is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
        return x + self.moe(self.mlp_norm(x))


class Stage(nn.Module):
    """A run of blocks; the first stage embeds token ids, the last returns logits."""

    def __init__(self, blocks: list[Block], embed: nn.Embedding | None, head: nn.Module | None):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.embed, self.head = embed, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = nn.Sequential(RMSNorm(cfg.hidden), nn.Linear(cfg.hidden, cfg.vocab, bias=False))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return Stage(list(self.blocks), self.embed, self.head)(ids)


def build_model(cfg: ModelConfig, seed: int = 0) -> Model:
    torch.manual_seed(seed)
    return Model(cfg)


def split_stages(model: Model, num_stages: int) -> list[Stage]:
    """The model's blocks in ``num_stages`` equal runs (sharing the model's parameters)."""
    layers = len(model.blocks)
    if layers % num_stages:
        raise ValueError(f"{layers} layers do not split into {num_stages} equal stages")
    per = layers // num_stages
    return [
        Stage(list(model.blocks[s * per : (s + 1) * per]), model.embed if s == 0 else None,
              model.head if s == num_stages - 1 else None)
        for s in range(num_stages)
    ]  # fmt: skip


def loss_fn(logits: torch.Tensor, labels: torch.Tensor, num_microbatches: int) -> torch.Tensor:
    """A micro-batch's share of the step's mean loss."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()) / num_microbatches
