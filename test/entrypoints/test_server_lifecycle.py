"""Two real server instances, each checked fresh and then ended: the warm-up, then SIGTERM;
--api-key, then the death of the scheduler."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import openai
import pytest
from helpers.server_process import (
    ServerProcess,
    assert_pool_full,
    internal_state,
    is_running,
    running_server,
    wait_gone,
)

from srt.managers.tokenizer_manager import WARMUP_TEXT

pytestmark = pytest.mark.slow  # starts processes

GENERATE = {"text": "Hello", "sampling_params": {"max_new_tokens": 2}}
PROTECTED = [
    ("GET", "/health_generate", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_server_info", None),
    ("GET", "/metrics", None),
    ("GET", "/flush_cache", None),
    ("POST", "/flush_cache", None),
    ("POST", "/abort_request", {"rid": "x"}),
    ("POST", "/generate", GENERATE),
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("GET", "/no_such_route", None),
]


def test_warm_up_leaves_no_trace_and_sigterm_stops_cleanly(qwen3_moe_path: str) -> None:
    """The warm-up generation runs before /health answers; afterwards the pool is full, the
    prefix cache empty and the request metrics zero, so the first user starts from scratch.
    Then SIGTERM stops that server and its children cleanly (one server for both: a
    fresh one, and its end)."""
    with running_server(qwen3_moe_path, "--enable-metrics") as server:
        state = internal_state(server.url)
        assert "warm-up done" in server.log()
        assert state["num_forward_steps"] > 0, state
        assert_pool_full(state)
        assert state["num_evictable_tokens"] == 0, state
        metrics = httpx.get(server.url + "/metrics").text.splitlines()
        labels = f'{{model_name="{qwen3_moe_path}"}}'
        for name in ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"):
            assert f"{name}{labels} 0.0" in metrics, name
        body = {"text": WARMUP_TEXT, "sampling_params": {"max_new_tokens": 2}}
        response = httpx.post(server.url + "/generate", json=body, timeout=60.0)
        assert response.json()["meta_info"]["cached_tokens"] == 0  # flushed after the warm-up
        assert_sigterm_stops_server_and_children(server)


def test_api_key_then_scheduler_death_stops_server(qwen3_moe_path: str) -> None:
    """--api-key guards every route but /health, and without --enable-metrics there is no
    /metrics; then (the end of that server) the death of its scheduler stops it."""
    args = ("--api-key", "secret", "--skip-server-warmup")
    with running_server(qwen3_moe_path, *args) as server:
        good = {"Authorization": "Bearer secret"}
        state = httpx.get(server.url + "/get_server_info", headers=good).json()
        assert state["internal_states"][0]["num_forward_steps"] == 0  # no warm-up ran
        assert "warm-up" not in server.log()
        with httpx.Client(base_url=server.url, timeout=60.0) as http:
            for auth in (None, "Bearer wrong", "secret", "Bearer secret2", "Basic secret"):
                headers = {} if auth is None else {"Authorization": auth}
                for method, route, body in PROTECTED:
                    response = http.request(method, route, json=body, headers=headers)
                    assert response.status_code == 401, (auth, method, route, response.text)
                    assert "API key" in response.json()["error"]["message"]
            assert http.get("/health").status_code == 200

            response = http.post("/generate", json=GENERATE, headers=good)
            assert response.status_code == 200, response.text
            assert response.json()["meta_info"]["completion_tokens"] == 2
            assert http.get("/get_server_info", headers=good).status_code == 200
            assert http.get("/metrics", headers=good).status_code == 404
        url = server.url + "/v1"
        models = openai.OpenAI(base_url=url, api_key="secret", max_retries=0).models.list()
        assert [model.id for model in models] == [qwen3_moe_path]
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        assert_scheduler_death_stops_server(server, qwen3_moe_path, good)


def proc_text(pid: int, name: str) -> str:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def start_ticks(pid: int) -> int:
    return int(proc_text(pid, "stat").rsplit(")", 1)[1].split()[19])


def scheduler_pid(server: ServerProcess, model_path: str) -> int:
    """The spawned child that maps the model's weight files; else the first one started
    (the launcher starts the scheduler before the detokenizer)."""
    spawned = [pid for pid in server.children() if "spawn_main" in proc_text(pid, "cmdline")]
    assert len(spawned) >= 2, f"expected a scheduler and a detokenizer, got {spawned}"
    model_dir = os.path.realpath(model_path)
    holding = [pid for pid in spawned if model_dir in proc_text(pid, "maps")]
    if len(holding) == 1:
        return holding[0]
    return min(spawned, key=lambda pid: (start_ticks(pid), pid))


def assert_scheduler_death_stops_server(
    server: ServerProcess, model_path: str, headers: dict[str, str]
) -> None:
    children = server.children()
    scheduler = scheduler_pid(server, model_path)
    body = {"text": "Hello", "stream": True}
    body["sampling_params"] = {"max_new_tokens": 2000, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=10.0, headers=headers) as http:
        with http.stream("POST", "/generate", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(scheduler, signal.SIGKILL)
            # The stream in flight ends with an error naming the dead child, then [DONE].
            rest = [line for line in lines if line.startswith("data: ")]
            code = server.wait_exit(timeout=5.0)
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = rest[-2]
    assert "child process scheduler rank 0 died" in error and '"code":500' in error, error
    log = server.log()
    assert code is not None and code != 0, f"server still running or exit 0:\n{log}"
    named = [line for line in log.splitlines() if "scheduler" in line and str(scheduler) in line]
    assert named, f"no log line names the dead scheduler (pid {scheduler}):\n{log}"
    assert wait_gone(children, timeout=5.0) == [], "children left behind"


def assert_sigterm_stops_server_and_children(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, timeout=60.0) as http:
        assert http.post("/generate", json=GENERATE).status_code == 200
    children = server.children()
    assert len(children) >= 2 and all(is_running(pid) for pid in children)
    ipc = server.ipc_dirs
    assert ipc and all(os.path.isdir(path) for path in ipc)
    server.proc.send_signal(signal.SIGTERM)
    code = server.wait_exit(timeout=10.0)
    log = server.log()
    assert code is not None, "still running 10 s after SIGTERM"
    assert wait_gone(children, timeout=5.0) == [], "children left behind"
    assert "Traceback" not in log, log
    # A clean stop: exit status 0 (not killed by the signal) and the IPC directory removed.
    left = sorted(path for path in ipc if os.path.exists(path))
    assert (code, left) == (0, []), f"exit code {code}, IPC directories left {left}:\n{log}"
