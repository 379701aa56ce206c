"""--log-requests: what each --log-requests-level puts in the received and finished lines."""

from __future__ import annotations

import logging

import pytest

from srt.managers.io_struct import BatchStrOutput, GenerateReqInput
from srt.managers.request_log import PARTIAL_CHARS, RequestLog
from srt.managers.request_state import ReqState

PROMPT = "secret prompt " + "x" * 3000
OUTPUT = "secret output " + "y" * 3000


def logged(level: int, caplog: pytest.LogCaptureFixture, **fields) -> str:
    """The two lines of one request that finishes with OUTPUT after 8 tokens."""
    obj = GenerateReqInput(text=PROMPT, sampling_params={"max_new_tokens": 8}, rid="r1", **fields)
    state = ReqState(obj, prompt_tokens=5)
    out = BatchStrOutput(
        ["r1"], [{"type": "length", "length": 8}], [OUTPUT], [[1] * 8], [5], [8], [2]
    )
    log = RequestLog(level)
    with caplog.at_level(logging.INFO, logger="srt.managers.request_log"):
        log.received(state)
        state.update(out, 0)
        log.finished(state)
    return caplog.text


def test_level_0_logs_ids_and_lengths_only(caplog):
    text = logged(0, caplog)
    assert "Receive: rid='r1', prompt_tokens=5\n" in text
    assert (
        "Finish: rid='r1', prompt_tokens=5, completion_tokens=8, cached_tokens=2, "
        "finish_reason={'type': 'length', 'length': 8}, latency="
    ) in text
    assert "secret" not in text and "max_new_tokens" not in text


def test_level_1_adds_the_sampling_parameters(caplog):
    text = logged(1, caplog)
    assert text.count("sampling_params={'max_new_tokens': 8}") == 2 and "secret" not in text


def test_level_2_adds_the_start_of_the_prompt_and_output(caplog):
    text = logged(2, caplog)
    assert text.count(f"text={PROMPT[:PARTIAL_CHARS]!r}") == 2
    assert f"output={OUTPUT[:PARTIAL_CHARS]!r}" in text and PROMPT[: PARTIAL_CHARS + 1] not in text


def test_level_3_adds_the_whole_prompt_and_output(caplog):
    text = logged(3, caplog)
    assert f"text={PROMPT!r}" in text and f"output={OUTPUT!r}" in text


def test_no_logs_requests_log_metadata_only(caplog):
    assert "secret" not in logged(3, caplog, no_logs=True)


def test_an_unfinished_request_logs_no_finish_reason(caplog):
    state = ReqState(GenerateReqInput(input_ids=[1, 2], rid="r2"), prompt_tokens=2)
    with caplog.at_level(logging.INFO, logger="srt.managers.request_log"):
        RequestLog(2).finished(state)
    assert "rid='r2'" in caplog.text and "finish_reason=None" in caplog.text
    assert "input_ids=[1, 2]" in caplog.text and "output=''" in caplog.text
