"""TboAttnBackend: attention for two-batch overlap.

A primary backend serves the whole batch (the dense layers before the overlapped part, and
every unsplit step); two child backends serve the micro-batches, one each, so that a backend
keeping per-batch state in itself (index buffers, CUDA-graph inputs) never has it overwritten
by the other micro-batch while both are alive. Child metadata is initialised only for
non-empty children. The whole batch's metadata is skipped on a split step when the model has
no layer before the overlapped part (``parent_attends_when_split`` False): nothing reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from srt.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from srt.model_executor.forward_batch_info import ForwardBatch


class TboAttnBackend(AttentionBackend):
    def __init__(
        self,
        primary: AttentionBackend,
        children: list[AttentionBackend],
        parent_attends_when_split: bool = True,
    ):
        if len(children) != 2:
            raise ValueError(f"two-batch overlap has two micro-batches, got {len(children)}")
        self.primary = primary
        self.children = children
        self.absorbed_mla_extend = primary.absorbed_mla_extend
        self.static_decode_metadata = primary.static_decode_metadata
        self.parent_attends_when_split = parent_attends_when_split

    @classmethod
    def init_new(
        cls, creator: Callable[[], AttentionBackend], parent_attends_when_split: bool = True
    ) -> TboAttnBackend:
        return cls(creator(), [creator(), creator()], parent_attends_when_split)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if not batch.tbo_children or self.parent_attends_when_split:
            self.primary.init_forward_metadata(batch)
        for child, backend in zip(batch.tbo_children or (), self.children):
            child.attn_backend = backend
            if child.num_tokens:
                backend.init_forward_metadata(child)

    # The parent batch's attention (a child batch calls its own backend directly).
    def forward_extend(self, q, k, v, layer, batch, save_kv_cache=True):
        return self.primary.forward_extend(q, k, v, layer, batch, save_kv_cache)

    def forward_decode(self, q, k, v, layer, batch, save_kv_cache=True):
        return self.primary.forward_decode(q, k, v, layer, batch, save_kv_cache)
