#!/usr/bin/env python
"""Wall time and CPU time per step of the two real stage processes of a split.

    .venv/bin/python benchmarks/step_cpu.py tiny|mlp [--steps N] [--pin G,F] [--repeats R] [--f-flags FLAGS]

Not part of the test suite. Starts ``python -m distgrad.cli stage g`` (bound on
tcp 127.0.0.1) and ``stage f`` as ``benchmarks/profile_step.py`` does, on the
same generated experiments (``tiny``: section A's 4-byte identity model,
``mlp``: section B's mlp-classify split at batch 32, unpipelined), runs
``--steps`` steps and prints, from both stages' ``--summary`` (``cpu_s``: the
process's CPU seconds, every thread, incl. ZeroMQ's I/O thread and the
kernel's work on its behalf), the wall time and each stage's CPU time per
step. The handshake and start-up are in the figures; with enough steps they
are a small share.

``--pin G,F`` runs each stage under ``taskset -c`` (e.g. ``0,0``: both on CPU
0, so the step's wall time is the CPU time of everything a step does;
``any`` pins that stage to nothing, and ``any,any`` is the default). CPU time per step moves less with the load of a
shared machine than wall time does, which makes it the figure to compare
before and after a change (run both in the same minute, alternating).

``--f-flags`` gives the driving stage more flags, e.g. ``--f-flags '--spin-us 300'``
(the driver spins before it blocks for the reply; the serving stage does not),
and each repeat then runs with and without them, alternating, so the two
lines of a repeat compare in the same minute.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_sections.common import BLAS_OVERRIDES  # noqa: E402
from distgrad.run.launcher import pinned_env  # noqa: E402
from profile_step import experiment  # noqa: E402

READY_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 600.0


def run_once(kind: str, steps: int, pin: tuple[str, str], workdir: Path,
             f_flags: list[str] | None = None) -> dict[str, float]:
    """One run of ``steps`` steps; µs per step: ``wall``, ``f``, ``g``, ``both`` (CPU)."""
    env = pinned_env()
    for name in BLAS_OVERRIDES:
        env.pop(name, None)
    env["PYTHONPATH"] = str(ROOT)
    exp = workdir / f"{kind}.toml"
    exp.write_text(experiment(kind))
    ready = workdir / "g.ready"
    ready.unlink(missing_ok=True)
    stage = [sys.executable, "-m", "distgrad.cli", "stage"]
    common = ["--experiment", str(exp), "--steps", str(steps), "--timeout", "60", "--log-level", "WARNING"]

    def taskset(cpu: str) -> list[str]:
        return [] if cpu == "any" else [shutil.which("taskset") or "taskset", "-c", cpu]

    g = subprocess.Popen([*taskset(pin[0]), *stage, "g", *common, "--bind", "tcp://127.0.0.1:*", "--ready-file",
                          str(ready), "--summary", str(workdir / "g.json")], env=env, stdout=subprocess.DEVNULL,
                         stderr=open(workdir / "g.log", "w"))
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (ready.exists() and ready.read_text().strip()):
            if time.monotonic() > deadline or g.poll() is not None:
                raise SystemExit(f"the g stage did not start; see {workdir / 'g.log'}")
            time.sleep(0.02)
        f = subprocess.run([*taskset(pin[1]), *stage, "f", *common, "--connect", ready.read_text().strip(),
                            "--summary", str(workdir / "f.json"), *(f_flags or [])], env=env, stdout=subprocess.DEVNULL,
                           stderr=open(workdir / "f.log", "w"), timeout=RUN_TIMEOUT_S)
        if f.returncode != 0:
            raise SystemExit(f"the f stage exited with {f.returncode}; see {workdir / 'f.log'}")
        g.wait(60)
    finally:
        if g.poll() is None:
            g.kill()
            g.wait()
    fs, gs = (json.loads((workdir / f"{name}.json").read_text()) for name in ("f", "g"))
    n = fs["steps"]
    return {"wall": 1e6 * fs["elapsed_s"] / n, "f": 1e6 * fs["cpu_s"] / n, "g": 1e6 * gs["cpu_s"] / n,
            "both": 1e6 * (fs["cpu_s"] + gs["cpu_s"]) / n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["tiny", "mlp"])
    p.add_argument("--steps", type=int, help="steps per run (default: 8000 tiny, 2000 mlp)")
    p.add_argument("--pin", default="any,any", help="taskset CPUs of g and f, 'any' for none (default any,any)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--f-flags", default="", help="more flags for the driving stage; each repeat then runs "
                                                  "without and with them")
    args = p.parse_args()
    pin = tuple(args.pin.split(","))
    if len(pin) != 2:
        p.error("--pin takes two CPUs (or 'any'), g's then f's: e.g. 0,0 or any,any")
    steps = args.steps or (8000 if args.kind == "tiny" else 2000)
    variants = [[], shlex.split(args.f_flags)] if args.f_flags else [[]]
    for _ in range(args.repeats):
        for f_flags in variants:
            with tempfile.TemporaryDirectory(prefix="distgrad-step-cpu-") as tmp:
                r = run_once(args.kind, steps, pin, Path(tmp), f_flags)
            print(f"{args.kind} g@{pin[0]} f@{pin[1]}{' f ' + ' '.join(f_flags) if f_flags else ''}: "
                  f"{r['wall']:.1f} us/step wall; CPU per step: f {r['f']:.1f} us, g {r['g']:.1f} us, "
                  f"both {r['both']:.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
