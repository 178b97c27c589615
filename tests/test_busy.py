"""A second data owner started while a run is in progress is told at once that the serving stage is busy
with another run (its run id, since when) and exits 4: no retries, no "no reply" (real processes)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from conftest import StageProcess, wait_for_file

GATED_STAGE = [sys.executable, Path(__file__).resolve().parent / "gated_stage.py"]
EXIT_REJECTED = 4


def _started_run(g: StageProcess, timeout: float = 30.0) -> str:
    """The run id the serving stage logged as started."""
    deadline = time.monotonic() + timeout
    while True:
        found = re.search(r"run (\S+) started by", g.output)
        if found:
            return found.group(1)
        assert time.monotonic() < deadline and g.proc.poll() is None, g.output
        time.sleep(0.02)


@pytest.mark.integration
def test_a_second_driver_is_told_the_stage_is_busy_and_exits_at_once(tmp_path):
    ready, gate = tmp_path / "g.ready", tmp_path / "step3.gate"
    experiment = ["--experiment", "seed-reverse", "--steps", "6"]
    # The first data owner holds before step 3; g counts it live long enough for the second to arrive.
    with StageProcess(["g", *experiment, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready, "--liveness", "120"],
                      tmp_path / "g.log") as g:
        endpoint = wait_for_file(ready, g)
        with StageProcess(["--step-gate", "3", gate, "--", "f", *experiment, "--connect", endpoint],
                          tmp_path / "f1.log", command=GATED_STAGE) as first:
            run = _started_run(g)
            with StageProcess(["f", *experiment, "--connect", endpoint, "--peer-deadline", "20"],
                              tmp_path / "f2.log") as second:
                code = second.wait()
                out = second.output
            assert code == EXIT_REJECTED, out
            assert re.search(rf"busy with run '{re.escape(run)}' since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ", out), out
            assert f"serving stage at {endpoint}" in out and "one run at a time" in out
            assert "retrying" not in out and "no reply" not in out and "is the serving stage running" not in out
            gate.touch()                      # the first run goes on undisturbed
            assert first.wait() == 0, first.output
