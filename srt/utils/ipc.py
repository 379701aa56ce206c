"""ZMQ endpoints between srt's processes and small typed wrappers around them.

Messages are the dataclasses of ``srt.managers.io_struct``, pickled. PUSH/PULL sockets carry one
direction each; a PULL socket may have several pushers (e.g. detokenizer and scheduler replies
both reach the tokenizer manager).
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass

import zmq
import zmq.asyncio


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PortArgs:
    """The endpoints of one server instance.

    One node: IPC sockets in a private temporary directory, and a free loopback port for the
    torch.distributed rendezvous. Several nodes (``--dist-init-addr HOST:PORT``): everything is
    TCP on node 0's HOST, the rendezvous on PORT and the ZMQ endpoints on the next ports, so
    every node derives the same endpoints from the flags alone. The node-0 side binds (the
    tokenizer manager, detokenizer and DP controller live there); schedulers connect, wherever
    they run."""

    ipc_dir: str | None
    dist_init_method: str
    tokenizer_input: str  # detokenizer and scheduler replies → tokenizer manager
    detokenizer_input: str  # schedulers → detokenizer
    controller_input: str  # tokenizer manager → DP controller (dp_size > 1)
    controller_load: str  # entry schedulers' load reports → DP controller
    scheduler_inputs: tuple[str, ...]  # → entry rank of each attention-DP group

    @classmethod
    def init_new(cls, server_args) -> PortArgs:
        dp = server_args.dp_size if server_args.enable_dp_attention else 1
        if server_args.dist_init_addr:
            host, _, port = server_args.dist_init_addr.rpartition(":")
            base = int(port)
            tcp = lambda k: f"tcp://{host}:{base + k}"  # noqa: E731
            return cls(
                None, f"tcp://{host}:{base}", tcp(1), tcp(2), tcp(3), tcp(4),
                tuple(tcp(5 + d) for d in range(dp)),
            )  # fmt: skip
        ipc_dir = tempfile.mkdtemp(prefix="srt-ipc-")
        ipc = lambda name: f"ipc://{os.path.join(ipc_dir, name)}"  # noqa: E731
        return cls(
            ipc_dir,
            f"tcp://127.0.0.1:{free_port()}",
            ipc("tokenizer_input"),
            ipc("detokenizer_input"),
            ipc("controller_input"),
            ipc("controller_load"),
            tuple(ipc(f"scheduler_input_{d}") for d in range(dp)),
        )

    @property
    def dist_init_host(self) -> str:
        return self.dist_init_method.removeprefix("tcp://").rpartition(":")[0]


def _socket(context: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.setsockopt(zmq.RCVHWM, 0)
    else:
        sock.setsockopt(zmq.SNDHWM, 0)
    (sock.bind if bind else sock.connect)(endpoint)
    return sock


class Sender:
    def __init__(self, context: zmq.Context, endpoint: str, bind: bool = False):
        self.socket = _socket(context, zmq.PUSH, endpoint, bind)

    def send(self, message: object) -> None:
        self.socket.send_pyobj(message)


class Receiver:
    """Blocking or polling receiver (scheduler, detokenizer)."""

    def __init__(self, context: zmq.Context, endpoint: str, bind: bool = True):
        self.socket = _socket(context, zmq.PULL, endpoint, bind)

    def recv(self, timeout_ms: int | None = None) -> object | None:
        """One message; None when ``timeout_ms`` passes first (0: never wait)."""
        if timeout_ms is not None and not self.socket.poll(timeout_ms):
            return None
        return self.socket.recv_pyobj()

    def recv_all(self) -> list[object]:
        out = []
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out


class AsyncReceiver:
    """asyncio receiver (tokenizer manager)."""

    def __init__(self, context: zmq.asyncio.Context, endpoint: str, bind: bool = True):
        self.socket = _socket(context, zmq.PULL, endpoint, bind)

    async def recv(self) -> object:
        return await self.socket.recv_pyobj()
