"""A free TCP port for a process group's rendezvous on this machine.

The usual way, binding port 0 and closing the socket, hands back a port of the kernel's
ephemeral range: the range it also draws from for every outgoing connection. Between the check
and the rendezvous server's own bind, another process's connection (a data loader, a second
job's gloo pairs) can be given that very port, and the server fails with "address already in
use". A port below the ephemeral range is never handed out that way, so only a process that
binds it on purpose can take it.
"""

from __future__ import annotations

import random
import socket

EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST = 10000
"""The lowest port chosen: below it lie the registered ports of common services."""
TRIES = 100


def ephemeral_start(path: str = EPHEMERAL_RANGE) -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be
    read: 32768)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(rng: random.Random | None = None) -> int:
    """A port that is free now, chosen at random below the ephemeral range where that range
    leaves room for one (else any free port the kernel gives)."""
    rng = rng or random.SystemRandom()  # never the seeded global generator
    top = ephemeral_start()
    if top - LOWEST >= 1000:
        for _ in range(TRIES):
            port = rng.randrange(LOWEST, top)
            if _bindable(port):
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
