"""Several data owners against one label owner: reproducible order, drops and rejoins.

Real processes over real sockets: three first-stage clients, each on its own
shard, and one serving stage that takes their steps in client order. The
results must equal ``--in-process`` bit for bit, whatever order the clients
start in; a client that dies is dropped and the others go on; it rejoins.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from distgrad.config.experiment import BUILTIN_DIR
from distgrad.run.auditing import run_audit

from conftest import StageGroup, free_tcp_endpoint, read_json, read_lines, run_launcher, run_main

GATED_STAGE = [sys.executable, Path(__file__).resolve().parent / "gated_stage.py"]

CLIENTS = ["f@0", "f@1", "f@2"]


def _reference(tmp_path: Path, experiment: str, *flags: str) -> dict:
    path = tmp_path / "reference.json"
    result = run_main(["run", experiment, "--in-process", "--summary", path, *flags])
    assert result.returncode == 0, result.stderr
    return read_json(path)


GUARD = "input_guard = { max_r2 = 1.0, after = 0 }"     # judges every step, never stops (R^2 <= 1)


@pytest.mark.parametrize("experiment,transport,flags", [
    ("digits-clients", "tcp", ["--steps", "60", "--privacy-meter", "--eval-every", "25"]),
    ("digits-splitfed", "ipc", ["--steps", "40", "--micro-batches", "2"]),
])
def test_three_clients_equal_the_in_process_order(tmp_path, experiment, transport, flags):
    """Metered and guarded (digits-clients): as ``_check_client_meters`` says."""
    plain = None
    if "--privacy-meter" in flags:          # and every client guarded
        plain, experiment = experiment, str(tmp_path / "guarded.toml")
        Path(experiment).write_text((BUILTIN_DIR / f"{plain}.toml").read_text().replace(
            '"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/').replace('name = "f"\n', f'name = "f"\n{GUARD}\n'))
    path = tmp_path / "run.json"
    metrics = ["--metrics", str(tmp_path / "m.jsonl"), "--trace", str(tmp_path / "t.jsonl"), "--trace-params",
               "sent_activation,sent_activation_grad"] if plain is not None else []
    result = run_launcher(["run", experiment, "--transport", transport, "--summary", path, *flags, *metrics])
    assert result.returncode == 0, result.stdout + result.stderr
    summary, reference = read_json(path), _reference(tmp_path, experiment, *flags)
    if plain is not None:
        unmetered = _reference(tmp_path, plain, *[f for f in flags if f != "--privacy-meter"])
        _check_client_meters(summary, reference, unmetered, read_lines(tmp_path / "m.g.jsonl"))
        # Each client's lines of the trace hold its views; the audit of each reproduces its meters' first window.
        report = run_audit(experiment, tmp_path / "t.jsonl", first=1, last=25, run_steps=60, window=25)
        for client in CLIENTS:
            labels = summary["label_meters"][client]["label_leaks"][0]
            inputs = summary["input_meters"][client]["input_leaks"][0]
            assert report[f"labels/{client}"]["label_recovery"] == labels["label_recovery"], client
            assert report[f"inputs/{client}"]["distance_correlation"] == inputs["distance_correlation"], client
    assert sorted(summary["params"]) == [*CLIENTS, "g"]
    assert summary["params"] == reference["params"]
    assert summary["params"]["f@0"] != summary["params"]["f@1"] or experiment == "digits-splitfed"
    for ours, theirs in zip(summary["clients"], reference["clients"]):
        assert ours["status"] == "completed"
        for key in ("client", "final_loss", "test_loss", "test_accuracy"):
            assert ours[key] == theirs[key], key
    for client in range(3):
        assert f"client {client}: final loss" in result.stdout


def _check_client_meters(summary: dict, reference: dict, unmetered: dict, label_lines: list[dict]) -> None:
    """Each client's own input meter and guard, and the label owner's meter of each client, named by the client
    (``f@K``): the same figures over processes as in one, windows of the evaluations closed by each client's own
    update, the label owner's in its metrics on that client's line; and the metered, guarded run trains bitwise
    the plain one."""
    assert summary["params"] == unmetered["params"]
    for key, kinds in (("input_meters", ("input_leaks", "input_attacks", "input_leak_extremes", "input_guard")),
                       ("label_meters", ("label_leaks", "label_attacks", "label_leak_extremes"))):
        assert sorted(summary[key]) == CLIENTS, key
        for client in CLIENTS:
            for field in kinds:
                assert summary[key][client][field] == reference[key][client][field], (key, client, field)
            assert [w["step"] for w in summary[key][client][kinds[0]]] == [25, 50, 60], (key, client)
    assert 0 < summary["input_meters"]["f@1"]["input_guard"]["peak_r2"] <= 1
    line = next(line for line in label_lines if line["step"] == 25 and line["client"] == 1)
    assert line["label_recovery"] == summary["label_meters"]["f@1"]["label_leaks"][0]["label_recovery"]
    assert summary["label_meters"]["f@0"]["label_attacks"] != summary["label_meters"]["f@1"]["label_attacks"]


def test_splitfed_clients_hold_the_same_parameters_after_an_average(tmp_path):
    summary = _reference(tmp_path, "digits-splitfed", "--steps", "20")
    assert summary["params"]["f@0"] == summary["params"]["f@1"] == summary["params"]["f@2"]
    separate = _reference(tmp_path, "digits-splitfed", "--steps", "21")
    assert separate["params"]["f@0"] != separate["params"]["f@1"]      # one step after it they differ


class Clients(StageGroup):
    """A serving stage and three clients of one run, each a process with its own log."""

    def __init__(self, tmp_path: Path, experiment: str, steps: int, endpoint: str, *flags: str) -> None:
        super().__init__(tmp_path)
        common = ["--experiment", experiment, "--steps", str(steps), *flags]
        self.args = {"g": ["g", "--bind", endpoint, "--summary", tmp_path / "g.json", *common]}
        for c, name in enumerate(CLIENTS):
            # The traces count and order the steps; one small parameter keeps a line ~2 KB, not 160 KB.
            self.args[name] = ["f", "--client", str(c), "--connect", endpoint, "--summary", tmp_path / f"{name}.json",
                               "--trace", tmp_path / f"{name}.jsonl", "--trace-params", "f1.b",
                               "--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "10", "--resume", *common]

    def steps(self, name: str) -> int:
        return self.lines(f"{name}.jsonl")

    def gate(self, name: str, *gate_args: object) -> None:
        """From its next start, client ``name`` runs through tests/gated_stage.py with ``gate_args``."""
        self.commands[name] = [*GATED_STAGE, *gate_args, "--"]

    def start_all_then_kill(self, name: str, when: str, at_step: int) -> None:
        """Start the serving stage and every client; SIGKILL ``name`` once client ``when`` reached ``at_step``."""
        self.start("g")
        for client in CLIENTS:
            self.start(client)
        self.wait_until(lambda: self.steps(when) >= at_step, f"{when} to reach step {at_step}")
        self.procs[name].signal(signal.SIGKILL)
        assert self.procs[name].wait(10) == -signal.SIGKILL, f"{name} ended before the kill"


def test_the_order_does_not_depend_on_who_comes_first(tmp_path, stage_group):
    """Client 2 says hello first and client 0 last: still the in-process result. The order is made by
    waiting for g to log each hello before the next client starts, not by timing."""
    run = stage_group(Clients, tmp_path, "digits-clients", 30, f"ipc://{tmp_path}/g.sock", "--timeout", "2")
    run.start("g")
    for name in reversed(CLIENTS):
        run.start(name)
        hello = f"client {name[-1]} said hello"
        run.wait_until(lambda: hello in (tmp_path / "g.1.log").read_text(), f"g to log {hello!r}")
    g_log = (tmp_path / "g.1.log").read_text()
    assert g_log.index("client 2 said hello") < g_log.index("client 1 said hello") < g_log.index("client 0 said hello")
    run.wait_all()
    reference = _reference(tmp_path, "digits-clients", "--steps", "30")["params"]
    for name in [*CLIENTS, "g"]:
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference[name], name


def test_a_dead_client_is_dropped_the_others_go_on_and_it_rejoins(tmp_path, stage_group):
    """Client 1 is killed; g drops it and clients 0 and 2 go on; restarted, it rejoins and all finish.
    The order is kept by gates (tests/gated_stage.py), not by timing: clients 0 and 2 wait before step
    ``hold`` until g has logged client 1's rejoin, and the new client 1 is started at once, waiting (its
    imports done) for the test to let it begin, so that 0 and 2 wait at most its hello, well under
    --liveness, however fast or slow the machine."""
    steps, hold = 200, 180
    rejoined, restart = tmp_path / "rejoined.gate", tmp_path / "restart.gate"
    run = stage_group(Clients, tmp_path, "digits-clients", steps, free_tcp_endpoint(), "--timeout", "1",
                      "--liveness", "1", "--peer-deadline", "30")
    for name in ("f@0", "f@2"):
        run.gate(name, "--step-gate", hold, rejoined)
    run.start_all_then_kill("f@1", when="f@1", at_step=40)
    run.gate("f@1", "--start-gate", restart)
    run.start("f@1")                                       # the same command line (--resume), held at the gate
    run.wait_until(lambda: "client 1 silent" in run.logs(), "g to drop client 1")
    at_drop = run.steps("f@0")
    assert at_drop + 20 < hold, at_drop
    run.wait_until(lambda: run.steps("f@0") >= at_drop + 20 and run.steps("f@2") >= at_drop + 20,
                   "clients 0 and 2 to go on without client 1")
    restart.touch()
    run.wait_until(lambda: "client 1 rejoins" in (tmp_path / "g.1.log").read_text(), "g to take client 1 back")
    rejoined.touch()
    run.wait_all()
    g_log = run.logs()
    assert "client 1 rejoins" in g_log and "resumed run" in g_log and "the serving stage goes on with this client" in g_log
    summary = read_json(tmp_path / "g.json")
    assert [c["status"] for c in summary["clients"]] == ["completed"] * 3
    assert [c["steps"] for c in summary["clients"]] == [steps] * 3
    rejoined = [line["step"] for line in read_lines(tmp_path / "f@1.jsonl")]
    assert rejoined == sorted(set(rejoined)) and rejoined[-1] == steps        # skipped steps, none twice
    assert len(rejoined) < steps
    for name in ("f@0", "f@2"):
        assert [line["step"] for line in read_lines(tmp_path / f"{name}.jsonl")] == list(range(1, steps + 1))


@pytest.mark.parametrize("args,needle", [
    (["f", "--connect", "tcp://127.0.0.1:5"], "give --client 0 to 2"),
    (["f", "--client", "3", "--connect", "tcp://127.0.0.1:5"], "give --client 0 to 2"),
    (["g", "--client", "1", "--bind", "tcp://127.0.0.1:*"], "--client is for the first stage"),
    (["g", "--bind", "tcp://127.0.0.1:*", "--keep-serving"], "--keep-serving is not supported"),
])
def test_client_usage_errors_exit_2(args, needle):
    result = run_main(["stage", *args, "--experiment", "digits-clients"])
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


def test_a_client_index_out_of_range_in_a_hello_is_refused(tmp_path, start_server, zmq_ctx):
    from distgrad.wire import messages as wire
    from distgrad.config.parse import load_experiment
    from distgrad.wire.transport import Client
    from distgrad.errors import PeerRejected
    from conftest import hello_message

    _, endpoint = start_server("digits-clients")
    exp = load_experiment("digits-clients")
    client = Client(zmq_ctx, endpoint)
    try:
        for bad in (7, -1, "0", None):
            with pytest.raises(PeerRejected, match="client"):
                client.request(hello_message(exp, "r1", client=bad, micro_batches=1), 5.0)
        ping = client.request(wire.Message(wire.PING, "", 0), 5.0)
        assert ping.body["phase"] == "joining"
        # A client naming another client's run id is refused (messages find their client by run id: it would
        # take client 0's turns and replies), and client 0 stays the only one taking part.
        assert client.request(hello_message(exp, "r1", client=0, micro_batches=1), 5.0).type == wire.WELCOME
        with pytest.raises(PeerRejected, match="run 'r1' is client 0's; client 1 needs a run id of its own"):
            client.request(hello_message(exp, "r1", client=1, micro_batches=1), 5.0)
        ping = client.request(wire.Message(wire.PING, "", 0), 5.0)
        assert (ping.body["phase"], ping.body["clients_active"]) == ("joining", 1)
    finally:
        client.close(linger_ms=0)


def test_a_client_back_with_a_new_run_waits_for_the_next_step_without_stalling_the_others():
    """No sockets: the serving stage's hello rules. Client 1 comes back with a fresh run id after
    its liveness ran out but before the stage dropped it: it joins at the next step, and the
    step in progress goes on without it."""
    from distgrad.wire import messages as wire
    from distgrad.config.parse import load_experiment
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import Phase, PeerStatus, ServingStage
    from conftest import hello_message

    exp = load_experiment("digits-clients")
    server = ServingStage(StageOptions(exp, "g", exp.seed, liveness_s=1.0))
    for c in range(3):
        server.handle([b"peer%d" % c], hello_message(exp, f"run{c}", client=c, micro_batches=1), 0.0)
    assert (server.phase, server.round) == (Phase.ROUND, 1)
    (_, welcome), = [r for r in server.handle([b"new"], hello_message(exp, "fresh1", client=1, micro_batches=1), 5.0)
                     if r[1].type == wire.WELCOME]
    assert welcome.body["next_step"] == 2
    assert server.peers[1].status is PeerStatus.REJOINING
    assert server.order == [0, 1, 2]            # its turn in step 1 is skipped, not waited for


def _raw_clients_to_the_end(exp, steps: int, endpoint: str, ctx, byes: set[int]) -> None:
    """Three raw protocol clients (zero activations) run every step; only those in ``byes`` say bye,
    the others fall silent after their last step, as if killed between it and their bye."""
    import numpy as np

    from distgrad.wire import messages as wire
    from distgrad.wire.transport import Client
    from conftest import hello_message

    clients = [Client(ctx, endpoint) for _ in range(3)]
    runs = [f"raw{c}" for c in range(3)]
    try:
        for c, client in enumerate(clients):
            client.send(hello_message(exp, runs[c], client=c, micro_batches=1, steps=steps))
        for c, client in enumerate(clients):
            assert client.wait(runs[c], {(0, 0)}, 10.0).type == wire.WELCOME
        shape = tuple(hello_message(exp, "r").body["activation"]["shape"])
        for step in range(1, steps + 1):
            for c, client in enumerate(clients):      # each waits for its own reply: turns come in order anyway
                client.send(wire.Message(wire.FORWARD, runs[c], step, 0, 1,
                                         tensors={"activation": np.zeros(shape, np.float32)}))
            for c, client in enumerate(clients):
                assert client.wait(runs[c], {(step, 0)}, 10.0).type == wire.BACKWARD
        for c in sorted(byes):
            reply = clients[c].request(wire.Message(wire.BYE, runs[c], steps, body={"steps": steps}), 10.0)
            assert reply.type == wire.BYE
    finally:
        for client in clients:
            client.close(linger_ms=0)


@pytest.mark.parametrize("byes,code,status", [({0, 1}, 0, "completed"), (set(), 3, "lost")])
def test_a_client_silent_between_its_last_step_and_its_bye_is_dropped_and_g_exits(
        tmp_path, start_server, zmq_ctx, byes, code, status):
    """A client that leaves without a bye: client 2 (or every client) stops after its last step without a bye. g drops it
    after --liveness and exits: 0 when some client said bye, else 3 after --peer-deadline more."""
    from distgrad.config.parse import load_experiment

    exp = load_experiment("digits-clients")
    summary_path = tmp_path / "g.json"
    proc, endpoint = start_server("digits-clients", "--steps", "3", "--liveness", "1", "--peer-deadline", "1",
                                  "--summary", summary_path)
    _raw_clients_to_the_end(exp, 3, endpoint, zmq_ctx, byes)
    # A hang guard, not a speed check: 30 s is 15 times --liveness plus --peer-deadline (2 s), and half the
    # 60 s default deadline; the log below names the 1 s the stage kept.
    assert proc.wait(timeout=30) == code, proc.output
    assert "client 2 silent for more than 1 s after the last step, without a bye; dropped" in proc.output
    summary = read_json(summary_path)
    assert summary["status"] == status
    assert [c["status"] for c in summary["clients"]] == [
        "completed" if c in byes else "dropped" for c in range(3)]
    if byes:
        assert "clients ['f@0', 'f@1'] said bye, clients ['f@2'] were dropped" in proc.output
    else:
        assert "every client lost for more than 1 s after the last step" in proc.output


@pytest.mark.parametrize("experiment", ["digits-clients", "digits-splitfed"])
def test_the_label_owner_killed_and_restarted_changes_nothing(tmp_path, stage_group, experiment):
    """kill -9 of the serving stage of three clients mid-run, restarted with the same command line
    (--checkpoint-dir, --resume): every client's and the label owner's parameters are bitwise those of
    the uninterrupted run. The clients retry meanwhile and roll back to the round it resumes at."""
    steps = 60
    run = stage_group(Clients, tmp_path, experiment, steps, f"ipc://{tmp_path}/g.sock", "--timeout", "0.5",
                      "--peer-deadline", "30")
    run.args["g"] += ["--checkpoint-dir", tmp_path / "g-ckpt", "--checkpoint-every", "10", "--resume"]
    run.start_all_then_kill("g", when="f@0", at_step=25)
    run.start("g")                                          # the same command line
    run.wait_all()
    assert "resumed run" in run.logs()
    reference = _reference(tmp_path, experiment, "--steps", str(steps))["params"]
    for name in [*CLIENTS, "g"]:
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference[name], name


def test_reading_an_experiment_of_many_clients_builds_its_data_a_fixed_number_of_times(tmp_path, monkeypatch):
    """Start-up with many data owners stays linear: every stage process reads the experiment, and reading it checked each data owner's shard by
    building the whole data once per owner: with N owners, N builds in each of N + 1 processes, O(N^2) at
    start-up (64 owners did not start within 90 s on 2 cores). The smallest shard (the last owner's) tells
    whether every owner gets a batch; one too few rows for it is still an error."""
    from distgrad.config import experiment as experiment_module
    from distgrad.config.parse import load_experiment
    from distgrad.errors import ConfigError
    builds = []
    build = experiment_module.build_data
    monkeypatch.setattr(experiment_module, "build_data", lambda *a, **k: builds.append(1) or build(*a, **k))
    text = (Path(__file__).parent.parent / "distgrad" / "experiments" / "digits-clients.toml").read_text()
    path = tmp_path / "many.toml"
    path.write_text(text.replace("count = 3", "count = 40").replace('"../datasets/digits.npz"', repr(
        str(Path(__file__).parent.parent / "distgrad" / "datasets" / "digits.npz"))))
    assert load_experiment(str(path)).clients.count == 40           # 1437 training rows: 35 or 36 each
    assert len(builds) <= 6, len(builds)
    path.write_text(path.read_text().replace("count = 40", "count = 45"))     # 31 or 32 rows: the last has 31
    with pytest.raises(ConfigError, match="data owner 44 of 45 gets 31 training rows, fewer than a batch of 32"):
        load_experiment(str(path))


# Slow (four processes): test_serving.py::test_a_client_restarted_without_the_update_of_its_last_step_gets_its_
# replies_again_and_skips_nothing checks the same decision of the serving stage by default, without sockets.
@pytest.mark.slow
@pytest.mark.parametrize("experiment,step", [("digits-clients", 5), ("digits-splitfed", 10)])   # 10: an average
def test_a_client_killed_between_its_replies_and_its_update_redoes_that_step_bitwise(tmp_path, stage_group,
                                                                                     experiment, step):
    """Client 1 checkpoints every step and dies (as SIGKILL would) once the replies of ``step`` arrived, before
    its update; restarted with the same command line it resumes at the step before and sends ``step`` again:
    the label owner answers it from its kept replies (then takes its part of the average), and every
    parameter is bitwise the uninterrupted run's."""
    steps = 12
    run = stage_group(Clients, tmp_path, experiment, steps, f"ipc://{tmp_path}/g.sock", "--timeout", "0.5",
                      "--peer-deadline", "30")
    every = run.args["f@1"].index("--checkpoint-every") + 1
    run.args["f@1"][every] = "1"
    died = tmp_path / "f1-died"
    run.gate("f@1", "--exit-before-update", str(step), died)
    run.start("g")
    for client in CLIENTS:
        run.start(client)
    assert run.procs["f@1"].wait(60) == 9 and died.exists()
    run.start("f@1")                                        # the same command line; the gate is passed
    run.wait_all()
    assert f"steps {step} to {step} are skipped" not in run.logs()
    reference = _reference(tmp_path, experiment, "--steps", str(steps))["params"]
    for name in [*CLIENTS, "g"]:
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference[name], name
    assert [line["step"] for line in read_lines(tmp_path / "f@1.jsonl")] == list(range(1, steps + 1))


# Slow (four processes): test_serving.py::test_a_splitfed_label_owner_from_its_own_stage_file_averages_what_the_
# clients_send checks the same path of the serving stage by default, without sockets.
@pytest.mark.slow
def test_splitfed_from_stage_files_equals_the_in_process_order(tmp_path, stage_group):
    """digits-splitfed as `distgrad split` writes it, each party started with its own stage file (the label
    owner's does not hold the clients' model): bitwise the combined experiment's in-process run."""
    from distgrad.config.parse import load_experiment
    from distgrad.config.split import split_experiment
    steps = 25
    files = {path.stem: path for path in split_experiment(load_experiment("digits-splitfed"), tmp_path / "parties")}
    run = stage_group(Clients, tmp_path, str(files["f"]), steps, f"ipc://{tmp_path}/g.sock", "--timeout", "2")
    run.args["g"][run.args["g"].index("--experiment") + 1] = str(files["g"])
    run.start("g")
    for client in CLIENTS:
        run.start(client)
    run.wait_all()
    reference = _reference(tmp_path, "digits-splitfed", "--steps", str(steps))["params"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == reference["g"]
    for name in CLIENTS:
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference[name], name
