"""A model's weight bytes: the routed experts apart from the rest (shared experts among the
rest), and what a step of a few tokens reads of them."""

from __future__ import annotations

from srt.model_executor.weight_bytes import WeightBytes
from srt.model_loader.config import ModelConfig
from srt.model_loader.loader import load_model
from srt.server_args import ServerArgs

MIB = 1 << 20


def test_a_step_reads_the_experts_its_tokens_reach():
    weights = WeightBytes(20 * MIB, 96 * MIB, num_experts=32, top_k=6)
    assert weights.read_by(1) == 20 * MIB + 18 * MIB
    assert weights.read_by(6) == weights.total == 116 * MIB  # 36 picks ≥ 32 experts
    assert WeightBytes(5 * MIB).read_by(1000) == 5 * MIB  # a dense model reads all


def test_weight_bytes_of_a_model_split_experts_from_the_rest(deepseek_v3_path):
    config = ModelConfig.from_server_args(ServerArgs(model_path=deepseek_v3_path, dtype="float32"))
    model = load_model(config, "cpu")
    weights = WeightBytes.of(model)
    moe_layers = [layer.mlp for layer in model.model.layers if layer.is_moe]
    routed = sum(p.nbytes for m in moe_layers for p in m.experts.parameters())
    assert weights.expert_bytes == routed > 0  # the shared expert is not among them
    assert (
        weights.total == weights.dense_bytes + routed == sum(p.nbytes for p in model.parameters())
    )
    assert (weights.num_experts, weights.top_k) == (
        config.hf_config.n_routed_experts,
        config.hf_config.num_experts_per_tok,
    )
