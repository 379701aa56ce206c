"""The operation executors and the operations strategies, without a model."""

from __future__ import annotations

import pytest
import torch

from srt.batch_overlap.two_batch_overlap import execute_overlapped_operations
from srt.layers.overlap.operations import (
    ExecutionOperation,
    LayerState,
    OperationObserver,
    YieldOperation,
    execute_operations,
    to_stages,
)
from srt.model_executor.forward_batch_info import ForwardMode
from srt.models.operations_strategy import DEEPSEEK, DENSE, QWEN3_MOE, YIELD


def _ops(log: list, names: str) -> list:
    """'a b | c' → operations appending (micro-batch tag, name) to log, and YIELDs."""

    def op(name):
        return ExecutionOperation(name, lambda state: log.append((state.get("tag"), name)))

    return [YieldOperation() if n == "|" else op(n) for n in names.split()]


def _state(tag: str) -> LayerState:
    state = LayerState(batch=None, positions=torch.empty(0))
    state.put(tag=tag)
    return state


def test_stages_cut_at_every_yield():
    ops = _ops([], "a | b c | |")
    assert [[op.name for op in stage] for stage in to_stages(ops)] == [["a"], ["b", "c"], [], []]


def test_plain_execution_ignores_yields():
    log = []
    execute_operations(_state("P"), _ops(log, "a | b | c"))
    assert log == [("P", "a"), ("P", "b"), ("P", "c")]


def test_delta_zero_alternates_stage_by_stage():
    log = []
    execute_overlapped_operations(_state("A"), _state("B"), _ops(log, "a1 a2 | b | c"), 0)
    assert log == [
        ("A", "a1"), ("A", "a2"), ("B", "a1"), ("B", "a2"),
        ("A", "b"), ("B", "b"), ("A", "c"), ("B", "c"),
    ]  # fmt: skip


def test_delta_two_lets_a_run_ahead_then_b_finishes():
    log = []
    execute_overlapped_operations(_state("A"), _state("B"), _ops(log, "s0 | s1 | s2 | s3"), 2)
    assert log == [
        ("A", "s0"), ("A", "s1"),  # A alone for delta stages
        ("A", "s2"), ("B", "s0"), ("A", "s3"), ("B", "s1"),  # alternating
        ("B", "s2"), ("B", "s3"),  # B finishes
    ]  # fmt: skip


def test_delta_out_of_range_is_refused():
    with pytest.raises(ValueError, match="delta_stages"):
        execute_overlapped_operations(_state("A"), _state("B"), _ops([], "a | b"), 3)


def test_state_is_checked():
    state = _state("A")
    with pytest.raises(KeyError, match="written twice"):
        state.put(tag="again")
    with pytest.raises(KeyError, match="read before"):
        state.pop("missing")
    state.put(extra=1)
    with pytest.raises(KeyError, match="left over"):
        state.take_outputs("tag")


def test_observer_records_every_operation_per_micro_batch():
    log, observer = [], OperationObserver(record=True)
    execute_overlapped_operations(_state("A"), _state("B"), _ops(log, "x | y"), 0, observer)
    events = observer.take_events()
    assert [(e.track, e.name) for e in events] == [
        ("A", "x"), ("B", "x"), ("A", "y"), ("B", "y"),
    ]  # fmt: skip
    assert all(e.end >= e.start for e in events)
    assert observer.take_events() == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_observer_times_device_work_on_cuda():
    """An operation that only enqueues ~50M cycles of device work returns at once on the host;
    its recorded interval must cover the device work, not the launch."""
    observer = OperationObserver(record=True)
    state = LayerState(batch=None, positions=torch.zeros(1, device="cuda"))
    sleep = ExecutionOperation("sleep", lambda state: torch.cuda._sleep(50_000_000))
    execute_operations(state, [sleep, ExecutionOperation("noop", lambda state: None)], observer)
    sleep_event, noop_event = observer.take_events()
    assert sleep_event.end - sleep_event.start > 5e-3
    assert noop_event.start >= sleep_event.end - 1e-6


def _names(ops) -> str:
    return " ".join("|" if op is YIELD else op for op in ops)


def test_strategies_match_sglang():
    """SGLang's operation lists (one layer) and deltas."""
    ds_prefill, delta = DEEPSEEK.for_mode(ForwardMode.EXTEND)
    assert delta == 0
    assert _names(ds_prefill) == (
        "comm_prepare_attn prepare_attn core_attn comm_prepare_mlp gate select_experts "
        "dispatch_a | dispatch_b experts combine_a | shared_experts combine_b output "
        "comm_postprocess"
    )
    for mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        ds_decode, delta = DEEPSEEK.for_mode(mode)
        assert delta == 2
        assert _names(ds_decode) == (
            "comm_prepare_attn prepare_attn | core_attn comm_prepare_mlp gate select_experts "
            "| dispatch_a shared_experts | dispatch_b experts combine_a | combine_b | output "
            "comm_postprocess"
        )
    qwen_decode, delta = QWEN3_MOE.for_mode(ForwardMode.DECODE)
    assert delta == 2
    assert _names(qwen_decode) == (
        "comm_prepare_attn prepare_attn | core_attn comm_prepare_mlp gate select_experts | "
        "dispatch_a | dispatch_b experts combine_a | combine_b output comm_postprocess |"
    )
    qwen_prefill, delta = QWEN3_MOE.for_mode(ForwardMode.EXTEND)
    assert delta == 0 and "shared_experts" not in qwen_prefill
    assert _names(qwen_prefill) == _names(ds_prefill).replace("shared_experts ", "")
    with pytest.raises(ValueError, match="IDLE"):
        DENSE.for_mode(ForwardMode.IDLE)


def test_layers_concatenate_into_one_strategy(qwen3_moe_path, deepseek_v3_path):
    """Model layers name their family; dense first layers are left out of the overlapped part
    and a dense layer inside it uses the dense list."""
    from srt.model_executor.model_runner import ModelRunner
    from srt.models.operations_strategy import OperationsStrategy
    from srt.server_args import ServerArgs

    for path, family in ((qwen3_moe_path, QWEN3_MOE), (deepseek_v3_path, DEEPSEEK)):
        args = ServerArgs(model_path=path, dtype="float32", device="cpu", max_total_tokens=64)
        model = ModelRunner(args).model.model
        moe_layers = model.layers[model.tbo_start_layer :]
        assert all(layer.operations_family is family for layer in moe_layers)
        assert all(not layer.is_moe for layer in model.layers[: model.tbo_start_layer])
        strategy = OperationsStrategy.init_new_tbo(moe_layers, ForwardMode.DECODE)
        assert strategy.tbo_delta_stages == 2
        per_layer = sum(1 for op in family.decode if op is YIELD)
        assert sum(1 for op in strategy.operations if op is YIELD) == per_layer * len(moe_layers)
        names = [op.name for op in strategy.operations if op is not YIELD]
        assert names.count("dispatch_a") == len(moe_layers)


def test_single_batch_overlap_runs_shared_experts_under_the_dispatch(deepseek_v3_path):
    """SBO's plain list moves the shared experts between dispatch_a and dispatch_b (they need
    only the router's input); without SBO they stay where the family puts them (prefill:
    under the combine)."""
    from srt.model_executor.model_runner import ModelRunner
    from srt.models.operations_strategy import layer_operations
    from srt.server_args import ServerArgs

    args = ServerArgs(model_path=deepseek_v3_path, dtype="float32", max_total_tokens=64)
    model = ModelRunner(args).model.model
    layer = model.layers[model.tbo_start_layer]
    for mode in (ForwardMode.EXTEND, ForwardMode.DECODE):
        plain = [op.name for op in layer_operations(layer, mode).operations if op is not YIELD]
        sbo = [op.name for op in layer_operations(layer, mode, "sbo").operations if op is not YIELD]
        assert sorted(plain) == sorted(sbo)
        assert sbo[sbo.index("dispatch_a") + 1] == "shared_experts"
        if mode is ForwardMode.EXTEND:  # the family's prefill list: under the combine
            assert plain.index("shared_experts") > plain.index("combine_a")
