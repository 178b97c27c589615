"""Bitwise equality does not depend on the BLAS or OpenMP thread counts of the environment.

This test process pins its pools to one thread (conftest.py), so every run it
compares must start in a process of its own whose pools were sized by an
environment asking for two threads: a `distgrad run --in-process`, and a Python
that imported numpy before distgrad. Each must end with the parameters of the
same run over processes (whose stages the launcher pins). ``one_compute_thread``
itself is checked here too: the counts inside it, and the counts restored after.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from conftest import CLI, PROCESS_DEADLINE_S, run_cli
from distgrad.threads import BLAS_THREAD_VARIABLES, one_compute_thread

TWO_THREADS = {name: "2" for name in BLAS_THREAD_VARIABLES}


def _unpinned_env() -> dict[str, str]:
    """This process's environment with every BLAS and OpenMP pool asked for two threads."""
    return {**os.environ, **TWO_THREADS, "PYTHONUNBUFFERED": "1"}


def _run_unpinned(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=PROCESS_DEADLINE_S, cwd=cwd,
                            env=_unpinned_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr
    return result


def _assert_same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()) and names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), f"{name} differs between {a} and {b}"


@pytest.mark.parametrize("experiment, steps", [
    ("mlp-classify", 20),
    # the torch CNN's 8 steps cost about 8 s: slow (mlp-classify covers the same code path by default)
    pytest.param("digits-cnn-torch", 8, marks=[pytest.mark.slow, pytest.mark.skipif(
        importlib.util.find_spec("torch") is None, reason="torch is not installed")]),
])
def test_in_process_with_two_threads_in_the_environment_equals_processes(tmp_path, experiment, steps):
    """`OPENBLAS_NUM_THREADS=2 OMP_NUM_THREADS=2 ... distgrad run EXP --in-process` saves the parameters
    the run over processes saves, byte for byte (numpy stages, and a torch stage)."""
    _run_unpinned([*CLI, "run", experiment, "--steps", str(steps), "--in-process", "--save", tmp_path / "inproc",
                   "--progress", "off"], tmp_path)
    result = run_cli(["run", experiment, "--steps", steps, "--save", tmp_path / "procs", "--progress", "off"],
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    _assert_same_files(tmp_path / "inproc", tmp_path / "procs")


# Slow (a Python program running both, about 7 s): the pools' limit is test_one_compute_thread_limits_every_pool_and_restores_it's,
# and an unpinned in-process run against processes is test_in_process_with_two_threads_in_the_environment_equals_processes'.
@pytest.mark.slow
def test_train_in_process_after_numpy_equals_run_local(tmp_path):
    """A Python program that imports numpy first (its pools sized by an environment asking for two
    threads), then calls ``train_in_process`` and ``run_local``, gets the same parameters from both."""
    script = textwrap.dedent("""
        import json
        import sys
        import numpy                      # first: OpenBLAS starts with the environment's two threads
        from distgrad import load_experiment
        from distgrad import run_local
        from distgrad import train_in_process

        inproc = train_in_process(load_experiment("mlp-classify"), steps=20)["params"]
        local = run_local("mlp-classify", steps=20, log_level="WARNING")["params"]
        json.dump({"in_process": inproc, "run_local": local}, sys.stdout)
    """)
    result = _run_unpinned([sys.executable, "-c", script], tmp_path)
    params = json.loads(result.stdout)
    inproc, local = params["in_process"], params["run_local"]
    assert sorted(inproc) == sorted(local)
    for stage in inproc:
        for name, values in inproc[stage].items():
            assert np.array_equal(np.asarray(values, np.float32), np.asarray(local[stage][name], np.float32)), \
                f"{stage}.{name} differs"


def _counts() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info()}


def test_one_compute_thread_limits_every_pool_and_restores_it():
    """Inside, every pool loaded computes on one thread (torch's too when it is loaded, and as a
    decorator); leaving restores the counts found on entry."""
    torch = importlib.import_module("torch") if importlib.util.find_spec("torch") is not None else None

    @one_compute_thread()
    def counts_inside() -> set[int]:
        if torch is not None:
            assert torch.get_num_threads() == 1
        return _counts()

    with threadpool_limits(limits=2):
        if torch is not None:
            torch.set_num_threads(2)
        before = _counts()          # {2}, or less where a pool cannot have more threads than cores
        assert counts_inside() == {1}
        assert _counts() == before
        if torch is not None:
            assert torch.get_num_threads() == 2
