"""DeepSeek-V2 and DeepSeek-V3 (HF ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``):
multi-head latent attention with absorbed weights, shared experts, dense first layers."""

from __future__ import annotations

import torch
from torch import nn

from srt.layers.layernorm import RMSNorm
from srt.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from srt.layers.moe.moe_block import MoEGate
from srt.layers.moe.topk import TopKConfig
from srt.layers.overlap.operations import LayerState
from srt.layers.radix_attention import RadixAttention
from srt.layers.rotary_embedding import (
    RotaryEmbedding,
    rope_parameters,
    yarn_softmax_scale_factor,
)
from srt.model_executor.forward_batch_info import AttnPart, mla_attention_parts
from srt.models.decoder_layer import MoECausalLM, MoEDecoderLayer
from srt.models.model_context import ModelContext
from srt.models.operations_strategy import DEEPSEEK
from srt.models.weight_mapping import WeightMapping


class DeepseekV2MLA(nn.Module):
    """MLA: the KV cache holds the normalised latent ``c_kv`` and the rotated ``k_pe``.

    Decode (one query per sequence): queries are projected into the latent space (``W_UK``
    absorbed), so attention is MQA over ``kv_lora_rank + qk_rope_head_dim``, every head reading
    the one cached latent, and the output is lifted back with ``W_UV``. Extend (many queries per
    sequence): the gathered latents are expanded by ``kv_b_proj`` into per-head keys
    ``[k_nope, k_pe]`` and values, and attention is plain MHA over ``qk_nope + qk_rope`` (as
    HF computes it, and SGLang and vLLM in prefill): a fraction of the absorbed form's work
    when queries outnumber the heads' shared keys. An attention backend that reads the latent
    in place (Triton's, ``absorbed_mla_extend``) runs extend absorbed too, as decode. Otherwise
    an extend batch's one-token rows after a prefix (a MIXED batch's decoding requests) attend
    absorbed, as in a decode step, and only the prompts expanded (``ForwardBatch.attn_parts``).

    Tensor parallelism splits the heads: q_proj / q_b_proj and kv_b_proj are column-parallel by
    head, o_proj row-parallel; q_a_proj and kv_a_proj_with_mqa are replicated, so every rank
    caches the full latent of every token. ``num_heads`` is this rank's head count."""

    def __init__(self, config, layer_id: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        h, total_heads = config.hidden_size, config.num_attention_heads
        tp = {"tp_rank": tp_rank, "tp_size": tp_size}
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head = self.nope + self.rope
        bias = getattr(config, "attention_bias", False)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, total_heads * qk_head, **tp)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_heads * qk_head, **tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.nope + self.v_head_dim), **tp
        )
        self.kv_b_proj.keep_dense = True  # read as w_uk / w_uv (``_kv_b``)
        self.o_proj = RowParallelLinear(total_heads * self.v_head_dim, h, bias=bias, **tp)
        self.num_heads = total_heads // tp_size  # the column-parallel layers checked divisibility
        rope_params = rope_parameters(config)
        self.rotary_emb = RotaryEmbedding(
            self.rope,
            config.max_position_embeddings,
            rope_params,
            is_neox_style=not getattr(config, "rope_interleave", True),
        )
        scaling = qk_head**-0.5 * yarn_softmax_scale_factor(rope_params)
        self.attn = RadixAttention(
            self.num_heads,
            self.kv_lora_rank + self.rope,
            scaling,
            1,
            layer_id,
            v_head_dim=self.kv_lora_rank,
        )
        self.attn_mha = RadixAttention(
            self.num_heads,
            qk_head,
            scaling,
            self.num_heads,
            layer_id,
            v_head_dim=self.v_head_dim,
            kv_from_cache=self._kv_from_latent,
        )

    def _kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, -1)
        return w[:, : self.nope], w[:, self.nope :]  # W_UK [H, nope, L], W_UV [H, v, L]

    def _kv_from_latent(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows ``[..., 1, L + rope]`` → keys ``[..., H, nope + rope]``, values
        ``[..., H, v]``."""
        latent, k_pe = rows[..., 0, : self.kv_lora_rank], rows[..., 0, self.kv_lora_rank :]
        kv = self.kv_b_proj(latent).view(*latent.shape[:-1], self.num_heads, -1)
        k_nope, value = kv.split([self.nope, self.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.rope)
        return torch.cat((k_nope, k_pe), dim=-1), value

    def op_prepare_attn(self, state: LayerState) -> None:
        x = state.pop("attn_input")
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope + self.rope).split(
            [self.nope, self.rope], dim=-1
        )  # [T, H, nope], [T, H, rope]
        kv_a, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv_a = self.kv_a_layernorm(kv_a).unsqueeze(1)  # [T, 1, L]
        q_pe, k_pe = self.rotary_emb(state.positions, q_pe, k_pe.unsqueeze(1))
        k = torch.cat((kv_a, k_pe), dim=-1)  # [T, 1, L + rope]: the cache row
        parts = self._parts(state.batch)
        queries = [
            self._query(q_nope[p.start : p.end], q_pe[p.start : p.end], p.absorbed) for p in parts
        ]
        state.put(attn_intermediate=(parts, queries, k, kv_a))

    @staticmethod
    def _parts(batch) -> tuple[AttnPart, ...]:
        """How the batch attends (``mla_attention_parts``; the ModelRunner splits a batch in
        parts when it builds the attention metadata)."""
        absorbed = batch.attn_backend.absorbed_mla_extend
        return batch.attn_parts or mla_attention_parts(batch, absorbed, split=False)

    def _query(self, q_nope: torch.Tensor, q_pe: torch.Tensor, absorbed: bool) -> torch.Tensor:
        """[T, H, nope], [T, H, rope] → [T, H, L + rope] absorbed, else [T, H, nope + rope]."""
        if absorbed:
            return self._absorbed_query(q_nope, q_pe)
        return torch.cat((q_nope, q_pe), dim=-1)

    def _absorbed_query(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[T, H, nope], [T, H, rope] → [T, H, L + rope]: ``W_UK`` absorbed into the query."""
        w_uk, _ = self._kv_b()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        return torch.cat((q_latent, q_pe), dim=-1)

    def op_core_attn(self, state: LayerState) -> None:
        parts, queries, k, v = state.pop("attn_intermediate")
        outs = []
        for q, p in zip(queries, parts):
            attend = self._absorbed_attn if p.absorbed else self.attn_mha
            outs.append(attend(q, k[p.start : p.end], v[p.start : p.end], p.batch))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        state.put(attn_output=self.o_proj(out))

    def _absorbed_attn(self, q, k, v, batch) -> torch.Tensor:
        """MQA over the cached latent, lifted back by ``W_UV``: [T, H · v]."""
        latent = self.attn(q, k, v, batch).view(-1, self.num_heads, self.kv_lora_rank)
        _, w_uv = self._kv_b()
        out = torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return out.transpose(0, 1).reshape(-1, self.num_heads * self.v_head_dim)


# What a config that omits ``topk_method`` means, per model type: transformers' DeepseekV3
# always routes with sigmoid scores, a correction bias and grouped top-k (its config class has
# no such field, so checkpoints it saves carry none); DeepSeek-V2's reference code defaults to
# greedy softmax.
DEFAULT_TOPK_METHOD = {"deepseek_v3": "noaux_tc"}


def _topk_config(config) -> TopKConfig:
    method = getattr(config, "topk_method", None) or DEFAULT_TOPK_METHOD.get(
        config.model_type, "greedy"
    )
    default_scoring = "sigmoid" if method == "noaux_tc" else "softmax"
    grouped = method in ("noaux_tc", "group_limited_greedy")
    return TopKConfig(
        top_k=config.num_experts_per_tok,
        scoring_func=getattr(config, "scoring_func", None) or default_scoring,
        renormalize=bool(getattr(config, "norm_topk_prob", False)),
        num_expert_group=config.n_group if grouped else None,
        topk_group=config.topk_group if grouped else None,
        routed_scaling_factor=getattr(config, "routed_scaling_factor", 1.0) or 1.0,
    )


def is_moe_layer(config, layer_id: int) -> bool:
    return (
        getattr(config, "n_routed_experts", None) is not None
        and layer_id >= config.first_k_dense_replace
        and layer_id % getattr(config, "moe_layer_freq", 1) == 0
    )


class DeepseekV2DecoderLayer(MoEDecoderLayer):
    operations_family = DEEPSEEK

    def __init__(self, config, layer_id: int, ctx: ModelContext):
        super().__init__()
        self.layer_id = layer_id
        p = ctx.parallel
        self.self_attn = DeepseekV2MLA(config, layer_id, p.attn_tp_rank, p.attn_tp_size)
        h = config.hidden_size
        if is_moe_layer(config, layer_id):
            topk = _topk_config(config)
            self.mlp = ctx.moe_block(
                MoEGate(
                    config.n_routed_experts, h, topk.scoring_func == "sigmoid", fp32_logits=True
                ),
                config.n_routed_experts,
                h,
                config.moe_intermediate_size,
                topk,
                layer_id,
                shared_intermediate_size=config.moe_intermediate_size
                * (config.n_shared_experts or 0),
            )
        else:
            self.mlp = ctx.dense_mlp(h, config.intermediate_size)
        self._init_norms(h, config.rms_norm_eps, ctx)


class DeepseekV2ForCausalLM(MoECausalLM):
    layer_cls = DeepseekV2DecoderLayer

    def weight_mapping(self) -> WeightMapping:
        return WeightMapping(
            stacked=[("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)],
            num_experts=getattr(self.config, "n_routed_experts", None) or 0,
            num_layers=self.config.num_hidden_layers,
        )


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    pass


EntryClass = [DeepseekV2ForCausalLM, DeepseekV3ForCausalLM]
