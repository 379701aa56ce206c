"""The pipeline executor trains exactly: for 1F1B, interleaved 1F1B and DualPipeV with and
without dW detach and ``--moe-fb-overlap``, at PP 2 and PP 4 (gloo, one process per rank; at
PP 4 plain DualPipeV only with dW detach, its schedule also running under fb-overlap), and
with the experts spread over an EP group of 2 at PP 2 (DualPipeV with fb-overlap), the loss of
every step, every parameter's gradient after the first step and the weights after three SGD
steps equal the single-process run of the same micro-batches (fp32, ≤ 1e-5 relative), for a
Qwen3-MoE-shaped and a DeepSeek-V3-shaped model. Past 2·PP micro-batches (PP 2 × N 8 at EP 1
and 2, PP 4 × N 12) DualPipeV with fb-overlap and dW detach trains as exactly, and runs its
schedule's order with the cool-down's weight gradients deferred. A forward-only step
(evaluation) gives every micro-batch's loss of one process and touches no gradient."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.model import ModelConfig
from pipeline.schedules import Comm, Compute, Pair
from pipeline.simulator import message_key
from pipeline.train import TrainConfig, max_relative_difference, reference, run

pytestmark = pytest.mark.slow  # starts processes

TOLERANCE = 1e-5


def configs(pp: int, ep: int) -> list[TrainConfig]:
    layers = 2 * pp  # a multiple of 2·PP (DualPipeV) and of PP·2 (VPP, v = 2)
    qwen = ModelConfig(layers=layers, experts=4)
    v3 = dataclasses.replace(qwen, shape="deepseek_v3")
    base = dict(pp=pp, ep=ep, steps=3)
    dualpipev = [
        TrainConfig("dualpipev", num_microbatches=2 * pp, fb_overlap=True, model=qwen, **base),
        TrainConfig("dualpipev", num_microbatches=2 * pp, dw_detach=True, fb_overlap=True,
                    model=v3, **base),
    ]  # fmt: skip
    if ep > 1:  # the pairs run the all-to-all in threads; the other actions outside them
        return dualpipev
    return [
        TrainConfig("1f1b", num_microbatches=pp, model=qwen, **base),
        TrainConfig("vpp", num_microbatches=pp, vpp=2, model=v3, **base),
        *(
            [TrainConfig("dualpipev", num_microbatches=2 * pp, model=qwen, **base)]
            if pp == 2
            else []
        ),  # at PP 4 its schedule runs under fb-overlap  # fmt: skip
        TrainConfig("dualpipev", num_microbatches=2 * pp, dw_detach=True, model=v3, **base),
        *(dualpipev if pp > 2 else []),  # at PP 2 the EP run has them
    ]


@pytest.mark.parametrize("pp, ep", [(2, 1), (4, 1), (2, 2)])
def test_schedules_train_like_one_process(pp, ep):
    cfgs = configs(pp, ep)
    for cfg, ranks in zip(cfgs, run(cfgs)):
        diff = max_relative_difference(ranks, reference(cfg))
        what = (cfg.method, cfg.dw_detach, cfg.fb_overlap)
        assert max(diff.values()) <= TOLERANCE, (*what, diff)
        assert all(len(r["losses"]) == cfg.steps for r in ranks)
        # under --moe-fb-overlap the pairs hand over at every all-to-all, EP 1 included
        assert all((r["handovers"] > 0) == cfg.fb_overlap for r in ranks), what
        if ep > 1:  # tokens did cross the EP group
            assert all(min(r["a2a_bytes"]) > 0 for r in ranks)


@pytest.mark.parametrize("pp, ep, n", [(2, 1, 8), (2, 2, 8), (4, 1, 12)])
def test_dualpipev_past_two_pp_micro_batches(pp, ep, n):
    """Past 2·PP micro-batches (the steady F&B phase repeats) DualPipeV with fb-overlap and dW
    detach trains like one process, each rank runs its schedule's computations in order, and
    on every pipeline rank past the first the W of a cool-down split B runs after later
    computations: deferred, not at once. Each F&B pair's halves post their sends inside the
    pair as they end: the backward's (it ends first) before the forward's, which the schedule
    lists first after the pair."""
    model = ModelConfig(layers=2 * pp, experts=4)
    cfg = TrainConfig("dualpipev", pp=pp, ep=ep, num_microbatches=n, dw_detach=True,
                      fb_overlap=True, steps=2, model=model)  # fmt: skip
    (ranks,) = run([cfg])
    diff = max_relative_difference(ranks, reference(cfg))
    assert max(diff.values()) <= TOLERANCE, diff
    schedule = cfg.schedule()
    for rank, result in enumerate(ranks):
        r = rank % pp
        planned = [str(a) for a in schedule.ranks[r] if not isinstance(a, Comm)]
        for spans in result["spans"]:
            ran = [name for name, _, _ in spans]
            assert ran == planned, rank  # a pair is one span under fb-overlap
            splits = [c for c in schedule.computes(r) if c.kind == "B" and c.split_w]
            gaps = [ran.index(str(Compute("W", c.stage, c.mb))) - ran.index(str(c)) - 1
                    for c in splits]  # fmt: skip
            # rank 0's cool-down Ws follow their Bs at once in DeepSeek's order; every other
            # rank's run after later computations
            assert min(gaps) >= 0 and (max(gaps) > 0) == (r > 0), (rank, gaps)
        pairs = [a for a in schedule.ranks[r] if isinstance(a, Pair)]
        for sends in result["sends"]:
            keys = [(message_key("act", a.f.stage, a.f.mb), message_key("grad", a.b.stage, a.b.mb))
                    for a in pairs]  # fmt: skip
            both = [(sends[f], sends[b]) for f, b in keys if f in sends and b in sends]
            assert both and all(b < f for f, b in both), rank


@pytest.mark.parametrize("pp, ep", [(2, 1), (4, 1), (2, 2)])
def test_forward_only_evaluates_like_one_process(pp, ep):
    """After a training step, a forward-only step over the next batch, by 1F1B and by
    DualPipeV with fb-overlap and dW detach (its pairs reduced to their forwards), gives each
    micro-batch's loss of the single-process model and leaves every gradient as it was."""
    base = dict(pp=pp, ep=ep, steps=1, evaluate=True, model=ModelConfig(layers=2 * pp, experts=4))
    cfgs = [TrainConfig("1f1b", num_microbatches=pp, **base),
            TrainConfig("dualpipev", num_microbatches=2 * pp, dw_detach=True, fb_overlap=True,
                        **base)]  # fmt: skip
    for cfg, ranks in zip(cfgs, run(cfgs)):
        diff = max_relative_difference(ranks, reference(cfg))
        assert "eval_loss" in diff and max(diff.values()) <= TOLERANCE, (cfg.method, diff)
        assert all(r["eval_grads_kept"] for r in ranks), cfg.method
