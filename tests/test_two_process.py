"""Two real stage processes over real sockets end bitwise equal to one process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import zmq

from distgrad.run.launcher import pinned_env

from conftest import (BIN, CLI, StageProcess, hello_message, read_json, read_lines, run_cli, run_launcher, run_main,
                      wait_for_file)

LABELS_AT_F = """
name = "labels-at-f"
steps = 40
seed = 3
labels = "first"
[data]
kind = "synthetic_regression"
samples = 256
features = 3
outputs = 2
batch = 16
[[stages]]
name = "f"
model = [{ type = "dense", name = "a", in = 3, out = 8 }, { type = "relu" }]
optimizer = { type = "adam", lr = 0.01 }
[[stages]]
name = "g"
model = [{ type = "dense", name = "b", in = 8, out = 2 }, { type = "sigmoid" }]
optimizer = { type = "sgd", lr = 0.1 }
loss = "sum_squared_error"
"""


# Learning-rate schedules on both stages, each changing within 40 steps (and within 20 -> 40, after a resume).
SCHEDULED = """
name = "scheduled"
steps = 40
seed = 3
[data]
kind = "synthetic_regression"
samples = 256
features = 3
outputs = 2
batch = 16
[[stages]]
name = "f"
model = [{ type = "dense", name = "a", in = 3, out = 8 }, { type = "tanh" }]
[stages.optimizer]
type = "adam"
lr = 0.02
schedule = { type = "cosine", decay_steps = 30, alpha = 0.1, warmup_steps = 5 }
[[stages]]
name = "g"
model = [{ type = "dense", name = "b", in = 8, out = 2 }]
optimizer = { type = "sgd", schedule = { type = "piecewise", boundaries = [15, 25], values = [0.1, 0.03, 0.01] } }
loss = "mean_squared_error"
"""


def _in_process(tmp_path, experiment, *extra, trace=True):
    summary = tmp_path / "inproc.json"
    trace_path = tmp_path / "inproc.trace.jsonl"
    result = run_main(["run", experiment, "--in-process", "--summary", summary,
                      *(["--trace", trace_path] if trace else []), *extra])
    assert result.returncode == 0, result.stderr
    return read_json(summary), read_lines(trace_path) if trace else None


# tanh-regression's full trace is 54 KB a step, written, merged and compared: 100 of its 300 steps here
# (its whole run is compared over tcp and ipc, without a trace, in test_spin_before_block_leaves_the_run...).
TRACED_STEPS = {"seed-reverse": [], "tanh-regression": ["--steps", "100"]}


# ipc is slow here: the spin test compares whole runs over tcp and ipc in the default suite.
@pytest.mark.parametrize("transport", ["tcp", pytest.param("ipc", marks=pytest.mark.slow)])
@pytest.mark.parametrize("experiment", sorted(TRACED_STEPS))
def test_launcher_run_is_bitwise_equal_to_in_process(tmp_path, experiment, transport):
    steps = TRACED_STEPS[experiment]
    reference, reference_trace = _in_process(tmp_path, experiment, *steps)
    summary_path, trace_path = tmp_path / "run.json", tmp_path / "run.trace.jsonl"
    result = run_launcher(["run", experiment, "--transport", transport, "--summary", summary_path, "--trace",
                           trace_path, *steps])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary_path)
    assert summary["mode"] == "two-process" and summary["transport"] == transport
    assert set(summary["params"]) == {"f", "g"}
    # JSON floats hold float32 values exactly, so == is a bitwise comparison here.
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]
    assert summary["steps"] == reference["steps"]
    assert summary["elapsed_s"] > 0 and summary["experiment"] == experiment
    trace = read_lines(trace_path)
    assert trace == reference_trace
    assert "activation_grad" in trace[0]["grads"] and "loss" in trace[0]


def test_labels_travelling_with_the_activations(tmp_path):
    exp = tmp_path / "labels-at-f.toml"
    exp.write_text(LABELS_AT_F)
    reference, _ = _in_process(tmp_path, str(exp), trace=False)
    summary_path = tmp_path / "run.json"
    result = run_launcher(["run", exp, "--summary", summary_path])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_json(summary_path)["params"] == reference["params"]


def test_a_scheduled_run_is_bitwise_equal_to_in_process_and_resumes_mid_schedule(tmp_path):
    from distgrad.stage.checkpoint import load as load_checkpoint
    from distgrad.config.parse import load_experiment, parse_experiment
    from distgrad.run.inprocess import train_in_process

    path = tmp_path / "scheduled.toml"
    path.write_text(SCHEDULED)
    exp = load_experiment(path)
    ck = tmp_path / "ck"
    common = ["run", path, "--checkpoint-dir", ck, "--checkpoint-every", "10", "--resume"]
    first = run_cli([*common, "--steps", "20", "--summary", tmp_path / "first.json"])
    assert first.returncode == 0, first.stdout + first.stderr
    assert read_json(tmp_path / "first.json")["params"] == train_in_process(exp, steps=20)["params"]
    for stage in ("f", "g"):
        (newest,) = ck.glob(f"{stage}-*-000000020.ckpt")
        assert load_checkpoint(newest).arrays["opt/updates"] == 20
    more = run_cli([*common, "--steps", "40", "--summary", tmp_path / "more.json"])
    assert more.returncode == 0, more.stdout + more.stderr
    resumed, reference = read_json(tmp_path / "more.json"), train_in_process(exp)
    assert resumed["steps"] == 40
    assert resumed["params"] == reference["params"] and resumed["final_loss"] == reference["final_loss"]
    unscheduled = train_in_process(parse_experiment(exp.raw | {"stages": [
        {**stage, "optimizer": {"type": stage["optimizer"]["type"], "lr": 0.02}} for stage in exp.raw["stages"]]}))
    assert unscheduled["params"] != reference["params"], "the schedules should change the run"


def test_stages_started_by_hand_write_summary_and_trace(tmp_path):
    """The two commands a user types in two terminals, on 127.0.0.1."""
    reference, reference_trace = _in_process(tmp_path, "seed-reverse", "--steps", "200", "--init", "fW=0.01,gW=-0.02")
    ready = tmp_path / "ready"
    common = ["--experiment", "seed-reverse", "--steps", "200", "--init", "fW=0.01,gW=-0.02"]
    g_args = ["g", "--bind", "tcp://127.0.0.1:*", "--ready-file", ready,
              "--summary", tmp_path / "g.json", "--trace", tmp_path / "g.jsonl", *common]
    with StageProcess(g_args, tmp_path / "g.log") as g:
        endpoint = wait_for_file(ready, g)
        assert endpoint.startswith("tcp://127.0.0.1:")
        f = StageProcess(["f", "--connect", endpoint, "--summary", tmp_path / "f.json",
                          "--trace", tmp_path / "f.jsonl", *common], tmp_path / "f.log")
        with f:
            assert f.wait() == 0, f.output
        assert g.wait() == 0, g.output          # one run by default: g exits after the bye
    f_summary, g_summary = read_json(tmp_path / "f.json"), read_json(tmp_path / "g.json")
    assert f_summary["params"] == {"f": reference["params"]["f"]}
    assert g_summary["params"] == {"g": reference["params"]["g"]}
    for s in (f_summary, g_summary):
        assert s["experiment"] == "seed-reverse" and s["steps"] == 200 and s["status"] == "completed"
        assert s["final_loss"] == reference["final_loss"]
    f_trace, g_trace = read_lines(tmp_path / "f.jsonl"), read_lines(tmp_path / "g.jsonl")
    assert len(f_trace) == len(g_trace) == 200
    for f_line, g_line, ref in zip(f_trace, g_trace, reference_trace):
        assert set(f_line["params"]) == {"fW"} and set(g_line["params"]) == {"gW"}
        assert f_line["params"]["fW"] == ref["params"]["fW"] and g_line["params"]["gW"] == ref["params"]["gW"]
        assert g_line["grads"]["activation_grad"] == ref["grads"]["activation_grad"]


def test_console_scripts_are_installed():
    assert (BIN / "distgrad").exists() and (BIN / "distgrad-stage").exists()


def test_driver_without_a_server_exits_3_naming_the_endpoint(tmp_path):
    endpoint = "tcp://127.0.0.1:9"      # discard port: nothing listens there
    with StageProcess(["f", "--experiment", "seed-reverse", "--connect", endpoint, "--timeout", "0.5",
                       "--peer-deadline", "1"],
                      tmp_path / "f.log") as f:
        # A hang guard, not a speed check: 30 s is 30 times the 1 s deadline, start-up included, and half the
        # 60 s default a driver that ignored --peer-deadline would wait. The message names the 1 s it kept.
        code = f.wait(30)
    assert code == 3
    assert endpoint in f.output and "no reply" in f.output and "gave up after retrying for 1 s" in f.output


def test_server_gives_up_on_a_lost_client_and_exits_3(start_server, tmp_path, zmq_ctx):
    g, endpoint = start_server("seed-reverse", "--liveness", "0.5", "--peer-deadline", "0.5")
    from distgrad.wire import messages as wire
    from distgrad.config.parse import load_experiment
    from distgrad.wire.transport import Client

    client = Client(zmq_ctx, endpoint)
    assert client.request(hello_message(load_experiment("seed-reverse"), "r1"), 5).type == wire.WELCOME
    # Client went silent: a clear error, not a hang. The wait's bound is a hang guard, not a speed check:
    # 30 s is 30 times the 1 s of --liveness plus --peer-deadline, and half the 60 s default deadline.
    assert g.wait(30) == 3
    assert "silent for more than 0.5 s" in g.output and "giving up" in g.output


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signals_stop_a_serving_stage_cleanly(start_server, signum, code):
    g, _ = start_server("seed-reverse")
    g.signal(signum)
    assert g.wait(10) == code
    assert "stopped cleanly" in g.output


def _last_progress_step(output: str) -> int:
    """The step of the last whole ``progress`` line a stage wrote with ``--progress lines`` (0 before any)."""
    lines = [line for line in output.splitlines(keepends=True) if line.startswith("progress ") and line.endswith("\n")]
    return json.loads(lines[-1][len("progress "):])["step"] if lines else 0


def test_sigterm_stops_the_driver_mid_run(start_server, tmp_path):
    g, endpoint = start_server("seed-reverse", "--liveness", "1", "--peer-deadline", "0.5",
                               "--summary", tmp_path / "g.json")
    with StageProcess(["f", "--experiment", "seed-reverse", "--connect", endpoint, "--steps", "20000",
                       "--progress", "lines"], tmp_path / "f.log") as f:
        deadline = time.monotonic() + 60                     # a hang guard: ~200 steps take well under 1 s
        while _last_progress_step(f.output) < 200:           # well into the run, far from its end
            assert time.monotonic() < deadline and f.proc.poll() is None, f.output
            time.sleep(0.02)
        f.signal(signal.SIGTERM)
        assert f.wait(10) == 143
    assert g.wait(20) == 3                # the server notices its client is gone
    assert read_json(tmp_path / "g.json")["status"] == "interrupted"


def test_keep_serving_runs_one_run_after_another(start_server, tmp_path):
    g, endpoint = start_server("seed-reverse", "--keep-serving", "--summary", tmp_path / "g.json")
    summaries = []
    for i in range(2):
        with StageProcess(["f", "--experiment", "seed-reverse", "--connect", endpoint, "--steps", "50",
                           "--summary", tmp_path / f"f{i}.json"], tmp_path / f"f{i}.log") as f:
            assert f.wait() == 0, f.output
        summaries.append(read_json(tmp_path / f"f{i}.json"))
    assert summaries[0]["params"] == summaries[1]["params"]   # each run starts from the initial state
    assert summaries[0]["run_id"] != summaries[1]["run_id"]
    assert g.proc.poll() is None                             # still serving
    g.signal(signal.SIGTERM)
    assert g.wait(10) == 143


def test_launcher_checks_the_configuration_before_starting_stages():
    result = run_launcher(["run", "seed-reverse", "--init", "nope=1"])
    assert result.returncode == 2
    assert "unknown parameters ['nope']" in result.stderr
    assert "[g]" not in result.stdout


def _processes_mentioning(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _copy_builtin(tmp_path, name):
    from distgrad.config.experiment import BUILTIN_DIR

    path = tmp_path / f"{name}-{tmp_path.name}.toml"
    path.write_text((BUILTIN_DIR / f"{name}.toml").read_text())
    return path


def test_launcher_stops_the_other_stage_when_one_fails(tmp_path):
    # Weights so large that g's loss overflows: g finds it non-finite and fails (exit 1),
    # f reports g's failure (exit 1, not 4: it sent nothing wrong).
    exp = _copy_builtin(tmp_path, "seed-reverse")
    result = run_launcher(["run", exp, "--init", "fW=1e30,gW=1e30"])
    assert result.returncode == 1
    assert "failed with exit code 1" in result.stderr
    assert "stage g: non-finite loss at step 1" in result.stdout
    # The run's own error carries the stage's words (a reason from below naming the stage at fault).
    assert re.search(r"stage [fg] failed with exit code 1: stage g: non-finite loss at step 1", result.stderr)
    assert _processes_mentioning(str(exp)) == []


def _wait_for(condition, what: str, timeout_s: float) -> None:
    """Return once ``condition()`` is true; fail naming ``what`` after ``timeout_s`` (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def test_ctrl_c_on_the_launcher_leaves_no_process_behind(tmp_path):
    """Ctrl-C once the run is under way (the driver connected to the serving stage, both stages running)."""
    exp = _copy_builtin(tmp_path, "seed-reverse")
    log_path = tmp_path / "launcher.log"
    with open(log_path, "w") as log:
        launcher = subprocess.Popen([*CLI, "run", str(exp), "--steps", "1000000"], stdout=log,
                                    stderr=subprocess.STDOUT, text=True, env=pinned_env(), start_new_session=True)
    try:
        def under_way() -> bool:
            assert launcher.poll() is None, f"the launcher exited {launcher.returncode}:\n{log_path.read_text()}"
            return "connected to stage" in log_path.read_text() and len(_processes_mentioning(str(exp))) >= 3
        _wait_for(under_way, "the driver to connect", 60)
        os.killpg(launcher.pid, signal.SIGINT)      # what Ctrl-C in a terminal does
        assert launcher.wait(15) == 130, log_path.read_text()
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(5)
    # Stages the launcher stopped may be reaped a moment after it exits: wait for that, bounded.
    _wait_for(lambda: _processes_mentioning(str(exp)) == [], "every stage process to end", 15)


# Integer labels at the last stage cross nothing and run in every digits test (test_cnn, test_readme,
# test_vertical): that case is slow-marked; the labels that travel stay in the default suite.
@pytest.mark.parametrize("labels", [pytest.param("last", marks=pytest.mark.slow), "first"])
def test_classifier_with_integer_labels_is_bitwise_equal(tmp_path, labels):
    from distgrad.config.experiment import BUILTIN_DIR

    exp = tmp_path / "mlp.toml"
    exp.write_text((BUILTIN_DIR / "mlp-classify.toml").read_text().replace('labels = "last"', f'labels = "{labels}"'))
    reference, _ = _in_process(tmp_path, str(exp), "--steps", "40", trace=False)
    summary_path = tmp_path / "run.json"
    result = run_launcher(["run", exp, "--steps", "40", "--summary", summary_path])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary_path)
    assert summary["params"] == reference["params"] and summary["final_loss"] == reference["final_loss"]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_spin_before_block_leaves_the_run_bitwise_unchanged(tmp_path, transport):
    reference, _ = _in_process(tmp_path, "tanh-regression", trace=False)
    summary_path = tmp_path / "spin.json"
    result = run_launcher(["run", "tanh-regression", "--transport", transport, "--spin-us", "300",
                           "--summary", summary_path])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary_path)
    assert summary["params"] == reference["params"] and summary["final_loss"] == reference["final_loss"]


@pytest.mark.parametrize("value", ["-1", "20000", "nan"])
@pytest.mark.parametrize("command", [["stage", "g", "--experiment", "seed-reverse", "--bind", "tcp://127.0.0.1:*"],
                                     ["run", "seed-reverse"], ["run", "tanh-regression", "--in-process"]])
def test_spin_time_out_of_range_is_a_usage_error(command, value):
    result = run_main([*command, "--spin-us", value])
    assert result.returncode == 2 and "--spin-us" in result.stderr, result.stderr


def test_an_idle_serving_stage_does_not_spin(monkeypatch, zmq_ctx):
    """The spin runs once per wait (after a message), not on every tick of an idle loop: every receive of
    the serving loop is recorded with the spin it was given, so this holds however busy the machine is."""
    import distgrad
    from distgrad.wire import messages as wire
    from distgrad.wire import transport
    from distgrad.wire.transport import Client

    polls: list[tuple[float, bool]] = []          # (spin_s, whether a message came) of each serving receive
    poll_frames = transport.poll_frames

    def recorded(sock, timeout_s, spin_s=0.0, copy_first=False):
        parts = poll_frames(sock, timeout_s, spin_s, copy_first)
        if sock.type == zmq.ROUTER:                # the serving stage's socket, not the client's
            polls.append((spin_s, parts is not None))
        return parts

    monkeypatch.setattr(transport, "poll_frames", recorded)
    with distgrad.serve_stage("seed-reverse", keep_serving=True, spin_s=0.01) as g:
        _wait_for(lambda: len(polls) >= 3, "three idle ticks", 30)
        client = Client(zmq_ctx, g.endpoint)
        try:
            assert client.request(wire.Message(wire.PING, "", 0), 5.0).type == wire.PONG
        finally:
            client.close(linger_ms=0)
        _wait_for(lambda: len(polls) >= 2 + next(i for i, (_, got) in enumerate(polls) if got),
                  "two ticks after the ping", 30)
    assert [got for _, got in polls].count(True) == 1 and polls[0][0] == 0.0, polls
    for (_, message_before), (spin, _) in zip(polls, polls[1:]):
        assert spin == (0.01 if message_before else 0.0), polls    # spins on the wait after a message only


# The upper bounds on a wait's duration below are hang guards, not speed checks: 5 s is 100 times the
# longest wait asked for (50 ms). The lower bounds hold however busy the machine is.
WAIT_HANG_GUARD_S = 5.0


def test_a_spinning_wait_is_still_bounded_and_still_receives(zmq_ctx):
    from distgrad.wire.transport import poll_frames

    a, b = zmq_ctx.socket(zmq.PAIR), zmq_ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://spin-test")
        b.connect("inproc://spin-test")
        started = time.monotonic()
        assert poll_frames(b, 0.05, spin_s=0.02) is None          # spins 20 ms, then blocks for the rest
        assert 0.04 <= time.monotonic() - started < WAIT_HANG_GUARD_S
        assert b.getsockopt(zmq.RCVTIMEO) <= 30                   # the block got what the spin left, not 50 ms
        started = time.monotonic()
        assert poll_frames(b, 0.01, spin_s=0.05) is None          # the spin counts towards the timeout:
        assert b.getsockopt(zmq.RCVTIMEO) == 0                    # it used all 10 ms, nothing is left to block
        assert time.monotonic() - started < WAIT_HANG_GUARD_S
        a.send_multipart([b"head", b"tail"])
        frames = poll_frames(b, 1.0, spin_s=0.05)
        assert [bytes(f) for f in frames] == [b"head", b"tail"]
    finally:
        a.close(0)
        b.close(0)


def test_a_wait_is_the_receive_itself_bounded_by_the_socket_timeout(zmq_ctx, monkeypatch):
    """poll_frames waits in one blocking receive bounded by RCVTIMEO, without a zmq_poll before it (a poll
    and then a receive cost a few more system calls per message), and still returns None in time."""
    from distgrad.wire import transport

    monkeypatch.setattr(zmq, "zmq_poll", lambda *args: pytest.fail("poll_frames called zmq_poll"))
    set_ = transport._set
    timeouts = []
    monkeypatch.setattr(transport, "_set", lambda sock, option, value: timeouts.append(value) or set_(sock, option,
                                                                                                    value))
    a, b = zmq_ctx.socket(zmq.PAIR), zmq_ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://rcvtimeo-test")
        b.connect("inproc://rcvtimeo-test")
        for _ in range(3):
            started = time.monotonic()
            assert transport.poll_frames(b, 0.05) is None
            assert 0.04 <= time.monotonic() - started < WAIT_HANG_GUARD_S and b.getsockopt(zmq.RCVTIMEO) == 50
        assert timeouts == [50]                         # set when it changes only
        assert transport.poll_frames(b, 0.0) is None and transport.poll_frames(b, -1.0) is None   # no wait
        assert timeouts == [50, 0]
        a.send_multipart([b"head", b"tail"])
        assert [bytes(f) for f in transport.poll_frames(b, 1.0)] == [b"head", b"tail"]
    finally:
        a.close(0)
        b.close(0)


def test_a_received_message_is_read_without_asking_the_socket_per_frame(zmq_ctx, monkeypatch):
    """poll_frames reads whether more frames follow from each Frame, and with ``copy_first`` takes the first
    (a ROUTER's routing id) as bytes; the socket is never asked (a getsockopt runs pyzmq's Python enum code)."""
    from distgrad.wire import transport

    asked = []
    get = transport._get
    monkeypatch.setattr(transport, "_get", lambda sock, option: asked.append(option) or get(sock, option))
    a, b = zmq_ctx.socket(zmq.PAIR), zmq_ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://more-test")
        b.connect("inproc://more-test")
        a.send_multipart([b"id", b"head", b"tail"])
        frames = transport.poll_frames(b, 1.0)
        assert [bytes(f) for f in frames] == [b"id", b"head", b"tail"] and asked == []
        a.send_multipart([b"id", b"head", b"tail"])
        frames = transport.poll_frames(b, 1.0, copy_first=True)
        assert frames[0] == b"id" and [bytes(f) for f in frames[1:]] == [b"head", b"tail"]
        assert asked == []
    finally:
        a.close(0)
        b.close(0)


def assert_ticks_apart(ticks: list[float]) -> None:
    """Consecutive liveness ticks (the ``now`` each was given) are a tick apart or more: never one per message.

    A busy machine only spreads them further; 10% below ``POLL_TICK_S`` allows for the millisecond
    granularity of a receive's timeout. A tick per message would be ~1 ms apart.
    """
    from distgrad.wire.transport import POLL_TICK_S

    gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
    assert all(gap >= 0.9 * POLL_TICK_S for gap in gaps), sorted(gaps)[:5]


def test_a_serving_stage_checks_liveness_once_a_tick_not_per_message(monkeypatch):
    """While messages keep coming, the serving stage's liveness tick runs once per POLL_TICK_S, not once per
    message; a run of many short steps still completes."""
    import distgrad
    from distgrad.run.serving import ServingStage

    ticks = []
    tick = ServingStage.tick
    monkeypatch.setattr(ServingStage, "tick", lambda self, now: ticks.append(now) or tick(self, now))
    with distgrad.serve_stage("seed-reverse") as g:
        summary = distgrad.drive_stage("seed-reverse", g.endpoint, steps=300)
        g.wait()
    assert summary["steps"] == 300
    assert_ticks_apart(ticks)


def test_the_update_after_the_last_reply_is_seen_by_every_later_message(start_server, zmq_ctx):
    """g replies to a step's last micro-batch before applying its update; whatever comes next
    (a ping, a repeated forward, the next step) finds the step applied exactly once."""
    import numpy as np

    from distgrad.wire import messages as wire
    from distgrad.config.parse import load_experiment
    from distgrad.wire.transport import Client

    exp = load_experiment("tanh-regression")
    g, endpoint = start_server("tanh-regression")
    client = Client(zmq_ctx, endpoint)
    run = "reply-first"
    shape = (exp.build_data(exp.seed).feature_shape[0] // 2, 32)
    try:
        assert client.request(hello_message(exp, run, micro_batches=2), 5.0).type == wire.WELCOME

        def forward(step, mb):
            activation = np.full(shape, 0.1 * step + 0.01 * mb, np.float32)
            reply = client.request(wire.Message(wire.FORWARD, run, step, mb, 2, tensors={"activation": activation}), 5.0)
            wire.expect_tensors(reply, {"activation_grad": (shape, np.float32)})     # read as a driver does
            return reply

        forward(1, 0)
        last = forward(1, 1)
        assert client.request(wire.Message(wire.PING, "", 0), 5.0).body["step"] == 1
        again = forward(1, 1)                             # a repeat: the cached reply, no second update
        assert np.array_equal(again.tensors["activation_grad"], last.tensors["activation_grad"])
        assert client.request(wire.Message(wire.PING, "", 0), 5.0).body["step"] == 1
        forward(2, 0)
        forward(2, 1)
        assert client.request(wire.Message(wire.PING, "", 0), 5.0).body["step"] == 2
    finally:
        client.close(linger_ms=0)
