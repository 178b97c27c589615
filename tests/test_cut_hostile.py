"""The cut library's own hostile and careless cases: a ``CutServer`` closing after the bye, checkpoint states
that are not what ``state_dict`` gave, a loop's loss that is not one number, rows that are not one integer per
row. Each gets the protocol's error reply (or a clear error at bind/connect); the user's loop never sees a
batch for it, and the real client is served on. The protocol's rules the cut library shares with the daemons
are checked against both in test_protocol_ends.py (fixed cases) and test_hostile.py (Hypothesis-driven)."""

from __future__ import annotations

import queue
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from conftest import free_tcp_endpoint, hello_message
from distgrad.config.parse import load_experiment
from distgrad.cut import Cut, CutServer
from distgrad.errors import ConfigError, CutMisuse, NonFiniteError, PeerAborted, PeerTimeout
from distgrad.run.cut_interface import FIRST, cut_side
from distgrad.run.cut_server import evaluation_scores
from distgrad.run.options import StageOptions, StopFlag
from distgrad.run.serving import serve
from distgrad.wire import messages as wire
from distgrad.wire.keys import keygen, load_public, load_secret
from distgrad.wire.link import evaluation_reply
from distgrad.wire.messages import ErrorCode, Message

FIELDS = dict(name="cut-hostile", stages=["f", "g"], batch=4, activation=[3], steps=3, seed=0)
REPLY_MS = 3000


class Loop:
    """A label owner's loop on a thread: replies to each batch with loss = its step, gradient ones; keeps
    the (step, mb) of the batches it saw; ``result()`` its exception, if any."""

    def __init__(self, server: CutServer) -> None:
        self.server, self.seen, self.error = server, [], None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.server:
                for batch in self.server:
                    self.seen.append((batch.step, batch.mb))
                    batch.reply(float(batch.step), np.ones((4, 3), np.float32))
        except BaseException as e:       # handed to the test
            self.error = e

    def result(self, timeout: float = 10.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server's loop did not end"
        return self.error


def dealer(ctx: zmq.Context, endpoint: str, **curve) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for option, value in curve.items():
        sock.setsockopt(getattr(zmq, option), value)
    sock.connect(endpoint)
    return sock


def curve_keys(tmp_path: Path, clients: tuple[str, ...]) -> tuple[Path, dict[str, dict[str, bytes]]]:
    """A server's secret key file and, by name, each client's DEALER socket options (its keys and the
    server's public key); the clients' public keys are in ``tmp_path / "clients"``, the allow directory."""
    server_public, server_secret = keygen(tmp_path / "server", "g")
    keys = {}
    for name in clients:
        _, secret = keygen(tmp_path / "clients", name)
        public, secret_key = load_secret(secret)
        keys[name] = dict(CURVE_SERVERKEY=load_public(server_public), CURVE_PUBLICKEY=public,
                          CURVE_SECRETKEY=secret_key)
    return server_secret, keys


def ask(sock: zmq.Socket, request) -> Message:
    sock.send_multipart(request if isinstance(request, list) else wire.encode(request))
    assert sock.poll(REPLY_MS), f"no reply to {request}"
    return wire.decode(sock.recv_multipart())


def refused(sock: zmq.Socket, request, code: str, text: str = "") -> str:
    reply = ask(sock, request)
    assert reply.type == wire.ERROR and reply.body["code"] == code, reply.body
    assert text in reply.body["message"], reply.body
    return reply.body["message"]


def forward(run: str, step: int, h=None, mb: int = 0, mbs: int = 1) -> Message:
    h = np.full((4, 3), step, np.float32) if h is None else h
    return Message(wire.FORWARD, run, step, mb, mbs, tensors={"activation": h})


def exp():
    return cut_side(FIRST, None, FIELDS).exp


@pytest.mark.integration
def test_a_repeated_bye_gets_the_first_byes_reply_while_the_server_closes():
    """protocol.md: a driver whose bye reply was lost may resend it; the loop has ended, and the server's
    close answers it (and pings) until the data owner falls quiet."""
    ctx = zmq.Context.instance()
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **FIELDS)
    loop = Loop(server)
    a = dealer(ctx, server.endpoint)
    try:
        assert ask(a, hello_message(exp(), "a")).type == wire.WELCOME
        assert ask(a, forward("a", 1)).type == wire.BACKWARD
        bye = ask(a, Message(wire.BYE, "a", 2, body={"steps": 1}))
        assert bye.type == wire.BYE and bye.body["steps"] == 1
        assert ask(a, Message(wire.BYE, "a", 2, body={"steps": 1})).body == bye.body
        assert ask(a, Message(wire.PING, "", 0)).type == wire.PONG
        refused(a, forward("a", 2), ErrorCode.RUN, "ended")
        assert loop.result() is None and loop.seen == [(1, 0)]
    finally:
        a.close()
        server.close()


@pytest.mark.integration
@pytest.mark.parametrize("fields", [FIELDS, {**FIELDS, "clients": {"count": 2, "mode": "separate"}}],
                         ids=["one data owner", "clients"])
def test_a_peer_that_keeps_sending_cannot_hold_off_the_timeout_of_a_silent_data_owner(fields):
    """Every wait is bounded, whatever else arrives: a peer pinging the server without pause (a monitor, or
    anyone) while the data owner it waits for stays silent. The loop's wait ends with PeerTimeout after
    liveness_s + peer_deadline_s; it once checked the silence only in a tick when nothing came, so a ping
    every few milliseconds kept it waiting for ever (a CutServer and a GroupServer alike)."""
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=0.1, peer_deadline_s=0.1, **fields)
    loop = Loop(server)
    pinger = dealer(zmq.Context.instance(), server.endpoint)
    try:
        pongs, hang_guard = 0, time.monotonic() + 10.0     # a hang guard, not a timing claim
        while loop.thread.is_alive() and time.monotonic() < hang_guard:
            pinger.send_multipart(wire.encode(Message(wire.PING, "", 0)))
            if pinger.poll(20):
                pongs += wire.decode(pinger.recv_multipart()).type == wire.PONG
        ended_under_pings = not loop.thread.is_alive()
    finally:
        pinger.close()
        error = loop.result()           # the pings stopped: it ends now in any case (and closes the server)
    assert ended_under_pings, "the loop still waited for its silent data owner while the pings came"
    assert pongs > 0 and isinstance(error, PeerTimeout) and "silent for more than 0.2 s" in str(error), error


def _saved_states() -> tuple[dict, dict]:
    """A Cut's and a CutServer's state_dict after one step between them."""
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **{**FIELDS, "steps": 1})
    loop = Loop(server)
    with Cut.connect(server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **{**FIELDS, "steps": 1}) as cut:
        cut.step(np.ones((4, 3), np.float32))
        cut_state = cut.state_dict()
    assert loop.result() is None
    return cut_state, server.state_dict()


def _refused_at_bind(state) -> str:
    with pytest.raises(ConfigError) as e:
        CutServer.bind("tcp://127.0.0.1:*", state=state, **{**FIELDS, "steps": 1}).close()
    return str(e.value)


def _refused_at_connect(state) -> str:
    with pytest.raises(ConfigError) as e:
        Cut.connect("tcp://127.0.0.1:9", state=state, **{**FIELDS, "steps": 1}).close(finished=False)
    return str(e.value)


@pytest.mark.integration
def test_a_tampered_or_wrong_state_is_a_config_error_at_bind_and_connect_not_a_crash_later():
    cut_state, server_state = _saved_states()
    reply = server_state["replies"][0]
    without = {k: v for k, v in server_state.items() if k != "step"}
    for state, text in [
            (cut_state, "not a CutServer's state_dict"),                       # the other side's
            (without, "lacks ['step']"),
            ({**server_state, "step": -1}, "step must be"),
            ({**server_state, "step": True}, "step must be"),
            ({**server_state, "micro_batches": 3}, "micro_batches 3"),
            ({**server_state, "replies": "x"}, "must be a list"),
            ({**server_state, "replies": [{**reply, "loss": "nan?"}]}, "number loss"),
            ({**server_state, "replies": [{k: v for k, v in reply.items() if k != "tensors"}]}, "exactly"),
            ({**server_state, "replies": [{**reply, "step": 7}]}, "not one of its steps"),
            ({**server_state, "replies": [{**reply, "tensors": {"activation_grad": np.ones(2, np.float32)}}]},
             "not a gradient"),
            ({**server_state, "replies": [{**reply, "tensors": {"activation_grad": np.array([None] * 12)}}]},
             "not a gradient"),
            ({**server_state, "residuals": {"codec/x": [1.0]}}, "residuals"),
            ({**server_state, "residuals": {"codec/activation_grad/mb0of1": np.ones(5, np.float32)}}, "(5,)"),
            ({**server_state, "residuals": {"codec/activation/mb0of1": np.ones((4, 3), np.float32)}},
             "not one this side keeps"),
            ({**server_state, "interface": "0" * 64}, "another interface")]:
        assert text in _refused_at_bind(state), (text, state)
    for state, text in [
            (server_state, "not a Cut's state_dict"),
            ({k: v for k, v in cut_state.items() if k != "step"}, "lacks ['step']"),
            ({**cut_state, "step": -1}, "step must be"),
            ({**cut_state, "run": 5}, "run id"),
            ({**cut_state, "residuals": None}, "residuals"),
            ({**cut_state, "residuals": {"codec/activation/mb0of1": np.ones((4, 2), np.float32)}}, "(4, 2)"),
            ("garbage", "not a cut state")]:
        assert text in _refused_at_connect(state), (text, state)
    # What state_dict gave is taken.
    CutServer.bind("tcp://127.0.0.1:*", state=server_state, **{**FIELDS, "steps": 1}).close()
    Cut.connect("tcp://127.0.0.1:9", state=cut_state, **{**FIELDS, "steps": 1}).close(finished=False)


@pytest.mark.integration
def test_a_loss_that_is_not_one_number_is_misuse_and_the_batch_can_still_be_answered():
    """A careless loop replies with a loss per row (reduction 'none') or a string: ``CutMisuse`` naming it,
    not a numpy error; nothing is sent, and the right reply then goes out."""
    def body(server) -> list[str]:
        batch, errors = next(iter(server)), []
        for loss in (np.ones(4, np.float32), "0.5", [0.5], None):
            with pytest.raises(CutMisuse) as e:
                batch.reply(loss, np.ones((4, 3), np.float32))
            errors.append(str(e.value))
        batch.reply(np.array(0.5, np.float32), np.ones((4, 3), np.float32))
        assert list(server) == []
        return errors

    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **{**FIELDS, "steps": 1})
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(errors=body(server)), daemon=True)
    thread.start()
    with Cut.connect(server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **{**FIELDS, "steps": 1}) as cut:
        assert cut.step(np.ones((4, 3), np.float32))[0] == np.float32(0.5)
    thread.join(10)
    server.close()
    assert len(result["errors"]) == 4 and all("must be one number" in e for e in result["errors"]), result


@pytest.mark.integration
def test_a_saved_reply_holding_nan_or_inf_is_a_config_error_at_bind():
    """A saved reply is checked as the data owner would check it when the step is sent again: a NaN or Inf
    loss or gradient (the interface forbids them) is refused at bind, not met by the data owner later."""
    _, server_state = _saved_states()
    reply = server_state["replies"][0]
    nan_grad = {name: np.full_like(array, np.nan) for name, array in reply["tensors"].items()}
    for state, text in [
            ({**server_state, "replies": [{**reply, "loss": float("nan")}]}, "has loss nan"),
            ({**server_state, "replies": [{**reply, "loss": float("-inf")}]}, "has loss -inf"),
            ({**server_state, "replies": [{**reply, "compute_s": float("nan")}]}, "compute_s nan"),
            ({**server_state, "replies": [{**reply, "tensors": nan_grad}]}, "NaN or Inf")]:
        message = _refused_at_bind(state)
        assert text in message and "reply to step 1 micro-batch 0" in message, (text, message)


@pytest.mark.integration
def test_a_cut_server_with_send_rows_refuses_rows_that_are_not_one_integer_per_row():
    """With send_rows a forward's rows are one int64 per row of the micro-batch, shape (n,): rows of another
    shape (even with the same number of integers), dtype or length are refused (tensor) and the loop never
    sees them; the right rows then go through."""
    ctx = zmq.Context.instance()
    fields = {**FIELDS, "send_rows": True, "steps": 1}
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **fields)
    loop = Loop(server)
    a = dealer(ctx, server.endpoint)

    def with_rows(rows) -> Message:
        return Message(wire.FORWARD, "a", 1, tensors={"activation": np.ones((4, 3), np.float32), "rows": rows})

    try:
        assert ask(a, hello_message(cut_side(FIRST, None, fields).exp, "a")).type == wire.WELCOME
        for rows in (np.arange(4, dtype=np.int64).reshape(2, 2), np.arange(4, dtype=np.int64).reshape(4, 1),
                     np.arange(4, dtype=np.float64), np.arange(8, dtype=np.int32), np.arange(3, dtype=np.int64),
                     np.array([0, 1, 2, -3], np.int64)):
            refused(a, with_rows(rows), ErrorCode.TENSOR, "row")
        refused(a, with_rows(np.arange(5, dtype=np.int64)), ErrorCode.TENSOR)      # more bytes than it takes
        assert ask(a, with_rows(np.array([3, 1, 2, 0], np.int64))).type == wire.BACKWARD
        assert ask(a, Message(wire.BYE, "a", 2, body={"steps": 1})).type == wire.BYE
        assert loop.result() is None and loop.seen == [(1, 0)]
    finally:
        a.close()
        server.close()




@pytest.mark.integration
def test_micro_batches_that_do_not_split_the_batch_are_a_config_error_at_bind_and_connect():
    """The interface's micro_batches must split its batch into equal parts, as every run checks before its first
    step: both ends refuse at bind/connect (before, the server bound and refused every hello until its
    peer deadline, and the data owner's first step was refused)."""
    fields = {**FIELDS, "micro_batches": 3}                 # a batch of 4 rows
    with pytest.raises(ConfigError, match="4 rows: they do not split into 3 equal micro-batches"):
        CutServer.bind("tcp://127.0.0.1:*", **fields)
    with pytest.raises(ConfigError, match="4 rows: they do not split into 3 equal micro-batches"):
        Cut.connect("tcp://127.0.0.1:9", **fields)
    Cut.connect("tcp://127.0.0.1:9", **{**FIELDS, "micro_batches": 2}).close(finished=False)   # 2 do split 4


@pytest.mark.parametrize("result, text", [
    ((0.5, 9), "correct=9"), ((0.5, -1), "correct=-1"), ((0.5, 2.5), "correct=2.5"), ((0.5, True), "correct=True"),
    ((0.5, 2, 1), "must return (loss, correct)"), (0.5, "must return (loss, correct)"),
    (("x", 2), "must be one number"), ((np.ones(2), 2), "must be one number")])
def test_what_a_loops_evaluate_returns_is_checked_in_that_loop(result, text):
    """evaluate(h, rows) returns (loss, correct): one number, and the rows right from 0 to the held-out count
    or None; anything else is CutMisuse at the label owner whose loop returned it (not a malformed reply the
    data owner refuses, nor a bare unpacking error)."""
    assert evaluation_scores((np.float32(0.5), np.int64(8)), 8) == {"loss": 0.5, "correct": 8, "count": 8}
    assert evaluation_scores([0.25, None], 8) == {"loss": 0.25, "correct": None, "count": 8}
    with pytest.raises(CutMisuse, match=re.escape(text)):
        evaluation_scores(result, 8)


@pytest.mark.integration
def test_an_evaluation_count_out_of_range_stops_the_label_owners_loop_not_the_data_owners(tmp_path):
    """A CutServer's evaluate that says more rows are right than it scored fails in the label owner's loop
    (CutMisuse), which tells the data owner why (PeerAborted); before, the reply went out malformed and the
    data owner's loop failed with a ProtocolError instead."""
    np.save(tmp_path / "x.npy", np.ones((20, 3), np.float32))
    np.save(tmp_path / "y.npy", np.zeros(20, np.int64))
    fields = {**FIELDS, "steps": 2}
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0,
                            evaluate=lambda h, rows: (0.5, 99),
                            data=dict(kind="npy", labels=str(tmp_path / "y.npy"), batch=4, test_fraction=0.2), **fields)
    loop = Loop(server)
    with pytest.raises(PeerAborted, match="CutMisuse: evaluate returned correct=99"):
        with Cut.connect(server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **fields,
                         data=dict(kind="npy", features=str(tmp_path / "x.npy"), batch=4, test_fraction=0.2)) as cut:
            cut.step(np.ones((4, 3), np.float32))
            cut.evaluate(np.ones((len(cut.test_rows), 3), np.float32))
    assert isinstance(loop.result(), CutMisuse) and loop.seen == [(1, 0)]


class StoppingLabelOwner:
    """A label owner (a ROUTER on a thread) whose evaluations all say stop, as a daemon's early stopping does:
    it welcomes a hello, answers a forward with a gradient of ones, an evaluate with stop, a bye with a bye;
    ``forwards`` counts the steps it was sent."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.forwards, self.done = [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _answer(self, msg: Message) -> Message:
        if msg.type == wire.HELLO:
            return Message(wire.WELCOME, msg.run, msg.step, body={"stage": "g", "next_step": 1})
        if msg.type == wire.FORWARD:
            self.forwards.append(msg.step)
            return Message(wire.BACKWARD, msg.run, msg.step, body={"loss": 0.5, "compute_s": 0.0},
                           tensors={"activation_grad": np.ones((4, 3), np.float32)})
        if msg.type == wire.EVALUATE:
            return evaluation_reply(msg.run, msg.step, {"loss": 0.5, "correct": None, "count": 4, "stop": True})
        return Message(wire.BYE, msg.run, msg.step, body={"steps": msg.body["steps"]})

    def _run(self) -> None:
        while not self.done.is_set():
            if self.sock.poll(50):
                identity, *frames = self.sock.recv_multipart()
                self.sock.send_multipart([identity, *wire.encode(self._answer(wire.decode(frames)))])

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.sock.close()


@pytest.mark.integration
def test_a_step_after_the_label_owners_early_stopping_said_stop_is_misuse_and_close_ends_the_run():
    """early_stopping ends the run on every party at the same step: once an evaluation says stop, the next
    cut.step is CutMisuse before anything is sent (before, it was sent, and a daemon label owner trained on
    past its own stop), and close() says bye after the steps applied."""
    owner = StoppingLabelOwner()
    try:
        with Cut.connect(owner.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **FIELDS) as cut:
            cut.step(np.ones((4, 3), np.float32))
            assert cut.evaluate(np.ones((4, 3), np.float32))["stop"] and cut.stopped
            with pytest.raises(CutMisuse, match="early stopping ended the run after step 1"):
                cut.step(np.ones((4, 3), np.float32))
            assert cut.applied == 1
        assert owner.forwards == [1]
    finally:
        owner.close()


@pytest.mark.integration
def test_a_state_given_with_a_step_or_run_is_a_config_error_not_one_of_them_ignored():
    """Cut.connect stands at a state_dict's step and run, or at step= and run=: given both, which one the
    loop meant is unknown, so it is refused (before, step= and run= were silently replaced by the state's)."""
    saved = Cut.connect("tcp://127.0.0.1:9", step=2, run="saved", **FIELDS)
    state = saved.state_dict()
    saved.close(finished=False)
    for extra in (dict(step=1, run="other"), dict(step=2), dict(run="saved")):
        with pytest.raises(ConfigError, match="state= .* or step= and run=, not both"):
            Cut.connect("tcp://127.0.0.1:9", state=state, **extra, **FIELDS)
    cut = Cut.connect("tcp://127.0.0.1:9", state=state, **FIELDS)
    assert (cut.applied, cut.run_id) == (2, "saved")
    cut.close(finished=False)


@pytest.mark.integration
def test_a_middle_stage_passes_the_notice_of_the_stage_above_down_so_the_label_owner_stops_at_once():
    """A chain with the cut library at both ends and a middle-stage daemon (distgrad-stage m) between: the data
    owner's loop stops mid-run and tells m, which fails its run and passes the notice down; the label owner's
    loop raises PeerAborted naming why (before, m did not pass it on and the label owner waited out its
    liveness and peer deadline: PeerTimeout)."""
    server = CutServer.bind("tcp://127.0.0.1:*", interface="chain-regression", liveness_s=5.0, peer_deadline_s=10.0)
    below: dict = {}

    def label_owner() -> None:
        try:
            with server:
                for batch in server:
                    batch.reply(0.5, np.ones_like(batch.h))
        except Exception as e:          # noqa: BLE001 - handed to the test
            below["error"] = e
    loop = threading.Thread(target=label_owner, daemon=True)
    loop.start()
    exp = load_experiment("chain-regression")
    middle: dict = {}
    ready = threading.Event()

    def run_middle() -> None:
        try:
            serve(StageOptions(exp, "m", exp.seed, liveness_s=5.0, peer_deadline_s=10.0), "tcp://127.0.0.1:*",
                  StopFlag(), connect=server.endpoint, on_ready=lambda endpoint: (middle.update(endpoint=endpoint),
                                                                                   ready.set()))
        except Exception as e:          # noqa: BLE001 - handed to the test
            middle["error"] = e
    thread = threading.Thread(target=run_middle, daemon=True)
    thread.start()
    assert ready.wait(30), middle
    with Cut.connect(middle["endpoint"], interface="chain-regression", timeout_s=2.0, peer_deadline_s=10.0) as cut:
        cut.step(np.ones(cut_side(FIRST, "chain-regression", {}).shape, np.float32))
        cut.close(finished=False)
    thread.join(30)
    assert isinstance(middle.get("error"), PeerAborted), middle
    loop.join(30)
    error = below.get("error")
    assert isinstance(error, PeerAborted), error
    assert "stage m stopped: the stage above stopped: stage f stopped: its loop closed the cut after step 1" in \
        str(error)


def _inside(end) -> None:
    """Wait until a thread is inside one of ``end``'s calls (the end marks its driving thread), for at most
    ``REPLY_MS``; the test's next call then shows whether a second thread is refused."""
    deadline = time.monotonic() + REPLY_MS / 1000
    while end.__dict__.get("_driver") is None and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.integration
def test_a_second_thread_calling_a_cut_end_while_one_is_inside_is_misuse_not_a_second_reply_to_one_step():
    """One loop drives a cut end: a call from another thread while one is inside (a step awaiting its reply, a
    ``next`` awaiting a batch) is ``CutMisuse`` at once. Before, two threads' ``cut.step`` both sent step 1 and
    both returned its one reply: two gradients back-propagated for a step applied once on each side. Calls
    that take turns from different threads go on as one loop's."""
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=3.0, **FIELDS)
    batches, release, seen = queue.Queue(), threading.Event(), []

    def loop() -> None:
        for batch in server:
            seen.append(batch.step)
            batches.put(batch)
            release.wait(REPLY_MS / 1000)
            batch.reply(float(batch.step), np.ones((4, 3), np.float32))

    serving = threading.Thread(target=loop, daemon=True)
    serving.start()
    _inside(server)                                      # the loop's thread waits for a batch in next()
    with pytest.raises(CutMisuse, match=r"CutServer.next was called from thread .* inside its next: one loop"):
        next(server)
    cut = Cut.connect(server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **FIELDS)
    first: dict = {}
    stepping = threading.Thread(target=lambda: first.update(loss=cut.step(np.full((4, 3), 1, np.float32))[0]))
    stepping.start()
    batches.get(timeout=REPLY_MS / 1000)                 # step 1 reached the loop: its thread awaits the reply
    with pytest.raises(CutMisuse, match=r"Cut.step was called from thread .* inside its step"):
        cut.step(np.full((4, 3), 2, np.float32))
    release.set()
    stepping.join(REPLY_MS / 1000)
    assert first == {"loss": np.float32(1.0)} and cut.applied == 1
    for k in (2, 3):                                     # this thread's turn now: its steps are the next ones
        assert cut.step(np.full((4, 3), k, np.float32))[0] == np.float32(k)
    cut.close()
    serving.join(REPLY_MS / 1000)
    assert not serving.is_alive() and seen == [1, 2, 3]
    server.close()
    # The server of several data owners keeps the same rule (its own next, waiting here for two parties).
    group = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=3.0, name="v", parties=2,
                           aggregate="concat", activation=[3], batch=4, steps=3)
    stopped: list = []
    waiting = threading.Thread(target=lambda: stopped.append(pytest.raises(PeerAborted, next, group)), daemon=True)
    waiting.start()
    _inside(group)
    with pytest.raises(CutMisuse, match=r"GroupServer.next was called from thread .* inside its next"):
        next(group)
    with zmq.Context() as ctx, dealer(ctx, group.endpoint) as party:     # a party stopping before its hello
        party.send_multipart(wire.encode(wire.abort_notice("r1", "p0", "its loop failed")))   # ends that next
        waiting.join(REPLY_MS / 1000)
    assert "its loop failed" in str(stopped[0].value)
    group.close()


def test_a_non_finite_activation_is_a_non_finite_error_before_anything_is_sent():
    """A NaN or Inf in ``h`` (the interface does not allow them) stops the data owner's loop here, naming the
    step, as a daemon data owner stops on its own activation; before, it crossed and came back as the label
    owner's refusal (or a timeout, with no label owner up). Nothing listens at the endpoint: nothing is sent."""
    cut = Cut.connect(free_tcp_endpoint(), timeout_s=0.2, peer_deadline_s=0.5, **FIELDS)
    h = np.ones((4, 3), np.float32)
    h[2, 1] = np.nan
    with pytest.raises(NonFiniteError, match=r"h holds NaN or Inf\) for step 1; nothing was sent"):
        cut.step(h)
    with pytest.raises(NonFiniteError, match=r"for the evaluation after step 0; nothing was sent"):
        cut.evaluate(np.full((2, 3), np.inf, np.float32))
    assert cut.applied == 0
    cut.close(finished=False)
