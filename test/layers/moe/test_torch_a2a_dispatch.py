"""The torch all-to-all dispatchers against a single-process MoE: dispatch → this rank's experts
→ combine must equal all experts applied to the rank's own tokens (fp32, ≤ 1e-5). The
low_latency mode's blocked combine (and its whole dispatcher on the wire nccl runs,
``ragged=False``) runs under ``forbid_host_sync``."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch
import torch.distributed as dist
from helpers.run_ranks import run_ranks

from srt.layers.moe.fused_moe import FusedMoE
from srt.layers.moe.token_dispatcher.auto import TorchA2AAutoDispatcher
from srt.layers.moe.token_dispatcher.blocked_combine import BlockedCombine
from srt.layers.moe.token_dispatcher.factory import create_dispatcher
from srt.layers.moe.token_dispatcher.low_latency import TorchA2ALowLatencyDispatcher
from srt.layers.moe.token_dispatcher.normal import TorchA2ANormalDispatcher
from srt.layers.moe.token_dispatcher.standard import StandardDispatcher
from srt.utils.sync_guard import forbid_host_sync

pytestmark = pytest.mark.slow  # starts processes

HIDDEN, INTER, TOP_K, CAPACITY = 16, 24, 3, 16
MAX_TOKENS = 12  # the most tokens a rank has in these cases: the step bound the model passes
# wire rows are 88 bytes (fp32): some exchanges split by direction, others do not; ranks must
# agree on which every time
DUPLEX_MIN_BYTES = 500
MODES = ("normal", "low_latency", "auto")
CASES = (
    "random",
    "sends_elsewhere",
    "receives_nothing",
    "empty_rank",
    "all_empty",
    "same_rank_topk",
    "masked_ids",
)


def _experts(rank: int, world: int, hidden: int, dtype: torch.dtype) -> tuple[FusedMoE, FusedMoE]:
    """(reference with every expert, this rank's share), same weights on every rank."""
    num_experts = 4 * world
    gen = torch.Generator().manual_seed(1234)
    w13 = torch.randn(num_experts, 2 * INTER, hidden, generator=gen) * 0.2
    w2 = torch.randn(num_experts, hidden, INTER, generator=gen) * 0.2
    ref, local = (
        FusedMoE(num_experts, hidden, INTER),
        FusedMoE(num_experts, hidden, INTER, rank, world),
    )
    for moe in (ref, local):
        sl = slice(moe.start, moe.start + moe.num_local_experts)
        moe.w13_weight.data.copy_(w13[sl])
        moe.w2_weight.data.copy_(w2[sl])
    return ref.to(dtype), local.to(dtype)


def _num_tokens(case: str, rank: int, gen: torch.Generator) -> int:
    if case == "all_empty" or (case == "empty_rank" and rank == 1):
        return 0
    return int(torch.randint(1, 13, (1,), generator=gen))


def _allowed(case: str, rank: int, world: int, gen: torch.Generator) -> torch.Tensor:
    """Experts a token of ``rank`` may choose in ``case``."""
    experts, owner = torch.arange(4 * world), torch.arange(4 * world) // 4
    if case == "sends_elsewhere" and rank == 0:
        return experts[owner != 0]
    if case == "receives_nothing":
        return experts[owner != world - 1]
    if case == "same_rank_topk":
        return experts[owner == int(torch.randint(world, (1,), generator=gen))]
    return experts


def _choose(case: str, rank: int, world: int, gen: torch.Generator) -> torch.Tensor:
    allowed = _allowed(case, rank, world, gen)
    return allowed[torch.randperm(len(allowed), generator=gen)[:TOP_K]]  # [k] distinct


def _routing(case: str, rank: int, world: int, seed: int, hidden: int, dtype: torch.dtype):
    """This rank's (hidden [T, H], weights [T, k], ids [T, k]) for ``case``."""
    gen = torch.Generator().manual_seed(seed * 100 + rank)
    t = _num_tokens(case, rank, gen)
    ids = torch.empty(t, TOP_K, dtype=torch.int64)  # [T, k]
    for i in range(t):
        ids[i] = _choose(case, rank, world, gen)
    if case == "masked_ids" and t:
        ids[0] = -1  # a padding token
        ids[torch.rand(ids.shape, generator=gen) < 0.2] = -1
    weights = torch.rand(t, TOP_K, generator=gen)  # [T, k]
    return torch.randn(t, hidden, generator=gen).to(dtype), weights, ids


def _make(
    mode: str,
    groups,
    rank: int,
    world: int,
    hidden=HIDDEN,
    dtype=torch.float32,
    cap=CAPACITY,
    sbo_num_blocks=None,
    tag=0,
):
    """With two groups, exchanges of more than DUPLEX_MIN_BYTES on a link split by direction."""
    return create_dispatcher(
        "torch",
        mode,
        groups=groups,
        ep_rank=rank,
        ep_size=world,
        num_experts=4 * world,
        top_k=TOP_K,
        hidden_size=hidden,
        dtype=dtype,
        max_dispatch_tokens_per_rank=cap,
        duplex_min_bytes=DUPLEX_MIN_BYTES,
        sbo_num_blocks=sbo_num_blocks,
        tag=tag,
    )


def _through(
    dispatcher, local: FusedMoE, inputs, is_extend: bool, seen=None, bound=None
) -> torch.Tensor:
    """``bound``: the step's token bound; with it the normal mode on gloo sends ragged."""
    dispatcher.dispatch_a(*inputs, is_extend=is_extend, global_max_tokens=bound)
    dispatched = dispatcher.dispatch_b()
    if seen is not None:
        seen.append(dispatched)
    dispatcher.combine_a(local(*dispatched))
    return dispatcher.combine_b()


def _through_blocked(dispatcher, local: FusedMoE, inputs, is_extend: bool, bound) -> torch.Tensor:
    """Single-batch overlap's order: up-projections, then each block's down-projection followed
    by its combine."""
    dispatcher.dispatch_a(*inputs, is_extend=is_extend, global_max_tokens=bound)
    hidden, weights, ids = dispatcher.dispatch_b()
    blocks = local.up_project_blocks(hidden, weights, ids, dispatcher.overlap_args)
    dispatcher.combine_a_blocks(lambda i: local.down_project_block(blocks, i))
    return dispatcher.combine_b()


def _fixed_wire(groups, rank: int, world: int, sbo_num_blocks: int | None):
    """A low_latency dispatcher sending whole blocks on gloo too: the wire nccl runs."""
    dispatcher = TorchA2ALowLatencyDispatcher(
        groups, rank, world, 4 * world, TOP_K, HIDDEN, torch.float32, CAPACITY,
        duplex_min_bytes=DUPLEX_MIN_BYTES, ragged=False,
    )  # fmt: skip
    assert dispatcher.p2p is None
    if sbo_num_blocks:
        layout, fmt = dispatcher.layout, dispatcher.fmt
        dispatcher.enable_blocked(BlockedCombine(sbo_num_blocks, layout, fmt, dispatcher.exchange))
    return dispatcher


def _guard(mode: str, is_extend: bool):
    """The low_latency steps run without host synchronisation (gloo's ragged counts are read
    under ``allow_host_sync``); the normal mode's count exchange and pair wire synchronise."""
    sync_free = mode in ("low_latency", "fixed_wire") or (mode == "auto" and not is_extend)
    return forbid_host_sync() if sync_free else contextlib.nullcontext()


def _check_blocked(rank: int, world: int, groups) -> None:
    """The blocked combine in every mode (and on the fixed wire), with 3 blocks over 4 local
    experts (sizes 2, 1, 1) and with one block, on every routing case; the same instance also
    combines unblocked."""
    ref, local = _experts(rank, world, HIDDEN, torch.float32)
    for mode, blocks in itertools.product((*MODES, "fixed_wire"), (3, 1)):
        if mode == "fixed_wire":
            dispatcher = _fixed_wire(groups, rank, world, blocks)
        else:
            dispatcher = _make(mode, groups, rank, world, sbo_num_blocks=blocks)
        for seed, case in enumerate(CASES):
            inputs = _routing(case, rank, world, seed, HIDDEN, torch.float32)
            for is_extend in (True, False) if mode == "auto" else (True,):
                bound = MAX_TOKENS if seed % 2 else None
                with _guard(mode, is_extend):
                    out = _through_blocked(dispatcher, local, inputs, is_extend, bound)
                _assert_matches(out, ref, inputs)
        inputs = _routing("random", rank, world, 99, HIDDEN, torch.float32)
        with _guard(mode, False):
            out = _through(dispatcher, local, inputs, False)
        _assert_matches(out, ref, inputs)
        dispatcher.dispatch_a(*inputs, is_extend=False)
        dispatcher.dispatch_b()
        with pytest.raises(RuntimeError, match="combine block 1 launched after 0"):
            dispatcher.combine_a_block(1, torch.zeros(0, HIDDEN))


def _check_received(case: str, rank: int, world: int, dispatched) -> None:
    """The edge a case is meant to hit did happen (normal mode: exact rows)."""
    _, _, ids = dispatched  # [R, k]
    if case in ("receives_nothing", "all_empty") and rank == world - 1:
        assert ids.shape[0] == 0
    if case == "same_rank_topk":  # one row per token carries its whole top-k
        assert bool((ids >= 0).all())
    assert bool(((ids < 0) | (ids // 4 == rank)).all())  # only this rank's experts


def _assert_matches(out: torch.Tensor, ref: FusedMoE, inputs, atol: float = 1e-5) -> None:
    expected = ref(*inputs)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    if out.numel():
        assert (out.float() - expected.float()).abs().max().item() <= atol


def _check_cases(rank: int, world: int, groups) -> None:
    ref, local = _experts(rank, world, HIDDEN, torch.float32)
    dispatchers = {mode: _make(mode, groups, rank, world) for mode in MODES}
    for (seed, case), bound in itertools.product(enumerate(CASES), (None, MAX_TOKENS)):
        inputs = _routing(case, rank, world, seed, HIDDEN, torch.float32)
        seen = []
        for mode, dispatcher in dispatchers.items():
            for is_extend in (True, False) if mode == "auto" else (True,):
                out = _through(dispatcher, local, inputs, is_extend, seen, bound)
                _assert_matches(out, ref, inputs)
        normal, low_latency = seen[0], seen[1]
        _check_received(case, rank, world, normal)
        # low_latency: fixed [ep·C] rows, of which exactly the normal mode's rows are valid
        assert low_latency.hidden_states.shape[0] == world * CAPACITY
        assert int((low_latency.topk_ids >= 0).any(dim=1).sum()) == normal.topk_ids.shape[0]


def _check_interleaved(rank: int, world: int, groups, modes: tuple[str, str]) -> None:
    """TBO's order: A and B in flight at once, each instance with its own buffers."""
    ref, local = _experts(rank, world, HIDDEN, torch.float32)
    a, b = (_make(mode, groups, rank, world, tag=tag) for tag, mode in enumerate(modes))
    in_a = _routing("random", rank, world, 7, HIDDEN, torch.float32)
    in_b = _routing("same_rank_topk", rank, world, 8, HIDDEN, torch.float32)
    a.dispatch_a(*in_a, is_extend=False, global_max_tokens=MAX_TOKENS)
    b.dispatch_a(*in_b, is_extend=False, global_max_tokens=MAX_TOKENS)
    out_a = a.dispatch_b()
    a.combine_a(local(*out_a))
    out_b = b.dispatch_b()
    b.combine_a(local(*out_b))
    _assert_matches(b.combine_b(), ref, in_b)
    _assert_matches(a.combine_b(), ref, in_a)


def _check_bf16_odd_hidden(rank: int, world: int, groups) -> None:
    hidden = 13  # 26 bytes per row: exercises the padding before the fp32 weights
    ref, local = _experts(rank, world, hidden, torch.bfloat16)
    inputs = _routing("random", rank, world, 11, hidden, torch.bfloat16)
    for mode in ("normal", "low_latency"):
        dispatcher = _make(mode, groups, rank, world, hidden, torch.bfloat16)
        out = _through(dispatcher, local, inputs, True, bound=MAX_TOKENS)
        _assert_matches(out, ref, inputs, atol=3e-2)


def _check_capacity(rank: int, world: int, groups) -> None:
    ref, local = _experts(rank, world, HIDDEN, torch.float32)
    # 6 tokens > capacity 4, but at most 4 to any one rank: fits
    ids = torch.tensor(
        [[4 * (t % world), 4 * (t % world) + 1, 4 * (t % world) + 2] for t in range(2 * world)]
    )
    inputs = (torch.randn(2 * world, HIDDEN), torch.rand(2 * world, TOP_K), ids)
    dispatcher = _make("low_latency", groups, rank, world, cap=4)
    _assert_matches(_through(dispatcher, local, inputs, False), ref, inputs)
    # every rank sends 6 tokens to rank 0: every rank raises before any collective
    over = (torch.randn(6, HIDDEN), torch.rand(6, TOP_K), torch.tensor([[0, 1, 2]] * 6))
    with pytest.raises(RuntimeError, match="--max-dispatch-tokens-per-rank=4"):
        _make("low_latency", groups, rank, world, cap=4).dispatch_a(*over)


def _rows_to(ids: torch.Tensor, world: int) -> list[int]:
    """(token, rank) pairs a rank with top-k ``ids`` sends each rank."""
    return [int(((ids >= 0) & (ids // 4 == p)).any(dim=1).sum()) for p in range(world)]


def _check_ragged_bytes(rank: int, world: int, groups) -> None:
    """On gloo a rank sends each peer a header and its valid rows, and gets exactly those rows'
    outputs back, in both modes."""
    ref, local = _experts(rank, world, HIDDEN, torch.float32)
    routings = [_routing("random", r, world, 5, HIDDEN, torch.float32) for r in range(world)]
    peers = [p for p in range(world) if p != rank]
    sent = _rows_to(routings[rank][2], world)
    received = [_rows_to(routings[p][2], world)[rank] for p in range(world)]
    for mode in ("normal", "low_latency"):
        dispatcher = _make(mode, groups, rank, world)
        out = _through(dispatcher, local, routings[rank], True, bound=MAX_TOKENS)
        _assert_matches(out, ref, routings[rank])
        expected = sum((1 + sent[p]) * dispatcher.fmt.row_bytes for p in peers)
        expected += sum(received[p] * dispatcher.fmt.hidden_bytes for p in peers)
        sent_bytes = dispatcher.p2p.bytes_sent + dispatcher.p2p_back.bytes_sent
        assert sent_bytes == expected, (mode, sent_bytes, expected)


def _check_construction(rank: int, world: int, groups) -> None:
    assert isinstance(_make("normal", groups, rank, world), TorchA2ANormalDispatcher)
    assert isinstance(_make("low_latency", groups, rank, world), TorchA2ALowLatencyDispatcher)
    auto = _make("auto", groups, rank, world)
    assert isinstance(auto, TorchA2AAutoDispatcher)
    with pytest.raises(ValueError, match="is_extend"):
        auto.dispatch_a(*_routing("random", rank, world, 0, HIDDEN, torch.float32))
    with pytest.raises(RuntimeError, match="combine_a called where dispatch_a"):
        _make("normal", groups, rank, world).combine_a(torch.zeros(0, HIDDEN))
    with pytest.raises(ValueError, match="ep_rank"):
        _make("normal", groups, (rank + 1) % world, world)


def _worker(rank: int, world: int, init_method: str, num_groups: int) -> None:
    torch.set_num_threads(1)  # the ranks share a few cores
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    groups = [dist.new_group(list(range(world))) for _ in range(num_groups)]
    _check_construction(rank, world, groups)
    _check_cases(rank, world, groups)
    for modes in (("normal", "normal"), ("low_latency", "low_latency"), ("normal", "low_latency")):
        _check_interleaved(rank, world, groups, modes)
    # the second micro-batch on groups of its own
    _check_interleaved(rank, world, [dist.new_group(list(range(world)))], ("auto", "auto"))
    _check_bf16_odd_hidden(rank, world, groups)
    _check_ragged_bytes(rank, world, groups)
    _check_capacity(rank, world, groups)
    _check_blocked(rank, world, groups)


@pytest.mark.parametrize("world,num_groups", [(2, 1), (2, 2), (4, 2)])
def test_torch_a2a_dispatchers_match_single_process_moe(world: int, num_groups: int) -> None:
    run_ranks(_worker, world, num_groups, timeout=180.0)


def test_factory_without_torch_distributed() -> None:
    assert isinstance(create_dispatcher("none", "auto"), StandardDispatcher)
    with pytest.raises(ValueError, match="no DeepEP dispatcher"):
        create_dispatcher("deepep", "auto")
    with pytest.raises(ValueError, match="deepep-mode"):
        create_dispatcher("torch", "fast")
    with pytest.raises(ValueError, match="moe-a2a-backend"):
        create_dispatcher("nccl", "auto")
