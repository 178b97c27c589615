#!/usr/bin/env python
"""A user-space WAN link on loopback: a TCP proxy that delays bytes and caps the rate, per direction.

    .venv/bin/python benchmarks/wan_link.py --listen 6001 --target 6000 --delay-ms 10 --rate-mbps 100
    .venv/bin/python benchmarks/wan_link.py --self-test [--delay-ms 5 --rate-mbps 40] [--json PATH]

or from Python (``rate_bps`` in bits per second, ``delay_s`` one way)::

    with LinkEmulator(0, target_port, delay_s=0.010, rate_bps=100e6) as link:
        connect to ("127.0.0.1", link.port) instead of the target

Every connection accepted on ``127.0.0.1:listen_port`` gets its own
connection to ``127.0.0.1:target_port``; bytes are relayed both ways. Any
TCP protocol works through it, ZeroMQ included (it only sees bytes).

The model (a pipe, per direction): the link is one serialiser of
``rate_bps`` followed by a fixed one-way ``delay_s``. Each chunk the proxy
reads (at most ``CHUNK_BYTES``, whatever one ``recv`` returns) departs at
``max(its arrival, the previous chunk's departure) + 8 * size / rate_bps``
and is delivered at ``departure + delay_s``. Chunks in flight overlap (this
is not stop-and-wait): a small message's one-way time is ``delay_s`` plus its
own serialisation, a bulk transfer's throughput is ``rate_bps``. The
serialiser of a direction is shared by all connections, as one link's
bandwidth would be. At most ``buffer_bytes`` per direction wait in the
proxy; beyond that it stops reading, and TCP's flow control pushes back on
the sender.

Limits (what this is not):
- no loss, reordering, jitter or duplication; no congestion control on the
  emulated path: both loopback legs have ~0 RTT and large windows, so a
  sender is never window-limited by the delay the way real TCP over a long
  fat network is during slow start or with small buffers;
- store-and-forward at ``recv`` granularity: a chunk is delivered whole;
- the sending kernel's and the proxy's buffers let a sender run ahead of the
  link by up to ``buffer_bytes`` plus socket buffers; measure at the receiver;
- timing is ``time.sleep`` on a shared machine: expect ~0.1 ms of error per
  chunk, and rates above a few hundred Mbit/s to be limited by Python's
  copying rather than by ``rate_bps``;
- loopback only, both ends: it refuses other addresses, so it never relays
  for the network.

``--self-test`` runs an echo server behind the link and prints (and with
``--json``, writes) the measured small-message round trip and bulk
throughput next to what the model predicts.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import json
import math
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
CHUNK_BYTES = 16 * 1024               # largest read; the link delivers chunks whole
DEFAULT_BUFFER_BYTES = 4 * 1024 * 1024   # per direction, held in the proxy before it stops reading
ACCEPT_POLL_S = 0.05                  # how often the accept loop checks for a stop
WAIT_SLICE_S = 0.05                   # longest single sleep while waiting for a chunk's delivery time
CONNECT_TIMEOUT_S = 5.0               # connecting to the target
JOIN_TIMEOUT_S = 2.0                  # per thread, when stopping


@dataclass(frozen=True)
class Shaping:
    """One direction of the link: one-way ``delay_s`` (seconds) and ``rate_bps`` (bits/s; None: no cap)."""

    delay_s: float = 0.0
    rate_bps: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.delay_s, (int, float)) and math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"delay_s must be a finite number of seconds >= 0, got {self.delay_s!r}")
        if self.rate_bps is not None and not (isinstance(self.rate_bps, (int, float))
                                              and math.isfinite(self.rate_bps) and self.rate_bps > 0):
            raise ValueError(f"rate_bps must be a finite number of bits per second > 0 (or None), "
                             f"got {self.rate_bps!r}")

    def serialisation_s(self, nbytes: int) -> float:
        """Seconds the link takes to put ``nbytes`` on the wire."""
        return 0.0 if self.rate_bps is None else 8.0 * nbytes / self.rate_bps


class _Serialiser:
    """The departure clock of one direction, shared by every connection."""

    def __init__(self, shaping: Shaping) -> None:
        self.shaping = shaping
        self._lock = threading.Lock()
        self._free_at = 0.0                # monotonic time the link finishes the last chunk given to it

    def deliver_at(self, arrival: float, nbytes: int) -> float:
        with self._lock:
            departure = max(arrival, self._free_at) + self.shaping.serialisation_s(nbytes)
            self._free_at = departure
        return departure + self.shaping.delay_s


class _Pipe:
    """One direction of one connection: a reader that stamps chunks, a writer that delivers them on time."""

    def __init__(self, conn: "_Connection", src: socket.socket, dst: socket.socket, serialiser: _Serialiser,
                 direction: str) -> None:
        self.conn, self.src, self.dst, self.serialiser, self.direction = conn, src, dst, serialiser, direction
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.cond = threading.Condition()

    def read_loop(self) -> None:
        link = self.conn.link
        limit = link.buffer_bytes
        while not self.conn.aborted:
            with self.cond:
                while self.queued >= limit and not self.conn.aborted:
                    self.cond.wait(WAIT_SLICE_S)
            try:
                data = self.src.recv(CHUNK_BYTES)
            except OSError:
                data = b""
            if self.conn.aborted:
                return
            due = self.serialiser.deliver_at(time.monotonic(), len(data))
            with self.cond:
                self.queue.append((due, data))        # b"": the end of this direction, delivered in order
                self.queued += len(data)
                self.cond.notify_all()
            if not data:
                return

    def write_loop(self) -> None:
        link = self.conn.link
        try:
            while True:
                with self.cond:
                    while not self.queue and not self.conn.aborted:
                        self.cond.wait(WAIT_SLICE_S)
                    if self.conn.aborted:
                        return
                    due, data = self.queue[0]
                while (wait := due - time.monotonic()) > 0:
                    if self.conn.aborted:
                        return
                    time.sleep(min(wait, WAIT_SLICE_S))
                if not data:
                    self.dst.shutdown(socket.SHUT_WR)   # pass the sender's end of stream on
                    return
                self.dst.sendall(data)
                link._count(self.direction, len(data))
                with self.cond:
                    self.queue.popleft()
                    self.queued -= len(data)
                    self.cond.notify_all()
        except OSError:
            self.conn.abort()
        finally:
            self.conn.pipe_done()


class _Connection:
    """A client connection and its connection to the target, relayed both ways."""

    def __init__(self, link: "LinkEmulator", client: socket.socket, target: socket.socket) -> None:
        self.link, self.sockets = link, (client, target)
        self.aborted = False
        self._lock = threading.Lock()
        self._open_pipes = 2
        pipes = (_Pipe(self, client, target, link._up, "up"), _Pipe(self, target, client, link._down, "down"))
        self.threads = [threading.Thread(target=fn, name=f"wan-link-{p.direction}-{n}", daemon=True)
                        for p in pipes for fn, n in ((p.read_loop, "read"), (p.write_loop, "write"))]
        for thread in self.threads:
            thread.start()

    def pipe_done(self) -> None:
        with self._lock:
            self._open_pipes -= 1
            last = self._open_pipes == 0
        if last:
            self.close()

    def abort(self) -> None:
        """Tear both sockets down (a reset or a stop): blocked reads and writes return."""
        self.aborted = True
        for sock in self.sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass                                  # already closed or never connected

    def close(self) -> None:
        self.abort()
        for sock in self.sockets:
            sock.close()
        self.link._forget(self)


def _loopback(host: str) -> str:
    try:
        loop = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loop = False
    if not loop:
        raise ValueError(f"the link emulator relays on loopback only; {host!r} is not a loopback address")
    return host


class LinkEmulator:
    """A TCP proxy on ``127.0.0.1:listen_port`` (0: a free port, see ``port``) to ``127.0.0.1:target_port``.

    ``delay_s`` (one way, seconds) and ``rate_bps`` (bits per second, None:
    no cap) shape the client-to-target direction ("up") and, unless
    ``reverse`` says otherwise, the target-to-client one ("down"); the model
    is in the module docstring. Starts on ``start()`` or ``with``; ``close()``
    resets every relayed connection and joins the threads. Raises
    ``ValueError`` for a bad delay, rate, buffer or a non-loopback host and
    ``OSError`` if the port cannot be bound.
    """

    def __init__(self, listen_port: int, target_port: int, delay_s: float = 0.0, rate_bps: float | None = None,
                 reverse: Shaping | None = None, buffer_bytes: int = DEFAULT_BUFFER_BYTES,
                 target_host: str = LOOPBACK) -> None:
        if not isinstance(buffer_bytes, int) or buffer_bytes < CHUNK_BYTES:
            raise ValueError(f"buffer_bytes must be an integer >= {CHUNK_BYTES}, got {buffer_bytes!r}")
        for name, port in (("listen_port", listen_port), ("target_port", target_port)):
            if not isinstance(port, int) or not 0 <= port <= 65535 or (name == "target_port" and port == 0):
                raise ValueError(f"{name} must be a TCP port number, got {port!r}")
        up = Shaping(delay_s, rate_bps)
        self.up, self.down = up, reverse or up
        self.buffer_bytes = buffer_bytes
        self.target = (_loopback(target_host), target_port)
        self._listen_port = listen_port
        self._up, self._down = _Serialiser(self.up), _Serialiser(self.down)
        self._listener: socket.socket | None = None
        self._accepter: threading.Thread | None = None
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._connections: set[_Connection] = set()
        self._threads: list[threading.Thread] = []
        self._stats = {"connections": 0, "refused": 0, "bytes_up": 0, "bytes_down": 0}

    @property
    def port(self) -> int:
        """The port clients connect to (known once started)."""
        if self._listener is None:
            raise RuntimeError("the link emulator is not started")
        return self._listener.getsockname()[1]

    def start(self) -> "LinkEmulator":
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((LOOPBACK, self._listen_port))
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        listener.settimeout(ACCEPT_POLL_S)
        self._listener = listener
        self._accepter = threading.Thread(target=self._accept_loop, name="wan-link-accept", daemon=True)
        self._accepter.start()
        return self

    def __enter__(self) -> "LinkEmulator":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[str, int]:
        """Connections accepted, connections whose target refused, and bytes delivered each way.

        A chunk is counted just after it was handed to the receiving socket: a
        reader may see its bytes a moment before the count; after ``close`` the
        counts are final.
        """
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Stop accepting, reset every connection, join the threads (each within ``JOIN_TIMEOUT_S``)."""
        self._stopping.set()
        if self._accepter is not None:
            self._accepter.join(JOIN_TIMEOUT_S)
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            conn.abort()
        for conn in connections:
            for thread in conn.threads:
                thread.join(JOIN_TIMEOUT_S)
            conn.close()
        if self._listener is not None:
            self._listener.close()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return                                # the listener was closed
            client.setblocking(True)
            try:
                target = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
                target.settimeout(None)
            except OSError:
                client.close()                        # the client sees its connection end
                with self._lock:
                    self._stats["refused"] += 1
                continue
            for sock in (client, target):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)   # the link adds the only delay
            with self._lock:
                self._stats["connections"] += 1
                self._connections.add(_Connection(self, client, target))

    def _count(self, direction: str, nbytes: int) -> None:
        with self._lock:
            self._stats[f"bytes_{direction}"] += nbytes

    def _forget(self, conn: _Connection) -> None:
        with self._lock:
            self._connections.discard(conn)


# ---------------------------------------------------------------- self-test

def _echo_server() -> tuple[socket.socket, threading.Thread]:
    """A loopback server that echoes small messages and swallows bulk ones (one connection at a time)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((LOOPBACK, 0))
    server.listen(4)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    while data := conn.recv(CHUNK_BYTES):
                        if data[:1] == b"e":         # echo requests start with "e"; bulk bytes are zeros
                            conn.sendall(data)
                        elif data[-1:] == b"!":      # the bulk transfer's last byte: acknowledge
                            conn.sendall(b"k")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, name="wan-link-echo", daemon=True)
    thread.start()
    return server, thread


def _close_listener(listener: socket.socket) -> None:
    """Close a listening socket, waking a thread blocked in its ``accept`` (close alone does not, on Linux)."""
    try:
        listener.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    listener.close()


def _recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionError(f"connection ended after {len(data)} of {count} bytes")
        data += chunk
    return data


def measure(delay_s: float, rate_bps: float | None, bulk_bytes: int = 1 << 20, pings: int = 5,
            timeout_s: float = 30.0) -> dict[str, Any]:
    """Round trips of an 8-byte message and the throughput of ``bulk_bytes`` through a fresh link.

    Returns seconds and bits per second, measured and as the model predicts;
    the bulk throughput is timed from the first byte sent to the receiver's
    one-byte acknowledgement, minus the model's round-trip delay.
    """
    server, thread = _echo_server()
    try:
        with LinkEmulator(0, server.getsockname()[1], delay_s=delay_s, rate_bps=rate_bps) as link:
            with socket.create_connection((LOOPBACK, link.port), timeout=timeout_s) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                rtts = []
                for _ in range(pings):
                    start = time.perf_counter()
                    sock.sendall(b"echo1234")
                    _recv_exactly(sock, 8)
                    rtts.append(time.perf_counter() - start)
                payload = bytes(bulk_bytes - 1) + b"!"
                start = time.perf_counter()
                sock.sendall(payload)
                _recv_exactly(sock, 1)
                elapsed = time.perf_counter() - start
            stats = link.stats()
    finally:
        _close_listener(server)
        thread.join(JOIN_TIMEOUT_S)
    shaping = Shaping(delay_s, rate_bps)
    transfer_s = max(elapsed - 2 * delay_s - shaping.serialisation_s(1), 1e-9)
    return {"delay_s": delay_s, "rate_bps": rate_bps, "bulk_bytes": bulk_bytes,
            "rtt_s_min": min(rtts), "rtt_s_model": 2 * delay_s + 2 * shaping.serialisation_s(8),
            "bulk_s": elapsed, "bulk_bps": 8 * bulk_bytes / transfer_s, "stats": stats}


# ---------------------------------------------------------------- command line

def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=int, default=0, help="port on 127.0.0.1 to accept on (0: any free port)")
    parser.add_argument("--target", type=int, help="port on 127.0.0.1 to relay to")
    parser.add_argument("--delay-ms", type=float, default=10.0, help="one-way delay, milliseconds (default 10)")
    parser.add_argument("--rate-mbps", type=float, default=100.0,
                        help="rate cap each way, Mbit/s; 0 for none (default 100)")
    parser.add_argument("--reverse-delay-ms", type=float, help="target-to-client delay if different")
    parser.add_argument("--reverse-rate-mbps", type=float, help="target-to-client rate if different (0: none)")
    parser.add_argument("--buffer-kib", type=int, default=DEFAULT_BUFFER_BYTES // 1024,
                        help="bytes held per direction before the proxy stops reading, KiB")
    parser.add_argument("--max-seconds", type=float, help="stop by itself after this long")
    parser.add_argument("--self-test", action="store_true",
                        help="measure a round trip and a bulk transfer through the link, then exit")
    parser.add_argument("--bulk-kib", type=int, default=1024, help="--self-test's bulk transfer, KiB")
    parser.add_argument("--json", type=Path, help="--self-test: write the figures here too")
    args = parser.parse_args(argv)
    if not args.self_test and args.target is None:
        parser.error("--target PORT is needed (or --self-test)")
    return args


def _rate(mbps: float | None) -> float | None:
    return None if not mbps else mbps * 1e6


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    try:
        if args.self_test:
            figures = measure(args.delay_ms / 1000, _rate(args.rate_mbps), bulk_bytes=args.bulk_kib * 1024)
            text = json.dumps(figures, indent=2)
            print(text)
            if args.json:
                args.json.write_text(text)
            return 0
        reverse = None
        if args.reverse_delay_ms is not None or args.reverse_rate_mbps is not None:
            reverse = Shaping((args.reverse_delay_ms if args.reverse_delay_ms is not None else args.delay_ms) / 1000,
                              _rate(args.reverse_rate_mbps if args.reverse_rate_mbps is not None else args.rate_mbps))
        link = LinkEmulator(args.listen, args.target, args.delay_ms / 1000, _rate(args.rate_mbps), reverse=reverse,
                            buffer_bytes=args.buffer_kib * 1024)
    except ValueError as e:
        print(f"wan_link.py: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()                                    # the loop below acts on it

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    deadline = math.inf if args.max_seconds is None else time.monotonic() + args.max_seconds
    with link:
        print(f"wan_link.py: 127.0.0.1:{link.port} -> 127.0.0.1:{args.target}, up {link.up}, down {link.down}",
              flush=True)
        while not stop.is_set() and time.monotonic() < deadline:
            stop.wait(0.1)
        print(f"wan_link.py: stopping; {json.dumps(link.stats())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
