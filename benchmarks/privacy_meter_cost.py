"""What the live privacy meter costs: digits at batch 32 over two stage processes, metered and not.

Usage: python benchmarks/privacy_meter_cost.py [--steps N] [--repeats N] [--json PATH]

Each repeat runs ``distgrad run digits`` (stage processes over tcp 127.0.0.1)
once without and once with ``--privacy-meter`` (both stages metered, windows
of 50 steps), alternately so machine noise hits both alike, and takes the
driving stage's wall time per step from its summary. Prints the median step
time of each and the overhead ((metered - plain) / plain); the target of
issue 23 is at most 10%. The metered run's parameters must equal the plain
run's (checked: the meter changes nothing).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

from distgrad.run.launcher import run_local


def one_run(steps: int, metered: bool, tmp: Path) -> tuple[float, dict]:
    """Wall seconds per step of the driving stage, and the run's summary."""
    summary = run_local("digits", steps=steps, log_level="WARNING", out=io.StringIO(), privacy_meter=metered,
                        summary_path=tmp / f"{'metered' if metered else 'plain'}.json")
    return summary["elapsed_s"] / steps, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    times: dict[str, list[float]] = {"plain": [], "metered": []}
    with tempfile.TemporaryDirectory() as name:
        for _ in range(args.repeats):
            for metered in (False, True):
                seconds, summary = one_run(args.steps, metered, Path(name))
                times["metered" if metered else "plain"].append(seconds)
                if metered:
                    assert summary["params"] == plain["params"], "the meter changed the run"
                    assert summary["label_leaks"] and summary["input_leaks"]
                else:
                    plain = summary
    plain_ms, metered_ms = (statistics.median(times[k]) * 1e3 for k in ("plain", "metered"))
    result = {"steps": args.steps, "repeats": args.repeats, "plain_step_ms": plain_ms,
              "metered_step_ms": metered_ms, "overhead": (metered_ms - plain_ms) / plain_ms}
    print(f"digits, batch 32, {args.steps} steps x {args.repeats}: {plain_ms:.3f} ms/step plain, "
          f"{metered_ms:.3f} ms/step metered: overhead {100 * result['overhead']:+.1f}%")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
