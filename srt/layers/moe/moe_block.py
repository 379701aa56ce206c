"""A sparse MoE block (router, routed experts, optional shared experts) as layer operations.

The block sees the tokens its communicator hands it (the group's own, the gathered global
buffer, or this rank's all-to-all chunk) and moves them to the experts with a dispatcher. The
dispatchers are not owned by the block: a model's MoE layers share one per micro-batch (its
buffers are per exchange in flight, not per layer), so they are passed in, one per
micro-batch. A batch picks its own by ``tbo_subbatch_index`` (two-batch overlap: A uses the
first, B the second, so their exchanges never share buffers); an unsplit batch uses the first.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from srt.eplb.expert_distribution import ExpertDistributionRecorder
from srt.eplb.expert_location import ExpertDispatchMap
from srt.layers import cpu_kernels
from srt.layers.cpu_kernels import ACT_TYPES
from srt.layers.dp_attention import max_chunk_tokens
from srt.layers.linear import linear, pack_weight
from srt.layers.moe.blocked_experts import BlockedProjection
from srt.layers.moe.expert_kernel import ExpertKernel
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.moe.token_dispatcher.base import CommMeter, TokenDispatcher
from srt.layers.moe.topk import TopKConfig, select_experts
from srt.layers.overlap.operations import LayerState
from srt.model_executor.forward_batch_info import ForwardBatch


class MoEGate(nn.Module):
    """Router weights, named as in HF checkpoints (``mlp.gate.weight`` and, for DeepSeek-V3,
    ``mlp.gate.e_score_correction_bias``)."""

    def __init__(
        self, num_experts: int, hidden_size: int, with_correction_bias: bool, fp32_logits: bool
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts), requires_grad=False)
            if with_correction_bias
            else None
        )
        self.fp32_logits = fp32_logits
        self.packed_weight = None  # the CPU layout of the weight, set by prepare_for_cpu

    def prepare_for_cpu(self) -> None:
        self.packed_weight = pack_weight(self.weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if self.fp32_logits:
            hidden_states, weight = hidden_states.float(), weight.float()
        return linear(hidden_states, weight, packed=self.packed_weight)  # [T, E]


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        gate: MoEGate,
        experts: FusedMoE,
        topk_config: TopKConfig,
        dispatchers: Sequence[TokenDispatcher],
        shared_experts: nn.Module | None = None,
        attn_tp_size: int = 1,
        comm_meter: CommMeter | None = None,
        dispatch_map: ExpertDispatchMap | None = None,
        layer_id: int = 0,
    ):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.topk_config = topk_config
        self.dispatchers = tuple(dispatchers)
        self.attn_tp_size = attn_tp_size  # each rank dispatches 1/attn_tp of its group's tokens
        self.comm_meter = comm_meter or CommMeter()  # shared by a model's MoE layers
        self.dispatch_map = dispatch_map  # EPLB: logical → physical ids, None: the same
        self.layer_id = layer_id
        self.recorder: ExpertDistributionRecorder | None = None  # set by the model runner

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The block as one call, for a model written without operation lists: its operations
        in vLLM's order (the shared experts between the combine's send and its receive, where
        dual-batch overlap hands over)."""
        state = LayerState(batch, batch.positions)
        state.put(mlp_input=hidden_states)
        shared = [self.op_shared_experts] if self.shared_experts is not None else []
        for op in (
            self.op_gate, self.op_select_experts, self.op_dispatch_a, self.op_dispatch_b,
            self.op_experts, self.op_combine_a, *shared, self.op_combine_b, self.op_output,
        ):  # fmt: skip
            op(state)
        return state.take_outputs("mlp_output")[0]

    def dispatcher(self, state: LayerState) -> TokenDispatcher:
        return self.dispatchers[state.batch.tbo_subbatch_index or 0]

    def op_gate(self, state: LayerState) -> None:
        state.put(router_logits=self.gate(state.get("mlp_input")))

    def op_select_experts(self, state: LayerState) -> None:
        """The router's choice, counted by the recorder where it is active. Where the experts
        run in the CPU kernels, so does the choice, counting included (one call)."""
        logits, bias = state.pop("router_logits"), self.gate.e_score_correction_bias
        recorder = self.recorder if self.recorder is not None and self.recorder.active else None
        if self.experts.packed_kernel is ExpertKernel.CPU_KERNEL and logits.dtype in ACT_TYPES:
            counts = () if recorder is None else recorder.rows(self.layer_id)
            weights, ids = cpu_kernels.select_experts(logits, self.topk_config, bias, counts)
        else:
            weights, ids = select_experts(logits, self.topk_config, bias)
            if recorder is not None:
                recorder.record(self.layer_id, ids)
        if self.dispatch_map is not None:
            ids = self.dispatch_map(ids)
        state.put(topk_output=(weights, ids))

    def op_dispatch_a(self, state: LayerState) -> None:
        hidden = state.get("mlp_input") if self.shared_experts else state.pop("mlp_input")
        weights, ids = state.pop("topk_output")
        batch, meter = state.batch, self.comm_meter
        meter.timed(
            partial(
                self.dispatcher(state).dispatch_a,
                is_extend=batch.global_is_extend(),
                global_max_tokens=max_chunk_tokens(batch, self.attn_tp_size),
                blocked_combine=batch.split.mode == "sbo",
            ),
            hidden,
            weights,
            ids,
        )

    def op_dispatch_b(self, state: LayerState) -> None:
        out = self.comm_meter.timed(self.dispatcher(state).dispatch_b)
        self.comm_meter.bytes += 2 * out.hidden_states.nbytes  # in, and back in the combine
        state.put(dispatch_output=out)

    def op_experts(self, state: LayerState) -> None:
        """With single-batch overlap only the up-projections (``FusedMoE.up_project_blocks``):
        the down-projections run block by block in ``op_combine_a``, each block's combine
        launched as it ends."""
        hidden, weights, ids = state.pop("dispatch_output")
        args = getattr(self.dispatcher(state), "overlap_args", None)
        if args is None:
            state.put(expert_output=self.experts(hidden, weights, ids))
            return
        state.put(expert_output=self.experts.up_project_blocks(hidden, weights, ids, args))

    def op_combine_a(self, state: LayerState) -> None:
        dispatcher, out = self.dispatcher(state), state.pop("expert_output")
        if not isinstance(out, BlockedProjection):
            self.comm_meter.timed(dispatcher.combine_a, out)
            return
        dispatcher.combine_a_blocks(lambda index: self.experts.down_project_block(out, index))

    def op_combine_b(self, state: LayerState) -> None:
        state.put(routed_output=self.comm_meter.timed(self.dispatcher(state).combine_b))

    def op_shared_experts(self, state: LayerState) -> None:
        state.put(shared_output=self.shared_experts(state.pop("mlp_input")))

    def op_output(self, state: LayerState) -> None:
        out = state.pop("routed_output")
        if self.shared_experts is not None:
            out = out + state.pop("shared_output")
        state.put(mlp_output=out)
