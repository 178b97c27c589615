"""Chains of three and four stages: one process per stage, bitwise equal to the composed model.

A middle stage serves the stage above it and connects to the stage below;
these tests run real processes over tcp and ipc, kill a middle stage and
restart it, and check every stage's parameters against ``--in-process``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import StageGroup, free_tcp_endpoint, read_json, read_lines, run_cli, run_launcher, run_main
from distgrad.config.parse import load_experiment

CHAINS = {"chain-regression": ["f", "m", "g"], "chain4-classify": ["f", "m1", "m2", "g"]}


_references: dict[tuple[str, ...], dict] = {}


def _reference(tmp_path: Path, experiment: str, *flags: str) -> dict:
    """``distgrad run EXPERIMENT --in-process FLAGS`` params (memoised: several tests share one)."""
    key = (experiment, *flags)
    if key not in _references:
        path = tmp_path / f"reference-{experiment}.json"
        result = run_main(["run", experiment, "--in-process", "--summary", path, *flags])
        assert result.returncode == 0, result.stderr
        _references[key] = read_json(path)["params"]
    return _references[key]


@pytest.mark.parametrize("experiment,transport,flags", [
    ("chain-regression", "tcp", []),
    ("chain-regression", "ipc", ["--micro-batches", "4", "--schedule", "gpipe"]),
    ("chain4-classify", "tcp", ["--micro-batches", "2", "--schedule", "1f1b"]),
    ("chain4-classify", "ipc", []),
])
def test_chain_run_equals_the_composed_model_in_one_process(tmp_path, experiment, transport, flags):
    summary_path = tmp_path / "run.json"
    result = run_launcher(["run", experiment, "--transport", transport, "--summary", summary_path, "--steps", "60",
                           *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(summary_path)
    assert sorted(summary["params"]) == sorted(CHAINS[experiment])
    assert summary["params"] == _reference(tmp_path, experiment, "--steps", "60", *flags[:2])
    assert summary["mode"] == f"{len(CHAINS[experiment])}-process"
    for name in CHAINS[experiment]:
        assert f"[{name}]" in result.stdout


def test_secure_chain_equals_the_composed_model(tmp_path):
    summary_path = tmp_path / "run.json"
    result = run_launcher(["run", "chain-regression", "--secure", "--summary", summary_path, "--steps", "40"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_json(summary_path)["params"] == _reference(tmp_path, "chain-regression", "--steps", "40")


def test_chain_trace_equals_the_in_process_trace(tmp_path):
    """And each stage writes its own metrics: a middle stage its steps, its learning rate and the
    loss it passes up."""
    run_launcher(["run", "chain4-classify", "--steps", "5", "--trace", tmp_path / "two.jsonl", "--metrics",
                  tmp_path / "m.jsonl"])
    run_main(["run", "chain4-classify", "--steps", "5", "--in-process", "--trace", tmp_path / "one.jsonl"])
    assert read_lines(tmp_path / "two.jsonl") == read_lines(tmp_path / "one.jsonl")
    losses = [line["loss"] for line in read_lines(tmp_path / "m.jsonl")]
    cuts = load_experiment("chain4-classify").cuts
    for index, name in enumerate(("m1", "m2", "g"), start=1):
        lines = read_lines(tmp_path / f"m.{name}.jsonl")
        assert [(line["step"], line["lr"]) for line in lines] == [(t, pytest.approx(0.003)) for t in range(1, 6)]
        assert [line["loss"] for line in lines] == losses, name
        if name == "g":
            assert not any("bytes_sent" in line for line in lines)      # no link below the last stage
            continue
        # A middle stage counts its link to the stage below, as the driving stage counts its own: each step
        # at least the activation it sends down and the gradient it gets back.
        tensor = 4 * int(np.prod(cuts[index]))
        for before, after in zip(lines, lines[1:]):
            assert after["bytes_sent"] - before["bytes_sent"] >= tensor, name
            assert after["bytes_received"] - before["bytes_received"] >= tensor, name


class Chain(StageGroup):
    """Every stage of one chain run as its own process, each restartable with its original command line."""

    def __init__(self, tmp_path: Path, experiment: str, steps: int, endpoints: dict[str, str],
                 resume: bool = True) -> None:
        super().__init__(tmp_path)
        self.names = CHAINS[experiment]
        common = ["--experiment", experiment, "--steps", str(steps), "--checkpoint-dir", tmp_path / "ckpt",
                  "--checkpoint-every", "20", "--timeout", "0.5", "--peer-deadline", "30", "--liveness", "3"]
        if resume:
            common.append("--resume")
        for i, name in enumerate(self.names):
            bind = ["--bind", endpoints[name]] if i > 0 else []
            connect = ["--connect", endpoints[self.names[i + 1]]] if i + 1 < len(self.names) else []
            self.args[name] = [name, *bind, *connect, "--summary", tmp_path / f"{name}.json", *common]
        # The trace counts and orders the steps; one small parameter keeps a line short (all: 130 KB).
        self.args[self.names[0]] += ["--trace", tmp_path / "trace.jsonl", "--trace-params", "f1.b"]

    def start_all(self) -> None:
        for name in reversed(self.names):
            self.start(name)

    def wait_for_step(self, target: int) -> None:
        self.wait_until(lambda: self.lines("trace.jsonl") >= target, f"step {target}")

    def finish(self) -> dict[str, dict]:
        self.wait_all()
        return {name: read_json(self.tmp / f"{name}.json") for name in self.names}


@pytest.mark.parametrize("experiment,victim,transport,resume", [
    ("chain-regression", "m", "tcp", True),
    pytest.param("chain4-classify", "m1", "ipc", True, marks=pytest.mark.slow),   # m2's kill covers chain4
    ("chain4-classify", "m2", "tcp", False),       # restarted from scratch: every stage goes back to step 0
])
def test_killing_a_middle_stage_and_restarting_it_changes_nothing(tmp_path, stage_group, experiment, victim, transport,
                                                                   resume):
    steps = 300
    names = CHAINS[experiment]
    endpoints = {name: free_tcp_endpoint() if transport == "tcp" else f"ipc://{tmp_path}/{name}.sock"
                 for name in names[1:]}
    chain = stage_group(Chain, tmp_path, experiment, steps, endpoints, resume=resume)
    chain.start_all()
    for fraction in (0.2, 0.6):
        chain.wait_for_step(int(steps * fraction) + 10)     # between two checkpoints (every 20): a rollback too
        chain.kill_9_and_restart(victim)
    summaries = chain.finish()
    reference = _reference(tmp_path, experiment, "--steps", str(steps))
    for name in names:
        assert summaries[name]["params"][name] == reference[name], name
        assert summaries[name]["steps"] == steps
    steps_traced = [line["step"] for line in read_lines(tmp_path / "trace.jsonl")]
    assert steps_traced == list(range(1, steps + 1))     # no lost or doubled step
    assert chain.starts[victim] == 3
    if resume:
        assert "resumed run" in chain.logs()



# test_a_middle_stage_whose_stage_below_never_answers_tells_the_driver_why covers the same path by default (a
# middle stage's reason for a silent stage below reaches a driver of the same bounds); these freeze a running chain.
@pytest.mark.slow
@pytest.mark.parametrize("experiment,frozen", [("chain-regression", "g"), ("chain4-classify", "g"),
                                               ("chain4-classify", "m2")])
def test_a_stage_frozen_below_a_middle_stage_is_named_in_the_drivers_error(tmp_path, stage_group, experiment,
                                                                           frozen):
    """SIGSTOP of a stage two or three levels below the driver, every stage with the same bounds (peer deadline
    3 s): the driver exits 4 with the reason of the stage right above the frozen one, naming the frozen one;
    it named the stage below it (exit 3), having given up before that stage's own wait ended."""
    import signal

    names = CHAINS[experiment]
    chain = stage_group(Chain, tmp_path, experiment, 100_000, {name: free_tcp_endpoint() for name in names[1:]},
                        resume=False)
    for args in chain.args.values():
        args[args.index("--peer-deadline") + 1] = "3"
    chain.start_all()
    chain.wait_for_step(20)
    chain.procs[frozen].signal(signal.SIGSTOP)
    try:
        code = chain.procs[names[0]].wait(60)
    finally:
        chain.procs[frozen].signal(signal.SIGCONT)
    output = chain.procs[names[0]].output
    above = names[names.index(frozen) - 1]
    assert code == 4, output
    # As that stage said it: a stage in between passes a reason up unchanged (not as its refusal).
    assert f"error aborted: stage {above} stopped: stage '{frozen}' did not answer" in output, output

def test_a_refusal_below_a_middle_stage_reaches_the_driver(tmp_path, start_server):
    """g runs another seed than f and m: the mismatch found by g comes up through m, exit 4."""
    _, g_endpoint = start_server("chain-regression", "--seed", "7", name="g")
    m, m_endpoint = start_server("chain-regression", "--connect", g_endpoint, stage="m", name="m")
    result = run_cli(["stage", "f", "--experiment", "chain-regression", "--connect", m_endpoint, "--timeout", "2",
                      "--peer-deadline", "5"])
    assert result.returncode == 4, result.stderr
    assert "stage g refused hello" in result.stderr and "seed" in result.stderr
    assert m.proc.poll() is None                      # the middle stage keeps serving


def test_a_middle_stage_whose_stage_below_never_answers_tells_the_driver_why(tmp_path, start_server):
    """Nothing serves below m: m gives up after its own deadline and answers the driver's pending hello (and
    its resends) with why, naming the endpoint below, so the driver exits 4 with that reason; it waited out
    its own deadline and asked whether m was running (exit 3). With the same bounds on both (as ``distgrad
    run`` gives them), the driver waits past its own deadline for m's reason (link.RELAY_GRACE_S): m's wait
    began after the driver's, and the driver gave up first, naming m as the stage that did not answer."""
    below = free_tcp_endpoint()
    m, m_endpoint = start_server("chain-regression", "--connect", below, "--timeout", "1", "--peer-deadline", "2",
                                 stage="m", name="m")
    result = run_cli(["stage", "f", "--experiment", "chain-regression", "--connect", m_endpoint, "--timeout", "1",
                      "--peer-deadline", "2"])
    assert result.returncode == 4, result.stderr
    assert f"error aborted: stage m stopped: no reply from {below}" in result.stderr, result.stderr
    assert "stage m stopped: no reply from" in m.output     # and m says so itself (it exits 3 afterwards)


@pytest.mark.parametrize("args,needle", [
    (["m", "--bind", "tcp://127.0.0.1:*"], "is the middle stage of 'chain-regression'"),
    (["m", "--connect", "tcp://127.0.0.1:5"], "give --bind ENDPOINT and --connect ENDPOINT"),
    (["m", "--bind", "tcp://127.0.0.1:*", "--connect", "tcp://127.0.0.1:5", "--micro-batches", "2"],
     "are for the driving stage"),
    (["m", "--bind", "tcp://127.0.0.1:*", "--connect", "tcp://127.0.0.1:5", "--curve-secret", "x"],
     "CURVE needs --curve-secret and --allow and --server-key together"),
])
def test_middle_stage_usage_errors_exit_2(args, needle):
    result = run_main(["stage", *args, "--experiment", "chain-regression"])
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr



def test_a_link_that_gives_up_names_the_stage_below_that_welcomed_it(zmq_ctx):
    """A stage below that welcomed the hello and then stops answering (frozen, or itself waiting on a
    stage further down) is named in the error with its endpoint: in a chain over tcp the endpoint alone
    does not say which stage froze."""
    import threading

    import zmq

    from distgrad.errors import PeerTimeout
    from distgrad.wire import messages as wire
    from distgrad.wire.link import DownstreamLink, LinkSettings
    from handshake import hello_message

    router = zmq_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    done = threading.Event()

    def stage_m2_that_freezes_after_its_welcome() -> None:
        while not done.is_set():
            if router.poll(50):
                envelope, *frames = router.recv_multipart()
                msg = wire.decode(frames)
                if msg.type == wire.HELLO:
                    router.send_multipart([envelope, *wire.encode(wire.Message(
                        wire.WELCOME, msg.run, 0, body={"stage": "m2", "next_step": 1}))])

    below = threading.Thread(target=stage_m2_that_freezes_after_its_welcome, daemon=True)
    below.start()
    link = DownstreamLink(LinkSettings("m1", timeout_s=0.2, liveness_s=1.0, peer_deadline_s=0.8),
                          f"tcp://127.0.0.1:{port}", lambda: None, zmq_ctx, None, None)
    try:
        hello = hello_message(load_experiment("chain4-classify"), "0123456789abcdef")
        assert link.handshake(hello) == 0
        forward = wire.Message(wire.FORWARD, hello.run, 1)
        link.send(forward)
        with pytest.raises(PeerTimeout) as raised:
            link.await_reply({(1, 0): forward}, (1, 0))
    finally:
        done.set()
        below.join(5)
        link.close(0)
        router.close(0)
    assert "stage 'm2' did not answer" in str(raised.value)
    assert f"tcp://127.0.0.1:{port}" in str(raised.value)
