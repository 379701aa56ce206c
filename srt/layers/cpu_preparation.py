"""What a layer does once its weights are loaded on CPU (``CpuPreparable``): lay a weight out
for the C kernels' panels or for oneDNN (the linear layers, the routed experts, the router, the
LM head; the dense originals stay for the code paths that read them), or turn its forward over
to a C kernel (RMSNorm, rotary embedding). ``ModelRunner`` calls ``prepare_for_cpu(model)``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class CpuPreparable(Protocol):
    """A module with work to do once loaded on CPU, before the first forward."""

    def prepare_for_cpu(self) -> None:
        """Called once, after loading (and tying) the weights, on CPU only."""


def prepare_for_cpu(model: nn.Module) -> None:
    """Prepare every module of a model loaded on CPU that needs it."""
    for module in model.modules():
        if isinstance(module, CpuPreparable):
            module.prepare_for_cpu()
