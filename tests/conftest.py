"""Fixtures for tests that start real stage processes over real sockets.

Every process is started through ``StageProcess``, which always stops it
(SIGTERM, then SIGKILL after a grace period) and reaps it; every wait has a
deadline; every ZeroMQ socket made by a test is closed with linger 0.
"""

from __future__ import annotations

import os

# Pin BLAS pools before numpy loads, as the launcher does for every stage, so any
# reference computed in this process uses the same kernels as the stage processes.
for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import zmq

from distgrad.launcher import pinned_env, stop_process

CLI = [sys.executable, "-m", "distgrad.cli"]
REQUIRE_VARIABLE = "DISTGRAD_REQUIRE"     # comma-separated modules whose absence fails the run instead of skipping


def pytest_configure(config: pytest.Config) -> None:
    """Where the environment promises optional modules (CI installs torch), a missing one is an error:
    without this its tests would be skipped and the run would still pass."""
    import importlib

    for name in filter(None, (n.strip() for n in os.environ.get(REQUIRE_VARIABLE, "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken install raising anything else
            pytest.exit(f"{REQUIRE_VARIABLE} names {name!r} but it cannot be imported "
                        f"({type(e).__name__}: {e}); its tests would be skipped", returncode=3)
STAGE_CLI = [*CLI, "stage"]
BIN = Path(sys.executable).parent
PROCESS_DEADLINE_S = 60.0


def run_cli(args: Sequence[str], timeout: float = PROCESS_DEADLINE_S, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``distgrad ARGS`` to completion (bounded) and return the result with text output."""
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=pinned_env(), cwd=cwd, stdin=subprocess.DEVNULL)


class StageProcess:
    """A ``distgrad-stage`` process whose output goes to a log file; always stopped on exit."""

    def __init__(self, args: Sequence[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([*STAGE_CLI, *map(str, args)], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=pinned_env())

    @property
    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait(self, timeout: float = PROCESS_DEADLINE_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stage process did not exit within {timeout} s; output:\n{self.output}")

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()

    def __enter__(self) -> "StageProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StageGroup:
    """The stage processes of one run, each restartable with its command line ``args[name]``.

    Every wait has a deadline; ``stop`` stops every process (the ``stage_group`` fixture calls it).
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.args: dict[str, list] = {}
        self.procs: dict[str, StageProcess] = {}
        self.starts: dict[str, int] = {}

    def start(self, name: str) -> None:
        self.starts[name] = self.starts.get(name, 0) + 1
        self.procs[name] = StageProcess(self.args[name], self.tmp / f"{name}.{self.starts[name]}.log")

    def lines(self, trace: str) -> int:
        """Lines (steps) in the trace file ``tmp_path/trace`` so far."""
        try:
            return len((self.tmp / trace).read_text().splitlines())
        except FileNotFoundError:
            return 0

    def wait_until(self, condition, what: str, timeout: float = 30.0, all_running: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.logs()}"
            if all_running:
                for proc in self.procs.values():
                    assert proc.proc.poll() is None, f"a stage exited early:\n{self.logs()}"
            time.sleep(0.002)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.tmp.glob("*.log")))

    def wait_all(self, timeout: float = 60.0) -> None:
        """Wait for every process to exit, and fail unless each exits 0."""
        for name, proc in self.procs.items():
            code = proc.wait(timeout)
            assert code == 0, f"{name} exited {code}:\n{self.logs()}"

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


@pytest.fixture
def stage_group():
    """A factory ``stage_group(GroupClass, *args)``; every group made is stopped afterwards."""
    made: list[StageGroup] = []

    def make(cls: type, *args, **kwargs) -> StageGroup:
        made.append(cls(*args, **kwargs))
        return made[-1]

    yield make
    for group in made:
        group.stop()


def wait_for_file(path: Path, proc: StageProcess, timeout: float = 30.0) -> str:
    """Contents of ``path`` once it exists; fails if ``proc`` exits or time runs out first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.proc.poll() is not None:
            pytest.fail(f"process exited with {proc.proc.returncode} before writing {path}:\n{proc.output}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} not written within {timeout} s:\n{proc.output}")
        time.sleep(0.02)
    return path.read_text().strip()


@pytest.fixture
def start_server(tmp_path: Path):
    """Start a serving stage bound to a free port; yields ``(process, endpoint)`` via a factory."""
    started: list[StageProcess] = []

    def start(experiment: str, *extra: str, stage: str = "g", bind: str = "tcp://127.0.0.1:*",
              name: str = "g") -> tuple[StageProcess, str]:
        ready = tmp_path / f"{name}.ready"
        proc = StageProcess([stage, "--experiment", experiment, "--bind", bind, "--ready-file", ready, *extra],
                            tmp_path / f"{name}.log")
        started.append(proc)
        return proc, wait_for_file(ready, proc)

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    """A private context; every socket it made is closed with linger 0 afterwards."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def hello_message(exp, run: str, **changes):
    """A valid hello from a fresh driving stage of ``exp``; ``changes`` replace body fields."""
    from distgrad import wire
    from distgrad.experiment import fingerprint_parts
    from distgrad.stage import Stage

    first = Stage.from_experiment(exp, exp.stage_names[0])
    body = {"role": first.name, "experiment": exp.name, "fingerprint": exp.fingerprint,
            "parts": fingerprint_parts(exp), "seed": exp.seed,
            "activation": {"shape": list(first.output_shape), "dtype": "float32"},
            "labels_travel": exp.labels_travel, "steps": exp.steps, "step": 0, "held": [0]}
    body.update(changes)
    return wire.Message(wire.HELLO, run, 0, body=body)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

