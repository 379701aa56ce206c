"""benchmark.common.static_batch, which bench_one_batch, the step benchmarks and the GPU check
measure with: a run generates exactly the tokens asked for, decodes as the prefill left off
(greedy, so two runs agree), and an observer receives the prefill's and first decode step's
operations."""

from __future__ import annotations

from benchmark.common.static_batch import make_runner, random_inputs, run_once
from srt.layers.overlap.operations import OperationObserver
from srt.server_args import ServerArgs


def test_run_once_generates_the_tokens_asked_and_records_the_steps(qwen3_moe_path, capsys):
    server_args = ServerArgs(model_path=qwen3_moe_path, device="cpu", dtype="float32")
    runner, ctx = make_runner(server_args, max_batch_size=3, max_tokens=3 * (7 + 4))
    inputs = random_inputs(runner.model_config.vocab_size, 3, 7, seed=0)
    first = run_once(runner, ctx, inputs, 4, verbose=True)
    lines = capsys.readouterr().out.splitlines()
    heads = ["Prefill", "Decode 0", "Decode 1", "Decode 2", "Decode", "Total"]
    assert [line.split(".")[0] for line in lines] == heads
    assert [len(ids) for ids in first["output_ids"]] == [4, 4, 4]
    assert first["events"] == {}
    again = run_once(runner, ctx, inputs, 4, False, OperationObserver(record=True))
    assert again["output_ids"] == first["output_ids"]  # the pools were cleared, nothing leaked
    assert set(again["events"]) == {"prefill", "decode"}
    layers = runner.model_config.hf_config.num_hidden_layers
    for events in again["events"].values():
        assert {e.layer_id for e in events if e.layer_id is not None} == set(range(layers))
