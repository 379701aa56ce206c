"""LayerCommunicator: the norms and collectives around attention and MLP.

On one rank the operations are the pre-attention and pre-MLP RMSNorms with their fused residual
adds. With tensor parallelism (``--moe-a2a-backend none``, no DP attention) each rank's o_proj
(row-parallel) and MLP / MoE outputs are partial sums: ``prepare_mlp`` all-reduces the attention
output over the attention-TP group before the norm, ``postprocess`` all-reduces the MLP output
over the TP group. Both collectives are no-ops on one rank.
"""

from __future__ import annotations

from srt.batch_overlap.operations import LayerState
from srt.distributed.communication_op import all_reduce
from srt.distributed.group_coordinator import GroupCoordinator
from srt.layers.layernorm import RMSNorm


class LayerCommunicator:
    def __init__(
        self,
        input_layernorm: RMSNorm,
        post_attention_layernorm: RMSNorm,
        attn_tp_group: GroupCoordinator | None = None,
        mlp_tp_group: GroupCoordinator | None = None,
    ):
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.attn_tp_group = attn_tp_group
        self.mlp_tp_group = mlp_tp_group

    def prepare_attn(self, state: LayerState) -> None:
        hidden, residual = state.pop("hidden_states"), state.pop("residual")
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        state.put(attn_input=hidden, residual=residual)

    def prepare_mlp(self, state: LayerState) -> None:
        attn_output = state.pop("attn_output")
        if self.attn_tp_group is not None:
            attn_output = all_reduce(self.attn_tp_group, attn_output)
        hidden, residual = self.post_attention_layernorm(attn_output, state.pop("residual"))
        state.put(mlp_input=hidden, residual=residual)

    def postprocess(self, state: LayerState) -> None:
        mlp_output = state.pop("mlp_output")
        if self.mlp_tp_group is not None:
            mlp_output = all_reduce(self.mlp_tp_group, mlp_output)
        state.put(hidden_states=mlp_output)
