"""A NaN or Inf in a stage's own loss or gradients: nothing applied or checkpointed, exit 1 on every side.

The NaN comes from a labels file (the last stage's own
data), from a stage's gradient computation, or from a reply below.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest
import zmq

from distgrad.wire import messages as wire
from distgrad.api import drive_stage
from distgrad.run.options import StageOptions
from distgrad.errors import NonFiniteError, ProtocolError, StageError
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.stage.engine import StepEngine
from distgrad.run.inprocess import _step, train_in_process
from distgrad.run.serving import PeerStatus, ServingStage
from distgrad.stage.records import read_trace
from distgrad.stage.stage import Stage
from distgrad.wire.messages import ErrorCode, Message

from handshake import only_reply
from conftest import StageProcess, hello_message, read_json, run_launcher, run_main, wait_for_file

BATCH = 8
NAN_STEP_RE = re.compile(r"stage g: non-finite loss at step (\d+)")


def _nan_labels_experiment(tmp_path: Path, chain: bool = False, allow_nonfinite: bool = False) -> Path:
    """A regression on 64 rows whose label 10 is NaN; labels at g (the last stage)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = x.sum(axis=1).astype(np.float32)
    y[10] = np.nan
    np.savez(tmp_path / "nan.npz", x=x, y=y)
    middle = ('[[stages]]\nname = "m"\nmodel = [{ type = "dense", name = "m1", in = 8, out = 8 }, { type = "tanh" }]\n'
              'optimizer = { type = "adam", lr = 0.01 }\n') if chain else ""
    path = tmp_path / "nan.toml"
    path.write_text(f'''name = "nan-labels"
steps = 20
allow_nonfinite = {str(allow_nonfinite).lower()}
[data]
kind = "npz"
path = "nan.npz"
label_dtype = "float32"
test_fraction = 0.0
batch = {BATCH}
[[stages]]
name = "f"
model = [{{ type = "dense", name = "f1", in = 4, out = 8 }}, {{ type = "tanh" }}]
optimizer = {{ type = "adam", lr = 0.01 }}
{middle}[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = 8, out = 1 }}]
optimizer = {{ type = "adam", lr = 0.01 }}
loss = "mean_squared_error"
''')
    return path


def _nan_step(text: str) -> int:
    match = NAN_STEP_RE.search(text)
    assert match, text
    return int(match.group(1))


def _checkpoint_steps(directory: Path, stage: str) -> list[int]:
    from distgrad.stage.checkpoint import steps_on_disk

    return steps_on_disk(directory, stage)


def _assert_failed_summary(path: Path, step: int, stages: tuple[str, ...]) -> None:
    """The summary a run that failed at ``step`` leaves: valid JSON saying it failed and why, the steps applied,
    the last applied step's loss, and every stage's parameters as that step left them."""
    summary = read_json(path)
    assert summary["status"] == "failed" and summary["steps"] == step - 1, summary
    assert f"non-finite loss at step {step}" in summary["error"]
    assert summary["final_loss"] is None if step == 1 else np.isfinite(summary["final_loss"])
    assert sorted(summary["params"]) == sorted(stages)
    assert all(np.isfinite(v).all() for params in summary["params"].values() for v in params.values())


def test_nan_label_in_process_exits_1_naming_stage_step_and_tensor(tmp_path):
    result = run_main(["run", _nan_labels_experiment(tmp_path), "--in-process", "--summary", tmp_path / "s.json"])
    assert result.returncode == 1, result.stderr
    step = _nan_step(result.stderr)
    assert step >= 1 and "Traceback" not in result.stderr
    _assert_failed_summary(tmp_path / "s.json", step, ("f", "g"))


def test_nan_label_python_api_raises_naming_the_stage_and_the_step(tmp_path):
    exp = load_experiment(_nan_labels_experiment(tmp_path))
    with pytest.raises(NonFiniteError, match=r"stage g: non-finite loss at step \d+"):
        train_in_process(exp)


def test_nan_label_over_processes_leaves_g_untouched_and_exits_1(tmp_path):
    """distgrad run: g logs the failure, f reports it (not 'refused'), no NaN checkpoint, exit 1."""
    ckpt = tmp_path / "ckpt"
    result = run_launcher(["run", _nan_labels_experiment(tmp_path), "--checkpoint-dir", ckpt, "--checkpoint-every",
                           "1", "--peer-deadline", "5", "--summary", tmp_path / "s.json",
                           "--trace", tmp_path / "t.jsonl"])
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    step = _nan_step(out)
    _assert_failed_summary(tmp_path / "s.json", step, ("f", "g"))
    traced = [line["step"] for line in read_trace(tmp_path / "t.jsonl")]
    assert traced == list(range(1, step))           # every applied step, merged from both stages
    assert re.search(r"\[g\].*ERROR.*stage g: non-finite loss at step", out), out
    assert re.search(r"\[f\].*ERROR.*stage g: non-finite loss at step", out), out
    assert "refused" not in out and "peer replied with error" not in out
    assert _checkpoint_steps(ckpt, "g")[-1] == step - 1


def test_nan_label_by_hand_both_stages_exit_1_and_g_keeps_its_parameters(tmp_path):
    exp_path = _nan_labels_experiment(tmp_path)
    ready, ckpt = tmp_path / "g.ready", tmp_path / "ckpt"
    common = ["--experiment", exp_path, "--peer-deadline", "5", "--checkpoint-dir", ckpt, "--checkpoint-every", "1"]
    with StageProcess(["g", *common, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready,
                       "--summary", tmp_path / "g.json"], tmp_path / "g.log") as g:
        endpoint = wait_for_file(ready, g)
        with StageProcess(["f", *common, "--connect", endpoint, "--summary", tmp_path / "f.json"],
                          tmp_path / "f.log") as f:
            assert f.wait(30) == 1, f.output
            assert g.wait(30) == 1, g.output
            step = _nan_step(g.output)
            assert _nan_step(f.output) == step and "refused" not in f.output
    summary = read_json(tmp_path / "g.json")
    assert summary["status"] == "failed" and summary["steps"] == step - 1
    _assert_failed_summary(tmp_path / "f.json", step, ("f",))      # the driving stage's own too
    assert all(np.isfinite(v).all() for v in summary["params"]["g"].values())
    assert _checkpoint_steps(ckpt, "g")[-1] == step - 1


def test_nan_label_in_a_chain_ends_every_stage_with_exit_1(tmp_path):
    result = run_launcher(["run", _nan_labels_experiment(tmp_path, chain=True), "--peer-deadline", "5"])
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    _nan_step(out)
    assert re.search(r"\[m\].*ERROR.*stage g: non-finite loss at step", out), out
    assert "peer replied with error" not in out


def test_allow_nonfinite_trains_through_a_nan_label(tmp_path):
    """The documented meaning of allow_nonfinite = true: NaN is accepted and applied, as before."""
    exp = load_experiment(_nan_labels_experiment(tmp_path, allow_nonfinite=True))
    summary = train_in_process(exp)
    assert np.isnan(summary["final_loss"])
    assert summary["status"] == "completed"     # a run in one process says how it ended, as one in processes


def _server(exp) -> ServingStage:
    return ServingStage(StageOptions(exp, exp.stage_names[-1], exp.seed))


def _forward(exp, run: str, step: int) -> Message:
    f = Stage.from_experiment(exp, "f")
    y, _ = f.forward(exp.build_data().features(step))
    return Message(wire.FORWARD, run, step, tensors={"activation": y})


def test_serving_stage_refuses_with_nonfinite_step_and_changes_nothing(tmp_path):
    exp = load_experiment(_nan_labels_experiment(tmp_path))
    step = _nan_step(str(pytest.raises(NonFiniteError, train_in_process, exp).value))
    server = _server(exp)
    server.handle([b"p"], hello_message(exp, "r"), 0.0)
    for s in range(1, step):
        server.handle([b"p"], _forward(exp, "r", s), 0.0)
        server.settle()
    before = {k: v.copy() for k, v in server.stage.params.items()}
    with pytest.raises(ProtocolError) as refused:
        server.handle([b"p"], _forward(exp, "r", step), 0.0)
    assert refused.value.code == ErrorCode.NONFINITE_STEP
    server.settle()
    assert server.stage.step == step - 1
    assert all(np.array_equal(before[k], v) for k, v in server.stage.params.items())
    assert isinstance(server.end_failed_run(), NonFiniteError)


def test_deferred_nan_gradient_is_not_applied_and_is_told_on_the_next_message(monkeypatch):
    """The serving stage computes weight gradients after its reply: a NaN there is caught before the update."""
    exp = load_experiment("tanh-regression")
    server = _server(exp)
    server.handle([b"p"], hello_message(exp, "r"), 0.0)
    real = Stage.loss_micro_batch_deferred

    def nan_grads(self, x, target, mb=0):
        loss, dx, later = real(self, x, target, mb)
        return loss, dx, lambda: {k: np.full_like(v, np.nan) for k, v in later().items()}

    monkeypatch.setattr(Stage, "loss_micro_batch_deferred", nan_grads)
    before = {k: v.copy() for k, v in server.stage.params.items()}
    reply = only_reply(server.handle([b"p"], _forward(exp, "r", 1), 0.0))
    assert reply.type == wire.BACKWARD
    server.settle()
    assert server.stage.step == 0
    assert all(np.array_equal(before[k], v) for k, v in server.stage.params.items())
    with pytest.raises(ProtocolError, match="stage g: non-finite gradient of g2.W at step 1") as told:
        server.handle([b"p"], _forward(exp, "r", 2), 0.0)
    assert told.value.code == ErrorCode.NONFINITE_STEP


def test_nan_activation_gradient_in_process_changes_no_stage(monkeypatch):
    exp = load_experiment("chain-regression")
    stages = [Stage.from_experiment(exp, name) for name in exp.stage_names]
    before = [{k: v.copy() for k, v in s.params.items()} for s in stages]
    real = Stage.backward

    def nan_dx(self, cache, dy, need_dx=True):
        dx, grads = real(self, cache, dy, need_dx)
        return (None if dx is None else np.full_like(dx, np.nan)), grads

    monkeypatch.setattr(Stage, "backward", nan_dx)
    data = exp.build_data()
    with pytest.raises(NonFiniteError, match="stage g: non-finite activation_grad at step 1"):
        _step([StepEngine(s, exp.final_loss.micro_batch_scale) for s in stages], 1, data.features(1),
              data.targets(1), 1)
    for stage, params in zip(stages, before):
        assert stage.step == 0 and all(np.array_equal(params[k], v) for k, v in stage.params.items())


def test_driver_given_a_nan_activation_gradient_fails_as_a_stage_not_a_refusal(zmq_ctx):
    """A reply below carrying NaN: the driver applies nothing and reports a stage failure (exit 1), not 4."""
    exp = load_experiment("tanh-regression")
    router = zmq_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    g = Stage.from_experiment(exp, "g")
    done = threading.Event()

    def fake_g() -> None:
        while not done.is_set():
            if not router.poll(100):
                continue
            frames = router.recv_multipart()
            envelope, msg = frames[:1], wire.decode(frames[1:])     # a DEALER peer: no delimiter
            if msg.type == wire.HELLO:
                reply = Message(wire.WELCOME, msg.run, 0, body={"stage": "g", "next_step": 1})
            else:
                dx = np.full(g.input_shape, np.nan, np.float32)
                reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body={"loss": 1.0},
                                tensors={"activation_grad": dx})
            router.send_multipart(envelope + wire.encode(reply))

    thread = threading.Thread(target=fake_g, daemon=True)
    thread.start()
    try:
        with pytest.raises(StageError, match="stage g: non-finite activation_grad at step 1"):
            # The fake g answers at once; the deadline is a hang guard, generous so a busy machine cannot
            # turn the non-finite reply into a timeout.
            drive_stage(exp, f"tcp://127.0.0.1:{port}", steps=3, timeout_s=2.0, peer_deadline_s=30.0)
    finally:
        done.set()
        thread.join(5)


def test_init_nan_in_an_experiment_file_is_refused_like_the_flag():
    raw = dict(load_experiment("seed-reverse").raw)
    stages = [dict(s) for s in raw["stages"]]
    stages[0]["model"] = [dict(stages[0]["model"][0], init=float("nan"))]
    with pytest.raises(Exception, match="not a finite float32 number"):
        parse_experiment(dict(raw, stages=stages))


def test_several_clients_server_drops_the_client_whose_step_is_nonfinite(monkeypatch):
    """The serving stage of several clients: the failing client hears nonfinite_step (its driver exits 1), nothing is
    applied, and the other clients' steps go on."""
    exp = load_experiment("digits-clients")
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    for c in range(exp.clients.count):
        server.handle([b"peer%d" % c], hello_message(exp, f"run{c}", client=c, micro_batches=1), 0.0)
    real = Stage.loss_micro_batch_deferred

    def nan_loss_for_client_0(self, x, target, mb=0):
        loss, dx, grads_later = real(self, x, target, mb)
        return (np.float32(np.nan) if server.turn == 0 else loss), dx, grads_later

    monkeypatch.setattr(Stage, "loss_micro_batch_deferred", nan_loss_for_client_0)
    before = {k: v.copy() for k, v in server.stage.params.items()}
    firsts = [Stage.from_experiment(exp, "f") for _ in range(exp.clients.count)]
    data = [exp.build_data(client=c) for c in range(exp.clients.count)]
    y0, _ = firsts[0].forward(data[0].features(1))
    (_, refused), = server.handle([b"peer0"], Message(wire.FORWARD, "run0", 1, tensors={"activation": y0}), 0.0)
    assert refused.type == wire.ERROR and refused.body["code"] == ErrorCode.NONFINITE_STEP
    assert "stage g: non-finite loss at step 1" in refused.body["message"]
    assert all(np.array_equal(before[k], v) for k, v in server.stage.params.items())
    assert server.peers[0].status is PeerStatus.DROPPED
    y1, _ = firsts[1].forward(data[1].features(1))
    (_, reply), = server.handle([b"peer1"], Message(wire.FORWARD, "run1", 1, tensors={"activation": y1}), 0.0)
    server.settle()
    assert reply.type == wire.BACKWARD and server.stage.step == 1


def test_a_run_in_one_process_stopped_by_a_signal_writes_a_summary_saying_so(tmp_path):
    """``distgrad run --in-process`` checks for SIGINT/SIGTERM between steps (``check_stop``): the run ends
    there with ``Interrupted`` and its summary says ``stopped``, the steps applied and their parameters."""
    from distgrad.errors import Interrupted

    exp, done = load_experiment("seed-reverse"), []

    def stop_after_three() -> None:
        done.append(1)
        if len(done) == 3:
            raise Interrupted(15)

    with pytest.raises(Interrupted):
        train_in_process(exp, steps=10, summary_path=tmp_path / "s.json", check_stop=stop_after_three)
    summary = read_json(tmp_path / "s.json")
    assert (summary["status"], summary["steps"], summary["error"]) == ("stopped", 3, "stopped by signal 15")
    assert summary["params"] == train_in_process(exp, steps=3)["params"]


def test_a_run_of_several_clients_in_one_process_that_fails_writes_a_summary_saying_so(tmp_path):
    """--in-process with several clients: a non-finite step ends the run with a summary saying ``failed``, the
    rounds completed, each client's last loss in ``clients`` and every process's parameters."""
    with pytest.raises(StageError):
        train_in_process(load_experiment("digits-clients"), steps=5, summary_path=tmp_path / "s.json",
                         init={"g1.W": 1e30})
    summary = read_json(tmp_path / "s.json")
    assert summary["status"] == "failed" and "non-finite" in summary["error"], summary["error"]
    assert summary["steps"] < 5 and [c["client"] for c in summary["clients"]] == [0, 1, 2]
    assert sorted(summary["params"]) == ["f@0", "f@1", "f@2", "g"] and "final_loss" not in summary


def test_a_run_of_several_clients_in_one_process_stops_on_a_signal_between_rounds(tmp_path):
    """``check_stop`` is called after each round too (the CLI's SIGTERM handler would otherwise only set a flag
    nobody reads): the run ends there, its summary saying ``stopped`` after those rounds."""
    from distgrad.errors import Interrupted

    def stop() -> None:
        raise Interrupted(15)

    with pytest.raises(Interrupted):
        train_in_process(load_experiment("digits-clients"), steps=50, summary_path=tmp_path / "s.json",
                         check_stop=stop)
    summary = read_json(tmp_path / "s.json")
    assert (summary["status"], summary["steps"]) == ("stopped", 1)
