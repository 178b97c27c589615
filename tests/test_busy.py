"""A second data owner started while a run is in progress is told at once that the serving stage is busy
with another run (its run id, since when) and exits 4, not a timeout saying there was no reply (real
processes). A driver restarted after a crash, whose old run's client is silent, still takes over once the
stage counts that client gone (tests/test_faults.py)."""

from __future__ import annotations

import re
import time

import pytest

from conftest import StageProcess, wait_for_file

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
    """The first data owner keeps stepping (a long run); the second gets the busy reply naming the first's
    run and when it started, and exits 4 with it: not a timeout (exit 3) saying the stage did not answer."""
    ready = tmp_path / "g.ready"
    experiment = ["--experiment", "seed-reverse", "--steps", "1000000"]
    with StageProcess(["g", *experiment, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready],
                      tmp_path / "g.log") as g:
        endpoint = wait_for_file(ready, g)
        with StageProcess(["f", *experiment, "--connect", endpoint], tmp_path / "f1.log") as first:
            run = _started_run(g)
            with StageProcess(["f", *experiment, "--connect", endpoint, "--peer-deadline", "20"],
                              tmp_path / "f2.log") as second:
                code = second.wait()
                out = second.output
            assert code == EXIT_REJECTED, out
            assert re.search(rf"busy with run '{re.escape(run)}' since \d{{4}}-\d\d-\d\dT\d\d:\d\d:\d\dZ", out), out
            assert f"serving stage at {endpoint}" in out and "one run at a time" in out
            assert "no reply" not in out and "is the serving stage running" not in out
            assert first.proc.poll() is None, first.output          # the first run goes on undisturbed


def test_the_busy_text_carries_the_figures_a_driver_reads():
    from distgrad.wire.messages import busy_silence, busy_text
    text = busy_text("run", "r1", 0.0, "its client", 0.25, 10.0)
    assert text.startswith("busy with run 'r1' since an unknown time (its client: heard 0.25 s ago")
    assert busy_silence(text) == (0.25, 10.0)
    assert busy_silence("busy: something else") is None and busy_silence("unknown run") is None
