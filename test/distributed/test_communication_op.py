"""Collectives on real gloo groups: the 4-rank world and its two 2-rank attention-TP groups
(tp=4, dp=2, DP attention), and the point-to-point row exchanges on the world's two device
groups (split by link direction), against the same arithmetic done in one process."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import torch
from helpers.run_ranks import run_ranks

from srt.distributed import communication_op as comm
from srt.distributed.group_coordinator import GroupCoordinator
from srt.distributed.p2p import DuplexRows
from srt.distributed.parallel_state import init_parallel_state

pytestmark = pytest.mark.slow  # starts processes


def _base(g: int, *shape: int) -> torch.Tensor:
    """Rank g's input: distinct per rank, exact in fp32."""
    n = 1
    for s in shape:
        n *= s
    return torch.arange(float(n)).reshape(shape) * (g + 1) + 100 * g


def _rows(g: int) -> torch.Tensor:
    return _base(g, g, 3)  # rank 0 has no rows (an idle DP rank)


def _var_sizes(n: int) -> list[int]:
    return [g + 1 for g in range(n)]


def _sum(n: int, *shape: int) -> torch.Tensor:
    return sum(_base(g, *shape) for g in range(n))


def _unchanged(grp: GroupCoordinator, g: int) -> bool:
    x = _base(g, 2 * grp.world_size, 3)
    comm.reduce_scatter(grp, x)
    return torch.equal(x, _base(g, 2 * grp.world_size, 3))


def _raises(fn: Callable[[], Any]) -> bool:
    try:
        fn()
    except ValueError:
        return True
    return False


# name → (what rank g of group grp runs, what every rank must get given (g, n))
CASES: dict[str, tuple[Callable, Callable]] = {
    "all_reduce": (
        lambda grp, g: comm.all_reduce(grp, _base(g, 2, 3)),
        lambda g, n: _sum(n, 2, 3),
    ),
    "all_reduce_bf16": (
        lambda grp, g: comm.all_reduce(grp, _base(g, 4).bfloat16()),
        lambda g, n: _sum(n, 4).bfloat16(),
    ),
    "all_gather_dim0": (
        lambda grp, g: comm.all_gather(grp, _base(g, 2, 3)),
        lambda g, n: torch.cat([_base(r, 2, 3) for r in range(n)]),
    ),
    "all_gather_dim_last": (
        lambda grp, g: comm.all_gather(grp, _base(g, 2, 3), dim=-1),
        lambda g, n: torch.cat([_base(r, 2, 3) for r in range(n)], dim=-1),
    ),
    "all_gather_dim_mid": (
        lambda grp, g: comm.all_gather(grp, _base(g, 2, 3, 2).transpose(0, 2), dim=1),
        lambda g, n: torch.cat([_base(r, 2, 3, 2).transpose(0, 2) for r in range(n)], dim=1),
    ),
    "all_gather_variable": (
        lambda grp, g: comm.all_gather_variable(grp, _rows(g), list(range(grp.world_size))),
        lambda g, n: torch.cat([_rows(r) for r in range(n)]),
    ),
    "all_gather_variable_exchanged_sizes": (
        lambda grp, g: comm.all_gather_variable(grp, _rows(g).t(), dim=1),
        lambda g, n: torch.cat([_rows(r).t() for r in range(n)], dim=1),
    ),
    "all_gather_sizes": (
        lambda grp, g: comm.all_gather_sizes(grp, 2 * g),
        lambda g, n: [2 * r for r in range(n)],
    ),
    "reduce_scatter_dim0": (
        lambda grp, g: comm.reduce_scatter(grp, _base(g, 2 * grp.world_size, 3)),
        lambda g, n: _sum(n, 2 * n, 3)[2 * g : 2 * g + 2],
    ),
    "reduce_scatter_dim_last": (
        lambda grp, g: comm.reduce_scatter(grp, _base(g, 3, 2 * grp.world_size), dim=-1),
        lambda g, n: _sum(n, 3, 2 * n)[:, 2 * g : 2 * g + 2],
    ),
    "reduce_scatter_variable": (
        lambda grp, g: comm.reduce_scatter_variable(
            grp, _base(g, sum(_var_sizes(grp.world_size)), 2), _var_sizes(grp.world_size)
        ),
        lambda g, n: _sum(n, sum(_var_sizes(n)), 2).split(_var_sizes(n))[g],
    ),
    # the nccl code path, run on gloo (torch 2.13's gloo has reduce_scatter_tensor)
    "reduce_scatter_padded": (
        lambda grp, g: comm.reduce_scatter_padded(
            grp, _base(g, sum(_var_sizes(grp.world_size)), 2), _var_sizes(grp.world_size)
        ),
        lambda g, n: _sum(n, sum(_var_sizes(n)), 2).split(_var_sizes(n))[g],
    ),
    "reduce_scatter_padded_dim_last": (
        lambda grp, g: comm.reduce_scatter_padded(
            grp, _base(g, 3, 2 * grp.world_size), [2] * grp.world_size, dim=-1
        ),
        lambda g, n: _sum(n, 3, 2 * n)[:, 2 * g : 2 * g + 2],
    ),
    "reduce_scatter_keeps_input": (_unchanged, lambda g, n: True),
    "broadcast": (
        lambda grp, g: comm.broadcast(grp, torch.full((4,), float(g)), src=grp.world_size - 1),
        lambda g, n: torch.full((4,), float(n - 1)),
    ),
    "broadcast_object": (
        lambda grp, g: comm.broadcast_object(
            grp, {"from": g, "reqs": ["a"]} if g == 1 else None, 1
        ),
        lambda g, n: {"from": 1, "reqs": ["a"]},
    ),
    "all_gather_object": (
        lambda grp, g: comm.all_gather_object(grp, ("rank", g)),
        lambda g, n: [("rank", r) for r in range(n)],
    ),
    "wrong_sizes_raise": (
        lambda grp, g: (
            _raises(lambda: comm.all_gather_variable(grp, _rows(g), [9] * 4))
            and _raises(lambda: comm.reduce_scatter(grp, _base(g, 2 * grp.world_size + 1, 3)))
        ),
        lambda g, n: True,
    ),
}


# name → (what world rank g runs with a DuplexRows, what it must get given (g, n)); rank 0
# sends and receives no rows (empty messages are skipped on both sides)
DUPLEX_CASES: dict[str, tuple[Callable, Callable]] = {
    "all_gather": (
        lambda rows, g: rows.all_gather(_rows(g), list(range(4))),
        lambda g, n: torch.cat([_rows(r) for r in range(n)]),
    ),
    # rank g sends rank q q rows (blocks of its own), so it gets g rows from every rank
    "all_to_all": (
        lambda rows, g: torch.cat(
            rows.all_to_all([_base(g, q, 2) + 10 * q for q in range(4)], [g] * 4)
        ),
        lambda g, n: torch.cat([_base(p, g, 2) + 10 * g for p in range(n)]),
    ),
    "wrong_sizes_raise": (
        lambda rows, g: _raises(lambda: rows.all_gather(_rows(g), [9] * 4)),
        lambda g, n: True,
    ),
}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), value.float().tolist())
    return value


def _worker(rank: int, n: int, init_method: str) -> dict:
    state = init_parallel_state(
        n, rank, 2, True, "none", "gloo", init_method, timeout=timedelta(seconds=30)
    )
    out = {}
    for group in (state.world, state.attn_tp):
        g = group.rank_in_group
        out[group.name] = {name: _plain(run(group, g)) for name, (run, _) in CASES.items()}
    out["duplex_groups"] = len(state.world_device_groups)
    rows = DuplexRows(state.world_device_groups, rank, n, tag=7)
    out["duplex"] = {name: _plain(run(rows, rank)) for name, (run, _) in DUPLEX_CASES.items()}
    state.destroy()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_worker, 4)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("group, size", [("world", 4), ("attn_tp", 2)])
def test_collective(results, name, group, size):
    _, expected = CASES[name]
    for rank, result in enumerate(results):
        g = rank % size
        assert result[group][name] == _plain(expected(g, size)), f"rank {rank}"


@pytest.mark.parametrize("name", DUPLEX_CASES)
def test_duplex_rows(results, name):
    _, expected = DUPLEX_CASES[name]
    for rank, result in enumerate(results):
        assert result["duplex_groups"] == 2  # gloo with DP attention: the world and its twin
        assert result["duplex"][name] == _plain(expected(rank, 4)), f"rank {rank}"
