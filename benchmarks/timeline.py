#!/usr/bin/env python
"""Where a lockstep step's time goes: each side's work and each message's way across, per step.

    .venv/bin/python benchmarks/timeline.py [--model tiny|mlp] [--bytes N] [--steps N] [--json PATH]

Not part of the default test suite. Runs a split as two real ``distgrad stage`` processes on tcp
loopback (``tiny``: the size group's identity model at ``--bytes``; ``mlp``: bench.py's mlp-classify split
at batch 32) with ``transport.send_frames`` and ``transport.poll_frames`` wrapped to note the time
(``time.monotonic``, one clock for both processes on one host) when a send starts and ends and when a
message has been received. Every step of the lockstep case is then six intervals, one after the other:

- ``f work``: f from the gradient's receipt to the next forward's send (its backward, update, the next
  batch and forward, the checks on what it received);
- ``f send``, ``g send``: the send calls (handing the frames to ZeroMQ);
- ``down``: from f's send to g's receipt (ZeroMQ's I/O threads, the kernel, waking g);
- ``g work``: g from the forward's receipt to its reply's send (decode, checks, forward, loss, backward);
- ``up``: from g's send to f's receipt, including g's deferred update when it delays the next receive.

It prints the median of each over the steps after ``WARM_STEPS`` (milliseconds), their sum beside the
measured step, and one raw round trip of the same frames (bench.py's bare DEALER/ROUTER echo) measured
just before: ``down + up`` against it is what the wire path costs beyond the raw frames, and ``f work +
g work`` against the in-process step is what the stages do beyond the model's compute. Each event also
notes the main thread's CPU time (``time.thread_time``), so a second line gives the CPU of ``f work`` and
``g work``: equal to their wall time when the thread runs throughout (not preempted, not waiting).
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
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_sections.common import HIDDEN  # noqa: E402
from bench_sections.configs import mlp_toml, trivial_toml  # noqa: E402
from bench_sections.wrapped_pair import bench_env, child_argv, run_wrapped_pair, stop, wait_ready  # noqa: E402

WARM_STEPS = 20               # the first steps allocate and connect
RAW_SECONDS = 2.0
RAW_TIMEOUT_S = 60.0


def child(out: Path, argv: list[str]) -> int:
    """Run ``distgrad stage ARGV`` with every send and receive timed; write ``[[event, time, thread CPU time],
    ...]`` to ``out``."""
    import distgrad.wire.transport as transport
    from distgrad.cli import main as cli_main

    events: list[tuple[str, float, float]] = []
    clock, cpu, send, poll = time.monotonic, time.thread_time, transport.send_frames, transport.poll_frames

    def timed_send(sock: Any, frames: Any, envelope: Any = ()) -> int:
        events.append(("send", clock(), cpu()))
        sent = send(sock, frames, envelope)
        events.append(("sent", clock(), cpu()))
        return sent

    def timed_poll(*args: Any, **kwargs: Any) -> Any:
        parts = poll(*args, **kwargs)
        if parts is not None:
            events.append(("received", clock(), cpu()))
        return parts

    transport.send_frames = timed_send  # type: ignore[assignment]
    transport.poll_frames = timed_poll  # type: ignore[assignment]
    try:
        return cli_main(["stage", *argv])
    finally:
        out.write_text(json.dumps(events))


def experiment(model: str, size: int) -> str:
    if model == "tiny":
        return trivial_toml(size)
    return mlp_toml("bench-mlp-b32", [("dense", 784, HIDDEN), ("relu",)], [("dense", HIDDEN, 10)], 32)


def raw_round_trip(size: int, workdir: Path, env: dict[str, str]) -> float:
    """Seconds per round trip of the bare DEALER/ROUTER echo (bench.py's ``raw``) of ``size`` bytes each way."""
    ready = workdir / "raw.ready"
    peers = str(ROOT / "benchmarks" / "_peers.py")
    server = subprocess.Popen([sys.executable, peers, "raw-server", str(ready), "tcp://127.0.0.1:*"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        endpoint = wait_ready(ready, server, "the raw echo server")
        out = subprocess.run([sys.executable, peers, "raw-client", endpoint, str(size), str(RAW_SECONDS)], env=env,
                             capture_output=True, text=True, timeout=RAW_TIMEOUT_S, check=True).stdout
        return float(json.loads(out.strip().splitlines()[-1])["rt_s"])
    finally:
        stop(server)


def phases(f_events: list[list[Any]], g_events: list[list[Any]]) -> dict[str, list[float]]:
    """The six intervals of each lockstep step (seconds), and the main thread's CPU time of each side's work,
    from both sides' events: f's sends after its hello (its forwards) and g's sends after its welcome (its
    replies) pair up one per step."""

    def starts(events: list[list[Any]], name: str, column: int = 1) -> list[float]:
        return [event[column] for event in events if event[0] == name][1:]

    f_send, f_sent, f_recv = starts(f_events, "send"), starts(f_events, "sent"), starts(f_events, "received")
    g_send, g_sent, g_recv = starts(g_events, "send"), starts(g_events, "sent"), starts(g_events, "received")
    f_send_cpu, f_recv_cpu = starts(f_events, "send", 2), starts(f_events, "received", 2)
    g_send_cpu, g_recv_cpu = starts(g_events, "send", 2), starts(g_events, "received", 2)
    steps = min(len(f_send), len(f_recv), len(g_send), len(g_recv), len(f_sent), len(g_sent))
    out: dict[str, list[float]] = {k: [] for k in ("f work", "f send", "down", "g work", "g send", "up", "step",
                                                   "f work CPU", "g work CPU")}
    for i in range(WARM_STEPS, steps - 1):
        out["f work CPU"].append(f_send_cpu[i + 1] - f_recv_cpu[i])
        out["g work CPU"].append(g_send_cpu[i] - g_recv_cpu[i])
        out["f send"].append(f_sent[i] - f_send[i])
        out["down"].append(g_recv[i] - f_sent[i])
        out["g work"].append(g_send[i] - g_recv[i])
        out["g send"].append(g_sent[i] - g_send[i])
        out["up"].append(f_recv[i] - g_sent[i])
        out["f work"].append(f_send[i + 1] - f_recv[i])
        out["step"].append(f_send[i + 1] - f_send[i])
    return out


def measure(model: str, size: int, steps: int, workdir: Path) -> dict[str, Any]:
    exp = workdir / f"timeline-{model}-{size}.toml"
    exp.write_text(experiment(model, size))
    env = bench_env(ROOT)
    frame_bytes = size if model == "tiny" else 32 * HIDDEN * 4
    raw_s = raw_round_trip(frame_bytes, workdir, env)
    outs = run_wrapped_pair(Path(__file__).resolve(), exp, steps, workdir, model, env)
    intervals = phases(json.loads(outs["f"].read_text()), json.loads(outs["g"].read_text()))
    if not intervals["step"]:
        raise RuntimeError(f"too few steps recorded for {steps} steps")
    medians = {k: statistics.median(v) for k, v in intervals.items()}
    return {"model": model, "bytes": frame_bytes, "steps_counted": len(intervals["step"]), "raw_rt_s": raw_s,
            "median_s": medians}


def main() -> int:
    wrapped = child_argv(sys.argv)
    if wrapped is not None:
        return child(*wrapped)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "mlp"], default="tiny")
    p.add_argument("--bytes", type=int, default=4, help="tiny: the activation's bytes")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="distgrad-timeline-") as tmp:
        r = measure(args.model, args.bytes, args.steps, Path(tmp))
    m = r["median_s"]
    parts = ("f work", "f send", "down", "g work", "g send", "up")
    print(f"{r['model']}, {r['bytes']} B per message, {r['steps_counted']} steps; medians in ms:")
    print("| " + " | ".join(parts) + " | sum | step | raw round trip | down + up | f work + g work |")
    print("|" + "---|" * (len(parts) + 5))
    print("| " + " | ".join(f"{m[k] * 1e3:.3f}" for k in parts)
          + f" | {sum(m[k] for k in parts) * 1e3:.3f} | {m['step'] * 1e3:.3f} | {r['raw_rt_s'] * 1e3:.3f} | "
          f"{(m['down'] + m['up']) * 1e3:.3f} | {(m['f work'] + m['g work']) * 1e3:.3f} |")
    print(f"main thread CPU: f work {m['f work CPU'] * 1e3:.3f}, g work {m['g work CPU'] * 1e3:.3f} ms")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
