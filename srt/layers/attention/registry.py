"""The attention backends by their ``--attention-backend`` names (``auto`` is resolved by
``ServerArgs`` into one of them)."""

from __future__ import annotations

from srt.layers.attention.base_attn_backend import AttentionBackend
from srt.layers.attention.cpu_backend import CpuAttnBackend
from srt.layers.attention.torch_native_backend import TorchNativeAttnBackend


def attention_backend_class(name: str) -> type[AttentionBackend]:
    """The class of the backend named ``name``: ``triton``, ``cpu`` or ``torch_native``."""
    if name == "triton":  # imported only where chosen: it needs the triton package
        from srt.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend
    backends = {"cpu": CpuAttnBackend, "torch_native": TorchNativeAttnBackend}
    if name not in backends:
        raise ValueError(f"unknown attention backend {name!r} (ServerArgs resolves 'auto')")
    return backends[name]
