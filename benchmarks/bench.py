#!/usr/bin/env python
"""distgrad performance, as ratios against the physical limit and against other ways to do the same.

    .venv/bin/python benchmarks/bench.py --json out.json [--quick]

Not part of the test suite. One run measures:

A. the message path, activation sizes 4 B .. 64 MiB (the gradient coming back
   is the same size), over tcp (127.0.0.1) and ipc: a bare pyzmq round trip
   (DEALER -> ROUTER echo, ~60-byte header + one raw frame each way, zero-copy
   at >= 64 KiB), distgrad's wire path alone (``transport.Client.request``
   against ``transport.Server`` + ``wire.decode``/``encode``, no model), a
   real distgrad step (``distgrad-stage g`` / ``distgrad-stage f`` on a
   generated experiment with trivial compute: an ``identity`` layer on each
   side over N = bytes/4 floats, sum of squared errors, no parameters to
   update) and the same model trained in one process (its compute alone);
B. the mlp-classify split (Dense 784->256 + ReLU | Dense 256->10 + softmax CE)
   at batch 1, 32 and 256: distgrad unpipelined, pipelined (1f1b and gpipe,
   M = 2, 4, 8), in one process, a bare raw-frame numpy split, a torch gloo
   split (when an interpreter with torch is found) and the lockstep ideal
   (in-process step + one raw round trip of the same frames); then a split
   whose stages cost about the same, pipelined at M = 4 and 8;
C. the f-stage's peak RSS under 1f1b and gpipe at M = 8, batch 256.

The machine is shared and noisy: within each group the variants are
interleaved (their order rotates every repeat), each is repeated and the
median is reported. Every process started gets ``distgrad.launcher.pinned_env()``
(one BLAS thread) and a deadline, and is stopped (SIGTERM, then SIGKILL) in a
``finally``. By default OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are removed from
the children's environment so numpy runs its native kernel (see
``--inherit-blas-env``). Exit codes: 0 ok; 1 a measurement failed (the others
are still reported); 2 usage; 130 / 143 stopped by SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, TextIO

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:          # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from distgrad.launcher import pinned_env  # noqa: E402

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
# split's whole batch, so splitting does not make numpy's matmuls less efficient (see performance.md).
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


class _Terminated(BaseException):
    """Raised by the SIGTERM handler: unwinds through every ``finally``, which stops the children."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def say(text: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---------------------------------------------------------------- processes

PROGRESS_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*\bstep (\d+)/(\d+) loss")


def _log_time(stamp: str) -> float:
    """Seconds since the epoch of a logging ``asctime`` (``2026-01-01 12:00:00,123``, local time)."""
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read_status(pid: int) -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (KiB) of ``pid``; empty once it is gone."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line.split(":")[0]] = int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


class Proc:
    """A child process with stdout and stderr in files; ``stop()`` always stops and reaps it."""

    def __init__(self, runner: "Runner", name: str, argv: list[str], env: dict[str, str]) -> None:
        runner.seq += 1
        stem = runner.logdir / f"{runner.seq:04d}-{name}"
        self.name, self.out_path, self.err_path = name, stem.with_suffix(".out"), stem.with_suffix(".log")
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        try:
            self.proc = subprocess.Popen(argv, stdout=self._out, stderr=self._err, stdin=subprocess.DEVNULL,
                                         env=env, cwd=runner.src)
        except BaseException:
            self._out.close()
            self._err.close()
            raise
        self.started = time.monotonic()
        runner.live.append(self)
        self._runner = runner

    def wait(self, deadline: float, on_tick: Callable[[], None] | None = None) -> int:
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name} still running at its deadline; killed\n{self.tail()}")
            if on_tick is not None:
                on_tick()
            time.sleep(TICK_S)
        return self.proc.returncode

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        for f in (self._out, self._err):
            if not f.closed:
                f.close()
        if self in self._runner.live:
            self._runner.live.remove(self)

    def json_line(self) -> dict[str, Any]:
        """The last JSON line the process printed on stdout."""
        self._out.flush()
        for line in reversed(self.out_path.read_text(errors="replace").splitlines()):
            if line.startswith("{"):
                return json.loads(line)
        raise BenchError(f"{self.name} printed no result\n{self.tail()}")

    def tail(self, lines: int = 12) -> str:
        text = []
        for path in (self.out_path, self.err_path):
            try:
                text += path.read_text(errors="replace").splitlines()
            except OSError:
                pass
        return "\n".join(f"  [{self.name}] {line}" for line in text[-lines:])


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_summary(path: Path) -> dict[str, Any]:
    """``steps`` and ``elapsed_s`` of a summary; a huge one (a 64 MiB model's parameters) is scanned."""
    if not path.exists():
        raise BenchError(f"no summary at {path}")
    if path.stat().st_size <= BIG_SUMMARY_BYTES:
        data = json.loads(path.read_text())
        return {"steps": data["steps"], "elapsed_s": data["elapsed_s"], "cpu_s": data.get("cpu_s")}
    text = path.read_bytes()
    found = {key: re.search(rb'"%s":\s*([0-9.eE+-]+)' % key.encode(), text)
             for key in ("steps", "elapsed_s", "cpu_s")}
    if not (found["steps"] and found["elapsed_s"]):
        raise BenchError(f"summary {path} has no steps / elapsed_s")
    return {"steps": int(found["steps"].group(1)), "elapsed_s": float(found["elapsed_s"].group(1)),
            "cpu_s": float(found["cpu_s"].group(1)) if found["cpu_s"] else None}


# ---------------------------------------------------------------- experiments

def _layer_toml(layer: tuple, index: int, prefix: str) -> str:
    if layer[0] == "dense":
        return f'{{ type = "dense", name = "{prefix}{index}", in = {layer[1]}, out = {layer[2]} }}'
    if layer[0] == "scale":
        return f'{{ type = "scale", name = "{prefix}{index}", size = {layer[1]}, init = 1.0 }}'
    return f'{{ type = "{layer[0]}" }}'


def mlp_toml(name: str, f: list[tuple], g: list[tuple], batch: int) -> str:
    """A classification experiment like mlp-classify with these layers and batch size."""
    def model(layers: list[tuple], prefix: str) -> str:
        return ",\n  ".join(_layer_toml(layer, i + 1, prefix) for i, layer in enumerate(layers))
    return f'''name = "{name}"
steps = 100
seed = 0
labels = "last"

[data]
kind = "synthetic_classification"
samples = {max(2048, 4 * batch)}
features = 784
classes = 10
batch = {batch}
spread = 4.0

[[stages]]
name = "f"
model = [
  {model(f, "f")},
]
optimizer = {{ type = "adam", lr = 0.001 }}

[[stages]]
name = "g"
model = [
  {model(g, "g")},
]
optimizer = {{ type = "adam", lr = 0.001 }}
loss = "softmax_cross_entropy"
'''


def trivial_toml(size_bytes: int) -> str:
    """Trivial compute over N = bytes/4 floats: an ``identity`` layer on each stage, sum of squared errors.

    No stage has a parameter, so no optimiser runs, and the identity layers
    pass arrays through without touching them. What remains per step is the
    least a split step does to its data: f makes its batch (the activation
    sent), g its target, the loss and its gradient (the array sent back), and
    both validate what they receive. (The earlier "trivial" model, one ``scale`` layer of N
    weights on each stage with SGD, spent a dozen element-wise passes over N
    floats per step on its weights, which made the large-message figures
    measure numpy, not the transport.) The ramp's delta is 0 (x = 1 every
    step), so the loss is 0 and every run stays finite.
    """
    n = max(1, size_bytes // 4)
    return f'''name = "bench-trivial-{size_bytes}"
steps = 100
seed = 0
labels = "last"

[data]
kind = "ramp"
start = 1.0
delta = 0.0
size = {n}

[[stages]]
name = "f"
model = [{{ type = "identity" }}]
optimizer = {{ type = "sgd", lr = 0.01 }}

[[stages]]
name = "g"
model = [{{ type = "identity" }}]
optimizer = {{ type = "sgd", lr = 0.01 }}
loss = "sum_squared_error"
'''


# ---------------------------------------------------------------- measurements

@dataclass
class Variant:
    """One measured configuration; ``fn(steps or seconds)`` returns a dict with ``t`` (seconds per step)."""

    key: str
    fn: Callable[[float], dict[str, Any]]
    est_s: float = 1e-3
    timed: bool = False            # fn takes a duration (round-trip clients) instead of a step count
    min_steps: int = 3
    max_steps: int = 20000
    samples: list[dict[str, Any]] = field(default_factory=list)
    failed: str | None = None

    def measure(self, target_s: float) -> dict[str, Any]:
        arg = target_s if self.timed else max(self.min_steps, min(self.max_steps, round(target_s / self.est_s)))
        result = self.fn(arg)
        self.est_s = result["t"]
        self.samples.append(result)
        return result

    @property
    def t(self) -> float | None:
        return median([s["t"] for s in self.samples])


class Runner:
    def __init__(self, workdir: Path, src: Path, env: dict[str, str], torch_python: str | None, repeats: int,
                 target_s: float) -> None:
        self.workdir, self.src, self.env, self.torch_python = workdir, src, env, torch_python
        self.repeats, self.target_s = repeats, target_s
        self.compute_min_s = COMPUTE_MIN_S
        self.logdir = workdir / "logs"
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.expdir = workdir / "experiments"
        self.expdir.mkdir(exist_ok=True)
        self.live: list[Proc] = []
        self.seq = 0
        self.failures: list[dict[str, str]] = []
        self.servers: dict[tuple[str, str], tuple[Proc, str]] = {}

    # -- plumbing

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        return Proc(self, name, argv, env or self.env)

    def run_json(self, name: str, argv: list[str], timeout_s: float, env: dict[str, str] | None = None) -> dict:
        proc = self.spawn(name, argv, env)
        try:
            code = proc.wait(time.monotonic() + timeout_s)
            if code != 0:
                raise BenchError(f"{name} exited with code {code}\n{proc.tail()}")
            return proc.json_line()
        finally:
            proc.stop()

    def wait_ready(self, proc: Proc, ready: Path) -> str:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if ready.exists():
                text = ready.read_text().strip()
                if text:
                    return text
            if proc.proc.poll() is not None:
                raise BenchError(f"{proc.name} exited with code {proc.proc.returncode} before it was ready\n"
                                 f"{proc.tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{proc.name} wrote no endpoint within {READY_TIMEOUT_S:g} s\n{proc.tail()}")
            time.sleep(0.02)

    def bind_endpoint(self, transport: str, name: str) -> str:
        return "tcp://127.0.0.1:*" if transport == "tcp" else f"ipc://{self.workdir}/{name}.sock"

    def write_experiment(self, name: str, text: str) -> Path:
        path = self.expdir / f"{name}.toml"
        path.write_text(text)
        return path

    def stop_all(self) -> None:
        for proc in reversed(list(self.live)):
            proc.stop()

    # -- echo servers (kept for the whole run)

    def server(self, role: str, transport: str) -> str:
        key = (role, transport)
        known = self.servers.get(key)
        if known is not None and known[0].proc.poll() is not None:
            say(f"{role} over {transport} exited with code {known[0].proc.returncode}; starting it again")
            known[0].stop()
            known = None
        if known is None:
            ready = self.workdir / f"{role}-{transport}.ready"
            ready.unlink(missing_ok=True)
            proc = self.spawn(f"{role}-{transport}", [sys.executable, str(HERE / "_peers.py"), role, str(ready),
                                                      self.bind_endpoint(transport, f"{role}-{transport}")])
            known = self.servers[key] = (proc, self.wait_ready(proc, ready))
        return known[1]

    def round_trip(self, role: str, transport: str, size: int, seconds: float) -> dict[str, Any]:
        endpoint = self.server(f"{role}-server", transport)
        r = self.run_json(f"{role}-client-{transport}-{size}",
                          [sys.executable, str(HERE / "_peers.py"), f"{role}-client", endpoint, str(size),
                           str(seconds)], STARTUP_ALLOWANCE_S + 10 * seconds)
        return {"t": r["rt_s"], "round_trips": r["round_trips"], "elapsed_s": r["elapsed_s"]}

    # -- distgrad

    def distgrad_pair(self, experiment: Path, steps: int, transport: str = "tcp", driver_flags: tuple = (),
                      expected_s: float = 5.0, extra_s: float = 0.0, stage_flags: tuple = (),
                      cpu: bool = False) -> dict[str, Any]:
        """One run of the two stage processes; the driver's summary gives ``elapsed_s``.

        ``stage_flags`` go to both stages. With ``cpu``, g writes a summary too
        (cheap only for a small g) and ``cores`` is the CPU time both processes
        used (every thread) over the driver's elapsed time.

        The f-stage's VmRSS / VmHWM are sampled every tick together with the last
        progress line it logged, so the training loop's part can be told apart
        from start-up and the summary write.
        """
        tag = f"{experiment.stem}-{transport}-{'-'.join(map(str, driver_flags + stage_flags)) or 'm1'}"
        ready, summary = self.workdir / f"{tag}.ready", self.workdir / f"{tag}.f.json"
        g_summary = self.workdir / f"{tag}.g.json"
        for path in (ready, summary, g_summary):
            path.unlink(missing_ok=True)
        stage = [sys.executable, "-m", "distgrad.cli", "stage"]
        common = ["--experiment", str(experiment), "--steps", str(steps), "--timeout", "60", *map(str, stage_flags)]
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s + extra_s
        g = f = None
        samples: list[dict[str, Any]] = []
        try:
            g = self.spawn(f"g-{tag}", [*stage, "g", *common, "--bind", self.bind_endpoint(transport, tag),
                                        "--ready-file", str(ready), "--log-level", "WARNING",
                                        *(["--summary", str(g_summary)] if cpu else [])])
            endpoint = self.wait_ready(g, ready)
            f = self.spawn(f"f-{tag}", [*stage, "f", *common, "--connect", endpoint, *map(str, driver_flags),
                                        "--summary", str(summary), "--log-level", "INFO"])
            log = open(f.err_path, errors="replace")
            progress = {"step": 0, "total": steps}
            logged: list[tuple[int, float]] = []      # (step, time of its progress line)
            t0 = time.monotonic()

            def tick() -> None:
                for line in log.readlines():
                    m = PROGRESS_LINE.search(line)
                    if m:
                        progress["step"], progress["total"] = int(m.group(2)), int(m.group(3))
                        logged.append((progress["step"], _log_time(m.group(1))))
                status = read_status(f.proc.pid)
                if status:
                    samples.append({"t": round(time.monotonic() - t0, 3), "step": progress["step"],
                                     "rss_kib": status.get("VmRSS"), "hwm_kib": status.get("VmHWM")})

            try:
                code = f.wait(deadline, tick)
                tick()
            finally:
                log.close()
            if code != 0:
                raise BenchError(f"f-stage exited with code {code}\n{f.tail()}\n{g.tail()}")
            code = g.wait(min(deadline, time.monotonic() + 30))
            if code != 0:
                raise BenchError(f"g-stage exited with code {code}\n{g.tail()}")
            result = read_summary(summary)
            if cpu:
                g_cpu = read_summary(g_summary).get("cpu_s")
                if result.get("cpu_s") is not None and g_cpu is not None:
                    result["cores"] = (result["cpu_s"] + g_cpu) / result["elapsed_s"]
        finally:
            for proc in (f, g):
                if proc is not None:
                    proc.stop()
            summary.unlink(missing_ok=True)
            g_summary.unlink(missing_ok=True)
        result["t"] = result["elapsed_s"] / result["steps"]
        result["memory"] = memory_stats(samples, steps)
        # Between the driver's first and last progress lines: no handshake, first step or bye.
        if len(logged) >= 2 and logged[-1][0] > logged[0][0]:
            result["steady_t"] = (logged[-1][1] - logged[0][1]) / (logged[-1][0] - logged[0][0])
        return result

    def inprocess_cli(self, experiment: Path, steps: int, expected_s: float) -> dict[str, Any]:
        summary = self.workdir / f"{experiment.stem}.inproc.json"
        summary.unlink(missing_ok=True)
        proc = self.spawn(f"inproc-{experiment.stem}", [sys.executable, "-m", "distgrad.cli", "run", str(experiment),
                                                        "--in-process", "--steps", str(steps), "--summary",
                                                        str(summary), "--log-level", "WARNING"])
        try:
            code = proc.wait(time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s)
            if code != 0:
                raise BenchError(f"in-process run exited with code {code}\n{proc.tail()}")
            result = read_summary(summary)
        finally:
            proc.stop()
            summary.unlink(missing_ok=True)
        result["t"] = result["elapsed_s"] / result["steps"]
        return result

    def inprocess_api(self, experiment: Path, steps: int, expected_s: float) -> dict[str, Any]:
        r = self.run_json(f"inproc-{experiment.stem}", [sys.executable, str(HERE / "_peers.py"), "inprocess",
                                                        str(experiment), str(steps)],
                          STARTUP_ALLOWANCE_S + 5 * expected_s)
        return {"steps": r["steps"], "elapsed_s": r["elapsed_s"], "t": r["elapsed_s"] / r["steps"]}

    def stage_compute(self, experiment: Path, micro_batches: int) -> dict[str, Any]:
        return self.run_json(f"compute-{experiment.stem}-m{micro_batches}",
                             [sys.executable, str(HERE / "_peers.py"), "stage-compute", str(experiment),
                              str(micro_batches), str(self.compute_min_s)], STARTUP_ALLOWANCE_S + 30)

    # -- the other implementations of the same split

    def bare_pair(self, batch: int, steps: int, expected_s: float) -> dict[str, Any]:
        tag = f"bare-b{batch}"
        ready = self.workdir / f"{tag}.ready"
        ready.unlink(missing_ok=True)
        script = [sys.executable, str(HERE / "_raw_split.py")]
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s
        g = f = None
        try:
            g = self.spawn(f"g-{tag}", [*script, "g", str(ready), self.bind_endpoint("tcp", tag), str(batch),
                                        str(HIDDEN)])
            endpoint = self.wait_ready(g, ready)
            f = self.spawn(f"f-{tag}", [*script, "f", endpoint, str(batch), str(HIDDEN), str(steps)])
            code = f.wait(deadline)
            if code != 0:
                raise BenchError(f"bare f exited with code {code}\n{f.tail()}\n{g.tail()}")
            r = f.json_line()
            g.wait(min(deadline, time.monotonic() + 10))
        finally:
            for proc in (f, g):
                if proc is not None:
                    proc.stop()
        return {"steps": r["steps"], "elapsed_s": r["elapsed_s"], "t": r["elapsed_s"] / r["steps"]}

    def torch_pair(self, batch: int, steps: int, expected_s: float) -> dict[str, Any]:
        assert self.torch_python is not None
        port = free_tcp_port()
        env = dict(self.env, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
        script = [self.torch_python, str(HERE / "_torch_split.py")]
        deadline = time.monotonic() + STARTUP_ALLOWANCE_S + 5 * expected_s
        procs: list[Proc] = []
        try:
            for rank in (1, 0):
                procs.append(self.spawn(f"torch-r{rank}-b{batch}", [*script, str(rank), str(port), str(batch),
                                                                    str(HIDDEN), str(steps)], env))
            g, f = procs
            code = f.wait(deadline)
            if code != 0:
                raise BenchError(f"torch rank 0 exited with code {code}\n{f.tail()}\n{g.tail()}")
            r = f.json_line()
            code = g.wait(min(deadline, time.monotonic() + 20))
            if code != 0:
                raise BenchError(f"torch rank 1 exited with code {code}\n{g.tail()}")
        finally:
            for proc in reversed(procs):
                proc.stop()
        return {"steps": r["steps"], "elapsed_s": r["elapsed_s"], "t": r["elapsed_s"] / r["steps"],
                "torch": r.get("torch")}

    # -- scheduling

    def interleave(self, group: str, variants: list[Variant], repeats: int | None = None) -> None:
        """Each repeat runs every variant once; the order rotates by one every repeat."""
        repeats = self.repeats if repeats is None else repeats
        for rep in range(repeats):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for v in order:
                if v.failed:
                    continue
                try:
                    r = v.measure(self.target_s)
                except BenchError as e:
                    v.failed = str(e)
                    self.failures.append({"group": group, "variant": v.key, "repeat": str(rep), "error": str(e)})
                    say(f"FAILED {group} {v.key}: {str(e).splitlines()[0]}")
                    continue
                extra = f" ({r['steps']} steps)" if "steps" in r else f" ({r.get('round_trips')} round trips)"
                say(f"{group} {v.key} rep {rep + 1}/{repeats}: {fmt_time(r['t'])}{extra}")


def memory_stats(samples: list[dict[str, Any]], steps: int) -> dict[str, Any]:
    """The f-stage's memory during its training loop, from samples taken with its last progress line.

    The loop is the part between its 10% progress line (step 2 at least) and its final one
    (start-up before, the summary write after). ``loop_hwm_kib`` is VmHWM at
    the last sample of the loop: the peak up to the end of the loop, start-up
    included. ``growth_hwm_kib`` is how much that peak rose after the 10% mark:
    every step reaches the same transient peak, so it stays flat unless memory
    accumulates. ``growth_rss_kib`` compares the largest sampled RSS of the
    second half of the loop with the first (sampling may miss transients).
    """
    final_hwm = max((s["hwm_kib"] for s in samples if s.get("hwm_kib")), default=None)
    in_loop = [s for s in samples if 0 < s["step"] < steps and s.get("rss_kib")]
    # Step 1 allocates the optimiser's state only at its end, so the peak settles from step 2 on.
    loop = [s for s in in_loop if s["step"] >= max(2, steps // 10)]
    if len(loop) < 2:
        return {"samples": len(samples), "loop_samples": len(loop), "final_hwm_kib": final_hwm}
    half = (loop[0]["step"] + loop[-1]["step"]) / 2
    first = [s["rss_kib"] for s in loop if s["step"] <= half] or [loop[0]["rss_kib"]]
    second = [s["rss_kib"] for s in loop if s["step"] > half] or [loop[-1]["rss_kib"]]
    return {"samples": len(samples), "loop_samples": len(loop), "final_hwm_kib": final_hwm,
            "loop_hwm_kib": in_loop[-1]["hwm_kib"], "loop_max_rss_kib": max(first + second),
            "loop_min_rss_kib": min(first + second), "growth_hwm_kib": in_loop[-1]["hwm_kib"] - loop[0]["hwm_kib"],
            "growth_rss_kib": max(second) - max(first), "loop_steps": [loop[0]["step"], loop[-1]["step"]],
            "steps": steps}


def cores(v: Variant) -> float | None:
    """CPU time of both stage processes over the run's wall time (median over the repeats)."""
    return median([s["cores"] for s in v.samples if s.get("cores") is not None])


def fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:.1f} us"
    if t < 1:
        return f"{t * 1e3:.2f} ms"
    return f"{t:.2f} s"


def fmt_size(n: int) -> str:
    return f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB" if n >= KIB else f"{n} B"


def fmt_ratio(r: float | None, digits: int = 2) -> str:
    return "-" if r is None else f"{r:.{digits}f}x"


def fmt_rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.0f}" if r >= 100 else f"{r:.1f}"


def summarise(v: Variant) -> dict[str, Any]:
    return {"t_s": v.t, "steps_per_s": (1 / v.t) if v.t else None, "samples": v.samples, "failed": v.failed}


# ---------------------------------------------------------------- A. message path

def message_path(runner: Runner, sizes: list[int], transports: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in sizes:
        exp = runner.write_experiment(f"trivial-{size}", trivial_toml(size))
        est_dg, est_ip = EST_DISTGRAD_SCALE[size], EST_INPROC_SCALE[size]
        extra = 3.0 * size / 4 / 1e6          # start-up and the summary of N parameters take ~3 s per million
        variants: dict[str, Variant] = {}
        for tr in transports:
            for role in ("raw", "wire"):
                variants[f"{role}-{tr}"] = Variant(
                    f"{role}-{tr}", lambda s, role=role, tr=tr, size=size: runner.round_trip(role, tr, size, s),
                    timed=True)
            small = size <= SPIN_SIZES_MAX
            variants[f"distgrad-{tr}"] = Variant(
                f"distgrad-{tr}", lambda n, tr=tr, exp=exp, est=est_dg, extra=extra, small=small: runner.distgrad_pair(
                    exp, int(n), tr, expected_s=n * est, extra_s=extra, cpu=small),
                est_s=est_dg, min_steps=12 if size >= 64 * MIB else 5)
            if small:
                variants[f"spin-{tr}"] = Variant(
                    f"spin-{tr}", lambda n, tr=tr, exp=exp, est=est_dg: runner.distgrad_pair(
                        exp, int(n), tr, expected_s=n * est, stage_flags=("--spin-us", SPIN_US), cpu=True),
                    est_s=est_dg, min_steps=5)
        variants["inprocess"] = Variant("inprocess", lambda n, exp=exp, est=est_ip, extra=extra: runner.inprocess_api(
            exp, int(n), n * est + extra),
                                        est_s=est_ip, min_steps=5)
        runner.interleave(f"A {fmt_size(size)}", list(variants.values()))
        inproc = variants["inprocess"].t
        row: dict[str, Any] = {"size_bytes": size, "inprocess": summarise(variants["inprocess"]),
                               "inprocess_step_s": inproc}
        for tr in transports:
            raw, wire, dg = (variants[f"{k}-{tr}"].t for k in ("raw", "wire", "distgrad"))
            fig: dict[str, Any] = {
                "raw_rt_s": raw, "wire_rt_s": wire, "distgrad_step_s": dg,
                "distgrad_over_raw": ratio(dg, raw), "wire_over_raw": ratio(wire, raw),
                "lockstep_ideal_s": (inproc + raw) if inproc is not None and raw is not None else None,
                "raw": summarise(variants[f"raw-{tr}"]), "wire": summarise(variants[f"wire-{tr}"]),
                "distgrad": summarise(variants[f"distgrad-{tr}"]),
            }
            fig["distgrad_over_lockstep_ideal"] = ratio(dg, fig["lockstep_ideal_s"])
            if f"spin-{tr}" in variants:
                spin = variants[f"spin-{tr}"].t
                fig.update({"spin_us": SPIN_US, "spin_step_s": spin, "spin_over_raw": ratio(spin, raw),
                            "cores": cores(variants[f"distgrad-{tr}"]), "spin_cores": cores(variants[f"spin-{tr}"]),
                            "spin": summarise(variants[f"spin-{tr}"])})
            # The same runs timed between the driver's first and last progress lines (no handshake,
            # no first step, no bye): the steady state, for comparison with elapsed_s / steps.
            fig["distgrad_steady_step_s"] = median([x["steady_t"] for x in variants[f"distgrad-{tr}"].samples
                                                    if "steady_t" in x])
            fig["distgrad_steady_share_of_raw_bytes_per_s"] = ratio(raw, fig["distgrad_steady_step_s"])
            # What a distgrad step spends beyond its wire path and its compute: the stage/daemon logic.
            fig["distgrad_minus_wire_minus_inprocess_s"] = (dg - wire - inproc) if None not in (dg, wire, inproc) \
                else None
            moved = 2 * size                      # activation down, gradient of the same size back
            fig["raw_bytes_per_s"] = moved / raw if raw else None
            fig["distgrad_bytes_per_s"] = moved / dg if dg else None
            fig["wire_bytes_per_s"] = moved / wire if wire else None
            fig["distgrad_share_of_raw_bytes_per_s"] = ratio(raw, dg)
            fig["wire_share_of_raw_bytes_per_s"] = ratio(raw, wire)
            row[tr] = fig
        out[str(size)] = row
    return out


# ---------------------------------------------------------------- B. the model

def model_section(runner: Runner, batches: list[int], micro_batches: list[int], schedules: list[str],
                  torch_ok: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for batch in batches:
        exp = runner.write_experiment(f"mlp-b{batch}", mlp_toml(f"mlp-classify-b{batch}", [("dense", 784, HIDDEN),
                                                                 ("relu",)], [("dense", HIDDEN, 10)], batch))
        est = EST_MLP[batch]
        frame = batch * HIDDEN * 4
        variants: dict[str, Variant] = {
            "unpipelined": Variant("unpipelined", lambda n, exp=exp, est=est: runner.distgrad_pair(
                exp, int(n), expected_s=n * est, cpu=True), est_s=est),
            "unpipelined_spin": Variant("unpipelined_spin", lambda n, exp=exp, est=est: runner.distgrad_pair(
                exp, int(n), expected_s=n * est, stage_flags=("--spin-us", SPIN_US), cpu=True), est_s=est),
            "inprocess": Variant("inprocess", lambda n, exp=exp, est=est: runner.inprocess_cli(exp, int(n), n * est),
                                 est_s=est / 2),
            "bare": Variant("bare", lambda n, batch=batch, est=est: runner.bare_pair(batch, int(n), n * est),
                            est_s=est),
            "raw_rt": Variant("raw_rt", lambda s, frame=frame: runner.round_trip("raw", "tcp", frame, s), timed=True),
        }
        if torch_ok:
            variants["torch_gloo"] = Variant("torch_gloo", lambda n, batch=batch, est=est: runner.torch_pair(
                batch, int(n), n * est),
                                             est_s=est)
        for m in micro_batches:
            if batch % m or batch == 1:
                continue
            for sched in schedules:
                flags = ("--micro-batches", m, "--schedule", sched)
                variants[f"{sched}_m{m}"] = Variant(
                    f"{sched}_m{m}", lambda n, flags=flags, exp=exp, est=est: runner.distgrad_pair(
                        exp, int(n), driver_flags=flags, expected_s=n * est), est_s=est)
        runner.interleave(f"B mlp batch {batch}", list(variants.values()))
        t = {k: v.t for k, v in variants.items()}
        sps = {k: (1 / x if x else None) for k, x in t.items()}
        ideal_t = (t["inprocess"] + t["raw_rt"]) if t["inprocess"] and t["raw_rt"] else None
        pipelined = {k: x for k, x in sps.items() if ("_m" in k and x)}
        best = max(pipelined, key=pipelined.get) if pipelined else None
        out[str(batch)] = {
            "batch": batch, "frame_bytes": frame,
            "steps_per_s": {k: x for k, x in sps.items() if k != "raw_rt"},
            "raw_rt_s": t["raw_rt"], "lockstep_ideal_steps_per_s": 1 / ideal_t if ideal_t else None,
            "unpipelined_minus_lockstep_ideal_s": (t["unpipelined"] - ideal_t) if t["unpipelined"] and ideal_t
            else None,
            "best_pipelined": best,
            "cores": {"unpipelined": cores(variants["unpipelined"]),
                      "unpipelined_spin": cores(variants["unpipelined_spin"])},
            "ratios": {
                "unpipelined_over_bare": ratio(sps["unpipelined"], sps["bare"]),
                "unpipelined_over_torch_gloo": ratio(sps["unpipelined"], sps.get("torch_gloo")),
                "unpipelined_over_lockstep_ideal": ratio(sps["unpipelined"], 1 / ideal_t if ideal_t else None),
                "unpipelined_spin_over_lockstep_ideal": ratio(sps["unpipelined_spin"],
                                                              1 / ideal_t if ideal_t else None),
                "unpipelined_spin_over_bare": ratio(sps["unpipelined_spin"], sps["bare"]),
                "unpipelined_spin_over_torch_gloo": ratio(sps["unpipelined_spin"], sps.get("torch_gloo")),
                "unpipelined_over_inprocess": ratio(sps["unpipelined"], sps["inprocess"]),
                "best_pipelined_over_unpipelined": ratio(pipelined.get(best), sps["unpipelined"]) if best else None,
                "best_pipelined_over_inprocess": ratio(pipelined.get(best), sps["inprocess"]) if best else None,
            },
            "memory": {k: v.samples[-1].get("memory") for k, v in variants.items()
                       if v.samples and "memory" in v.samples[-1]},
            "runs": {k: summarise(v) for k, v in variants.items()},
        }
    return out


def describe_layers(layers: list[tuple]) -> str:
    """``[("dense", 784, 1024), ("relu",)]`` -> ``"Dense 784->1024 + ReLU"``."""
    return " + ".join(f"Dense {layer[1]}->{layer[2]}" if layer[0] == "dense" else layer[0].capitalize().replace(
        "Relu", "ReLU") for layer in layers)


def balanced_section(runner: Runner, micro_batches: list[int], schedules: list[str],
                     batch: int = BALANCED["batch"], spec: dict[str, Any] = BALANCED) -> dict[str, Any]:
    name = f"balanced-b{batch}"
    exp = runner.write_experiment(name, mlp_toml(name, spec["f"], spec["g"], batch))
    compute = {}
    for m in [1, *micro_batches]:
        try:
            compute[m] = runner.stage_compute(exp, m)
        except BenchError as e:
            runner.failures.append({"group": "balanced", "variant": f"stage-compute m{m}", "repeat": "0",
                                    "error": str(e)})
    if 1 in compute:
        c = compute[1]
        say(f"balanced split, isolated compute per batch: f {fmt_time(c['f_forward_backward_s'])}, "
            f"g {fmt_time(c['g_forward_loss_backward_s'])}, updates {fmt_time(c['f_update_s'])} / "
            f"{fmt_time(c['g_update_s'])}")
    est = 0.02 * batch / 256
    variants: dict[str, Variant] = {
        "unpipelined": Variant("unpipelined", lambda n: runner.distgrad_pair(exp, int(n), expected_s=n * est),
                               est_s=est),
        "inprocess": Variant("inprocess", lambda n: runner.inprocess_cli(exp, int(n), n * est), est_s=est),
    }
    for m in micro_batches:
        for sched in schedules:
            flags = ("--micro-batches", m, "--schedule", sched)
            variants[f"{sched}_m{m}"] = Variant(
                f"{sched}_m{m}", lambda n, flags=flags: runner.distgrad_pair(exp, int(n), driver_flags=flags,
                                                                             expected_s=n * est), est_s=est)
    runner.interleave(f"B balanced batch {batch}", list(variants.values()))
    sps = {k: (1 / v.t if v.t else None) for k, v in variants.items()}
    ceilings = {}
    if 1 in compute:
        c1 = compute[1]
        unsplit = (c1["f_forward_backward_s"] + c1["g_forward_loss_backward_s"] + c1["f_update_s"]
                   + c1["g_update_s"])
        for m in micro_batches:
            if m in compute:
                cm = compute[m]
                fm, gm = cm["f_forward_backward_s"], cm["g_forward_loss_backward_s"]
                piped = m * max(fm, gm) + min(fm, gm) + cm["f_update_s"] + cm["g_update_s"]
                ceilings[str(m)] = {"f_per_micro_batch_s": fm, "g_per_micro_batch_s": gm, "g_over_f": gm / fm,
                                    "split_compute_over_unsplit": m * (fm + gm) / (c1["f_forward_backward_s"]
                                                                                  + c1["g_forward_loss_backward_s"]),
                                    "compute_only_speedup_estimate": unsplit / piped}
    return {
        "model": {"f": describe_layers(spec["f"]), "g": f"{describe_layers(spec['g'])}, softmax CE", "batch": batch},
        "stage_compute": {str(k): v for k, v in compute.items()},
        "compute_only_estimates": ceilings,
        "steps_per_s": sps,
        "ratios": {
            **{f"{k}_over_unpipelined": ratio(x, sps["unpipelined"]) for k, x in sps.items() if "_m" in k},
            **{f"{k}_over_inprocess": ratio(x, sps["inprocess"]) for k, x in sps.items() if "_m" in k},
            "unpipelined_over_inprocess": ratio(sps["unpipelined"], sps["inprocess"]),
        },
        "memory": {k: v.samples[-1].get("memory") for k, v in variants.items()
                   if v.samples and "memory" in v.samples[-1]},
        "runs": {k: summarise(v) for k, v in variants.items()},
    }


# ---------------------------------------------------------------- C. memory

def memory_section(runner: Runner, model: dict[str, Any], repeats: int, steps: int,
                   wide: dict[str, Any] = WIDE) -> dict[str, Any]:
    """1f1b vs gpipe at M = 8, batch 256: the mlp runs of B, plus a wide split whose activations dominate."""
    m = 8
    batch = wide["batch"]
    width = wide["f"][0][2]
    exp = runner.write_experiment("wide-b256", mlp_toml("wide-b256", wide["f"], wide["g"], batch))
    variants = {sched: Variant(sched, lambda n, sched=sched: runner.distgrad_pair(
        exp, int(n), driver_flags=("--micro-batches", m, "--schedule", sched), expected_s=n * 0.15),
        est_s=0.15, min_steps=steps, max_steps=steps) for sched in ("1f1b", "gpipe")}
    runner.interleave(f"C wide batch {batch} M=8", list(variants.values()), repeats)
    per_mb = (batch // m) * width * 4
    result: dict[str, Any] = {
        "wide": {
            "model": {"f": f"Dense 784->{width} + ReLU", "g": f"Dense {width}->10, softmax CE", "batch": batch,
                      "micro_batches": m},
            "activation_bytes_per_micro_batch": per_mb,
            "expected_held_per_in_flight_micro_batch_bytes": 2 * per_mb,
            "expected_gpipe_minus_1f1b_kib": (m - 2) * 2 * per_mb // KIB,
            "runs": {k: summarise(v) for k, v in variants.items()},
        },
    }
    for name, runs in (("wide", {k: v.samples for k, v in variants.items()}),
                       ("mlp", {s: model.get("256", {}).get("runs", {}).get(f"{s}_m{m}", {}).get("samples", [])
                                for s in ("1f1b", "gpipe")})):
        stats = {}
        for sched, samples in runs.items():
            mems = [s["memory"] for s in samples if "loop_hwm_kib" in s.get("memory", {})]   # >= 2 loop samples
            stats[sched] = {
                "loop_hwm_kib": median([x["loop_hwm_kib"] for x in mems]),
                "loop_max_rss_kib": median([x["loop_max_rss_kib"] for x in mems]),
                "growth_hwm_kib": max((x["growth_hwm_kib"] for x in mems), default=None),
                "growth_rss_kib": max((x["growth_rss_kib"] for x in mems), default=None),
                "final_hwm_kib": median([x["final_hwm_kib"] for x in mems if x.get("final_hwm_kib")]),
                "runs": len(mems),
            }
        a, b = stats.get("1f1b", {}), stats.get("gpipe", {})
        diff = (b["loop_max_rss_kib"] - a["loop_max_rss_kib"]) if a.get("loop_max_rss_kib") and \
            b.get("loop_max_rss_kib") else None
        hwm_diff = (b["loop_hwm_kib"] - a["loop_hwm_kib"]) if a.get("loop_hwm_kib") and b.get("loop_hwm_kib") else None
        result.setdefault(name, {}).update(schedules=stats, gpipe_minus_1f1b_loop_max_rss_kib=diff,
                                           gpipe_minus_1f1b_loop_hwm_kib=hwm_diff)
    result["mlp"]["expected_gpipe_minus_1f1b_kib"] = (m - 2) * 2 * (batch // m) * HIDDEN * 4 // KIB
    return result


# ---------------------------------------------------------------- targets

def all_memory(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every distgrad pair run's f-stage memory figures (B and C)."""
    out = []
    for section in (results.get("model", {}).values(), [results.get("balanced", {}), results.get("balanced_big_batch", {})],
                    [results.get("memory", {}).get("wide", {})]):
        for block in section:
            for run in block.get("runs", {}).values():
                out += [s["memory"] for s in run.get("samples", []) if "loop_hwm_kib" in s.get("memory", {})]
    return out


def targets(results: dict[str, Any], transports: list[str]) -> list[dict[str, Any]]:
    """Every figure next to its target; ``limited_by`` says what bounds it, with the figures that show it."""
    rows: list[dict[str, Any]] = []

    def add(name: str, figure: float | None, target: str, ok: bool | None, limit: str) -> None:
        rows.append({"target": name, "figure": figure, "wanted": target,
                     "met": None if figure is None else ok, "limited_by": limit})

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x * 100:.0f}%"

    mp = results.get("message_path", {})
    for size in (4, 4 * KIB):
        for tr in transports:
            r = mp.get(str(size), {}).get(tr, {})
            x = r.get("distgrad_over_raw")
            add(f"small message {fmt_size(size)} {tr}: distgrad step / raw round trip", x, "<= 1.3x",
                x is not None and x <= 1.3,
                f"latency: the wire path alone is {fmt_ratio(r.get('wire_over_raw'))} raw "
                f"({fmt_time(r.get('wire_rt_s'))} vs {fmt_time(r.get('raw_rt_s'))}); compute "
                f"{fmt_time(mp.get(str(size), {}).get('inprocess_step_s'))}")
            x = r.get("spin_over_raw")
            if x is not None:
                add(f"small message {fmt_size(size)} {tr} with --spin-us {r['spin_us']}: distgrad step / raw round trip",
                    x, "<= 1.3x", x <= 1.3,
                    f"latency; CPU: both stage processes busy {fmt_ratio(r.get('spin_cores'))} cores with the spin "
                    f"vs {fmt_ratio(r.get('cores'))} without ({fmt_time(r.get('spin_step_s'))} vs "
                    f"{fmt_time(r.get('distgrad_step_s'))} per step)")
    for size in (4 * MIB, 64 * MIB):
        for tr in transports:
            r = mp.get(str(size), {}).get(tr, {})
            x = r.get("distgrad_share_of_raw_bytes_per_s")
            ip, raw = mp.get(str(size), {}).get("inprocess_step_s"), r.get("raw_rt_s")
            ceiling = ratio(raw, (ip + raw) if ip is not None and raw is not None else None)
            add(f"large message {fmt_size(size)} {tr}: distgrad bytes/s / raw bytes/s", x, ">= 0.85",
                x is not None and x >= 0.85,
                f"compute on the critical path: the model's own step is {fmt_time(ip)} vs raw {fmt_time(raw)}, so "
                f"even a free transport gets {pct(ceiling)}; wire path alone "
                f"{pct(r.get('wire_share_of_raw_bytes_per_s'))}; step / (compute + raw) "
                f"{fmt_ratio(r.get('distgrad_over_lockstep_ideal'))}")
    model = results.get("model", {})
    b32 = model.get("32", {})
    sps = b32.get("steps_per_s", {})
    x = b32.get("ratios", {}).get("unpipelined_over_bare")
    add("mlp batch 32: unpipelined / bare raw-frame numpy split", x, ">= 1.0", x is not None and x >= 1.0,
        f"latency: {fmt_time(ratio(1, sps.get('unpipelined')))} vs {fmt_time(ratio(1, sps.get('bare')))} per step; "
        f"distgrad's framing, validation and step logic vs none")
    x = b32.get("ratios", {}).get("unpipelined_over_torch_gloo")
    add("mlp batch 32: unpipelined / torch gloo split", x, ">= 2.0", x is not None and x >= 2.0,
        f"latency: torch gloo {fmt_time(ratio(1, sps.get('torch_gloo')))} per step vs distgrad "
        f"{fmt_time(ratio(1, sps.get('unpipelined')))}" if sps.get("torch_gloo") else "torch not available")
    x = b32.get("ratios", {}).get("unpipelined_spin_over_bare")
    add(f"mlp batch 32 with --spin-us {SPIN_US}: unpipelined / bare raw-frame numpy split", x, ">= 1.0",
        x is not None and x >= 1.0,
        f"latency; CPU: {fmt_ratio(b32.get('cores', {}).get('unpipelined_spin'))} cores busy with the spin vs "
        f"{fmt_ratio(b32.get('cores', {}).get('unpipelined'))} without")
    for batch in ("1", "32"):
        b = model.get(batch, {})
        x = b.get("ratios", {}).get("unpipelined_over_lockstep_ideal")
        add(f"mlp batch {batch}: unpipelined / lockstep ideal (in-process + one raw round trip)", x, ">= 0.85",
            x is not None and x >= 0.85,
            f"latency: {fmt_time(b.get('unpipelined_minus_lockstep_ideal_s'))} per step over the ideal; the bare "
            f"split reaches "
            f"{fmt_ratio(ratio(b.get('steps_per_s', {}).get('bare'), b.get('lockstep_ideal_steps_per_s')))} of it")
        x = b.get("ratios", {}).get("unpipelined_spin_over_lockstep_ideal")
        add(f"mlp batch {batch} with --spin-us {SPIN_US}: unpipelined / lockstep ideal", x, ">= 0.85",
            x is not None and x >= 0.85,
            f"latency; CPU: {fmt_ratio(b.get('cores', {}).get('unpipelined_spin'))} cores busy with the spin vs "
            f"{fmt_ratio(b.get('cores', {}).get('unpipelined'))} without")
    for bal in (results.get("balanced", {}), results.get("balanced_big_batch", {})):
        est = bal.get("compute_only_estimates", {})
        batch = bal.get("model", {}).get("batch", BALANCED["batch"])
        for key in sorted(k for k in bal.get("ratios", {}) if k.endswith("_over_unpipelined")):
            m = key.split("_m")[1].split("_")[0]
            if int(m) >= 4:
                x = bal["ratios"][key]
                e = est.get(m, {})
                add(f"balanced split batch {batch}, {key.split('_over')[0]}: pipelined / unpipelined", x, ">= 1.6x",
                    x is not None and x >= 1.6,
                    f"compute: split into {m}, the stages' compute costs "
                    f"{fmt_ratio(e.get('split_compute_over_unsplit'))} the unsplit batch; isolated compute alone "
                    f"allows {fmt_ratio(e.get('compute_only_speedup_estimate'))}; two stages overlapping perfectly "
                    f"allow at most 2M/(M+1) = {fmt_ratio(2 * int(m) / (int(m) + 1))}")
    x = model.get("256", {}).get("ratios", {}).get("best_pipelined_over_inprocess")
    add("mlp batch 256: best pipelined / in-process (one thread)", x, ">= 1.0", x is not None and x >= 1.0,
        "compute: f holds almost all of it (784x256 vs 256x10), nothing to overlap")
    bal = results.get("balanced", {})      # batch 256, not the batch-1024 run the loop above ended on
    best = max((v for k, v in bal.get("ratios", {}).items() if k.endswith("_over_inprocess") and "_m" in k and v),
               default=None)
    add("balanced split batch 256: best pipelined / in-process (one thread)", best, ">= 1.0",
        best is not None and best >= 1.0,
        f"compute: unpipelined is {fmt_ratio(bal.get('ratios', {}).get('unpipelined_over_inprocess'))} in-process; "
        f"pipelining does not pay back its splitting cost")
    wide = results.get("memory", {}).get("wide", {})
    diff, expected = wide.get("gpipe_minus_1f1b_loop_hwm_kib"), wide.get("expected_gpipe_minus_1f1b_kib")
    add("memory, wide split M=8 batch 256: f-stage peak (VmHWM) gpipe - 1f1b, KiB", diff,
        f"~{expected} (6 more micro-batches in flight)", diff is not None and expected is not None
        and 0.5 * expected <= diff <= 2 * expected,
        "the schedule's window: gpipe keeps 8 micro-batches' activations, 1f1b 2")
    mems = all_memory(results)
    growth = max((m["growth_hwm_kib"] for m in mems), default=None)
    add("memory, every distgrad run of B and C: largest f-stage VmHWM rise after 10% of the loop, KiB", growth,
        "<= 2048 (no growth over steps)", growth is not None and growth <= 2048,
        f"{len(mems)} runs of {min((m['steps'] for m in mems), default=0)} to "
        f"{max((m['steps'] for m in mems), default=0)} steps; buffers are per step")
    return rows


# ---------------------------------------------------------------- output

def format_table(rows: list[list[str]], markdown: bool = False) -> str:
    """Aligned plain-text columns, or a Markdown table."""
    if markdown:
        lines = ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
        lines.insert(1, "|" + "---|" * len(rows[0]))
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(results: dict[str, Any], transports: list[str], out: TextIO, markdown: bool = False) -> None:
    """Print every section's table and the targets (as Markdown with ``markdown``)."""
    def table(rows: list[list[str]]) -> str:
        return format_table(rows, markdown)

    mp = results.get("message_path")
    if mp:
        print("\nA. Message path (per step: activation down, gradient of the same size back)", file=out)
        rows = [["size", "tr", "raw rt", "wire rt", "distgrad step", "(steady)", "in-proc step", "dg/raw",
                 "wire/raw", "dg/(inproc+raw)", "raw MB/s", "dg MB/s", "dg share", "wire share",
                 f"spin {SPIN_US}us step", "spin/raw", "cores (spin)"]]
        for size, row in mp.items():
            for tr in transports:
                r = row.get(tr, {})
                big = int(size) >= 4 * MIB
                rows.append([fmt_size(int(size)), tr, fmt_time(r.get("raw_rt_s")), fmt_time(r.get("wire_rt_s")),
                             fmt_time(r.get("distgrad_step_s")), fmt_time(r.get("distgrad_steady_step_s")),
                             fmt_time(row.get("inprocess_step_s")),
                             fmt_ratio(r.get("distgrad_over_raw")), fmt_ratio(r.get("wire_over_raw")),
                             fmt_ratio(r.get("distgrad_over_lockstep_ideal")),
                             f"{r['raw_bytes_per_s'] / 1e6:.0f}" if big and r.get("raw_bytes_per_s") else "",
                             f"{r['distgrad_bytes_per_s'] / 1e6:.0f}" if big and r.get("distgrad_bytes_per_s") else "",
                             f"{r['distgrad_share_of_raw_bytes_per_s'] * 100:.0f}%"
                             if big and r.get("distgrad_share_of_raw_bytes_per_s") else "",
                             f"{r['wire_share_of_raw_bytes_per_s'] * 100:.0f}%"
                             if big and r.get("wire_share_of_raw_bytes_per_s") else "",
                             fmt_time(r.get("spin_step_s")) if "spin_step_s" in r else "",
                             fmt_ratio(r.get("spin_over_raw")) if "spin_step_s" in r else "",
                             f"{fmt_ratio(r.get('cores'))} ({fmt_ratio(r.get('spin_cores'))})"
                             if "spin_step_s" in r else ""])
        print(table(rows), file=out)
    model = results.get("model")
    if model:
        print("\nB. mlp-classify split, steps/s (tcp)", file=out)
        keys = sorted({k for b in model.values() for k in b["steps_per_s"]},
                      key=lambda k: (k not in ("unpipelined", "inprocess", "bare", "torch_gloo"), k))
        rows = [["variant", *[f"batch {b}" for b in model]]]
        for k in keys:
            rows.append([k, *[fmt_rate(b["steps_per_s"].get(k)) for b in model.values()]])
        rows.append(["lockstep ideal", *[fmt_rate(b["lockstep_ideal_steps_per_s"]) for b in model.values()]])
        rows.append(["raw rt (frame)", *[f"{fmt_time(b['raw_rt_s'])} ({fmt_size(b['frame_bytes'])})"
                                         for b in model.values()]])
        for rk in ("unpipelined_over_bare", "unpipelined_over_torch_gloo", "unpipelined_over_lockstep_ideal",
                   "unpipelined_spin_over_bare", "unpipelined_spin_over_torch_gloo",
                   "unpipelined_spin_over_lockstep_ideal",
                   "unpipelined_over_inprocess", "best_pipelined_over_unpipelined", "best_pipelined_over_inprocess"):
            rows.append([rk.replace("_over_", " / "), *[fmt_ratio(b["ratios"].get(rk)) for b in model.values()]])
        for ck in ("unpipelined", "unpipelined_spin"):
            rows.append([f"cores busy, {ck}", *[fmt_ratio(b.get("cores", {}).get(ck)) for b in model.values()]])
        rows.append(["best pipelined", *[b["best_pipelined"] or "-" for b in model.values()]])
        print(table(rows), file=out)
    for bal in (results.get("balanced"), results.get("balanced_big_batch")):
        if not bal:
            continue
        print(f"\nB'. Balanced split at batch {bal['model']['batch']} ({bal['model']['f']} | {bal['model']['g']}), "
              f"steps/s", file=out)
        rows = [["variant", "steps/s", "/ unpipelined", "/ in-process"]]
        for k, x in bal["steps_per_s"].items():
            rows.append([k, fmt_rate(x), fmt_ratio(ratio(x, bal["steps_per_s"].get("unpipelined"))),
                         fmt_ratio(ratio(x, bal["steps_per_s"].get("inprocess")))])
        print(table(rows), file=out)
        for m, c in bal.get("compute_only_estimates", {}).items():
            print(f"  M={m}: isolated compute per micro-batch f {fmt_time(c['f_per_micro_batch_s'])}, "
                  f"g {fmt_time(c['g_per_micro_batch_s'])} (g/f {c['g_over_f']:.2f}); splitting costs "
                  f"{c['split_compute_over_unsplit']:.2f}x the unsplit compute; compute-only speedup estimate "
                  f"{c['compute_only_speedup_estimate']:.2f}x", file=out)
    mem = results.get("memory")
    if mem:
        print("\nC. f-stage memory, M=8, batch 256 (KiB)", file=out)
        rows = [["model", "schedule", "loop VmHWM", "loop max RSS", "VmHWM growth", "RSS growth",
                 "final VmHWM"]]
        for name in ("mlp", "wide"):
            for sched, s in mem.get(name, {}).get("schedules", {}).items():
                rows.append([name, sched, *[str(s.get(k)) if s.get(k) is not None else "-"
                                            for k in ("loop_hwm_kib", "loop_max_rss_kib", "growth_hwm_kib",
                                                      "growth_rss_kib", "final_hwm_kib")]])
        print(table(rows), file=out)
        for name in ("mlp", "wide"):
            s = mem.get(name, {})
            print(f"  {name}: gpipe - 1f1b loop max RSS {s.get('gpipe_minus_1f1b_loop_max_rss_kib')} KiB, "
                  f"VmHWM {s.get('gpipe_minus_1f1b_loop_hwm_kib')} KiB (6 more micro-batches in flight: "
                  f"~{s.get('expected_gpipe_minus_1f1b_kib')} KiB)", file=out)
    rows = [["target", "figure", "wanted", "met", "limited by"]]
    for t in results.get("targets", []):
        fig = t["figure"]
        rows.append([t["target"], "-" if fig is None else f"{fig:.3g}", t["wanted"],
                     {True: "met", False: "NOT met", None: "-"}[t["met"]], t["limited_by"]])
    print("\nTargets", file=out)
    print(table(rows), file=out)


# ---------------------------------------------------------------- main

def find_torch(option: str | None, env: dict[str, str]) -> tuple[str | None, str]:
    """An interpreter that can import torch, and a note saying which (or why none)."""
    if option == "none":
        return None, "skipped: --torch-python none"
    candidates = [option] if option else [sys.executable, os.environ.get("DISTGRAD_BENCH_TORCH_PYTHON"),
                                          str(TORCH_VENV_PYTHON)]
    for python in filter(None, candidates):
        if not Path(python).exists():
            continue
        try:
            r = subprocess.run([python, "-c", "import torch, numpy, torch.distributed as d; "
                                "print(torch.__version__, d.is_gloo_available())"],
                               capture_output=True, text=True, timeout=120, env=env)
        except subprocess.TimeoutExpired:
            continue
        if r.returncode == 0 and r.stdout.split()[-1:] == ["True"]:
            return python, f"torch {r.stdout.split()[0]} from {python}"
    return None, (f"skipped: no interpreter with torch (and numpy) found among {[c for c in candidates if c]}; "
                  f"create one with `python3 -m venv {TORCH_VENV_PYTHON.parent.parent} && "
                  f"{TORCH_VENV_PYTHON.parent}/pip install torch numpy`")


SNAPSHOT_TRIES = 5
SNAPSHOT_RETRY_S = 5.0


def snapshot_distgrad(dest: Path, env: dict[str, str]) -> dict[str, Any]:
    """Copy distgrad/ to ``dest/distgrad`` and check that it imports; every process then runs this copy.

    The package is edited while benchmarks run: a run measures one version of
    it from start to end, and a copy caught mid-edit (it does not import) is
    taken again after a pause.
    """
    error = ""
    for attempt in range(SNAPSHOT_TRIES):
        shutil.rmtree(dest / "distgrad", ignore_errors=True)
        shutil.copytree(ROOT / "distgrad", dest / "distgrad", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        check = subprocess.run([sys.executable, "-c", "import distgrad.cli, distgrad.serving, distgrad.inprocess, "
                                "distgrad.launcher; print(distgrad.__file__)"], cwd=dest, env=env,
                               capture_output=True, text=True, timeout=60)
        if check.returncode == 0 and check.stdout.strip().startswith(str(dest)):
            digest = hashlib.sha256()
            for path in sorted((dest / "distgrad").rglob("*")):
                if path.is_file():
                    digest.update(str(path.relative_to(dest)).encode() + b"\0" + path.read_bytes())
            return {"path": str(dest / "distgrad"), "sha256": digest.hexdigest(), "attempts": attempt + 1}
        error = (check.stdout + check.stderr).strip().splitlines()[-1:] or ["imported from elsewhere"]
        say(f"the copy of distgrad/ does not import ({error[0]}); copying again in {SNAPSHOT_RETRY_S:g} s")
        time.sleep(SNAPSHOT_RETRY_S)
    raise BenchError(f"no importable copy of distgrad/ after {SNAPSHOT_TRIES} tries: {error}")


def machine_info(runner: Runner) -> dict[str, Any]:
    info: dict[str, Any] = {"nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
                            "uname": f"{platform.system()} {platform.release()} {platform.machine()}",
                            "python": platform.python_version(), "loadavg_start": os.getloadavg()}
    try:
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                           if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        info["children"] = runner.run_json("info", [sys.executable, str(HERE / "_peers.py"), "info"], 60)
    except BenchError as e:
        info["children"] = {"error": str(e)}
    for key, cmd in (("git_head", ["git", "rev-parse", "HEAD"]),
                     ("git_dirty", ["git", "status", "--short", "--", "distgrad"])):
        try:
            info[key] = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info[key] = None
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="distgrad benchmarks: message path, model, pipelining, memory.")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every figure, sample and ratio here")
    p.add_argument("--quick", action="store_true", help="a reduced set for a smoke check (under ~2 minutes)")
    p.add_argument("--smoke", action="store_true",
                   help="every variant once at tiny sizes, tcp only, to check the script runs (seconds; the "
                        "figures mean nothing)")
    p.add_argument("--repeats", type=int, help="repeats per variant (default 3, quick 1)")
    p.add_argument("--target-s", type=float, help="seconds per measurement (default 1.2, quick 0.4)")
    p.add_argument("--sections", default="A,B,C", help="comma-separated subset of A (message path), B (model, "
                   "balanced split), C (memory); default A,B,C")
    p.add_argument("--torch-python", metavar="PATH",
                   help=f"interpreter with torch for the gloo split ('none' to skip; default: this one, "
                        f"$DISTGRAD_BENCH_TORCH_PYTHON, then {TORCH_VENV_PYTHON})")
    p.add_argument("--inherit-blas-env", action="store_true",
                   help="keep OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE from the environment (default: removed in "
                        "the children, so numpy runs its native kernel)")
    p.add_argument("--workdir", type=Path, help="keep logs and generated experiments here (default: a temp dir)")
    p.add_argument("--report", type=Path, metavar="JSON",
                   help="measure nothing: print the tables of an earlier run's --json file")
    p.add_argument("--markdown", action="store_true", help="with --report: Markdown tables (for docs/performance.md)")
    args = p.parse_args(argv)
    if args.report:
        results = json.loads(args.report.read_text())
        report(results, ["tcp", "ipc"], sys.stdout, args.markdown)
        return 0
    if args.smoke and args.quick:
        p.error("--smoke and --quick exclude each other")
    repeats = args.repeats or (1 if args.quick or args.smoke else 3)
    target_s = args.target_s or (SMOKE["target_s"] if args.smoke else 0.4 if args.quick else 1.2)
    sections = set(args.sections.upper().split(","))
    if repeats < 1 or not target_s > 0 or not sections <= {"A", "B", "C"}:
        p.error("--repeats must be >= 1, --target-s > 0, --sections a subset of A,B,C")
    signal.signal(signal.SIGTERM, _on_sigterm)

    base = dict(os.environ)
    if not args.inherit_blas_env:
        for name in BLAS_OVERRIDES:
            base.pop(name, None)
    env = pinned_env(base)
    started = time.monotonic()
    results: dict[str, Any] = {}
    transports = SMOKE["transports"] if args.smoke else ["tcp", "ipc"]
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    with tempfile.TemporaryDirectory(prefix="distgrad-bench-") as tmp_name:
        workdir = (args.workdir or Path(tmp_name)).resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        src = workdir / "src"
        src.mkdir(exist_ok=True)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(src), env.get("PYTHONPATH")]))
        try:
            snapshot = snapshot_distgrad(src, env)
        except BenchError as e:
            say(f"FAILED: {e}")
            return 1
        torch_python, torch_note = find_torch(args.torch_python, env) if "B" in sections else (None, "not run")
        runner = Runner(workdir, src, env, torch_python, repeats, target_s)
        if args.smoke:
            runner.compute_min_s = SMOKE["compute_min_s"]
        code = 0
        try:
            results["meta"] = {
                "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else argv,
                "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "quick": args.quick, "smoke": args.smoke, "repeats": repeats, "target_s": target_s, "sections": sorted(sections),
                "blas_env": "inherited" if args.inherit_blas_env else f"{', '.join(BLAS_OVERRIDES)} removed",
                "torch": torch_note, "distgrad_snapshot": snapshot, "machine": machine_info(runner),
            }
            say(f"{mode} run: {repeats} repeat(s), ~{target_s:g} s per measurement; "
                f"torch: {torch_note}")
            if "A" in sections:
                results["message_path"] = message_path(
                    runner, SMOKE["sizes"] if args.smoke else QUICK_SIZES if args.quick else SIZES, transports)
            if "B" in sections and args.smoke:
                results["model"] = model_section(runner, SMOKE["batches"], SMOKE["micro_batches"],
                                                 SMOKE["schedules"], torch_python is not None)
                results["balanced"] = balanced_section(runner, SMOKE["micro_batches"], SMOKE["schedules"],
                                                       SMOKE["balanced_batch"], SMOKE["balanced"])
            elif "B" in sections:
                results["model"] = model_section(runner, [32] if args.quick else BATCHES,
                                                 [4] if args.quick else MICRO_BATCHES, ["1f1b", "gpipe"],
                                                 torch_python is not None)
                results["balanced"] = balanced_section(runner, [4] if args.quick else [4, 8],
                                                       ["1f1b"] if args.quick else ["1f1b", "gpipe"])
                if not args.quick:
                    results["balanced_big_batch"] = balanced_section(runner, [4, 8], ["1f1b", "gpipe"],
                                                                     BALANCED_BIG_BATCH)
            if "C" in sections:
                if args.smoke:
                    results["memory"] = memory_section(runner, results.get("model", {}), 1, SMOKE["memory_steps"],
                                                       SMOKE["wide"])
                else:
                    results["memory"] = memory_section(runner, results.get("model", {}), 1 if args.quick else 2,
                                                       8 if args.quick else 30)
        except KeyboardInterrupt:
            say("interrupted (SIGINT); children stopped")
            code = 130
        except _Terminated:
            say("terminated (SIGTERM); children stopped")
            code = 143
        finally:
            runner.stop_all()
        results["targets"] = targets(results, transports)
        results["failures"] = runner.failures
        results["runtime_s"] = round(time.monotonic() - started, 1)
        results.setdefault("meta", {})["loadavg_end"] = os.getloadavg()
    report(results, transports, sys.stdout)
    print(f"\n{mode} run took {results['runtime_s']:.0f} s; "
          f"{len(runner.failures)} failed measurement(s)", flush=True)
    for failure in runner.failures:
        print(f"FAILED {failure['group']} {failure['variant']} (repeat {failure['repeat']}):\n{failure['error']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"figures written to {args.json}")
    if code:
        return code
    return 1 if runner.failures else 0


if __name__ == "__main__":
    sys.exit(main())
