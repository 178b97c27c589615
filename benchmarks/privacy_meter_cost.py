"""What the live privacy meter costs: digits at batch 32 over two stage processes, metered and not.

Usage: python benchmarks/privacy_meter_cost.py [--steps N] [--repeats N] [--json PATH]

Each repeat runs ``distgrad run digits`` (stage processes over tcp 127.0.0.1)
once without and once with ``--privacy-meter`` (both stages metered, windows
of 50 steps), alternately so machine noise hits both alike, and takes the
driving stage's wall time per step from its summary. Prints the median step
time of each and the overhead ((metered - plain) / plain); the target: at most
10%. The metered run's parameters must equal the plain
run's (checked: the meter changes nothing). The same pair in one process
(``--in-process``, no wire) gives the meter's own cost with less noise: the
meter's work at the label owner runs after its reply has left, so over
processes it partly overlaps the data owner's next step. Each metered run
also reports the wall time its meters spent (the summary's ``input_meter_s``
and ``label_meter_s``): the meter's own work per step, which machine noise
inflates far less than a difference of two runs.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
from pathlib import Path

from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.run.launcher import run_local


def one_run(steps: int, metered: bool, tmp: Path, in_process: bool) -> tuple[float, dict]:
    """Wall seconds per step of the driving stage (or of the in-process run), and the run's summary."""
    if in_process:
        summary = train_in_process(load_experiment("digits"), steps=steps, privacy_meter=metered)
        return summary["elapsed_s"] / steps, summary
    summary = run_local("digits", steps=steps, log_level="WARNING", out=io.StringIO(), privacy_meter=metered,
                        summary_path=tmp / f"{'metered' if metered else 'plain'}.json")
    return summary["elapsed_s"] / steps, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result: dict[str, float | int] = {"steps": args.steps, "repeats": args.repeats}
    with tempfile.TemporaryDirectory() as name:
        for where, in_process in (("processes", False), ("in_process", True)):
            times: dict[bool, list[float]] = {False: [], True: []}
            spent: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                plain: dict = {}
                for metered in (False, True):
                    seconds, summary = one_run(args.steps, metered, Path(name), in_process)
                    times[metered].append(seconds)
                    if metered:
                        assert summary["params"] == plain["params"], "the meter changed the run"
                        assert summary["label_leaks"] and summary["input_leaks"]
                        for key in ("input_meter_s", "label_meter_s"):
                            spent.setdefault(key, []).append(summary[key] / args.steps)
                    else:
                        plain = summary
            plain_ms, metered_ms = (statistics.median(times[k]) * 1e3 for k in (False, True))
            own = {key: statistics.median(values) * 1e3 for key, values in spent.items()}
            result.update({f"{where}_plain_step_ms": plain_ms, f"{where}_metered_step_ms": metered_ms,
                           f"{where}_overhead": (metered_ms - plain_ms) / plain_ms,
                           **{f"{where}_{key.removesuffix('_s')}_ms_per_step": value for key, value in own.items()}})
            print(f"digits, batch 32, {args.steps} steps x {args.repeats}, {where.replace('_', ' ')}: "
                  f"{plain_ms:.3f} ms/step plain, {metered_ms:.3f} ms/step metered: overhead "
                  f"{100 * (metered_ms - plain_ms) / plain_ms:+.1f}%; the meters' own work "
                  f"{own['input_meter_s']:.4f} ms/step (data owner) and {own['label_meter_s']:.4f} ms/step "
                  f"(label owner)")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
