"""Token embedding and LM head, ready for vocabulary sharding across TP ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from srt.layers.linear import copy_checked, pack_weight


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, end) of the (padded) vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.num_embeddings = num_embeddings
        per_rank = -(-num_embeddings // tp_size)
        self.start = min(tp_rank * per_rank, num_embeddings)
        self.end = min(num_embeddings, self.start + per_rank)
        self.tp_size = tp_size
        self.weight = nn.Parameter(torch.empty(per_rank, embedding_dim))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, name: str = "") -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            copy_checked(param, loaded, name)  # raises with both shapes
        rows = self.end - self.start
        param.data.zero_()
        param.data[:rows].copy_(loaded[self.start : self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mask, input_ids - self.start, 0)
        out = F.embedding(local, self.weight)
        return out * mask.unsqueeze(-1).to(out.dtype)  # the caller all-reduces


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection; its logits are computed by LogitsProcessor."""

    packed_weight = None  # the CPU layout of the weight, set by prepare_for_cpu

    def prepare_for_cpu(self) -> None:
        """Once loaded (and tied, where it shares the embedding), on CPU: the weight laid out
        for ``linear`` (``srt.layers.linear.pack_weight``)."""
        self.packed_weight = pack_weight(self.weight)
