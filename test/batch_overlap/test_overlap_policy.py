"""--overlap-mode auto's cost model and decisions on synthetic timings (no clock involved):
exploration of each mode, the fastest prediction, hysteresis, re-measuring, pruning where the
all-to-all is too small to hide, and the same choices on every rank fed the same numbers."""

from __future__ import annotations

import random

import pytest
import torch

from srt.batch_overlap.calibration import ladder
from srt.batch_overlap.overlap_policy import OverlapCostModel, OverlapPolicy, bucket_of
from srt.batch_overlap.step_overlap import StepOverlap
from srt.layers.moe.token_dispatcher.base import CommMeter
from srt.model_executor.forward_batch_info import ForwardMode
from srt.server_args import ServerArgs

ALL = {"off", "tbo", "sbo"}


def run(policy: OverlapPolicy, kind: str, tokens: int, cost: dict, steps: int) -> list[str]:
    """``steps`` steps whose time per mode is ``cost[mode]`` (comm: half of off's time)."""
    chosen = []
    for _ in range(steps):
        mode = policy.choose(kind, tokens, ALL)
        policy.observe(kind, mode, tokens, cost[mode], cost["off"] / 2)
        chosen.append(mode)
    return chosen


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 255, 256)] == [0, 0, 1, 1, 2, 2, 3, 7, 8]


def test_prediction_follows_a_line_and_smooths_an_outlier():
    model = OverlapCostModel()
    model.observe("decode", "off", 16, 0.010, 0.0, 1)
    model.observe("decode", "off", 64, 0.040, 0.0, 2)
    assert model.predict("decode", "tbo", 32) is None
    assert model.predict("decode", "off", 8) == pytest.approx(0.010)  # flat below
    assert model.predict("decode", "off", 40) == pytest.approx(0.025)  # between
    assert model.predict("decode", "off", 128) == pytest.approx(0.080)  # along the last two
    assert model.predict("prefill", "off", 16) is None  # kinds are separate
    for n, t in ((8, 0.008), (16, 0.010), (64, 0.060), (128, 0.016), (256, 0.019)):
        model.observe("prefill", "off", n, t, 0.0, 3)  # one noisy cell at 64 tokens
    assert 0.012 < model.predict("prefill", "off", 32) < 0.035  # no cell of its own


def test_explores_each_mode_then_runs_the_fastest():
    policy = OverlapPolicy(remeasure_every=1000)
    chosen = run(policy, "decode", 256, {"off": 0.10, "tbo": 0.07, "sbo": 0.12}, 10)
    assert chosen[:3] == ["off", "tbo", "sbo"]
    assert chosen[3:] == ["tbo"] * 7
    assert policy.num_explored == 3
    assert policy.info()["num_steps"] == {"decode/off": 1, "decode/sbo": 1, "decode/tbo": 8}


def test_each_bucket_and_kind_decides_on_its_own():
    policy = OverlapPolicy(remeasure_every=1000)
    run(policy, "decode", 256, {"off": 0.10, "tbo": 0.07, "sbo": 0.12}, 5)
    small = run(policy, "decode", 8, {"off": 0.01, "tbo": 0.02, "sbo": 0.015}, 5)
    prefill = run(policy, "prefill", 256, {"off": 0.5, "tbo": 0.6, "sbo": 0.4}, 5)
    assert small[3:] == ["off", "off"] and prefill[3:] == ["sbo", "sbo"]
    assert policy.choose("decode", 300, ALL) == "tbo"  # 256..511: the first bucket's choice


def test_hysteresis_keeps_the_mode_within_the_margin():
    policy = OverlapPolicy(modes=("off", "tbo"), margin=0.05, remeasure_every=1000)
    run(policy, "decode", 100, {"off": 0.100, "tbo": 0.080}, 4)
    assert policy.current[("decode", bucket_of(100))] == "tbo"
    # tbo slows to 0.092: still faster than off, tbo stays
    chosen = run(policy, "decode", 100, {"off": 0.100, "tbo": 0.092}, 10)
    assert set(chosen) == {"tbo"}
    # off is measured faster: tbo's ratio to off was measured against the old off, so it
    # takes most of tbo's window (three steps) measured against the new one to switch
    for _ in range(3):
        policy.observe("decode", "off", 100, 0.080, 0.04)
    chosen = run(policy, "decode", 100, {"off": 0.080, "tbo": 0.092}, 8)
    assert chosen == ["tbo"] * 3 + ["off"] * 5


def test_an_overlap_needs_a_clear_gain_to_replace_the_plain_step():
    policy = OverlapPolicy(modes=("off", "tbo"), remeasure_every=1000)
    chosen = run(policy, "decode", 100, {"off": 0.100, "tbo": 0.094}, 6)  # 6 % faster
    assert chosen == ["off", "tbo", "off", "off", "off", "off"]
    chosen = run(policy, "prefill", 100, {"off": 0.100, "tbo": 0.088}, 4)  # 12 % faster
    assert chosen == ["off", "tbo", "tbo", "tbo"]


def test_a_bucket_s_own_cell_outweighs_its_neighbours():
    model = OverlapCostModel()
    for n, t in ((16, 0.050), (32, 0.016), (64, 0.030)):  # a slow neighbour at 16 tokens
        model.observe("decode", "off", n, t, 0.0, 1)
    assert model.predict("decode", "off", 32) == pytest.approx(0.016)
    assert 0.016 <= model.predict("decode", "off", 40) < 0.02  # along the (flat) slope


def test_remeasures_the_mode_sampled_longest_ago():
    policy = OverlapPolicy(remeasure_every=4)
    cost = {"off": 0.10, "tbo": 0.085, "sbo": 0.095}  # none far behind tbo
    chosen = run(policy, "decode", 64, cost, 12)
    # visits 1-3 explore; every 4th visit re-measures: off (sampled at step 1), then sbo
    assert chosen == ["off", "tbo", "sbo", "off", "tbo", "tbo", "tbo", "sbo",
                      "tbo", "tbo", "tbo", "off"]  # fmt: skip
    assert policy.num_explored == 6


def test_a_mode_far_behind_is_remeasured_less_often():
    policy = OverlapPolicy(remeasure_every=4, far_behind=0.25, far_remeasure_every=12)
    cost = {"off": 0.10, "tbo": 0.07, "sbo": 0.12}  # sbo 71 % behind tbo, off 36 %
    chosen = run(policy, "decode", 64, cost, 24)
    # every 4th visit re-measures off (the safe choice, at the full rate); sbo, last run at
    # visit 3, only once 12 visits have passed: at visit 16 (its turn, off's was at 12)
    assert chosen == ["off", "tbo", "sbo", "off", "tbo", "tbo", "tbo", "off", "tbo", "tbo",
                      "tbo", "off", "tbo", "tbo", "tbo", "sbo", "tbo", "tbo", "tbo", "off",
                      "tbo", "tbo", "tbo", "off"]  # fmt: skip
    assert policy.num_explored == 9


def test_an_overlap_that_stays_behind_waits_longer_and_longer():
    policy = OverlapPolicy(modes=("off", "tbo"), remeasure_every=4, max_remeasure_every=16)
    chosen = run(policy, "decode", 64, {"off": 0.10, "tbo": 0.11}, 64)  # tbo 10 % behind
    # explored at visit 2, re-measured at the first re-measuring visit (4), then after
    # waits of 8, 16 visits and 16 again (the cap)
    assert [v for v, mode in enumerate(chosen, 1) if mode == "tbo"] == [2, 4, 12, 28, 44, 60]
    # the link got slower: tbo's next sample (visit 76) shows it ahead, so it is re-measured
    # at every re-measuring visit again until its median follows and it runs
    chosen = run(policy, "decode", 64, {"off": 0.10, "tbo": 0.07}, 32)
    assert [v for v, mode in enumerate(chosen, 65) if mode == "tbo"][:3] == [76, 80, 84]
    assert policy.current[("decode", bucket_of(64))] == "tbo"


def test_remeasuring_follows_a_change():
    policy = OverlapPolicy(modes=("off", "tbo"), remeasure_every=4)
    run(policy, "decode", 64, {"off": 0.10, "tbo": 0.07}, 8)
    # the link got faster: tbo now loses; off, re-measured every 4th step, shows it
    chosen = run(policy, "decode", 64, {"off": 0.05, "tbo": 0.07}, 32)
    # off's re-measures at visits 12, 16 and 20 make most of its window; three more tbo
    # steps measured against it, and from visit 25 off runs; tbo, now 47 % behind, is not
    # re-measured again within these 32 visits
    assert chosen[:3] == ["tbo"] * 3 and chosen[16:] == ["off"] * 16
    assert policy.current[("decode", bucket_of(64))] == "off"


def test_overlap_is_not_tried_where_the_all_to_all_is_too_small():
    policy = OverlapPolicy(min_comm_share=0.03, remeasure_every=4)
    chosen = []
    for _ in range(12):
        mode = policy.choose("decode", 64, ALL)
        policy.observe("decode", mode, 64, 0.10, 0.001)  # 1 % of the step in the all-to-all
        chosen.append(mode)
    assert chosen == ["off"] * 12 and policy.num_explored == 1


def test_a_step_that_cannot_split_never_runs_tbo():
    policy = OverlapPolicy(remeasure_every=2)
    for _ in range(10):
        mode = policy.choose("decode", 1, {"off", "sbo"})
        assert mode != "tbo"
        policy.observe("decode", mode, 1, 0.01, 0.005)
    assert OverlapPolicy(modes=("off", "tbo")).choose("decode", 8, {"off", "sbo"}) == "off"


def test_unknown_modes_and_kinds_are_refused():
    with pytest.raises(ValueError, match="need 'off'"):
        OverlapPolicy(modes=("tbo",))
    with pytest.raises(ValueError, match="kind"):
        OverlapPolicy().choose("verify", 8, ALL)


def test_every_rank_chooses_the_same_from_the_shared_measurements():
    """Two ranks measure differently; fed the max over both (as the MLP sync gives it), their
    choices agree at every step, through explorations, switches and re-measures."""
    rng = random.Random(0)
    ranks = [StepOverlap("auto", ("off", "tbo", "sbo"), CommMeter(), torch.device("cpu"))
             for _ in range(2)]  # fmt: skip
    shared = None
    for _ in range(300):
        mode = ForwardMode.EXTEND if rng.random() < 0.2 else ForwardMode.DECODE
        tokens, can_split = rng.choice([1, 8, 64, 300, 2048]), rng.random() < 0.8
        chosen = {rank.choose(mode, tokens, can_split, shared) for rank in ranks}
        assert len(chosen) == 1
        local = [[rng.randrange(1000, 90000), rng.randrange(0, 40000)] for _ in ranks]
        shared = [max(column) for column in zip(*local)]
    infos = [rank.info() for rank in ranks]
    assert infos[0] == infos[1] and infos[0]["num_explored_steps"] > 0
    assert {key.split("/")[1] for key in infos[0]["num_steps"]} == {"off", "tbo", "sbo"}


def test_a_fixed_mode_runs_on_every_step():
    tbo = StepOverlap("tbo", ("tbo",), CommMeter(), torch.device("cpu"))
    assert tbo.choose(ForwardMode.DECODE, 64, True, None) == "tbo"
    assert tbo.choose(ForwardMode.DECODE, 64, False, None) == "off"  # cannot split
    sbo = StepOverlap("sbo", ("sbo",), CommMeter(), torch.device("cpu"))
    assert sbo.choose(ForwardMode.IDLE, 0, False, None) == "sbo"
    assert tbo.measurement == [] and tbo.info() == {"overlap_mode": "tbo"}


def make_args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="unused", **kwargs)


def test_overlap_mode_and_its_aliases():
    a2a = dict(tp_size=2, moe_a2a_backend="torch")
    assert make_args().overlap_mode == "off"
    args = make_args(enable_two_batch_overlap=True, **a2a)
    assert args.overlap_mode == "tbo" and args.tbo_decode_token_threshold == 32
    args = make_args(overlap_mode="sbo", **a2a)
    assert args.enable_single_batch_overlap and not args.enable_two_batch_overlap
    args = make_args(overlap_mode="auto", **a2a)
    assert args.overlap_modes == ("off", "tbo", "sbo")
    assert (args.tbo_decode_token_threshold, args.tbo_prefill_token_threshold) == (0, 0)
    explicit = make_args(overlap_mode="auto", tbo_decode_token_threshold=64, **a2a)
    assert explicit.tbo_decode_token_threshold == 64  # an explicit threshold still bounds TBO
    dp = dict(tp_size=2, dp_size=2, enable_dp_attention=True)
    assert make_args(overlap_mode="auto", **dp).overlap_modes == ("off", "tbo")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(overlap_mode="auto"), "no all-to-all to overlap"),
        (dict(overlap_mode="sbo", enable_two_batch_overlap=True, tp_size=2,
              moe_a2a_backend="torch"), "--overlap-mode sbo and --enable-two-batch-overlap"),
        (dict(overlap_mode="fast"), "must be one of"),
        (dict(overlap_mode="auto", tp_size=2, dp_size=2, enable_dp_attention=True,
              sbo_num_blocks=2), "--sbo-num-blocks needs --overlap-mode sbo or auto"),
    ],
)  # fmt: skip
def test_overlap_mode_refusals(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_args(**kwargs)


def test_calibration_runs_each_mode_three_times_and_keeps_the_median():
    policy = OverlapPolicy(calibrating=True)
    chosen = []
    for seconds in (0.30, 0.10, 0.07, 0.11, 0.08, 0.12, 0.09, 0.5, 0.13):  # cold, then noisy
        mode = policy.choose("decode", 64, ALL)
        policy.observe("decode", mode, 64, seconds, 0.05)
        chosen.append(mode)
    assert chosen == ["off", "tbo", "sbo"] * 3
    assert policy.num_calibration_steps == 9 and policy.step_counts == {}
    medians = {m: policy.model.cell("decode", m, bucket_of(64)).seconds for m in ALL}
    assert medians == {"off": 0.11, "tbo": 0.10, "sbo": 0.12}
    policy.end_calibration()
    # measured: no exploration left; tbo's 9 % gain is under the bar an overlap must clear
    assert policy.choose("decode", 64, ALL) == "off" and policy.num_explored == 0


def test_an_overlap_is_weighed_against_the_plain_step_measured_alongside():
    """Calibrated on a quiet machine (tbo 20 % slower), served under load that slows every
    mode by 40 %: the loaded plain step is not compared with the quiet tbo."""
    policy = OverlapPolicy(modes=("off", "tbo"), calibrating=True, remeasure_every=4)
    for _ in range(3):
        for _ in range(2):
            mode = policy.choose("decode", 64, ALL)
            policy.observe("decode", mode, 64, {"off": 0.10, "tbo": 0.12}[mode], 0.05)
    policy.end_calibration()
    assert policy.model.cell("decode", "tbo", bucket_of(64)).vs_off == pytest.approx(1.2)
    chosen = run(policy, "decode", 64, {"off": 0.14, "tbo": 0.168}, 24)
    assert chosen == ["off"] * 24  # tbo's quiet 0.12 alone would have won; 26 % behind, it
    # also waits 64 visits for a re-measure
    assert policy.model.predict("decode", "tbo", 64) == pytest.approx(0.168)


def test_calibration_ladder():
    assert ladder(1, 6) == [1, 2, 4, 6] and ladder(1, 8) == [1, 2, 4, 8]
    assert ladder(16, 2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert ladder(16, 8) == []


def test_one_outlier_moves_nothing_and_a_lasting_change_is_followed():
    model = OverlapCostModel(window=5)
    for step in range(3):
        model.observe("decode", "off", 64, 0.010, 0.004, step)
    model.observe("decode", "off", 64, 1.000, 0.400, 3)  # the machine was busy elsewhere
    cell = model.cell("decode", "off", bucket_of(64))
    assert (cell.seconds, cell.comm_seconds, cell.samples) == (0.010, 0.004, 4)
    model.observe("decode", "off", 64, 0.020, 0.008, 4)  # the link got slower
    assert cell.seconds == 0.010
    model.observe("decode", "off", 64, 0.020, 0.008, 5)  # most of the window is slower
    assert (cell.seconds, cell.comm_seconds) == (0.020, 0.008)
    with pytest.raises(ValueError, match="window"):
        OverlapCostModel(window=0)
