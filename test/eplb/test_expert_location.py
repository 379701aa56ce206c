"""The expert location: the placement the flags ask for (trivial, a file's placement, a file's
recorded load balanced), the map a MoE block applies (copies take rows evenly, the same rows
every time, no host sync), experts loaded into every slot that holds them, the recorder's
start / stop / dump and EPLB's window, and bad input refused naming the flag."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from launch_server import parse_args

from srt.distributed.parallel_state import ParallelState
from srt.eplb.algorithm import imbalance, rank_load
from srt.eplb.expert_distribution import ExpertDistributionRecorder
from srt.eplb.expert_location import ExpertLocation, expert_location_from_args, keep_in_place
from srt.layers.moe.fused_moe import FusedMoE
from srt.server_args import ServerArgs
from srt.utils.sync_guard import forbid_host_sync

PLAIN = ["--model-path", "m", "--device", "cpu", "--attention-backend", "torch_native"]
EP2 = ["--tp", "2", "--moe-a2a-backend", "torch"]
CONFIG = SimpleNamespace(num_hidden_layers=2, num_experts=4)


def args(*argv: str) -> ServerArgs:
    return parse_args([*PLAIN, *argv])


def test_the_map_spreads_an_experts_rows_over_its_copies():
    # 4 experts, 6 slots on 2 ranks: expert 0 in slots 0 and 3, expert 2 in 2 and 5
    location = ExpertLocation.from_physical(torch.tensor([[0, 1, 2, 0, 3, 2]]), 4, 2)
    assert location.local_experts(0, 0) == [0, 1, 2] and location.local_experts(0, 1) == [0, 3, 2]
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [2, 0]])
    rank0 = location.dispatch_map(0, 0)
    assert rank0(ids).tolist() == [[0, 1], [3, 5], [0, 4], [5, 3]]
    assert rank0(ids).tolist() == rank0(ids).tolist()  # a pure function of the rows
    rank1 = location.dispatch_map(0, 1)  # another rank starts on the other copy
    assert rank1(ids[:1]).tolist() == [[3, 1]]
    hot = rank0(torch.zeros(100, 1, dtype=torch.long))
    assert torch.bincount(hot.flatten()).tolist() == [50, 0, 0, 50]
    with forbid_host_sync():  # the decode forward's guard: the map reads nothing on the host
        rank0(ids)


def test_the_identity_needs_no_map_unless_it_may_change():
    assert ExpertLocation.trivial(2, 4, 0, 2).dispatch_map(1, 0) is None
    live = ExpertLocation.trivial(2, 4, 0, 2).dispatch_map(1, 0, live=True)
    assert live.table.shape == (4, 1)  # room for the most copies 4 slots can give an expert
    spread = ExpertLocation.from_physical(torch.tensor([[0, 0, 0, 0, 1, 2, 3, 0]]), 4, 2)
    with pytest.raises(ValueError, match="5 copies of an expert: the map holds at most 1"):
        live.update(spread.placement, 0)
    wide = ExpertLocation.trivial(1, 4, 4, 2)
    live = wide.dispatch_map(0, 0, live=True)
    live.update(spread.placement, 0)  # in place, into the same tensors
    assert live(torch.zeros(5, 1, dtype=torch.long)).flatten().tolist() == [0, 1, 2, 3, 7]
    with_copies = ExpertLocation.trivial(2, 4, 2, 2)
    assert with_copies.local_experts(0, 1) == [3, 0, 1]  # slot s holds expert s % 4
    assert with_copies.dispatch_map(0, 0) is not None


def test_a_slot_loads_the_expert_it_holds():
    moe = FusedMoE(6, 4, 2, ep_rank=1, ep_size=2, local_experts=[0, 3, 0])
    for e in range(4):
        for shard in ("w1", "w3", "w2"):
            shape = (4, 2) if shard == "w2" else (2, 4)
            param = moe.w2_weight if shard == "w2" else moe.w13_weight
            moe.weight_loader(param, torch.full(shape, float(e)), "w", shard, e)
    assert moe.w13_weight[:, 0, 0].tolist() == [0.0, 3.0, 0.0]
    assert moe.w2_weight[:, 0, 0].tolist() == [0.0, 3.0, 0.0]


def test_the_flags_make_the_placement(tmp_path):
    assert expert_location_from_args(args(*EP2), CONFIG) is None
    trivial = expert_location_from_args(args(*EP2, "--ep-num-redundant-experts", "2"), CONFIG)
    assert trivial.num_physical == 6
    rows = [[3, 2, 1, 0], [0, 1, 2, 3]]
    given = tmp_path / "p.json"
    given.write_text(json.dumps({"physical_to_logical_map": rows}))
    location = expert_location_from_args(args(*EP2, "--init-expert-location", str(given)), CONFIG)
    assert location.placement.physical_to_logical.tolist() == rows
    load = torch.tensor([[40.0, 30.0, 20.0, 10.0], [1.0, 1.0, 1.0, 1.0]])
    recorded = tmp_path / "load.pt"
    torch.save({"logical_count": load}, recorded)
    flags = (*EP2, "--ep-num-redundant-experts", "2", "--init-expert-location", str(recorded))
    balanced = expert_location_from_args(args(*flags), CONFIG)
    assert (balanced.placement.logical_replica_count[0] > 1).sum() >= 1  # the hot one copied
    before = imbalance(rank_load(trivial.placement, load))
    after = imbalance(rank_load(balanced.placement, load))
    assert after[0] < before[0] and after[0] == 1.0
    # where DeepSeek's greedy loses to the trivial placement (3 copies of 90 on 2 ranks), the
    # trivial one is kept
    torch.save({"logical_count": torch.tensor([[90.0, 5.0, 3.0, 2.0]] * 2)}, recorded)
    kept = expert_location_from_args(args(*flags), CONFIG)
    assert (
        kept.placement.physical_to_logical.tolist()
        == trivial.placement.physical_to_logical.tolist()
    )


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--ep-num-redundant-experts", "2"], "--ep-num-redundant-experts: expert placement needs"),
        ([*EP2, "--ep-num-redundant-experts", "1"], "split evenly over the 2 EP ranks"),
        ([*EP2, "--ep-num-redundant-experts", "-2"], "must be ≥ 0"),
        ([*EP2, "--init-expert-location", "/nonexistent.json"], "no such file"),
        (["--enable-eplb"], "--enable-eplb: expert placement needs expert parallelism"),
        ([*EP2, "--eplb-rebalance-num-iterations", "10"], "needs --enable-eplb"),
        ([*EP2, "--enable-eplb", "--eplb-rebalance-num-iterations", "0"], "must be ≥ 1"),
    ],
)
def test_bad_flags_are_refused(argv, match, capsys):
    with pytest.raises(SystemExit):
        args(*argv)
    assert match in capsys.readouterr().err


def test_a_file_for_another_model_is_refused(tmp_path):
    wrong = tmp_path / "w.json"
    wrong.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 3]]}))
    with pytest.raises(ValueError, match=r"--init-expert-location .*is \(1, 4\).*need \(2, 4\)"):
        args(*EP2, "--init-expert-location", str(wrong)).check_against_model(CONFIG)
    torch.save({"logical_count": torch.ones(2, 8)}, tmp_path / "l.pt")
    with pytest.raises(ValueError, match="logical_count is \\(2, 8\\), this model has \\(2, 4\\)"):
        args(*EP2, "--init-expert-location", str(tmp_path / "l.pt")).check_against_model(CONFIG)
    missing = tmp_path / "m.json"
    missing.write_text(json.dumps({"physical_to_logical_map": [[0, 1, 2, 2], [0, 1, 2, 3]]}))
    with pytest.raises(ValueError, match="layer 0 places no copy of experts \\[3\\]"):
        args(*EP2, "--init-expert-location", str(missing)).check_against_model(CONFIG)
    dense = SimpleNamespace(num_hidden_layers=2)
    with pytest.raises(ValueError, match="not a MoE model"):
        args(*EP2, "--ep-num-redundant-experts", "2").check_against_model(dense)


def test_the_recorder_counts_between_start_and_stop():
    recorder = ExpertDistributionRecorder(2, 4, ParallelState.single_rank())
    ids = torch.tensor([[0, 1], [0, 3]])
    assert not recorder.active  # on CPU, nothing counted until asked
    recorder.start()
    with forbid_host_sync():
        recorder.record(1, ids)
    recorder.stop()
    recorder.record(1, ids)  # a block no longer calls it once stopped; the dump is the stop's
    assert recorder.dump() == [[0, 0, 0, 0], [2, 1, 0, 1]]
    recorder.keep_window()  # --enable-eplb: a window of its own, taken and emptied
    assert recorder.active
    recorder.record(0, ids)
    assert recorder.take_window().tolist() == [[2, 1, 0, 1], [0, 0, 0, 0]]
    assert not recorder.take_window().any()
    recorder.start()
    assert recorder.dump() == [[0, 0, 0, 0], [0, 0, 0, 0]]


def test_a_new_placement_moves_as_few_experts_as_it_can():
    old = torch.tensor([[0, 1, 2, 3, 4, 5]])
    # the same ranks' sets, handed to the other rank and reordered: nothing needs to move
    assert keep_in_place(old, torch.tensor([[5, 3, 4, 2, 1, 0]]), 2, 1).tolist() == old.tolist()
    new = torch.tensor([[4, 0, 0, 1, 2, 3]])  # a second copy of 0; 5 is gone
    kept = keep_in_place(old, new, 2, 1)
    # {1, 2, 3} goes to rank 0, which held 1 and 2 (in their slots); {4, 0, 0} to rank 1,
    # which held 4: three slots change expert instead of all six
    assert kept.tolist() == [[3, 1, 2, 0, 4, 0]]
    per_rank = lambda p: sorted(sorted(p[0, r * 3 : r * 3 + 3].tolist()) for r in range(2))
    assert per_rank(kept) == per_rank(new)  # the same sets of experts: the same loads
    # with two nodes a set stays on its node, even where the other node's rank held more of it
    two_nodes = keep_in_place(torch.tensor([[0, 1, 2, 3]]), torch.tensor([[2, 3, 0, 1]]), 4, 2)
    assert two_nodes.tolist() == [[2, 3, 0, 1]]
