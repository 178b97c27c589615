"""``distgrad stage`` for a first stage, held at gates (files) that the test creates.

    python tests/gated_stage.py [--start-gate FILE] [--step-gate STEP FILE] -- f --experiment ...

A test orders events across stage processes with these gates instead of timing them:

- ``--start-gate FILE``: the process starts (its imports done) and waits for FILE before the stage
  begins, that is before it takes its checkpoint directory's lock, resumes or connects.
- ``--step-gate STEP FILE``: the stage waits for FILE before it computes step STEP (once).

Every wait is bounded by ``GATE_DEADLINE_S``: past it the process exits 1 naming the gate. Everything
else is ``distgrad stage ARGS`` (``distgrad.cli.stage_main``), unchanged.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

GATE_DEADLINE_S = 60.0
POLL_S = 0.002


def wait_for_gate(path: Path) -> None:
    """Return once ``path`` exists; ``SystemExit`` (1) after ``GATE_DEADLINE_S``."""
    deadline = time.monotonic() + GATE_DEADLINE_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"gated_stage: gate {path} not opened within {GATE_DEADLINE_S:g} s")
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gated_stage.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--start-gate", type=Path, help="wait for this file before the stage begins")
    parser.add_argument("--step-gate", nargs=2, metavar=("STEP", "FILE"),
                        help="wait for FILE before computing step STEP")
    parser.add_argument("stage_args", nargs=argparse.REMAINDER, help="-- then the arguments of distgrad stage")
    args = parser.parse_args(argv)
    stage_args = args.stage_args[1:] if args.stage_args[:1] == ["--"] else args.stage_args

    from distgrad import cli

    from distgrad.run import driver

    if args.start_gate is not None:
        drive = driver.drive_first_stage

        def gated_drive(*a, **kw):
            wait_for_gate(args.start_gate)
            return drive(*a, **kw)

        driver.drive_first_stage = gated_drive       # cli imports it from driver when the stage starts
    if args.step_gate is not None:
        gate_step, gate = int(args.step_gate[0]), Path(args.step_gate[1])
        step_once = driver._Driver.step_once

        def gated_step_once(self):
            if self.state.stage.step + 1 == gate_step:
                wait_for_gate(gate)
            return step_once(self)

        driver._Driver.step_once = gated_step_once
    return cli.stage_main(stage_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
