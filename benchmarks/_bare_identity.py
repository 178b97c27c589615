#!/usr/bin/env python
"""The bare lockstep split of the benchmarks' identity model, for bench.py and scaling.py: the floor a split
step can reach on this machine, measured beside the raw round trip of the same frames.

The computation of ``configs.trivial_toml``'s two stages (an identity layer on each side, the sum of squared
errors on g, x = 1 every step) written as directly as it can be, with only what any split must do per step:
f makes its batch, g its target, the loss and its gradient with the numpy calls distgrad's ``SumSquaredError``
makes; a binary header each way (kind, run id, step) that the receiver checks, the frame's byte length
checked, every received float tensor checked for NaN and Inf, every wait bounded. Nothing else: no reply
cache, no resume, no handshake, no progress, no received tensor copied to an aligned address (distgrad copies
a misaligned frame, see ``wire.messages``), no per-step Python objects beyond the arrays' views. Two
processes, a DEALER and a ROUTER, tensors of 64 KiB and more sent without a copy, as distgrad does.

    _bare_identity.py g READY_FILE ENDPOINT BYTES
    _bare_identity.py f ENDPOINT BYTES STEPS        # prints {"steps", "elapsed_s"}
"""

from __future__ import annotations

import json
import struct
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

F32 = np.float32
ZERO_COPY_MIN_BYTES = 64 * 1024
WAIT_MS = 30_000                   # a side that hears nothing for this long fails
IDLE_EXIT_S = 120.0                # the g side exits by itself after this long without a request
HEADER = struct.Struct("<2sB16sQf")  # magic, kind, run id, step, loss
MAGIC, FORWARD, BACKWARD, QUIT = b"DB", 1, 2, 3
RUN = b"bare-identity-00"


def write_ready(sock, ready_file: str) -> None:
    """Write the bound endpoint of ``sock`` to ``ready_file`` at once (a rename): the driver's start signal."""
    import zmq
    tmp = Path(ready_file + ".tmp")
    tmp.write_text(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    tmp.replace(ready_file)


def drive(ctx, sock, one_step: Callable[[int], None], steps: int, quit_frame: bytes) -> None:
    """Step 0 untimed (it connects), then steps 1..``steps`` timed; then ``quit_frame`` to the g side, the
    figures printed (``{"steps", "elapsed_s"}``) and ``sock`` and ``ctx`` closed."""
    try:
        one_step(0)
        started = time.perf_counter()
        for step in range(1, steps + 1):
            one_step(step)
        elapsed = time.perf_counter() - started
        sock.send(quit_frame)
        print(json.dumps({"steps": steps, "elapsed_s": elapsed}), flush=True)
    finally:
        sock.close(200)
        ctx.term()


def run_role(argv: list[str], serve_g: Callable[[str, str, int], None], drive_f: Callable[[str, int, int], None],
             usage: str | None) -> int:
    """``g READY_FILE ENDPOINT BYTES`` or ``f ENDPOINT BYTES STEPS``: run that side; 2 with ``usage`` otherwise."""
    if argv[:1] == ["g"] and len(argv) == 4:
        serve_g(argv[1], argv[2], int(argv[3]))
    elif argv[:1] == ["f"] and len(argv) == 4:
        drive_f(argv[1], int(argv[2]), int(argv[3]))
    else:
        print(usage, file=sys.stderr)
        return 2
    return 0


def _checked_tensor(frame, size: int, what: str) -> np.ndarray:
    if len(frame) != size:
        raise RuntimeError(f"{what} of {len(frame)} bytes, expected {size}")
    array = np.frombuffer(frame if isinstance(frame, bytes) else frame.buffer, F32)
    if not np.isfinite(np.vdot(array, array)):      # as distgrad's all_finite: one pass, no temporary
        if not np.isfinite(array).all():
            raise RuntimeError(f"{what} holds NaN or Inf")
    return array


def serve_g(ready_file: str, endpoint: str, size: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(IDLE_EXIT_S * 1000))
    sock.bind(endpoint)
    write_ready(sock, ready_file)
    copy = size < ZERO_COPY_MIN_BYTES
    target = np.empty(size // 4, F32)
    square = np.empty(size // 4, F32)
    # Two gradient buffers in turn: a zero-copy reply's buffer is free again once f has received it, which
    # lockstep ensures before the next forward arrives.
    gradients = (np.empty(size // 4, F32), np.empty(size // 4, F32))
    step = 0
    try:
        while True:
            try:
                ident, header, *tensor = sock.recv_multipart(copy=copy)
            except zmq.Again:
                return
            magic, kind, run, sent_step, _ = HEADER.unpack_from(header if copy else header.buffer)
            if kind == QUIT:
                return
            if magic != MAGIC or kind != FORWARD or run != RUN or sent_step != step or len(tensor) != 1:
                raise RuntimeError(f"unexpected message: kind {kind}, step {sent_step} (expected {step})")
            pred = _checked_tensor(tensor[0], size, "activation")
            target.fill(1.0)
            diff = np.subtract(pred, target, out=gradients[step % 2])
            np.multiply(diff, diff, out=square)
            loss = F32(np.add.reduce(square, axis=None, dtype=F32))
            diff *= F32(2)
            sock.send(ident if copy else ident.bytes, zmq.SNDMORE)
            sock.send(HEADER.pack(MAGIC, BACKWARD, RUN, step, loss), zmq.SNDMORE)
            sock.send(diff, 0, copy=copy)
            step += 1
    finally:
        sock.close(0)
        ctx.term()


def drive_f(endpoint: str, size: int, steps: int) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, WAIT_MS)
    sock.connect(endpoint)
    copy = size < ZERO_COPY_MIN_BYTES

    def one_step(step: int) -> None:
        x = np.full(size // 4, 1.0, F32)             # the batch (distgrad's ramp makes one each step too)
        sock.send(HEADER.pack(MAGIC, FORWARD, RUN, step, 0.0), zmq.SNDMORE)
        sock.send(x, 0, copy=copy)
        try:
            header, *tensor = sock.recv_multipart(copy=copy)
        except zmq.Again:
            raise RuntimeError(f"no reply from {endpoint} within {WAIT_MS / 1000:g} s") from None
        magic, kind, run, got, _ = HEADER.unpack_from(header if copy else header.buffer)
        if magic != MAGIC or kind != BACKWARD or run != RUN or got != step or len(tensor) != 1:
            raise RuntimeError(f"unexpected reply: kind {kind}, step {got} (expected {step})")
        _checked_tensor(tensor[0], size, "gradient")  # the identity's backward passes it on: nothing to do

    drive(ctx, sock, one_step, steps, HEADER.pack(MAGIC, QUIT, RUN, 0, 0.0))


if __name__ == "__main__":
    sys.exit(run_role(sys.argv[1:], serve_g, drive_f, __doc__))
