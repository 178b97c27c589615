#!/usr/bin/env python
"""Per-call costs of distgrad's hot path, in one process, without sockets between processes.

    .venv/bin/python benchmarks/per_message.py [--repeats 7] [--json PATH]

Each figure is the best of ``--repeats`` timed batches (timeit's rule: the
minimum is the least disturbed by other load), timed in this thread's CPU
time (``time.thread_time``, so time other processes take is not counted), in
microseconds per call:

- ``encode`` / ``decode`` of a ``forward`` (one float32 activation) and of a
  ``backward`` reply (with ``loss`` and ``compute_s``), at 4 B and 32 KiB, and
  a forward's ``decode`` + ``expect_tensors`` (its binary header's frames are
  read against the receiver's ``FrameLayout`` there);
- ``expect_tensors`` (shape, dtype, finiteness) at 4 B, 32 KiB and 4 MiB;
- ``g handles a forward``: ``wire.decode`` + ``ServingStage.handle`` +
  ``wire.encode`` of the reply + ``ServingStage.settle`` (the gradients and
  update it defers until the reply is sent), for seed-reverse (one float)
  and mlp-classify (batch 32), i.e. everything the serving stage does per
  message except the socket calls;
- ``a step of f and g, no sockets``: the driving stage's whole step
  (``step_once`` and its after-step work) against that serving stage, each
  message encoded and decoded as it would cross, for seed-reverse and
  mlp-classify: everything both processes do per step but the socket calls;
- the same step of seed-reverse ``after other work``: between two steps (not
  timed) other code runs over other data (``other_work``: a dict of 300
  entries built, an 8 MiB array summed), as the kernel, ZeroMQ's I/O threads
  and the other stage do between a stage's messages in a two-process run;
  the median step, so what the step's own code and data lose from the
  caches shows beside the hot figure;
- ``transport round trip``: ``send_frames`` / ``poll_frames`` both ways over
  ``inproc://`` against the same calls in bare pyzmq (``send_multipart`` /
  ``recv_multipart``), 4 B;
- optimiser updates: Adam and SGD on one float, Adam on 784x256 + 256.

bench.py measures the two-process figures. tests/test_benchmarks.py runs this
script with ``--repeats 1`` so that it keeps working as distgrad changes; if
the serving stage's class moves, the import below says so and exits 1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("distgrad") is None:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))          # handshake.hello_message: the hello the tests send too

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from distgrad.wire import transport

from distgrad.wire import messages as wire  # noqa: E402
from distgrad.run.options import StageOptions, StopFlag  # noqa: E402
from distgrad.config.parse import load_experiment  # noqa: E402
from distgrad.model.optim import SGD, Adam  # noqa: E402
from handshake import hello_message  # noqa: E402

try:
    # The serving stage's protocol logic without its socket: handle(msg, now) -> reply, then settle().
    from distgrad.run.serving import ServingStage  # noqa: E402
    from distgrad.run.driver import _Driver  # noqa: E402     the driving stage's loop, its link's socket replaced
except ImportError as e:  # renamed or moved by a refactor: say so rather than fail somewhere below
    raise SystemExit(f"per_message.py: cannot import the serving stage's message handler "
                     f"distgrad.run.serving.ServingStage ({e}); it was renamed or moved: update this import") from e

RUN = "0123456789abcdef0123456789abcdef"


def best_us(fn, repeats: int, min_batch_s: float = 0.02) -> float:
    number = 1
    while True:
        t = timeit.timeit(fn, number=number, timer=time.thread_time)
        if t >= min_batch_s:
            break
        number *= 2
    return min(timeit.repeat(fn, number=number, repeat=repeats, timer=time.thread_time)) / number * 1e6


def codec(repeats: int) -> dict[str, float]:
    out = {}
    for size in (4, 32 * 1024):
        x = np.ones(size // 4, np.float32)
        fwd = wire.Message(wire.FORWARD, RUN, 12345, 0, 1, tensors={"activation": x})
        bwd = wire.Message(wire.BACKWARD, RUN, 12345, 0, 1, body={"loss": 0.25, "compute_s": 1.5e-5},
                           tensors={"activation_grad": x})
        ff, bf = ([memoryview(f).tobytes() for f in wire.encode(m)] for m in (fwd, bwd))
        out[f"encode forward {size} B"] = best_us(lambda: wire.encode(fwd), repeats)
        out[f"encode backward {size} B"] = best_us(lambda: wire.encode(bwd), repeats)
        out[f"decode forward {size} B"] = best_us(lambda: wire.decode(ff), repeats)
        out[f"decode backward {size} B"] = best_us(lambda: wire.decode(bf), repeats)
        # What a receiver does with a forward: decode, then its tensors checked against its expectation
        # (a binary header's frames are only read there).
        layout = wire.FrameLayout({"activation": (x.shape, np.float32)})
        out[f"decode + expect_tensors forward {size} B"] = best_us(
            lambda: wire.expect_tensors(wire.decode(ff), layout), repeats)
    for size in (4, 32 * 1024, 4 * 1024 * 1024):
        x = np.ones(size // 4, np.float32)
        msg = wire.Message(wire.FORWARD, RUN, 1, tensors={"activation": x})
        spec = {"activation": ((size // 4,), np.dtype(np.float32))}
        out[f"expect_tensors {size} B"] = best_us(lambda: wire.expect_tensors(msg, spec), repeats)
    return out


PEER = [b"peer"]       # the envelope of the one peer


def g_handles(name: str, repeats: int) -> float:
    """decode + handle + encode of one forward, averaged over many consecutive steps."""
    exp = load_experiment(name)
    logic = ServingStage(StageOptions(experiment=exp, stage=exp.stage_names[-1], seed=exp.seed))
    f_shape = logic.stage.input_shape
    (_, welcome), = logic.handle(PEER, hello_message(exp, RUN, steps=10**9, micro_batches=1), time.monotonic())
    if welcome.type != wire.WELCOME:
        raise SystemExit(f"per_message.py: {name}: the serving stage answered the hello with {welcome.describe()}")
    rng = np.random.default_rng(0)
    x = rng.normal(size=f_shape).astype(np.float32) * np.float32(0.1)
    batch = 256
    step = [0]

    def prepare() -> list[list[bytes]]:
        out = []
        for _ in range(batch):
            step[0] += 1
            m = wire.Message(wire.FORWARD, RUN, step[0], 0, 1, tensors={"activation": x})
            out.append([memoryview(f).tobytes() for f in wire.encode(m)])
        return out

    samples = []
    for _ in range(repeats * 3):
        msgs = prepare()
        t0 = time.thread_time()
        for frames in msgs:
            msg = wire.decode(frames, logic.max_tensor_bytes)
            for _, reply in logic.handle(PEER, msg, 0.0):
                wire.encode(reply)
            logic.settle()
        samples.append((time.thread_time() - t0) / batch * 1e6)
    return min(samples)


OTHER_DATA = np.ones(1 << 20)      # 8 MiB of float64


def other_work() -> None:
    """Code and data that are not the step's: what runs between two steps of a stage process."""
    table = {str(i): 2 * i for i in range(300)}
    OTHER_DATA.sum() + len(table)


def median_step_us(step, repeats: int, between, steps: int = 2000) -> float:
    """The median thread CPU time of ``step`` (µs) over ``steps`` calls with ``between()`` run (untimed)
    before each; the least of ``repeats`` such medians."""
    medians = []
    for _ in range(repeats):
        times = []
        for _ in range(steps):
            between()
            t0 = time.thread_time()
            step()
            times.append(time.thread_time() - t0)
        medians.append(sorted(times)[steps // 2] * 1e6)
    return min(medians)


def step_both_sides(name: str, repeats: int, between=None) -> float:
    """One whole unpipelined step of both stages, the sockets left out: the driving stage's ``step_once`` and
    its after-step work, each message encoded, handed to a ``ServingStage`` (decode, handle, encode of the
    reply, settle) and the reply decoded back, as ``transport.Client.send`` / ``wait`` would. Averaged over
    many consecutive steps; everything both processes do per step but the socket calls. With ``between``,
    that is run before each step, untimed, and the figure is ``median_step_us``'s."""
    exp = load_experiment(name)
    logic = ServingStage(StageOptions(exp, exp.stage_names[-1], exp.seed, steps=10**9))
    driver = _Driver(StageOptions(exp, exp.stage_names[0], exp.seed, steps=10**9), "tcp://127.0.0.1:9",
                     StopFlag(), zmq.Context.instance())
    replies: list[list[bytes]] = []

    def send(msg: wire.Message) -> None:
        msg = wire.decode([memoryview(f).tobytes() for f in wire.encode(msg)], logic.max_tensor_bytes)
        answers = logic.handle(PEER, msg, 0.0)
        while answers:
            replies.extend([memoryview(f).tobytes() for f in wire.encode(reply)] for _, reply in answers)
            answers = logic.settle()

    def wait(run, keys, timeout_s, check_stop=None, what=None) -> wire.Message:
        return wire.decode(replies.pop(0), driver.link.client.max_reply_bytes)

    driver.link.client.send, driver.link.client.wait = send, wait
    driver.state.begin(RUN)
    driver.handshake()
    driver.report_every, driver.last_step = 10**9, 0
    driver.started = driver.last_report = time.perf_counter()

    def step() -> None:
        driver.step_started, driver.wait_before, driver.g_before = (time.perf_counter(), driver.traffic.wait_s,
                                                                    driver.g_compute_s)
        driver.step_once()
        driver._after_step()

    try:
        for _ in range(20):         # the first steps allocate (Adam's state, scratch buffers)
            step()
        return best_us(step, repeats) if between is None else median_step_us(step, repeats, between)
    finally:
        driver.link.close(0)


def round_trips(repeats: int) -> dict[str, float]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
    b.bind("inproc://per-message")
    a.connect("inproc://per-message")
    x = np.ones(1, np.float32)
    ff = wire.encode(wire.Message(wire.FORWARD, RUN, 1, tensors={"activation": x}))
    bf = wire.encode(wire.Message(wire.BACKWARD, RUN, 1, body={"loss": 0.5}, tensors={"activation_grad": x}))

    def distgrad_rt() -> None:
        transport.send_frames(a, ff)
        parts = transport.poll_frames(b, 1.0)
        transport.send_frames(b, bf, [parts[0].bytes])
        transport.poll_frames(a, 1.0)

    def raw_rt() -> None:
        a.send_multipart(ff)
        b.poll(1000, zmq.POLLIN)
        parts = b.recv_multipart(copy=False)
        b.send_multipart([parts[0].bytes, *bf])
        a.poll(1000, zmq.POLLIN)
        a.recv_multipart(copy=False)

    try:
        return {"transport round trip inproc 4 B": best_us(distgrad_rt, repeats),
                "bare pyzmq round trip inproc 4 B (poll + recv)": best_us(raw_rt, repeats)}
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def optimisers(repeats: int) -> dict[str, float]:
    out = {}
    p, g = {"w": np.ones(1, np.float32)}, {"w": np.full(1, 0.1, np.float32)}
    adam, sgd = Adam(), SGD()
    out["Adam step, 1 float"] = best_us(lambda: adam.step(p, g), repeats)
    out["SGD step, 1 float"] = best_us(lambda: sgd.step(p, g), repeats)
    p = {"W": np.ones((784, 256), np.float32), "b": np.ones(256, np.float32)}
    g = {k: np.full_like(v, 0.1) for k, v in p.items()}
    adam = Adam()
    out["Adam step, 784x256 + 256"] = best_us(lambda: adam.step(p, g), repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results: dict[str, float] = {}
    results.update(codec(args.repeats))
    for name in ("seed-reverse", "mlp-classify"):
        results[f"g handles a forward ({name})"] = g_handles(name, args.repeats)
    for name in ("seed-reverse", "mlp-classify"):
        results[f"a step of f and g, no sockets ({name})"] = step_both_sides(name, args.repeats)
    results["a step of f and g, no sockets (seed-reverse), after other work"] = step_both_sides(
        "seed-reverse", args.repeats, other_work)
    results.update(round_trips(args.repeats))
    results.update(optimisers(args.repeats))
    width = max(map(len, results))
    for key, value in results.items():
        print(f"{key:<{width}}  {value:8.2f} µs")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
