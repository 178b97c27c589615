"""A small TCP relay that impairs a link: fixed latency each way, and one abrupt cut.

Used by ``tests/test_netns.py`` in place of ``tc netem`` (not available on
every kernel). Run it as its own process, e.g. inside a network namespace::

    python tests/tcp_relay.py --listen 10.231.7.2:6001 --target 10.231.7.2:6000 \
        --delay-ms 20 --cut-after-bytes 20000 --report relay.json --ready-file relay.ready

Every accepted connection gets its own connection to ``--target``; bytes are
forwarded both ways, each chunk held back ``--delay-ms`` after it arrived
(a latency, not a bandwidth limit: chunks in flight overlap). Once the total
number of bytes received, both directions and all connections together,
reaches ``--cut-after-bytes``, the chunk that crossed the threshold is
dropped and every open connection is reset on both sides (SO_LINGER 0, so
the peers see an RST). That happens once; later connections are relayed
normally.

``--report`` is rewritten (atomically) after every connection and cut, and at
exit: ``{"connections", "open", "cuts", "cut_at_bytes", "bytes_up",
"bytes_down"}`` (up = client to target). The relay stops on SIGTERM or
SIGINT, or by itself after ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path

CHUNK = 65536


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


class Relay:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.delay = args.delay_ms / 1000.0
        self.connections = 0
        self.cuts = 0
        self.cut_at_bytes: int | None = None
        self.bytes = {"up": 0, "down": 0}
        self.open: dict[int, "Connection"] = {}

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def report(self) -> None:
        if self.args.report is None:
            return
        data = {"connections": self.connections, "open": len(self.open), "cuts": self.cuts,
                "cut_at_bytes": self.cut_at_bytes, "bytes_up": self.bytes["up"], "bytes_down": self.bytes["down"]}
        tmp = self.args.report.with_name(self.args.report.name + ".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.args.report)

    def log(self, text: str) -> None:
        print(f"relay: {text}", flush=True)

    def received(self, direction: str, count: int) -> bool:
        """Count ``count`` bytes; True when they trigger the cut (the caller drops them)."""
        self.bytes[direction] += count
        limit = self.args.cut_after_bytes
        if limit is not None and self.cuts == 0 and self.bytes["up"] + self.bytes["down"] >= limit:
            self.cuts = 1
            self.cut_at_bytes = self.bytes["up"] + self.bytes["down"]
            self.log(f"cutting {len(self.open)} connection(s) after {self.cut_at_bytes} bytes")
            for conn in list(self.open.values()):
                conn.reset()
            self.report()
            return True
        return False

    # -- serving -------------------------------------------------------------------------------------------
    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            target_r, target_w = await asyncio.wait_for(asyncio.open_connection(*self.args.target), 5.0)
        except (OSError, asyncio.TimeoutError) as error:
            self.log(f"connection {number}: target {self.args.target} unreachable: {error}")
            client_w.transport.abort()
            self.report()
            return
        conn = Connection(self, number, client_w, target_w)
        self.open[number] = conn
        self.log(f"connection {number} from {client_w.get_extra_info('peername')}")
        self.report()
        try:
            await asyncio.gather(conn.pump(client_r, target_w, "up"), conn.pump(target_r, client_w, "down"))
        finally:
            self.open.pop(number, None)
            conn.close()
            self.log(f"connection {number} closed")
            self.report()

    async def main(self) -> None:
        loop = asyncio.get_running_loop()
        stopped = asyncio.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stopped.set)
        host, port = self.args.listen
        server = await asyncio.start_server(self.handle, host, port, reuse_address=True)
        self.report()
        if self.args.ready_file is not None:
            self.args.ready_file.write_text(f"{host}:{port}\n")
        self.log(f"listening on {host}:{port}, forwarding to {self.args.target[0]}:{self.args.target[1]}, "
                 f"delay {self.args.delay_ms:g} ms, cut after {self.args.cut_after_bytes} bytes")
        try:
            await asyncio.wait_for(stopped.wait(), self.args.max_seconds)
        except asyncio.TimeoutError:
            self.log(f"stopping after --max-seconds {self.args.max_seconds:g}")
        server.close()
        for conn in list(self.open.values()):
            conn.reset()
        await asyncio.sleep(0)
        self.report()


class Connection:
    """One relayed client connection and its connection to the target."""

    def __init__(self, relay: Relay, number: int, client_w: asyncio.StreamWriter,
                 target_w: asyncio.StreamWriter) -> None:
        self.relay = relay
        self.number = number
        self.writers = (client_w, target_w)
        self.dead = False

    def reset(self) -> None:
        """Abort both sides at once; SO_LINGER 0 makes the kernel send an RST."""
        if self.dead:
            return
        self.dead = True
        for writer in self.writers:
            sock = writer.get_extra_info("socket")
            try:
                if sock is not None:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
            writer.transport.abort()

    def close(self) -> None:
        if not self.dead:
            self.dead = True
            for writer in self.writers:
                writer.transport.abort()

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Forward ``reader`` to ``writer``, each chunk ``delay`` after it arrived; in order."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None or self.dead:
                    break
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while not self.dead:
                data = await reader.read(CHUNK)
                if not data:
                    break
                if self.relay.received(direction, len(data)):
                    break                               # the chunk that triggered the cut is lost
                queue.put_nowait((loop.time() + self.relay.delay, data))
        except (OSError, asyncio.IncompleteReadError):
            pass
        queue.put_nowait((loop.time() + self.relay.delay, None))
        try:
            await sender
        except (OSError, ConnectionError):
            pass
        self.close()                                    # one side gone: take the other down too


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", type=_host_port, required=True, metavar="HOST:PORT")
    p.add_argument("--target", type=_host_port, required=True, metavar="HOST:PORT")
    p.add_argument("--delay-ms", type=float, default=0.0, help="latency added to every chunk, each way")
    p.add_argument("--cut-after-bytes", type=int, metavar="N",
                   help="once, after N bytes in total, reset every open connection")
    p.add_argument("--report", type=Path, metavar="PATH", help="JSON counters, rewritten on every event")
    p.add_argument("--ready-file", type=Path, metavar="PATH", help="written once listening")
    p.add_argument("--max-seconds", type=float, default=120.0, help="exit by itself after this long")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    relay = Relay(parse_args(argv))
    asyncio.run(relay.main())
    return 0


if __name__ == "__main__":
    sys.exit(main())
