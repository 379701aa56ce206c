"""ModelOptions and ModelContext: what a model's layers are built from.

Layers get their parallel info when they are built, never from a global: a model makes one
ModelContext from this rank's ParallelState and the ModelOptions (the server flags that shape
the model beyond its process groups), and asks it for every part whose sharding depends on the
parallel layout, so that the model files describe only their architecture.

Sharding over T ranks in attention-TP groups of A ranks (A == T without DP attention):
- embedding and attention: inside the attention-TP group;
- dense MLPs: inside the attention-TP group too, as their tokens never leave the group;
- routed experts: the ParallelState's MoE layout (expert TP over the world with
  ``--moe-a2a-backend none``, unless ``--ep-size`` says otherwise; EP with an all-to-all);
- shared experts: with ``--moe-a2a-backend none``, TP over the world like the routed experts
  (they see the same tokens and their partial sums are reduced together); with an all-to-all
  backend, replicated: each rank then computes complete outputs for its own chunk of tokens;
- LM head: see ``srt.layers.logits_processor``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srt.distributed.parallel_state import ParallelState
from srt.eplb.expert_location import ExpertLocation
from srt.layers.communicator import LayerCommunicator, MlpMode
from srt.layers.dp_attention import DpRowsGather
from srt.layers.layernorm import RMSNorm
from srt.layers.logits_processor import LogitsProcessor
from srt.layers.mlp import GatedMLP
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.moe.moe_block import MoEGate, SparseMoeBlock
from srt.layers.moe.token_dispatcher.base import CommMeter, TokenDispatcher
from srt.layers.moe.token_dispatcher.factory import create_dispatcher
from srt.layers.moe.topk import TopKConfig
from srt.layers.overlap.single_batch_overlap import default_num_blocks
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from srt.server_args_choices import DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK


@dataclass(frozen=True)
class ModelOptions:
    """``enable_two_batch_overlap`` / ``enable_single_batch_overlap``: the model is built so
    that steps may run that overlap (``--overlap-mode`` tbo / sbo, or auto for both; two
    micro-batches for dbo too); each step says whether it does (``ForwardBatch.split``)."""

    deepep_mode: str = "auto"
    max_dispatch_tokens_per_rank: int = DEFAULT_MAX_DISPATCH_TOKENS_PER_RANK
    enable_dp_lm_head: bool = False
    enable_two_batch_overlap: bool = False
    enable_single_batch_overlap: bool = False
    sbo_num_blocks: int | None = None  # None: default_num_blocks(local experts)
    sbo_communication_sms: int | None = None  # CUDA only; None: SmSplit's default
    expert_location: ExpertLocation | None = None  # None: each rank a contiguous slice
    enable_eplb: bool = False  # the placement changes while serving (every layer has a map)

    @classmethod
    def from_server_args(
        cls, server_args, expert_location: ExpertLocation | None = None
    ) -> ModelOptions:
        return cls(
            server_args.deepep_mode,
            server_args.max_dispatch_tokens_per_rank,
            server_args.enable_dp_lm_head,
            bool({"tbo", "dbo"} & set(server_args.overlap_modes)),  # two micro-batches
            "sbo" in server_args.overlap_modes,
            server_args.sbo_num_blocks,
            server_args.sbo_communication_sms,
            expert_location,
            server_args.enable_eplb,
        )


class ModelContext:
    """Builds a model's parallel-layout-dependent parts. It owns the model's token dispatchers:
    one instance per micro-batch, shared by every MoE layer (one micro-batch runs one exchange
    at a time, and low_latency buffers per layer would cost memory for nothing). Two-batch
    overlap has two micro-batches, so two instances: never a second use of one."""

    def __init__(self, parallel: ParallelState | None = None, options: ModelOptions | None = None):
        self.parallel = parallel or ParallelState.single_rank()
        self.options = options or ModelOptions()
        self.dispatchers: list[TokenDispatcher] = []
        self.comm_meter = CommMeter()  # the dispatchers' time, for --overlap-mode auto
        self._dispatcher_shape: tuple[int, int, int] | None = None

    @property
    def a2a_backend(self) -> str:
        return self.parallel.config.moe_a2a_backend

    @property
    def cross_dp_lm_head(self) -> bool:
        """The LM head is sharded over the whole world (DP attention, no --enable-dp-lm-head)."""
        return self.parallel.attn_dp_size > 1 and not self.options.enable_dp_lm_head

    def communicator(
        self, input_layernorm: RMSNorm, post_attention_layernorm: RMSNorm, is_moe: bool
    ) -> LayerCommunicator:
        mode = MlpMode.for_layer(self.parallel, is_moe)
        return LayerCommunicator(input_layernorm, post_attention_layernorm, self.parallel, mode)

    def dense_mlp(self, hidden_size: int, intermediate_size: int) -> GatedMLP:
        p = self.parallel
        return GatedMLP(hidden_size, intermediate_size, p.attn_tp_rank, p.attn_tp_size)

    def moe_block(
        self,
        gate: MoEGate,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        topk_config: TopKConfig,
        layer_id: int,
        shared_intermediate_size: int = 0,
    ) -> SparseMoeBlock:
        """``num_experts`` logical experts; with an expert location (EPLB), its slots of
        layer ``layer_id`` on this rank, the router's choices mapped onto them."""
        p, location = self.parallel, self.options.expert_location
        local_experts, dispatch_map, slots = None, None, num_experts
        if location is not None:
            slots = location.num_physical
            local_experts = location.local_experts(layer_id, p.moe_ep_rank)
            dispatch_map = location.dispatch_map(layer_id, p.moe_ep_rank, self.options.enable_eplb)
        experts = FusedMoE(
            slots,
            hidden_size,
            intermediate_size,
            *(p.moe_ep_rank, p.moe_ep_size, p.moe_tp_rank, p.moe_tp_size),
            local_experts=local_experts,
        )
        shared = None
        if shared_intermediate_size:
            tp = (0, 1) if self.a2a_backend != "none" else (p.tp_rank, p.tp_size)
            shared = GatedMLP(hidden_size, shared_intermediate_size, *tp)
        dispatchers = self._dispatchers(slots, topk_config.top_k, hidden_size)
        return SparseMoeBlock(
            gate,
            experts,
            topk_config,
            dispatchers,
            shared,
            p.attn_tp_size,
            self.comm_meter,
            None if dispatch_map is None else dispatch_map.to(p.device),
            layer_id,
        )

    def _dispatchers(self, num_experts: int, top_k: int, hidden_size: int) -> list[TokenDispatcher]:
        shape = (num_experts, top_k, hidden_size)
        if self._dispatcher_shape not in (None, shape):
            raise ValueError(f"MoE layers of one model differ: {self._dispatcher_shape} vs {shape}")
        self._dispatcher_shape = shape
        p, opts = self.parallel, self.options
        sbo_blocks = None
        if opts.enable_single_batch_overlap:
            sbo_blocks = opts.sbo_num_blocks or default_num_blocks(num_experts // p.moe_ep_size)
        while len(self.dispatchers) < (2 if opts.enable_two_batch_overlap else 1):
            self.dispatchers.append(
                create_dispatcher(
                    self.a2a_backend,
                    opts.deepep_mode,
                    groups=p.moe_ep_device_groups,
                    ep_rank=p.moe_ep_rank,
                    ep_size=p.moe_ep_size,
                    num_experts=num_experts,
                    top_k=top_k,
                    hidden_size=hidden_size,
                    dtype=torch.get_default_dtype(),  # the model's dtype while it is built
                    max_dispatch_tokens_per_rank=opts.max_dispatch_tokens_per_rank,
                    device=p.device,
                    sbo_num_blocks=sbo_blocks,
                    sbo_communication_sms=opts.sbo_communication_sms,
                    combine_group=p.moe_ep_combine,
                    counts_group=p.moe_ep.cpu_group if p.moe_ep_size > 1 else None,
                    tag=len(self.dispatchers),
                )
            )
        return self.dispatchers

    def embedding(self, vocab_size: int, hidden_size: int) -> VocabParallelEmbedding:
        p = self.parallel
        return VocabParallelEmbedding(vocab_size, hidden_size, p.attn_tp_rank, p.attn_tp_size)

    def lm_head(self, vocab_size: int, hidden_size: int) -> tuple[ParallelLMHead, LogitsProcessor]:
        p = self.parallel
        group = p.world if self.cross_dp_lm_head else p.attn_tp
        head = ParallelLMHead(vocab_size, hidden_size, group.rank_in_group, group.world_size)
        cross_dp = DpRowsGather(p) if self.cross_dp_lm_head else None
        return head, LogitsProcessor(vocab_size, group, cross_dp)
