"""The rendezvous port: free, and outside the kernel's ephemeral range, from which another
process's outgoing connection could take it between the check and the bind."""

import random
import socket

from moe.training import ports


def test_the_port_is_free_and_below_the_ephemeral_range():
    start = ports.ephemeral_start()
    for _ in range(20):
        port = ports.free_port()
        assert ports.LOWEST <= port < start
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: binding it works


def test_a_taken_port_is_never_returned(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    monkeypatch.setattr(ports, "ephemeral_start", lambda: 65000)
    monkeypatch.setattr(ports, "LOWEST", taken)

    class FirstTheTakenOne(random.Random):
        calls = 0

        def randrange(self, lo, hi):
            self.calls += 1
            return taken if self.calls == 1 else super().randrange(lo, hi)

    try:
        rng = FirstTheTakenOne(0)
        assert ports.free_port(rng) != taken and rng.calls >= 2
    finally:
        held.close()


def test_the_range_is_read_from_the_kernel_file_or_defaults(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert ports.ephemeral_start(str(f)) == 40000
    f.write_text("garbage")
    assert ports.ephemeral_start(str(f)) == 32768
    assert ports.ephemeral_start(str(tmp_path / "missing")) == 32768


def test_without_room_below_the_range_any_free_port_is_taken(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_start", lambda: ports.LOWEST + 10)
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
