"""The DP controller's routing decision (``--load-balance-method``)."""

from __future__ import annotations

import pytest

from srt.managers.data_parallel_controller import LoadBalancer
from srt.managers.io_struct import DpLoadReport, TokenizedGenerateReqInput
from srt.sampling.sampling_params import SamplingParams


def req(num_tokens: int) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput("r", list(range(num_tokens)), SamplingParams())


def test_round_robin_cycles():
    lb = LoadBalancer("round_robin", 3)
    assert [lb.pick(req(1)) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_shortest_queue_counts_reports_and_requests_sent_since():
    lb = LoadBalancer("shortest_queue", 2)
    lb.on_report(DpLoadReport(0, num_reqs=3, num_tokens=0))
    # group 1 is empty: it gets requests until it holds as many as group 0
    assert [lb.pick(req(1)) for _ in range(4)] == [1, 1, 1, 0]
    lb.on_report(DpLoadReport(1, num_reqs=0, num_tokens=0))  # group 1 finished its work
    assert lb.pick(req(1)) == 1


def test_minimum_tokens_prefers_fewest_tokens():
    lb = LoadBalancer("minimum_tokens", 2)
    lb.on_report(DpLoadReport(0, num_reqs=1, num_tokens=100))
    lb.on_report(DpLoadReport(1, num_reqs=5, num_tokens=20))
    assert lb.pick(req(50)) == 1  # 20 < 100 although group 1 holds more requests
    assert lb.pick(req(50)) == 1  # 70 < 100
    assert lb.pick(req(50)) == 0  # 120 > 100


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match="--load-balance-method"):
        LoadBalancer("random", 2)
