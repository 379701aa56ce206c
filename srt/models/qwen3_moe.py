"""Qwen3-MoE (HF ``Qwen3MoeForCausalLM``)."""

from __future__ import annotations

from torch import nn

from srt.layers.layernorm import RMSNorm
from srt.layers.linear import QKVParallelLinear, RowParallelLinear
from srt.layers.moe.moe_block import MoEGate
from srt.layers.moe.topk import TopKConfig
from srt.layers.overlap.operations import LayerState
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import RotaryEmbedding, rope_parameters
from srt.models.decoder_layer import MoECausalLM, MoEDecoderLayer
from srt.models.model_context import ModelContext
from srt.models.operations_strategy import QWEN3_MOE
from srt.models.weight_mapping import WeightMapping


class Qwen3MoeAttention(nn.Module):
    """Heads split over the attention-TP ranks; KV heads replicated when fewer than ranks."""

    def __init__(self, config, layer_id: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        total_heads = config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        bias = getattr(config, "attention_bias", False)
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            total_heads,
            config.num_key_value_heads,
            bias=bias,
            **tp,
        )
        # This rank's heads.
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, bias=bias, **tp
        )
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim,
            config.max_position_embeddings,
            rope_parameters(config),
            is_neox_style=True,
        )
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def op_prepare_attn(self, state: LayerState) -> None:
        qkv = self.qkv_proj(state.pop("attn_input"))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(state.positions, q, k)
        state.put(attn_intermediate=(q, k, v))

    def op_core_attn(self, state: LayerState) -> None:
        q, k, v = state.pop("attn_intermediate")
        state.put(attn_output=self.o_proj(self.attn(q, k, v, state.batch)))


def is_moe_layer(config, layer_id: int) -> bool:
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_id + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    operations_family = QWEN3_MOE

    def __init__(self, config, layer_id: int, ctx: ModelContext):
        super().__init__()
        self.layer_id = layer_id
        p = ctx.parallel
        self.self_attn = Qwen3MoeAttention(config, layer_id, p.attn_tp_rank, p.attn_tp_size)
        h = config.hidden_size
        if is_moe_layer(config, layer_id):
            self.mlp = ctx.moe_block(
                MoEGate(config.num_experts, h, False, fp32_logits=False),
                config.num_experts,
                h,
                config.moe_intermediate_size,
                TopKConfig(config.num_experts_per_tok, renormalize=config.norm_topk_prob),
                layer_id,
            )
        else:
            self.mlp = ctx.dense_mlp(h, config.intermediate_size)
        self._init_norms(h, config.rms_norm_eps, ctx)


class Qwen3MoeForCausalLM(MoECausalLM):
    layer_cls = Qwen3MoeDecoderLayer

    def weight_mapping(self) -> WeightMapping:
        return WeightMapping(
            stacked=[
                ("qkv_proj", "q_proj", "q"),
                ("qkv_proj", "k_proj", "k"),
                ("qkv_proj", "v_proj", "v"),
                ("gate_up_proj", "gate_proj", 0),
                ("gate_up_proj", "up_proj", 1),
            ],
            num_experts=self.config.num_experts,
            num_layers=self.config.num_hidden_layers,
        )


EntryClass = Qwen3MoeForCausalLM
