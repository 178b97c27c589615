"""The one list of thread-count variables that BLAS and OpenMP pools read when numpy loads.

Two stages on two cores must not fight over their cores, and a fixed thread
count keeps every process's float32 results identical, so every stage process
runs its pools with one thread. This module imports nothing, so a front end
can pin the pools before numpy is first imported.
"""

from __future__ import annotations

import os
from typing import MutableMapping

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")


def pin_blas_threads(env: MutableMapping[str, str] | None = None, override: bool = False) -> None:
    """Set every variable of ``BLAS_THREAD_VARIABLES`` in ``env`` (default: this process's) to one thread;
    without ``override``, a value already there wins (the user chose it)."""
    env = os.environ if env is None else env
    for name in BLAS_THREAD_VARIABLES:
        if override:
            env[name] = "1"
        else:
            env.setdefault(name, "1")
