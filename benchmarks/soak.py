#!/usr/bin/env python
"""Soak run: one long two-process training run while the memory of both stages is sampled.

Starts the serving stage ``g`` of ``seed-reverse`` bound to a free tcp port on
127.0.0.1, waits for its ready file, starts the driving stage ``f`` against it
and samples the resident memory (``VmRSS`` from ``/proc/PID/status``, KiB) of
both processes every ``--interval-s`` seconds until ``f`` exits. Then it reports,
per stage, the RSS after warm-up, the final and maximum RSS and the growth after
warm-up, and fails if that growth exceeds ``--max-growth-pct`` or a stage exits
non-zero.

Every wait is bounded: the ready file within ``READY_TIMEOUT_S``, the whole run
within ``--deadline-s``. Both processes are always stopped (SIGTERM, then
SIGKILL after ``STOP_GRACE_S``) and reaped.

    python benchmarks/soak.py --steps 100000 --interval-s 2 --json out.json

Exit codes: 0 ok; 1 growth over the limit, a stage exited non-zero, or the run
could not complete (ready file or deadline missed); 2 usage; 130 / 143 stopped
by SIGINT / SIGTERM (both stages stopped and reaped first).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, TextIO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:          # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from distgrad.run.launcher import pinned_env, stop_process  # noqa: E402

READY_TIMEOUT_S = 30.0       # the serving stage must write its ready file within this
STOP_GRACE_S = 5.0           # after SIGTERM, how long a stage may take before SIGKILL
SERVER_EXIT_S = 15.0         # after f exits, how long g may take to exit on its own (within the deadline)
WARMUP_FRACTION = 0.10       # the warm-up sample is the first at or after this fraction of the run
TICK_S = 0.02                # how often f's exit is checked between samples
STAGES = ("f", "g")


class SoakError(RuntimeError):
    """The soak could not run to the end: no ready file in time, deadline passed, g died early."""


def read_rss_kib(pid: int) -> int | None:
    """``VmRSS`` of ``pid`` in KiB, or None once the process is gone (or a zombie, which has none)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return None


class _Stage:
    """One stage process with its output in a log file; ``stop()`` always stops and reaps it."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w")
        try:
            self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=pinned_env())
        except BaseException:
            self._log.close()
            raise
        self.killed = False

    def stop(self) -> None:
        if stop_process(self.proc, STOP_GRACE_S):
            self.killed = True
        self._log.close()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def stage_stats(samples: list[dict[str, Any]], stage: str, duration_s: float,
                warmup_fraction: float = WARMUP_FRACTION) -> dict[str, Any]:
    """Warm-up, final and maximum RSS of one stage and its growth after warm-up (percent).

    The warm-up sample is the first one (with a value for this stage) at or after
    ``warmup_fraction`` of ``duration_s``; if there is none (a run shorter than one
    sampling interval), the first sample. Growth is
    ``(max after warm-up - warm-up) / warm-up * 100``.
    """
    key = f"{stage}_rss_kib"
    points = [(s["t"], s[key]) for s in samples if s.get(key) is not None]
    if not points:
        return {"samples": 0, "warmup_t": None, "warmup_kib": None, "final_kib": None, "max_kib": None,
                "max_after_warmup_kib": None, "growth_pct": None}
    index = next((i for i, (t, _) in enumerate(points) if t >= warmup_fraction * duration_s), 0)
    warmup_t, warmup = points[index]
    after = max(rss for _, rss in points[index:])
    return {"samples": len(points), "warmup_t": round(warmup_t, 3), "warmup_kib": warmup,
            "final_kib": points[-1][1], "max_kib": max(rss for _, rss in points),
            "max_after_warmup_kib": after, "growth_pct": round((after - warmup) / warmup * 100.0, 3)}


def _stage_argv(stage: str, experiment: str, flags: list[str]) -> list[str]:
    return [sys.executable, "-m", "distgrad.cli", "stage", stage, "--experiment", experiment, *flags]


def soak(steps: int, interval_s: float, *, deadline_s: float = 1800.0, max_growth_pct: float = 10.0,
         experiment: str = "seed-reverse", workdir: str | Path | None = None,
         warmup_fraction: float = WARMUP_FRACTION,
         progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``steps`` training steps over two processes, sampling both RSS every ``interval_s``.

    Returns ``{"config", "samples", "stages", "exit_codes", "duration_s", "steps_per_s", "ok",
    "failures", ...}``: ``samples`` are ``{"t", "f_rss_kib", "g_rss_kib"}`` with ``t`` in seconds
    since f started (an RSS is None once that process is gone), ``stages`` holds ``stage_stats``
    per stage, ``ok`` is False when a stage exited non-zero or grew more than ``max_growth_pct``
    after warm-up (``failures`` says why). Raises ``SoakError`` when g writes no ready file within
    ``READY_TIMEOUT_S``, exits before it, or the run is not over within ``deadline_s`` (both
    processes are then killed). Logs (and the stages' summaries) go to ``workdir``, by default a
    temporary directory that is removed afterwards.
    """
    if steps < 1 or not interval_s > 0 or not deadline_s > 0:
        raise ValueError("steps must be >= 1, interval_s and deadline_s > 0")
    say = progress or (lambda text: None)
    with tempfile.TemporaryDirectory(prefix="distgrad-soak-") as tmp_name:
        tmp = Path(workdir) if workdir is not None else Path(tmp_name)
        tmp.mkdir(parents=True, exist_ok=True)
        return _soak(steps, interval_s, deadline_s, max_growth_pct, experiment, tmp, warmup_fraction, say)


def _soak(steps: int, interval_s: float, deadline_s: float, max_growth_pct: float, experiment: str,
          tmp: Path, warmup_fraction: float, say: Callable[[str], None]) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + deadline_s
    ready = tmp / "ready"
    ready.unlink(missing_ok=True)
    common = ["--steps", str(steps)]
    stages: dict[str, _Stage] = {}
    samples: list[dict[str, Any]] = []
    try:
        stages["g"] = g = _Stage("g", _stage_argv("g", experiment, [
            "--bind", "tcp://127.0.0.1:*", "--ready-file", str(ready), *common,
            "--summary", str(tmp / "g.summary.json")]), tmp / "g.log")
        ready_by = min(deadline, time.monotonic() + READY_TIMEOUT_S)
        endpoint = ""
        while not endpoint:
            if g.proc.poll() is not None:
                raise SoakError(f"stage g exited with code {g.proc.returncode} before it was ready:\n{g.tail()}")
            if time.monotonic() > ready_by:
                raise SoakError(f"stage g wrote no endpoint to {ready} within {READY_TIMEOUT_S:g} s:\n{g.tail()}")
            if ready.exists():
                endpoint = ready.read_text().strip()
            if not endpoint:
                time.sleep(TICK_S)
        say(f"g serving on {endpoint} (pid {g.proc.pid})")

        stages["f"] = f = _Stage("f", _stage_argv("f", experiment, [
            "--connect", endpoint, *common, "--summary", str(tmp / "f.summary.json")]), tmp / "f.log")
        t0 = time.monotonic()
        say(f"f driving {steps} steps (pid {f.proc.pid}); sampling every {interval_s:g} s")
        next_sample = t0
        while f.proc.poll() is None:
            now = time.monotonic()
            if now > deadline:
                raise SoakError(f"run not over within the deadline of {deadline_s:g} s; both stages killed")
            if now >= next_sample:
                sample = {"t": round(now - t0, 3)}
                for name in STAGES:
                    sample[f"{name}_rss_kib"] = read_rss_kib(stages[name].proc.pid)
                if sample["f_rss_kib"] is None and f.proc.poll() is not None:
                    break                       # f exited between the two checks: not a sample
                samples.append(sample)
                while next_sample <= now:       # fixed schedule, no drift; skip slots we overran
                    next_sample += interval_s
            time.sleep(max(0.0, min(TICK_S, next_sample - time.monotonic())))
        duration = time.monotonic() - t0
        say(f"f exited with code {f.proc.returncode} after {duration:.2f} s; {len(samples)} samples")

        server_by = min(deadline, time.monotonic() + SERVER_EXIT_S)
        while g.proc.poll() is None and time.monotonic() < server_by:
            time.sleep(TICK_S)
        if g.proc.poll() is None and time.monotonic() >= deadline:
            raise SoakError(f"stage g still running at the deadline of {deadline_s:g} s; killed")
    finally:
        for stage in reversed(list(stages.values())):
            stage.stop()

    exit_codes = {name: stages[name].proc.returncode for name in STAGES}
    summaries = {}
    for name in STAGES:
        try:
            summaries[name] = json.loads((tmp / f"{name}.summary.json").read_text())
        except (OSError, ValueError):
            summaries[name] = None
    loop_s = (summaries["f"] or {}).get("elapsed_s")
    stats = {name: stage_stats(samples, name, duration, warmup_fraction) for name in STAGES}
    failures = []
    for name in STAGES:
        if exit_codes[name] != 0:
            how = " (stopped by soak)" if stages[name].killed else ""
            failures.append(f"stage {name} exited with code {exit_codes[name]}{how}")
        growth = stats[name]["growth_pct"]
        if growth is None:
            failures.append(f"stage {name}: no RSS samples")
        elif growth > max_growth_pct:
            failures.append(f"stage {name}: RSS grew {growth:.2f}% after warm-up (limit {max_growth_pct:g}%)")
    result: dict[str, Any] = {
        "config": {"experiment": experiment, "steps": steps, "interval_s": interval_s, "deadline_s": deadline_s,
                   "max_growth_pct": max_growth_pct, "warmup_fraction": warmup_fraction},
        "exit_codes": exit_codes,
        "duration_s": round(duration, 3),
        "loop_s": loop_s,
        "steps_per_s": round(steps / loop_s, 1) if loop_s else None,
        "wall_steps_per_s": round(steps / duration, 1) if duration > 0 else None,
        "final_loss": (summaries["f"] or {}).get("final_loss"),
        "stages": stats,
        "samples": samples,
        "ok": not failures,
        "failures": failures,
    }
    if failures:
        result["log_tails"] = {name: stages[name].tail() for name in STAGES}
    return result


def format_table(result: dict[str, Any]) -> str:
    """The per-stage figures as a small fixed-width table (KiB, and MiB in brackets)."""
    def kib(value: int | None) -> str:
        return "-" if value is None else f"{value} ({value / 1024:.1f} MiB)"
    rows = [("stage", "exit", "warm-up RSS", "final RSS", "max RSS", "growth")]
    for name in STAGES:
        s = result["stages"][name]
        growth = "-" if s["growth_pct"] is None else f"{s['growth_pct']:.2f}%"
        rows.append((name, str(result["exit_codes"][name]), kib(s["warmup_kib"]), kib(s["final_kib"]),
                     kib(s["max_kib"]), growth))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


class _Terminated(BaseException):
    """Raised by the SIGTERM handler: unwinds through soak()'s ``finally``, which stops both stages."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    p = argparse.ArgumentParser(description="Soak run: a long two-process run with the RSS of both stages sampled.")
    p.add_argument("--steps", type=int, default=100_000, help="training steps (default 100000)")
    p.add_argument("--interval-s", type=float, default=2.0, help="seconds between RSS samples (default 2)")
    p.add_argument("--deadline-s", type=float, default=1800.0,
                   help="the whole run must end within this; then both stages are killed (default 1800)")
    p.add_argument("--max-growth-pct", type=float, default=10.0,
                   help="fail if either stage's RSS grows more than this after warm-up (default 10)")
    p.add_argument("--experiment", default="seed-reverse", help="built-in name or TOML path (default seed-reverse)")
    p.add_argument("--workdir", type=Path, help="keep logs and stage summaries here (default: a temporary dir)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every sample and the summary here")
    args = p.parse_args(argv)
    if args.steps < 1 or not args.interval_s > 0 or not args.deadline_s > 0:
        p.error("--steps must be >= 1; --interval-s and --deadline-s must be > 0")
    signal.signal(signal.SIGTERM, _on_sigterm)

    def say(text: str) -> None:
        print(f"[soak {time.strftime('%H:%M:%S')}] {text}", file=out, flush=True)

    try:
        result = soak(args.steps, args.interval_s, deadline_s=args.deadline_s, max_growth_pct=args.max_growth_pct,
                      experiment=args.experiment, workdir=args.workdir, progress=say)
    except SoakError as e:
        say(f"FAILED: {e}")
        return 1
    except KeyboardInterrupt:
        say("interrupted (SIGINT); both stages stopped")
        return 130
    except _Terminated:
        say("terminated (SIGTERM); both stages stopped")
        return 143
    print(format_table(result), file=out)
    rate = f"{result['steps_per_s']:.0f}" if result["steps_per_s"] else "?"
    print(f"{args.steps} steps in {result['duration_s']:.2f} s wall ({rate} steps/s in f's training loop), "
          f"{len(result['samples'])} samples every {args.interval_s:g} s", file=out)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"samples and summary written to {args.json}", file=out)
    for failure in result["failures"]:
        say(f"FAILED: {failure}")
    for name, tail in result.get("log_tails", {}).items():
        print(f"--- last lines of {name}'s log ---\n{tail}", file=out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
