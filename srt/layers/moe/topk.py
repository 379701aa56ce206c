"""Router top-k selection: softmax or sigmoid scores, optional group-limited choice and
correction bias (DeepSeek-V3's noaux_tc), renormalisation and routed scaling."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


class TopKOutput(NamedTuple):
    topk_weights: torch.Tensor  # [T, topk] float32
    topk_ids: torch.Tensor  # [T, topk] int64, global expert ids


@dataclass(frozen=True)
class TopKConfig:
    top_k: int
    scoring_func: str = "softmax"  # softmax | sigmoid
    renormalize: bool = False
    num_expert_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0


def _group_mask(scores: torch.Tensor, cfg: TopKConfig, biased: bool) -> torch.Tensor:
    num_tokens, num_experts = scores.shape
    group_size = num_experts // cfg.num_expert_group  # not -1: a view of 0 tokens needs it
    grouped = scores.view(num_tokens, cfg.num_expert_group, group_size)  # [T, G, E/G]
    if biased:  # V3: a group scores by the sum of its two best experts
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
    else:  # V2: by its best expert
        group_scores = grouped.max(dim=-1).values  # [T, G]
    group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    return group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts).bool()


def select_experts(
    router_logits: torch.Tensor, cfg: TopKConfig, correction_bias: torch.Tensor | None = None
) -> TopKOutput:
    """router_logits: [T, E] → weights and ids of the chosen experts, [T, topk] each."""
    logits = router_logits.float()
    if cfg.scoring_func == "softmax":
        scores = logits.softmax(dim=-1)  # [T, E]
    elif cfg.scoring_func == "sigmoid":
        scores = logits.sigmoid()  # [T, E]
    else:
        raise ValueError(f"unsupported scoring function {cfg.scoring_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if cfg.num_expert_group and cfg.topk_group and cfg.num_expert_group > 1:
        mask = _group_mask(choice, cfg, biased=correction_bias is not None)
        choice = choice.masked_fill(~mask, float("-inf"))
    topk_ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]  # [T, topk]
    topk_weights = scores.gather(1, topk_ids)  # [T, topk]
    if cfg.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * cfg.routed_scaling_factor
    return TopKOutput(topk_weights, topk_ids)
