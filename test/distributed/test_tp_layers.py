"""TP layer numerics on real gloo ranks: each rank builds the full layer (tp_size=1) and its
shard (tp_rank/tp_size of a group), loads the same full checkpoint tensors through
``weight_loader``, and the sharded output after the layer's collective must equal the full one.
Run on the 4-rank world (tp=4) and on the 2-rank attention-TP groups of (tp=4, dp=2).

The ``test_bug_*`` tests (one process, no collectives) pin down loader and sharding edge cases
that were once wrong."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from helpers.run_ranks import run_ranks

from srt.distributed import communication_op as comm
from srt.distributed.group_coordinator import GroupCoordinator
from srt.distributed.parallel_state import init_parallel_state
from srt.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from srt.layers.mlp import GatedMLP
from srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.slow  # starts processes

TOL = 1e-5
HIDDEN, HEAD_DIM, TOKENS, VOCAB = 16, 4, 5, 37  # 37: not divisible by 2 or 4


def _ckpt(*shape: int, seed: int) -> torch.Tensor:
    """A checkpoint tensor, identical on every rank."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.5


def _load(module: torch.nn.Module, tensors: list[tuple[str, torch.Tensor, tuple]]):
    params = dict(module.named_parameters())
    for name, tensor, extra in tensors:
        params[name].weight_loader(params[name], tensor, name, *extra)
    return module


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    return (got - want).abs().max().item()


def _tp(grp: GroupCoordinator) -> dict:
    return {"tp_rank": grp.rank_in_group, "tp_size": grp.world_size}


def check_column(grp: GroupCoordinator) -> float:
    ckpt = [("weight", _ckpt(24, HIDDEN, seed=1), ()), ("bias", _ckpt(24, seed=2), ())]
    full = _load(ColumnParallelLinear(HIDDEN, 24, bias=True), ckpt)
    shard = _load(ColumnParallelLinear(HIDDEN, 24, bias=True, **_tp(grp)), ckpt)
    x = _ckpt(TOKENS, HIDDEN, seed=3)
    return _err(comm.all_gather(grp, shard(x), dim=-1), full(x))


def check_row(grp: GroupCoordinator) -> float:
    ckpt = [("weight", _ckpt(HIDDEN, 24, seed=4), ()), ("bias", _ckpt(HIDDEN, seed=5), ())]
    full = _load(RowParallelLinear(24, HIDDEN, bias=True), ckpt)
    shard = _load(RowParallelLinear(24, HIDDEN, bias=True, **_tp(grp)), ckpt)
    x = _ckpt(TOKENS, 24, seed=6)
    part = 24 // grp.world_size
    local_x = x.narrow(-1, grp.rank_in_group * part, part)
    return _err(comm.all_reduce(grp, shard(local_x)), full(x))


def check_merged(grp: GroupCoordinator) -> float:
    sizes = [8, 12]
    ckpt = [("weight", _ckpt(s, HIDDEN, seed=10 + i), (i,)) for i, s in enumerate(sizes)]
    ckpt += [("bias", _ckpt(s, seed=20 + i), (i,)) for i, s in enumerate(sizes)]
    full = _load(MergedColumnParallelLinear(HIDDEN, sizes, bias=True), ckpt)
    shard = _load(MergedColumnParallelLinear(HIDDEN, sizes, bias=True, **_tp(grp)), ckpt)
    x = _ckpt(TOKENS, HIDDEN, seed=7)
    local = shard(x).split([s // grp.world_size for s in sizes], dim=-1)
    out = torch.cat([comm.all_gather(grp, part, dim=-1) for part in local], dim=-1)
    return _err(out, full(x))


def check_gated_mlp(grp: GroupCoordinator) -> float:
    inter = 24
    ckpt = [
        ("gate_up_proj.weight", _ckpt(inter, HIDDEN, seed=30), (0,)),
        ("gate_up_proj.weight", _ckpt(inter, HIDDEN, seed=31), (1,)),
        ("down_proj.weight", _ckpt(HIDDEN, inter, seed=32), ()),
    ]
    full = _load(GatedMLP(HIDDEN, inter), ckpt)
    shard = _load(GatedMLP(HIDDEN, inter, **_tp(grp)), ckpt)
    x = _ckpt(TOKENS, HIDDEN, seed=33)
    return _err(comm.all_reduce(grp, shard(x)), full(x))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain GQA attention over all tokens: q [T, H, D], k/v [T, KV, D] → [T, H * D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v).flatten(1)


def _qkv_heads(layer: QKVParallelLinear, x: torch.Tensor):
    q, k, v = layer(x).split(
        [layer.num_heads * HEAD_DIM, layer.num_kv_heads * HEAD_DIM, layer.num_kv_heads * HEAD_DIM],
        dim=-1,
    )
    return (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))


def _check_qkv(grp: GroupCoordinator, heads: int, kv_heads: int) -> float:
    """Rank-local q heads must come with exactly the KV heads they attend to (GQA: q head h uses
    kv head h // (heads / kv_heads)); attention + o_proj + all-reduce equals the full layer."""
    shards = [("q", heads), ("k", kv_heads), ("v", kv_heads)]
    ckpt = [
        ("weight", _ckpt(h * HEAD_DIM, HIDDEN, seed=40 + i), (s,))
        for i, (s, h) in enumerate(shards)
    ]
    ckpt += [("bias", _ckpt(h * HEAD_DIM, seed=50 + i), (s,)) for i, (s, h) in enumerate(shards)]
    o_ckpt = [("weight", _ckpt(HIDDEN, heads * HEAD_DIM, seed=60), ())]
    full = _load(QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, bias=True), ckpt)
    shard = _load(QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv_heads, bias=True, **_tp(grp)), ckpt)
    o_full = _load(RowParallelLinear(heads * HEAD_DIM, HIDDEN), o_ckpt)
    o_shard = _load(RowParallelLinear(heads * HEAD_DIM, HIDDEN, **_tp(grp)), o_ckpt)
    x = _ckpt(TOKENS, HIDDEN, seed=61)
    (q, k, v), (lq, lk, lv) = _qkv_heads(full, x), _qkv_heads(shard, x)
    per_rank = heads // grp.world_size
    mine = list(range(grp.rank_in_group * per_rank, (grp.rank_in_group + 1) * per_rank))
    kv_mine = sorted({h // (heads // kv_heads) for h in mine})
    errors = [_err(lq, q[:, mine]), _err(lk, k[:, kv_mine]), _err(lv, v[:, kv_mine])]
    out = comm.all_reduce(grp, o_shard(_attention(lq, lk, lv)))
    return max(errors + [_err(out, o_full(_attention(q, k, v)))])


def check_qkv_gqa_4q_2kv(grp: GroupCoordinator) -> float:
    return _check_qkv(grp, 4, 2)  # tp=4: each KV head replicated on 2 ranks


def check_qkv_mqa_4q_1kv(grp: GroupCoordinator) -> float:
    return _check_qkv(grp, 4, 1)


def check_qkv_gqa_8q_4kv(grp: GroupCoordinator) -> float:
    return _check_qkv(grp, 8, 4)  # KV heads split, no replication


def check_vocab_embedding(grp: GroupCoordinator) -> float:
    ckpt = [("weight", _ckpt(VOCAB, HIDDEN, seed=70), ())]
    full = _load(VocabParallelEmbedding(VOCAB, HIDDEN), ckpt)
    shard = _load(VocabParallelEmbedding(VOCAB, HIDDEN, **_tp(grp)), ckpt)
    ids = torch.cat([torch.arange(VOCAB), torch.tensor([0, VOCAB - 1, 9, 10, 18, 19])])
    return _err(comm.all_reduce(grp, shard(ids)), full(ids))


def check_lm_head_logits(grp: GroupCoordinator) -> float:
    ckpt = [("weight", _ckpt(VOCAB, HIDDEN, seed=80), ())]
    full = _load(ParallelLMHead(VOCAB, HIDDEN), ckpt)
    shard = _load(ParallelLMHead(VOCAB, HIDDEN, **_tp(grp)), ckpt)
    hidden = _ckpt(TOKENS, HIDDEN, seed=81)
    logits = comm.all_gather(grp, hidden @ shard.weight.t(), dim=-1)[:, :VOCAB]
    return _err(logits, hidden @ full.weight.t())


CHECKS = {name[len("check_") :]: fn for name, fn in globals().items() if name.startswith("check_")}


def _worker(rank: int, n: int, init_method: str) -> dict:
    state = init_parallel_state(
        n, rank, 2, True, "none", "gloo", init_method, timeout=timedelta(seconds=30)
    )
    out = {}
    with torch.inference_mode():  # as ModelRunner.forward; collectives are not autograd-aware
        for group in (state.world, state.attn_tp):
            out[group.name] = {name: check(group) for name, check in CHECKS.items()}
    state.destroy()
    return out


@pytest.fixture(scope="module")
def errors() -> list[dict]:
    return run_ranks(_worker, 4)


@pytest.mark.parametrize("name", CHECKS)
@pytest.mark.parametrize("group", ["world", "attn_tp"])  # tp=4, tp=2
def test_tp_layer_matches_full_layer(errors, group, name):
    per_rank = [result[group][name] for result in errors]
    assert max(per_rank) <= TOL, f"max |sharded - full| per rank: {per_rank}"


# --- bugs in the layers' TP logic (single process: weight loading needs no collective) ---


def test_bug_merged_fused_checkpoint_tp2():
    """A fused [gate; up] checkpoint tensor (shard_id None) must give rank r the rows
    [gate_r; up_r]; the inherited ColumnParallelLinear loader gives it one contiguous block."""
    gate, up = _ckpt(8, 4, seed=90), _ckpt(8, 4, seed=91)
    for rank in range(2):
        by_shard = _load(
            MergedColumnParallelLinear(4, [8, 8], tp_rank=rank, tp_size=2),
            [("weight", gate, (0,)), ("weight", up, (1,))],
        )
        fused = _load(
            MergedColumnParallelLinear(4, [8, 8], tp_rank=rank, tp_size=2),
            [("weight", torch.cat([gate, up]), ())],
        )
        assert torch.equal(fused.weight, by_shard.weight), f"rank {rank}"


@pytest.mark.parametrize(
    "layer, shard_id",
    [
        (lambda: MergedColumnParallelLinear(4, [8, 8]), 0),
        (lambda: QKVParallelLinear(4, 2, 2, 2), "k"),
    ],
    ids=["merged_gate", "qkv_k"],
)
def test_bug_shard_loader_accepts_wrong_checkpoint_shape(layer, shard_id):
    """A gate_proj / k_proj with twice the expected rows is silently truncated."""
    module = layer()
    with pytest.raises(ValueError, match="shape mismatch"):
        module.weight_loader(module.weight, _ckpt(16, 4, seed=92), "wrong", shard_id)


def test_bug_qkv_rejects_unshardable_kv_heads():
    """6 q heads / 3 kv heads on 2 ranks cannot be split (rank 0's q heads 0-2 need kv heads 0
    and 1); the layer builds anyway and silently drops kv head 2."""
    with pytest.raises(ValueError):
        QKVParallelLinear(8, 2, 6, 3, tp_rank=0, tp_size=2)


def test_bug_vocab_smaller_than_padded_shards():
    """vocab 5 on 4 ranks: 2 rows per rank, rank 3 starts at row 6 > 5 and must hold only
    padding; its weight_loader raises instead (and the embedding is wrong after the sum)."""
    weight = _ckpt(5, 3, seed=93)
    ids = torch.arange(5)
    total = torch.zeros(5, 3)
    for rank in range(4):
        shard = _load(VocabParallelEmbedding(5, 3, rank, 4), [("weight", weight, ())])
        total += shard(ids)
    assert torch.equal(total, weight)
