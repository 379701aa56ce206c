"""Operations strategies: which operations a layer runs, in which order, and where the stage
boundaries (``YieldOperation``) of two-batch overlap fall (SGLang's lists for DeepSeek and
Qwen3-MoE).

A strategy is data. Each decoder layer names its family (``operations_family``, a class
attribute set by the model file, never looked up by class name); the family gives the
operation names per forward mode, and the layer turns names into its bound operations
(``layer.operation(name)``). The plain forward runs the same lists with the yields ignored, so
there is one code path for both.

Where the stages cut, for the two micro-batches A and B:
- prefill (delta 0): A launches its dispatch at the end of a stage, and B's whole attention
  runs while it is in flight; then A's experts run while B's dispatch travels, and so on.
- decode and target-verify (delta 2): A runs two stages ahead, so each all-to-all of one
  micro-batch is in flight while the other computes its attention, router or experts.
Layers are concatenated: the last stage of layer l runs on into the first of layer l + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from srt.layers.overlap.operations import ExecutionOperation, OperationItem, YieldOperation
from srt.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from srt.models.decoder_layer import MoEDecoderLayer

YIELD = YieldOperation()
_ATTN = ("comm_prepare_attn", "prepare_attn")


@dataclass(frozen=True)
class OperationsFamily:
    """Operation names (and YIELDs) of one layer per mode, and the stage lead of A."""

    name: str
    prefill: tuple[str | YieldOperation, ...]
    decode: tuple[str | YieldOperation, ...]
    prefill_delta_stages: int = 0
    decode_delta_stages: int = 2

    def for_mode(self, mode: ForwardMode) -> tuple[tuple[str | YieldOperation, ...], int]:
        if mode.is_idle():
            raise ValueError("an IDLE step follows the global forward mode's strategy")
        if mode.is_decode() or mode.is_target_verify():
            return self.decode, self.decode_delta_stages
        return self.prefill, self.prefill_delta_stages


DEEPSEEK = OperationsFamily(
    "deepseek",
    prefill=(
        *_ATTN, "core_attn", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a", YIELD,
        "dispatch_b", "experts", "combine_a", YIELD,
        "shared_experts", "combine_b", "output", "comm_postprocess",
    ),
    decode=(
        *_ATTN, YIELD,
        "core_attn", "comm_prepare_mlp", "gate", "select_experts", YIELD,
        "dispatch_a", "shared_experts", YIELD,
        "dispatch_b", "experts", "combine_a", YIELD,
        "combine_b", YIELD,
        "output", "comm_postprocess",
    ),
)  # fmt: skip

QWEN3_MOE = OperationsFamily(
    "qwen3_moe",
    prefill=(
        *_ATTN, "core_attn", "comm_prepare_mlp", "gate", "select_experts", "dispatch_a", YIELD,
        "dispatch_b", "experts", "combine_a", YIELD,
        "combine_b", "output", "comm_postprocess",
    ),
    decode=(
        *_ATTN, YIELD,
        "core_attn", "comm_prepare_mlp", "gate", "select_experts", YIELD,
        "dispatch_a", YIELD,
        "dispatch_b", "experts", "combine_a", YIELD,
        "combine_b", "output", "comm_postprocess", YIELD,
    ),
)  # fmt: skip

# A dense layer (no all-to-all) inside the overlapped part: one cut between attention's
# projections and its kernel, so the other micro-batch's communication still has company.
DENSE = OperationsFamily(
    "dense",
    prefill=(*_ATTN, YIELD, "core_attn", "comm_prepare_mlp", "mlp", "comm_postprocess"),
    decode=(*_ATTN, YIELD, "core_attn", "comm_prepare_mlp", "mlp", "comm_postprocess"),
)


@dataclass
class OperationsStrategy:
    operations: list[OperationItem]
    tbo_delta_stages: int | None = None  # None: no MoE layer sets it (dense only)

    @classmethod
    def init_new_tbo(
        cls, layers: Sequence[MoEDecoderLayer], forward_mode: ForwardMode
    ) -> OperationsStrategy:
        """The layers' lists concatenated; the delta is the MoE layers' (all must agree)."""
        parts = [layer_operations(layer, forward_mode) for layer in layers]
        deltas = {p.tbo_delta_stages for p in parts if p.tbo_delta_stages is not None}
        if len(deltas) > 1:
            raise ValueError(f"layers of one model disagree on tbo_delta_stages: {deltas}")
        ops = [op for p in parts for op in p.operations]
        return cls(ops, deltas.pop() if deltas else 0)


# Where the plain path runs the shared experts under an overlap mode that moves them.
_SHARED_EXPERTS_AFTER = {"sbo": "dispatch_a", "dbo": "combine_a"}


def layer_operations(
    layer: MoEDecoderLayer, forward_mode: ForwardMode, overlap: str = "off"
) -> OperationsStrategy:
    """The layer's operations for ``forward_mode`` under the step's ``overlap`` mode. On the
    plain path: single-batch overlap places the shared experts between ``dispatch_a`` and
    ``dispatch_b``; dual-batch overlap (vLLM's schedule) between ``combine_a`` and
    ``combine_b``, where the combine's yield follows them."""
    family = layer.operations_family if layer.is_moe else DENSE
    names, delta = family.for_mode(forward_mode)
    after = _SHARED_EXPERTS_AFTER.get(overlap)
    if after is not None and layer.has_shared_experts:
        names = [n for n in names if n != "shared_experts"]
        names.insert(names.index(after) + 1, "shared_experts")
    ops: list[OperationItem] = []
    for name in names:
        if isinstance(name, YieldOperation):
            ops.append(name)
        elif name != "shared_experts" or layer.has_shared_experts:
            ops.append(ExecutionOperation(name, layer.operation(name), layer.layer_id))
    return OperationsStrategy(ops, delta if layer.is_moe else None)
