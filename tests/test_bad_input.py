"""A live serving stage refuses bad messages with error replies and keeps its state."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from distgrad.wire import messages as wire
from distgrad.config.parse import load_experiment
from distgrad.stage.stage import Stage
from distgrad.wire.transport import Client
from distgrad.wire.messages import ErrorCode, Message

from conftest import StageProcess, hello_message, read_json, run_main

REPLY_TIMEOUT_MS = 5000


def _raw_request(sock: zmq.Socket, frames: list) -> Message:
    sock.send_multipart(frames)
    assert sock.poll(REPLY_TIMEOUT_MS), "no reply to a malformed message"
    return wire.decode(sock.recv_multipart())


def _header(**fields) -> bytes:
    header = {"v": wire.PROTOCOL_VERSION, "type": "forward", "run": "x", "step": 1, "mb": 0, "mbs": 1, "body": {}, "tensors": []}
    header.update(fields)
    return msgpack.packb(header)


def _binary(version: int = wire.PROTOCOL_VERSION, code: int = 1, flags: int = 0, count: int = 0) -> bytes:
    """A forward's binary header (docs/protocol.md, *Binary header*) for run "x", step 1."""
    return wire.BINARY_HEADER.pack(0xC1, version, code, flags, count, 1, 0, 1, 0, 1, 0.0, 0.0) + b"x"


def _read_grad(reply: Message, shape: tuple[int, ...]) -> np.ndarray:
    """A backward reply's activation gradient, read against what this driver expects of it."""
    wire.expect_tensors(reply, {"activation_grad": (shape, np.float32)})
    return reply.tensors["activation_grad"]


def _hello(exp, run: str, **changes) -> Message:
    return hello_message(exp, run, **changes)


UNDECODABLE = [
    ([b"\xc1garbage"], ErrorCode.MALFORMED),
    ([b""], ErrorCode.MALFORMED),
    ([msgpack.packb([1, 2, 3])], ErrorCode.MALFORMED),
    ([_header(v=99)], ErrorCode.VERSION),
    ([_header(type="launch-missiles")], ErrorCode.TYPE),
    ([_header(tensors=[["activation", "float32", [1]]])], ErrorCode.TENSOR),          # frame missing
    ([_header(tensors=[["activation", "float32", [1 << 40, 1 << 40]]]), b"1234"], ErrorCode.TENSOR),
    ([_header(step=-1)], ErrorCode.MALFORMED),
    ([_binary(version=4), b"1234"], ErrorCode.VERSION),
    ([_binary(code=9), b"1234"], ErrorCode.TYPE),
    ([_binary(flags=1, count=1), b"1234"], ErrorCode.MALFORMED),
    ([_binary(count=2), b"1234"], ErrorCode.TENSOR),                                  # a frame missing
    ([_binary()[:-3]], ErrorCode.MALFORMED),                                           # cut short
]


def test_undecodable_messages_get_error_replies_and_a_real_run_follows(start_server, tmp_path, zmq_ctx):
    g, endpoint = start_server("seed-reverse", "--summary", tmp_path / "g.json")
    exp = load_experiment("seed-reverse")
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    for frames, code in UNDECODABLE:
        reply = _raw_request(dealer, frames)
        assert reply.type == wire.ERROR and reply.body["code"] == code, (frames, reply.body)
    # Well-formed but refused: no handshake yet, and handshakes that do not match.
    client = Client(zmq_ctx, endpoint)
    for msg, code in [
        (Message(wire.FORWARD, "r", 1, tensors={"activation": np.ones(1, np.float32)}), ErrorCode.RUN),
        (_hello(exp, "r", fingerprint="0" * 64), ErrorCode.MISMATCH),
        (_hello(exp, "r", seed=7), ErrorCode.MISMATCH),
        (_hello(exp, "r", activation={"shape": [2], "dtype": "float32"}), ErrorCode.MISMATCH),
        # parts that the hello's (matching) fingerprint is not the digest of: another interface than it names
        (_hello(exp, "r", parts={**exp.interface_parts(), "steps": 1}), ErrorCode.MALFORMED),
        (_hello(exp, "r", parts={}), ErrorCode.MALFORMED),
        (Message(wire.BACKWARD, "r", 1, body={"loss": 0.0}), ErrorCode.RUN),
    ]:
        with pytest.raises(Exception) as info:
            client.request(msg, 5)
        assert getattr(info.value, "code", None) == code, info.value
    # A REQ peer (with its empty delimiter frame) is answered too.
    req = zmq_ctx.socket(zmq.REQ)
    req.connect(endpoint)
    assert _raw_request(req, [b"not msgpack \xc1"]).body["code"] == ErrorCode.MALFORMED
    # The daemon is still serving, and trains exactly as if nothing had happened.
    ref = tmp_path / "ref.json"
    assert run_main(["run", "seed-reverse", "--in-process", "--summary", ref]).returncode == 0
    with StageProcess(["f", "--experiment", "seed-reverse", "--connect", endpoint], tmp_path / "f.log") as f:
        assert f.wait() == 0, f.output
    assert g.wait() == 0, g.output
    assert read_json(tmp_path / "g.json")["params"]["g"] == read_json(ref)["params"]["g"]
    assert "refused" in g.output


def test_bad_forwards_mid_run_change_nothing(start_server, tmp_path, zmq_ctx):
    """Drive f by hand and slip a bad message in before every step: g's result is unchanged."""
    steps = 30
    g, endpoint = start_server("seed-reverse", "--summary", tmp_path / "g.json")
    exp = load_experiment("seed-reverse")
    f = Stage.from_experiment(exp, "f")
    data = exp.build_data()
    client = Client(zmq_ctx, endpoint)
    assert client.request(_hello(exp, "run-1"), 5).type == wire.WELCOME
    # A second client may not hijack the run.
    intruder = Client(zmq_ctx, endpoint)
    with pytest.raises(Exception) as info:
        intruder.request(_hello(exp, "run-2"), 5)
    assert info.value.code == ErrorCode.RUN
    bad_forwards = [
        ({"activation": np.ones(2, np.float32)}, ErrorCode.TENSOR),                 # wrong shape
        ({"activation": np.ones(1, np.float64)}, ErrorCode.TENSOR),                 # wrong dtype
        ({"activation": np.array([np.nan], np.float32)}, ErrorCode.NONFINITE),
        ({"activation": np.array([np.inf], np.float32)}, ErrorCode.NONFINITE),
        ({"activation": np.ones(1, np.float32), "extra": np.ones(1, np.float32)}, ErrorCode.TENSOR),
        ({}, ErrorCode.TENSOR),
    ]
    for step in range(1, steps + 1):
        tensors, code = bad_forwards[step % len(bad_forwards)]
        with pytest.raises(Exception) as info:
            client.request(Message(wire.FORWARD, "run-1", step, tensors=tensors), 5)
        assert info.value.code == code
        for wrong_step in (step + 1, step + 100):                                   # from the future
            with pytest.raises(Exception) as info:
                client.request(Message(wire.FORWARD, "run-1", wrong_step,
                                       tensors={"activation": np.ones(1, np.float32)}), 5)
            assert info.value.code == ErrorCode.STEP and f"expected step {step}" in str(info.value)
        y, cache = f.forward(data.features(step))
        reply = client.request(Message(wire.FORWARD, "run-1", step, tensors={"activation": y}), 5)
        # A repeat of the step just applied gets the same reply and no second update.
        again = client.request(Message(wire.FORWARD, "run-1", step, tensors={"activation": y}), 5)
        assert again.body == reply.body
        np.testing.assert_array_equal(_read_grad(again, y.shape), _read_grad(reply, y.shape))
        _, grads = f.backward(cache, reply.tensors["activation_grad"].copy())
        f.apply(grads)
    with pytest.raises(Exception) as info:                 # a bye must agree on the steps applied
        client.request(Message(wire.BYE, "run-1", steps + 1, body={"steps": steps - 1}), 5)
    assert info.value.code == ErrorCode.STEP
    client.request(Message(wire.BYE, "run-1", steps + 1, body={"steps": steps}), 5)
    assert g.wait() == 0, g.output
    ref = tmp_path / "ref.json"
    assert run_main(["run", "seed-reverse", "--in-process", "--steps", steps, "--summary", ref]).returncode == 0
    reference = read_json(ref)["params"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == reference["g"]
    assert {k: v.tolist() for k, v in f.params.items()} == reference["f"]
