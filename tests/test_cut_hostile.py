"""The cut library under attack and careless use: a ``CutServer`` over real sockets against raw DEALERs
sending what a real data owner never would, a ``Cut`` against a label owner that answers badly, and
checkpoint states that are not what ``state_dict`` gave. Each gets the protocol's error reply (or a clear
error at bind/connect); the user's loop never sees a batch for it, and the real client is served on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from conftest import hello_message
from distgrad.cut import Cut, CutServer
from distgrad.errors import ConfigError, CutMisuse, PeerAborted
from distgrad.run.cut_interface import FIRST, cut_side
from distgrad.wire import messages as wire
from distgrad.wire.keys import keygen, load_public, load_secret
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.transport import MAX_FRAMES
from test_bad_input import UNDECODABLE

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
def test_a_cut_server_refuses_what_no_real_data_owner_sends_and_serves_the_real_one_on():
    ctx = zmq.Context.instance()
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **FIELDS)
    loop = Loop(server)
    a, b = dealer(ctx, server.endpoint), dealer(ctx, server.endpoint)
    try:
        for frames, code in UNDECODABLE:
            refused(a, frames, code)
        refused(a, [b"x"] * (MAX_FRAMES + 1), ErrorCode.MALFORMED)
        refused(a, forward("a", 1), ErrorCode.RUN, "hello first")          # before any hello
        big = dealer(ctx, server.endpoint)          # a frame over MAXMSGSIZE: ZeroMQ drops that peer, no reply
        big.send_multipart([b"\x00" * (server.max_frame + 1)])
        assert not big.poll(300)
        big.close()
        assert ask(a, Message(wire.PING, "", 0)).type == wire.PONG
        assert ask(a, hello_message(exp(), "a")).type == wire.WELCOME
        refused(b, hello_message(exp(), "b"), ErrorCode.RUN, "busy")       # a second client while a is live
        refused(b, forward("b", 1), ErrorCode.RUN)
        refused(a, forward("a", 1, np.ones((4, 2), np.float32)), ErrorCode.TENSOR)
        refused(a, forward("a", 1, np.full((4, 3), np.nan, np.float32)), ErrorCode.NONFINITE)
        refused(a, forward("a", 1, np.ones((4, 3), np.float64)), ErrorCode.TENSOR)
        refused(a, forward("a", 3), ErrorCode.STEP, "expected step 1")     # a step far ahead
        refused(a, forward("a", 1, mb=0, mbs=2), ErrorCode.STEP)
        assert ask(a, Message(wire.PING, "a", 1)).type == wire.PONG
        first = ask(a, forward("a", 1))
        assert first.type == wire.BACKWARD and first.body["loss"] == 1.0
        again = ask(a, forward("a", 1))                                     # resent: the cached reply
        assert again.type == wire.BACKWARD and again.body == first.body
        refused(a, Message(wire.BYE, "a", 2, body={"steps": 5}), ErrorCode.STEP)
        assert ask(a, forward("a", 2)).body["loss"] == 2.0
        assert ask(a, Message(wire.BYE, "a", 3, body={"steps": 2})).type == wire.BYE
        assert loop.result() is None
        assert loop.seen == [(1, 0), (2, 0)]
    finally:
        a.close()
        b.close()
        server.close()


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
            elif msg.type == wire.FORWARD:
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


@pytest.mark.integration
@pytest.mark.parametrize("answer,error,text", [
    (lambda m: backward(m, np.ones((4, 2), np.float32)), "ProtocolError", "stage g's reply to step 1"),
    (lambda m: backward(m, np.ones((4, 3), np.float64)), "ProtocolError", "accepts at most 48"),
    (lambda m: backward(m, np.full((4, 3), np.inf, np.float32)), "NonFiniteError", "non-finite activation_grad"),
    (lambda m: backward(m, np.ones((4, 3), np.float32), loss=float("nan")), "NonFiniteError", "non-finite loss"),
    (lambda m: [b"\xc1garbage"], "ProtocolError", "malformed"),
    (lambda m: None, "PeerTimeout", "no reply"),
    (lambda m: backward(m, np.ones((4, 3), np.float32), step=m.step + 1), "PeerTimeout", "no reply"),
], ids=["shape", "dtype", "inf-grad", "nan-loss", "garbage", "silent", "other-step"])
def test_a_cut_facing_a_label_owner_that_answers_badly_gets_a_clear_error_within_its_bounds(answer, error, text):
    owner = BadLabelOwner(answer)
    cut = Cut.connect(owner.endpoint, timeout_s=0.2, peer_deadline_s=0.8, **FIELDS)
    try:
        started = time.monotonic()
        with pytest.raises(Exception) as e:
            cut.step(np.ones((4, 3), np.float32))
        assert type(e.value).__name__ in error.split("|"), repr(e.value)
        assert text in str(e.value), str(e.value)
        # A hang guard, not a speed check: 10 s is over 10 times the 0.8 s peer deadline, and well under the
        # 60 s default a cut that ignored it would wait.
        assert time.monotonic() - started < 10 and cut.applied == 0
    finally:
        cut.close(finished=False)
        owner.close()


@pytest.mark.integration
def test_with_curve_the_run_belongs_to_the_key_that_opened_it(tmp_path):
    """protocol.md, *Owner*: another allowed key may not drive, rewind, end or replace the open run."""
    server_secret, keys = curve_keys(tmp_path, ("f", "intruder"))
    ctx = zmq.Context()              # CURVE's authenticator is one per context
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, curve_secret=server_secret,
                            allow=tmp_path / "clients", ctx=ctx, **FIELDS)
    loop = Loop(server)
    owner, intruder = dealer(ctx, server.endpoint, **keys["f"]), dealer(ctx, server.endpoint, **keys["intruder"])
    try:
        assert ask(owner, hello_message(exp(), "a")).type == wire.WELCOME
        refused(intruder, hello_message(exp(), "a"), ErrorCode.RUN, "another client key")
        refused(intruder, hello_message(exp(), "b"), ErrorCode.RUN, "busy")
        refused(intruder, forward("a", 1), ErrorCode.RUN, "another client key")
        refused(intruder, Message(wire.BYE, "a", 1, body={"steps": 0}), ErrorCode.RUN, "another client key")
        refused(intruder, wire.abort_notice("a", "f", "not its run"), ErrorCode.RUN, "not from the data owner")
        assert ask(intruder, Message(wire.PING, "", 0)).type == wire.PONG
        assert ask(owner, forward("a", 1)).body["loss"] == 1.0
        assert ask(owner, Message(wire.BYE, "a", 2, body={"steps": 1})).type == wire.BYE
        assert loop.result() is None and loop.seen == [(1, 0)]
    finally:
        owner.close()
        intruder.close()
        server.close()
        ctx.term()


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
def test_refused_messages_do_not_keep_a_run_live_so_a_new_run_may_replace_one_whose_data_owner_is_gone():
    """protocol.md: the open run's client is live while a hello, forward or bye of it was accepted within
    liveness_s; pings and refused messages do not count (in plaintext anyone may send the run id)."""
    ctx = zmq.Context.instance()
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=0.5, peer_deadline_s=5.0, **FIELDS)
    loop = Loop(server)
    a, b = dealer(ctx, server.endpoint), dealer(ctx, server.endpoint)
    try:
        assert ask(a, hello_message(exp(), "a")).type == wire.WELCOME
        # Time passing is the point here, not an order of events: refused messages for longer than liveness_s
        # (0.5 s). A busy machine only lets more time pass, which the outcome below does not depend on.
        until = time.monotonic() + 0.8
        while time.monotonic() < until:
            refused(a, forward("a", 3), ErrorCode.STEP)
            time.sleep(0.05)
        assert ask(b, hello_message(exp(), "b")).type == wire.WELCOME
        assert ask(b, forward("b", 1)).body["loss"] == 1.0
        refused(a, forward("a", 1), ErrorCode.RUN)
        assert ask(b, Message(wire.BYE, "b", 2, body={"steps": 1})).type == wire.BYE
        assert loop.result() is None and loop.seen == [(1, 0)]
    finally:
        a.close()
        b.close()
        server.close()


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
def test_an_aborted_notice_stops_the_loop_only_from_its_own_data_owner():
    """A notice of another run (anyone may send one in plaintext) is refused and the run goes on; its own
    data owner's stops the loop at once with PeerAborted naming the reason."""
    ctx = zmq.Context.instance()
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **FIELDS)
    loop = Loop(server)
    a, b = dealer(ctx, server.endpoint), dealer(ctx, server.endpoint)
    try:
        assert ask(a, hello_message(exp(), "a")).type == wire.WELCOME
        assert ask(a, forward("a", 1)).type == wire.BACKWARD
        refused(b, wire.abort_notice("b", "f", "not yours"), ErrorCode.RUN, "aborted notice of run 'b'")
        assert ask(a, forward("a", 2)).type == wire.BACKWARD
        a.send_multipart(wire.encode(wire.abort_notice("a", "f", "its loop failed: ValueError: bad batch")))
        error = loop.result()
        assert isinstance(error, PeerAborted) and "stage f stopped: its loop failed: ValueError: bad batch" in str(error)
        assert loop.seen == [(1, 0), (2, 0)]
        assert not a.poll(300)            # nothing is told back to a data owner that stopped
    finally:
        a.close()
        b.close()
        server.close()
