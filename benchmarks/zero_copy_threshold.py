"""Where pyzmq's zero-copy send starts to pay: round trips of one raw frame, copy=True vs copy=False.

Usage: python benchmarks/zero_copy_threshold.py [--transport tcp|ipc] [--rounds N] [--repeats N]
       [--sizes BYTES,...] [--json PATH]

Both variants run alternately in one process pair on loopback, so machine
noise hits them alike; the printed ratio (zero-copy time / copy time) below 1
means zero-copy is faster at that size. distgrad's transport.ZERO_COPY_MIN_BYTES
is chosen from this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]


ECHO_WAIT_MS = 10_000        # the echo side exits after this long without a request; a round trip fails after it
STOP_WAIT_S = 5.0            # after "stop", how long the echo process may take to exit before it is killed


def serve(endpoint: str) -> None:
    """Echo every frame back until "stop" or ``ECHO_WAIT_MS`` of silence (connects: the timing side binds)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.connect(endpoint)
    try:
        while sock.poll(ECHO_WAIT_MS):
            parts = sock.recv_multipart(copy=False)
            if parts[1].bytes == b"stop":
                return
            sock.send_multipart(parts, copy=False)
    finally:
        sock.close(0)
        ctx.term()


def measure(sock: zmq.Socket, sizes: list[int], rounds: int, repeats: int) -> dict[int, dict[str, float]]:
    """Median microseconds per round trip of one frame of each size, copied and zero-copy, alternately."""
    out = {}
    for size in sizes:
        frame = np.ones(max(1, size // 4), np.float32)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(repeats):
            for copy in (True, False):
                start = time.perf_counter()
                for _ in range(rounds):
                    sock.send(frame, copy=copy)
                    if not sock.poll(ECHO_WAIT_MS):
                        raise SystemExit(f"no echo within {ECHO_WAIT_MS} ms")
                    sock.recv(copy=False)
                times[copy].append((time.perf_counter() - start) / rounds * 1e6)
        c, z = statistics.median(times[True]), statistics.median(times[False])
        out[size] = {"copy_us": c, "zero_copy_us": z, "ratio": z / c}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    parser.add_argument("--rounds", type=int, default=400, help="round trips per timing (default 400)")
    parser.add_argument("--repeats", type=int, default=5, help="timings per variant and size (default 5)")
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="comma-separated frame sizes in bytes (default %(default)s)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the figures here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    if args.rounds < 1 or args.repeats < 1 or not sizes or min(sizes) < 1:
        parser.error("--rounds and --repeats must be >= 1, --sizes positive byte counts")
    with tempfile.TemporaryDirectory(prefix="zc-") as tmp:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        server = None
        try:
            if args.transport == "tcp":
                endpoint = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
            else:
                endpoint = f"ipc://{tmp}/zc.sock"
                sock.bind(endpoint)
            server = subprocess.Popen([sys.executable, __file__, "--serve", endpoint], stdin=subprocess.DEVNULL)
            sock.send(b"warm-up")            # waits for the echo process to start and connect
            if not sock.poll(ECHO_WAIT_MS):
                raise SystemExit(f"the echo process did not answer within {ECHO_WAIT_MS} ms")
            sock.recv()
            results = measure(sock, sizes, args.rounds, args.repeats)
            sock.send(b"stop")
        finally:
            if server is not None:
                try:
                    server.wait(STOP_WAIT_S)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait(STOP_WAIT_S)
            sock.close(0)
            ctx.term()
    print(f"{'size':>10} {'copy us':>10} {'zero-copy us':>13} {'ratio':>7}")
    for size, r in results.items():
        print(f"{size:>10} {r['copy_us']:>10.1f} {r['zero_copy_us']:>13.1f} {r['ratio']:>7.2f}")
    if args.json:
        args.json.write_text(json.dumps({"transport": args.transport, "rounds": args.rounds, "repeats": args.repeats,
                                         "sizes": {str(k): v for k, v in results.items()}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
