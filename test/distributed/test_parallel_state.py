"""ParallelConfig layouts (pure), and the real groups built on 2 and 4 gloo ranks."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from helpers.run_ranks import run_ranks

from srt.distributed import communication_op as comm
from srt.distributed.parallel_state import (
    ParallelConfig,
    ParallelState,
    build_parallel_state,
    init_parallel_state,
)

pytestmark = pytest.mark.slow  # starts processes

GROUPS = ("world", "attn_tp", "moe_ep", "moe_tp")
TIMEOUT = timedelta(seconds=30)


@pytest.mark.parametrize(
    "config, attn, ep, moe_tp",
    [
        (
            ParallelConfig(4, 2, True, "torch"),
            [[0, 1], [2, 3]],
            [[0, 1, 2, 3]],
            [[0], [1], [2], [3]],
        ),
        (ParallelConfig(4, 4, True), [[0], [1], [2], [3]], [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
        (ParallelConfig(2), [[0, 1]], [[0], [1]], [[0, 1]]),
        (ParallelConfig(4, ep_size=2), [[0, 1, 2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]]),
        # dp_size without DP attention: replicas are separate worlds, attention TP is the world
        (ParallelConfig(4, 2, False), [[0, 1, 2, 3]], [[0], [1], [2], [3]], [[0, 1, 2, 3]]),
    ],
)
def test_layouts(config, attn, ep, moe_tp):
    assert config.attn_tp_group_ranks() == attn
    assert config.moe_ep_group_ranks() == ep
    assert config.moe_tp_group_ranks() == moe_tp
    assert config.attn_tp_size * config.attn_dp_size == config.tp_size
    assert config.moe_ep_size * config.moe_tp_size == config.tp_size


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tp_size=4, dp_size=3, enable_dp_attention=True),
        dict(tp_size=4, moe_a2a_backend="torch", ep_size=2),
        dict(tp_size=4, moe_a2a_backend="nvshmem"),
        dict(tp_size=4, ep_size=3),
        dict(tp_size=0),
    ],
)
def test_invalid_configs(kwargs):
    with pytest.raises(ValueError):
        ParallelConfig(**kwargs)


def test_single_rank_state_needs_no_process_group():
    state = ParallelState.single_rank()
    assert not dist.is_initialized()
    assert (state.tp_size, state.attn_tp_size, state.attn_dp_rank, state.moe_ep_rank) == (
        1,
        1,
        0,
        0,
    )
    x = torch.arange(6.0).reshape(2, 3)
    assert comm.all_reduce(state.tp, x) is x
    assert comm.all_gather(state.attn_tp, x, dim=-1) is x
    assert comm.reduce_scatter(state.moe_ep, x) is x
    assert comm.broadcast_object(state.tp, {"a": 1}) == {"a": 1}
    assert comm.all_gather_object(state.tp, 7) == [7]
    state.destroy()
    state.destroy()


def _describe(state: ParallelState) -> dict:
    """Each group's layout, its real member list, and a sum of global ranks over both of its
    process groups (proves the groups are the right ones, not just well labelled)."""
    out = {
        "attn_tp_rank": state.attn_tp_rank,
        "attn_tp_size": state.attn_tp_size,
        "attn_dp_rank": state.attn_dp_rank,
        "attn_dp_size": state.attn_dp_size,
        "tp": (state.tp_rank, state.tp_size),
        "moe": (state.moe_ep_rank, state.moe_ep.world_size, state.moe_tp_rank),
        # the world's gloo twin (point-to-point exchanges split by direction), and whether the
        # dispatchers get it
        "duplex": [dist.get_process_group_ranks(g) for g in state.world_device_groups],
        "ep_duplex": state.moe_ep_duplex is not None,
    }
    for name in GROUPS:
        group = getattr(state, name)
        rank_sum = comm.all_reduce(group, torch.tensor([float(state.rank)])).item()
        out[name] = {
            "ranks": list(group.ranks),
            "rank_in_group": group.rank_in_group,
            "device_ranks": dist.get_process_group_ranks(group.device_group),
            "cpu_ranks": dist.get_process_group_ranks(group.cpu_group),
            "rank_sum": rank_sum,
            "gathered": comm.all_gather_object(group, state.rank),
        }
    return out


def _four_rank_worker(rank: int, n: int, init_method: str) -> dict:
    state = init_parallel_state(n, rank, 2, True, "torch", "gloo", init_method, timeout=TIMEOUT)
    out = {"dp2": _describe(state)}
    for name, config in [
        ("dp4", ParallelConfig(4, 4, True)),
        ("ep2", ParallelConfig(4, ep_size=2)),
    ]:
        extra = build_parallel_state(config, timeout=TIMEOUT)
        out[name] = _describe(extra)
        extra.destroy()
    state.destroy()
    out["destroyed"] = not dist.is_initialized()
    return out


def _two_rank_worker(rank: int, n: int, init_method: str) -> dict:
    """torch.distributed initialised by someone else: the state must leave the world alone."""
    dist.init_process_group("gloo", init_method=init_method, world_size=n, rank=rank)
    state = init_parallel_state(n, rank, timeout=TIMEOUT)
    out = {"tp2": _describe(state), "owns_world": state.owns_world}
    state.destroy()
    out["world_kept"] = dist.is_initialized() and dist.get_world_size() == n
    return out


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_ranks(_four_rank_worker, 4)


def _check(results: list[dict], key: str, config: ParallelConfig) -> None:
    partitions = {
        "world": [list(range(config.tp_size))],
        "attn_tp": config.attn_tp_group_ranks(),
        "moe_ep": config.moe_ep_group_ranks(),
        "moe_tp": config.moe_tp_group_ranks(),
    }
    for rank, result in enumerate(results):
        got = result[key]
        assert got["tp"] == (rank, config.tp_size)
        assert got["attn_tp_size"] == config.attn_tp_size
        assert got["attn_dp_size"] == config.attn_dp_size
        assert got["attn_dp_rank"] == rank // config.attn_tp_size
        assert got["attn_tp_rank"] == rank % config.attn_tp_size
        for name, partition in partitions.items():
            (ranks,) = [g for g in partition if rank in g]
            group = got[name]
            assert group["ranks"] == group["device_ranks"] == group["cpu_ranks"] == ranks, name
            assert group["rank_in_group"] == ranks.index(rank)
            assert group["rank_sum"] == sum(ranks)
            assert group["gathered"] == ranks


def test_groups_tp4_dp2_dp_attention_a2a(four_ranks):
    _check(four_ranks, "dp2", ParallelConfig(4, 2, True, "torch"))
    assert [r["dp2"]["moe"] for r in four_ranks] == [(r, 4, 0) for r in range(4)]
    assert all(
        r["dp2"]["duplex"] == [[0, 1, 2, 3]] * 2 and r["dp2"]["ep_duplex"] for r in four_ranks
    )


def test_groups_tp4_dp4_dp_attention(four_ranks):
    _check(four_ranks, "dp4", ParallelConfig(4, 4, True))
    assert [r["dp4"]["moe"] for r in four_ranks] == [(0, 1, r) for r in range(4)]
    # the LM head over the world uses the twin; no all-to-all backend, so no dispatcher does
    assert all(r["dp4"]["duplex"] == [[0, 1, 2, 3]] * 2 for r in four_ranks)
    assert not any(r["dp4"]["ep_duplex"] for r in four_ranks)


def test_groups_tp4_ep2(four_ranks):
    _check(four_ranks, "ep2", ParallelConfig(4, ep_size=2))
    assert [r["ep2"]["moe"] for r in four_ranks] == [(0, 2, 0), (0, 2, 1), (1, 2, 0), (1, 2, 1)]
    assert all(r["ep2"]["duplex"] == [] for r in four_ranks)  # no all-to-all, no DP attention


def test_destroy_releases_default_group(four_ranks):
    assert all(r["destroyed"] for r in four_ranks)


def test_groups_tp2_dp1_on_initialised_world():
    results = run_ranks(_two_rank_worker, 2)
    _check(results, "tp2", ParallelConfig(2))
    assert [(r["owns_world"], r["world_kept"]) for r in results] == [(False, True)] * 2
