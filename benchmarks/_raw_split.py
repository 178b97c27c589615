#!/usr/bin/env python
"""The bare raw-frame numpy split of mlp-classify, for benchmarks/bench.py.

The same computation as distgrad's ``mlp-classify`` stages (Dense IN->HIDDEN +
ReLU on f; Dense HIDDEN->CLASSES + softmax cross-entropy on g; float32 Adam on
each side) written as directly as it can be: two processes, a DEALER and a
ROUTER, one raw frame each way per step with a 1-byte header, lockstep, no
validation, no step ids, no retries. It is the floor a framework can be held
to. Like distgrad's driving stage, it does not compute the gradient with
respect to f's input (nothing needs it).

    _raw_split.py g READY_FILE ENDPOINT BATCH HIDDEN
    _raw_split.py f ENDPOINT BATCH HIDDEN STEPS    # prints {"steps", "elapsed_s"}

``make_data`` is shared with ``_torch_split.py``.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from _bare_identity import write_ready

F32 = np.float32
FEATURES, CLASSES, SPREAD, SEED = 784, 10, 4.0, 0
ZERO_COPY_MIN_BYTES = 64 * 1024
IDLE_EXIT_S = 120.0


def make_data(batch: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian blobs like distgrad's synthetic_classification: (samples, 784) float32, int64 labels.

    ``max(2048, 4 * batch)`` samples in a fixed shuffled order; step i reads the
    contiguous rows of batch ``i mod (samples // batch)``.
    """
    samples = max(2048, 4 * batch)
    rng = np.random.default_rng([seed, 13])
    centres = rng.normal(size=(CLASSES, FEATURES))
    y = rng.integers(0, CLASSES, size=samples).astype(np.int64)
    x = (centres[y] + SPREAD * rng.normal(size=(samples, FEATURES))).astype(F32)
    return x, y


def glorot(rng: np.random.Generator, n_in: int, n_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (n_in + n_out))
    return rng.uniform(-limit, limit, size=(n_in, n_out)).astype(F32)


class Adam:
    """Minimal float32 Adam (TF1's update), in place, scratch buffers reused."""

    def __init__(self, params: list[np.ndarray], lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 eps: float = 1e-8) -> None:
        self.params = params
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.t = [np.empty_like(p) for p in params]
        self.lr, self.b1, self.b2, self.eps = F32(lr), F32(beta1), F32(beta2), F32(eps)
        self.b1p, self.b2p = self.b1, self.b2

    def step(self, grads: list[np.ndarray]) -> None:
        one = F32(1)
        alpha = self.lr * np.sqrt(one - self.b2p) / (one - self.b1p)
        c1, c2 = one - self.b1, one - self.b2
        for w, g, m, v, t in zip(self.params, grads, self.m, self.v, self.t):
            np.subtract(g, m, out=t)
            t *= c1
            m += t
            np.multiply(g, g, out=t)
            t -= v
            t *= c2
            v += t
            np.sqrt(v, out=t)
            t += self.eps
            np.divide(m, t, out=t)
            t *= alpha
            w -= t
        self.b1p, self.b2p = self.b1p * self.b1, self.b2p * self.b2


def _send(sock, header: bytes, array: np.ndarray, envelope: bytes | None = None) -> None:
    import zmq
    if envelope is not None:
        sock.send(envelope, zmq.SNDMORE)
    sock.send(header, zmq.SNDMORE)
    sock.send(array, 0, copy=array.nbytes < ZERO_COPY_MIN_BYTES)


def serve_g(ready_file: str, endpoint: str, batch: int, hidden: int) -> None:
    import zmq

    _, y_all = make_data(batch)
    batches = len(y_all) // batch
    rng = np.random.default_rng([SEED, 2])
    w2, b2 = glorot(rng, hidden, CLASSES), np.zeros(CLASSES, F32)
    adam = Adam([w2, b2])
    rows = np.arange(batch)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    write_ready(sock, ready_file)
    copy = batch * hidden * 4 < ZERO_COPY_MIN_BYTES
    step = 0
    try:
        while sock.poll(int(IDLE_EXIT_S * 1000), zmq.POLLIN):
            ident = sock.recv()
            header = sock.recv()
            if header == b"q":
                break
            frame = sock.recv(copy=copy)
            a = np.frombuffer(frame if copy else frame.buffer, F32).reshape(batch, hidden)
            y = y_all[(step % batches) * batch:(step % batches + 1) * batch]
            step += 1
            logits = a @ w2 + b2
            shifted = logits - logits.max(axis=1, keepdims=True)
            e = np.exp(shifted)
            p = e / e.sum(axis=1, keepdims=True)
            p[rows, y] -= F32(1)
            p /= F32(batch)                       # d(mean CE)/d(logits)
            dw2, db2 = a.T @ p, p.sum(axis=0)
            da = p @ w2.T
            adam.step([dw2, db2])
            _send(sock, b"g", da, ident)
    finally:
        sock.close(0)
        ctx.term()


def drive_f(endpoint: str, batch: int, hidden: int, steps: int) -> None:
    import zmq

    x_all, _ = make_data(batch)
    batches = len(x_all) // batch
    rng = np.random.default_rng([SEED, 1])
    w1, b1 = glorot(rng, FEATURES, hidden), np.zeros(hidden, F32)
    adam = Adam([w1, b1])
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    copy = batch * hidden * 4 < ZERO_COPY_MIN_BYTES

    def one_step(step: int) -> None:
        i = step % batches
        x = x_all[i * batch:(i + 1) * batch]
        h = x @ w1 + b1
        a = np.maximum(h, F32(0))
        _send(sock, b"a", a)
        if not sock.poll(30_000, zmq.POLLIN):
            raise RuntimeError(f"no reply from {endpoint} within 30 s")
        _, frame = sock.recv_multipart(copy=copy)
        da = np.frombuffer(frame if copy else frame.buffer, F32).reshape(batch, hidden)
        dh = da * (h > 0)
        adam.step([x.T @ dh, dh.sum(axis=0)])

    try:
        one_step(0)                               # connects; not timed
        started = time.perf_counter()
        for step in range(1, steps + 1):
            one_step(step)
        elapsed = time.perf_counter() - started
        sock.send_multipart([b"q"])
        print(json.dumps({"steps": steps, "elapsed_s": elapsed}), flush=True)
    finally:
        sock.close(200)
        ctx.term()


def main(argv: list[str]) -> int:
    if argv[0] == "g":
        serve_g(argv[1], argv[2], int(argv[3]), int(argv[4]))
    elif argv[0] == "f":
        drive_f(argv[1], int(argv[2]), int(argv[3]), int(argv[4]))
    else:
        print(f"unknown role {argv[0]!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
