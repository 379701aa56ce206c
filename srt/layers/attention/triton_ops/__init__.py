"""Triton kernels of the triton attention backend: paged decode (split-KV) and extend attention
over the KV pool, read in place through the request → token-slot table."""

from srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd

__all__ = ["decode_attention_fwd", "extend_attention_fwd"]
