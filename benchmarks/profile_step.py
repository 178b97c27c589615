#!/usr/bin/env python
"""Profile both stage processes of a running split with py-spy, and print the top functions.

    .venv/bin/python benchmarks/profile_step.py tiny|mlp [--bytes N] [--native] [--seconds 10] [--rate 250]
        [--top 25] [--out DIR]

Not part of the test suite. Starts the two stage processes as ``benchmarks/bench.py``
does (``python -m distgrad.cli stage g`` bound on tcp 127.0.0.1, ``stage f``
connected to it, ``launcher.pinned_env()``, OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE
removed) on the benchmark's generated experiments: ``tiny`` is section A's
identity model (4 bytes, or ``--bytes N``: the size group's model at that
activation size), ``mlp`` section B's mlp-classify split at batch 32,
unpipelined. After a warm-up it attaches ``py-spy record --format raw`` to
each process for ``--seconds`` (``--nonblocking``, so the processes are
never paused, unless ``--native``: C frames too, numpy's and pyzmq's, which
py-spy reads only by pausing the process, so the shares of waiting and
work are then skewed; ``--idle``, so the time spent blocked in ``poll`` shows too),
then stops both. For each process it prints the main thread's functions by
own time (the innermost frame of a sample) and by total time (any frame of
a sample), as shares of that thread's samples. The raw profiles stay in
``--out`` (default: a temporary directory). Needs ``py-spy`` (``pip install
py-spy``) and ptrace rights over the children (root, or
``kernel.yama.ptrace_scope`` 0).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "benchmarks"):     # a checkout without installing; bench_sections when imported
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from bench_sections.common import BLAS_OVERRIDES, HIDDEN  # noqa: E402
from bench_sections.configs import mlp_toml, trivial_toml  # noqa: E402
from distgrad.run.launcher import pinned_env  # noqa: E402

STEPS = 10_000_000           # more than any profile lasts; the processes are stopped after it
READY_TIMEOUT_S = 60.0
WARM_UP_S = 3.0


def experiment(kind: str, size_bytes: int = 4) -> str:
    if kind == "tiny":
        return trivial_toml(size_bytes)
    return mlp_toml("bench-mlp-b32", [("dense", 784, HIDDEN), ("relu",)], [("dense", HIDDEN, 10)], 32)


def summarise(raw: str, top: int) -> str:
    """The main thread's top functions by own and total time, from ``py-spy --format raw --threads`` output
    (a line per distinct stack: ``thread (ID): NAME;outermost frame;...;innermost frame COUNT``)."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        threads[frames[0]][tuple(frames[1:])] += int(count)
    if not threads:
        return "  no samples"
    main = next((t for t in threads if t.endswith("MainThread")), None) or max(
        threads, key=lambda t: sum(threads[t].values()))
    stacks = threads[main]
    total = sum(stacks.values())
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    for stack, n in stacks.items():
        if stack:
            own[stack[-1]] += n
            for frame in set(stack):
                inclusive[frame] += n
    share = {name: 100 * sum(n for frame, n in own.items() if frame.startswith(name + " ")) / total
             for name in ("poll_frames", "send_frames")}
    lines = [f"  {total} samples of the main thread ({main}): {share['poll_frames']:.1f}% blocked in poll_frames, "
             f"{share['send_frames']:.1f}% in send_frames, {100 - sum(share.values()):.1f}% the rest",
             "  own time:"]
    lines += [f"    {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines.append("  total time:")
    lines += [f"    {100 * n / total:5.1f}%  {frame}" for frame, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=["tiny", "mlp"])
    p.add_argument("--bytes", type=int, default=4, help="tiny: the activation's size in bytes (the size group's model)")
    p.add_argument("--native", action="store_true", help="py-spy --native: C frames too (numpy, pyzmq)")
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", type=Path)
    p.add_argument("--lines", action="store_true", help="count each line of a function apart")
    args = p.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = args.out or Path(tempfile.mkdtemp(prefix="distgrad-profile-"))
    out.mkdir(parents=True, exist_ok=True)
    env = pinned_env()
    for name in BLAS_OVERRIDES:
        env.pop(name, None)
    env["PYTHONPATH"] = str(ROOT)
    exp = out / f"{args.kind}.toml"
    exp.write_text(experiment(args.kind, args.bytes))
    ready = out / "g.ready"
    ready.unlink(missing_ok=True)
    stage = [sys.executable, "-m", "distgrad.cli", "stage"]
    common = ["--experiment", str(exp), "--steps", str(STEPS), "--timeout", "60", "--log-level", "WARNING"]
    procs: list[subprocess.Popen] = []
    try:
        procs.append(subprocess.Popen([*stage, "g", *common, "--bind", "tcp://127.0.0.1:*", "--ready-file",
                                       str(ready)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=open(out / "g.log", "w")))
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (ready.exists() and ready.read_text().strip()):
            if time.monotonic() > deadline or procs[0].poll() is not None:
                print(f"the g stage did not start; see {out / 'g.log'}", file=sys.stderr)
                return 1
            time.sleep(0.05)
        procs.append(subprocess.Popen([*stage, "f", *common, "--connect", ready.read_text().strip()], env=env,
                                      stdout=subprocess.DEVNULL, stderr=open(out / "f.log", "w")))
        time.sleep(WARM_UP_S)
        spies = [subprocess.Popen([py_spy, "record", "--pid", str(proc.pid), "--duration", str(args.seconds),
                                   "--rate", str(args.rate), "--format", "raw", "--threads", "--idle",
                                   *([] if args.lines else ["--nolineno"]), *(["--native"] if args.native else []),
                                   *([] if args.native else ["--nonblocking"]), "--output", str(out / f"{name}.raw")],
                                  stdout=subprocess.DEVNULL, stderr=open(out / f"py-spy-{name}.log", "w"))
                 for name, proc in (("g", procs[0]), ("f", procs[1]))]
        for spy, name in zip(spies, "gf"):
            if spy.wait(args.seconds + 60) != 0:
                print(f"py-spy failed on stage {name}; see {out / f'py-spy-{name}.log'}", file=sys.stderr)
                return 1
        for name, proc in (("g", procs[0]), ("f", procs[1])):
            if proc.poll() is not None:
                print(f"stage {name} exited with code {proc.returncode}; see {out / (name + '.log')}",
                      file=sys.stderr)
                return 1
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(procs):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for name, role in (("f", "driver (f)"), ("g", "serving stage (g)")):
        print(f"{role}, {args.kind}:")
        print(summarise((out / f"{name}.raw").read_text(), args.top))
    print(f"raw profiles in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
