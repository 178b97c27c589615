"""``distgrad stage``, held at gates (files) that the test creates.

    python tests/gated_stage.py [--start-gate FILE] [--step-gate STEP FILE] [--average-gate STEP FILE]
                                [--hold-after-save STEP FILE] [--hold-after-test FILE]
                                [--exit-before-update STEP FILE] -- f --experiment ...

A test orders events across stage processes with these gates instead of timing them:

- ``--start-gate FILE``: the process starts (its imports done) and waits for FILE before the stage
  begins, that is before it takes its checkpoint directory's lock, resumes or connects.
- ``--step-gate STEP FILE``: the stage waits for FILE before it computes step STEP (once).
- ``--average-gate STEP FILE``: a SplitFed client waits for FILE after its update of step STEP, before it
  sends its parameters for that step's average (once).
- ``--hold-after-save STEP FILE``: any stage (a serving one too), once it has written its checkpoint of
  step STEP, creates FILE and stops there, as if frozen, until it is killed: a test kills it between that
  checkpoint and whatever the stage would have done next (its replies).
- ``--hold-after-test FILE``: any stage, once it has recorded the final evaluation of a validation split (the
  kept model's test rows: ``StageState.record_test``, which checkpoints it), creates FILE and stops there until
  it is killed: the label owner before its reply leaves, a data owner before its bye.
- ``--exit-before-update STEP FILE``: any stage, once step STEP is complete (a first stage: its replies
  arrived) and before its update, creates FILE and exits at once with status 9, writing nothing more, as a
  SIGKILL there would (once: a start that finds FILE runs on).

The first three are for a first stage (``distgrad stage f``).

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
    parser.add_argument("--average-gate", nargs=2, metavar=("STEP", "FILE"),
                        help="wait for FILE before sending the SplitFed average of step STEP")
    parser.add_argument("--hold-after-save", nargs=2, metavar=("STEP", "FILE"),
                        help="after the checkpoint of step STEP, create FILE and wait to be killed")
    parser.add_argument("--hold-after-test", type=Path,
                        help="after recording the final evaluation, create this file and wait to be killed")
    parser.add_argument("--exit-before-update", nargs=2, metavar=("STEP", "FILE"),
                        help="before the update of step STEP, create FILE and exit 9 (unless FILE exists)")
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
    if args.average_gate is not None:
        average_step, average_gate = int(args.average_gate[0]), Path(args.average_gate[1])
        average = driver._Driver._average

        def gated_average(self, step):
            if step == average_step:
                wait_for_gate(average_gate)
            return average(self, step)

        driver._Driver._average = gated_average
    if args.hold_after_save is not None:
        _hold_after_save(int(args.hold_after_save[0]), Path(args.hold_after_save[1]))
    if args.hold_after_test is not None:
        _hold_after_test(args.hold_after_test)
    if args.exit_before_update is not None:
        _exit_before_update(int(args.exit_before_update[0]), Path(args.exit_before_update[1]))
    return cli.stage_main(stage_args)


def _hold_after_save(step: int, reached: Path) -> None:
    """After the checkpoint of ``step`` is written: create ``reached`` and wait to be killed (exit 1 after
    ``GATE_DEADLINE_S``)."""
    from distgrad.run import stage_state

    save = stage_state.StageState.save

    def save_then_hold(self, at_step=None, *a, **kw):
        save(self, at_step, *a, **kw)
        if (self.stage.step if at_step is None else at_step) == step:
            reached.touch()
            time.sleep(GATE_DEADLINE_S)
            raise SystemExit(f"gated_stage: not killed within {GATE_DEADLINE_S:g} s after the checkpoint of "
                             f"step {step}")

    stage_state.StageState.save = save_then_hold


def _hold_after_test(reached: Path) -> None:
    """After the final evaluation is recorded (and checkpointed): create ``reached`` and wait to be killed."""
    from distgrad.run import stage_state

    record = stage_state.StageState.record_test

    def record_then_hold(self, *a, **kw):
        record(self, *a, **kw)
        reached.touch()
        time.sleep(GATE_DEADLINE_S)
        raise SystemExit(f"gated_stage: not killed within {GATE_DEADLINE_S:g} s after the final evaluation")

    stage_state.StageState.record_test = record_then_hold


def _exit_before_update(step: int, reached: Path) -> None:
    """Before the update of ``step`` (``StepEngine.update``): create ``reached`` and exit 9 at once, as a
    SIGKILL would (no checkpoint, no exit handler); a process that finds ``reached`` already there runs on."""
    import os

    from distgrad.stage import engine

    update = engine.StepEngine.update

    def exit_then_update(self, at_step, *a, **kw):
        if at_step == step and not reached.exists():
            reached.touch()
            os._exit(9)
        return update(self, at_step, *a, **kw)

    engine.StepEngine.update = exit_then_update


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
