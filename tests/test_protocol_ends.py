"""The protocol's shared rules (``run.protocol``), each checked once against every end it applies to, over real
sockets: a hostile or careless peer sends what a real one never would, and every end answers alike (the same
error code and words), keeps serving, changes nothing, and an honest peer completes afterwards.

The serving ends: a ``distgrad-stage g`` daemon (a process of its own) and the cut library's ``CutServer``
(its loop on a thread), driven by raw DEALERs. The driving ends: a ``distgrad-stage f`` daemon (a process of
its own) and the cut library's ``Cut``, each facing a label owner that answers badly. The Hypothesis-driven
hostile frames against both serving ends are in test_hostile.py; what is the cut library's alone (its state
dicts, its loop's misuse) in test_cut_hostile.py.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import zmq

from conftest import StageProcess, hello_message, read_json, run_main, wait_for_file
from distgrad.config.parse import load_experiment
from distgrad.cut import Cut, CutServer
from distgrad.align import AlignOptions
from distgrad.errors import ConfigError, PeerAborted, PeerTimeout, ProtocolError
from distgrad.run.cut_interface import FIRST, cut_side
from distgrad.run.options import StageOptions
from distgrad.run.predict import PredictionServer
from distgrad.run.serving import ServingStage
from distgrad.stage.stage import Stage
from distgrad.wire import messages as wire
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.transport import MAX_FRAMES
from test_bad_input import UNDECODABLE
from test_cut_hostile import FIELDS, Loop, ask, curve_keys, dealer, refused
from handshake import only_reply

LIVENESS_S = 2.0
CUT_FIELDS = dict(name="protocol-ends", stages=["f", "g"], batch=4, activation=[3], steps=3, seed=0)


@dataclass
class End:
    """A label owner serving at ``endpoint``, with the experiment (``exp``) a data owner of it runs and the
    shape of one step's activation (``shape``). ``stop()`` ends it and returns what its loop raised;
    ``applied(run)`` the steps the label owner computed in ``run`` once it ended (the cut: the batches its
    loop saw, in order; the daemon: its summary's count), so a refused message visibly changed nothing;
    ``max_frame`` the largest frame it takes."""

    kind: str
    endpoint: str
    exp: Any
    shape: tuple[int, ...]
    stop: Callable[[], Any]
    applied: Callable[[str], list[int]]
    max_frame: int
    log: Callable[[], str] = lambda: ""
    files: Callable[[], dict[str, bytes]] = dict     # what it keeps on disk (the daemon: its checkpoints)

    def answered(self, reply: Message, step: int) -> None:
        """``reply`` is the backward of ``step`` as the label owner computed it (the cut's loop: loss = step)."""
        assert reply.type == wire.BACKWARD and reply.step == step, reply.describe()
        if self.kind == "cut":
            assert reply.body["loss"] == float(step), reply.body


def _cut_end(liveness_s: float = LIVENESS_S, **bind: Any) -> End:
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=liveness_s, peer_deadline_s=10.0, **bind, **CUT_FIELDS)
    loop = Loop(server)

    def stop() -> Any:
        error = loop.result(liveness_s + 10.0)
        server.close()
        if "ctx" in bind:
            bind["ctx"].term()
        return error

    def applied(run: str) -> list[int]:
        assert server.run_id == run and all(mb == 0 for _, mb in loop.seen), (server.run_id, loop.seen)
        return [step for step, _ in loop.seen]

    exp = cut_side(FIRST, None, CUT_FIELDS).exp
    return End("cut", server.endpoint, exp, (4, 3), stop, applied, server.max_frame)


def _daemon_end(start_server, tmp_path, *extra: str, liveness_s: float = LIVENESS_S) -> End:
    summary, checkpoints = tmp_path / "g-summary.json", tmp_path / "g-checkpoints"
    g, endpoint = start_server("seed-reverse", "--keep-serving", "--liveness", str(liveness_s), "--summary",
                               str(summary), "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "1", *extra)
    exp = load_experiment("seed-reverse")
    shape = tuple(Stage.from_experiment(exp, "g").input_shape)

    def applied(run: str) -> list[int]:
        deadline = time.monotonic() + 10           # the summary is written just after the bye's reply
        while not (summary.exists() and read_json(summary).get("run_id") == run):
            assert time.monotonic() < deadline, f"no summary of run {run}:\n{g.output[-2000:]}"
            time.sleep(0.01)
        done = read_json(summary)
        return list(range(1, done["steps"] + 1)) if done["status"] == "completed" else [done["status"]]

    def files() -> dict[str, bytes]:
        return {str(p.relative_to(checkpoints)): p.read_bytes() for p in sorted(checkpoints.rglob("*")) if p.is_file()}

    return End("daemon", endpoint, exp, shape, lambda: None if "Traceback" not in g.output else g.output[-3000:],
               applied, max(wire.HEADER_MAX_BYTES, 4 * int(np.prod(shape))), lambda: g.output, files)


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


def wider(end: End) -> tuple[int, ...]:
    """A shape one column wider than the end's activation."""
    return (*end.shape[:-1], end.shape[-1] + 1)


@pytest.mark.integration
def test_every_serving_end_follows_the_same_rules(end_kind, start_server, dealers, tmp_path):
    """Refusals of undecodable, over-size and out-of-turn messages, ping, a second client while the first is
    live, the reply cache, the bye and its replay: the same codes and words from the daemon and from the cut
    library; the label owner computes only the honest steps, and serves on."""
    end = _daemon_end(start_server, tmp_path) if end_kind == "daemon" else _cut_end()
    a, b = dealers(end.endpoint), dealers(end.endpoint)
    try:
        for frames, code in UNDECODABLE:
            refused(a, frames, code)
        refused(a, [b"x"] * (MAX_FRAMES + 1), ErrorCode.MALFORMED,         # counted with its routing id
                f"a message of {MAX_FRAMES + 2} frames")
        refused(a, forward(end, "a", 1), ErrorCode.RUN, "hello first")           # before any hello
        big = dealers(end.endpoint)          # a frame over MAXMSGSIZE: ZeroMQ drops that peer, no reply
        big.send_multipart([b"\x00" * (end.max_frame + 1)])
        assert not big.poll(300)
        big.close()
        pong = ask(a, Message(wire.PING, "", 0))
        assert pong.type == wire.PONG and {"stage", "experiment", "run", "step"} <= set(pong.body), pong.body
        refused(a, hello_message(end.exp, "a", purpose="predict"), ErrorCode.MISMATCH, "hello has purpose=")
        refused(a, hello_message(end.exp, "a", eval_every=-1), ErrorCode.MALFORMED, "eval_every=")
        refused(a, hello_message(end.exp, "a", client=1), ErrorCode.MISMATCH,          # one data owner here
                f"hello has client=1; experiment {end.exp.name!r} has no [clients]")
        welcome = ask(a, hello_message(end.exp, "a"))
        assert welcome.type == wire.WELCOME and welcome.body["next_step"] == 1, welcome.body
        busy = refused(b, hello_message(end.exp, "b"), ErrorCode.RUN, "busy")   # a second client while a is live
        assert busy.startswith("busy with run 'a' since ") and busy.endswith("; cannot start run 'b'"), busy
        refused(b, forward(end, "b", 1), ErrorCode.RUN, "forward for run 'b', expected run a")
        refused(a, forward(end, "other", 1), ErrorCode.RUN, "forward for run 'other', expected run a")
        refused(a, Message(wire.WELCOME, "a", 1), ErrorCode.TYPE, "does not accept 'welcome' messages")
        refused(a, wire.abort_notice("other", "f", "not its run"), ErrorCode.RUN,    # stops no run but its own
                "an aborted notice of run 'other', expected run a")
        refused(a, forward(end, "a", 3), ErrorCode.STEP, "forward for step 3 micro-batch 0/1; expected step 1 "
                                                         "micro-batch 0/1")
        refused(a, forward(end, "a", 1, mb=0, mbs=2), ErrorCode.STEP, "expected step 1")
        refused(a, forward(end, "a", 1, np.ones(wider(end), np.float32)), ErrorCode.TENSOR)
        refused(a, forward(end, "a", 1, np.full(end.shape, np.nan, np.float32)), ErrorCode.NONFINITE)
        refused(a, forward(end, "a", 1, np.ones(end.shape, np.float64)), ErrorCode.TENSOR)
        assert ask(a, Message(wire.PING, "a", 1)).body["step"] == 0              # nothing of them was applied
        first = ask(a, forward(end, "a", 1))
        end.answered(first, 1)
        again = ask(a, forward(end, "a", 1))                                    # resent: the cached reply
        assert again.type == wire.BACKWARD and again.body == first.body
        assert again.tensors.keys() == first.tensors.keys() and all(
            np.array_equal(again.tensors[n], first.tensors[n]) for n in first.tensors)
        kept = end.files()
        refused(a, Message(wire.BYE, "a", 2, body={"steps": 5}), ErrorCode.STEP, "bye after 5 steps, but")
        refused(a, forward(end, "a", 2, np.full(end.shape, np.inf, np.float32)), ErrorCode.NONFINITE)
        refused(a, forward(end, "a", 2, np.ones(end.shape, np.float64)), ErrorCode.TENSOR)
        refused(a, hello_message(end.exp, "a", seed=7), ErrorCode.MISMATCH, "hello has seed=7")
        refused(b, hello_message(end.exp, "b"), ErrorCode.RUN)     # (a cut server never replaces a run at a step)
        assert end.files() == kept and ask(a, Message(wire.PING, "a", 1)).body["step"] == 1   # nothing changed
        end.answered(ask(a, forward(end, "a", 2)), 2)
        bye = ask(a, Message(wire.BYE, "a", 3, body={"steps": 2}))
        assert bye.type == wire.BYE and bye.body["steps"] == 2
        assert ask(a, Message(wire.BYE, "a", 3, body={"steps": 2})).body == bye.body   # a lost reply: again
        after = ask(a, Message(wire.PING, "", 0))
        assert after.type == wire.PONG and after.body["run"] == "", after.body        # no run is open now
        assert end.applied("a") == [1, 2]
    finally:
        a.close()
        b.close()
        assert end.stop() is None


@pytest.mark.integration
def test_with_curve_every_serving_end_keeps_a_run_to_the_key_that_opened_it(end_kind, start_server, dealers,
                                                                            tmp_path):
    """protocol.md, *Owner*: another allowed key may not drive, rewind, end, stop or replace the open run:
    refused with the same words at both ends; the owner's run goes on."""
    server_secret, keys = curve_keys(tmp_path, ("owner", "other"))
    if end_kind == "daemon":
        end = _daemon_end(start_server, tmp_path, "--curve-secret", str(server_secret),
                          "--allow", str(tmp_path / "clients"))
    else:
        end = _cut_end(curve_secret=server_secret, allow=tmp_path / "clients", ctx=zmq.Context())

    def curve_dealer(name: str) -> zmq.Socket:
        return dealers(end.endpoint, **keys[name])

    owner, other = curve_dealer("owner"), curve_dealer("other")
    try:
        assert ask(owner, hello_message(end.exp, "a")).type == wire.WELCOME
        refused(other, hello_message(end.exp, "a"), ErrorCode.RUN, "this run belongs to another client key")
        refused(other, hello_message(end.exp, "b"), ErrorCode.RUN, "busy")
        refused(other, forward(end, "a", 1), ErrorCode.RUN, "this run belongs to another client key")
        refused(other, Message(wire.BYE, "a", 1, body={"steps": 0}), ErrorCode.RUN,
                "this run belongs to another client key")
        refused(other, wire.abort_notice("a", "f", "not its run"), ErrorCode.RUN,
                "an aborted notice not from the data owner: this run belongs to another client key")
        assert ask(other, Message(wire.PING, "", 0)).type == wire.PONG
        end.answered(ask(owner, forward(end, "a", 1)), 1)
        assert ask(owner, Message(wire.BYE, "a", 2, body={"steps": 1})).type == wire.BYE
        assert end.applied("a") == [1]
    finally:
        owner.close()
        other.close()
        assert end.stop() is None


@pytest.mark.integration
def test_refused_messages_do_not_keep_a_run_live_so_a_new_run_may_replace_one_whose_data_owner_is_gone(
        end_kind, start_server, dealers, tmp_path):
    """protocol.md: the open run's client is live while a hello, forward or bye of it was accepted within
    liveness_s; pings and refused messages do not count (in plaintext anyone may send the run id)."""
    liveness = 0.5
    end = (_daemon_end(start_server, tmp_path, liveness_s=liveness) if end_kind == "daemon"
           else _cut_end(liveness_s=liveness))
    a, b = dealers(end.endpoint), dealers(end.endpoint)
    try:
        assert ask(a, hello_message(end.exp, "a")).type == wire.WELCOME
        # Time passing is the point here, not an order of events: refused messages for longer than liveness_s
        # (0.5 s). A busy machine only lets more time pass, which the outcome below does not depend on.
        until = time.monotonic() + 0.8
        while time.monotonic() < until:
            refused(a, forward(end, "a", 3), ErrorCode.STEP)
            assert ask(a, Message(wire.PING, "a", 0)).type == wire.PONG
            time.sleep(0.05)
        assert ask(b, hello_message(end.exp, "b")).type == wire.WELCOME
        end.answered(ask(b, forward(end, "b", 1)), 1)
        refused(a, forward(end, "a", 1), ErrorCode.RUN)
        assert ask(b, Message(wire.BYE, "b", 2, body={"steps": 1})).type == wire.BYE
        assert end.applied("b") == [1]
    finally:
        a.close()
        b.close()
        assert end.stop() is None


@pytest.mark.integration
def test_an_aborted_notice_ends_the_run_only_from_its_own_data_owner(end_kind, start_server, dealers, tmp_path):
    """A notice of another run (anyone may send one in plaintext) is refused and the run goes on; its own
    data owner's ends the run at once naming the reason (the cut's loop raises PeerAborted; the daemon fails
    the run and serves the next), with no reply."""
    end = _daemon_end(start_server, tmp_path) if end_kind == "daemon" else _cut_end()
    a, b = dealers(end.endpoint), dealers(end.endpoint)
    reason = "its loop failed: ValueError: bad batch"
    try:
        assert ask(a, hello_message(end.exp, "a")).type == wire.WELCOME
        assert ask(a, forward(end, "a", 1)).type == wire.BACKWARD
        refused(b, wire.abort_notice("b", "f", "not yours"), ErrorCode.RUN, "an aborted notice of run 'b', "
                                                                           "expected run a")
        assert ask(a, forward(end, "a", 2)).type == wire.BACKWARD
        a.send_multipart(wire.encode(wire.abort_notice("a", "f", reason)))
        assert not a.poll(300)            # nothing is told back to a data owner that stopped
        if end.kind == "cut":
            error = end.stop()
            assert isinstance(error, PeerAborted) and f"stage f stopped: {reason}" in str(error), error
            assert end.applied("a") == [1, 2]
            return
        assert end.applied("a") == ["failed"] and f"stage f stopped: {reason}" in end.log()
        assert ask(b, hello_message(end.exp, "b")).type == wire.WELCOME      # the next run is served
    finally:
        a.close()
        b.close()
        if end.kind == "daemon":
            assert end.stop() is None


# -- a hello's and a bye's rules at the daemon's serving logic (``ServingStage``, in this process: the code a
# distgrad-stage runs) and at the cut library's servers (over a socket): the same code and words

def _daemon_refusal(serving: ServingStage, msg: Message) -> tuple[str, str]:
    """The code and text of the error the serving daemon's logic answers ``msg`` with."""
    with pytest.raises(ProtocolError) as refusal:
        serving.handle([b"peer"], msg, 0.0)
    return refusal.value.code, refusal.value.args[0]


def _cut_refusal(sock: zmq.Socket, msg: Message) -> tuple[str, str]:
    reply = ask(sock, msg)
    assert reply.type == wire.ERROR, reply.describe()
    return reply.body["code"], reply.body["message"]


def _serve_on_a_thread(server: CutServer) -> threading.Thread:
    """``server``'s loop on a thread, answering each micro-batch (loss = its step, a gradient of ones) until the
    data owner's bye, its stop notice (``PeerAborted``) or its silence (``PeerTimeout``)."""
    def loop() -> None:
        try:
            with server:
                for batch in server:
                    batch.reply(float(batch.step), np.ones(batch.h.shape, np.float32))
        except (PeerAborted, PeerTimeout):
            pass
    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


@pytest.mark.integration
def test_a_bye_in_the_middle_of_a_step_is_refused_alike_and_the_step_goes_on(dealers):
    """A bye comes between steps: one after the first of a step's two micro-batches is refused (code ``step``,
    the same words) by the daemon's serving logic and by the cut library's server, which both go on: the
    step's second micro-batch is answered, and then the bye is taken."""
    bye = Message(wire.BYE, "a", 1, body={"steps": 0})
    exp = load_experiment("tanh-regression")
    serving = ServingStage(StageOptions(exp, "g", exp.seed))
    shape = tuple(serving.stage.input_shape)
    half = np.full((shape[0] // 2, *shape[1:]), 0.5, np.float32)
    assert only_reply(serving.handle([b"peer"], hello_message(exp, "a", micro_batches=2), 0.0)).type == wire.WELCOME
    assert only_reply(serving.handle([b"peer"], Message(wire.FORWARD, "a", 1, 0, 2, tensors={"activation": half}),
                                     0.0)).type == wire.BACKWARD
    daemon = _daemon_refusal(serving, bye)
    assert only_reply(serving.handle([b"peer"], Message(wire.FORWARD, "a", 1, 1, 2, tensors={"activation": half}),
                                     0.0)).type == wire.BACKWARD
    serving.settle()
    done = only_reply(serving.handle([b"peer"], Message(wire.BYE, "a", 2, body={"steps": 1}), 0.0))
    assert done.type == wire.BYE and done.body == {"steps": 1} and serving.stage.step == 1

    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=LIVENESS_S, peer_deadline_s=10.0, **CUT_FIELDS)
    thread, a = _serve_on_a_thread(server), dealers(server.endpoint)
    cut_exp = cut_side(FIRST, None, CUT_FIELDS).exp
    h = np.full((2, 3), 0.5, np.float32)
    try:
        assert ask(a, hello_message(cut_exp, "a", micro_batches=2)).type == wire.WELCOME
        assert ask(a, Message(wire.FORWARD, "a", 1, 0, 2, tensors={"activation": h})).type == wire.BACKWARD
        cut = _cut_refusal(a, bye)
        assert ask(a, Message(wire.FORWARD, "a", 1, 1, 2, tensors={"activation": h})).type == wire.BACKWARD
        assert ask(a, Message(wire.BYE, "a", 2, body={"steps": 1})).body == {"steps": 1}
    finally:
        a.close()
        thread.join(LIVENESS_S + 10.0)
    assert daemon == cut == (ErrorCode.STEP, "bye after 0 steps, but step 1 of client of run a is under way here "
                                             "(1 of its micro-batches taken): say bye between steps")


@pytest.mark.integration
def test_an_evaluation_for_a_step_the_data_owner_has_not_reached_is_refused_alike_and_changes_nothing(tmp_path,
                                                                                                    dealers):
    """The held-out rows are scored after a step: an ``evaluate`` whose step is not the next (a hostile data
    owner's step 500 at step 0, or step 0) is refused (code ``step``, the same words) by the daemon's serving
    logic, which scored and judged it before, and by the cut library's server; neither scores or records
    anything, and the honest evaluation after it is answered."""
    exp = load_experiment("digits")
    serving = ServingStage(StageOptions(exp, "g", exp.seed))
    data = exp.build_data()
    h = Stage.from_experiment(exp, "f").forward(data.test_features(), training=False)[0]
    assert only_reply(serving.handle([b"peer"], hello_message(exp, "a"), 0.0)).type == wire.WELCOME
    daemon = [_daemon_refusal(serving, Message(wire.EVALUATE, "a", step, tensors={"activation": h}))
              for step in (500, 0)]
    assert serving.peers[0].evaluation is None and serving.state.verdicts.best_step == 0     # nothing judged
    honest = only_reply(serving.handle([b"peer"], Message(wire.EVALUATE, "a", 1, tensors={"activation": h}), 0.0))
    assert honest.type == wire.EVALUATION and honest.step == 1

    np.save(tmp_path / "y.npy", np.zeros(20, np.int64))
    scored = []
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=LIVENESS_S, peer_deadline_s=10.0,
                            evaluate=lambda h, rows: scored.append(len(rows)) or (0.5, 1),
                            data=dict(kind="npy", labels=str(tmp_path / "y.npy"), batch=4, test_fraction=0.2),
                            **CUT_FIELDS)
    thread, a = _serve_on_a_thread(server), dealers(server.endpoint)
    held_out = np.full((4, 3), 0.5, np.float32)
    try:
        assert ask(a, hello_message(cut_side(FIRST, None, CUT_FIELDS).exp, "a")).type == wire.WELCOME
        cut = [_cut_refusal(a, Message(wire.EVALUATE, "a", step, tensors={"activation": held_out}))
               for step in (500, 0)]
        assert scored == []
        assert ask(a, Message(wire.EVALUATE, "a", 1, tensors={"activation": held_out})).type == wire.EVALUATION
        assert ask(a, Message(wire.BYE, "a", 1, body={"steps": 0})).body == {"steps": 0}
    finally:
        a.close()
        thread.join(LIVENESS_S + 10.0)
    assert scored == [4]
    assert daemon == cut == [(ErrorCode.STEP, f"evaluate for step {step}, but client of run a has 0 steps applied "
                                              f"here: the held-out rows are scored after a step, before the next "
                                              f"one's forwards") for step in (500, 0)]


@pytest.mark.integration
def test_a_stage_serving_several_data_owners_refuses_a_hello_with_the_same_words_as_the_cut_library(dealers,
                                                                                                  tmp_path):
    """Which data owner a hello is from, and that several take lockstep steps: the daemon's serving logic for
    clients in turn and for feature parties refuses a hello naming none it serves, or asking for steps in
    flight, with the words of the cut library's server of several data owners; so does ``distgrad predict``'s
    label owner of feature parties (its logic, in this process)."""
    clients = load_experiment("digits-clients")
    vertical = load_experiment("vertical-classify")
    on_clients = ServingStage(StageOptions(clients, "g", clients.seed))
    on_parties = ServingStage(StageOptions(vertical, "g", vertical.seed))
    count = clients.clients.count

    def party_hello(exp, role: str, **changes) -> Message:
        message = hello_message(exp, "a", **changes)
        message.body["role"] = role
        return message

    daemon = [_daemon_refusal(on_clients, hello_message(clients, "a", client=count)),
              _daemon_refusal(on_clients, hello_message(clients, "a", client=0, staleness=1)),
              _daemon_refusal(on_parties, party_hello(vertical, "a", client=1)),
              _daemon_refusal(on_parties, party_hello(vertical, "z")),
              _daemon_refusal(on_parties, party_hello(vertical, "a", staleness=1))]
    predicting = PredictionServer(StageOptions(vertical, "g", vertical.seed), tmp_path / "predictions.csv", None)
    predict = []
    for role, changes in (("a", {"client": 1}), ("z", {})):
        with pytest.raises(ProtocolError) as refusal:
            predicting.handle(party_hello(vertical, role, purpose="predict", rows=10, **changes), 0.0)
        predict.append((refusal.value.code, refusal.value.args[0]))
    assert predict == daemon[2:4]
    group_fields = dict(name="group-words", batch=4, activation=[3], steps=2, seed=0)
    cut = []
    for fields, ask_for in (
            (dict(group_fields, stages=["f", "g"], clients=count,
                  data={"kind": "synthetic_regression", "features": 2, "batch": 4, "samples": 64}),
             lambda exp: [hello_message(exp, "a", client=count), hello_message(exp, "a", client=0, staleness=1)]),
            (dict(group_fields, stages=["a", "b", "c", "g"], aggregate="concat"),
             lambda exp: [party_hello(exp, "a", client=1), party_hello(exp, "z"), party_hello(exp, "a", staleness=1)])):
        server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=LIVENESS_S, peer_deadline_s=10.0, **fields)
        thread, sock = _serve_on_a_thread(server), dealers(server.endpoint)
        exp = cut_side(FIRST, None, fields, **({"client": 0} if "clients" in fields else {"party": 0})).exp
        try:
            cut += [_cut_refusal(sock, msg) for msg in ask_for(exp)]
            sock.send_multipart(wire.encode(wire.abort_notice("", "f", "the test is done")))   # ends the loop
        finally:
            sock.close()
            thread.join(LIVENESS_S + 10.0)
    named = [(code, text.replace("'group-words'", "EXP").replace("'vertical-classify'", "EXP"))
             for code, text in daemon + cut]
    assert named[:len(daemon)] == named[len(daemon):], (daemon, cut)
    assert named[0] == (ErrorCode.MISMATCH, f"hello has client={count}; this stage serves clients 0 to {count - 1} "
                                            f"(give --client, or Cut.connect(..., client=C))")
    assert named[2] == (ErrorCode.MISMATCH, "hello has client=1; the feature parties of EXP are told apart by "
                                            "their stage")
    assert named[4][1] == ("hello has staleness=1; a stage serving several data owners (clients or feature "
                           "parties) takes lockstep steps only")


@pytest.mark.parametrize("seconds", ["inf", "0", "nan"])
def test_every_end_refuses_a_wait_that_is_not_bounded(seconds, tmp_path):
    """Every wait is bounded: a timeout, liveness window or peer deadline of infinite, NaN (or no) seconds is
    refused with the same words by a daemon's flags (``distgrad-stage``, ``distgrad run``, ``distgrad align``,
    ``distgrad ping``) and the cut library's arguments, before anything starts; an infinite one was taken, and
    a dead peer then hung the other side for ever."""
    value = float(seconds)
    text = f"must be > 0 seconds and finite (every wait is bounded), got {value!r}"
    stage = run_main(["stage", "g", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:*", "--liveness",
                      seconds])
    assert stage.returncode == 2 and f"--liveness {text}" in stage.stderr, stage.stderr
    run = run_main(["run", "seed-reverse", "--steps", "2", "--peer-deadline", seconds])
    assert run.returncode == 2 and f"--peer-deadline {text}" in run.stderr, run.stderr
    ping = run_main(["ping", "tcp://127.0.0.1:5", "--timeout", seconds])     # it waited for ever on inf and NaN
    assert ping.returncode == 2 and f"--timeout {text}" in ping.stderr, ping.stderr
    with pytest.raises(ConfigError, match=re.escape(f"--liveness {text}")):
        AlignOptions(tmp_path / "ids.csv", "id", tmp_path / "out.csv", connect="tcp://127.0.0.1:5", liveness_s=value)
    with pytest.raises(ConfigError, match=re.escape(f"liveness_s {text}")):
        Cut.connect("tcp://127.0.0.1:5", liveness_s=value, **CUT_FIELDS)
    with pytest.raises(ConfigError, match=re.escape(f"peer_deadline_s {text}")):
        CutServer.bind("tcp://127.0.0.1:*", peer_deadline_s=value, **CUT_FIELDS)


def test_every_end_refuses_a_liveness_no_heartbeat_can_carry(tmp_path):
    """ZeroMQ's heartbeat carries its time-to-live in 16 bits of deciseconds: a liveness window over 6553 s was
    taken and then failed inside ZeroMQ with a traceback (exit 1) at the first socket. It is refused before
    anything starts, with the same words, by a daemon's flags and the cut library's arguments."""
    text = "must be at most 6553 seconds (the longest ZeroMQ heartbeat), got 7000.0"
    stage = run_main(["stage", "f", "--experiment", "seed-reverse", "--connect", "tcp://127.0.0.1:5",
                      "--liveness", "7000"])
    assert stage.returncode == 2 and f"--liveness {text}" in stage.stderr, stage.stderr
    run = run_main(["run", "seed-reverse", "--steps", "2", "--liveness", "7000"])
    assert run.returncode == 2 and f"--liveness {text}" in run.stderr, run.stderr
    with pytest.raises(ConfigError, match=re.escape(f"--liveness {text}")):
        AlignOptions(tmp_path / "ids.csv", "id", tmp_path / "out.csv", connect="tcp://127.0.0.1:5", liveness_s=7000.0)
    with pytest.raises(ConfigError, match=re.escape(f"liveness_s {text}")):
        Cut.connect("tcp://127.0.0.1:5", liveness_s=7000.0, **CUT_FIELDS)


# -- the label owner of ``distgrad predict``, which serves its own messages (predict, predicted) by the same rules

@pytest.fixture(scope="module")
def halves(tmp_path_factory) -> Path:
    """seed-reverse's two stages after two steps, as ``--save`` writes them (what ``distgrad predict --load``
    takes)."""
    folder = tmp_path_factory.mktemp("halves")
    assert run_main(["run", "seed-reverse", "--in-process", "--steps", "2", "--save", folder]).returncode == 0
    return folder


def _predicting_end(tmp_path: Path, halves: Path, *extra: str) -> tuple[StageProcess, str, Path]:
    """A ``distgrad predict`` label owner of seed-reverse bound to a free port: (its process, its endpoint, the
    file it writes its predictions to)."""
    ready, output = tmp_path / "predict.ready", tmp_path / "predictions.npy"
    proc = StageProcess(["predict", "seed-reverse", "--stage", "g", "--load", halves / "g.npz", "--bind",
                         "tcp://127.0.0.1:*", "--ready-file", ready, "--output", output, *extra],
                        tmp_path / "predict.log", distgrad=True)
    return proc, wait_for_file(ready, proc), output


def chunk(run: str, number: int, value: Any = 0.5, dtype: Any = np.float32, shape: tuple[int, ...] = (1,)) -> Message:
    return Message(wire.PREDICT, run, number, tensors={"activation": np.full(shape, value, dtype)})


def predicted(halves: Path, values: list[float]) -> np.ndarray:
    """What seed-reverse's saved g predicts for one-row chunks of ``values``, computed in this process."""
    exp = load_experiment("seed-reverse")
    g = Stage.from_experiment(exp, "g")
    g.load_parameters(halves / "g.npz")
    return np.stack([exp.final_loss.predict(g.forward(np.full((1,), v, np.float32), training=False)[0])
                           for v in values])


@pytest.mark.integration
def test_the_prediction_server_follows_the_same_rules(tmp_path, halves, dealers):
    """``distgrad predict``'s label owner refuses what the training ends refuse, with the same codes and words
    (undecodable and over-size messages, a run it does not serve, a notice of another run, a type it does not
    take), answers pings, and then writes exactly the honest chunks' predictions."""
    proc, endpoint, output = _predicting_end(tmp_path, halves)
    exp = load_experiment("seed-reverse")
    a = dealers(endpoint)
    try:
        for frames, code in UNDECODABLE:
            refused(a, frames, code)
        refused(a, [b"x"] * (MAX_FRAMES + 1), ErrorCode.MALFORMED, f"a message of {MAX_FRAMES + 2} frames")
        big = dealers(endpoint)              # a frame over MAXMSGSIZE: ZeroMQ drops that peer, no reply
        big.send_multipart([b"\x00" * (wire.HEADER_MAX_BYTES + 5)])
        assert not big.poll(300)
        big.close()
        refused(a, chunk("a", 1), ErrorCode.RUN, "predict for run 'a', expected a hello first")
        refused(a, wire.abort_notice("other", "f", "not its run"), ErrorCode.RUN,
                "an aborted notice of run 'other', expected a hello first")
        assert ask(a, Message(wire.PING, "", 0)).body["purpose"] == "predict"
        refused(a, hello_message(exp, "a"), ErrorCode.MISMATCH, "not a training run")
        assert ask(a, hello_message(exp, "a", purpose="predict", rows=2)).type == wire.WELCOME
        refused(a, chunk("other", 1), ErrorCode.RUN, "predict for run 'other', expected run a")
        refused(a, wire.abort_notice("other", "f", "not its run"), ErrorCode.RUN,
                "an aborted notice of run 'other', expected run a")
        refused(a, forward_of(exp, "a", 1), ErrorCode.TYPE, "does not accept 'forward' messages")
        refused(a, chunk("a", 1, np.nan), ErrorCode.NONFINITE)
        refused(a, chunk("a", 1, dtype=np.float64), ErrorCode.TENSOR)
        refused(a, chunk("a", 1, shape=(2,)), ErrorCode.TENSOR)
        refused(a, chunk("a", 3), ErrorCode.STEP, "chunk 3 is out of range 1..2")
        assert ask(a, chunk("a", 1, 0.25)).body == {"rows": 1}
        assert ask(a, chunk("a", 1, 0.5)).body == {"rows": 1}          # a chunk sent again replaces itself
        assert ask(a, chunk("a", 2, -1.5)).body == {"rows": 1}
        assert ask(a, Message(wire.BYE, "a", 3, body={"chunks": 2, "rows": 2})).type == wire.BYE
        assert proc.wait() == 0, proc.output
        assert np.array_equal(np.load(output), predicted(halves, [0.5, -1.5]))
    finally:
        a.close()
        proc.stop()


def test_refused_messages_do_not_keep_a_prediction_live(tmp_path):
    """protocol.md, *live*, at ``distgrad predict``'s label owner too (no sockets: its rules at given times): a
    prediction's sender is heard by what is accepted, so its refused chunks neither keep the prediction busy
    for another sender's hello nor hold off the wait's end (they once did both: any message of its run
    counted)."""
    exp = load_experiment("seed-reverse")
    server = PredictionServer(StageOptions(exp, "g", exp.seed, liveness_s=0.5, peer_deadline_s=1.0),
                              tmp_path / "predictions.npy", None)
    assert server.handle(hello_message(exp, "a", purpose="predict", rows=2), 0.0).type == wire.WELCOME
    for now in (0.3, 0.6, 0.9, 1.2):
        with pytest.raises(ProtocolError) as refusal:
            server.handle(chunk("a", 3), now)
        assert refusal.value.code == ErrorCode.STEP
    assert "giving up" in (server.silent(1.2, 0.0) or "")
    assert server.handle(hello_message(exp, "b", purpose="predict", rows=2), 1.2).type == wire.WELCOME


@pytest.mark.integration
def test_with_curve_a_prediction_belongs_to_the_key_that_said_its_hello(tmp_path, halves, dealers):
    """protocol.md, *Owner*, at ``distgrad predict``'s label owner too: another allowed key may not send the
    prediction's chunks, end it, stop it or say its hello again; the owner's prediction is written whole."""
    server_secret, keys = curve_keys(tmp_path, ("owner", "other"))
    proc, endpoint, output = _predicting_end(tmp_path, halves, "--curve-secret", server_secret, "--allow",
                                             tmp_path / "clients")
    exp = load_experiment("seed-reverse")
    owner, other = dealers(endpoint, **keys["owner"]), dealers(endpoint, **keys["other"])
    try:
        assert ask(owner, hello_message(exp, "a", purpose="predict", rows=1)).type == wire.WELCOME
        refused(other, hello_message(exp, "a", purpose="predict", rows=1), ErrorCode.RUN,
                "this run belongs to another client key")
        refused(other, chunk("a", 1, 3.0), ErrorCode.RUN, "this run belongs to another client key")
        refused(other, Message(wire.BYE, "a", 2, body={"chunks": 1, "rows": 1}), ErrorCode.RUN,
                "this run belongs to another client key")
        refused(other, wire.abort_notice("", "f", "not its prediction"), ErrorCode.RUN,
                "an aborted notice not from the data owner: this run belongs to another client key")
        assert ask(owner, chunk("a", 1, 0.75)).body == {"rows": 1}
        assert ask(owner, Message(wire.BYE, "a", 2, body={"chunks": 1, "rows": 1})).type == wire.BYE
        assert proc.wait() == 0, proc.output
        assert np.array_equal(np.load(output), predicted(halves, [0.75]))
    finally:
        owner.close()
        other.close()
        proc.stop()


def forward_of(exp: Any, run: str, step: int) -> Message:
    return Message(wire.FORWARD, run, step, tensors={"activation": np.ones((1,), np.float32)})


# -- the driving ends, facing a label owner that answers badly

class BadLabelOwner:
    """A ROUTER on a thread that welcomes any hello and answers each forward with ``answer(forward)``: a
    list of frames, or None for no answer at all."""

    def __init__(self, answer) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint, self.answer, self.stop = f"tcp://127.0.0.1:{port}", answer, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = wire.decode(frames)
            if msg.type == wire.HELLO:
                out = wire.encode(Message(wire.WELCOME, msg.run, msg.step, body={"stage": "g", "next_step": 1}))
            elif msg.type in (wire.FORWARD, wire.PREDICT):
                out = self.answer(msg)
            else:
                out = wire.encode(Message(wire.BYE, msg.run, msg.step, body={"steps": 0}))
            if out is not None:
                self.sock.send_multipart([identity, *out])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


def backward(msg: Message, grad, loss: float = 0.5, step: int | None = None) -> list:
    return wire.encode(Message(wire.BACKWARD, msg.run, msg.step if step is None else step, msg.mb, msg.mbs,
                               body={"loss": loss, "compute_s": 0.0}, tensors={"activation_grad": grad}))


DRIVER_TIMEOUT_S, DRIVER_DEADLINE_S = 0.2, 0.8


def _cut_driver(endpoint: str, tmp_path) -> tuple[str, str]:
    """A ``Cut``'s first step against ``endpoint``: the class and words of the error it raised."""
    cut = Cut.connect(endpoint, timeout_s=DRIVER_TIMEOUT_S, peer_deadline_s=DRIVER_DEADLINE_S, **FIELDS)
    try:
        with pytest.raises(Exception) as e:
            cut.step(np.ones((4, 3), np.float32))
        assert cut.applied == 0
        return type(e.value).__name__, str(e.value)
    finally:
        cut.close(finished=False)


# A daemon's exit code for each error a Cut raises (docs/cli.md: 1 a stage's failure, 3 a timeout, 4 a refusal).
EXIT_CODES = {"ProtocolError": 4, "NonFiniteError": 1, "PeerTimeout": 3}


def _daemon_driver(endpoint: str, tmp_path) -> tuple[str, str]:
    """A ``distgrad-stage f`` seed-reverse process against ``endpoint``: the error class its exit code means,
    and its log."""
    summary = tmp_path / "f-summary.json"
    with StageProcess(["f", "--experiment", "seed-reverse", "--connect", endpoint, "--timeout", DRIVER_TIMEOUT_S,
                       "--peer-deadline", DRIVER_DEADLINE_S, "--summary", summary], tmp_path / "f.log") as f:
        code = f.wait()
    done = read_json(summary) if summary.exists() else {"steps": 0}
    assert done["steps"] == 0, done            # nothing of the bad reply was applied
    return {code: name for name, code in EXIT_CODES.items()}.get(code, f"exit {code}"), f.output


def _predict_driver(endpoint: str, tmp_path: Path, halves: Path) -> tuple[str, str]:
    """``distgrad predict``'s data owner (seed-reverse's f, two rows) against ``endpoint``: the error class its
    exit code means, and its log."""
    rows = tmp_path / "rows.npy"
    np.save(rows, np.array([[0.5], [1.5]], np.float32))
    with StageProcess(["predict", "seed-reverse", "--stage", "f", "--load", halves / "f.npz", "--connect", endpoint,
                       "--input", rows, "--timeout", DRIVER_TIMEOUT_S, "--peer-deadline", DRIVER_DEADLINE_S],
                      tmp_path / "f-predict.log", distgrad=True) as f:
        code = f.wait()
    return {code: name for name, code in EXIT_CODES.items()}.get(code, f"exit {code}"), f.output


def other_step(m: Message, shape: tuple[int, ...]) -> list:
    """A reply to the step (or chunk) after ``m``'s, as a label owner confused about the order would send."""
    if m.type == wire.PREDICT:
        return wire.encode(Message(wire.PREDICTED, m.run, m.step + 1, body={"rows": 1}))
    return backward(m, np.ones(shape, np.float32), step=m.step + 1)


# Each bad answer, the error every driving end stops with, and words that error names.
BAD_ANSWERS = [
    # (a backward's binary header names no shape: its frame is read as the expected one, and fails by its size)
    ("shape", lambda m, shape: backward(m, np.ones((*shape[:-1], shape[-1] - 1), np.float32)), "ProtocolError",
     "stage g's reply to step 1"),
    ("dtype", lambda m, shape: backward(m, np.ones(shape, np.float64)), "ProtocolError", "accepts at most"),
    ("inf-grad", lambda m, shape: backward(m, np.full(shape, np.inf, np.float32)), "NonFiniteError",
     "non-finite activation_grad"),
    ("nan-loss", lambda m, shape: backward(m, np.ones(shape, np.float32), loss=float("nan")), "NonFiniteError",
     "non-finite loss"),
    ("garbage", lambda m, shape: [b"\xc1garbage"], "ProtocolError", "malformed: the reply from tcp://127.0.0.1:"),
    ("silent", lambda m, shape: None, "PeerTimeout", "no reply"),
    ("other-step", other_step, "PeerTimeout", "no reply"),
]
PREDICT_ANSWERS = {"garbage", "silent", "other-step"}   # a predicted reply carries no tensor nor loss
BAD_ANSWER_CASES = [pytest.param(driver, *answer, id=f"{answer[0]}-{driver}") for answer in BAD_ANSWERS
                    for driver in ("cut", "daemon", "predict") if driver != "predict" or answer[0] in PREDICT_ANSWERS]


@pytest.mark.integration
@pytest.mark.parametrize("driver,name,answer,error,text", BAD_ANSWER_CASES)
def test_a_data_owner_facing_a_label_owner_that_answers_badly_gets_a_clear_error_within_its_bounds(
        driver, name, answer, error, text, tmp_path, request):
    """Every driving end (the cut library's ``Cut``, a ``distgrad-stage f`` daemon, and where it applies
    ``distgrad predict``'s data owner) checks a reply with the same rules (``wire.link``): a wrong shape or
    dtype, a NaN or Inf, garbage, no reply or a reply to another step stop it with the same error naming the
    problem, within its bounds, nothing applied."""
    shape = (4, 3) if driver == "cut" else tuple(Stage.from_experiment(load_experiment("seed-reverse"), "g").input_shape)
    owner = BadLabelOwner(lambda m: answer(m, shape))
    try:
        started = time.monotonic()
        if driver == "predict":
            got, words = _predict_driver(owner.endpoint, tmp_path, request.getfixturevalue("halves"))
        else:
            got, words = (_cut_driver if driver == "cut" else _daemon_driver)(owner.endpoint, tmp_path)
        assert got == error and text in words, (got, words[-2000:])
        # A hang guard, not a speed check: 20 s is many times the 0.8 s peer deadline (and a process's start),
        # and well under the 60 s default a data owner that ignored it would wait.
        assert time.monotonic() - started < 20
    finally:
        owner.close()
