#!/usr/bin/env python
"""distgrad's own model and wire code in a bare lockstep loop, for bench.py: what a dedicated lockstep lane
built from those parts (and nothing of the driver, the serving stage, its rounds or its reply cache) could
reach, between ``_bare_identity.py`` (the floor) and a real distgrad step.

The split of ``configs.trivial_toml``'s identity model, like ``_bare_identity.py``, but each side builds its
``distgrad.stage.Stage`` from the experiment and uses distgrad's calls for everything a step of the short
lockstep path does to its data and messages: ``wire.encode`` / ``wire.decode`` (the binary header),
``transport.send_frames`` / ``transport.poll_frames``, ``Expected.receive`` (frame lengths, alignment,
finiteness), ``Stage.forward``, ``Stage.loss_backward``, ``Stage.backward``, ``Stage.check_finite`` and
``Stage.apply``. Not a protocol: no handshake, no step order beyond a comparison, no resend, no progress.

    _parts_identity.py g READY_FILE ENDPOINT BYTES
    _parts_identity.py f ENDPOINT BYTES STEPS        # prints {"steps", "elapsed_s"}
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if importlib.util.find_spec("distgrad") is None:   # bench.py puts its snapshot of distgrad on PYTHONPATH
    sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402
import zmq  # noqa: E402

from _bare_identity import drive, run_role, write_ready  # noqa: E402
from bench_sections.configs import trivial_toml  # noqa: E402
from distgrad.config.parse import load_experiment  # noqa: E402
from distgrad.stage.stage import Stage, backward_specs, forward_specs  # noqa: E402
from distgrad.wire import messages as wire  # noqa: E402
from distgrad.wire.transport import poll_frames, send_frames  # noqa: E402

RUN = "parts-identity"
WAIT_S = 30.0                      # a side that hears nothing for this long fails
IDLE_EXIT_S = 120.0                # the g side exits by itself after this long without a request
QUIT = b"quit"


def _stage(size: int, name: str) -> Stage:
    with tempfile.TemporaryDirectory(prefix="distgrad-parts-") as tmp:
        path = Path(tmp) / f"trivial-{size}.toml"
        path.write_text(trivial_toml(size))
        exp = load_experiment(str(path))
    return Stage.from_experiment(exp, name, exp.seed)


def serve_g(ready_file: str, endpoint: str, size: int) -> None:
    stage = _stage(size, "g")
    forward = forward_specs(stage, None, 1)
    target = np.empty(size // 4, np.float32)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    write_ready(sock, ready_file)
    step = 0
    try:
        while True:
            frames = poll_frames(sock, IDLE_EXIT_S, copy_first=True)
            if frames is None or bytes(frames[1]) == QUIT:
                return
            msg = wire.decode(frames[1:])
            if msg.type != wire.FORWARD or msg.run != RUN or msg.step != step:
                raise RuntimeError(f"unexpected {msg.describe()} (expected the forward of step {step})")
            activation = forward.receive(msg, False)
            y, cache = stage.forward(activation)
            target.fill(1.0)
            loss, dy = stage.loss_backward(y, target)
            dx, grads = stage.backward(cache, dy)
            stage.check_finite("activation_grad", dx, step)
            reply = wire.Message(wire.BACKWARD, RUN, step, 0, 1, body={"loss": float(loss)},
                                 tensors={"activation_grad": dx})
            send_frames(sock, wire.encode(reply), [frames[0]])
            stage.apply(grads)
            step += 1
    finally:
        sock.close(0)
        ctx.term()


def drive_f(endpoint: str, size: int, steps: int) -> None:
    stage = _stage(size, "f")
    backward = backward_specs(stage, 1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)

    def one_step(step: int) -> None:
        x = np.full(size // 4, 1.0, np.float32)          # the batch, as _bare_identity.py makes it
        y, cache = stage.forward(x)
        send_frames(sock, wire.encode(wire.Message(wire.FORWARD, RUN, step, 0, 1, tensors={"activation": y})))
        frames = poll_frames(sock, WAIT_S)
        if frames is None:
            raise RuntimeError(f"no reply from {endpoint} within {WAIT_S:g} s")
        msg = wire.decode(frames)
        if msg.type != wire.BACKWARD or msg.run != RUN or msg.step != step:
            raise RuntimeError(f"unexpected {msg.describe()} (expected the backward of step {step})")
        _, grads = stage.backward(cache, backward.receive(msg, False), need_dx=False)
        stage.apply(grads)

    drive(ctx, sock, one_step, steps, QUIT)


if __name__ == "__main__":
    sys.exit(run_role(sys.argv[1:], serve_g, drive_f, __doc__))
