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
median is reported. Every process started gets ``distgrad.run.launcher.pinned_env()``
(one BLAS thread) and a deadline, and is stopped (SIGTERM, then SIGKILL) in a
``finally``. By default OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE are removed from
the children's environment so numpy runs its native kernel (see
``--inherit-blas-env``). Exit codes: 0 ok; 1 a measurement failed (the others
are still reported); 2 usage; 130 / 143 stopped by SIGINT / SIGTERM.

The sections live in ``benchmarks/bench_sections/`` (A ``message_path``, B
``model``, C ``memory``), apart from the runner that measures them
(``runner``, ``procs``) and the tables (``report``); this file reads the
flags and runs the sections chosen.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:          # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from bench_sections.common import (BALANCED_BIG_BATCH, BATCHES, BLAS_OVERRIDES, MICRO_BATCHES,  # noqa: E402
                                   QUICK_SIZES, SIZES, SMOKE, TORCH_VENV_PYTHON, BenchError, on_sigterm,
                                   Terminated, say)
from bench_sections.machine import find_torch, machine_info, snapshot_distgrad  # noqa: E402
from bench_sections.memory import memory_section  # noqa: E402
from bench_sections.message_path import message_path  # noqa: E402
from bench_sections.model import balanced_section, model_section  # noqa: E402
from bench_sections.report import report, targets  # noqa: E402
from bench_sections.runner import Runner  # noqa: E402
from distgrad.run.launcher import pinned_env  # noqa: E402


def parser() -> argparse.ArgumentParser:
    """The command line."""
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
    p.add_argument("--markdown", action="store_true", help="with --report: Markdown tables (for docs/performance-archive.md)")
    return p


def run_sections(runner: Runner, args: argparse.Namespace, sections: set[str], transports: list[str],
                 results: dict[str, Any]) -> None:
    """Measure the ``sections`` chosen (A, B, C) at the sizes of the mode (full, ``--quick``, ``--smoke``),
    adding each section's figures to ``results``."""
    if "A" in sections:
        results["message_path"] = message_path(
            runner, SMOKE["sizes"] if args.smoke else QUICK_SIZES if args.quick else SIZES, transports)
    if "B" in sections and args.smoke:
        results["model"] = model_section(runner, SMOKE["batches"], SMOKE["micro_batches"],
                                         SMOKE["schedules"], runner.torch_python is not None)
        results["balanced"] = balanced_section(runner, SMOKE["micro_batches"], SMOKE["schedules"],
                                               SMOKE["balanced_batch"], SMOKE["balanced"])
    elif "B" in sections:
        results["model"] = model_section(runner, [32] if args.quick else BATCHES,
                                         [4] if args.quick else MICRO_BATCHES, ["1f1b", "gpipe"],
                                         runner.torch_python is not None)
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


def measure(args: argparse.Namespace, argv: list[str] | None, env: dict[str, str], sections: set[str],
            transports: list[str], repeats: int, target_s: float, mode: str) -> tuple[dict[str, Any], list, int]:
    """Snapshot distgrad, run the sections in a work directory, stop every child: ``(results, failures,
    exit code)`` (130 / 143 when stopped by a signal)."""
    started = time.monotonic()
    results: dict[str, Any] = {}
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
            return results, [], 1
        torch_python, torch_note = find_torch(args.torch_python, env) if "B" in sections else (None, "not run")
        runner = Runner(workdir, src, env, torch_python, repeats, target_s)
        if args.smoke:
            runner.compute_min_s = SMOKE["compute_min_s"]
        code = 0
        try:
            results["meta"] = {
                "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else argv,
                "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                "quick": args.quick, "smoke": args.smoke, "repeats": repeats, "target_s": target_s,
                "sections": sorted(sections),
                "blas_env": "inherited" if args.inherit_blas_env else f"{', '.join(BLAS_OVERRIDES)} removed",
                "torch": torch_note, "distgrad_snapshot": snapshot, "machine": machine_info(runner),
            }
            say(f"{mode} run: {repeats} repeat(s), ~{target_s:g} s per measurement; "
                f"torch: {torch_note}")
            run_sections(runner, args, sections, transports, results)
        except KeyboardInterrupt:
            say("interrupted (SIGINT); children stopped")
            code = 130
        except Terminated:
            say("terminated (SIGTERM); children stopped")
            code = 143
        finally:
            runner.stop_all()
        results["targets"] = targets(results, transports)
        results["failures"] = runner.failures
        results["runtime_s"] = round(time.monotonic() - started, 1)
        results.setdefault("meta", {})["loadavg_end"] = os.getloadavg()
    return results, runner.failures, code


def main(argv: list[str] | None = None) -> int:
    p = parser()
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
    signal.signal(signal.SIGTERM, on_sigterm)

    base = dict(os.environ)
    if not args.inherit_blas_env:
        for name in BLAS_OVERRIDES:
            base.pop(name, None)
    transports = SMOKE["transports"] if args.smoke else ["tcp", "ipc"]
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    results, failures, code = measure(args, argv, pinned_env(base), sections, transports, repeats, target_s, mode)
    if not results:
        return code                     # the snapshot failed: nothing was measured
    report(results, transports, sys.stdout)
    print(f"\n{mode} run took {results['runtime_s']:.0f} s; "
          f"{len(failures)} failed measurement(s)", flush=True)
    for failure in failures:
        print(f"FAILED {failure['group']} {failure['variant']} (repeat {failure['repeat']}):\n{failure['error']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")
        print(f"figures written to {args.json}")
    if code:
        return code
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
