"""Network helpers for multi-node runs."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct

logger = logging.getLogger(__name__)
_SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """IPv4 address of interface ``name`` (Linux), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_towards(host: str) -> str | None:
    """The local interface whose address is the source of packets to ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))  # UDP: no packet is sent
        local = s.getsockname()[0]
    for _, name in socket.if_nameindex():
        if interface_address(name) == local:
            return name
    return None


def set_socket_ifname_for(host: str) -> None:
    """gloo (and NCCL's bootstrap) bind to the address the machine's hostname resolves to,
    which on a multi-homed node or in a network namespace is often not on the path to the
    other nodes. Unless the user chose (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME), use the
    interface that routes to node 0."""
    name = interface_towards(host)
    if name is None:
        logger.warning("no local interface routes to %s; gloo picks its default", host)
        return
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var not in os.environ:
            os.environ[var] = name
            logger.info("%s=%s (the interface towards %s)", var, name, host)
