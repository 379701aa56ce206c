"""The attention backend interface, and the extend batch's sequences that the backends share."""

from __future__ import annotations

import abc
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from srt.layers.radix_attention import RadixAttention
    from srt.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(abc.ABC):
    """A kernel family for paged attention.

    A backend must:
    - ``init_forward_metadata(batch)``: prepare whatever the kernels need for this batch (index
      tables, masks) once per forward, and store it on ``batch.attn_metadata``;
    - ``forward_extend`` / ``forward_decode``: write the new tokens' K/V at
      ``batch.out_cache_loc`` (when ``save_kv_cache``), then attend each query to its sequence's
      cached prefix and to the new tokens causally. q: [T, H, D]; k: [T, Hk, D]; v: [T, Hk, Dv];
      returns [T, H, Dv]. Padded tokens (``out_cache_loc == 0``) may produce anything.

    ``absorbed_mla_extend``: MLA models run extend in the absorbed form too (MQA over the
    cached latent, as in decode) rather than expanding per-head keys and values.
    ``static_decode_metadata``: decode reads nothing but the batch's own tensors (no host
    values), so a CUDA graph captured on static buffers replays it with new values.
    """

    absorbed_mla_extend: bool = False
    static_decode_metadata: bool = False

    @abc.abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...

    @abc.abstractmethod
    def forward_extend(
        self, q, k, v, layer: RadixAttention, batch: ForwardBatch, save_kv_cache: bool = True
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def forward_decode(
        self, q, k, v, layer: RadixAttention, batch: ForwardBatch, save_kv_cache: bool = True
    ) -> torch.Tensor: ...

    def forward(
        self, q, k, v, layer: RadixAttention, batch: ForwardBatch, save_kv_cache: bool = True
    ) -> torch.Tensor:
        if batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, batch, save_kv_cache)
        if batch.forward_mode.is_idle():
            return q.new_empty(0, layer.num_heads, layer.v_head_dim)
        return self.forward_extend(q, k, v, layer, batch, save_kv_cache)


@dataclass(frozen=True)
class ExtendSeqs:
    """An extend batch's sequences, built once per forward for every backend: per sequence
    its cached prefix length, its new tokens, and its first row of ``q`` (the new tokens of
    all sequences lie one after another)."""

    prefix_lens: list[int]
    new_lens: list[int]
    starts: list[int]

    @classmethod
    def of(cls, batch: ForwardBatch) -> ExtendSeqs:
        new = batch.extend_seq_lens_cpu
        starts = list(itertools.accumulate(new, initial=0))[:-1]
        return cls(batch.extend_prefix_lens_cpu, new, starts)

    def table(self) -> torch.Tensor:
        """The kernels' layout: ``[3, B]`` int64 on the host, rows prefix lengths, new
        lengths, first rows."""
        return torch.tensor([self.prefix_lens, self.new_lens, self.starts], dtype=torch.int64)
