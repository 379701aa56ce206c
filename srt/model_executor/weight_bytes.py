"""How many weight bytes a forward step reads, for the choices that go by it: the CPU threads
of a step (``cpu_threads``), the model's size in the scheduler's report, and the bytes a
decode step reads in the benchmarks (``benchmark/common/weight_bytes.py``: bench_one_batch's
effective bandwidth, the GPU report's memory floor).

A step does not read the whole model: of the routed experts it reads at most ``tokens × top_k``
experts' worth, so a mixture of experts that is large in all reads, for a few tokens, as little
as a small model."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from srt.layers.moe.moe_block import SparseMoeBlock


@dataclass(frozen=True)
class WeightBytes:
    """This rank's weight bytes: ``dense_bytes`` outside the routed experts, ``expert_bytes``
    in them (``num_experts`` in the model, ``top_k`` per token)."""

    dense_bytes: int
    expert_bytes: int = 0
    num_experts: int = 0
    top_k: int = 0

    @classmethod
    def of(cls, model: nn.Module, per_weight: int | None = None) -> WeightBytes:
        """The model's parameter bytes, each weight counted at ``per_weight`` bytes if given
        (the float32 bytes of a bf16 or fp8 model), else at its dtype's size."""
        blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]

        def size(params) -> int:
            return sum(p.numel() * per_weight if per_weight else p.nbytes for p in params)

        total = size(model.parameters())
        if not blocks:
            return cls(total)
        experts = sum(size(b.experts.parameters()) for b in blocks)
        first = blocks[0]
        return cls(total - experts, experts, first.experts.num_experts, first.topk_config.top_k)

    @property
    def total(self) -> int:
        return self.dense_bytes + self.expert_bytes

    def read_by(self, tokens: int) -> int:
        """The bytes a step of ``tokens`` tokens (a decode step: its sequences) reads: all but
        the routed experts, and of those at most ``tokens × top_k`` experts' share."""
        if not self.num_experts:
            return self.total
        share = min(1.0, tokens * self.top_k / self.num_experts)
        return self.dense_bytes + int(self.expert_bytes * share)
