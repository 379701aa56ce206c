"""The EPLB placement algorithm (``srt.eplb.algorithm``): hand-worked placements,
the maps' invariants over seeded random loads, the balance it reaches against the trivial
placement, the hierarchical policy keeping each expert group on one node, and bad input."""

from __future__ import annotations

import pytest
import torch

from srt.eplb.algorithm import (
    ExpertPlacement,
    imbalance,
    rank_load,
    rebalance_experts,
    trivial_placement,
)


def _random_loads(num_layers: int, num_logical: int, seed: int) -> torch.Tensor:
    """Layers of uniform, heavy-tailed and small-integer loads (with ties and zeros)."""
    gen = torch.Generator().manual_seed(seed)
    third = num_layers // 3
    return torch.cat(
        [
            torch.rand(third, num_logical, generator=gen) * 100,
            torch.rand(third, num_logical, generator=gen).clamp_min(1e-3) ** -1.0,
            torch.randint(0, 4, (num_layers - 2 * third, num_logical), generator=gen).float(),
        ]
    )


def _check_consistent(placement: ExpertPlacement, num_logical: int, load: torch.Tensor):
    p2l, l2p = placement.physical_to_logical, placement.logical_to_physical
    counts = placement.logical_replica_count
    num_layers, num_physical = p2l.shape
    assert p2l.dtype == l2p.dtype == counts.dtype == torch.long
    assert counts.shape == (num_layers, num_logical)
    assert ((p2l >= 0) & (p2l < num_logical)).all()
    assert (counts >= 1).all()  # every logical expert placed
    assert (counts.sum(1) == num_physical).all()
    assert l2p.shape == (num_layers, num_logical, int(counts.max()))
    for layer in range(num_layers):
        assert torch.equal(torch.bincount(p2l[layer], minlength=num_logical), counts[layer])
        for expert in range(num_logical):
            slots = l2p[layer, expert]
            held = slots[: counts[layer, expert]]
            assert (slots[counts[layer, expert] :] == -1).all()
            assert (p2l[layer, held] == expert).all()
            assert (held.diff() > 0).all()
    # Slots split evenly over the ranks, and every token lands on some rank.
    loads = rank_load(placement, load)
    assert loads.shape == (num_layers, placement.ep_size)
    assert num_physical == placement.ep_size * placement.slots_per_rank
    torch.testing.assert_close(loads.sum(1), load.double().sum(1))


def test_hot_expert_gets_the_redundant_slots():
    load = torch.tensor([[10.0, 1.0, 1.0, 0.0]])
    placement = rebalance_experts(load, 6, ep_size=2)
    # Expert 0 takes both extra copies (10/3 each); rank 0 gets two of them and expert 3.
    assert placement.physical_to_logical.tolist() == [[0, 0, 3, 0, 1, 2]]
    assert placement.logical_replica_count.tolist() == [[3, 1, 1, 1]]
    assert placement.logical_to_physical.tolist() == [
        [[0, 1, 3], [4, -1, -1], [5, -1, -1], [2, -1, -1]]
    ]
    loads = rank_load(placement, load)
    torch.testing.assert_close(loads, torch.tensor([[20 / 3, 16 / 3]], dtype=torch.float64))
    torch.testing.assert_close(imbalance(loads), torch.tensor([10 / 9], dtype=torch.float64))
    # The greedy is not optimal: here the trivial placement (copies of experts 0 and 1 on
    # rank 1) happens to do better, 6.5 against 5.5.
    trivial = trivial_placement(1, 4, 6, 2)
    torch.testing.assert_close(
        imbalance(rank_load(trivial, load)), torch.tensor([13 / 12]).double()
    )


def test_packing_without_redundancy():
    load = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    placement = rebalance_experts(load, 4, ep_size=2)
    # Heaviest first onto the lightest rank: {4, 1} and {3, 2}.
    assert placement.physical_to_logical.tolist() == [[0, 3, 1, 2], [3, 0, 2, 1]]
    assert imbalance(rank_load(placement, load)).tolist() == [1.0, 1.0]
    trivial = trivial_placement(2, 4, 4, 2)
    assert imbalance(rank_load(trivial, load)).tolist() == [1.4, 1.4]


def test_hierarchical_hand_worked():
    # Groups {0, 1} (load 2) and {2, 3} (load 10), two nodes of one rank each, three slots per
    # rank: the heavier group goes to node 0 and each node copies its hottest expert (the
    # lower index on ties). The global policy mixes the groups for a perfect balance.
    load = torch.tensor([[1.0, 1.0, 5.0, 5.0]])
    placement = rebalance_experts(load, 6, ep_size=2, num_groups=2, num_nodes=2)
    assert placement.physical_to_logical.tolist() == [[3, 2, 2, 1, 0, 0]]
    assert rank_load(placement, load).tolist() == [[10.0, 2.0]]
    flat = rebalance_experts(load, 6, ep_size=2, num_groups=2, num_nodes=1)
    assert flat.physical_to_logical.tolist() == [[2, 2, 0, 3, 3, 1]]
    assert rank_load(flat, load).tolist() == [[6.0, 6.0]]
    # Four one-expert groups onto two nodes, heaviest first onto the lighter node: {8, 1} on
    # node 0 and {5, 4} on node 1, each node's slots heaviest first.
    load = torch.tensor([[8.0, 1.0, 4.0, 5.0]])
    placement = rebalance_experts(load, 4, ep_size=2, num_groups=4, num_nodes=2)
    assert placement.physical_to_logical.tolist() == [[0, 1, 3, 2]]


CONFIGS = [  # num_logical, num_physical, ep_size, num_groups, num_nodes
    (4, 4, 1, 1, 1),
    (8, 8, 8, 1, 1),
    (8, 12, 4, 1, 1),
    (16, 20, 4, 4, 2),
    (32, 40, 4, 8, 2),
    (24, 32, 8, 6, 4),  # groups do not divide over nodes: global
    (64, 72, 8, 8, 4),
]


@pytest.mark.parametrize("num_logical,num_physical,ep_size,num_groups,num_nodes", CONFIGS)
def test_maps_are_consistent(num_logical, num_physical, ep_size, num_groups, num_nodes):
    load = _random_loads(9, num_logical, seed=num_physical)
    placement = rebalance_experts(
        load, num_physical, ep_size=ep_size, num_groups=num_groups, num_nodes=num_nodes
    )
    _check_consistent(placement, num_logical, load)
    assert torch.equal(
        placement.physical_to_logical,
        rebalance_experts(
            load, num_physical, ep_size=ep_size, num_groups=num_groups, num_nodes=num_nodes
        ).physical_to_logical,
    )
    _check_consistent(trivial_placement(9, num_logical, num_physical, ep_size), num_logical, load)


@pytest.mark.parametrize(
    "num_logical,num_physical,ep_size",
    [(16, 16, 4), (64, 64, 8), (16, 20, 4), (32, 40, 4), (64, 80, 8)],
)
def test_not_worse_than_trivial(num_logical, num_physical, ep_size):
    # The greedy carries no guarantee (see the hand-worked cases: tiny layers can lose), but
    # at these sizes it beats the contiguous slices on every one of these seeded layers.
    load = _random_loads(60, num_logical, seed=7)
    balanced = imbalance(rank_load(rebalance_experts(load, num_physical, ep_size=ep_size), load))
    trivial = trivial_placement(60, num_logical, num_physical, ep_size)
    assert (balanced <= imbalance(rank_load(trivial, load)) + 1e-9).all()


def test_power_law_load_at_ep4():
    # Zipf-like loads (expert i of the layer's shuffled order gets 1 / (i + 1)), 64 experts,
    # 16 redundant (25 %), EP 4.
    gen = torch.Generator().manual_seed(0)
    zipf = 1000.0 / torch.arange(1, 65, dtype=torch.float64)
    load = torch.stack([zipf[torch.randperm(64, generator=gen)] for _ in range(8)])
    balanced = imbalance(rank_load(rebalance_experts(load, 80, ep_size=4), load))
    trivial = imbalance(rank_load(trivial_placement(8, 64, 80, 4), load))
    assert balanced.max() <= 1.15
    assert trivial.max() > 1.5


def test_hierarchical_keeps_each_group_on_one_node():
    num_logical, num_physical, ep_size, num_groups, num_nodes = 32, 40, 4, 8, 2
    load = _random_loads(9, num_logical, seed=3)
    placement = rebalance_experts(
        load, num_physical, ep_size=ep_size, num_groups=num_groups, num_nodes=num_nodes
    )
    group_of_slot = placement.physical_to_logical // (num_logical // num_groups)
    node_of_slot = torch.arange(num_physical) // (num_physical // num_nodes)
    for layer in range(load.shape[0]):
        nodes = [set(node_of_slot[group_of_slot[layer] == g].tolist()) for g in range(num_groups)]
        assert all(len(n) == 1 for n in nodes)
        assert sorted(n.pop() for n in nodes) == [0] * 4 + [1] * 4  # groups split evenly


def test_global_policy_when_groups_do_not_divide_over_nodes():
    load = _random_loads(6, 12, seed=5)
    grouped = rebalance_experts(load, 16, ep_size=4, num_groups=3, num_nodes=2)
    flat = rebalance_experts(load, 16, ep_size=4)
    assert torch.equal(grouped.physical_to_logical, flat.physical_to_logical)


def test_zero_load_and_trivial_placement():
    placement = rebalance_experts(torch.zeros(2, 4), 6, ep_size=2)
    _check_consistent(placement, 4, torch.zeros(2, 4))
    assert imbalance(rank_load(placement, torch.zeros(2, 4))).tolist() == [1.0, 1.0]
    assert trivial_placement(1, 8, 8, 4).physical_to_logical.tolist() == [list(range(8))]
    trivial = trivial_placement(1, 8, 10, 2)
    assert trivial.physical_to_logical.tolist() == [list(range(8)) + [0, 1]]
    assert trivial.logical_to_physical[0, :3].tolist() == [[0, 8], [1, 9], [2, -1]]


@pytest.mark.parametrize(
    "load,num_physical,kwargs,match",
    [
        (torch.ones(2, 4), 6, {"ep_size": 4}, "multiple of ep_size"),
        (torch.ones(2, 4), 3, {"ep_size": 1}, "at least num_logical"),
        (torch.ones(2, 4), 4, {"ep_size": 0}, "must be positive"),
        (torch.ones(4), 4, {"ep_size": 2}, r"\[num_layers, num_logical\]"),
        (torch.tensor([[1.0, -1.0]]), 2, {"ep_size": 1}, "non-negative"),
        (torch.tensor([[1.0, float("nan")]]), 2, {"ep_size": 1}, "finite"),
        (torch.ones(1, 6), 8, {"ep_size": 2, "num_groups": 4}, "must divide num_logical"),
        (torch.ones(1, 8), 8, {"ep_size": 2, "num_nodes": 4}, "must divide ep_size"),
    ],
)
def test_bad_input(load, num_physical, kwargs, match):
    with pytest.raises(ValueError, match=match):
        rebalance_experts(load, num_physical, **kwargs)


def test_trivial_placement_bad_sizes():
    with pytest.raises(ValueError, match="multiple of ep_size"):
        trivial_placement(1, 4, 6, 4)
