"""The DBO thread executor on its own: the hand-over order of vLLM's schedule, receive hooks,
threads started once and stopped, errors, and the thread-local state the workers share."""

from __future__ import annotations

import gc
import threading
from types import SimpleNamespace

import pytest
import torch

from srt.batch_overlap.ubatching import UBatchWrapper
from srt.layers.overlap.ubatch_context import (
    current_context,
    dbo_maybe_run_recv_hook,
    dbo_register_recv_hook,
    dbo_yield,
    make_ubatch_contexts,
)
from srt.model_executor.forward_batch_info import StepSplit
from srt.utils.sync_guard import HostSyncError, forbid_host_sync


def batch(index: int, num_tokens: int = 2):
    return SimpleNamespace(
        input_ids=torch.full((num_tokens,), index), positions=torch.arange(num_tokens), index=index
    )


class Layers:
    """A "model" of ``layers`` MoE layers whose dispatch and combine log their steps and hand
    over as the dispatchers do (hook, send, yield, receive)."""

    def __init__(self, layers: int = 2):
        self.layers, self.log, self.lock = layers, [], threading.Lock()

    def note(self, what: str, index: int) -> None:
        with self.lock:
            self.log.append(f"{what}{index}")

    def exchange(self, name: str, index: int) -> None:
        dbo_maybe_run_recv_hook()
        self.note(f"{name}-send", index)
        dbo_register_recv_hook(lambda: self.note(f"{name}-recv", index))
        dbo_yield()

    def __call__(self, input_ids, positions, b):
        i = b.index
        for _ in range(self.layers):
            self.note("A", i)
            self.exchange("D", i)
            self.note("MLP", i)
            self.exchange("C", i)
        return input_ids * 10


def test_plain_calls_do_nothing_outside_dbo():
    assert current_context() is None
    dbo_yield()
    dbo_register_recv_hook(lambda: pytest.fail("a hook outside DBO"))
    dbo_maybe_run_recv_hook()


def test_schedule_follows_vllm():
    """Comp |A0 A1|MLP1|S1 MLP0|...: micro-batch 1's dispatch is received by 0 before it sends
    its own, and so on (the design document's order, S aside)."""
    model = Layers(layers=2)
    wrapper = UBatchWrapper(model)
    outs = wrapper.run([batch(0), batch(1)])
    assert [o.tolist() for o in outs] == [[0, 0], [10, 10]]
    first_layer = ["A0", "D-send0", "A1", "D-recv0", "D-send1", "MLP0", "D-recv1", "C-send0",
                   "MLP1", "C-recv0", "C-send1", "A0", "C-recv1", "D-send0"]  # fmt: skip
    assert model.log[: len(first_layer)] == first_layer
    assert model.log.count("D-recv0") == model.log.count("D-send0") == 2
    assert wrapper.num_steps == 1 and wrapper.num_yields == 8
    wrapper.close()


def test_threads_reused_and_stopped():
    before = threading.active_count()
    wrapper = UBatchWrapper(Layers())
    for _ in range(3):
        wrapper.run([batch(0), batch(1)])
    assert threading.active_count() == before + 2
    wrapper.close()
    assert threading.active_count() == before
    for _ in range(10):  # dropped without close: collected with its threads
        w = UBatchWrapper(Layers())
        w.run([batch(0), batch(1)])
        del w
        gc.collect()
    assert threading.active_count() == before


def test_error_raised_and_the_other_runs_on():
    class Failing(Layers):
        def __call__(self, input_ids, positions, b):
            if b.index == 0:
                self.exchange("D", 0)
                raise RuntimeError("micro-batch 0 failed")
            return super().__call__(input_ids, positions, b)

    model = Failing(layers=1)
    wrapper = UBatchWrapper(model)
    with pytest.raises(RuntimeError, match="micro-batch 0 failed"):
        wrapper.run([batch(0), batch(1)])
    assert model.log[-1] == "C-send1"  # micro-batch 1 ran to its end alone
    threads = threading.active_count()
    del model.log[:]
    outs = run_within(10.0, wrapper.run, [batch(2), batch(3)])  # the same threads serve on
    assert [o.tolist() for o in outs] == [[20, 20], [30, 30]]
    assert model.log == ["A2", "D-send2", "A3", "D-recv2", "D-send3", "MLP2", "D-recv3",
                         "C-send2", "MLP3", "C-recv2", "C-send3", "C-recv3"]  # fmt: skip
    assert threading.active_count() == threads and wrapper.num_steps == 2
    wrapper.close()


def run_within(seconds: float, fn, *args):
    """``fn(*args)`` in a daemon thread: a worker that died with the failed micro-batch would
    hang the caller forever; here it fails the test."""
    out = []
    caller = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    caller.start()
    caller.join(seconds)
    assert out, f"no result within {seconds} s: a worker thread is gone"
    return out[0]


def test_wrapper_passes_unsplit_batches_through():
    calls = []
    wrapper = UBatchWrapper(lambda ids, pos, b: calls.append(threading.current_thread()) or ids)
    parent = SimpleNamespace(input_ids=torch.arange(4), positions=torch.arange(4),
                             split=StepSplit("off"), tbo_children=[batch(0), batch(1)])  # fmt: skip
    wrapper(parent.input_ids, parent.positions, parent)
    assert calls == [threading.current_thread()]
    parent.split = StepSplit("dbo")
    out = wrapper(parent.input_ids, parent.positions, parent)
    assert out.tolist() == [0, 0, 1, 1] and threading.current_thread() not in calls[1:]
    wrapper.close()


def test_workers_share_the_callers_state():
    seen = {}

    def model(ids, pos, b):
        seen[b.index] = (torch.is_inference_mode_enabled(), torch.get_num_threads())
        if b.index == 1:
            ids.tolist()  # a host read: the caller's guard must catch it here too
        return ids

    wrapper = UBatchWrapper(model)
    with torch.inference_mode(), forbid_host_sync("cpu"):
        with pytest.raises(HostSyncError):
            wrapper.run([batch(0), batch(1)])
    assert seen == {0: (True, torch.get_num_threads()), 1: (True, torch.get_num_threads())}
    wrapper.close()


def test_contexts_made_in_pairs():
    with pytest.raises(ValueError, match="2 micro-batches, not 1"):
        make_ubatch_contexts([batch(0)], torch.device("cpu"))
