"""The cut as a library (distgrad.cut, distgrad.torch): a user's own loop on either side of the cut, against
a daemon or another user loop, over real processes and sockets; bitwise equal to the configured run of the
same model, resumed exactly after a kill -9 from the user's own checkpoint, and loud about misuse."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'distgrad[torch]'): the cut library's tests, torch and numpy loops alike, need it; CI installs it")

from conftest import DIGITS_NPZ, StageProcess, free_tcp_endpoint, read_json, wait_for_file  # noqa: E402
from distgrad.config.experiment import BUILTIN_DIR  # noqa: E402
from distgrad.config.parse import load_experiment  # noqa: E402
from distgrad.errors import ConfigError, CutMisuse, PeerAborted, PeerRejected, PeerTimeout  # noqa: E402
from distgrad.run.inprocess import train_in_process  # noqa: E402
from distgrad.cut import Cut, CutServer  # noqa: E402
import cut_loops  # noqa: E402
from distgrad.wire.keys import keygen  # noqa: E402

LOOPS = Path(__file__).resolve().parent / "cut_loops.py"
STEPS = 12

ENCODER = "from torch import nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(64, 16), nn.ReLU())\n"
HEAD = "from torch import nn\n\n\ndef make():\n    return nn.Sequential(nn.Linear(16, 10))\n"


def _interface(steps: int = STEPS, extra: str = "") -> str:
    return (f'[interface]\nname = "cut-test"\nstages = ["f", "g"]\nbatch = 32\n'
            f'activation = {{ shape = [16], dtype = "float32" }}\nsteps = {steps}\nseed = 0\nlabels = "last"\n'
            f'reduction = "mean"\n{extra}\n')


def _data(part: str, test_fraction: float) -> str:
    return f'[data]\nkind = "npy"\n{part}\nbatch = 32\ntest_fraction = {test_fraction}\n'


def write_parties(folder: Path, steps: int = STEPS, extra: str = "", test_fraction: float = 0.0) -> Path:
    """Both parties' files in one folder: the daemons' stage files (f.toml, g.toml: modules, optimiser,
    loss) and the library's (f-lib.toml, g-lib.toml: the same interface and data, [stage] names only)."""
    folder.mkdir(parents=True, exist_ok=True)
    digits = np.load(DIGITS_NPZ)
    np.save(folder / "pixels.npy", (digits["pixels"] / 16.0).astype(np.float32))
    np.save(folder / "digits.npy", digits["digit"].astype(np.int64))
    (folder / "encoder.py").write_text(ENCODER)
    (folder / "head.py").write_text(HEAD)
    iface = _interface(steps, extra)
    F_DATA, G_DATA = (_data('features = "pixels.npy"', test_fraction), _data('labels = "digits.npy"', test_fraction))
    (folder / "f.toml").write_text(iface + '[stage]\nname = "f"\nmodule = "encoder:make"\n'
                                           'optimizer = { type = "Adam", lr = 0.003 }\n' + F_DATA)
    (folder / "g.toml").write_text(iface + '[stage]\nname = "g"\nmodule = "head:make"\n'
                                           'optimizer = { type = "Adam", lr = 0.003 }\n'
                                           'loss = { type = "CrossEntropyLoss" }\n' + G_DATA)
    (folder / "f-lib.toml").write_text(iface + '[stage]\nname = "f"\n' + F_DATA)
    (folder / "g-lib.toml").write_text(iface + '[stage]\nname = "g"\n' + G_DATA)
    return folder


# The same cut computed by numpy in a daemon's stage file: for the tests whose point is the protocol's notices,
# not the framework (a PyTorch daemon's start is seconds of CPU; the torch daemons' runs are the tests of the
# configured run's numbers).
NUMPY_STAGES = {
    "f": 'model = [{ type = "dense", name = "f1", in = 64, out = 16 }, { type = "relu" }]\n'
         'optimizer = { type = "adam", lr = 0.003 }\n',
    "g": 'model = [{ type = "dense", name = "g1", in = 16, out = 10 }]\noptimizer = { type = "adam", lr = 0.003 }\n'
         'loss = "softmax_cross_entropy"\n',
}


def with_numpy_stage(folder: Path, stage: str) -> None:
    """``folder``'s daemon stage file ``stage``.toml with a numpy model of the same shapes in place of its module."""
    path = folder / f"{stage}.toml"
    head, rest = path.read_text().split("[stage]\n", 1)
    path.write_text(f'{head}[stage]\nname = "{stage}"\n{NUMPY_STAGES[stage]}\n[data]{rest.split("[data]", 1)[1]}')


def reference(folder: Path, micro_batches: int = 1) -> dict:
    """The configured run of the same model, in one process."""
    return train_in_process(load_experiment([folder / "f.toml", folder / "g.toml"]),
                            micro_batches=micro_batches)["params"]


def loop(folder: Path, side: str, target: Path | str, *flags: str, name: str | None = None) -> StageProcess:
    """A user loop of tests/cut_loops.py in its own process."""
    return StageProcess([LOOPS, side, folder, target, *flags], folder / f"{name or side}-loop.log",
                        command=[sys.executable])


def daemon(folder: Path, stage: str, *args: str) -> StageProcess:
    return StageProcess([stage, "--experiment", folder / f"{stage}.toml", "--summary", folder / f"{stage}.json",
                         *args], folder / f"{stage}-daemon.log")


@pytest.mark.parametrize("codecs", [
    "", pytest.param('activation_codec = "int8"\ngradient_codec = "topk:4+ef"', marks=pytest.mark.slow)],
    ids=["plain", "int8-down-topk-ef-up"])
def test_a_torch_loop_drives_a_label_owner_daemon_bitwise_as_the_configured_run(tmp_path, codecs):
    folder = write_parties(tmp_path / "p", extra=codecs)
    ready = folder / "g.ready"
    with daemon(folder, "g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready) as g:
        cut_loops.data_owner(folder, wait_for_file(ready, g), None)     # the user's loop: this process
        assert g.wait() == 0, g.output
    expected = reference(folder)
    assert json.loads((folder / "f-params.json").read_text()) == expected["f"]
    assert read_json(folder / "g.json")["params"]["g"] == expected["g"]


@pytest.mark.slow
@pytest.mark.timeout(180)    # three to four PyTorch processes; slower beside the rest of the slow set
@pytest.mark.parametrize("test_fraction,micro_batches", [(0.0, 1), (0.2, 1), (0.0, 4)],
                         ids=["no-held-out-rows", "evaluated-by-the-loop", "four-micro-batches"])
def test_a_data_owner_daemon_drives_a_torch_loop_bitwise_as_the_configured_run(tmp_path, test_fraction,
                                                                               micro_batches):
    folder = write_parties(tmp_path / "p", test_fraction=test_fraction)
    ready = folder / "g.ready"
    with loop(folder, "g", ready, *(["--evaluate"] if test_fraction else [])) as g:
        endpoint = wait_for_file(ready, g)
        with daemon(folder, "f", "--connect", endpoint, "--micro-batches", str(micro_batches)) as f:
            assert f.wait() == 0, f.output
        assert g.wait() == 0, g.output
    expected = reference(folder, micro_batches)
    assert read_json(folder / "f.json")["params"]["f"] == expected["f"]
    result = json.loads((folder / "g-params.json").read_text())
    assert result["params"] == expected["g"]
    assert result["seen"] == list(range(1, STEPS + 1))
    if test_fraction:          # the loop's scores of the held-out rows are the configured run's
        summary, configured = read_json(folder / "f.json"), train_in_process(
            load_experiment([folder / "f.toml", folder / "g.toml"]))
        assert (summary["test_loss"], summary["test_accuracy"]) == (configured["test_loss"],
                                                                   configured["test_accuracy"])


def _two_loops(folder: Path, f_flags: tuple = (), g_flags: tuple = (), restart: str = "") -> dict:
    """Run both user loops; ``restart`` names the side whose loop kills itself (its flags say when) and is
    started again, resuming from its own checkpoint. Returns both sides' results."""
    ready = folder / "g.ready"
    with loop(folder, "g", ready, *g_flags) as g:
        endpoint = wait_for_file(ready, g)
        with loop(folder, "f", endpoint, *f_flags) as f:
            if restart == "f":
                assert f.wait() == -9, f.output
                with loop(folder, "f", endpoint, name="f2") as f2:
                    assert f2.wait() == 0, f2.output
            elif restart == "g":
                assert g.wait() == -9, g.output
                with loop(folder, "g", ready, name="g2") as g2:
                    assert f.wait() == 0, f.output
                    assert g2.wait() == 0, g2.output
            else:
                assert f.wait() == 0, f.output
        if restart != "g":
            assert g.wait() == 0, g.output
    return {"f": json.loads((folder / "f-params.json").read_text()),
            "g": json.loads((folder / "g-params.json").read_text())}


@pytest.mark.slow
@pytest.mark.timeout(180)    # three to four PyTorch processes; slower beside the rest of the slow set
def test_two_torch_loops_train_bitwise_as_the_configured_run(tmp_path):
    folder = write_parties(tmp_path / "p")
    result = _two_loops(folder)
    expected = reference(folder)
    assert result["f"] == expected["f"] and result["g"]["params"] == expected["g"]
    assert result["g"]["seen"] == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(180)    # three to four PyTorch processes; slower beside the rest of the slow set
@pytest.mark.parametrize("side,flags", [("f", ("--die-after-reply", "5")), ("g", ("--die-before-send", "5"))],
                         ids=["data-owner-killed-after-its-reply-came", "label-owner-killed-before-its-reply-left"])
def test_a_loop_killed_9_resumes_from_its_own_checkpoint_with_no_step_lost_or_doubled(tmp_path, side, flags):
    """Step 5's reply is cached in the label owner's checkpoint: the data owner, resumed at step 4, sends
    step 5 again and gets that reply; the label owner's loop never computes a step twice."""
    folder = write_parties(tmp_path / "p")
    result = _two_loops(folder, **{f"{side}_flags": flags}, restart=side)
    expected = reference(folder)
    assert result["f"] == expected["f"] and result["g"]["params"] == expected["g"]
    assert result["g"]["seen"] == list(range(1, STEPS + 1))


def _numpy_reference(folder: Path) -> dict:
    """The numpy loops of cut_loops.py composed in one process: the same arithmetic with no wire."""
    from distgrad.run.cut_interface import FIRST, cut_side
    side = cut_side(FIRST, folder / "f-lib.toml", {})
    pixels, labels = np.load(folder / "pixels.npy"), np.load(folder / "digits.npy")
    w = np.random.default_rng(1).normal(0, 0.1, (64, 16)).astype(np.float32)
    v = np.random.default_rng(2).normal(0, 0.1, (16, 10)).astype(np.float32)
    losses = []
    for step in range(1, STEPS + 1):
        rows = side.rows(step)
        x = pixels[rows]
        h = x @ w
        z = h @ v
        p = np.exp(z - z.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        y = labels[rows]
        losses.append(float(-np.mean(np.log(p[np.arange(len(y)), y]))))
        dz = p.copy()
        dz[np.arange(len(y)), y] -= 1
        dz /= np.float32(len(y))
        dh = (dz @ v.T).astype(np.float32)
        v -= np.float32(0.1) * (h.T @ dz).astype(np.float32)
        w -= np.float32(0.1) * (x.T @ dh)
    return {"w": w.tolist(), "v": v.tolist(), "losses": losses}


def test_two_numpy_loops_compute_what_the_same_loops_compute_in_one_process(tmp_path):
    folder = write_parties(tmp_path / "p")
    result = _two_loops(folder, ("--numpy",), ("--numpy",))
    expected = _numpy_reference(folder)
    assert result["f"]["w"] == expected["w"]
    assert result["g"]["v"] == expected["v"] and result["g"]["losses"] == expected["losses"]


# ---------------------------------------------------------------- how a run ends: cleanly, or with the reason told

def _ended(folder: Path, f_flags: tuple = (), g_flags: tuple = ()) -> tuple[dict, dict]:
    """Both numpy loops in their own processes, each ending as its flags say (tests/cut_loops.py); how each
    ended (``error``, ``message``, ``steps``), once both processes have exited."""
    ready = folder / "g.ready"
    with loop(folder, "g", ready, "--numpy", *g_flags) as g:
        endpoint = wait_for_file(ready, g)
        with loop(folder, "f", endpoint, "--numpy", *f_flags) as f:
            f.wait()
        g.wait()
    return read_json(folder / "f-outcome.json"), read_json(folder / "g-outcome.json")


@pytest.mark.integration
def test_a_label_owner_loop_that_leaves_after_its_last_step_ends_both_sides_cleanly(tmp_path):
    """The label owner counts its steps and breaks after the last reply, before the data owner's bye: its
    CutServer answers the bye as it closes, so the data owner's close ends the run (bounds short enough that
    a bye left waiting would be a PeerTimeout)."""
    folder = write_parties(tmp_path / "p", steps=4)
    f, g = _ended(folder, ("--deadline", "3.0"), ("--leave-after-last", "--liveness", "2.0", "--deadline", "3.0"))
    assert f == {"error": None, "message": "", "steps": 4} and g == {"error": None, "message": "", "steps": 4}


@pytest.mark.integration
@pytest.mark.parametrize("f_flags,g_flags,f_ends,g_ends", [
    (("--bad-shape-at", "2"), (),
     ("CutMisuse", "h has shape (32, 15)", 1),
     ("PeerAborted", "stage f stopped: its loop failed: CutMisuse: h has shape (32, 15)", 1)),
    ((), ("--forget-reply-at", "2"),
     ("PeerAborted", ("stage g stopped: its loop failed: CutMisuse: the loop asked for the next batch without "
                      "replying to step 2"), 1),
     ("CutMisuse", "without replying to step 2", 1)),
    (("--close-at", "2"), (),
     (None, "", 2), ("PeerAborted", "stage f stopped: its loop closed the cut after step 2 of 4", 2)),
    ((), ("--close-at", "2"),
     ("PeerAborted", "stage g stopped: its loop closed the CutServer after step 2 of 4", 2), (None, "", 2))],
    ids=["data-owner-sends-a-wrong-shape", "label-owner-forgets-a-reply", "data-owner-closes-mid-run",
         "label-owner-closes-mid-run"])
def test_a_side_that_stops_mid_run_tells_the_other_why_and_it_stops_at_once(tmp_path, f_flags, g_flags, f_ends,
                                                                              g_ends):
    """A mistake raised on one side, or a close before the run's end, reaches the other side as an aborted
    notice with the reason: it raises PeerAborted naming it, not a PeerTimeout after its bounds (kept short
    here, so a side left waiting would time out instead)."""
    folder = write_parties(tmp_path / "p", steps=4)
    f, g = _ended(folder, ("--deadline", "20.0", *f_flags), ("--liveness", "10.0", "--deadline", "10.0", *g_flags))
    for outcome, (error, text, steps) in ((f, f_ends), (g, g_ends)):
        assert outcome["error"] == error and text in outcome["message"] and outcome["steps"] == steps, outcome


@pytest.mark.integration
def test_a_label_owner_that_leaves_after_its_last_step_still_scores_the_held_out_rows_and_takes_the_bye(tmp_path):
    """Between the last step and the bye the data owner may evaluate: the closing CutServer serves that too."""
    folder = write_parties(tmp_path / "p", steps=2, test_fraction=0.2)

    def counting(server):
        for batch in server:
            batch.reply(1.0, np.zeros(batch.h.shape, np.float32))
            if batch.step == server.exp.steps:
                return "left"

    served = Served(CutServer.bind("tcp://127.0.0.1:*", interface=folder / "g-lib.toml", liveness_s=5.0,
                                   evaluate=lambda h, rows: (0.25, 3)), counting)
    with Cut.connect(served.server.endpoint, interface=folder / "f-lib.toml", timeout_s=1.0,
                     peer_deadline_s=3.0) as cut:
        for step in (1, 2):
            cut.step(np.zeros((32, 16), np.float32), cut.rows(step))
        scores = cut.evaluate(np.zeros((len(cut.test_rows), 16), np.float32))
    assert (scores["loss"], scores["correct"]) == (0.25, 3)
    left, error = served.result()
    assert error is None and left == "left" and served.server.bye is not None


@pytest.mark.integration
def test_a_data_owner_daemon_is_told_when_the_label_owners_loop_fails(tmp_path):
    """The notice is the protocol's: a distgrad-stage data owner driving a loop that fails stops at once
    naming the loop's error, not after its peer deadline (kept short, so a daemon left waiting would time
    out instead)."""
    folder = write_parties(tmp_path / "p", steps=4)
    with_numpy_stage(folder, "f")
    ready = folder / "g.ready"
    with loop(folder, "g", ready, "--numpy", "--forget-reply-at", "2") as g:
        endpoint = wait_for_file(ready, g)
        with daemon(folder, "f", "--connect", endpoint, "--timeout", "1", "--peer-deadline", "20") as f:
            assert f.wait() != 0
            output = f.output
        g.wait()
    assert "aborted" in output and "stage g stopped: its loop failed: CutMisuse" in output, output
    assert read_json(folder / "g-outcome.json")["error"] == "CutMisuse"


@pytest.mark.integration
def test_a_label_owner_daemon_is_told_when_the_data_owners_loop_fails(tmp_path):
    """The other way round: a distgrad-stage label owner facing a Cut whose loop fails (a wrong shape at step
    2) stops at once (exit 4) naming the loop's error, not after its liveness and peer deadline (kept long,
    so a daemon left waiting would still be running when the test's bound expires), and writes no
    checkpoint of the step it never finished."""
    folder = write_parties(tmp_path / "p", steps=4)
    with_numpy_stage(folder, "g")
    ready = folder / "g.ready"
    with daemon(folder, "g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready, "--liveness", "600",
                "--peer-deadline", "600") as g:
        endpoint = wait_for_file(ready, g)
        with loop(folder, "f", endpoint, "--numpy", "--bad-shape-at", "2") as f:
            f.wait()
        assert g.wait() == 4, g.output
        output = g.output
    assert "stage f stopped: its loop failed: CutMisuse: h has shape (32, 15)" in output, output
    assert read_json(folder / "f-outcome.json")["error"] == "CutMisuse"
    assert read_json(folder / "g.json")["status"] == "failed"


BREAKING_ENCODER = ("from torch import nn\n\n\nclass Breaking(nn.Sequential):\n"
                    "    calls = 0\n\n    def forward(self, x):\n        type(self).calls += 1\n"
                    "        if type(self).calls == 3:\n            raise RuntimeError('the encoder broke at its third batch')\n"
                    "        return super().forward(x)\n\n\ndef make():\n"
                    "    return Breaking(nn.Linear(64, 16), nn.ReLU())\n")


@pytest.mark.integration
# Slow (two daemons, about 10 s): the notice a failing driver sends is test_secure_aggregation's
# test_a_value_out_of_range_is_not_told_to_the_label_owner_nor_relayed_to_the_other_parties, and the serving stage
# ending the run on it test_vertical's test_a_party_that_stops_ends_the_run_and_every_other_party_is_told_why.
@pytest.mark.slow
def test_a_label_owner_daemon_is_told_when_the_data_owner_daemon_fails_mid_run(tmp_path):
    """Daemons on both sides: a data owner whose own module raises at its third batch tells the label owner
    why (an aborted notice) as it exits; the label owner ends the run as failed at once (exit 4) naming the
    error, not after its liveness and peer deadline (kept long, so a daemon left waiting would outlive the
    test's bound)."""
    folder = write_parties(tmp_path / "p", steps=6)
    (folder / "encoder.py").write_text(BREAKING_ENCODER)
    ready = folder / "g.ready"
    with daemon(folder, "g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready, "--liveness", "600",
                "--peer-deadline", "600") as g:
        endpoint = wait_for_file(ready, g)
        with daemon(folder, "f", "--connect", endpoint) as f:
            assert f.wait() == 1, f.output
        assert g.wait() == 4, g.output
        output = g.output
    assert "stage f stopped: it failed:" in output and "the encoder broke at its third batch" in output, output
    assert read_json(folder / "g.json")["status"] == "failed"


# ---------------------------------------------------------------- send_rows: the data owner's loader picks the rows

REORDERED = Path(__file__).resolve().parent / "reordered_stage.py"
SEND_ROWS = "send_rows = true"


def reference_in_order(folder: Path, order, monkeypatch, micro_batches: int = 1) -> dict:
    """The configured run in one process, every epoch's rows taken in ``order(train_rows, epoch)`` (with
    send_rows, the label owner trains on the rows the data owner's loader picks)."""
    from distgrad.config.data import RowBatches
    with monkeypatch.context() as patch:
        patch.setattr(RowBatches, "epoch_order", lambda self, epoch: order(self.train_rows, epoch))
        return reference(folder, micro_batches)


def _own_order_is_not_the_shared_one(folder: Path) -> None:
    from distgrad.run.cut_interface import FIRST, cut_side
    side = cut_side(FIRST, folder / "f-lib.toml", {})
    assert cut_loops.own_order(side.data.train_rows, 0)[:32].tolist() != side.rows(1).tolist()


def test_a_torch_loop_with_its_own_shuffle_and_send_rows_drives_a_label_owner_daemon_bitwise(tmp_path,
                                                                                                monkeypatch):
    folder = write_parties(tmp_path / "p", extra=SEND_ROWS)
    _own_order_is_not_the_shared_one(folder)
    ready = folder / "g.ready"
    with daemon(folder, "g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready) as g:
        cut_loops.data_owner(folder, wait_for_file(ready, g), None, shuffle=True)   # the user's loop: here
        assert g.wait() == 0, g.output
    expected = reference_in_order(folder, cut_loops.own_order, monkeypatch)
    assert expected != reference(folder)
    assert json.loads((folder / "f-params.json").read_text()) == expected["f"]
    assert read_json(folder / "g.json")["params"]["g"] == expected["g"]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_data_owner_daemon_with_send_rows_drives_a_torch_loop_on_the_rows_it_sends(tmp_path, monkeypatch):
    """The daemon's loader walks every epoch backwards (tests/reordered_stage.py): the label owner's loop
    gets those rows as batch.rows and takes their labels."""
    folder = write_parties(tmp_path / "p", extra=SEND_ROWS)
    ready = folder / "g.ready"
    endpoint = free_tcp_endpoint()
    ready.write_text(endpoint)                   # the loop binds where the ready file says
    args = ["f", "--experiment", folder / "f.toml", "--summary", folder / "f.json", "--connect", endpoint,
            "--micro-batches", "2"]
    with StageProcess(args, folder / "f-daemon.log", command=[sys.executable, REORDERED, "--"]) as f:
        cut_loops.label_owner(folder, ready, None)          # the user's loop: this process
        assert f.wait() == 0, f.output
    import reordered_stage
    with monkeypatch.context() as patch:           # the reference as test_send_rows makes it
        patch.setattr(reordered_stage.RowBatches, "epoch_order", reordered_stage.RowBatches.epoch_order)
        reordered_stage.reverse_epochs()
        expected = reference(folder, 2)
    assert expected != reference(folder, 2)
    assert read_json(folder / "f.json")["params"]["f"] == expected["f"]
    result = json.loads((folder / "g-params.json").read_text())
    assert result["params"] == expected["g"] and result["seen"] == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.timeout(180)    # three PyTorch processes; slower beside the rest of the slow set
def test_two_torch_loops_with_send_rows_train_on_the_data_owners_shuffle_bitwise(tmp_path, monkeypatch):
    folder = write_parties(tmp_path / "p", extra=SEND_ROWS)
    result = _two_loops(folder, ("--shuffle",))
    expected = reference_in_order(folder, cut_loops.own_order, monkeypatch)
    assert result["f"] == expected["f"] and result["g"]["params"] == expected["g"]


@pytest.mark.integration
def test_send_rows_between_two_loops_crosses_the_loaders_rows_and_bad_rows_are_refused(tmp_path):
    """The Cut checks what it can (integers, one per row, none twice); the CutServer refuses, as the label
    owner daemon does, a row out of range or held out, naming it, and the step goes on with good rows."""
    folder = write_parties(tmp_path / "p", test_fraction=0.2)
    data = {"kind": "npy", "batch": 4, "test_fraction": 0.2}
    fields = {**FIELDS, "send_rows": True, "steps": 2}
    served = Served(CutServer.bind("tcp://127.0.0.1:*", data={**data, "labels": str(folder / "digits.npy")},
                                   **fields),
                    lambda server: [(b.step, b.rows.tolist(), b.reply(1.0, np.zeros((4, 3), np.float32)))[:2]
                                    for b in server])
    cut = Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0,
                      data={**data, "features": str(folder / "pixels.npy")}, **fields)
    train, held = cut.side.data.train_rows, int(cut.side.data.test_rows[0])
    assert "needs the row numbers" in caught(lambda: cut.step(h_of(1)))
    assert "integers" in caught(lambda: cut.step(h_of(1), np.array([1.0, 2, 3, 4])))
    assert "shape (3,)" in caught(lambda: cut.step(h_of(1), [1, 2, 3]))
    assert "row 2 appears twice" in caught(lambda: cut.step(h_of(1), [1, 2, 2, 3]))
    for bad, text in [([1, 2, 3, 1797], "row 1797 out of range"), ([1, -1, 3, 4], "row -1 out of range"),
                      ([held, *train[:3]], f"row {held} held out for evaluation")]:
        with pytest.raises(PeerRejected, match=text) as info:
            cut.step(h_of(1), bad)
        assert info.value.code == "tensor" and cut.applied == 0
    mine = [train[9], train[2], train[7], train[0]]
    assert cut.step(h_of(1), mine)[0] == np.float32(1.0)
    cut.step(h_of(2), np.array(train[4:8], np.int32))
    cut.close()
    seen, error = served.result()
    assert error is None, error
    assert seen == [(1, [int(r) for r in mine]), (2, [int(r) for r in train[4:8]])]


# ---------------------------------------------------------------- micro-batches, bit for bit on the data owner's side

@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_torch_loop_backwarding_each_micro_batch_trains_bitwise_as_the_daemons_micro_batches(tmp_path):
    """``cut.step([h_0, ..., h_3])``: each micro-batch's own gradient, back-propagated in order and the sum
    scaled by ``cut.scale``, is the daemon data owner's ``--micro-batches 4`` bit for bit."""
    folder = write_parties(tmp_path / "p", extra="micro_batches = 4")
    ready = folder / "g.ready"
    with daemon(folder, "g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready) as g:
        cut_loops.data_owner(folder, wait_for_file(ready, g), None, micro=4)
        assert g.wait() == 0, g.output
    expected = reference(folder, micro_batches=4)
    assert json.loads((folder / "f-params.json").read_text()) == expected["f"]
    assert read_json(folder / "g.json")["params"]["g"] == expected["g"]


# ---------------------------------------------------------------- held-out rows from the data owner's loop

@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_torch_loop_evaluates_with_a_label_owner_daemon_as_the_configured_run(tmp_path):
    """``cut.evaluate`` after every ``eval_every``-th step: the daemon's loss, accuracy, metrics and
    ``keep_best`` verdicts, equal to the configured run's evaluations."""
    folder = write_parties(tmp_path / "p", extra="eval_every = 4", test_fraction=0.2)
    g_file = folder / "g.toml"
    g_file.write_text(g_file.read_text().replace('loss = { type = "CrossEntropyLoss" }\n',
                                                 'loss = { type = "CrossEntropyLoss" }\nmetrics = ["f1"]\n'
                                                 'keep_best = "test_accuracy"\n'))
    ready = folder / "g.ready"
    with daemon(folder, "g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready) as g:
        cut_loops.data_owner(folder, wait_for_file(ready, g), None, evaluates=True)
        assert g.wait() == 0, g.output
    configured = train_in_process(load_experiment([folder / "f.toml", g_file]))
    assert json.loads((folder / "f-params.json").read_text()) == configured["params"]["f"]
    scores = json.loads((folder / "f-evaluations.json").read_text())
    held = load_experiment(folder / "f.toml").build_data(stage="f").test_rows
    assert [s["step"] for s in scores] == [4, 8, 12] and all(s["count"] == len(held) for s in scores)
    assert [(s["step"], s["loss"], s["correct"] / s["count"], s["metrics"]["f1"]) for s in scores] == [
        (e["step"], e["test_loss"], e["test_accuracy"], e["test_f1"]) for e in configured["evaluations"]]
    assert all(isinstance(s["best"], bool) for s in scores) and scores[0]["best"]


@pytest.mark.integration
def test_a_cut_data_owners_hello_announces_the_evaluations_its_loop_makes(tmp_path, caplog):
    """The loop evaluates after every interface eval_every-th step (``evaluation_due``), and its hello says so
    as a daemon data owner's does: a daemon label owner's keep_best then knows it acts (nothing said), and one
    the announced evaluations leave idle is said. Without held-out rows it announces none."""
    import logging
    import zmq
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage

    def hello_of(lib_file: Path):
        cut = Cut.connect("tcp://127.0.0.1:9", lib_file, ctx=zmq.Context.instance())
        hellos: list = []
        cut.link.handshake = lambda hello, client=None: hellos.append(hello) or 0    # what it would send
        try:
            cut._handshake()
        finally:
            cut.link.close(0)
        return hellos[0]

    for every, steps, said in ((4, STEPS, False), (STEPS, STEPS, True)):
        folder = write_parties(tmp_path / str(every), extra=f"eval_every = {every}", test_fraction=0.2)
        with_numpy_stage(folder, "g")
        g_file = folder / "g.toml"
        g_file.write_text(g_file.read_text().replace("loss = ", 'keep_best = "test_loss"\nloss = '))
        hello = hello_of(folder / "f-lib.toml")
        assert hello.body["eval_every"] == every and hello.body["steps"] == steps
        g_exp = load_experiment(g_file)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="distgrad"):
            assert [m.type for _, m in ServingStage(StageOptions(g_exp, "g", 0)).handle([b"f"], hello, 0.0)] == [
                "welcome"]
        warned = [r.getMessage() for r in caplog.records if r.name == "distgrad.config"]
        assert bool(warned) == said and all(f"eval_every = {every} and {steps} steps" in w for w in warned), warned
    folder = write_parties(tmp_path / "none", extra="eval_every = 4")
    assert "eval_every" not in hello_of(folder / "f-lib.toml").body


@pytest.mark.integration
def test_cut_evaluate_against_a_cut_server_gets_its_loops_scores_and_a_wrong_shape_is_misuse(tmp_path):
    folder = write_parties(tmp_path / "p", test_fraction=0.2)
    data = {"kind": "npy", "batch": 4, "test_fraction": 0.2}
    fields = {**FIELDS, "steps": 1}
    seen = []

    def evaluate(h, rows):
        seen.append((h.copy(), rows.copy()))
        return float(h.sum()), 7

    served = Served(CutServer.bind("tcp://127.0.0.1:*", data={**data, "labels": str(folder / "digits.npy")},
                                   evaluate=evaluate, **fields),
                    lambda server: [b.reply(1.0, np.zeros((4, 3), np.float32)) for b in server])
    with Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0,
                     data={**data, "features": str(folder / "pixels.npy")}, **fields) as cut:
        held = cut.test_rows
        h = np.ones((len(held), 3), np.float32)
        assert f"({len(held)}, 3)" in caught(lambda: cut.evaluate(h[:5]))
        assert "float32" in caught(lambda: cut.evaluate(h.astype(np.float64)))
        assert not cut.evaluation_due
        cut.step(h_of(1))
        assert cut.evaluation_due
        assert cut.evaluate(h) == {"loss": float(h.sum()), "correct": 7, "count": len(held)}
        assert cut.evaluate(h.copy()) == {"loss": float(h.sum()), "correct": 7, "count": len(held)}   # a resend
        # Other activations at the same step: the label owner would answer with the first scores (a resend).
        assert "scored after step 1 already" in caught(lambda: cut.evaluate(h * 2))
    _, error = served.result()
    assert error is None, error
    assert len(seen) == 1 and seen[0][0].tolist() == h.tolist() and seen[0][1].tolist() == held.tolist()


# ---------------------------------------------------------------- staleness: a daemon data owner's steps in flight

def _scores(summary: dict) -> list:
    return [(e["step"], e["test_loss"], e["test_accuracy"]) for e in summary["evaluations"]]


def test_a_data_owner_daemon_with_steps_in_flight_drives_a_torch_loop_bitwise(tmp_path):
    """``--staleness 2``: the daemon sends steps k+1..k+3 before it applies k+1; the loop sees each step
    once, in order, and its evaluations (after every 5th step, while steps are in flight) score what the
    configured run's do."""
    folder = write_parties(tmp_path / "p", test_fraction=0.2)
    ready = folder / "g.ready"
    endpoint = free_tcp_endpoint()
    ready.write_text(endpoint)
    with daemon(folder, "f", "--connect", endpoint, "--staleness", "2", "--eval-every", "5") as f:
        cut_loops.label_owner(folder, ready, None, evaluates=True)     # the user's loop: this process
        assert f.wait() == 0, f.output
    configured = train_in_process(load_experiment([folder / "f.toml", folder / "g.toml"]), staleness=2,
                                  eval_every=5)
    assert configured["params"] != reference(folder)
    summary = read_json(folder / "f.json")
    assert summary["params"]["f"] == configured["params"]["f"]
    result = json.loads((folder / "g-params.json").read_text())
    assert result["params"] == configured["params"]["g"] and result["seen"] == list(range(1, STEPS + 1))
    assert _scores(summary) == _scores(configured) and len(_scores(summary)) == 3


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_label_owner_loop_killed_9_under_steps_in_flight_resumes_with_no_step_lost_or_doubled(tmp_path):
    """The loop dies after saving step 5, its reply unsent, with steps 6 and 7 already sent to it; resumed,
    it answers the daemon's resent steps from its checkpoint's replies and computes each step once."""
    folder = write_parties(tmp_path / "p")
    ready = folder / "g.ready"
    ready.write_text(free_tcp_endpoint())
    endpoint = ready.read_text()
    with loop(folder, "g", ready, "--die-before-send", "5") as g:
        with daemon(folder, "f", "--connect", endpoint, "--staleness", "2") as f:
            assert g.wait() == -9, g.output
            with loop(folder, "g", ready, name="g2") as g2:
                assert f.wait() == 0, f.output
                assert g2.wait() == 0, g2.output
    configured = train_in_process(load_experiment([folder / "f.toml", folder / "g.toml"]), staleness=2)
    assert read_json(folder / "f.json")["params"]["f"] == configured["params"]["f"]
    result = json.loads((folder / "g-params.json").read_text())
    assert result["params"] == configured["params"]["g"] and result["seen"] == list(range(1, STEPS + 1))


# ---------------------------------------------------------------- the contract, with both ends in this process

FIELDS = dict(name="cut-unit", stages=["f", "g"], batch=4, activation=[3], steps=3, seed=0)


class Served:
    """``body(server)`` on a thread (the label owner's loop); ``result()`` its value or its exception."""

    def __init__(self, server, body) -> None:
        self.server, self.value, self.error = server, None, None
        self.thread = threading.Thread(target=self._run, args=(body,), daemon=True)
        self.thread.start()

    def _run(self, body) -> None:
        try:
            self.value = body(self.server)
        except BaseException as e:       # handed to the test
            self.error = e
        finally:
            self.server.close()

    def result(self, timeout: float = 20.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server's loop did not end"
        return self.value, self.error


def bind_again(endpoint: str, **fields) -> CutServer:
    """A ``CutServer`` at the endpoint a closed one of this process had: ZeroMQ frees it a moment later."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return CutServer.bind(endpoint, **fields)
        except ConfigError as e:
            if "in use" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def caught(call) -> str:
    with pytest.raises(CutMisuse) as e:
        call()
    return str(e.value)


def h_of(step: int) -> np.ndarray:
    return np.full((4, 3), step, np.float32) + np.arange(12, dtype=np.float32).reshape(4, 3) / 10


@pytest.mark.integration
def test_misuse_on_either_side_is_a_clear_error_and_changes_nothing():
    def body(server):
        errors, batches = {}, iter(server)
        first = next(batches)
        errors["shape"] = caught(lambda: first.reply(0.5, np.zeros((4, 2), np.float32)))
        errors["dtype"] = caught(lambda: first.reply(0.5, np.zeros((4, 3))))
        errors["save"] = caught(server.state_dict)
        # A torch loss that requires grad (a RuntimeError in numpy) and a torch gradient: misuse naming the cure.
        errors["torch loss"] = caught(lambda: first.reply(torch.tensor(0.5, requires_grad=True) * 1,
                                                          np.ones((4, 3), np.float32)))
        errors["torch grad"] = caught(lambda: first.reply(0.5, torch.ones(4, 3)))
        first.reply(0.5, np.ones((4, 3), np.float32))
        errors["twice"] = caught(lambda: first.reply(0.5, np.ones((4, 3), np.float32)))
        next(batches)
        errors["unanswered"] = caught(lambda: next(batches))
        server.batch.reply(0.25, np.ones((4, 3), np.float32))
        next(batches).reply(0.125, np.ones((4, 3), np.float32))
        assert list(batches) == []
        return errors

    served = Served(CutServer.bind("tcp://127.0.0.1:*", **FIELDS), body)
    cut = Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=10.0, **FIELDS)
    assert "shape (4, 2)" in caught(lambda: cut.step(np.zeros((4, 2), np.float32)))
    assert "float32" in caught(lambda: cut.step(np.zeros((4, 3))))
    assert "distgrad.torch takes tensors" in caught(lambda: cut.step(torch.zeros(4, 3, requires_grad=True)))
    assert cut.step(h_of(1))[0] == np.float32(0.5)
    assert "next is 2" in caught(lambda: cut.step(h_of(1), step=1))
    assert cut.step(h_of(2))[0] == np.float32(0.25)
    assert "rows" in str(pytest.raises(ConfigError, cut.rows).value)       # no [data]: no shared order here
    assert cut.step(h_of(3), step=3)[0] == np.float32(0.125)
    cut.close()
    assert "closed" in caught(lambda: cut.step(h_of(4)))
    errors, error = served.result()
    assert error is None, error
    assert "shape (4, 3)" in errors["shape"] and "float32" in errors["dtype"]
    assert "reply first" in errors["save"] and "already" in errors["twice"]
    assert "without replying to step 2" in errors["unanswered"]
    assert "must be one number" in errors["torch loss"] and "loss.item()" in errors["torch loss"]
    assert "distgrad.torch takes tensors" in errors["torch grad"]


# A hang guard, not a speed check: over 10 times the longest bound below (1 s), and well under the 60 s
# default deadline a side that ignored its settings would wait. The messages name the bounds kept.
DEAD_PEER_HANG_GUARD_S = 15.0


@pytest.mark.integration
def test_a_dead_peer_is_a_peer_timeout_on_either_side_within_its_bounds():
    cut = Cut.connect(free_tcp_endpoint(), timeout_s=0.2, peer_deadline_s=1.0, **FIELDS)
    started = time.monotonic()
    with pytest.raises(PeerTimeout, match="no reply from"):
        cut.step(h_of(1))
    assert time.monotonic() - started < DEAD_PEER_HANG_GUARD_S
    cut.close(finished=False)
    with CutServer.bind("tcp://127.0.0.1:*", liveness_s=0.2, peer_deadline_s=0.5, **FIELDS) as server:
        started = time.monotonic()
        with pytest.raises(PeerTimeout, match="silent for more than 0.7 s at step 0"):
            next(iter(server))
        assert time.monotonic() - started < DEAD_PEER_HANG_GUARD_S


@pytest.mark.integration
def test_a_handshake_mismatch_names_the_field_and_both_values():
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=0.5, peer_deadline_s=1.0, **FIELDS),
                    lambda server: list(server))
    cut = Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0,
                      **{**FIELDS, "steps": 4, "gradient_codec": "float16"})
    with pytest.raises(PeerRejected, match="steps: f has 4, g has 3") as refused:
        cut.step(h_of(1))
    # A peer speaking another codec is named with its codec; fields given in code are said to be (not a "file").
    assert "gradient_codec: f has 'float16', g has nothing" in str(refused.value)
    assert ("comes from f's interface given as keyword arguments and g's interface given as keyword arguments"
            in str(refused.value))
    cut.close(finished=False)
    _, error = served.result()       # the refused cut is not its data owner: it tells nothing, but the timeout
    assert isinstance(error, PeerTimeout) and "the last message refused here: hello" in str(error)   # says why
    assert "steps: f has 4, g has 3" in str(error)


@pytest.mark.integration
def test_a_resume_the_other_side_cannot_serve_names_both_steps_and_one_step_behind_gets_the_cached_reply():
    def two_steps(server):
        for batch in server:
            batch.reply(1.0, np.zeros((4, 3), np.float32))
            if batch.step == 2:
                return server.state_dict()

    served = Served(CutServer.bind("tcp://127.0.0.1:*", **FIELDS), two_steps)
    cut = Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **FIELDS)
    start = cut.state_dict()
    cut.step(h_of(1))
    cut.step(h_of(2))
    state, error = served.result()
    assert error is None, error
    cut.close(finished=False)
    seen = []
    served = Served(CutServer.bind("tcp://127.0.0.1:*", state=state, liveness_s=0.5, peer_deadline_s=1.5,
                                   **FIELDS), lambda server: seen.extend(server))
    with Cut.connect(served.server.endpoint, step=0, run=start["run"], timeout_s=1.0, peer_deadline_s=5.0,
                     **FIELDS) as cut:
        with pytest.raises(PeerRejected, match=r"can return to steps \[0\] .* stands at step 2 .*: resume both "
                                               r"sides from checkpoints of the same step"):
            cut.step(h_of(1))
        cut.close(finished=False)
    # One step behind is fine: the label owner's checkpoint holds its reply to step 2, sent again.
    with Cut.connect(served.server.endpoint, step=1, run=start["run"], timeout_s=1.0, peer_deadline_s=5.0,
                     **FIELDS) as cut:
        assert cut.step(h_of(2))[0] == np.float32(1.0) and cut.applied == 2
        cut.close(finished=False)
    _, error = served.result()        # the refused cuts told it nothing; the one it served, that it closed
    assert isinstance(error, PeerAborted) and "closed the cut after step 2 of 3" in str(error)
    assert seen == []                 # its loop computed nothing


@pytest.mark.integration
def test_micro_batches_reach_the_loop_one_by_one_and_come_back_as_the_daemons_combine_them():
    def body(server):
        seen = []
        for batch in server:
            seen.append((batch.step, batch.mb, batch.mbs, batch.last, batch.h.shape))
            batch.reply(float(batch.mb + 1), np.full((2, 3), batch.mb + 1, np.float32))
        return seen, server.scale

    served = Served(CutServer.bind("tcp://127.0.0.1:*", **{**FIELDS, "micro_batches": 2, "steps": 1}), body)
    with Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0,
                     **{**FIELDS, "micro_batches": 2, "steps": 1}) as cut:
        loss, dh = cut.step(h_of(1))
    (seen, scale), error = served.result()
    assert error is None, error
    assert seen == [(1, 0, 2, False, (2, 3)), (1, 1, 2, True, (2, 3))]
    assert scale == np.float32(0.5) and loss == np.float32(1.5)
    assert dh.tolist() == [[0.5] * 3] * 2 + [[1.0] * 3] * 2


@pytest.mark.integration
def test_step_micro_batches_returns_each_micro_batchs_own_gradient_unscaled():
    fields = {**FIELDS, "micro_batches": 2, "steps": 1}
    served = Served(CutServer.bind("tcp://127.0.0.1:*", **fields),
                    lambda server: [b.reply(float(b.mb + 1), np.full((2, 3), b.mb + 1, np.float32)) for b in server])
    with Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **fields) as cut:
        parts = [h_of(1)[:2], h_of(1)[2:]]
        assert "2 micro-batches as a list" in caught(lambda: cut.step_micro_batches(parts[:1]))
        assert "shape (2, 3)" in caught(lambda: cut.step_micro_batches([h_of(1), h_of(1)]))
        loss, grads = cut.step_micro_batches(parts)
    assert error_free(served)
    assert loss == np.float32(1.5) and cut.scale == np.float32(0.5)
    assert [g.tolist() for g in grads] == [[[1.0] * 3] * 2, [[2.0] * 3] * 2]


def error_free(served: "Served") -> bool:
    _, error = served.result()
    assert error is None, error
    return True


@pytest.mark.integration
def test_an_int8_codec_and_curve_work_through_the_library(tmp_path):
    server_public, server_secret = keygen(tmp_path / "server", "g")
    _, client_secret = keygen(tmp_path / "clients", "f")
    fields = {**FIELDS, "activation_codec": "int8", "steps": 1}

    def body(server):
        batches = [(np.array(b.h), b.reply(2.0, np.ones((4, 3), np.float32))) for b in server]
        return batches[0][0]

    served = Served(CutServer.bind("tcp://127.0.0.1:*", curve_secret=server_secret, allow=tmp_path / "clients",
                                   **fields), body)
    with Cut.connect(served.server.endpoint, curve_secret=client_secret, server_key=server_public, timeout_s=1.0,
                     peer_deadline_s=5.0, **fields) as cut:
        assert cut.step(h_of(1))[0] == np.float32(2.0)
    received, error = served.result()
    assert error is None, error
    scale = np.abs(h_of(1)).max(axis=1, keepdims=True) / 127
    assert not np.array_equal(received, h_of(1)) and np.all(np.abs(received - h_of(1)) <= scale / 2 + 1e-7)


@pytest.mark.integration
def test_the_torch_layer_refuses_a_detached_h_and_a_reply_without_a_gradient():
    import distgrad.torch as dt

    def body(server):
        batch = next(iter(server))
        error = caught(lambda: batch.reply(torch.tensor(1.0)))
        batch.h.sum().backward()
        batch.reply(torch.tensor(1.0))
        return error, list(server)

    served = Served(dt.CutServer.bind("tcp://127.0.0.1:*", **{**FIELDS, "steps": 1}), body)
    with dt.Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **{**FIELDS, "steps": 1}) as cut:
        assert "does not require grad" in caught(lambda: cut.step(torch.zeros(4, 3)))
        h = torch.zeros(4, 3, requires_grad=True)
        assert cut.step(h * 2) == 1.0
        assert h.grad.tolist() == [[2.0] * 3] * 4
    (error, rest), failure = served.result()
    assert failure is None, failure
    assert "loss.backward()" in error and rest == []


@pytest.mark.integration
def test_the_torch_layer_backpropagates_micro_batches_of_one_graph_and_refuses_an_h_sent_already():
    """Micro-batches that are the chunks of one encoder(x) share its graph: each gets its gradient (the graph is
    kept until the last backward), not a RuntimeError after the step was applied on both sides. An h that a step
    sent and back-propagated already (its graph freed) is CutMisuse before anything is sent: nothing changes."""
    import distgrad.torch as dt
    fields = {**FIELDS, "micro_batches": 2, "steps": 2}

    def body(server):
        seen = []
        for batch in server:
            (batch.h * (batch.mb + 1)).sum().backward()
            batch.reply(torch.tensor(1.0))
            seen.append((batch.step, batch.mb))
        return seen

    served = Served(dt.CutServer.bind("tcp://127.0.0.1:*", **fields), body)
    with dt.Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **fields) as cut:
        torch.manual_seed(0)
        encoder = torch.nn.Linear(3, 3)
        parts = list(torch.relu(encoder(torch.ones(4, 3))).chunk(2))
        assert cut.step(parts) == 1.0 and cut.applied == 1
        expected = torch.zeros_like(encoder.bias)
        for i, part in enumerate(torch.relu(encoder(torch.ones(4, 3))).chunk(2)):    # each chunk's own gradient
            expected += torch.autograd.grad(part, encoder.bias, torch.full_like(part, i + 1.0), retain_graph=True)[0]
        assert torch.equal(encoder.bias.grad, expected)
        error = caught(lambda: cut.step(parts))
        assert "sent and back-propagated by step 1 already" in error and "encoder(x)" in error
        assert cut.applied == 1
        assert cut.step(list(encoder(torch.ones(4, 3)).chunk(2)), step=2) == 1.0
    seen, failure = served.result()
    assert failure is None, failure
    assert seen == [(1, 0), (1, 1), (2, 0), (2, 1)]


def test_an_own_loop_stage_file_takes_only_the_stage_name_and_refuses_what_the_library_cannot_do(tmp_path):
    from distgrad.run.cut_interface import FIRST, LAST, cut_side
    path = tmp_path / "f.toml"
    path.write_text(_interface() + '[stage]\nname = "f"\nmodule = "encoder:make"\n')
    with pytest.raises(ConfigError, match=r"takes only 'name'"):
        cut_side(FIRST, path, {})
    with pytest.raises(ConfigError, match="cannot keep staleness = 1 steps in flight: a PyTorch loop .* autograd "
                                          "refuses.*distgrad-stage --staleness S"):
        cut_side(FIRST, None, {**FIELDS, "staleness": 1})
    assert cut_side(LAST, None, {**FIELDS, "staleness": 1}).exp.staleness == 1
    # A combined experiment's staleness is part of the interface it gives a party (it was dropped: the label
    # owner's end then disagreed with the daemon data owner's, and a Cut ran it in lockstep).
    combined = tmp_path / "stale-tanh.toml"
    combined.write_text((BUILTIN_DIR / "tanh-regression.toml").read_text()
                        .replace('labels = "last"', 'labels = "last"\nstaleness = 1'))
    assert cut_side(LAST, combined, {}).exp.staleness == 1
    assert cut_side(LAST, combined, {}).exp.interface_parts() == load_experiment(combined).interface_parts()
    with pytest.raises(ConfigError, match="cannot keep staleness = 1 steps in flight"):
        cut_side(FIRST, combined, {})
    with pytest.raises(ConfigError, match="a Cut drives the first stage"):
        cut_side(FIRST, None, {**FIELDS, "stage": "g"})
    with pytest.raises(ConfigError, match="not both"):
        cut_side(FIRST, path, {"batch": 4})
    with pytest.raises(ConfigError, match="give its run id too"):
        Cut(cut_side(FIRST, None, FIELDS), "tcp://127.0.0.1:1", step=2)
    assert cut_side(FIRST, None, FIELDS).exp.interface_parts() == load_experiment_parts(tmp_path)


def load_experiment_parts(tmp_path: Path) -> dict:
    """The interface parts a daemon's stage file with FIELDS' interface gives (a numpy model, no data)."""
    path = tmp_path / "daemon-f.toml"
    path.write_text('[interface]\nname = "cut-unit"\nstages = ["f", "g"]\nbatch = 4\n'
                    'activation = { shape = [3], dtype = "float32" }\nsteps = 3\nseed = 0\n'
                    '[stage]\nname = "f"\nmodel = [{ type = "dense", name = "d", in = 2, out = 3 }]\n'
                    '[data]\nkind = "synthetic_regression"\nfeatures = 2\nbatch = 4\n')
    parts = load_experiment(path).interface_parts()
    return {k: v for k, v in parts.items() if k not in ("rows", "held-out rows", "sample order")}


DOC = Path(__file__).resolve().parents[1] / "docs" / "cut.md"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_docs_example_runs_as_written(tmp_path):
    """docs/cut.md: its files are written, its `# run` block runs in a fresh folder (two PyTorch loops)."""
    from distgrad.run.launcher import pinned_env
    env = pinned_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    files, runs = 0, []
    for lang, body in re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), re.S):
        first = body.split("\n", 1)[0].strip()
        if lang in ("python", "toml") and first.startswith("# ") and first[2:].strip().endswith((".py", ".toml")):
            path = tmp_path / first[2:].strip()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(body)
            files += 1
        elif lang == "sh" and first == "# run":
            runs.append(subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, text=True,
                                       capture_output=True, timeout=170, stdin=subprocess.DEVNULL))
    assert files == 5 and len(runs) == 1
    result = runs[0]
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    assert "data owner: 88 steps" in result.stdout and "label owner: 88 steps" in result.stdout
    loss = float(re.search(r"last loss ([0-9.]+)", result.stdout).group(1))
    assert loss < 1.0, result.stdout
    # Started again with the same command after the run's end, both resume from their last checkpoints (step 88)
    # and end at once, with no step left (the data owner's loop runs no step: its print must still work).
    (tmp_path / "label-owner" / "endpoint").unlink()
    body = [b for lang, b in re.findall(r"```(\w+)\n(.*?)```", DOC.read_text(), re.S) if b.startswith("# run\n")][0]
    again = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout=170, stdin=subprocess.DEVNULL)
    assert again.returncode == 0, f"{again.stdout}\n{again.stderr}"
    assert "data owner: 88 steps, last loss nan" in again.stdout and "label owner: 88 steps" in again.stdout


@pytest.mark.integration
def test_a_label_owner_loop_that_fails_after_replying_sends_no_reply_it_may_not_have_saved():
    """The reply waits for the next batch: a loop failing before it asks (and before it saved) sends no
    reply of the step but tells the data owner why; the data owner resumed at the step before sends the
    step again to the loop resumed there."""
    def failing(server):
        with server:
            for batch in server:
                batch.reply(1.0, np.zeros((4, 3), np.float32))
                raise RuntimeError("the loop failed before saving")

    served = Served(CutServer.bind("tcp://127.0.0.1:*", **FIELDS), failing)
    endpoint, losses = served.server.endpoint, []
    with Cut.connect(endpoint, timeout_s=0.5, peer_deadline_s=30.0, **FIELDS) as cut:
        start = cut.state_dict()
        with pytest.raises(PeerAborted, match="stage g stopped: its loop failed: RuntimeError: the loop failed "
                                              "before saving"):
            cut.step(h_of(1))             # the failed loop's reply to step 1 never left
        assert cut.applied == 0
    assert isinstance(served.result()[1], RuntimeError)
    served = Served(bind_again(endpoint, **FIELDS),
                    lambda server: [batch.reply(2.0, np.zeros((4, 3), np.float32)) or batch.step for batch in server])
    with Cut.connect(endpoint, state=start, timeout_s=0.5, peer_deadline_s=30.0, **FIELDS) as cut:
        losses.extend(float(cut.step(h_of(k))[0]) for k in (1, 2, 3))
    assert losses == [2.0] * 3
    steps, error = served.result()
    assert error is None and steps == [1, 2, 3]


@pytest.mark.integration
def test_a_label_owner_loop_that_fails_while_the_data_owner_resends_tells_it_at_its_fresh_socket():
    """The loop computes past the data owner's timeout_s, so the data owner resends its step on a fresh socket,
    then fails: the data owner is told why in reply to its resent request (PeerAborted), and the loop's
    exception leaves the with block as raised. Before, the notice went only where the data owner had been
    heard (its closed socket), and it waited out its peer deadline (PeerTimeout)."""
    failure = RuntimeError("the loop's own bug")

    def failing(server):
        with server:
            for _ in server:
                time.sleep(0.25)          # the data owner (timeout_s 0.1) resends meanwhile
                raise failure

    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=30.0, peer_deadline_s=30.0, **FIELDS), failing)
    told: list = []

    def data_owner() -> None:
        try:
            with Cut.connect(served.server.endpoint, timeout_s=0.1, peer_deadline_s=30.0, **FIELDS) as cut:
                cut.step(h_of(1))
        except PeerAborted as e:
            told.append(str(e))
    thread = threading.Thread(target=data_owner, daemon=True)
    thread.start()
    assert served.result(timeout=10.0)[1] is failure
    thread.join(10.0)
    assert len(told) == 1 and "stage g stopped: its loop failed: RuntimeError: the loop's own bug" in told[0], told


@pytest.mark.integration
def test_rows_of_another_length_or_order_say_where_they_differ(tmp_path):
    folder = write_parties(tmp_path)
    cut = Cut.connect(free_tcp_endpoint(), interface=folder / "f-lib.toml", timeout_s=0.2, peer_deadline_s=1.0)
    rows, h = cut.rows(1), np.zeros((32, 16), np.float32)
    short = caught(lambda: cut.step(h, rows[:10]))
    assert "given 10 rows" in short and "has 32 for it" in short
    assert "send_rows = true" in short and "its own loader" in short      # the way to use one's own order
    for shaped in (rows.reshape(4, 8), rows.astype(np.float64)):            # the same numbers, not one per row
        assert "one integer per row of h, shape (32,)" in caught(lambda shaped=shaped: cut.step(h, shaped))
    swapped = rows.copy()
    swapped[[3, 4]] = swapped[[4, 3]]
    assert f"position 3 is row {rows[4]}, the order's is {rows[3]}" in caught(lambda: cut.step(h, swapped))
    cut.close(finished=False)


@pytest.mark.integration
def test_the_torch_layer_says_what_to_do_about_a_float64_h_and_a_batch_left_unanswered():
    import distgrad.torch as dt

    def body(server):
        batches = iter(server)
        next(batches)                       # the loop forgets batch.reply
        return caught(lambda: next(batches))

    served = Served(dt.CutServer.bind("tcp://127.0.0.1:*", **FIELDS), body)
    cut = dt.Cut.connect(served.server.endpoint, timeout_s=0.2, peer_deadline_s=1.0, **FIELDS)
    assert "h.float()" in caught(lambda: cut.step(torch.zeros(4, 3, dtype=torch.float64, requires_grad=True)))
    assert "distgrad.cut takes numpy arrays" in caught(lambda: cut.step(np.zeros((4, 3), np.float32)))
    with pytest.raises(PeerAborted, match="closed the CutServer after step 0 of 3"):   # told, not left waiting
        cut.step(torch.zeros(4, 3, requires_grad=True) * 2)
    cut.close(finished=False)
    unanswered, failure = served.result()
    assert failure is None, failure
    assert "call batch.reply first" in unanswered and "grad)" not in unanswered    # the torch reply takes loss only


@pytest.mark.integration
def test_rows_nothing_numbers_are_a_clear_error_not_none():
    """A label owner with no [data] and no send_rows has no row numbers: reading batch.rows says so (None would
    index labels[None] silently), and the batch can still be answered."""
    import distgrad.torch as dt

    def body(server):
        batch = next(iter(server))
        message = caught(lambda: batch.rows)
        batch.h.sum().backward()
        batch.reply(0.0)
        return message

    served = Served(dt.CutServer.bind("tcp://127.0.0.1:*", **FIELDS), body)
    cut = dt.Cut.connect(served.server.endpoint, timeout_s=2.0, peer_deadline_s=5.0, **FIELDS)
    cut.step(torch.zeros(4, 3, requires_grad=True) * 2)
    cut.close(finished=False)
    message, failure = served.result()
    assert failure is None, failure
    assert "nothing numbers" in message and "send_rows" in message and "[data]" in message


@pytest.mark.integration
def test_a_combined_experiment_is_an_interface_and_agrees_with_its_split_stage_files(tmp_path):
    """interface= may name a combined experiment (a built-in's name or its file; stage= picks the party, by
    default the first or the last stage): the hello is the daemons' for that experiment, so a loop given the
    built-in's name shakes hands with a loop given the stage file `distgrad split` writes, and steps. The
    built-in digits scales its pixels (feature_scale), which the data owner's loop of its own does itself: its
    end refuses it with the reason (the label owner's takes the [data] without it, as distgrad split writes
    it); the digits file without feature_scale is an interface like the built-in's."""
    from distgrad.config.split import split_experiment
    from distgrad.run.cut_interface import FIRST, LAST, cut_side
    with pytest.raises(ConfigError, match="sets feature_scale.*your loop reads its own features"):
        cut_side(FIRST, "digits", {})
    digits = load_experiment("digits")
    assert cut_side(LAST, "digits", {}).exp.interface_parts() == digits.interface_parts()
    unscaled = tmp_path / "digits-unscaled.toml"
    unscaled.write_text(Path(digits.source).read_text().replace("feature_scale = 0.0625\n", "").replace(
        '"../datasets/digits.npz"', f'"{DIGITS_NPZ}"'))
    assert "feature_scale" not in unscaled.read_text()
    assert cut_side(FIRST, unscaled, {}).exp.interface_parts() == digits.interface_parts()   # the same interface
    for name in ("tanh-regression", unscaled):
        exp = load_experiment(name)
        assert cut_side(FIRST, name, {}).exp.interface_parts() == exp.interface_parts()
        assert cut_side(LAST, exp.source, {}).stage == exp.stage_names[-1]
        assert cut_side(FIRST, name, {"stage": exp.stage_names[0]}).stage == exp.stage_names[0]
    with pytest.raises(ConfigError, match="no stage 'h'"):
        cut_side(FIRST, "digits", {"stage": "h"})
    with pytest.raises(ConfigError, match="only stage="):
        cut_side(FIRST, "digits", {"steps": 3})
    from distgrad.config.tomlfile import read_toml
    g_file = split_experiment(load_experiment("tanh-regression"), tmp_path / "parties")[-1]
    g_table = {**read_toml(g_file, "stage file"), "stage": {"name": "g"}}     # the loop's model replaces its own

    def body(server):
        for batch in server:
            batch.reply(0.5, np.ones_like(batch.h))
            return batch.step, batch.h.shape

    served = Served(CutServer.bind("tcp://127.0.0.1:*", interface=g_table), body)
    cut = Cut.connect(served.server.endpoint, interface="tanh-regression", timeout_s=2.0, peer_deadline_s=5.0)
    shape = cut_side(FIRST, "tanh-regression", {}).shape
    loss, dh = cut.step(np.zeros(shape, np.float32))
    cut.close(finished=False)
    (step, h_shape), failure = served.result()
    assert failure is None, failure
    assert (float(loss), step, h_shape) == (0.5, 1, shape) and np.array_equal(dh, np.ones(shape, np.float32))


def test_a_torch_loops_evaluate_result_reaches_the_numpy_layers_checks():
    """distgrad.torch hands what the loop's evaluate returns to distgrad.cut's checks: tensors of one
    number as numbers (a count of rows right as an int, also a float tensor of a whole count), anything else
    as it is, so a result that is not (loss, correct) is CutMisuse naming it, not an unpacking error."""
    from distgrad.run.cut_server import evaluation_scores
    from distgrad.torch import _evaluate_tensors

    def scored(result):
        return evaluation_scores(_evaluate_tensors(lambda h, rows: result)(np.ones((2, 3), np.float32),
                                                                            np.arange(2)), 2)

    loss = torch.tensor(0.1, dtype=torch.float32)
    assert scored((loss, torch.tensor(2))) == {"loss": float(np.float32(0.1)), "correct": 2, "count": 2}
    assert scored((loss, torch.tensor([True, False]).float().sum()))["correct"] == 1
    assert scored((loss, None))["correct"] is None
    for result, text in [((loss, 1, 2), "must return (loss, correct)"), (loss, "must return (loss, correct)"),
                         ((torch.ones(2), 1), "must be one number"), ((loss, torch.tensor(1.5)), "correct=")]:
        assert text in caught(lambda: scored(result)), result


@pytest.mark.integration
def test_a_reply_keeps_the_gradient_the_loop_gave_when_the_loop_reuses_one_array_for_every_gradient():
    """A loop that writes each micro-batch's gradient into one array it keeps (no allocation per step) and
    gives it to ``batch.reply``: the reply kept for a resend (here in the saved state, sent again to a data
    owner resumed one step behind) holds what the gradient was when it was replied, not the array's later
    values. (The reply's array used to be the loop's own, kept by reference.)"""
    fields = {**FIELDS, "micro_batches": 2, "steps": 1}

    def reused(server):
        grad = np.empty((2, 3), np.float32)
        for batch in server:
            grad[...] = batch.mb + 1                 # the same array for every micro-batch
            batch.reply(float(batch.mb + 1), grad)
            if batch.last:
                grad[...] = -1                       # and written again once the step is done
                return server.state_dict()

    # The loop ends with the step: the server waits liveness_s for a bye that never comes (short here).
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=0.5, peer_deadline_s=5.0, **fields), reused)
    cut = Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **fields)
    start = cut.state_dict()
    first = cut.step(h_of(1))
    state, error = served.result()
    assert error is None, error
    cut.close(finished=False)
    assert first[1].tolist() == [[0.5] * 3] * 2 + [[1.0] * 3] * 2     # each micro-batch's, scaled by 1/2
    served = Served(CutServer.bind("tcp://127.0.0.1:*", state=state, liveness_s=0.5, peer_deadline_s=1.5,
                                   **fields), lambda server: list(server))
    with Cut.connect(served.server.endpoint, step=0, run=start["run"], timeout_s=1.0, peer_deadline_s=5.0,
                     **fields) as cut:
        again = cut.step(h_of(1))                    # answered from the kept replies, computed once
        cut.close(finished=False)
    served.result()
    assert again[0] == first[0] and again[1].tolist() == first[1].tolist()


@pytest.mark.integration
def test_a_step_that_is_not_an_integer_of_the_run_is_refused_by_rows_and_batch_sampler_at_once(tmp_path):
    """cut.rows(step) takes an integer step of the run (a numpy integer too), not 1.5 (a TypeError deep in the
    data) or True (read as step 1); batch_sampler refuses a start that is not a step when it is built, not
    when a DataLoader first iterates it (its len() counting a step 0 meanwhile)."""
    import distgrad.torch as dt
    folder = write_parties(tmp_path / "parties")
    cut = dt.Cut.connect(free_tcp_endpoint(), interface=folder / "f-lib.toml")
    try:
        assert torch.equal(cut.rows(np.int64(2)), cut.rows(2))
        for step in (0, STEPS + 1, 1.5, True):
            with pytest.raises(ConfigError, match=f"step {step!r} is not a step of this run"):
                cut.rows(step)
        for start in (0, -5, 1.5, True, STEPS + 2):
            with pytest.raises(ConfigError, match=f"start={start!r} is not a step"):
                dt.batch_sampler(cut, start=start)
        assert len(dt.batch_sampler(cut, start=STEPS + 1)) == 0 and list(dt.batch_sampler(cut, start=STEPS)) == [
            cut.rows(STEPS).tolist()]
    finally:
        cut.close(finished=False)
    # A resume point read back as a numpy integer (e.g. from an array of the user's checkpoint) is a step too.
    import uuid
    resumed = dt.Cut.connect(free_tcp_endpoint(), interface=folder / "f-lib.toml", step=np.int64(2),
                             run=uuid.uuid4().hex)
    try:
        assert resumed.applied == 2 and type(resumed.applied) is int and len(dt.batch_sampler(resumed)) == STEPS - 2
    finally:
        resumed.close(finished=False)
    with pytest.raises(ConfigError, match="an integer from 0 to"):
        dt.Cut.connect(free_tcp_endpoint(), interface=folder / "f-lib.toml", step=2.0, run=uuid.uuid4().hex)


@pytest.mark.integration
def test_the_torch_server_goes_on_serving_after_the_loop_handles_a_batch_left_unanswered():
    """distgrad.torch's CutServer is its own iterator, as distgrad.cut's is: a loop that catches the CutMisuse
    of asking before replying, replies, and asks again gets the next step, not a StopIteration that ends its loop
    mid-run (a generator ends for good once an error leaves it)."""
    import distgrad.torch as dt

    def body(server):
        batches = iter(server)
        first = next(batches)
        error = caught(lambda: next(batches))
        first.h.sum().backward()
        first.reply(0.0)
        served = [first.step]
        for batch in batches:
            batch.h.sum().backward()
            batch.reply(0.0)
            served.append(batch.step)
        return error, served

    served = Served(dt.CutServer.bind("tcp://127.0.0.1:*", **FIELDS), body)
    with dt.Cut.connect(served.server.endpoint, timeout_s=1.0, peer_deadline_s=5.0, **FIELDS) as cut:
        for _ in range(FIELDS["steps"]):
            cut.step(torch.ones(4, 3, requires_grad=True) * 1)
    (error, steps), failure = served.result()
    assert failure is None, failure
    assert "call batch.reply first" in error and steps == [1, 2, 3]


def test_the_torch_cut_names_its_run_and_interface_so_a_loop_can_resume_with_step_and_run():
    """docs/cut.md: ``Cut.connect(..., step=k, run=RUN_ID)`` resumes run ``cut.run_id``; the torch layer takes
    ``step=`` and ``run=`` as the numpy one does, so its ``Cut`` names its run (and its interface, ``cut.exp``,
    as the numpy loops of the docs read ``cut.exp.steps``) too. Before, both were missing from it
    (AttributeError), and only ``state_dict()`` held the run id."""
    import distgrad.torch as dt

    endpoint = free_tcp_endpoint()           # nothing is sent: the handshake is the first step's
    first = dt.Cut.connect(endpoint, **FIELDS)
    assert first.run_id == first.state_dict()["run"] and first.exp.steps == FIELDS["steps"]
    again = dt.Cut.connect(endpoint, step=2, run=first.run_id, **FIELDS)
    assert (again.applied, again.run_id) == (2, first.run_id)
    assert len(dt.batch_sampler(again)) == again.exp.steps - 2 == 1
    server = dt.CutServer.bind("tcp://127.0.0.1:*", **FIELDS)
    assert server.exp.interface_fingerprint == first.state_dict()["interface"]
    for cut in (first, again):
        cut.close(finished=False)
    server.close()


# Slow (about a second of waits): the default test_a_dead_peer_is_a_peer_timeout_on_either_side_within_its_bounds
# covers the same wait for a batch and its PeerTimeout.
@pytest.mark.slow
@pytest.mark.integration
def test_a_label_owner_loop_computing_past_its_bounds_still_waits_its_bounds_for_the_next_batch():
    """The silence that makes a ``PeerTimeout`` counts from when the loop asks for its next batch: while the
    loop computed, its data owner waited for the reply (no resend here: its timeout_s is long). Before, the
    loop's computing time counted as the data owner's silence, so a loop slower than ``liveness_s +
    peer_deadline_s`` got a ``PeerTimeout`` at the first poll after sending its reply, although the data owner
    was live and about to send the next step (a single data owner's server; the server of several counted
    from the ask already). The same holds for a loop asking again after a ``PeerTimeout``."""
    def body(server):
        for batch in server:
            if batch.step == 1:
                time.sleep(0.6)            # longer than liveness_s + peer_deadline_s = 0.4 s
            batch.reply(1.0, np.zeros((4, 3), np.float32))
        return server.step

    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=0.2, peer_deadline_s=0.2, **FIELDS), body)
    with Cut.connect(served.server.endpoint, timeout_s=5.0, peer_deadline_s=10.0, **FIELDS) as cut:
        for k in range(1, FIELDS["steps"] + 1):
            cut.step(h_of(k))
            time.sleep(0.15)               # the data owner's own computing before its next step
    steps, error = served.result()
    assert error is None and steps == FIELDS["steps"], error
