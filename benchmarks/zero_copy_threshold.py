"""Where pyzmq's zero-copy send starts to pay: round trips of one raw frame, copy=True vs copy=False.

Usage: python benchmarks/zero_copy_threshold.py [--transport tcp|ipc] [--rounds N]

Both variants run alternately in one process pair on loopback, so machine
noise hits them alike; the printed ratio (zero-copy time / copy time) below 1
means zero-copy is faster at that size. distgrad's transport.ZERO_COPY_MIN_BYTES
is chosen from this.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20]


def serve(endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        if not sock.poll(10_000):
            return
        parts = sock.recv_multipart(copy=False)
        if parts[1].bytes == b"stop":
            return
        sock.send_multipart(parts, copy=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["tcp", "ipc"], default="tcp")
    parser.add_argument("--rounds", type=int, default=400)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    tmp = tempfile.mkdtemp(prefix="zc-")
    endpoint = "tcp://127.0.0.1:5611" if args.transport == "tcp" else f"ipc://{tmp}/zc.sock"
    server = subprocess.Popen([sys.executable, __file__, "--serve", endpoint])
    try:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(endpoint)
        print(f"{'size':>10} {'copy us':>10} {'zero-copy us':>13} {'ratio':>7}")
        for size in SIZES:
            frame = np.ones(size // 4, np.float32)
            times = {True: [], False: []}
            for _ in range(5):
                for copy in (True, False):
                    start = time.perf_counter()
                    for _ in range(args.rounds):
                        sock.send(frame, copy=copy)
                        if not sock.poll(10_000):
                            raise SystemExit("no echo within 10 s")
                        sock.recv(copy=False)
                    times[copy].append((time.perf_counter() - start) / args.rounds * 1e6)
            c, z = statistics.median(times[True]), statistics.median(times[False])
            print(f"{size:>10} {c:>10.1f} {z:>13.1f} {z / c:>7.2f}")
        sock.send(b"stop")
    finally:
        time.sleep(0.2)
        server.kill()
        server.wait(5)
        Path(tmp).rmdir() if not any(Path(tmp).iterdir()) else None


if __name__ == "__main__":
    main()
