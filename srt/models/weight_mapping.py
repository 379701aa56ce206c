"""The name → parameter lookup shared by all models: a checkpoint tensor's name, through the
model's ``WeightMapping``, to the parameter (and the shard of it) that takes it."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from srt.layers.linear import default_weight_loader

_EXPERT_RE = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$"
)
_EXPERT_SHARDS = {
    "gate_proj": ("w13_weight", "w1"),
    "up_proj": ("w13_weight", "w3"),
    "down_proj": ("w2_weight", "w2"),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class WeightMapping:
    """How checkpoint names map onto a model's (fused) parameters.

    ``stacked``: (parameter name part, checkpoint name part, shard id) — e.g. q_proj goes into
    qkv_proj as shard "q". Per-expert tensors ``…experts.{e}.{gate,up,down}_proj.weight`` go to
    the stacked ``w13_weight`` / ``w2_weight`` of ``num_experts`` experts (their fp8 block
    scales ``….weight_scale_inv`` to ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``).
    """

    stacked: list[tuple[str, str, str | int]]
    num_experts: int = 0
    num_layers: int | None = None  # layers at or past this index (e.g. MTP) are skipped
    skip_prefixes: tuple[str, ...] = ()


def _skip(name: str, mapping: WeightMapping) -> bool:
    if name.endswith("rotary_emb.inv_freq") or name.startswith(mapping.skip_prefixes):
        return True
    layer = _LAYER_RE.match(name)
    return bool(
        layer and mapping.num_layers is not None and int(layer.group(1)) >= mapping.num_layers
    )


def _route(name: str, mapping: WeightMapping) -> tuple[str, tuple]:
    """checkpoint name → (parameter name, extra weight_loader args)."""
    expert = _EXPERT_RE.match(name)
    if expert:
        param, shard = _EXPERT_SHARDS[expert.group(3)]
        scale = expert.group(4) or ""  # fp8: the block scales
        return f"{expert.group(1)}.{param}{scale}", (shard, int(expert.group(2)))
    for param_part, ckpt_part, shard in mapping.stacked:
        if f".{ckpt_part}." in name:
            return name.replace(f".{ckpt_part}.", f".{param_part}."), (shard,)
    return name, ()


def _expected_pieces(name: str, mapping: WeightMapping) -> int:
    if name.endswith((".w13_weight", ".w13_weight_scale_inv")):
        return 2 * mapping.num_experts
    if name.endswith((".w2_weight", ".w2_weight_scale_inv")):
        return mapping.num_experts
    return max(1, sum(f".{p}." in name for p, _, _ in mapping.stacked))


def load_weights_by_mapping(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], mapping: WeightMapping
) -> None:
    """Load every checkpoint tensor through its parameter's ``weight_loader``.

    Raises ValueError naming the tensor for an unknown tensor, a shape mismatch, or a parameter
    the checkpoint does not provide."""
    params = dict(model.named_parameters())
    pieces: Counter[str] = Counter()
    for ckpt_name, tensor in weights:
        if _skip(ckpt_name, mapping):
            continue
        name, extra = _route(ckpt_name, mapping)
        param = params.get(name)
        if param is None:
            raise ValueError(
                f"checkpoint tensor {ckpt_name} {tuple(tensor.shape)} matches no "
                f"parameter of {type(model).__name__}"
            )
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            default_weight_loader(param, tensor, ckpt_name)
        else:
            loader(param, tensor, ckpt_name, *extra)
        pieces[name] += 1
    missing = [n for n in params if pieces[n] < _expected_pieces(n, mapping)]
    if missing:
        raise ValueError(f"checkpoint is missing tensors for parameters: {', '.join(missing)}")
