"""How many threads distgrad's computation runs on: one, in every process and whatever the environment.

Two rules, one module:

* ``pin_blas_threads`` sets the thread-count variables that BLAS and OpenMP
  pools read when they load (``BLAS_THREAD_VARIABLES``), so that a stage
  process starts no pool threads it will not use and two stages on two
  cores do not fight over them. It imports nothing, so a front end can call
  it before numpy is first imported.
* ``one_compute_thread`` is what makes results equal: a pool's thread count
  changes how a matmul or a reduction is split, hence its float32 rounding,
  so a run in one process is bitwise the run over processes only when both
  compute on the same count. Every computation of a run (``train_in_process``,
  a stage process's serving loop and driver, the prediction paths) runs
  inside it: at run time, through threadpoolctl (a well-kept library for
  exactly this), every BLAS and OpenMP pool loaded in the process, and
  torch's intra-op pool when torch is loaded, compute on one thread, whatever
  ``OPENBLAS_NUM_THREADS`` or ``OMP_NUM_THREADS`` said when they loaded and
  whatever imported numpy first. A pool loaded later inside it is not
  limited: numpy is loaded on entry, and ``distgrad.stage.torch_stage`` sets torch
  to one thread when it is imported.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator, MutableMapping

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                         "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS")


def pin_blas_threads(env: MutableMapping[str, str] | None = None, override: bool = False) -> None:
    """Set every variable of ``BLAS_THREAD_VARIABLES`` in ``env`` (default: this process's) to one thread;
    without ``override``, a value already there wins (the user chose it: it sizes the pools, while
    ``one_compute_thread`` still computes on one thread)."""
    env = os.environ if env is None else env
    for name in BLAS_THREAD_VARIABLES:
        if override:
            env[name] = "1"
        else:
            env.setdefault(name, "1")


def one_torch_thread(torch: Any) -> None:
    """Set ``torch``'s intra-op pool (and the MKL and OpenMP pools torch drives) to one thread."""
    torch.set_num_threads(1)


@contextlib.contextmanager
def one_compute_thread() -> Iterator[None]:
    """While inside, every BLAS and OpenMP pool loaded, and torch's, computes on one thread; leaving restores
    the counts found on entry. Usable as a decorator.

    Enter it in the thread that computes: OpenMP and MKL limits are the calling thread's. OpenBLAS's and
    torch's pools are the process's, shared by its threads (``distgrad.api`` may serve a stage in one
    thread and drive another in the next): threadpoolctl lets the first thread inside set OpenBLAS's, and
    a thread leaving restores them for all.
    """
    import numpy  # noqa: F401  (loads numpy's BLAS, so that its pool is among those limited)
    from threadpoolctl import threadpool_limits

    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    with threadpool_limits(limits=1):
        if torch is not None:
            one_torch_thread(torch)
        try:
            yield
        finally:
            if torch is not None:
                torch.set_num_threads(torch_threads)
