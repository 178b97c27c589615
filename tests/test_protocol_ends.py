"""The protocol's shared rules, tested against every serving end alike: a ``distgrad-stage`` daemon and the
cut library's ``CutServer``, each over real sockets, driven by a raw DEALER sending what a real data owner
never would. Both follow ``run.protocol`` (refusals, ping/pong, the run's owner key, the order of a step's
forwards, the cache of resent replies and evaluations, the bye and its replay), so each rule is checked
once here for both ends."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import zmq

from conftest import hello_message
from distgrad.config.parse import load_experiment
from distgrad.cut import CutServer
from distgrad.run.cut_interface import FIRST, cut_side
from distgrad.stage.stage import Stage
from distgrad.wire import messages as wire
from distgrad.wire.messages import ErrorCode, Message
from test_bad_input import UNDECODABLE
from test_cut_hostile import ask, curve_keys, dealer, refused

LIVENESS_S = 2.0
CUT_FIELDS = dict(name="protocol-ends", stages=["f", "g"], batch=4, activation=[3], steps=3, seed=0)


@dataclass
class End:
    """A label owner serving at ``endpoint``, with the experiment (``exp``) a data owner of it runs and the
    shape of one step's activation (``shape``); ``stop()`` ends it and returns what its loop raised."""

    kind: str
    endpoint: str
    exp: Any
    shape: tuple[int, ...]
    stop: Callable[[], Any]


def _cut_end(**bind: Any) -> End:
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=LIVENESS_S, peer_deadline_s=10.0, **bind, **CUT_FIELDS)
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            with server:
                for batch in server:
                    batch.reply(float(batch.step), np.ones(batch.h.shape, np.float32))
        except BaseException as e:       # handed to the test
            errors.append(e)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def stop() -> Any:
        thread.join(LIVENESS_S + 10.0)
        server.close()
        if "ctx" in bind:
            bind["ctx"].term()
        return errors[0] if errors else None

    exp = cut_side(FIRST, None, CUT_FIELDS).exp
    return End("cut", server.endpoint, exp, (4, 3), stop)


def _daemon_end(start_server, *extra: str) -> End:
    g, endpoint = start_server("seed-reverse", "--keep-serving", "--liveness", str(LIVENESS_S), *extra)
    exp = load_experiment("seed-reverse")
    shape = tuple(Stage.from_experiment(exp, "g").input_shape)
    return End("daemon", endpoint, exp, shape, lambda: None if "Traceback" not in g.output else g.output[-3000:])


@pytest.fixture(params=["daemon", "cut"])
def end_kind(request) -> str:
    return request.param


@pytest.fixture
def dealers() -> Iterator[Callable[..., zmq.Socket]]:
    """DEALER sockets to an end (``dealer`` of the cut library's hostile tests) in a context of their own."""
    ctx = zmq.Context()
    yield lambda endpoint, **curve: dealer(ctx, endpoint, **curve)
    ctx.destroy(linger=0)


def forward(end: End, run: str, step: int, h: np.ndarray | None = None, mb: int = 0, mbs: int = 1) -> Message:
    h = np.full(end.shape, 0.5, np.float32) if h is None else h
    return Message(wire.FORWARD, run, step, mb, mbs, tensors={"activation": h})


@pytest.mark.integration
def test_every_serving_end_follows_the_same_rules(end_kind, start_server, dealers):
    """Refusals of undecodable and out-of-turn messages, ping, the reply cache, the bye and its replay:
    the same codes and texts from the daemon and from the cut library."""
    end = _daemon_end(start_server) if end_kind == "daemon" else _cut_end()
    a = dealers(end.endpoint)
    try:
        for frames, code in UNDECODABLE:
            refused(a, frames, code)
        refused(a, forward(end, "a", 1), ErrorCode.RUN, "hello first")           # before any hello
        pong = ask(a, Message(wire.PING, "", 0))
        assert pong.type == wire.PONG and {"stage", "experiment", "run", "step"} <= set(pong.body), pong.body
        refused(a, hello_message(end.exp, "a", purpose="predict"), ErrorCode.MISMATCH, "hello has purpose=")
        refused(a, hello_message(end.exp, "a", eval_every=-1), ErrorCode.MALFORMED, "eval_every=")
        welcome = ask(a, hello_message(end.exp, "a"))
        assert welcome.type == wire.WELCOME and welcome.body["next_step"] == 1, welcome.body
        refused(a, forward(end, "other", 1), ErrorCode.RUN, "forward for run 'other', expected run a")
        refused(a, Message(wire.WELCOME, "a", 1), ErrorCode.TYPE, "does not accept 'welcome' messages")
        refused(a, wire.abort_notice("other", "f", "not its run"), ErrorCode.RUN,    # stops no run but its own
                "an aborted notice of run 'other', expected run a")
        refused(a, forward(end, "a", 3), ErrorCode.STEP, "forward for step 3 micro-batch 0/1; expected step 1 "
                                                         "micro-batch 0/1")
        refused(a, forward(end, "a", 1, mb=0, mbs=2), ErrorCode.STEP, "expected step 1")
        refused(a, forward(end, "a", 1, np.full(end.shape, np.nan, np.float32)), ErrorCode.NONFINITE)
        refused(a, forward(end, "a", 1, np.ones(end.shape, np.float64)), ErrorCode.TENSOR)
        first = ask(a, forward(end, "a", 1))
        assert first.type == wire.BACKWARD, first.body
        again = ask(a, forward(end, "a", 1))                                    # resent: the cached reply
        assert again.type == wire.BACKWARD and again.body == first.body
        assert again.tensors.keys() == first.tensors.keys() and all(
            np.array_equal(again.tensors[n], first.tensors[n]) for n in first.tensors)
        refused(a, Message(wire.BYE, "a", 2, body={"steps": 5}), ErrorCode.STEP, "bye after 5 steps, but")
        assert ask(a, forward(end, "a", 2)).type == wire.BACKWARD
        bye = ask(a, Message(wire.BYE, "a", 3, body={"steps": 2}))
        assert bye.type == wire.BYE and bye.body["steps"] == 2
        assert ask(a, Message(wire.BYE, "a", 3, body={"steps": 2})).body == bye.body   # a lost reply: again
        after = ask(a, Message(wire.PING, "", 0))
        assert after.type == wire.PONG and after.body["run"] == "", after.body        # no run is open now
    finally:
        a.close()
        assert end.stop() is None


@pytest.mark.integration
def test_with_curve_every_serving_end_keeps_a_run_to_the_key_that_opened_it(end_kind, start_server, dealers,
                                                                            tmp_path):
    """Another allowed key may not drive the run, nor end it: refused with the same text at both ends."""
    server_secret, keys = curve_keys(tmp_path, ("owner", "other"))
    if end_kind == "daemon":
        end = _daemon_end(start_server, "--curve-secret", str(server_secret), "--allow", str(tmp_path / "clients"))
    else:
        end = _cut_end(curve_secret=server_secret, allow=tmp_path / "clients", ctx=zmq.Context())

    def curve_dealer(name: str) -> zmq.Socket:
        return dealers(end.endpoint, **keys[name])

    owner, other = curve_dealer("owner"), curve_dealer("other")
    try:
        assert ask(owner, hello_message(end.exp, "a")).type == wire.WELCOME
        refused(other, forward(end, "a", 1), ErrorCode.RUN, "this run belongs to another client key")
        refused(other, Message(wire.BYE, "a", 1, body={"steps": 0}), ErrorCode.RUN,
                "this run belongs to another client key")
        refused(other, wire.abort_notice("a", "f", "not its run"), ErrorCode.RUN,
                "an aborted notice not from the data owner: this run belongs to another client key")
        assert ask(owner, forward(end, "a", 1)).type == wire.BACKWARD
        assert ask(owner, Message(wire.BYE, "a", 2, body={"steps": 1})).type == wire.BYE
    finally:
        owner.close()
        other.close()
        assert end.stop() is None

