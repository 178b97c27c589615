"""A middle stage whose label owner withholds the training loss (dp_sgd with clip_noise) says so in its summary.

The data owner records ``final_loss: null`` with ``training_loss: "withheld by the label owner"``; a middle stage
of a chain gets the same replies from below (no loss) and records the same, in its summary, its checkpoints and
the summary of a run it finds finished. Unit tests: the middle stage and the label owner are the daemons'
serving stages in this process, the middle stage's link to the label owner handing each request to it through
the wire's encoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from distgrad.config.parse import load_experiment
from distgrad.run.handshake import hello
from distgrad.run.options import StageOptions
from distgrad.run.serving import ServingStage
from distgrad.run.stage_state import finished_run, nothing_to_do
from distgrad.stage.stage import Stage
from distgrad.wire import messages as wire

from test_budget import DP_SGD
from test_defenses import _defended

RUN = "run-1"


class _Loop:
    """A middle stage's link to the serving stage below it, in this process: each request is encoded,
    decoded and handled there, and its reply encoded and decoded back, as the wire would carry them."""

    def __init__(self, below: ServingStage) -> None:
        self.below, self.reply_specs, self.replies = below, None, {}

    def set_reply_specs(self, specs) -> None:
        self.reply_specs = specs

    def _ask(self, msg: wire.Message) -> wire.Message:
        answered = self.below.handle([b"m"], wire.decode(wire.encode(msg)), 0.0) + self.below.settle()
        (reply,) = [reply for _, reply in answered]
        return wire.decode(wire.encode(reply))

    def handshake(self, msg: wire.Message, client: int | None = None) -> int:
        return self._ask(msg).body["next_step"] - 1

    def send(self, msg: wire.Message) -> None:
        self.replies[(msg.step, msg.mb)] = self._ask(msg)

    def await_reply(self, pending, key, types=None) -> wire.Message:
        return self.replies.pop(key)

    def exchange(self, msg: wire.Message, types=None) -> wire.Message:
        return self._ask(msg)


def _chain(tmp_path: Path, monkeypatch, g_extra: str, **options) -> tuple[ServingStage, Callable[..., ServingStage]]:
    """chain-regression's middle stage m (``options``: its ``StageOptions``) linked to its label owner g
    (``g_extra``: lines of g's table), and a function that makes a new m on the same link."""
    exp = load_experiment(_defended(tmp_path, "chain-regression", {2: g_extra}, "chain.toml"))
    below = ServingStage(StageOptions(exp, "g", exp.seed, steps=2))
    monkeypatch.setattr("distgrad.run.serving.DownstreamLink", lambda *args, **kwargs: _Loop(below))

    def middle(**more) -> ServingStage:
        return ServingStage(StageOptions(exp, "m", exp.seed, steps=2, **options, **more), connect="tcp://x:1")

    m = middle()
    said = hello(exp, "f", exp.seed, exp.cuts[0], RUN, [0], 2, 1)
    assert [reply.type for _, reply in m.handle([b"f"], said, 0.0)] == [wire.WELCOME]
    return m, middle


def _step(m: ServingStage, step: int) -> wire.Message:
    """Step ``step`` of the data owner f through m: m's reply to it."""
    exp = m.exp
    x = Stage.from_experiment(exp, "f").forward(exp.build_data(stage="f").features(step))[0]
    answered = m.handle([b"f"], wire.Message(wire.FORWARD, RUN, step, 0, 1, tensors={"activation": x}), 0.0)
    answered += m.settle()
    (reply,) = [wire.decode(wire.encode(reply)) for _, reply in answered]
    return reply


def _finish(m: ServingStage) -> dict:
    """The bye after step 2, and m's summary of its completed run."""
    assert [r.type for _, r in m.handle([b"f"], wire.Message(wire.BYE, RUN, 3, body={"steps": 2}), 0.0)] == [
        wire.BYE]
    summary = m.finish_run()
    assert summary is not None and summary["status"] == "completed" and summary["steps"] == 2
    return summary


def test_a_middle_stage_records_a_withheld_loss_as_null_with_the_data_owners_note(tmp_path, monkeypatch):
    """With dp_sgd at the label owner m passes up no loss and its summary says why, as the data owner's does:
    final_loss null and training_loss "withheld by the label owner" (and its log line of the completed run);
    its checkpoints keep it, so a resumed m and the summary of the run found finished say it too."""
    ck = tmp_path / "ck"
    m, middle = _chain(tmp_path, monkeypatch, DP_SGD, checkpoint_dir=ck, checkpoint_every=1)
    assert wire.LOSS_WITHHELD_KEY in _step(m, 1).body
    resumed = middle(resume=True).close_run("stopped")      # from the checkpoint of step 1
    assert resumed["steps"] == 1 and resumed["training_loss"] == wire.LOSS_WITHHELD, resumed
    _step(m, 2)
    summary = _finish(m)
    assert summary["final_loss"] is None and summary["training_loss"] == wire.LOSS_WITHHELD == \
        "withheld by the label owner", summary
    assert m.topology.completed_message(summary).endswith("2 steps, final loss withheld by the label owner")
    opts = StageOptions(m.exp, "m", m.exp.seed, steps=2, checkpoint_dir=ck, resume=True)
    again = nothing_to_do(opts, finished_run(opts))
    assert again["final_loss"] is None and again["training_loss"] == wire.LOSS_WITHHELD, again


def test_a_middle_stage_given_the_loss_records_it_with_no_note(tmp_path, monkeypatch):
    """Without dp_sgd the loss comes up through m: its summary holds the label owner's loss, and no note."""
    m, _ = _chain(tmp_path, monkeypatch, "")
    assert isinstance(_step(m, 1).body["loss"], float)
    _step(m, 2)
    summary = _finish(m)
    assert summary["final_loss"] == pytest.approx(m.loss) and isinstance(summary["final_loss"], float)
    assert "training_loss" not in summary
