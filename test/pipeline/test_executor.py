"""The pipeline executor trains exactly: for 1F1B, interleaved 1F1B and DualPipeV with and
without dW detach, at PP 2 and PP 4 (gloo, one process per rank), the loss of every step, every
parameter's gradient after the first step and the weights after three SGD steps equal the
single-process run of the same micro-batches (fp32, ≤ 1e-5 relative), for a Qwen3-MoE-shaped
and a DeepSeek-V3-shaped model."""

from __future__ import annotations

import dataclasses

import pytest

from pipeline.model import ModelConfig
from pipeline.train import TrainConfig, max_relative_difference, reference, run

pytestmark = pytest.mark.slow  # starts processes

TOLERANCE = 1e-5


def configs(pp: int) -> list[TrainConfig]:
    layers = 2 * pp  # a multiple of 2·PP (DualPipeV) and of PP·2 (VPP, v = 2)
    qwen = ModelConfig(layers=layers, experts=4)
    v3 = dataclasses.replace(qwen, shape="deepseek_v3")
    base = dict(pp=pp, steps=3)
    return [
        TrainConfig("1f1b", num_microbatches=pp, model=qwen, **base),
        TrainConfig("vpp", num_microbatches=pp, vpp=2, model=v3, **base),
        TrainConfig("dualpipev", num_microbatches=2 * pp, model=qwen, **base),
        TrainConfig("dualpipev", num_microbatches=2 * pp, dw_detach=True, model=v3, **base),
    ]


@pytest.mark.parametrize("pp", [2, 4])
def test_schedules_train_like_one_process(pp):
    cfgs = configs(pp)
    for cfg, ranks in zip(cfgs, run(cfgs)):
        diff = max_relative_difference(ranks, reference(cfg))
        assert max(diff.values()) <= TOLERANCE, (cfg.method, cfg.dw_detach, diff)
        assert all(len(r["losses"]) == cfg.steps for r in ranks)
