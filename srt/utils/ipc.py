"""ZMQ endpoints between srt's processes and small typed wrappers around them.

Messages are the dataclasses of ``srt.managers.io_struct``, pickled. PUSH/PULL sockets carry one
direction each; a PULL socket may have several pushers (e.g. detokenizer and scheduler replies
both reach the tokenizer manager).
"""

from __future__ import annotations

import os
import socket
import tempfile
from dataclasses import dataclass, field

import zmq
import zmq.asyncio


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class PortArgs:
    """The IPC endpoints of one server instance (a private temporary directory)."""

    ipc_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="srt-ipc-"))
    # torch.distributed rendezvous of the rank processes (tcp://127.0.0.1:PORT)
    dist_init_port: int = field(default_factory=free_port)

    @property
    def dist_init_method(self) -> str:
        return f"tcp://127.0.0.1:{self.dist_init_port}"

    def _ipc(self, name: str) -> str:
        return f"ipc://{os.path.join(self.ipc_dir, name)}"

    @property
    def scheduler_input(self) -> str:  # tokenizer manager → scheduler (attention-TP rank 0)
        return self._ipc("scheduler_input")

    @property
    def detokenizer_input(self) -> str:  # scheduler → detokenizer
        return self._ipc("detokenizer_input")

    @property
    def tokenizer_input(self) -> str:  # detokenizer and scheduler replies → tokenizer manager
        return self._ipc("tokenizer_input")


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
