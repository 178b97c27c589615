"""kill -9 of the label owner of several clients at the moments where a SplitFed average or a client's step
could be lost or repeated: the run still ends bitwise equal to the uninterrupted one.

The serving stage checkpoints a round of an average only once the average is computed, with each client's
replies of that round (its backward replies and the average), and a restarted serving stage answers a client
that resends one of them from that checkpoint (and scores an evaluation after that round sent again while every
client is still away). These tests kill it at chosen points, held by gates
(tests/gated_stage.py), not by timing; the stress variant kills it at many points under CPU load.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import read_json
from test_clients import CLIENTS, Clients, _reference

STEPS = 40


def _restart_run(tmp_path: Path, stage_group, steps: int = STEPS):
    """The label owner and three clients of digits-splitfed, every one checkpointing every 10 steps with
    ``--resume``; the endpoint's socket is ``tmp_path/g.sock``."""
    run = stage_group(Clients, tmp_path, "digits-splitfed", steps, f"ipc://{tmp_path}/g.sock", "--timeout", "0.5",
                      "--peer-deadline", "30")
    # A long --liveness: a client held at a gate while g waits for it is not dropped, however slow the machine.
    run.args["g"] += ["--checkpoint-dir", tmp_path / "g-ckpt", "--checkpoint-every", "10", "--resume",
                      "--liveness", "60"]
    return run


def _kill_and_restart_g(run) -> None:
    """SIGKILL the serving stage and start it again with its plain command line (no gate)."""
    run.procs["g"].signal(signal.SIGKILL)
    assert run.procs["g"].wait(10) == -signal.SIGKILL, f"g ended before the kill:\n{run.logs()}"
    run.commands.pop("g", None)
    run.start("g")


def _assert_equals_the_uninterrupted_run(tmp_path: Path, run, steps: int = STEPS) -> None:
    run.wait_all(120)
    assert "resumed run" in run.logs()
    reference = _reference(tmp_path, "digits-splitfed", "--steps", str(steps))["params"]
    for name in [*CLIENTS, "g"]:
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference[name], name


def _phase(endpoint: str, zmq_ctx) -> tuple[str, int]:
    """The phase and step a pong of the serving stage names (("", 0) when none came within a second: a ping
    sent before the connection was made is dropped, and the caller asks again)."""
    from distgrad.errors import PeerTimeout
    from distgrad.wire import messages as wire
    from distgrad.wire.transport import Client

    client = Client(zmq_ctx, endpoint)
    try:
        pong = client.request(wire.Message(wire.PING, "", 0), 1.0).body
        return pong["phase"], pong["step"]
    except PeerTimeout:
        return "", 0
    finally:
        client.close(linger_ms=0)


def test_killed_between_the_checkpoint_of_an_average_round_and_its_replies(tmp_path, stage_group):
    """g is killed right after it wrote its checkpoint of step 30, a step of an average, before any reply
    of that average left: every client, waiting for it, sends its parameters again to the restarted g,
    which answers from the checkpoint. (A checkpoint taken before the average made the restarted g skip
    that average: each client kept its own parameters of step 30.)"""
    run = _restart_run(tmp_path, stage_group)
    held = tmp_path / "g-held-after-30.gate"
    run.gate("g", "--hold-after-save", 30, held)
    run.start("g")
    for name in CLIENTS:
        run.start(name)
    run.wait_until(lambda: held.exists(), "g to write its checkpoint of step 30", timeout=90)
    _kill_and_restart_g(run)
    _assert_equals_the_uninterrupted_run(tmp_path, run)


def test_killed_while_waiting_for_the_last_client_of_an_average(tmp_path, stage_group, zmq_ctx):
    """g is killed in the average of step 30 while client 2 (held at a gate) has not yet sent its
    parameters: the restarted g resumes before that average (step 20) and every client goes back there.
    (A checkpoint taken at the end of the round, before the average, let the restarted g resume after the
    round and skip its average.)"""
    run = _restart_run(tmp_path, stage_group)
    gate = tmp_path / "f2-average-30.gate"
    run.gate("f@2", "--average-gate", 30, gate)
    run.start("g")
    for name in CLIENTS:
        run.start(name)
    endpoint = f"ipc://{tmp_path}/g.sock"
    # In an average the pong names the rounds before it: 29 for the average of step 30.
    run.wait_until(lambda: _phase(endpoint, zmq_ctx) == ("averaging", 29), "g to wait for the average of step 30",
                   timeout=90)
    _kill_and_restart_g(run)
    gate.touch()
    _assert_equals_the_uninterrupted_run(tmp_path, run)


def _resend_after_restart(tmp_path: Path, start_server, zmq_ctx, experiment: str, last: str) -> None:
    """Raw protocol clients run 2 steps against g (checkpoints every step); ``last`` ("forward" or
    "average") is client 2's last request of step 2. Its reply read, g is killed and restarted with the
    same command line; the request sent again (as if that reply had been lost) gets the same reply."""
    from conftest import hello_message

    from distgrad.config.parse import load_experiment
    from distgrad.wire import messages as wire
    from distgrad.wire.transport import Client

    exp = load_experiment(experiment)
    bind = f"ipc://{tmp_path}/g.sock"
    args = ("--steps", "4", "--checkpoint-dir", tmp_path / "g-ckpt", "--checkpoint-every", "1", "--resume",
            "--peer-deadline", "30")
    proc, endpoint = start_server(experiment, *args, bind=bind)
    ones = {name: np.ones(shape, np.float32) for name, (shape, _) in _client_params(exp).items()}
    clients = [Client(zmq_ctx, endpoint) for _ in range(3)]
    runs = [f"raw{c}" for c in range(3)]
    shape = tuple(hello_message(exp, "r").body["activation"]["shape"])
    try:
        for c, client in enumerate(clients):
            client.send(hello_message(exp, runs[c], client=c, micro_batches=1, steps=4))
        for c, client in enumerate(clients):
            assert client.wait(runs[c], {(0, 0)}, 10.0).type == wire.WELCOME
        last_request = last_reply = None
        for step in (1, 2):
            for c, client in enumerate(clients):
                activation = np.full(shape, 0.01 * (c + step), np.float32)
                client.send(wire.Message(wire.FORWARD, runs[c], step, 0, 1, tensors={"activation": activation}))
                reply = client.wait(runs[c], {(step, 0)}, 10.0)
                assert reply.type == wire.BACKWARD, reply.body
                last_request = wire.Message(wire.FORWARD, runs[c], step, 0, 1, tensors={"activation": activation})
                last_reply = reply
            if last == "average" and step % exp.clients.average_every == 0:
                for c, client in enumerate(clients):
                    client.send(wire.Message(wire.AVERAGE, runs[c], step, tensors={
                        name: value * (c + 1) for name, value in ones.items()}))
                for c, client in enumerate(clients):
                    reply = client.wait(runs[c], {(step, 0)}, 10.0)
                    assert reply.type == wire.AVERAGE, reply.body
                    last_request = wire.Message(wire.AVERAGE, runs[c], step, tensors={
                        name: value * (c + 1) for name, value in ones.items()})
                    last_reply = reply
        deadline = time.monotonic() + 30
        while not any(path.name.endswith("000000002.ckpt") for path in (tmp_path / "g-ckpt").glob("g-*")):
            assert time.monotonic() < deadline, proc.output
            time.sleep(0.01)
        proc.proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        (tmp_path / "g.ready").unlink()
        proc, endpoint = start_server(experiment, *args, bind=bind, name="g")
        client = Client(zmq_ctx, endpoint)
        clients.append(client)
        again = client.request(last_request, 10.0)
        assert (again.type, again.run, again.step, again.mb, again.mbs) == (
            last_reply.type, last_reply.run, last_reply.step, last_reply.mb, last_reply.mbs), again.body
        assert again.body.get("loss") == last_reply.body.get("loss")
        assert sorted(again.tensors) == sorted(last_reply.tensors)
        for name, value in last_reply.tensors.items():
            assert np.array_equal(again.tensors[name], value) and again.tensors[name].dtype == value.dtype, name
        assert "resumed run" in proc.output
    finally:
        for client in clients:
            client.close(linger_ms=0)


def _client_params(exp) -> dict:
    from distgrad.stage.stage import Stage

    stage = Stage.from_experiment(exp, exp.stage_names[0], exp.seed, {})
    return {name: (value.shape, value.dtype) for name, value in stage.params.items()}


@pytest.mark.parametrize("experiment,last", [("digits-clients", "forward"), ("digits-splitfed", "average")])
def test_a_request_of_the_checkpointed_step_sent_again_to_the_restarted_g_gets_the_same_reply(
        tmp_path, start_server, zmq_ctx, experiment, last):
    """The last reply of a step (a client's backward of its last micro-batch, or its average) is lost when g
    is killed after its checkpoint of that step and before the reply reached the client, which sends the
    request again: the restarted g, before any hello, answers it from the checkpoint with the same reply."""
    if last == "average":
        path = tmp_path / "every2.toml"
        text = (Path(__file__).parent.parent / "distgrad" / "experiments" / "digits-splitfed.toml").read_text()
        path.write_text(text.replace("average_every = 10", "average_every = 2").replace(
            '"../datasets/digits.npz"', repr(str(Path(__file__).parent.parent / "distgrad" / "datasets" /
                                                 "digits.npz"))))
        experiment = str(path)
    _resend_after_restart(tmp_path, start_server, zmq_ctx, experiment, last)


def _reached(endpoint: str, zmq_ctx, step: int, averaging: bool) -> bool:
    """g's pong says it is at or past the round after ``step`` (``averaging``: at or past that round's
    average). A round's turns and its average both report the rounds done before it."""
    phase, done = _phase(endpoint, zmq_ctx)
    return phase != "" and (done, phase == "averaging") >= (step, averaging)


@pytest.mark.slow
@pytest.mark.parametrize("repeat", range(3))
@pytest.mark.parametrize("step,averaging", [(18, False), (19, False), (19, True), (20, False),
                                            (28, False), (29, False), (29, True), (30, False)])
def test_the_label_owner_killed_anywhere_near_an_average_under_load_changes_nothing(
        tmp_path, stage_group, zmq_ctx, step, averaging, repeat):
    """Stress: g killed -9 as soon as its pong says it reached a point around the average and checkpoint of
    step 20 or 30 (``step``: the rounds done; ``averaging``: in the next round's average), with a busy
    process on every core competing with the stages, so that the kill lands anywhere near there. Restarted
    with the same command line, the run ends bitwise equal to the uninterrupted one."""
    steps = 60
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
            for _ in range(os.cpu_count() or 2)]
    try:
        run = _restart_run(tmp_path, stage_group, steps)
        run.start("g")
        for name in CLIENTS:
            run.start(name)
        endpoint = f"ipc://{tmp_path}/g.sock"
        run.wait_until(lambda: _reached(endpoint, zmq_ctx, step, averaging), f"g to reach step {step}", timeout=90)
        _kill_and_restart_g(run)
        _assert_equals_the_uninterrupted_run(tmp_path, run, steps)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(10)


def test_the_replies_of_a_step_come_back_from_a_checkpoint_file_bit_for_bit(tmp_path):
    """No sockets: the replies ``kept_replies`` keeps (backward replies of two micro-batches with coded
    tensors of several dtypes, and an average) pass a real checkpoint file and come back identical, in their
    tensors' order; those of another step are not kept."""
    from distgrad.run import kept_replies
    from distgrad.run.peers import Peer
    from distgrad.stage import checkpoint
    from distgrad.wire import messages as wire

    rng = np.random.default_rng(0)
    peers = [Peer(c, run=f"run{c}") for c in range(3)]
    coded = {"values": rng.standard_normal((32, 4)).astype(np.float16), "indices": np.arange(128, dtype=np.int32),
             "scale": np.float32(0.5) * np.ones((), np.float32)}
    for mb in range(2):
        peers[1].cached[(7, mb)] = wire.Message(wire.BACKWARD, "run1", 7, mb, 2, body={"loss": 0.1 * (mb + 1),
                                                "compute_s": 1e-3}, tensors={k: v + mb for k, v in coded.items()})
    peers[0].cached[(6, 0)] = wire.Message(wire.BACKWARD, "run0", 6, 0, 1, body={"loss": 1.0},
                                           tensors={"g": np.ones(3, np.float32)})
    mean = {"f1.W": rng.standard_normal((4, 4)).astype(np.float32), "f1.b": np.zeros(4, np.float32)}
    for peer in (peers[0], peers[2]):
        peer.averaged = wire.Message(wire.AVERAGE, peer.run, 7, tensors=mean)
    path = checkpoint.save(tmp_path, "g", "r", 7, "fp", kept_replies.kept_arrays(peers, 7), {})
    back = [Peer(c, run=f"run{c}") for c in range(3)]
    assert [p.index for p in kept_replies.restore(back, checkpoint.load(path).arrays, 7)] == [0, 1, 2]
    assert back[0].cached == {} and back[1].averaged is None
    for ours, theirs in [(back[1].cached[(7, mb)], peers[1].cached[(7, mb)]) for mb in range(2)] + [
            (back[0].averaged, peers[0].averaged), (back[2].averaged, peers[2].averaged)]:
        assert (ours.type, ours.run, ours.step, ours.mb, ours.mbs, ours.body) == (
            theirs.type, theirs.run, theirs.step, theirs.mb, theirs.mbs, theirs.body)
        assert list(ours.tensors) == list(theirs.tensors)
        for name, value in theirs.tensors.items():
            assert ours.tensors[name].dtype == value.dtype and np.array_equal(ours.tensors[name], value), name
        assert [bytes(f) for f in wire.encode(ours)] == [bytes(f) for f in wire.encode(theirs)]


@pytest.mark.parametrize("experiment,step", [("digits-splitfed", 30), ("digits-clients", 20)])
def test_killed_after_the_checkpoint_before_the_evaluations_of_its_step(tmp_path, stage_group, experiment, step):
    """Clients evaluate every 10 steps; g is killed right after its checkpoint of ``step``, before the
    evaluations of that step (and, SplitFed, the average's replies) are answered. Each client sends its
    ``evaluate`` again to the restarted g, which scores it with the parameters of that step, as the
    uninterrupted run does: every client's evaluations and parameters are those of the uninterrupted run."""
    run = stage_group(Clients, tmp_path, experiment, STEPS, f"ipc://{tmp_path}/g.sock", "--timeout", "0.5",
                      "--peer-deadline", "30")
    run.args["g"] += ["--checkpoint-dir", tmp_path / "g-ckpt", "--checkpoint-every", "10", "--resume"]
    for name in CLIENTS:
        run.args[name] += ["--eval-every", "10"]
    held = tmp_path / "g-held.gate"
    run.gate("g", "--hold-after-save", step, held)
    run.start("g")
    for name in CLIENTS:
        run.start(name)
    run.wait_until(lambda: held.exists(), f"g to write its checkpoint of step {step}", timeout=90)
    _kill_and_restart_g(run)
    run.wait_all(120)
    reference = _reference(tmp_path, experiment, "--steps", str(STEPS), "--eval-every", "10")
    for c, name in enumerate(CLIENTS):
        summary = read_json(tmp_path / f"{name}.json")
        assert summary["params"][name] == reference["params"][name], name
        ours = [(e["step"], e["test_loss"]) for e in summary["evaluations"]]
        theirs = [(e["step"], e["test_loss"]) for e in reference["clients"][c]["evaluations"]]
        assert ours == theirs, name
