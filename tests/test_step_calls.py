"""What a lockstep step costs each side in Python calls: the common case (one data owner, one label owner,
no staleness, one micro-batch) takes a short path through the same driver and serving stage.

Counted in one process, without sockets (the driving stage's link sends each message, encoded and decoded as
it would cross, to a ``ServingStage``), with ``sys.setprofile``: a count, not a timing, so it does not depend
on the machine's load. ``benchmarks/copies.py`` gives the same figure for two real processes.
The run is checked against the in-process reference bitwise, so the short path computes what the long one
does.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import zmq

from distgrad.config.parse import load_experiment
from distgrad.run.driver import _Driver
from distgrad.run.inprocess import train_in_process
from distgrad.run.options import StageOptions, StopFlag
from distgrad.run.serving import ServingStage
from distgrad.wire import messages as wire

RUN = "0123456789abcdef0123456789abcdef"
PEER = [b"peer"]
WARM_STEPS = 5
COUNTED_STEPS = 10
# Python calls per step of seed-reverse (one weight a side, Adam) in this harness: 80.5 on the data owner's side
# and 134 on the label owner's before the lockstep path was made short, 53.6 and 100 after.
MAX_F_CALLS = 60
MAX_G_CALLS = 108



class _Calls:
    """Counts the Python calls of this thread, on the side (``f`` or ``g``) in progress."""

    def __init__(self) -> None:
        self.side = "f"
        self.counts = {"f": 0, "g": 0}

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.counts[self.side] += 1


def test_a_lockstep_step_is_a_short_path_on_both_sides_and_computes_the_reference():
    steps = WARM_STEPS + COUNTED_STEPS
    exp = load_experiment("seed-reverse")
    logic = ServingStage(StageOptions(exp, exp.stage_names[-1], exp.seed, steps=steps))
    driver = _Driver(StageOptions(exp, exp.stage_names[0], exp.seed, steps=steps), "tcp://127.0.0.1:9",
                     StopFlag(), zmq.Context.instance())
    calls = _Calls()
    replies: list[list[bytes]] = []

    def send(msg: wire.Message) -> None:         # the label owner's side of a step, between the two sockets
        side, calls.side = calls.side, "g"
        try:
            msg = wire.decode([memoryview(f).tobytes() for f in wire.encode(msg)], logic.max_tensor_bytes)
            answers = logic.handle(PEER, msg, 0.0)
            while answers:
                replies.extend([memoryview(f).tobytes() for f in wire.encode(reply)] for _, reply in answers)
                answers = logic.settle()
        finally:
            calls.side = side

    def wait(run, keys, timeout_s, check_stop=None, what=None) -> wire.Message:
        check_stop()
        return wire.decode(replies.pop(0), driver.link.client.max_reply_bytes)

    driver.link.client.send, driver.link.client.wait = send, wait     # type: ignore[method-assign]
    try:
        driver.state.begin(RUN)
        driver.handshake()
        driver.report_every, driver.last_step = 10**9, 0
        driver.started = driver.last_report = 0.0

        def step() -> None:
            driver.step_started, driver.wait_before, driver.g_before = 0.0, 0.0, 0.0
            driver.step_once()
            driver._after_step()

        for _ in range(WARM_STEPS):
            step()
        sys.setprofile(calls)
        try:
            for _ in range(COUNTED_STEPS):
                step()
        finally:
            sys.setprofile(None)
        f_calls, g_calls = (calls.counts[side] / COUNTED_STEPS for side in "fg")
        assert f_calls <= MAX_F_CALLS, f"the data owner's step made {f_calls:g} Python calls (at most {MAX_F_CALLS})"
        assert g_calls <= MAX_G_CALLS, f"the label owner's step made {g_calls:g} Python calls (at most {MAX_G_CALLS})"

        print(f"Python calls per step: f {f_calls:g}, g {g_calls:g}")
        reference = train_in_process(exp, steps=steps)["params"]
        assert driver.state.stage.step == logic.stage.step == steps
        for stage in (driver.state.stage, logic.stage):
            assert sorted(reference[stage.name]) == sorted(stage.params)
            for name, value in stage.params.items():
                assert np.array_equal(np.asarray(reference[stage.name][name], np.float32), value), name
    finally:
        driver.link.close(0)
