"""The debugging flags and their environment aliases: one table, read once by ServerArgs."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from srt.server_args import ServerArgs
from srt.server_args_debug import ENV_ALIASES, apply_env_aliases

SRT = Path(__file__).resolve().parents[1] / "srt"


def args(**kwargs) -> ServerArgs:
    return ServerArgs(model_path="unused", device="cpu", **kwargs)


def test_an_alias_sets_a_field_left_at_its_default():
    a = args()
    assert (a.stream_trace_dir, a.forbid_host_sync, a.enable_operation_profile) == (
        None,
        False,
        False,
    )
    env = {"SRT_STREAM_TRACE": "/tmp/t", "SRT_FORBID_HOST_SYNC": "1", "SRT_OPERATION_PROFILE": "1"}
    apply_env_aliases(a, env)
    assert (a.stream_trace_dir, a.forbid_host_sync, a.enable_operation_profile) == (
        "/tmp/t",
        True,
        True,
    )


def test_an_explicit_flag_wins_and_zero_is_off():
    a = args(stream_trace_dir="/flag")
    apply_env_aliases(a, {"SRT_STREAM_TRACE": "/env", "SRT_FORBID_HOST_SYNC": "0"})
    assert a.stream_trace_dir == "/flag" and a.forbid_host_sync is False


def test_server_args_read_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SRT_STREAM_TRACE", str(tmp_path))
    assert args().stream_trace_dir == str(tmp_path)


def test_the_flags_are_on_the_command_line():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model-path", "m", "--stream-trace-dir", "d", "--forbid-host-sync"])
    a = ServerArgs.from_cli_args(ns)
    assert a.stream_trace_dir == "d" and a.forbid_host_sync


def test_no_other_module_reads_the_aliased_variables():
    readers = {
        path.relative_to(SRT).as_posix()
        for path in SRT.rglob("*.py")
        for alias in ENV_ALIASES
        if f'"{alias.variable}"' in path.read_text()
    }
    assert readers == {"server_args_debug.py"}


def test_the_logging_flags_on_the_command_line():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    argv = ["--model-path", "m", "--device", "cpu", "--decode-log-interval", "4", "--log-requests"]
    a = ServerArgs.from_cli_args(parser.parse_args([*argv, "--log-requests-level", "0"]))
    assert (a.decode_log_interval, a.log_requests, a.log_requests_level) == (4, True, 0)
    with pytest.raises(SystemExit):  # argparse: "invalid choice"
        parser.parse_args([*argv, "--log-requests-level", "4"])


def test_the_logging_defaults():
    a = args()
    assert (a.decode_log_interval, a.log_requests, a.log_requests_level) == (40, False, None)
    assert args(log_requests=True).log_requests_level == 2  # SGLang's default


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"decode_log_interval": 0}, "--decode-log-interval: must be ≥ 1, got 0"),
        ({"log_requests": True, "log_requests_level": 4}, "--log-requests-level: must be one of"),
        ({"log_requests_level": 1}, "--log-requests-level: needs --log-requests"),
    ],
)
def test_bad_logging_flags_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        args(**kwargs)
