"""The U-shaped split: the data owner runs the first stage and the head, a server the body.

``digits-ushaped`` is f -> body -> head with the labels on the head: f (the
images) and head (the labels, the loss) are the data owner's, body is the
server's. The test runs the three parties' stage files (``distgrad split``:
the body's holds no data) as three processes, with a recording relay on
each of the body's two links, and checks every message the body received in
the whole run (hello, forwards, evaluations, bye, and the replies from
below): no target, no tensor shaped like the images or the predictions, and
nothing in the bodies but what docs/topologies.md says the server learns.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import zmq

from distgrad.wire import messages as wire
from distgrad.config.parse import load_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.config.split import split_experiment

from conftest import read_json, run_cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

EXPERIMENT = "digits-ushaped"
STEPS, EVAL_EVERY = 60, 30
FEATURES, CLASSES = 64, 10          # an image's pixels, the head's output per row (one score per digit)
CUT_ABOVE, CUT_BELOW = 48, 32       # f's output, the body's output
RELAY_POLL_MS = 50


class RecordingRelay:
    """A ROUTER the stage above connects to and a DEALER connected to the stage serving at ``target``:
    every message passes unchanged, and its frames are kept by direction (``down``: towards ``target``,
    ``up``: its replies). Runs in a thread until ``stop``; the sockets belong to ``ctx``."""

    def __init__(self, ctx: zmq.Context, target: str) -> None:
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.back = ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(target)
        self.down: list[list[bytes]] = []
        self.up: list[list[bytes]] = []
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        sender = b""
        while not self._stopped.is_set():
            ready = dict(poller.poll(RELAY_POLL_MS))
            if self.front in ready:
                sender, *frames = self.front.recv_multipart()
                self.down.append(frames)
                self.back.send_multipart(frames)
            if self.back in ready:
                frames = self.back.recv_multipart()
                self.up.append(frames)
                self.front.send_multipart([sender, *frames])    # a DEALER above: its latest routing id

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(5)
        assert not self._thread.is_alive(), "the relay did not stop"


def _decoded(recorded: list[list[bytes]]) -> list[wire.Message]:
    return [wire.decode(frames) for frames in recorded]


def _check_tensors(messages: list[wire.Message], allowed: dict[str, tuple[str, int]]) -> None:
    """Each message carries only tensors named in ``allowed`` (type -> (name, width)), float32 rows of
    that width: never a target, an image (64 wide) or a prediction (10 wide)."""
    for msg in messages:
        if msg.frames is not None:      # a binary header: read its frames as the receiver does, rows of that width
            assert msg.type in allowed, msg.describe()
            name, width = allowed[msg.type]
            rows = sum(memoryview(frame).nbytes for frame in msg.frames) // (4 * width)
            wire.expect_tensors(msg, {name: ((rows, width), np.float32)})      # one frame of exactly that
        for name, array in msg.tensors.items():
            assert name != "target", msg.describe()
            assert msg.type in allowed and name == allowed[msg.type][0], f"{msg.describe()} carries {name!r}"
            assert array.dtype == np.float32 and array.ndim == 2, f"{msg.describe()}: {array.dtype}{array.shape}"
            assert array.shape[1] == allowed[msg.type][1] and array.shape[1] not in (FEATURES, CLASSES)


def test_split_gives_the_data_owner_images_and_labels_and_the_server_nothing(tmp_path: Path):
    paths = split_experiment(load_experiment(EXPERIMENT), tmp_path)
    assert [p.stem for p in paths] == ["f", "body", "head"]
    f, body, head = (tomllib.loads(p.read_text()) for p in paths)
    assert f["data"]["features"] == "features" and "labels" not in f["data"]
    assert head["data"]["labels"] == "labels" and "features" not in head["data"]
    assert "data" not in body and "loss" not in body["stage"] and head["stage"]["loss"] == "softmax_cross_entropy"
    assert load_experiment(paths).interface_parts() == load_experiment(EXPERIMENT).interface_parts()


def test_the_body_never_receives_an_image_a_label_or_a_prediction(tmp_path: Path, start_server, zmq_ctx):
    f_file, body_file, head_file = split_experiment(load_experiment(EXPERIMENT), tmp_path / "parties")
    common = ["--steps", STEPS, "--timeout", "5", "--peer-deadline", "20"]
    head, head_endpoint = start_server(head_file, *common, "--summary", tmp_path / "head.json", stage="head",
                                       name="head")
    below = RecordingRelay(zmq_ctx, head_endpoint)
    body, body_endpoint = start_server(body_file, *common, "--connect", below.endpoint, "--summary",
                                       tmp_path / "body.json", stage="body", name="body")
    above = RecordingRelay(zmq_ctx, body_endpoint)
    try:
        result = run_cli(["stage", "f", "--experiment", f_file, "--connect", above.endpoint, *common,
                          "--eval-every", EVAL_EVERY, "--summary", tmp_path / "f.json"])
        assert result.returncode == 0, result.stderr
        assert body.wait() == 0 and head.wait() == 0, body.output + head.output
    finally:
        above.stop()
        below.stop()

    reference = train_in_process(load_experiment(EXPERIMENT), steps=STEPS, eval_every=EVAL_EVERY)
    for name in ("f", "body", "head"):
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference["params"][name], name
    f_summary = read_json(tmp_path / "f.json")
    assert f_summary["evaluations"] == reference["evaluations"] and len(reference["evaluations"]) == 2

    from_f, from_head = _decoded(above.down), _decoded(below.up)        # everything the body received
    to_head, to_f = _decoded(below.down), _decoded(above.up)            # everything it sent
    assert [m.type for m in from_f] == ["hello"] + ["forward"] * 30 + ["evaluate"] \
        + ["forward"] * 30 + ["evaluate", "bye"]
    assert [m.type for m in from_head] == ["welcome"] + ["backward"] * 30 + ["evaluation"] \
        + ["backward"] * 30 + ["evaluation", "bye"]
    _check_tensors(from_f, {"forward": ("activation", CUT_ABOVE), "evaluate": ("activation", CUT_ABOVE)})
    _check_tensors(from_head, {"backward": ("activation_grad", CUT_BELOW)})
    _check_tensors(to_head, {"forward": ("activation", CUT_BELOW), "evaluate": ("activation", CUT_BELOW)})
    assert not any(m.body for m in from_f if m.type in ("forward", "evaluate"))

    # What travels up through the body besides the gradient: each micro-batch's loss (and the time the
    # head took), each evaluation's loss and count of right answers; the steps at the bye.
    for msg in from_head:
        expected = {"welcome": {"stage", "next_step"}, "backward": {"loss", "compute_s"},
                    "evaluation": {"loss", "correct", "count"}, "bye": {"steps"}}[msg.type]
        assert set(msg.body) == expected, msg.describe()
    evaluations = [m.body for m in from_head if m.type == "evaluation"]
    assert [e["correct"] / e["count"] for e in evaluations] == [e["test_accuracy"] for e in reference["evaluations"]]
    # The hello from f: the interface (no loss, no target shape: the labels do not travel) and the data
    # owner's row counts and sample-order digest; no row.
    parts = from_f[0].body["parts"]
    assert "target" not in parts and (parts["rows"], parts["held-out rows"]) == (1797, 359)
    assert {m.type for m in to_f} == {"welcome", "backward", "evaluation", "bye"}
