"""LayerCommunicator: the norms and (later) collectives around attention and MLP.

On one rank the operations are the pre-attention and pre-MLP RMSNorms with their fused residual
adds; with tensor or data parallelism they also carry the gathers, scatters and reductions.
"""

from __future__ import annotations

from srt.batch_overlap.operations import LayerState
from srt.layers.layernorm import RMSNorm


class LayerCommunicator:
    def __init__(self, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm):
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm

    def prepare_attn(self, state: LayerState) -> None:
        hidden, residual = state.pop("hidden_states"), state.pop("residual")
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        state.put(attn_input=hidden, residual=residual)

    def prepare_mlp(self, state: LayerState) -> None:
        hidden, residual = self.post_attention_layernorm(
            state.pop("attn_output"), state.pop("residual")
        )
        state.put(mlp_input=hidden, residual=residual)

    def postprocess(self, state: LayerState) -> None:
        state.put(hidden_states=state.pop("mlp_output"))
