"""Pipeline schedules as data: every generated schedule passes the checker at PP 2, 4 and 8; the
simulator reproduces the bubble formulas exactly for the cost models they assume; the checker
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


@pytest.mark.parametrize("pp", PPS)
@pytest.mark.parametrize("fb", [2.0, 2.5, 3.0])
def test_dualpipev_bubble(pp, fb):
    """Zero bubble's cost model (F = B − W = W, an F&B pair between the larger part and their
    sum): with dW detach, DeepSeek's (PP/2 − 1)(F&B + B − 3W) over 2·PP stages; without it,
    each of the cool-down's PP − 1 splits gives back its 2W: (PP − 1)(F&B + B − W)."""
    F, B, W = 1.0, 2.0, 1.0
    costs = Costs(F=F, B=B, W=W, FB=fb)
    detach = simulate(dualpipev(pp, 3 * pp, dw_detach=True), costs)
    assert max(detach.bubbles()) == pytest.approx((2 * pp / 2 - 1) * (fb + B - 3 * W))
    whole = simulate(dualpipev(pp, 3 * pp, dw_detach=False), costs)
    assert max(whole.bubbles()) == pytest.approx((pp - 1) * (fb + B - W))


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
