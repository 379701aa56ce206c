"""Two nodes: two ``launch_server`` processes with ``--nnodes 2`` (one rank each) serve a
request whose output equals the one-node run; node 1 follows node 0's lifetime. ``--tp 2`` on
loopback; DP attention with the all-to-all with node 1 in its own network namespace joined to
node 0's by a veth pair (skipped without root and ``ip netns``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.engine_outputs import PARAMS, PROMPTS
from helpers.server_process import ServerProcess, free_port

from benchmark.common.netns import netns_available

pytestmark = pytest.mark.slow  # starts processes

LAYOUTS = {
    "tp2": ("--tp", "2"),
    "tp2-dp2-torch": (
        "--tp", "2", "--dp", "2", "--enable-dp-attention", "--moe-a2a-backend", "torch",
    ),
}  # fmt: skip
FOLLOW_TIMEOUT_S = 30.0


def free_port_block(host: str, size: int = 8) -> int:
    """A port P with P … P+size-1 free: the rendezvous and srt's ZMQ endpoints."""
    import socket

    for _ in range(50):
        base = free_port()
        try:
            with contextlib.ExitStack() as stack:
                for k in range(size):
                    s = stack.enter_context(socket.socket())
                    s.bind((host, base + k))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports")


@pytest.fixture(scope="module")
def reference(single_rank_outputs) -> list[list[int]]:
    return [out["output_ids"] for out in single_rank_outputs("tiny-qwen3-moe")]


def run_two_nodes(model_path: str, layout: tuple[str, ...], host: str, node1_prefix: list[str]):
    """Start node 1 (under ``node1_prefix``, e.g. ``ip netns exec NS``) and node 0, send the
    prompts to node 0; returns the output ids. Stops node 0 and checks node 1 follows."""
    base = free_port_block(host)
    common = [*layout, "--nnodes", "2", "--dist-init-addr", f"{host}:{base}"]
    node1_cmd = [sys.executable, "-m", "launch_server", "--model-path", model_path]
    node1_cmd += ["--dtype", "float32", "--max-total-tokens", "4096", *common, "--node-rank", "1"]
    node1 = subprocess.Popen(
        [*node1_prefix, *node1_cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    node0 = ServerProcess(model_path, *common, "--node-rank", "0")
    try:
        node0.wait_healthy(timeout=120)
        response = httpx.post(
            node0.url + "/generate",
            json={"input_ids": PROMPTS, "sampling_params": PARAMS},
            timeout=60.0,
        )
        response.raise_for_status()
        outputs = [out["output_ids"] for out in response.json()]
        node0.stop()
        try:
            node1.wait(FOLLOW_TIMEOUT_S)  # node 1 follows node 0's lifetime
        except subprocess.TimeoutExpired:
            pytest.fail(f"node 1 still running {FOLLOW_TIMEOUT_S} s after node 0 stopped")
        return outputs
    except BaseException:
        print(node0.log())
        if node1.poll() is None:
            node1.kill()
        print(node1.communicate(timeout=10)[0])
        raise
    finally:
        node0.stop()
        node0.remove_log()
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)


def test_two_nodes_on_loopback(qwen3_moe_path, reference):
    outputs = run_two_nodes(qwen3_moe_path, LAYOUTS["tp2"], "127.0.0.1", [])
    assert outputs == reference


@contextlib.contextmanager
def veth_namespace() -> Iterator[tuple[str, str, str]]:
    """A network namespace joined to this one by a veth pair: yields (namespace, this side's
    address, this side's link); the namespace side is .2 of the same /24 and has no other
    route. Removed on exit. Skips the test where none can be built."""
    tag = f"srt{os.getpid() % 100000}"
    ns, here, there = f"{tag}-ns", f"{tag}a", f"{tag}b"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    try:
        ip("netns", "add", ns)
        ip("link", "add", here, "type", "veth", "peer", "name", there)
        ip("link", "set", there, "netns", ns)
        ip("addr", "add", f"{subnet}.1/24", "dev", here)
        ip("link", "set", here, "up")
        ip("netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", there)
        ip("netns", "exec", ns, "ip", "link", "set", there, "up")
        ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        built = None
    except subprocess.CalledProcessError as e:
        built = e.stderr.decode().strip()
    try:
        if built is not None:
            pytest.skip(f"cannot build a veth namespace: {built}")
        yield ns, f"{subnet}.1", here
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def link_bytes(link: str) -> tuple[int, int]:
    """(sent, received) bytes of a network interface so far."""
    stats = Path("/sys/class/net", link, "statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


# The two nodes' rendezvous, ZMQ and all-to-all traffic, each way (about 155 kB measured);
# a link that only saw the kernel's own packets (neighbour discovery) carries a few hundred bytes.
MIN_LINK_BYTES = 64 * 1024


@pytest.mark.skipif(not netns_available(), reason="needs network namespaces (root and ip netns)")
def test_two_nodes_dp_attention_in_network_namespaces(qwen3_moe_path, reference):
    """DP attention with the all-to-all across the two nodes, node 1 in its own network
    namespace: its only way to node 0 is the veth pair, whose counters show the traffic."""
    layout = LAYOUTS["tp2-dp2-torch"]
    with veth_namespace() as (ns, host, link):
        before = link_bytes(link)
        outputs = run_two_nodes(qwen3_moe_path, layout, host, ["ip", "netns", "exec", ns])
        sent, received = (after - was for after, was in zip(link_bytes(link), before))
    assert outputs == reference
    assert min(sent, received) >= MIN_LINK_BYTES, (sent, received)
    leftover = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns not in leftover
