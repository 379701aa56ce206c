"""Single-batch overlap without a model: the block partition, the blocked-combine layout
(``compute_overlap_args``) against a brute-force reading of the same routing, the experts'
blocked halves with every kernel (``expert_compute``, without host synchronisation) against a
per-pair reference, the SM split and the CPU combine stream."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from srt.layers.moe.expert_compute import compute_experts
from srt.layers.moe.expert_kernel import ExpertKernel
from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.overlap.single_batch_overlap import (
    SmSplit,
    block_ranges,
    compute_overlap_args,
    default_num_blocks,
    make_combine_stream,
    partition_blocks,
)
from srt.server_args import ServerArgs
from srt.utils.sync_guard import forbid_host_sync


@pytest.mark.parametrize(
    "experts, blocks, expected",
    [
        (8, 4, [0, 0, 1, 1, 2, 2, 3, 3]),
        (5, 2, [0, 0, 0, 1, 1]),
        (2, 3, [0, 1]),  # more blocks than experts: block 2 is empty
        (4, 1, [0, 0, 0, 0]),
    ],
)
def test_partition_is_contiguous_and_near_equal(experts, blocks, expected):
    assert partition_blocks(experts, blocks).tolist() == expected


@pytest.mark.parametrize("experts, blocks", [(8, 4), (5, 2), (2, 3), (4, 1), (7, 3), (3, 5)])
def test_block_ranges_are_the_partition(experts, blocks):
    ranges = block_ranges(experts, blocks)
    assert len(ranges) == blocks
    assert [b for b, r in enumerate(ranges) for _ in r] == partition_blocks(
        experts, blocks
    ).tolist()


def test_default_blocks_and_bad_count():
    assert [default_num_blocks(n) for n in (1, 2, 4, 16)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="--sbo-num-blocks"):
        partition_blocks(4, 0)


def test_overlap_args_match_the_routing():
    """Two ranks × 4 local experts, 2 blocks. From rank 0's point of view: it sends its 5
    tokens' choices and receives rows from ranks 0 and 1 (ids masked to its experts)."""
    ep_size, local, blocks = 2, 4, 2
    sent = torch.tensor([[0, 5], [7, 2], [4, 6], [1, 3], [5, 4]])
    # rows rank 0 receives: from itself its tokens 0, 1, 3 (masked to experts 0..3), from rank 1
    # two rows
    recv = torch.tensor([[0, -1], [-1, 2], [1, 3], [3, -1], [2, 0]])
    combine, down = compute_overlap_args(blocks, local, 0, ep_size, sent, recv, [3, 2])
    # receiver: block 0 = experts {0, 1}, block 1 = {2, 3}; pairs row-major
    assert down.pair_rows[0].tolist() == [0, 2, 4] and down.pair_slots[0].tolist() == [0, 0, 1]
    assert down.pair_rows[1].tolist() == [1, 2, 3, 4]
    assert down.pair_slots[1].tolist() == [1, 1, 0, 0]
    assert down.send_splits == [[2, 1], [2, 2]]
    # sender: by destination rank, then token, then slot; block b of rank d = experts of
    # local index in b's range
    assert combine.recv_splits == [[2, 4], [2, 2]]
    # block 0: rank 0 {0,1}: (t0,k0) e0, (t3,k0) e1; rank 1 {4,5}: (t0,k1) e5, (t2,k0) e4,
    # (t4,k0) e5, (t4,k1) e4
    assert combine.token_idx[0].tolist() == [0, 3, 0, 2, 4, 4]
    # block 1: rank 0 {2,3}: (t1,k1), (t3,k1); rank 1 {6,7}: (t1,k0) e7, (t2,k1) e6
    assert combine.token_idx[1].tolist() == [1, 3, 1, 2]


HIDDEN, INTER, TOP_K, ROWS = 64, 64, 3, 12  # whole panels of every width (8 to 64)


def _rank_one_rows(seed: int):
    """EP rank 1 of 2 (local experts 4..7 of 8) and rows as a low_latency dispatch leaves them:
    ids of rank 0's experts masked to -1, the last rows invalid (ids -1, weights 0)."""
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(8, HIDDEN, INTER, ep_rank=1, ep_size=2)
    moe.w13_weight.data.copy_(torch.randn(4, 2 * INTER, HIDDEN, generator=gen) * 0.2)
    moe.w2_weight.data.copy_(torch.randn(4, HIDDEN, INTER, generator=gen) * 0.2)
    ids = torch.stack([torch.randperm(8, generator=gen)[:TOP_K] for _ in range(ROWS)])
    ids = ids.masked_fill(ids < 4, -1)
    ids[-3:] = -1
    weights = torch.rand(ROWS, TOP_K, generator=gen).masked_fill(ids < 0, 0.0)
    return moe, torch.randn(ROWS, HIDDEN, generator=gen), weights, ids


def _pair_output(moe: FusedMoE, hidden, weights, ids, row: int, slot: int) -> torch.Tensor:
    e = int(ids[row, slot]) - moe.start
    gate_up = moe.w13_weight[e] @ hidden[row]
    act = F.silu(gate_up[:INTER]) * gate_up[INTER:]
    return weights[row, slot] * (moe.w2_weight[e] @ act)


@pytest.mark.parametrize("kernel", list(ExpertKernel))
def test_blocked_experts_equal_the_pairs(kernel):
    """3 blocks over 4 local experts: each block's row sums (row wire) and pair outputs (pair
    wire) against the pairs computed one by one; nothing but the loop reads a device value."""
    moe, hidden, weights, ids = _rank_one_rows(seed=3)
    if kernel is ExpertKernel.CPU_KERNEL:
        moe.prepare_for_cpu()
        if moe.panels is None:
            pytest.skip("no C kernels on this machine")
    guard = contextlib.nullcontext if kernel is ExpertKernel.LOOP else forbid_host_sync
    local = ids - moe.start
    with guard():
        projection = compute_experts(moe, kernel, hidden, weights, ids)
    for experts in block_ranges(4, 3):
        rows, slots = ((local >= experts.start) & (local < experts.stop)).nonzero(as_tuple=True)
        pairs = [_pair_output(moe, hidden, weights, ids, r, k) for r, k in zip(rows, slots)]
        expected = torch.zeros(ROWS, HIDDEN).index_add_(0, rows, torch.stack(pairs))
        with guard():
            sums = projection.row_sums(experts)
            outputs = projection.pair_outputs(experts, rows, slots)
        assert (sums - expected).abs().max().item() <= 1e-5, experts
        assert (outputs - torch.stack(pairs)).abs().max().item() <= 1e-5, experts


def test_blocked_experts_of_no_rows():
    moe, hidden, weights, ids = _rank_one_rows(seed=4)
    projection = compute_experts(moe, ExpertKernel.GROUPED_MM, hidden[:0], weights[:0], ids[:0])
    assert projection.row_sums(range(0, 2)).shape == (0, HIDDEN)
    none = torch.zeros(0, dtype=torch.int64)
    assert projection.pair_outputs(range(0, 2), none, none).shape == (0, HIDDEN)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(moe_a2a_backend="torch", deepep_mode="normal", enable_two_batch_overlap=True),
         "exclude each other"),
        (dict(tp_size=2), "needs an all-to-all"),
        (dict(moe_a2a_backend="torch"), "one rank"),
        (dict(tp_size=2, moe_a2a_backend="torch", deepep_mode="normal", sbo_num_blocks=0),
         "--sbo-num-blocks 0: must be ≥ 1"),
        (dict(tp_size=2, moe_a2a_backend="torch", sbo_communication_sms=0),
         "--sbo-communication-sms 0: must be ≥ 1"),
        (dict(tp_size=2, moe_a2a_backend="torch", sbo_communication_sms=8),
         "--sbo-communication-sms splits a CUDA device's SMs"),
    ],
)  # fmt: skip
def test_invalid_sbo_flags(qwen3_moe_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(
            model_path=qwen3_moe_path, device="cpu", enable_single_batch_overlap=True, **kwargs
        )


@pytest.mark.parametrize("flag", ["sbo_num_blocks", "sbo_communication_sms"])
def test_sbo_tuning_needs_sbo(qwen3_moe_path, flag):
    with pytest.raises(ValueError, match="needs --overlap-mode sbo or auto"):
        ServerArgs(model_path=qwen3_moe_path, device="cpu", **{flag: 2})


@pytest.mark.parametrize("mode", ["normal", "low_latency", "auto"])
def test_sbo_accepts_every_dispatch_mode(qwen3_moe_path, mode):
    args = ServerArgs(
        model_path=qwen3_moe_path, device="cpu", tp_size=2, moe_a2a_backend="torch",
        deepep_mode=mode, chunked_prefill_size=64, max_running_requests=64,
        enable_single_batch_overlap=True,
    )  # fmt: skip
    assert args.enable_single_batch_overlap and args.deepep_mode == mode


@pytest.mark.parametrize(
    "total, major, override, communicate",
    [(132, 9, None, 3), (148, 10, None, 32), (132, 9, 16, 16), (170, 12, None, 3)],
)
def test_sm_split(total, major, override, communicate):
    """SGLang's defaults: 3 SMs for the combine, 32 on Blackwell (sm_10x), or the flag's."""
    split = SmSplit.resolve(total, major, override)
    assert (split.communicate, split.compute) == (communicate, total - communicate)


@pytest.mark.parametrize("override", [0, 132, 200])
def test_sm_split_out_of_range(override):
    with pytest.raises(ValueError, match=f"--sbo-communication-sms {override}: must be in"):
        SmSplit.resolve(132, 9, override)


def test_cpu_combine_stream():
    """CPU: launches return at once; join waits and reduces in launch order; no SM split."""
    stream, log = make_combine_stream("cpu"), []

    class Work:
        def __init__(self, name):
            self.name = name

        def wait(self):
            log.append(f"wait {self.name}")

    for name in ("a", "b"):
        stream.submit(lambda n=name: log.append(f"launch {n}") or Work(n),
                      lambda n=name: log.append(f"reduce {n}"))  # fmt: skip
    assert log == ["launch a", "launch b"]
    with stream.compute_sms():
        stream.join()
    assert log[2:] == ["wait a", "reduce a", "wait b", "reduce b"]
    with pytest.raises(ValueError, match="CUDA devices only"):
        make_combine_stream("cpu", 3)
