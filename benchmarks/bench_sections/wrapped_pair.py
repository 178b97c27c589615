"""Two stage processes of one experiment, each run under a script's own wrapper (``SCRIPT --child OUT -- g|f
...``): the harness of ``copies.py`` and ``timeline.py``, which wrap distgrad's functions inside the stage
processes to count or time them."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from distgrad.run.launcher import pinned_env

from .common import BLAS_OVERRIDES

READY_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 300.0


def bench_env(root: Path) -> dict[str, str]:
    """The environment of a benchmark's child: one BLAS thread, numpy's native kernel, ``root`` importable."""
    env = pinned_env()
    for name in BLAS_OVERRIDES:
        env.pop(name, None)
    env["PYTHONPATH"] = str(root)
    return env


def wait_ready(ready: Path, proc: subprocess.Popen, what: str) -> str:
    """The endpoint ``proc`` wrote to ``ready``; raises ``RuntimeError`` if it exits or takes too long."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not (ready.exists() and ready.read_text().strip()):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{what} did not start")
        time.sleep(0.05)
    return ready.read_text().strip()


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_wrapped_pair(script: Path, experiment: Path, steps: int, workdir: Path, tag: str,
                     env: dict[str, str]) -> dict[str, Path]:
    """Run stage g (bound on tcp 127.0.0.1) and stage f of ``experiment`` for ``steps`` steps, each as
    ``python SCRIPT --child OUT -- g|f ...``, to the end; return each side's ``OUT`` (``workdir/SIDE-TAG.json``).
    Raises ``RuntimeError`` naming the log of a stage that fails; both are stopped in any case."""
    ready = workdir / f"g-{tag}.ready"
    ready.unlink(missing_ok=True)
    outs = {side: workdir / f"{side}-{tag}.json" for side in "gf"}
    me = [sys.executable, str(script)]
    common = ["--experiment", str(experiment), "--steps", str(steps), "--timeout", "60", "--log-level", "WARNING"]
    logs = {side: open(workdir / f"{side}-{tag}.log", "w") for side in "gf"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["g"] = subprocess.Popen([*me, "--child", str(outs["g"]), "--", "g", *common, "--bind",
                                       "tcp://127.0.0.1:*", "--ready-file", str(ready)],
                                      env=env, stdout=subprocess.DEVNULL, stderr=logs["g"])
        endpoint = wait_ready(ready, procs["g"], f"the g stage (see {workdir / f'g-{tag}.log'})")
        procs["f"] = subprocess.Popen([*me, "--child", str(outs["f"]), "--", "f", *common, "--connect", endpoint],
                                      env=env, stdout=subprocess.DEVNULL, stderr=logs["f"])
        for side in "fg":
            if procs[side].wait(RUN_TIMEOUT_S) != 0:
                raise RuntimeError(f"stage {side} exited {procs[side].returncode}; "
                                   f"see {workdir / f'{side}-{tag}.log'}")
    finally:
        for proc in procs.values():
            stop(proc)
        for log in logs.values():
            log.close()
    return outs


def child_argv(argv: list[str]) -> tuple[Path, list[str]] | None:
    """``(OUT, stage arguments)`` of a ``--child OUT -- ...`` command line, or None for another one."""
    if "--child" not in argv:
        return None
    at = argv.index("--child")
    rest = argv[at + 2:]
    return Path(argv[at + 1]), rest[1:] if rest[:1] == ["--"] else rest
