#!/usr/bin/env python
"""What a wake-up costs the Python that runs after it: the same pure-Python work, hot and after each message.

    .venv/bin/python benchmarks/wake_cost.py [--work-us 50] [--round-trips 8000] [--repeats 2]
        [--modes block,spin,spin-yield] [--json PATH]

Not part of the test suite. No distgrad code runs here: two processes (this script and a copy of it as the
echoing side) play a lockstep ping-pong over tcp 127.0.0.1 with pyzmq (a DEALER and a ROUTER, one 4-byte
frame each way), and each side runs a fixed piece of pure-Python work (a dictionary loop, its iteration
count calibrated once to about ``--work-us`` in a hot loop) between receiving a message and sending the
next, as a stage's per-message logic does. Per mode it prints the round trip, each side's work in the
ping-pong (median of ``time.thread_time`` around the work: CPU time, so time the thread spent descheduled
is not in it) and the same work timed in a hot loop in the same process, and their ratio: the penalty the
Python after a wake-up pays on this machine (cold caches, a core woken from idle). The hot runs are
interleaved with the ping-pong (after every ``BLOCK`` round trips, each side runs the work ``BLOCK`` times
back to back before it sends or answers), so both figures come from the same seconds: on a shared virtual
machine the speed of a core moves by half from one second to the next, and a hot loop timed before or
after the ping-pong measures another machine.

Modes (how each side waits for its next message):

- ``block``: a blocking receive (what a stage does by default);
- ``spin``: polls the socket's events without sleeping until the message is there, then receives
  (what ``--spin-us`` does, without its bound);
- ``spin-yield``: the same with ``os.sched_yield()`` between polls, so a runnable thread on the same core
  (ZeroMQ's I/O threads) is not kept waiting by the spin.

Each repeat runs every mode once, in turn, so the modes of one repeat compare in the same minute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import zmq

MODES = ("block", "spin", "spin-yield")
WARM_ROUND_TRIPS = 500          # the first round trips connect and fill caches; not counted
BLOCK = 100                     # round trips between two hot blocks, and the runs of the work in a hot block
WAIT_S = 10.0                   # a bound on every wait: a peer that is gone is an error, not a hang
CALIBRATION_RUNS = 200


def work(iterations: int) -> int:
    """A fixed piece of pure-Python work (a loop of dictionary stores, as protocol logic does)."""
    table: dict[int, int] = {}
    for i in range(iterations):
        table[i & 7] = i
    return len(table)


def calibrate(work_us: float) -> int:
    """The iteration count of ``work`` that takes about ``work_us`` of CPU in a hot loop."""
    iterations = 1000
    for _ in range(CALIBRATION_RUNS):       # warm: the interpreter specialises the loop over its first runs
        work(iterations)
    for _ in range(3):
        samples = []
        for _ in range(CALIBRATION_RUNS):
            started = time.thread_time()
            work(iterations)
            samples.append(time.thread_time() - started)
        per_iteration = statistics.median(samples) / iterations
        iterations = max(1, round(work_us * 1e-6 / per_iteration)) if per_iteration > 0 else iterations * 2
    return iterations


def waiter(sock: zmq.Socket, mode: str) -> Callable[[], None]:
    """The wait before each receive, by ``mode``; raises ``TimeoutError`` after ``WAIT_S``."""
    if mode == "block":
        return lambda: None
    pause = os.sched_yield if mode == "spin-yield" else (lambda: None)

    def wait() -> None:
        end = time.perf_counter() + WAIT_S
        while not sock.get(zmq.EVENTS) & zmq.POLLIN:
            pause()
            if time.perf_counter() > end:
                raise TimeoutError(f"no message within {WAIT_S:.0f} s")
    return wait


def timed_work(iterations: int, samples: list[float]) -> None:
    started = time.thread_time()
    work(iterations)
    samples.append(time.thread_time() - started)


def hot_block(i: int, iterations: int, samples: list[float]) -> None:
    """After every ``BLOCK`` round trips (``i`` counts them from 0), ``BLOCK`` runs of the work back to back;
    the first of them runs after a wake-up and is not kept."""
    if i % BLOCK == BLOCK - 1:
        block: list[float] = []
        for _ in range(BLOCK + 1):
            timed_work(iterations, block)
        samples.extend(block[1:])


def echo(endpoint_file: str, mode: str, iterations: int) -> None:
    """The echoing side: bind, write the endpoint, answer every message after the work; print its figures."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
    sock.bind("tcp://127.0.0.1:*")
    tmp = endpoint_file + ".tmp"
    with open(tmp, "w") as out:
        out.write(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    os.replace(tmp, endpoint_file)
    wait, samples, hot_samples, i = waiter(sock, mode), [], [], 0
    try:
        while True:
            wait()
            ident, payload = sock.recv_multipart()
            if payload == b"q":
                break
            timed_work(iterations, samples)
            if i >= WARM_ROUND_TRIPS:
                hot_block(i, iterations, hot_samples)
            i += 1
            sock.send_multipart([ident, payload])
    finally:
        sock.close(0)
        ctx.term()
    print(json.dumps({"after_wake_s": statistics.median(samples[WARM_ROUND_TRIPS:]), "hot_s": statistics.median(hot_samples)}))


def drive(mode: str, iterations: int, round_trips: int, workdir: str) -> dict[str, Any]:
    """One ping-pong of ``round_trips`` in ``mode`` against a fresh echoing process; its figures in µs."""
    endpoint_file = os.path.join(workdir, f"echo-{mode}.endpoint")
    if os.path.exists(endpoint_file):
        os.remove(endpoint_file)            # an earlier repeat's
    child = subprocess.Popen([sys.executable, __file__, "--echo", endpoint_file, "--mode", mode,
                              "--iterations", str(iterations)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not os.path.exists(endpoint_file):
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit("the echoing process did not start")
            time.sleep(0.01)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(WAIT_S * 1000))
        sock.connect(open(endpoint_file).read())
        wait, samples, round_trip, hot_samples = waiter(sock, mode), [], [], []
        for i in range(WARM_ROUND_TRIPS + round_trips):
            if i >= WARM_ROUND_TRIPS:
                hot_block(i, iterations, hot_samples)
            started = time.perf_counter()
            timed_work(iterations, samples)
            sock.send(b"abcd")
            wait()
            sock.recv()
            if i >= WARM_ROUND_TRIPS:
                round_trip.append(time.perf_counter() - started)
        sock.send(b"q")
        sock.close(200)
        ctx.term()
        out, _ = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    echoed = json.loads(out.strip().splitlines()[-1])
    after = (statistics.median(samples[WARM_ROUND_TRIPS:]), echoed["after_wake_s"])
    hot_s = (statistics.median(hot_samples), echoed["hot_s"])
    return {"mode": mode, "step_us": 1e6 * statistics.median(round_trip),
            "work_after_wake_us": [1e6 * a for a in after], "work_hot_us": [1e6 * h for h in hot_s],
            "penalty": [a / h if h else None for a, h in zip(after, hot_s)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-us", type=float, default=50.0, help="each side's work per message, hot (default 50)")
    p.add_argument("--round-trips", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--json", help="write every row here")
    p.add_argument("--echo", help=argparse.SUPPRESS)          # the echoing process's endpoint file
    p.add_argument("--mode", default="block", help=argparse.SUPPRESS)
    p.add_argument("--iterations", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.echo:
        echo(args.echo, args.mode, args.iterations)
        return 0
    if args.round_trips < BLOCK:
        p.error(f"--round-trips must be at least {BLOCK} (a hot block comes after every {BLOCK})")
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"unknown mode(s) {unknown}: use {', '.join(MODES)}")
    iterations = calibrate(args.work_us)
    rows = []
    print(f"work: {iterations} iterations (about {args.work_us:g} us hot); {args.round_trips} round trips a run")
    print("| mode | step (us) | work after a wake, driver / echo (us) | hot (us) | penalty |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="distgrad-wake-cost-") as workdir:
        for _ in range(args.repeats):
            for mode in modes:
                row = drive(mode, iterations, args.round_trips, workdir)
                rows.append(row)
                after, hot_us, penalty = row["work_after_wake_us"], row["work_hot_us"], row["penalty"]
                print(f"| {mode} | {row['step_us']:.1f} | {after[0]:.1f} / {after[1]:.1f} | "
                      f"{hot_us[0]:.1f} / {hot_us[1]:.1f} | {penalty[0]:.2f} / {penalty[1]:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"iterations": iterations, "rows": rows}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
