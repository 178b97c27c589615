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


@pytest.mark.integration
@pytest.mark.parametrize("group", [False, True], ids=["cut-server", "group-server-of-clients"])
def test_a_second_data_owner_of_the_cut_library_is_told_the_loop_is_busy_mid_run_and_stops_at_once(group):
    """The cut library's label owner, mid-run (steps applied) with its data owners live: another run's data
    owner is told the stage is busy with that run (its id, since when) and raises at once; it was told
    only that the label owner 'is in run ... at step N' (a refusal that did not say the run is live)."""
    import threading

    import numpy as np

    from distgrad.cut import Cut, CutServer
    from distgrad.errors import PeerRejected

    fields: dict = dict(name="busy-loop", stages=["f", "g"], batch=4, activation=[3], steps=40, seed=0)
    if group:
        fields.update(clients=2, data={"kind": "synthetic_regression", "features": 2, "batch": 4, "samples": 64})
    clients: list = [0, 1] if group else [None]
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=30.0, peer_deadline_s=30.0, **fields)
    stepped = threading.Event()

    def serve() -> None:
        with server:
            for batch in server:
                batch.reply(1.0, np.ones((4, 3), np.float32))

    def connect(client: int | None) -> Cut:
        return Cut.connect(server.endpoint, timeout_s=5.0, peer_deadline_s=30.0,
                           **({} if client is None else {"client": client}), **fields)

    def step(cut: Cut, group: bool) -> None:
        cut.step(np.ones((4, 3), np.float32), *([cut.rows()] if group else []))

    def first(client: int | None) -> None:
        with connect(client) as cut:
            for _ in range(fields["steps"]):
                step(cut, group)
                stepped.set()
                time.sleep(0.05)        # a data owner computing between its steps: the loop has time to serve

    threads = [threading.Thread(target=serve, daemon=True),
               *(threading.Thread(target=first, args=(c,), daemon=True) for c in clients)]
    for thread in threads:
        thread.start()
    assert stepped.wait(30), "the first data owner never stepped"
    with pytest.raises(PeerRejected) as refused:
        with connect(clients[0]) as second:
            step(second, group)
    text = str(refused.value)
    assert re.search(r"busy with run '\w+' since \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", text), text
    for thread in reversed(threads):      # the first run ends, then the loop closes its server
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads)
