"""The driving stage's use of the wait for a reply: what needs no reply is done while one is
awaited, not between a reply and the next forward, and every applied step is still reported.

Both stages run in this process (``serve_stage`` in a thread, ``drive_stage`` here) over tcp on 127.0.0.1.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from distgrad.api import drive_stage, serve_stage
from distgrad.config.data import Ramp
from distgrad.config.parse import load_experiment
from distgrad.errors import StageError
from distgrad.run.driver import _Driver
from distgrad.run.inprocess import train_in_process
from distgrad.stage.stage import Stage
from distgrad.wire.link import DownstreamLink

from conftest import read_lines


def _record_driver_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """``("features", step)`` for each batch the driving stage (this thread) fetches and ``("wait", step)``
    for each reply it begins to await, in order."""
    events: list[tuple[str, int]] = []
    main = threading.current_thread()
    features, await_reply = Ramp.features, DownstreamLink.await_reply

    def recorded_features(self, step):
        if threading.current_thread() is main:      # the serving stage's targets are its features too
            events.append(("features", step))
        return features(self, step)

    def recorded_await_reply(self, pending, key, types=None):
        events.append(("wait", key[0]))
        return await_reply(self, pending, key, types)

    monkeypatch.setattr(Ramp, "features", recorded_features)
    monkeypatch.setattr(DownstreamLink, "await_reply", recorded_await_reply)
    return events


@pytest.mark.parametrize("staleness", [0, 2])
def test_the_next_batch_is_fetched_while_the_reply_is_awaited(monkeypatch, staleness):
    """Step t+1's batch (a function of the step, not of the parameters) is fetched after step t's forward is
    sent and before its reply is awaited, once per step; the parameters are those of the plain order."""
    steps = 6
    events = _record_driver_events(monkeypatch)
    with serve_stage("seed-reverse", steps=steps) as g:
        summary = drive_stage("seed-reverse", g.endpoint, steps=steps, staleness=staleness)
    events = [event for event in events if event[0] == "features" or event[1] > 0]     # not the hello's
    assert sorted(step for kind, step in events if kind == "features") == list(range(1, steps + 1))
    for step in range(1, steps):
        assert events.index(("features", step + 1)) < events.index(("wait", step)), events
    reference = train_in_process(load_experiment("seed-reverse"), steps=steps, staleness=staleness)
    assert summary["params"]["f"] == reference["params"]["f"]


def _metrics_of_a_failing_run(tmp_path: Path) -> list[dict]:
    """The driver's metrics lines of a seed-reverse run of 6 steps that fails with an injected StageError."""
    metrics = tmp_path / "f.jsonl"
    with serve_stage("seed-reverse", steps=6) as g:
        with pytest.raises(StageError, match="injected"):
            # g answers at once; the deadline is a hang guard, generous so a busy machine cannot turn the
            # injected failure into a timeout.
            drive_stage("seed-reverse", g.endpoint, steps=6, metrics_path=metrics, timeout_s=2.0,
                        peer_deadline_s=30.0)
    return read_lines(metrics)


def test_a_step_applied_before_a_failure_is_reported(monkeypatch, tmp_path: Path):
    """Reports of applied steps are written while the next reply is awaited; when the run fails before that
    (here: the forward of step 4), the steps applied are still in the metrics file."""
    forward = Stage.forward

    def failing_forward(self, x, mb=0, training=True):
        if self.name == "f" and training and self.step + 1 == 4:
            raise StageError("stage f: forward failed at step 4: injected")
        return forward(self, x, mb, training)

    monkeypatch.setattr(Stage, "forward", failing_forward)
    assert [line["step"] for line in _metrics_of_a_failing_run(tmp_path)] == [1, 2, 3]


def test_a_step_whose_evaluation_fails_is_still_reported(monkeypatch, tmp_path: Path):
    """A step is applied before its evaluation: when that evaluation fails (here: after step 3), the step's
    record is still written, without scores, as docs/watching.md promises for every step a failed run applied."""
    monkeypatch.setattr(_Driver, "_evaluation_due", lambda self, step: step == 3)

    def failing_evaluate(self):
        raise StageError(f"stage f: evaluation after step {self.state.stage.step} failed: injected")

    monkeypatch.setattr(_Driver, "evaluate", failing_evaluate)
    lines = _metrics_of_a_failing_run(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert not any(key.startswith("test_") for key in lines[-1])


def test_no_wait_for_a_reply_outlasts_the_peer_deadline(monkeypatch):
    """A --timeout longer than --peer-deadline: each wait for a reply is cut to what is left of the deadline,
    so a silent peer makes the driver give up within --peer-deadline, not after one whole --timeout."""
    import time

    import zmq

    from distgrad.errors import PeerTimeout
    from distgrad.wire import messages as wire
    from distgrad.wire.link import LinkSettings
    from distgrad.wire.transport import Client

    asked: list[float] = []

    def silent_wait(self, run, keys, timeout_s, check_stop=None, what=lambda: ""):
        asked.append(timeout_s)
        time.sleep(min(timeout_s, 0.02))       # stands for a peer that never answers
        raise PeerTimeout(f"no reply within {timeout_s:g} s")

    monkeypatch.setattr(Client, "wait", silent_wait)
    ctx = zmq.Context()
    try:
        settings = LinkSettings("f", timeout_s=1000.0, liveness_s=10.0, peer_deadline_s=0.3)
        link = DownstreamLink(settings, "tcp://127.0.0.1:9", lambda: None, ctx, None, None)
        request = wire.Message(wire.FORWARD, "run", 1)
        with pytest.raises(PeerTimeout, match="gave up after retrying for 0.3 s"):
            link.await_reply({(1, 0): request}, (1, 0))
        link.client.close(0)
    finally:
        ctx.destroy(linger=0)
    assert asked and max(asked) <= 0.3, asked
