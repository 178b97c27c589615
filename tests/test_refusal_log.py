"""Refused messages are logged in bounded lines: the first of a kind in an interval in full, the repeats as a
count (``RefusalLog``), in every server that refuses messages: the serving stage, the predict server (both
``serving.decode_and_handle``) and the cut library's server."""

from __future__ import annotations

import logging

import pytest
import zmq

from distgrad.wire import messages as wire
from distgrad.wire import transport
from distgrad.wire.transport import RefusalLog

REPLY_MS = 5000
JUNK = [b"not a distgrad message"]
FLOOD = 200


class Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _flood(ctx: zmq.Context, endpoint: str, count: int = FLOOD) -> None:
    """``count`` undecodable messages from one raw peer, each answered with an error."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        for _ in range(count):
            sock.send_multipart(JUNK)
            assert sock.poll(REPLY_MS), "no reply to a refused message"
            assert wire.decode(sock.recv_multipart()).type == wire.ERROR
    finally:
        sock.close(0)


def test_repeats_are_counted_and_logged_as_one_line_when_the_interval_closes():
    log = logging.getLogger("distgrad.test-refusal-repeats")
    keep = Keep()
    log.addHandler(keep)
    try:
        refusals = RefusalLog(log, interval_s=60.0)
        for i in range(100):
            refusals.note("forward malformed", "refused forward %d", i)
        refusals.note("hello run", "refused hello")
        assert keep.lines == ["refused forward 0 [logged once per 60 s per key]",
                              "refused hello [logged once per 60 s per key]"]
        refusals.flush()
        assert keep.lines[2:] == ["99 more refusal(s) like the one logged before (forward malformed) within 60 s"]
        refusals.flush()                      # nothing counted since
        assert len(keep.lines) == 3
        refusals.note("forward malformed", "refused forward %d", 100)        # a new interval: in full again
        assert keep.lines[-1] == "refused forward 100 [logged once per 60 s per key]"
        refusals._window -= 61                # the interval is over: its repeats come before the next line
        refusals.note("forward malformed", "refused forward %d", 101)
        refusals.note("forward malformed", "refused forward %d", 102)
        refusals._window -= 61
        refusals.note("hello run", "refused hello")
        assert keep.lines[-2:] == ["1 more refusal(s) like the one logged before (forward malformed) within 60 s",
                                   "refused hello [logged once per 60 s per key]"]
        refusals.note("hello run", "refused hello")
        refusals.tick()                       # the interval is not over: nothing yet
        assert keep.lines[-1] == "refused hello [logged once per 60 s per key]"
        refusals._window -= 61                # over, and no refusal since: an idle server's tick logs the count
        refusals.tick()
        assert keep.lines[-1] == "1 more refusal(s) like the one logged before (hello run) within 60 s"
    finally:
        log.removeHandler(keep)


@pytest.mark.integration
def test_a_serving_stage_logs_a_flood_of_refused_messages_in_one_line(start_server, zmq_ctx):
    proc, endpoint = start_server("seed-reverse")
    _flood(zmq_ctx, endpoint)
    # The stage still answers, and its log holds the first refusal, not one line per message.
    sock = zmq_ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    sock.send_multipart(wire.encode(wire.Message(wire.PING, "", 0)))
    assert sock.poll(REPLY_MS) and wire.decode(sock.recv_multipart()).type == wire.PONG
    refused = [line for line in proc.output.splitlines() if "refused an undecodable message" in line]
    assert len(refused) == 1, proc.output[-3000:]
    assert "logged once per" in refused[0]


@pytest.mark.integration
def test_a_cut_server_logs_a_flood_of_refused_messages_in_one_line():
    from conftest import hello_message
    from distgrad.cut import CutServer
    from test_cut_hostile import FIELDS, Loop, ask, dealer, exp, forward

    ctx = zmq.Context.instance()
    keep = Keep()
    logging.getLogger("distgrad").addHandler(keep)
    # One refusal log a logger per process: forget what earlier tests in this worker refused on it, so the
    # first refusal of this flood is logged in full here.
    transport._REFUSAL_LOGS.clear()
    server = CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **FIELDS)
    loop = Loop(server)
    a = dealer(ctx, server.endpoint)
    try:
        _flood(ctx, server.endpoint)
        assert ask(a, hello_message(exp(), "a")).type == wire.WELCOME        # and it serves on
        for step in (1, 2, 3):
            assert ask(a, forward("a", step)).type == wire.BACKWARD
        assert ask(a, wire.Message(wire.BYE, "a", 4, body={"steps": 3})).type == wire.BYE
        assert loop.result() is None
    finally:
        a.close()
        server.close()
        logging.getLogger("distgrad").removeHandler(keep)
    refused = [line for line in keep.lines if "refused an undecodable message" in line]
    assert len(refused) == 1, keep.lines[:5]


def test_decode_and_handle_the_predict_servers_path_too_logs_a_kind_once():
    """The serving stage and the predict server both refuse through ``decode_and_handle``."""
    from distgrad.run.serving import decode_and_handle

    log = logging.getLogger("distgrad.test-decode-and-handle")
    keep = Keep()
    log.addHandler(keep)
    try:
        for _ in range(50):
            msg, answer, refused = decode_and_handle(JUNK, 1 << 20, lambda m: None, log)
            assert refused and msg is None and answer.type == wire.ERROR
        assert len([line for line in keep.lines if line.startswith("refused an undecodable message")]) == 1
    finally:
        log.removeHandler(keep)
