"""A label owner's own loop through the cut library's ``CutServer``, in a process of its own, serving run after
run on one endpoint as ``distgrad-stage g --keep-serving`` does: the cut library's serving end in the
hostile-peer tests (tests/hostile_ends.py).

    python cut_serving.py READY_FILE SUMMARY_FILE LIVENESS_S [CURVE_SECRET ALLOW_DIR]

The interface is ``INTERFACE``: batches of one row of one float32 feature, so a forward's activation is one
float32, as seed-reverse's is at a daemon. The loop keeps a parameter ``w`` that each step changes
(``train``), so a step that should not have been taken shows in every later loss and gradient. When a run
ends (its bye, its data owner's aborted notice, a failure of the loop) its outcome is written to
SUMMARY_FILE, whole, as JSON: ``{"run_id", "steps", "status", "w", "losses"}``; then a new ``CutServer``
binds the same endpoint with a fresh ``w`` for the next run. The endpoint is written to READY_FILE once bound,
and the number of servers bound so far to READY_FILE with the suffix ``.binds`` (a test waits on it for the
next server after a run's end).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np

INTERFACE = dict(name="hostile-cut", stages=["f", "g"], batch=1, activation=[1], steps=1_000_000, seed=0)
PEER_DEADLINE_S = 3600.0     # a silent data owner is the test's to end; the loop never times out under it
W0 = np.float32(0.25)
REBIND_S = 10.0


def fresh_w() -> np.ndarray:
    return np.full((1, 1), W0, np.float32)


def train(w: np.ndarray, h: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
    """One step of the loop's own model on activation ``h``: ``(loss, d(loss)/dh, the new w)``, float32
    throughout and bounded for any finite ``h`` (a hostile activation cannot make it overflow)."""
    t = np.tanh(h).astype(np.float32)
    loss = float(np.sum(t * w, dtype=np.float32))
    grad = ((np.float32(1) - t * t) * w).astype(np.float32)
    return loss, grad, (np.float32(0.5) * w + np.float32(0.5) * t).astype(np.float32)


def _write(path: Path, text: str) -> None:
    """``text`` into ``path``, whole: a reader never sees it half written."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _bind(endpoint: str, settings: dict):
    """A ``CutServer`` at ``endpoint``; the last one's socket may hold the port for a moment after it closed
    (ZeroMQ releases it in the background), so a busy port is tried again for up to ``REBIND_S``."""
    from distgrad.cut import CutServer
    from distgrad.errors import ConfigError

    deadline = time.monotonic() + REBIND_S
    while True:
        try:
            return CutServer.bind(endpoint, **settings)
        except ConfigError as e:
            if "in use" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def serve(ready: Path, summary: Path, liveness_s: float, curve: dict) -> None:
    endpoint, binds = "tcp://127.0.0.1:*", 0
    while True:
        server = _bind(endpoint, dict(liveness_s=liveness_s, peer_deadline_s=PEER_DEADLINE_S, **curve, **INTERFACE))
        if endpoint.endswith("*"):
            endpoint = server.endpoint
            _write(ready, endpoint)
        binds += 1
        _write(ready.with_suffix(".binds"), str(binds))
        w, losses, status = fresh_w(), [], "completed"
        try:
            with server:
                for batch in server:
                    loss, grad, w = train(w, batch.h)
                    losses.append(loss)
                    batch.reply(loss, grad)
        except Exception as e:        # the run's end, whatever it was; the next run is served all the same
            status = f"{type(e).__name__}: {e}"
            logging.getLogger("cut_serving").warning("run %s ended: %s", server.run_id, status)
        if server.run_id:
            _write(summary, json.dumps({"run_id": server.run_id, "steps": server.step, "status": status,
                                        "w": w.tolist(), "losses": losses}))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    args = sys.argv[1:]
    keys = dict(curve_secret=args[3], allow=args[4]) if len(args) > 3 else {}
    serve(Path(args[0]), Path(args[1]), float(args[2]), keys)
