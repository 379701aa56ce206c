"""Pipeline schedules as data: every generated schedule passes the checker at PP 2, 4 and 8; the
simulator reproduces 1F1B's and VPP's bubble formulas, and DualPipeV's derived closed form, which
equals DeepSeek's and MindSpeed's formulas exactly where their assumptions hold; the checker
catches broken schedules; bad configurations are refused with the rule they break."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.report import message_times
from pipeline.schedules import Comm, Compute, Pair, dualpipev, forward_schedule, make_schedule
from pipeline.simulator import Costs, ScheduleError, check, simulate
from pipeline.train import main as train_main

PPS = (2, 4, 8)
METHODS = [("1f1b", {}), ("vpp", {"v": 2}), ("vpp", {"v": 3}),
           ("dualpipev", {"dw_detach": False}), ("dualpipev", {"dw_detach": True})]  # fmt: skip


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("method, options", METHODS, ids=lambda x: str(x))
def test_generated_schedules_are_valid(pp, method, options):
    for n in (2 * pp, 3 * pp):
        check(make_schedule(method, pp, n, **options))


@pytest.mark.parametrize("pp", (2, 4))
@pytest.mark.parametrize("method, options", METHODS, ids=lambda x: str(x))
def test_forward_only_schedules(pp, method, options):
    """The forward-only schedule passes the checker and runs each rank's forwards in the full
    schedule's order, its pairs' forwards in their place; a backward in it is caught."""
    full = make_schedule(method, pp, 2 * pp, **options)
    forwards = make_schedule(method, pp, 2 * pp, forward_only=True, **options)
    check(forwards)
    for rank in range(pp):
        assert forwards.computes(rank) == [c for c in full.computes(rank) if c.kind == "F"]
        assert all(a.what == "act" for a in forwards.ranks[rank] if isinstance(a, Comm))
    broken = forward_schedule(full)
    broken.ranks[0].append(Compute("B", 0, 0))
    with pytest.raises(ScheduleError, match="B0@s0 runs 1 times"):
        check(broken)


@pytest.mark.parametrize("pp", PPS)
def test_one_f_one_b_bubble(pp):
    F, B = 1.0, 2.3
    t = simulate(make_schedule("1f1b", pp, 3 * pp), Costs(F=F, B=B, W=0.5))
    assert t.bubbles() == pytest.approx([(pp - 1) * (F + B)] * pp)
    assert t.peak_activations() == [pp - r for r in range(pp)]


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_bubble_is_a_vth(pp, v):
    """Stage costs F and B split over v chunks: each chunk costs F/v, B/v."""
    F, B = 1.2, 2.0
    t = simulate(make_schedule("vpp", pp, 2 * pp, v=v), Costs(F=F / v, B=B / v, W=0.1))
    assert max(t.bubbles()) == pytest.approx((pp - 1) * (F + B) / v)


# DualPipeV cost points (F, B, W, F&B), per chunk, a2a 0: zero bubble's (F = B − W = W) with
# full and no overlap, then away from it; docs/dualpipev.md's table
DUALPIPEV_COSTS = [(1, 2, 1, 2), (1, 2, 1, 3), (2, 3, 1, 4), (1, 2, 0.5, 2.5), (1, 4, 1, 4.5),
                   (1, 2, 0, 2), (1, 1, 0.5, 1.5), (1, 3, 2, 3)]  # fmt: skip


def _mindspeed(pp: int, c: Costs) -> float:
    """MindSpeed's (PP − 1)(F&B + B − W) − F, PP the pipeline ranks."""
    return (pp - 1) * (c.FB + c.B - c.W) - c.F


def _deepseek(pp: int, c: Costs) -> float:
    """DeepSeek's (PP/2 − 1)(F&B + B − 3W) with its PP the 2·PP stages."""
    return (2 * pp / 2 - 1) * (c.FB + c.B - 3 * c.W)


def _dualpipev_bubble(pp: int, c: Costs, dw_detach: bool) -> float:
    """The largest bubble (ranks PP − 2 and PP − 1) at p2p 0, any N ≥ 2·PP, from rank PP − 1's
    critical path. Its first backward starts at the later of its own forwards' end, 3·PP·F
    (PP − 1 waiting for its first input, 2·PP + 1 of its own, the last the V tip's unpaired F0)
    and the first gradient's arrival, 2·PP·F + (PP − 1)(B − W) (rank 0's forwards, then a split
    backward on each of ranks 0 to PP − 2). Then its backward and F&B pairs without a gap. Last,
    the last micro-batch's F1 crosses ranks PP − 2 … 0 as pairs and its backward comes back over
    the 2·PP stages: whole, (PP − 1)·F&B + 2·PP·B; split (all but rank 0's B1), ending at rank
    0's last W, or at rank PP − 1's PP deferred Ws where those are longer (2W > B)."""
    late_gradient = max(0.0, (pp - 1) * (c.B - c.W) - pp * c.F)
    if not dw_detach:
        return (pp - 1) * (c.F + c.FB) + late_gradient
    return (pp - 1) * (c.F + c.FB - c.B + max(0.0, c.B - 2 * c.W)) + late_gradient


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("dw_detach", [False, True])
@pytest.mark.parametrize("cost", DUALPIPEV_COSTS, ids=str)
def test_dualpipev_bubble_closed_form(pp, dw_detach, cost):
    """Every rank's bubble: rank r ≤ PP − 2 runs PP − 2 − r fewer F&B pairs than the last two
    ranks, so waits F + B − F&B less for each."""
    c = Costs(*cost)
    overlap = c.F + c.B - c.FB
    want = [_dualpipev_bubble(pp, c, dw_detach) - max(0, pp - 2 - r) * overlap for r in range(pp)]
    for n in (2 * pp, 2 * pp + 1, 3 * pp):
        assert simulate(dualpipev(pp, n, dw_detach=dw_detach), c).bubbles() == pytest.approx(want)


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("cost", DUALPIPEV_COSTS, ids=str)
def test_dualpipev_bubble_against_the_formulas(pp, cost):
    """Without dW detach, MindSpeed's formula where the first gradient reaches rank PP − 1 after
    its forwards, else above it (by F at F = B − W); with it, DeepSeek's exactly where
    F = B − W ≥ W (zero bubble's point among them), else above or below."""
    c = Costs(*cost)
    F, B, W = c.F, c.B, c.W
    whole = max(simulate(dualpipev(pp, 3 * pp, dw_detach=False), c).bubbles())
    assert whole - _mindspeed(pp, c) == pytest.approx(max(0.0, pp * F - (pp - 1) * (B - W)))
    assert (whole == pytest.approx(_mindspeed(pp, c))) == ((pp - 1) * (B - W) >= pp * F)
    detach = max(simulate(dualpipev(pp, 3 * pp, dw_detach=True), c).bubbles())
    above = (pp - 1) * max(0.0, 2 * W - B) + max(-F, (pp - 1) * (F - (B - W)))
    assert detach - _deepseek(pp, c) == pytest.approx(above)
    assert (detach == pytest.approx(_deepseek(pp, c))) == (F == B - W and 2 * W <= B)


def test_dualpipev_bubble_all_to_all_counts_in_lone_computations():
    """a2a adds to a lone F or B (a split B too), not to an F&B pair: the closed form holds
    with F + a2a and B + a2a."""
    pp, a2a = 4, 0.5
    bubbles = simulate(dualpipev(pp, 12, dw_detach=True), Costs(1, 2, 1, 3, a2a=a2a)).bubbles()
    assert max(bubbles) == pytest.approx(_dualpipev_bubble(pp, Costs(1 + a2a, 2 + a2a, 1, 3), True))


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("dw_detach", [False, True])
def test_dualpipev_bubble_grows_with_the_transfer_time(pp, dw_detach):
    """Neither formula has a p2p term. Each rank pairs micro-batch k's B1 with k + PP's F0, and
    k's activation crosses the V in between (2·(PP − 1) messages) with no slack: every PP more
    micro-batches add 2·(PP − 1)·p2p to the bubble."""
    c, p2p = Costs(1, 2, 1, 3), 0.25
    slow = dataclasses.replace(c, p2p=p2p)
    bubbles = [max(simulate(dualpipev(pp, k * pp, dw_detach=dw_detach), slow).bubbles())
               for k in (2, 3, 4)]  # fmt: skip
    assert bubbles[0] > _dualpipev_bubble(pp, c, dw_detach)
    assert bubbles[1] - bubbles[0] == pytest.approx(2 * (pp - 1) * p2p)
    assert bubbles[2] - bubbles[1] == pytest.approx(2 * (pp - 1) * p2p)


def test_a_late_message_delays_its_receiver():
    """``by_message``: one slow message holds up what needs it, the others keep ``p2p``."""
    schedule = make_schedule("1f1b", 2, 4)
    base = simulate(schedule, Costs(F=1.0, B=2.0, p2p=0.1))
    slow = simulate(schedule, Costs(F=1.0, B=2.0, p2p=0.1, by_message={"act0@s0": 0.6}))
    assert slow.makespan == pytest.approx(base.makespan + 0.5)  # the pipeline's first wait
    first = next(s for s in slow.spans if s.rank == 1)
    assert str(first.action) == "F0@s1" and first.start == pytest.approx(1.6)


def test_message_times_from_the_ranks_clocks():
    """A receive that waited saw its message arrive; one that did not bounds it; ranks on
    different clocks give none."""
    sender = {"clock": "a", "sends": [{"act0@s0": 1.0, "act1@s0": 2.0}], "receives": [{}]}
    receiver = {"clock": "a", "sends": [{}],
                "receives": [{"act0@s0": (1.1, 1.5), "act1@s0": (2.05, 2.05)}]}  # fmt: skip
    assert message_times([sender, receiver], 0, p2p=0.2) == pytest.approx(
        {"act0@s0": 0.5, "act1@s0": 0.05}
    )
    assert message_times([sender, {**receiver, "clock": "b"}], 0, p2p=0.2) == {}


def test_dualpipev_holds_fewer_activations_than_one_f_one_b_per_stage():
    """Per rank DualPipeV holds 2·PP + 1 chunk activations of half a 1F1B stage each: PP + ½
    stages' worth on every rank, against PP on 1F1B's first rank."""
    for pp in PPS:
        peaks = simulate(dualpipev(pp, 3 * pp, dw_detach=True)).peak_activations()
        assert peaks == [2 * pp + 1] * pp


def test_dualpipev_layout():
    s = dualpipev(4, 8, dw_detach=True)
    assert s.stage_rank == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [s.chunk_of(stage) for stage in (0, 7, 3, 4)] == [0, 1, 0, 1]
    pairs = [a for a in s.ranks[1] if isinstance(a, Pair)]
    assert pairs and all(p.f.mb != p.b.mb or p.f.stage != p.b.stage for p in pairs)


@pytest.mark.parametrize(
    "args, message",
    [
        (("dualpipev", 4, 7), "at least 2·PP = 8 micro-batches"),
        (("dualpipev", 2, 8, 2), "incompatible with virtual pipeline stages"),
        (("vpp", 4, 6, 2), "must be a multiple of PP"),
        (("vpp", 4, 8, 1), "at least 2 chunks"),
        (("gpipe", 2, 4), "one of 1f1b, vpp, dualpipev"),
    ],
)
def test_bad_configurations_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(*args)


def _broken(schedule, rank, transform):
    s = dataclasses.replace(schedule, ranks=[list(a) for a in schedule.ranks])
    s.ranks[rank] = transform(s.ranks[rank])
    return s


def test_checker_catches_broken_schedules():
    s = make_schedule("1f1b", 2, 4)
    no_recv = _broken(s, 1, lambda acts: [a for a in acts if not isinstance(a, Comm)
                                          or a.kind != "recv" or a.mb != 2])  # fmt: skip
    with pytest.raises(ScheduleError, match="sends without receives"):
        check(no_recv)
    twice = _broken(s, 0, lambda acts: acts + [Compute("F", 0, 1)])
    with pytest.raises(ScheduleError, match="F1@s0 runs 2 times"):
        check(twice)
    # rank 1 waits for a gradient it must itself send first: a deadlock
    swapped = _broken(s, 0, lambda acts: list(reversed(acts)))
    with pytest.raises(ScheduleError, match="deadlock"):
        check(swapped)
    w_without_split = _broken(s, 1, lambda acts: acts + [Compute("W", 1, 0)])
    with pytest.raises(ScheduleError, match="W0@s1 without a split B"):
        check(w_without_split)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--num-layers", "6"], "multiple of the 8 stages"),
        (["--schedules-method", "1f1b", "--moe-fb-overlap"], "1f1b has none"),
        (["--expert-model-parallel-size", "3"], "must split over"),
        (["--rank", "0"], "go together"),
    ],
)
def test_training_command_line_refuses_bad_configurations(argv, message, capsys):
    base = ["--schedules-method", "dualpipev", "--pipeline-model-parallel-size", "4",
            "--num-micro-batches", "8"]  # fmt: skip
    with pytest.raises(SystemExit):
        train_main([*base, *argv])
    assert message in capsys.readouterr().err
