"""LayerCommunicator: the norms and collectives around attention and MLP.

On one rank the operations are the pre-attention and pre-MLP RMSNorms with their fused residual
adds. Attention is sharded inside the attention-TP group, so ``prepare_mlp`` first all-reduces
the row-parallel o_proj output there; the residual always stays with the group's own tokens.
Then it depends on where the MLP's tokens and weights are (:class:`MlpMode`):

- ``TP``: the MLP runs on the group's tokens with weights sharded over the attention-TP group
  (dense layers; a MoE with ``--moe-a2a-backend none`` without DP attention, where that group
  is the world). ``postprocess`` all-reduces the partial sums there.
- ``DP_GATHER``: a MoE with ``--moe-a2a-backend none`` under DP attention. Experts are sharded
  over the whole world, so every rank needs every group's tokens: ``prepare_mlp`` gathers them
  into the padded global buffer (``dp_gather``), ``postprocess`` sums the partial outputs and
  brings back this group's rows (``dp_scatter``).
- ``A2A``: a MoE with an all-to-all backend. Tokens travel to their experts' ranks, so each
  attention-TP rank sends only its chunk of the group's tokens (``prepare_mlp``);
  ``postprocess`` all-gathers the chunks' (complete, not partial) outputs inside the group.
"""

from __future__ import annotations

from enum import Enum, auto
from typing import TYPE_CHECKING

from srt.distributed.communication_op import all_reduce
from srt.layers.dp_attention import attn_tp_all_gather, attn_tp_chunk, dp_gather, dp_scatter
from srt.layers.layernorm import RMSNorm
from srt.layers.overlap.operations import LayerState

if TYPE_CHECKING:
    from srt.distributed.parallel_state import ParallelState


class MlpMode(Enum):
    TP = auto()
    DP_GATHER = auto()
    A2A = auto()

    @classmethod
    def for_layer(cls, parallel: ParallelState, is_moe: bool) -> MlpMode:
        if not is_moe:
            return cls.TP
        if parallel.config.moe_a2a_backend != "none":
            return cls.A2A
        return cls.DP_GATHER if parallel.attn_dp_size > 1 else cls.TP


class LayerCommunicator:
    def __init__(
        self,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        parallel: ParallelState,
        mode: MlpMode,
    ):
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.parallel = parallel
        self.mode = mode

    def prepare_attn(self, state: LayerState) -> None:
        hidden, residual = state.pop("hidden_states"), state.pop("residual")
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        state.put(attn_input=hidden, residual=residual)

    def prepare_mlp(self, state: LayerState) -> None:
        p = self.parallel
        attn_output = all_reduce(p.attn_tp, state.pop("attn_output"))
        hidden, residual = self.post_attention_layernorm(attn_output, state.pop("residual"))
        if self.mode is MlpMode.DP_GATHER:
            hidden = dp_gather(p, hidden, state.batch)
        elif self.mode is MlpMode.A2A:
            hidden = attn_tp_chunk(hidden, p.attn_tp_rank, p.attn_tp_size)
        state.put(mlp_input=hidden, residual=residual)

    def postprocess(self, state: LayerState) -> None:
        p, out = self.parallel, state.pop("mlp_output")
        num_tokens = state.get("residual").shape[0]  # this group's tokens
        if self.mode is MlpMode.TP:
            out = all_reduce(p.attn_tp, out)
        elif self.mode is MlpMode.DP_GATHER:
            out = dp_scatter(p, out, state.batch, num_tokens)
        else:
            out = attn_tp_all_gather(p.attn_tp, out, num_tokens)
        state.put(hidden_states=out)
