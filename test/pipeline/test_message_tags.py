"""The executor's message tags, (direction, stage) × 4096 + micro-batch, stay unique and within
a 32-bit tag: a schedule past either bound is refused where the run starts, by the executor and
by the training command line, with the limit and the value."""

from __future__ import annotations

import pytest

from pipeline.executor import MAX_MICROBATCHES, MAX_STAGES, RankExecutor
from pipeline.schedules import Schedule, make_schedule
from pipeline.train import main as train_main

SHAPE = (2, 8, 32)


def test_micro_batches_up_to_the_bound_run_and_past_it_are_refused():
    RankExecutor(make_schedule("1f1b", 1, MAX_MICROBATCHES), 0, {}, SHAPE).close()
    with pytest.raises(ValueError, match=f"{MAX_MICROBATCHES + 1} micro-batches.*at most 4096"):
        RankExecutor(make_schedule("1f1b", 1, MAX_MICROBATCHES + 1), 0, {}, SHAPE)


def test_stages_past_a_32_bit_tag_are_refused():
    def stages(num: int) -> Schedule:
        return Schedule("many", 1, 1, num, [0] * num, [[]])

    assert 2 * MAX_STAGES * MAX_MICROBATCHES == 2**31  # the largest tag is 2**31 − 1
    RankExecutor(stages(MAX_STAGES), 0, {}, SHAPE).close()
    with pytest.raises(ValueError, match=f"{MAX_STAGES + 1} stages.*at most {MAX_STAGES}"):
        RankExecutor(stages(MAX_STAGES + 1), 0, {}, SHAPE)


def test_training_command_line_refuses_too_many_micro_batches(capsys):
    argv = ["--schedules-method", "1f1b", "--num-micro-batches", str(MAX_MICROBATCHES + 1)]
    with pytest.raises(SystemExit):
        train_main(argv)
    assert f"{MAX_MICROBATCHES + 1} micro-batches" in capsys.readouterr().err
