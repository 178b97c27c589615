"""benchmarks/wan_link.py measured through itself: delay and rate cap hold, ZeroMQ passes through.

Only what load cannot break is asserted: the bytes arrive whole and in order,
and the link is never faster than its model (a round trip takes at least twice
the one-way delay, a transfer at least its size over the rate cap). A busy
machine only makes things slower, so these hold on any machine; how close the
link comes to its model (round trip near 2 x delay, throughput near the cap) is
a measurement, made by ``benchmarks/wan_link.py --self-test``, not asserted
here. Every server and link is closed in ``finally`` / ``with``; every receive
has a timeout.
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import zmq

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "wan_link.py"
_spec = importlib.util.spec_from_file_location("wan_link", PATH)
wan_link = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("wan_link", wan_link)        # dataclasses look their module up there
_spec.loader.exec_module(wan_link)

RECV_TIMEOUT_S = 5.0
# A hang guard, not a speed check: 1 MiB at 40 Mbit/s takes 0.21 s; 30 s is over 100 times that.
DELIVERY_DEADLINE_S = 30.0


class Server:
    """A loopback server in a thread: echoes every chunk when ``echo``, else counts bytes and stamps the last."""

    def __init__(self, echo: bool) -> None:
        self.echo, self.received, self.last_at = echo, 0, 0.0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.sock.accept()
        except OSError:
            return
        with conn:
            conn.settimeout(RECV_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                while data := conn.recv(65536):
                    self.received += len(data)
                    self.last_at = time.perf_counter()
                    if self.echo:
                        conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(RECV_TIMEOUT_S)


@pytest.fixture
def echo_server() -> Iterator[Server]:
    server = Server(echo=True)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def sink_server() -> Iterator[Server]:
    server = Server(echo=False)
    try:
        yield server
    finally:
        server.close()


def test_small_messages_come_back_whole_and_no_sooner_than_twice_the_delay(echo_server):
    delay = 0.02
    with wan_link.LinkEmulator(0, echo_server.port, delay_s=delay, rate_bps=100e6) as link:
        with socket.create_connection(("127.0.0.1", link.port), timeout=RECV_TIMEOUT_S) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts = []
            for _ in range(3):
                start = time.perf_counter()
                sock.sendall(b"ping")
                assert sock.recv(16) == b"ping"
                rtts.append(time.perf_counter() - start)
    assert link.stats()["bytes_up"] == link.stats()["bytes_down"] == 12      # final once closed (threads joined)
    assert min(rtts) >= 2 * delay, rtts          # the delay is applied each way (load only adds to it)


def test_a_bulk_transfer_arrives_whole_and_no_faster_than_the_cap(sink_server):
    rate, size = 40e6, 1 << 20                     # 1 MiB at 40 Mbit/s: 0.21 s
    with wan_link.LinkEmulator(0, sink_server.port, delay_s=0.005, rate_bps=rate) as link:
        with socket.create_connection(("127.0.0.1", link.port), timeout=RECV_TIMEOUT_S) as sock:
            start = time.perf_counter()
            sock.sendall(bytes(size))
            deadline = start + DELIVERY_DEADLINE_S
            while sink_server.received < size and time.perf_counter() < deadline:
                time.sleep(0.002)
    assert sink_server.received == size
    assert link.stats()["bytes_up"] == size
    throughput = 8 * size / (sink_server.last_at - start)
    assert throughput <= rate, f"{throughput / 1e6:.1f} Mbit/s through a {rate / 1e6:.0f} Mbit/s link"


def test_zeromq_passes_through(zmq_ctx):
    delay = 0.01
    rep = zmq_ctx.socket(zmq.REP)
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    with wan_link.LinkEmulator(0, port, delay_s=delay) as link:
        req = zmq_ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{link.port}")
        rtts = []
        for i in range(3):
            start = time.perf_counter()
            req.send(b"x%d" % i)
            assert rep.poll(RECV_TIMEOUT_S * 1000), "the request did not arrive through the link"
            rep.send(rep.recv())
            assert req.poll(RECV_TIMEOUT_S * 1000), "the reply did not arrive through the link"
            assert req.recv() == b"x%d" % i
            rtts.append(time.perf_counter() - start)
    assert min(rtts) >= 2 * delay, rtts


@pytest.mark.parametrize("kwargs, message", [
    ({"delay_s": -0.1}, "delay_s must be"),
    ({"rate_bps": 0}, "rate_bps must be"),
    ({"rate_bps": float("inf")}, "rate_bps must be"),
    ({"target_host": "10.0.0.1"}, "loopback only"),
    ({"buffer_bytes": 10}, "buffer_bytes must be"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        wan_link.LinkEmulator(0, 6000, **kwargs)
