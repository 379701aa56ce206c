"""Layer operations and their executor.

A decoder layer exposes its forward as a list of small operations (``op_*`` methods). Each
operation reads and writes a ``LayerState``; the plain forward runs the list in order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from srt.model_executor.forward_batch_info import ForwardBatch

Operation = Callable[["LayerState"], None]


@dataclass
class LayerState:
    """What flows between a layer's operations.

    ``batch`` and ``positions`` are read-only context. Every other value is written once with
    ``put`` and consumed once with ``pop``; writing a key twice or leaving one behind is a bug
    that raises.
    """

    batch: ForwardBatch
    positions: torch.Tensor
    values: dict[str, Any] = field(default_factory=dict)

    def put(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            if key in self.values:
                raise KeyError(f"layer state key {key!r} written twice")
            self.values[key] = value

    def pop(self, key: str) -> Any:
        if key not in self.values:
            raise KeyError(f"layer state key {key!r} read before it was written")
        return self.values.pop(key)

    def get(self, key: str) -> Any:
        if key not in self.values:
            raise KeyError(f"layer state key {key!r} read before it was written")
        return self.values[key]

    def take_outputs(self, *keys: str) -> tuple[Any, ...]:
        outputs = tuple(self.pop(k) for k in keys)
        if self.values:
            raise KeyError(f"layer state left over after the layer: {sorted(self.values)}")
        return outputs


def execute_operations(state: LayerState, operations: Sequence[Operation]) -> None:
    """The plain path: every operation once, in order."""
    for op in operations:
        op(state)
