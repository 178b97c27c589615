"""Constants and small helpers every part of the benchmark shares."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent.parent    # the checkout
HERE = Path(__file__).resolve().parent.parent    # benchmarks/: the helper scripts

KIB, MIB = 1024, 1024 * 1024
SIZES = [4, 4 * KIB, 256 * KIB, 4 * MIB, 64 * MIB]
QUICK_SIZES = [4, 256 * KIB, 4 * MIB]
BATCHES = [1, 32, 256]
MICRO_BATCHES = [2, 4, 8]
HIDDEN = 256                           # mlp-classify's activation width
COMPUTE_MIN_S = 0.5                    # how long _peers.py stage-compute times each call
SPIN_US = 1000                         # --spin-us for the spin-before-block variants
SPIN_SIZES_MAX = 4 * KIB               # message sizes that get a spin variant (the small-message target)
READY_TIMEOUT_S = 60.0                 # a server must write its ready file within this
STOP_GRACE_S = 3.0                     # after SIGTERM, before SIGKILL
TICK_S = 0.05                          # polling interval while a measured process runs
STARTUP_ALLOWANCE_S = 60.0             # per measurement, on top of its expected running time
BIG_SUMMARY_BYTES = 16 * MIB           # summaries larger than this are scanned, not parsed
TORCH_VENV_PYTHON = Path("/tmp/distgrad-torch/bin/python")
BLAS_OVERRIDES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
BALANCED = {"f": [("dense", 784, 1024), ("relu",)],
            "g": [("dense", 1024, 784), ("relu",), ("dense", 784, 10)], "batch": 256}
# The same split at a 4x bigger batch: its micro-batches at M = 4 have the 256 rows of the batch-256
# split's whole batch, so splitting does not make numpy's matmuls less efficient (see docs/performance-archive.md).
BALANCED_BIG_BATCH = 1024
WIDE = {"f": [("dense", 784, 8192), ("relu",)], "g": [("dense", 8192, 10)], "batch": 256}
# --smoke: every variant of every section once, at sizes that take seconds in all (tests/test_benchmarks.py).
SMOKE = {"target_s": 0.01, "sizes": [4], "transports": ["tcp"], "batches": [32], "micro_batches": [2],
         "schedules": ["1f1b"], "balanced_batch": 8, "memory_steps": 3, "compute_min_s": 0.01,
         "balanced": {"f": [("dense", 784, 32), ("relu",)], "g": [("dense", 32, 16), ("relu",), ("dense", 16, 10)]},
         "wide": {"f": [("dense", 784, 32), ("relu",)], "g": [("dense", 32, 10)], "batch": 16}}

# Initial guesses of seconds per step (or round trip); after a variant's first
# measurement its own last figure is used to size the next one.
EST_DISTGRAD_SCALE = {4: 6e-4, 4 * KIB: 6e-4, 256 * KIB: 2e-3, 4 * MIB: 1.2e-2, 64 * MIB: 0.3}
EST_INPROC_SCALE = {4: 1e-4, 4 * KIB: 1e-4, 256 * KIB: 5e-4, 4 * MIB: 8e-3, 64 * MIB: 0.2}
EST_MLP = {1: 6e-4, 32: 1.2e-3, 256: 6e-3}


class BenchError(RuntimeError):
    """A measurement could not be taken (a process failed, missed its deadline, printed nothing)."""


class Terminated(BaseException):
    """Raised by the SIGTERM handler: unwinds through every ``finally``, which stops the children."""


def on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
