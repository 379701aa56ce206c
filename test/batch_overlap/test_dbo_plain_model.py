"""Dual-batch overlap needs nothing from the model: a model written plainly (its layers call the
MoE block from ``forward``, no operation list, no attention metadata) runs under DBO on two
ranks with expert parallelism and gives exactly the plain run's output, for a decode batch, an
extend batch whose split cuts a prompt, and a step where one rank has no tokens (nobody
splits). The shared experts run between the combine's send and its receive (vLLM's place)."""

from __future__ import annotations

import pytest
import torch
from helpers.run_ranks import run_ranks
from torch import nn

from srt.batch_overlap.step_split import SplitConfig, plan_split, settle_split
from srt.batch_overlap.two_batch_overlap import with_children
from srt.batch_overlap.ubatching import UBatchWrapper
from srt.distributed.parallel_state import init_parallel_state
from srt.layers.layernorm import RMSNorm
from srt.layers.moe.moe_block import MoEGate
from srt.layers.moe.topk import TopKConfig
from srt.model_executor.dp_sync import apply_dp_sync, sync_dp_batch
from srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from srt.models.model_context import ModelContext, ModelOptions

pytestmark = pytest.mark.slow  # starts processes

HIDDEN, VOCAB, EXPERTS = 32, 64, 8


class PlainMoEModel(nn.Module):
    """Embedding, then per layer ``h + moe(norm(h))``: the MoE block called as a module."""

    def __init__(self, ctx: ModelContext, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.norms = nn.ModuleList(RMSNorm(HIDDEN) for _ in range(layers))
        self.moe = nn.ModuleList(
            ctx.moe_block(
                MoEGate(EXPERTS, HIDDEN, False, False),
                EXPERTS,
                HIDDEN,
                48,
                TopKConfig(top_k=2, renormalize=True),
                layer_id,
                shared_intermediate_size=40,
            )  # fmt: skip
            for layer_id in range(layers)
        )

    def forward(self, input_ids, positions, batch) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for norm, moe in zip(self.norms, self.moe):
            hidden = hidden + moe(norm(hidden), batch)
        return hidden


def make_batch(lens: list[int] | None, extend: bool) -> ForwardBatch | None:
    if lens is None:
        return None
    n = sum(lens) if extend else len(lens)
    ids = (torch.arange(n) * 7 + 3) % VOCAB
    fields = dict(extend_prefix_lens_cpu=[0] * len(lens), extend_seq_lens_cpu=list(lens))
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND if extend else ForwardMode.DECODE,
        batch_size=len(lens), input_ids=ids, positions=torch.arange(n),
        req_pool_indices=torch.arange(len(lens)), seq_lens=torch.tensor(lens),
        seq_lens_cpu=list(lens), out_cache_loc=torch.arange(n), req_to_token_pool=None,
        token_to_kv_pool=None, **(fields if extend else {}),
    )  # fmt: skip


def run_step(model, parallel, lens, extend: bool, dbo: bool):
    batch = make_batch(lens, extend)
    config = SplitConfig("dbo" if dbo else None, 0, 0)
    proposal = None if batch is None else plan_split(batch, config)
    info = sync_dp_batch(parallel, batch, proposal, split_rule=config.rule)
    if batch is None:
        batch = ForwardBatch.idle(None, None, torch.device("cpu"))
    mode = "dbo" if info.can_split else "off"
    apply_dp_sync(batch, info, settle_split(mode, batch, proposal, info.split_tokens))
    with_children(batch, parallel.attn_tp_size)
    return model.ubatches(batch.input_ids, batch.positions, batch), batch.split.is_split


def plain_worker(rank: int, n: int, init_method: str, mode: str, steps: list) -> list:
    torch.set_num_threads(1)
    parallel = init_parallel_state(n, rank, n, True, "torch", "gloo", init_method)
    try:
        torch.manual_seed(0)
        ctx = ModelContext(parallel, ModelOptions(deepep_mode=mode, enable_two_batch_overlap=True))
        model = PlainMoEModel(ctx)
        for p in model.parameters():
            p.data.normal_(0.0, 0.2)
        model.ubatches = UBatchWrapper(model)  # the whole model, as vLLM wraps it
        out = []
        with torch.inference_mode():
            for lens, extend in steps:
                plain, _ = run_step(model, parallel, lens[rank], extend, dbo=False)
                dbo, split = run_step(model, parallel, lens[rank], extend, dbo=True)
                out.append((plain.numpy(), dbo.numpy(), split))  # no tensors through the queue
        out.append(model.ubatches.num_yields)
        model.ubatches.close()
        return out
    finally:
        parallel.destroy()


STEPS = [
    ([[1] * 7, [1] * 5], False),  # decode: 7 and 5 tokens, both split at 3
    ([[5, 4], [6]], True),  # extend: split at token 4, inside each rank's first prompt
    ([[1] * 6, None], False),  # rank 1 has nothing: nobody splits
]
EXPECTED_SPLIT = [True, True, False]


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
def test_plain_model_under_dbo_equals_plain(mode):
    results = run_ranks(plain_worker, 2, mode, STEPS, timeout=120.0)
    for rank, out in enumerate(results):
        *steps, yields = out
        assert [split for _, _, split in steps] == EXPECTED_SPLIT
        for i, (plain, dbo, _) in enumerate(steps):
            assert plain.shape == dbo.shape, f"rank {rank} step {i}"
            assert abs(dbo - plain).max(initial=0.0) <= 1e-5, f"rank {rank} step {i}"
        assert yields == 2 * 2 * 2 * sum(EXPECTED_SPLIT)  # 2 layers x 2 exchanges x 2 threads
