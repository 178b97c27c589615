#!/usr/bin/env python
"""Peer processes for benchmarks/bench.py; not meant to be run by hand.

Each role runs in its own process (started by bench.py with BLAS pinned to
one thread) and prints at most one JSON line on stdout:

``raw-server READY_FILE ENDPOINT``
    A ROUTER echo server in bare pyzmq: every request ``[header, payload]``
    is answered with a ~60-byte header and a payload of the same size (a
    preallocated buffer, sent without a copy when it is >= 64 KiB).
``raw-client ENDPOINT SIZE SECONDS``
    A DEALER that times round trips of ``[~60-byte header, SIZE bytes]``
    against ``raw-server`` for about SECONDS; prints ``{"round_trips", "elapsed_s", "rt_s"}``.
``wire-server READY_FILE ENDPOINT``
    distgrad's wire path with no model: ``transport.Server`` receives,
    ``wire.decode`` + ``wire.expect_tensors`` validate, and a ``backward``
    reply carrying an ``activation_grad`` of the same shape goes back through
    ``wire.encode`` (``Server.reply``).
``wire-client ENDPOINT SIZE SECONDS``
    ``transport.Client.request`` of a ``forward`` with one float32
    ``activation`` of SIZE bytes, then ``wire.expect_tensors`` on the reply,
    as the driving stage does; prints like ``raw-client``.
``inprocess EXPERIMENT STEPS``
    ``distgrad.train_in_process`` through the Python API (no summary file, so
    a 64 MiB model does not spend its time writing JSON); prints
    ``{"steps", "elapsed_s"}``.
``stage-compute EXPERIMENT MICRO_BATCHES [MIN_S]``
    Times, in isolation, one micro-batch's forward+backward of the first stage
    and forward+loss+backward of the last stage, and each stage's optimiser
    update, each for about MIN_S seconds (default 0.5); prints seconds per
    call (medians).
``info``
    numpy version and the BLAS core and thread count it actually runs.

Every loop is bounded: servers exit after ``IDLE_EXIT_S`` without a request.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import json
import os
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if importlib.util.find_spec("distgrad") is None:   # bench.py puts its snapshot of distgrad on PYTHONPATH
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

ZERO_COPY_MIN_BYTES = 64 * 1024   # as distgrad.wire.transport: copy below, zero-copy at and above
IDLE_EXIT_S = 1800.0              # a server with no request for this long exits by itself
REPLY_TIMEOUT_S = 30.0            # a client waiting longer than this for a reply fails
WARMUP_S = 0.1                    # round trips before the timed ones start


def _emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _write_ready(path: str, endpoint: str) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(endpoint)
    tmp.replace(path)


def _timed_loop(one_round_trip, seconds: float) -> dict:
    """Warm up for ``WARMUP_S``, then run round trips in growing chunks for about ``seconds``."""
    end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < end:
        one_round_trip()
    count, chunk = 0, 1
    started = time.perf_counter()
    while True:
        for _ in range(chunk):
            one_round_trip()
        count += chunk
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            break
        chunk = min(chunk * 2, max(1, int(count * (seconds - elapsed) / elapsed) + 1))
    return {"round_trips": count, "elapsed_s": elapsed, "rt_s": elapsed / count}


# ---------------------------------------------------------------- bare pyzmq

def raw_server(ready_file: str, endpoint: str) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    _write_ready(ready_file, sock.getsockopt_string(zmq.LAST_ENDPOINT))
    replies: dict[int, np.ndarray] = {}
    reply_header = b"R" * 60
    try:
        while sock.poll(int(IDLE_EXIT_S * 1000), zmq.POLLIN):
            ident = sock.recv(copy=True)
            header = sock.recv(copy=True)        # the client writes the payload size in its header
            if header == b"quit":
                break
            size = int(header)
            payload = sock.recv(copy=size < ZERO_COPY_MIN_BYTES)
            if len(payload) != size or sock.getsockopt(zmq.RCVMORE):
                raise RuntimeError(f"request of {len(payload)} bytes, header said {size}")
            buf = replies.get(size)
            if buf is None:
                buf = replies[size] = np.zeros(size, np.uint8)
            sock.send(ident, zmq.SNDMORE, copy=True)
            sock.send(reply_header, zmq.SNDMORE, copy=True)
            sock.send(buf, 0, copy=size < ZERO_COPY_MIN_BYTES)
    finally:
        sock.close(0)
        ctx.term()


def raw_client(endpoint: str, size: int, seconds: float) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(REPLY_TIMEOUT_S * 1000))     # zmq.Again instead of a hang
    sock.connect(endpoint)
    payload = np.ones(size, np.uint8)
    copy = size < ZERO_COPY_MIN_BYTES
    header = b"%-60d" % size          # 60 bytes; the server reads the size from it

    def round_trip() -> None:
        sock.send(header, zmq.SNDMORE, copy=True)
        sock.send(payload, 0, copy=copy)
        _, reply = sock.recv_multipart(copy=copy)
        if len(reply) != size:
            raise RuntimeError(f"reply of {len(reply)} bytes to a {size}-byte request")

    if not sock.poll(10_000, zmq.POLLOUT):
        raise RuntimeError(f"cannot send to {endpoint}")
    try:
        _emit({"size": size, **_timed_loop(round_trip, seconds)})
    finally:
        sock.close(0)
        ctx.term()


# ---------------------------------------------------------------- distgrad's wire path, no model

def wire_server(ready_file: str, endpoint: str) -> None:
    from distgrad.wire import messages as wire
    from distgrad.wire.transport import Server

    ctx = zmq.Context()
    server = Server(ctx, endpoint, None, 30.0)
    _write_ready(ready_file, server.endpoint)
    replies: dict[int, np.ndarray] = {}
    layouts: dict[int, "wire.FrameLayout"] = {}
    idle_until = time.monotonic() + IDLE_EXIT_S
    try:
        while time.monotonic() < idle_until:
            request = server.receive(0.1)
            if request is None:
                continue
            idle_until = time.monotonic() + IDLE_EXIT_S
            envelope, frames, _ = request
            msg = wire.decode(frames, 1 << 30)
            if msg.type == wire.BYE:
                server.reply(envelope, wire.Message(wire.BYE, msg.run, msg.step))
                break
            # The clients' sizes vary, and a forward's header does not say its shape: this server expects
            # one float32 vector filling the frame, an expectation built once per size, as a stage does.
            size = memoryview(frames[1]).nbytes if len(frames) == 2 else -1
            layout = layouts.get(size)
            if layout is None:
                layout = layouts[size] = wire.FrameLayout({"activation": ((max(size, 0) // 4,), np.float32)})
                replies[size] = np.zeros(max(size, 0) // 4, np.float32)
            wire.expect_tensors(msg, layout)
            grad = replies[size]
            server.reply(envelope, wire.Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs,
                                                body={"loss": 0.0}, tensors={"activation_grad": grad}))
    finally:
        server.close(0)
        ctx.term()


def wire_client(endpoint: str, size: int, seconds: float) -> None:
    from distgrad.wire import messages as wire
    from distgrad.wire.transport import Client

    n = max(1, size // 4)
    ctx = zmq.Context()
    limit = max(wire.HEADER_MAX_BYTES, n * 4)
    client = Client(ctx, endpoint, limit, n * 4, 30.0)
    activation = np.ones(n, np.float32)
    run = uuid.uuid4().hex
    expected = wire.FrameLayout({"activation_grad": ((n,), np.float32)})
    step = [0]

    def round_trip() -> None:
        step[0] += 1
        msg = wire.Message(wire.FORWARD, run, step[0], 0, 1, tensors={"activation": activation})
        reply = client.request(msg, REPLY_TIMEOUT_S)
        wire.expect_tensors(reply, expected)

    try:
        _emit({"size": n * 4, **_timed_loop(round_trip, seconds)})
    finally:
        client.close(0)
        ctx.term()


# ---------------------------------------------------------------- compute alone

def inprocess(experiment: str, steps: int) -> None:
    from distgrad.config.parse import load_experiment
    from distgrad.run.inprocess import train_in_process

    exp = load_experiment(experiment)
    summary = train_in_process(exp, steps)
    _emit({"steps": summary["steps"], "elapsed_s": summary["elapsed_s"]})


def _median_time(fn, min_s: float = 0.5, repeats: int = 7) -> float:
    fn()
    n, t = 1, 0.0
    while True:                       # calls per sample so that one sample takes about min_s/repeats
        started = time.perf_counter()
        for _ in range(n):
            fn()
        t = time.perf_counter() - started
        if t >= min_s / repeats:
            break
        n *= 2
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - started) / n)
    return float(np.median(samples))


def stage_compute(experiment: str, micro_batches: int, min_s: float = 0.5) -> None:
    from distgrad.config.parse import load_experiment
    from distgrad.stage.stage import Stage, micro_batch

    exp = load_experiment(experiment)
    first, last = exp.stage_names
    f, g = Stage.from_experiment(exp, first), Stage.from_experiment(exp, last)
    data = exp.build_data(exp.seed)
    x = micro_batch(data.features(1), 0, micro_batches)
    y = micro_batch(np.asarray(data.targets(1), g.target_dtype), 0, micro_batches)
    a, _ = f.forward(x)
    da = np.ones_like(a)
    f_grads = {k: np.zeros_like(v) for k, v in f.params.items()}
    g_grads = {k: np.zeros_like(v) for k, v in g.params.items()}
    _emit({
        "micro_batches": micro_batches, "rows": int(x.shape[0]),
        "f_forward_backward_s": _median_time(lambda: f.backward(f.forward(x)[1], da), min_s),
        "g_forward_loss_backward_s": _median_time(lambda: g.loss_micro_batch(a, y), min_s),
        "f_update_s": _median_time(lambda: f.optimizer.step(f.params, f_grads), min_s),
        "g_update_s": _median_time(lambda: g.optimizer.step(g.params, g_grads), min_s),
        "f_data_s": _median_time(lambda: data.features(2), min_s),
    })


# ---------------------------------------------------------------- machine

def blas_core() -> dict:
    """The OpenBLAS core numpy runs on and its thread count (None when it cannot be asked)."""
    libs = glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "libscipy_openblas*.so"))
    out: dict = {"library": os.path.basename(libs[0]) if libs else None, "core": None, "threads": None, "config": None}
    if not libs:
        return out
    try:
        lib = ctypes.CDLL(libs[0])
        for key, suffix in (("core", "get_corename"), ("config", "get_config")):
            fn = next((getattr(lib, n) for n in (f"scipy_openblas_{suffix}64_", f"openblas_{suffix}64_",
                                                  f"openblas_{suffix}") if hasattr(lib, n)), None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                out[key] = fn().decode()
        fn = next((getattr(lib, n) for n in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                                              "openblas_get_num_threads") if hasattr(lib, n)), None)
        if fn is not None:
            fn.restype = ctypes.c_int
            out["threads"] = int(fn())
    except OSError:
        pass
    return out


def info() -> None:
    import platform

    import distgrad

    _emit({"distgrad": os.path.dirname(distgrad.__file__), "numpy": np.__version__, "pyzmq": zmq.__version__,
           "libzmq": zmq.zmq_version(),
           "python": platform.python_version(), "blas": blas_core(),
           "env": {k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                  "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}})


def main(argv: list[str]) -> int:
    role, args = argv[0], argv[1:]
    if role == "raw-server":
        raw_server(args[0], args[1])
    elif role == "raw-client":
        raw_client(args[0], int(args[1]), float(args[2]))
    elif role == "wire-server":
        wire_server(args[0], args[1])
    elif role == "wire-client":
        wire_client(args[0], int(args[1]), float(args[2]))
    elif role == "inprocess":
        inprocess(args[0], int(args[1]))
    elif role == "stage-compute":
        stage_compute(args[0], int(args[1]), *(float(a) for a in args[2:3]))
    elif role == "info":
        info()
    else:
        print(f"unknown role {role!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
