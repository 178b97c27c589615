"""The cut library for several data owners: a CutServer serving vertical feature parties (each a Cut of its own,
their embeddings combined by ``aggregate``) or clients in turn, over real processes and sockets; bitwise equal
to the same loops composed in one process, resumed exactly after a kill -9 of one side, and a clear error,
within the bounds, for a party that is missing or dead."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import DIGITS_NPZ, StageProcess, free_tcp_endpoint, wait_for_file  # noqa: E402
from distgrad.cut import Cut, CutServer  # noqa: E402
from distgrad.errors import ConfigError, CutMisuse, PeerAborted, PeerRejected, PeerTimeout  # noqa: E402
from distgrad.model import aggregate as aggregates  # noqa: E402
from distgrad.run.cut_interface import FIRST, LAST, cut_side  # noqa: E402

import cut_group_loops  # noqa: E402

pytestmark = pytest.mark.integration       # every test here opens sockets (most start processes)

LOOPS = Path(__file__).resolve().parent / "cut_group_loops.py"
STEPS = 8
NO_TORCH = "torch is not installed (pip install 'distgrad[torch]'): the PyTorch loops need it; CI installs it"


def _interface(stages: list[str], steps: int, extra: str) -> str:
    cuts = len(stages) - 1
    activation = ('{ shape = [8], dtype = "float32" }' if cuts == 1 else
                  "[" + ", ".join(['{ shape = [8], dtype = "float32" }'] * cuts) + "]")
    return (f'[interface]\nname = "group-test"\nstages = {json.dumps(stages)}\nbatch = 32\n'
            f'activation = {activation}\nsteps = {steps}\nseed = 0\n{extra}\n')


def _data(part: str) -> str:
    return f'[data]\nkind = "npy"\n{part}\nbatch = 32\ntest_fraction = 0.0\n'


def _digits(folder: Path) -> np.ndarray:
    folder.mkdir(parents=True, exist_ok=True)
    digits = np.load(DIGITS_NPZ)
    np.save(folder / "y.npy", digits["digit"].astype(np.int64))
    return (digits["pixels"] / 16.0).astype(np.float32)


def write_vertical(folder: Path, count: int, aggregate: str, steps: int = STEPS) -> Path:
    """Party i holds x{i}.npy (its share of the pixel columns) and p{i}.toml; the label owner y.npy, g.toml."""
    pixels = _digits(folder)
    edges = np.linspace(0, pixels.shape[1], count + 1).astype(int)
    stages = [*(f"p{i}" for i in range(count)), "g"]
    iface = _interface(stages, steps, f'aggregate = "{aggregate}"')
    for i in range(count):
        np.save(folder / f"x{i}.npy", np.ascontiguousarray(pixels[:, edges[i]:edges[i + 1]]))
        (folder / f"p{i}.toml").write_text(iface + f'[stage]\nname = "p{i}"\n' + _data(f'features = "x{i}.npy"'))
    (folder / "g.toml").write_text(iface + '[stage]\nname = "g"\n' + _data('labels = "y.npy"'))
    return folder


def write_clients(folder: Path, count: int, steps: int = STEPS) -> Path:
    """Every client's f.toml and x.npy (each takes its shard of the rows), the label owner's g.toml."""
    np.save(folder / "x.npy", _digits(folder))
    iface = _interface(["f", "g"], steps, f"clients = {{ count = {count} }}")
    (folder / "f.toml").write_text(iface + '[stage]\nname = "f"\n' + _data('features = "x.npy"'))
    (folder / "g.toml").write_text(iface + '[stage]\nname = "g"\n' + _data('labels = "y.npy"'))
    return folder


def loop(folder: Path, *args: object, name: str) -> StageProcess:
    """A user loop of tests/cut_group_loops.py in its own process."""
    return StageProcess([LOOPS, args[0], folder, *args[1:]], folder / f"{name}-loop.log", command=[sys.executable])


def run_group(folder: Path, kind: str, count: int, server_flags: tuple = (), flags: dict | None = None,
              restart: str | None = None) -> dict:
    """The label owner's loop and ``count`` data owners' loops (``kind`` "party" or "client"), each in its own
    process; ``flags[i]``: data owner i's, ``server_flags``: the label owner's. ``restart`` names the loop
    that kills itself (its flags say when: "g", or a data owner's index as a string) and is started again,
    resuming from its own checkpoint. Returns every loop's parameters."""
    flags = flags or {}
    ready = folder / "g.ready"
    with loop(folder, "server", ready, *server_flags, name="g") as g:
        endpoint = wait_for_file(ready, g, timeout=60)
        owners = [loop(folder, kind, endpoint, i, *flags.get(i, ()), name=f"d{i}") for i in range(count)]
        try:
            if restart == "g":
                assert g.wait() == -9, g.output
                with loop(folder, "server", ready, name="g2") as g2:
                    for i, owner in enumerate(owners):
                        assert owner.wait() == 0, owner.output
                    assert g2.wait() == 0, g2.output
            else:
                if restart is not None:           # the others wait for it (a step needs every party)
                    killed = owners[int(restart)]
                    assert killed.wait() == -9, killed.output
                    owners[int(restart)] = loop(folder, kind, endpoint, restart, name=f"d{restart}-again")
                for owner in owners:
                    assert owner.wait() == 0, owner.output
                assert g.wait() == 0, g.output
        finally:
            for owner in owners:
                owner.stop()
    names = [f"{'p' if kind == 'party' else 'c'}{i}" for i in range(count)]
    result = {name: json.loads((folder / f"{name}-params.json").read_text()) for name in names}
    g_result = json.loads((folder / "g-params.json").read_text())
    return {**result, "g": g_result["params"], "seen": g_result["seen"]}


def _expected_seen(kind: str, count: int, steps: int = STEPS) -> list[list[int]]:
    if kind == "party":
        return [[step, -1] for step in range(1, steps + 1)]
    return [[step, c] for step in range(1, steps + 1) for c in range(count)]


# -- over processes, bitwise
@pytest.mark.parametrize("count,aggregate", [
    (2, "concat"), pytest.param(2, "sum", marks=pytest.mark.slow), (3, "concat"), (3, "sum"),
    pytest.param(2, "mean", marks=pytest.mark.slow)])
def test_vertical_numpy_loops_compute_bitwise_what_one_process_computes(tmp_path, count, aggregate):
    folder = write_vertical(tmp_path / "v", count, aggregate)
    result = run_group(folder, "party", count)
    expected = cut_group_loops.reference(folder, "party", count, aggregate)
    seen = result.pop("seen")
    assert result == expected
    assert seen == _expected_seen("party", count)


@pytest.mark.slow
@pytest.mark.timeout(240)      # four PyTorch processes
@pytest.mark.parametrize("aggregate", ["concat", "sum"])
def test_vertical_torch_loops_compute_bitwise_what_one_process_computes(tmp_path, aggregate):
    pytest.importorskip("torch", reason=NO_TORCH)
    folder = write_vertical(tmp_path / "v", 2, aggregate)
    result = run_group(folder, "party", 2, ("--torch",), {0: ("--torch",), 1: ("--torch",)})
    seen = result.pop("seen")
    assert result == cut_group_loops.reference(folder, "party", 2, aggregate, torch_loop=True)
    assert seen == _expected_seen("party", 2)


def test_clients_in_turn_numpy_loops_compute_bitwise_what_one_process_computes(tmp_path):
    """Each step, client 0, 1, 2 in turn; the label owner's loop sees whose batch it is, each client's rows
    are its own shard's."""
    folder = write_clients(tmp_path / "c", 3)
    result = run_group(folder, "client", 3)
    seen = result.pop("seen")
    assert result == cut_group_loops.reference(folder, "client", 3)
    assert seen == _expected_seen("client", 3)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_clients_in_turn_torch_loops_compute_bitwise_what_one_process_computes(tmp_path):
    pytest.importorskip("torch", reason=NO_TORCH)
    folder = write_clients(tmp_path / "c", 2)
    result = run_group(folder, "client", 2, ("--torch",), {0: ("--torch",), 1: ("--torch",)})
    seen = result.pop("seen")
    assert result == cut_group_loops.reference(folder, "client", 2, torch_loop=True)
    assert seen == _expected_seen("client", 2)


# -- kill -9 and resume
@pytest.mark.parametrize("kind,killed", [
    ("party", "1"), pytest.param("party", "g", marks=pytest.mark.slow),
    pytest.param("client", "2", marks=pytest.mark.slow), ("client", "g")],
    ids=["party-killed-after-its-reply-came", "label-owner-of-parties-killed-before-its-replies-left",
         "client-killed-after-its-reply-came", "label-owner-of-clients-killed-before-its-replies-left"])
def test_a_loop_killed_9_resumes_from_its_checkpoint_with_no_step_lost_or_doubled(tmp_path, kind, killed):
    """Step 5's replies are cached in the label owner's checkpoint: a data owner resumed at step 4 sends step 5
    again and gets its reply; the label owner's loop never computes a step twice."""
    count = 2 if kind == "party" else 3
    folder = (write_vertical(tmp_path / "v", count, "concat") if kind == "party"
              else write_clients(tmp_path / "c", count))
    if killed == "g":
        result = run_group(folder, kind, count, ("--die-before-send", "5"), restart="g")
    else:
        result = run_group(folder, kind, count, flags={int(killed): ("--die-after-reply", "5")}, restart=killed)
    seen = result.pop("seen")
    assert result == cut_group_loops.reference(folder, kind, count)
    assert seen == _expected_seen(kind, count)


# -- a daemon on the other side
def _daemon_file(folder: Path, library_file: str, stage: str, model: str, extra: str = "") -> Path:
    """A daemon's stage file of the same interface and data as the library loop's ``library_file``."""
    text = (folder / library_file).read_text()
    interface, rest = text.split("[stage]", 1)
    data = rest[rest.index("[data]"):]
    path = folder / f"{stage}-daemon.toml"
    path.write_text(f'{interface}[stage]\nname = "{stage}"\nmodel = [{model}]\n'
                    f'optimizer = {{ type = "sgd", lr = 0.1 }}\n{extra}{data}')
    return path


def test_daemon_clients_drive_a_label_owner_loop_and_party_loops_drive_a_daemon_label_owner(tmp_path):
    """The library speaks the daemons' protocol for several data owners too: two distgrad-stage clients take
    their turns with a CutServer loop, and two party loops (Cuts) train with a distgrad-stage vertical
    label owner."""
    folder = write_clients(tmp_path / "c", 2, steps=4)
    f = _daemon_file(folder, "f.toml", "f", '{ type = "dense", name = "f1", in = 64, out = 8 }')
    ready = folder / "g.ready"
    with loop(folder, "server", ready, name="g") as g:
        endpoint = wait_for_file(ready, g, timeout=60)
        clients = [StageProcess(["f", "--experiment", f, "--connect", endpoint, "--client", c],
                                folder / f"f{c}-daemon.log") for c in (0, 1)]
        try:
            assert [c.wait() for c in clients] == [0, 0], [c.output for c in clients]
            assert g.wait() == 0, g.output
        finally:
            for c in clients:
                c.stop()
    assert json.loads((folder / "g-params.json").read_text())["seen"] == _expected_seen("client", 2, 4)

    folder = write_vertical(tmp_path / "v", 2, "concat", steps=4)
    g_file = _daemon_file(folder, "g.toml", "g", '{ type = "dense", name = "g1", in = 16, out = 10 }',
                          'loss = "softmax_cross_entropy"\n')
    ready = folder / "g-daemon.ready"
    with StageProcess(["g", "--experiment", g_file, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready,
                       "--summary", folder / "g.json"], folder / "g-daemon.log") as g:
        endpoint = wait_for_file(ready, g, timeout=60)
        with loop(folder, "party", endpoint, 0, name="d0") as p0, loop(folder, "party", endpoint, 1, name="d1") as p1:
            assert (p0.wait(), p1.wait()) == (0, 0), (p0.output, p1.output)
        assert g.wait() == 0, g.output
    summary = json.loads((folder / "g.json").read_text())
    assert summary["rounds"] == 4 and [p["status"] for p in summary["parties"]] == ["completed", "completed"]


# -- a party missing or dead
def _outcome(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}-outcome.json").read_text())


def _parties_up_then_label_owner(folder: Path, count: int, flags: dict) -> tuple[StageProcess, list[StageProcess]]:
    """Party loops started first (at a free endpoint the label owner will bind) and up, about to say hello;
    then the label owner's loop with short bounds (liveness 2 s + peer deadline 3 s), so what it waits for
    is a party that is missing or dead, not one still starting."""
    endpoint = free_tcp_endpoint()
    (folder / "g.ready").write_text(endpoint)
    parties = [loop(folder, "party", endpoint, i, "--up", folder / f"d{i}.up", *flags.get(i, ()), name=f"d{i}")
               for i in range(count)]
    for i, party in enumerate(parties):
        wait_for_file(folder / f"d{i}.up", party, timeout=60)
    return loop(folder, "server", folder / "g.ready", "--liveness", "2.0", "--deadline", "3.0", name="g"), parties


def test_a_missing_party_is_a_clear_error_within_the_bounds_and_the_others_are_told(tmp_path):
    """Party 1 never comes: the label owner's loop raises PeerTimeout naming it after liveness + deadline
    (2 + 3 s), and party 0, waiting for its reply, is told why (PeerAborted), not left to time out."""
    folder = write_vertical(tmp_path / "v", 2, "concat")
    g, parties = _parties_up_then_label_owner(folder, 1, {})
    with g, parties[0] as party:
        assert g.wait() == 1, g.output
        assert party.wait() == 1, party.output
    outcome = _outcome(folder, "g")
    assert outcome["error"] == "PeerTimeout"
    assert "party p1 of group-test silent for more than 5 s at step 1 (a step needs every feature party" in \
        outcome["message"]
    # As a daemon label owner does, the loop's server logs which party it waits for once it is silent past
    # its liveness bound, before it gives up.
    assert "waiting for party p1: silent for more than 2 s at step 1 (a step needs every feature party)" in \
        g.output, g.output
    told = _outcome(folder, "p0")
    assert told["error"] == "PeerAborted"
    assert "stage g stopped: its loop failed: PeerTimeout: party p1" in told["message"]


@pytest.mark.slow
def test_a_party_killed_and_not_restarted_is_a_clear_error_naming_it(tmp_path):
    folder = write_vertical(tmp_path / "v", 3, "sum")
    g, parties = _parties_up_then_label_owner(folder, 3, {2: ("--die-after-reply", "3")})
    try:
        with g:
            assert parties[2].wait() == -9
            assert g.wait() == 1, g.output
            assert [p.wait() for p in parties[:2]] == [1, 1]
    finally:
        for p in parties:
            p.stop()
    outcome = _outcome(folder, "g")
    assert outcome["error"] == "PeerTimeout" and "party p2 of group-test silent" in outcome["message"]
    assert "at step 4" in outcome["message"]
    for name in ("p0", "p1"):
        assert _outcome(folder, name)["error"] == "PeerAborted"


# -- in one process: the interface, the hello, misuse
FIELDS = dict(name="group-unit", batch=4, activation=[3], steps=2, seed=0)
CLIENT_FIELDS = dict(FIELDS, stages=["f", "g"], clients=2,
                     data={"kind": "synthetic_regression", "features": 2, "batch": 4, "samples": 64})


class Served:
    """A server's loop ``body(server)`` on a thread; ``result()`` joins it (bounded) and gives what it
    returned, or the error it raised."""

    def __init__(self, server, body) -> None:
        self.server, self.out, self.error = server, None, None
        self.thread = threading.Thread(target=self._run, args=(body,), daemon=True)
        self.thread.start()

    def _run(self, body) -> None:
        try:
            with self.server:
                self.out = body(self.server)
        except Exception as e:          # noqa: BLE001 - handed to the test
            self.error = e

    def result(self, timeout: float = 30.0):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the server's loop did not end"
        return self.out, self.error


def _answer_all(server) -> list:
    seen = []
    for batch in server:
        seen.append((batch.step, batch.mb, batch.client, None if batch.parts is None else len(batch.parts)))
        batch.reply(float(batch.h.sum()), np.ascontiguousarray(batch.h * 2))
    return seen


def _serve_parties(fields: dict, body, count: int) -> tuple[object, dict]:
    """``body`` as the label owner's loop of a ``CutServer`` bound with ``fields``, against ``count`` party
    threads (``_parties``): what the loop returned, and each party's results by (party, step). The loop must
    not fail."""
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=3.0, peer_deadline_s=5.0, **fields), body)
    results: dict = {}
    for t in _parties(served.server.endpoint, count, fields, results):
        t.join(30)
    returned, error = served.result()
    assert error is None, error
    return returned, results


def _parties(endpoint: str, count: int, fields: dict, results: dict, **options) -> list[threading.Thread]:
    def party(i: int) -> None:
        try:
            with Cut.connect(endpoint, party=i, timeout_s=1.0, peer_deadline_s=10.0, **options, **fields) as cut:
                for step in range(1, fields["steps"] + 1):
                    h = np.full((4, 3), 10 * i + step, np.float32)
                    results[(i, step)] = cut.step(h)
        except Exception as e:          # noqa: BLE001 - handed to the test
            results[i] = e
    threads = [threading.Thread(target=party, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("aggregate", ["concat", "sum", "mean"])
def test_each_party_gets_its_own_part_of_the_gradient_of_the_combined_batch(aggregate):
    fields = dict(FIELDS, parties=3, aggregate=aggregate)
    seen, results = _serve_parties(fields, _answer_all, 3)
    assert seen == [(1, 0, None, 3), (2, 0, None, 3)]
    for step in (1, 2):
        hs = [np.full((4, 3), 10 * i + step, np.float32) for i in range(3)]
        combined = aggregates.combine(aggregate, hs)
        parts = aggregates.split(aggregate, combined * 2, [3, 3, 3])
        for i in range(3):
            loss, dh = results[(i, step)]
            assert loss == np.float32(combined.sum()) and np.array_equal(dh, parts[i])


def test_the_interface_of_several_data_owners_names_parties_and_clients():
    side = cut_side(LAST, None, dict(FIELDS, parties=3, aggregate="concat"))
    assert list(side.exp.stage_names) == ["p0", "p1", "p2", "g"] and side.shape == (4, 9)
    assert cut_side(FIRST, None, dict(FIELDS, parties=3, aggregate="sum"), party=2).stage == "p2"
    assert cut_side(FIRST, None, dict(FIELDS, parties=3, aggregate="sum"), party="p1").shape == (4, 3)
    with pytest.raises(ConfigError, match=r"party=3 is not a feature party: give its index \(0 to 2\)"):
        cut_side(FIRST, None, dict(FIELDS, parties=3, aggregate="sum"), party=3)
    with pytest.raises(ConfigError, match=r"\[clients\] count = 2: give this data owner's client="):
        cut_side(FIRST, None, CLIENT_FIELDS)
    with pytest.raises(ConfigError, match="the label owner serves every client"):
        cut_side(LAST, None, CLIENT_FIELDS, client=0)
    with pytest.raises(ConfigError, match="the interface has no \\[clients\\]"):
        cut_side(FIRST, None, dict(FIELDS, stages=["f", "g"]), client=0)
    with pytest.raises(ConfigError, match="asynchronous pipelining is for two stages and chains"):
        cut_side(LAST, None, dict(FIELDS, parties=2, aggregate="sum", staleness=1))
    with pytest.raises(ConfigError, match="mode = 'splitfed'"):
        cut_side(LAST, None, dict(CLIENT_FIELDS, clients={"count": 2, "mode": "splitfed", "average_every": 1}))
    rows = [cut_side(FIRST, None, CLIENT_FIELDS, client=c).rows(1) for c in (0, 1)]
    assert not set(rows[0]) & set(rows[1])           # each client its own shard
    with pytest.raises(ConfigError, match="several clients scores no held-out rows"):
        CutServer.bind("tcp://127.0.0.1:*", evaluate=lambda h, rows: (0.0, None), **CLIENT_FIELDS)


def test_a_hello_from_no_party_served_here_is_refused_and_missing_parties_are_named():
    fields = dict(FIELDS, parties=2, aggregate="concat")
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=1.0, peer_deadline_s=2.0, **fields), _answer_all)
    other = dict(FIELDS, stages=["p0", "p1", "p2", "g"], aggregate="concat")
    with Cut.connect(served.server.endpoint, party=2, timeout_s=1.0, peer_deadline_s=3.0, **other) as cut:
        with pytest.raises(PeerRejected, match=r"hello from stage 'p2'; this label owner serves the feature "
                                               r"parties \['p0', 'p1'\]"):
            cut.step(np.zeros((4, 3), np.float32))
    _, error = served.result()
    assert isinstance(error, PeerTimeout) and "party p0, party p1 of group-unit silent" in str(error)


def test_clients_are_served_in_turn_and_a_client_index_out_of_range_is_refused():
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=3.0, peer_deadline_s=5.0, **CLIENT_FIELDS),
                    _answer_all)
    endpoint = served.server.endpoint
    bad = dict(CLIENT_FIELDS, clients=3)
    with Cut.connect(endpoint, client=2, timeout_s=1.0, peer_deadline_s=3.0, **bad) as cut:
        with pytest.raises(PeerRejected):
            cut.step(np.zeros((4, 3), np.float32), cut.rows(1))
    out: dict = {}

    def client(c: int) -> None:
        with Cut.connect(endpoint, client=c, timeout_s=1.0, peer_deadline_s=10.0, **CLIENT_FIELDS) as cut:
            for step in (1, 2):
                out[(c, step)] = cut.step(np.full((4, 3), c, np.float32), cut.rows(step))
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in (1, 0)]    # 1 comes first
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    seen, error = served.result()
    assert error is None, error
    assert seen == [(1, 0, 0, None), (1, 0, 1, None), (2, 0, 0, None), (2, 0, 1, None)]
    assert out[(1, 2)][0] == np.float32(12.0) and out[(0, 1)][0] == 0.0


def test_a_group_state_resumes_and_a_bad_one_is_refused_before_anything_changes():
    fields = dict(FIELDS, parties=2, aggregate="sum")
    states = []

    def body(server):
        for batch in server:
            batch.reply(1.0, np.ones_like(batch.h))
            if batch.step == 1:
                with pytest.raises(CutMisuse):
                    batch.reply(1.0, np.ones_like(batch.h))
            states.append(server.state_dict())
    _, results = _serve_parties(fields, body, 2)
    state = states[0]
    assert state["step"] == 1 and [p["step"] for p in state["peers"]] == [1, 1]
    resumed = CutServer.bind("tcp://127.0.0.1:*", state=state, **fields)
    assert resumed.step == 1
    resumed.close()
    for bad, match in [({**state, "turn": 1}, "turn"), ({**state, "peers": state["peers"][:1]}, "list of 2"),
                       ({**state, "peers": [{**state["peers"][0], "step": 0}, state["peers"][1]]}, "has step 0"),
                       ({k: v for k, v in state.items() if k != "turn"}, "exactly")]:
        with pytest.raises(ConfigError, match=match):
            CutServer.bind("tcp://127.0.0.1:*", state=bad, **fields)


def test_a_party_whose_rows_differ_from_the_others_is_refused_and_nothing_is_applied():
    fields = dict(FIELDS, parties=2, aggregate="concat", send_rows=True,
                  data={"kind": "synthetic_regression", "features": 2, "batch": 4, "samples": 64})
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=2.0, **fields), _answer_all)
    errors: dict = {}

    def party(i: int) -> None:
        try:      # the refusal leaves the with block: the label owner is told this loop stopped
            with Cut.connect(served.server.endpoint, party=i, timeout_s=1.0, peer_deadline_s=5.0, **fields) as cut:
                cut.step(np.zeros((4, 3), np.float32), cut.rows(1) if i == 0 else cut.rows(2))
        except PeerRejected as e:
            errors[i] = str(e)
    threads = [threading.Thread(target=party, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    seen, error = served.result()
    assert "the feature parties sent different rows for step 1" in errors.get(0, "") and 1 in errors
    assert isinstance(error, PeerAborted) and served.server.step == 0


def test_a_group_server_refuses_what_no_real_party_sends_and_serves_the_real_ones_on():
    """Raw DEALERs in place of two feature parties: every bad hello or forward gets the protocol's error reply
    and changes nothing; the loop sees each step once, combined, and a resent forward gets its cached reply."""
    import zmq

    from distgrad.run import handshake
    from distgrad.wire import messages as wire
    from distgrad.wire.messages import ErrorCode, Message

    fields = dict(FIELDS, parties=2, aggregate="concat")
    exp = cut_side(FIRST, None, fields, party=0).exp

    def hello(stage: str, run: str, **changes) -> Message:
        message = handshake.hello(exp, stage, exp.seed, exp.cuts[0], run, [0], exp.steps, 1)
        message.body.update(changes)
        return message

    def forward(run: str, step: int, value: float, h=None, mbs: int = 1) -> Message:
        h = np.full((4, 3), value, np.float32) if h is None else h
        return Message(wire.FORWARD, run, step, 0, mbs, tensors={"activation": h})

    def ask(sock, message: Message) -> Message:
        sock.send_multipart(wire.encode(message))
        assert sock.poll(3000), f"no reply to {message.describe()}"
        return wire.decode(sock.recv_multipart())

    def refused(sock, message: Message, code: str, text: str = "") -> None:
        reply = ask(sock, message)
        assert reply.type == wire.ERROR and reply.body["code"] == code and text in reply.body["message"], reply.body

    def body(server):
        seen = []
        for batch in server:
            seen.append((batch.step, batch.h.tolist()))
            batch.reply(float(batch.step), np.ascontiguousarray(batch.h * 2))
        return seen

    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=5.0, **fields), body)
    ctx = zmq.Context.instance()
    a, b = (ctx.socket(zmq.DEALER) for _ in range(2))
    try:
        for sock in (a, b):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(served.server.endpoint)
        refused(a, forward("ra", 1, 1.0), ErrorCode.RUN, "hello first")
        refused(a, hello("p9", "ra"), ErrorCode.MISMATCH, "serves the feature parties ['p0', 'p1']")
        refused(a, hello("p0", "ra", client=1), ErrorCode.MISMATCH, "told apart by their stage")
        refused(a, hello("p0", "ra", staleness=1), ErrorCode.MISMATCH, "lockstep steps only")
        assert ask(a, hello("p0", "ra")).type == wire.WELCOME
        refused(b, hello("p0", "rb"), ErrorCode.RUN, "busy")                   # p0's place is taken
        refused(b, hello("p1", "ra"), ErrorCode.RUN, "is party p0's")          # p0's run
        refused(a, forward("ra", 1, 1.0, np.ones((4, 2), np.float32)), ErrorCode.TENSOR)
        refused(a, forward("ra", 3, 1.0), ErrorCode.STEP, "expected step 1")
        refused(a, forward("ra", 1, 1.0, mbs=2), ErrorCode.STEP)
        refused(a, Message(wire.BYE, "ra", 1, body={"steps": 0}), ErrorCode.STEP, "every feature party")
        a.send_multipart(wire.encode(forward("ra", 1, 1.0)))                  # waits for p1's part
        assert not a.poll(300)
        assert ask(b, hello("p1", "rb")).type == wire.WELCOME
        first = ask(b, forward("rb", 1, 2.0))
        assert a.poll(3000)
        mine = wire.decode(a.recv_multipart())
        assert first.type == mine.type == wire.BACKWARD and first.body["loss"] == mine.body["loss"] == 1.0
        assert ask(a, forward("ra", 1, 1.0)).body == mine.body                  # resent: the cached reply
        a.send_multipart(wire.encode(forward("ra", 2, 3.0)))
        assert ask(b, forward("rb", 2, 4.0)).body["loss"] == 2.0
        assert a.poll(3000) and wire.decode(a.recv_multipart()).body["loss"] == 2.0
        for sock, run in ((a, "ra"), (b, "rb")):
            assert ask(sock, Message(wire.BYE, run, 3, body={"steps": 2})).type == wire.BYE
    finally:
        a.close()
        b.close()
    seen, error = served.result()
    assert error is None, error
    assert seen == [(1, [[1.0] * 3 + [2.0] * 3] * 4), (2, [[3.0] * 3 + [4.0] * 3] * 4)]


def test_vertical_micro_batches_combine_micro_batch_by_micro_batch():
    """With micro_batches = 2 each party's step is two micro-batches; the loop sees each combined, and each
    party gets the daemons' combination of its parts' gradients (their sum times the scale, 1/2 for a mean)."""
    fields = dict(FIELDS, parties=2, aggregate="concat", micro_batches=2)
    seen, results = _serve_parties(fields, _answer_all, 2)
    assert seen == [(1, 0, None, 2), (1, 1, None, 2), (2, 0, None, 2), (2, 1, None, 2)]
    for step in (1, 2):
        for i in range(2):
            loss, dh = results[(i, step)]
            h = np.full((4, 3), 10 * i + step, np.float32)
            assert np.array_equal(dh, h * 2 * np.float32(0.5))
            combined = np.concatenate([np.full((2, 3), step, np.float32), np.full((2, 3), 10 + step, np.float32)], 1)
            assert loss == (np.float32(combined.sum()) + np.float32(combined.sum())) * np.float32(0.5)


def test_vertical_parties_held_out_embeddings_are_combined_and_scored_once_for_all(tmp_path):
    """Each party sends its held-out rows' embeddings after the last step; the loop's evaluate gets them
    combined (as a batch is) with the held-out rows, and every party gets the same scores; a party that asks
    again gets them again without a second scoring."""
    np.save(tmp_path / "y.npy", np.arange(40) % 3)
    np.save(tmp_path / "x.npy", np.zeros((40, 2), np.float32))
    rows = {"kind": "npy", "batch": 4, "test_fraction": 0.2}
    fields = dict(FIELDS, parties=2, aggregate="sum", data={**rows, "labels": str(tmp_path / "y.npy")})
    party_fields = {**fields, "data": {**rows, "features": str(tmp_path / "x.npy")}}
    calls = []

    def evaluate(h, rows):
        calls.append((h.copy(), rows.copy()))
        return float(h.sum()), None

    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=3.0, peer_deadline_s=5.0, evaluate=evaluate,
                                   **fields), _answer_all)
    scores: dict = {}

    def party(i: int) -> None:
        with Cut.connect(served.server.endpoint, party=i, timeout_s=1.0, peer_deadline_s=10.0,
                         **party_fields) as cut:
            for step in (1, 2):
                cut.step(np.full((4, 3), i + 1, np.float32), cut.rows(step))
            held_out = np.full((len(cut.test_rows), 3), 10 * (i + 1), np.float32)
            scores[i] = cut.evaluate(held_out)
            scores[(i, "again")] = cut.evaluate(held_out)
    threads = [threading.Thread(target=party, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    _, error = served.result()
    assert error is None, error
    (h, rows), = calls
    test_rows = cut_side(LAST, None, fields).data.test_rows
    assert rows.tolist() == list(test_rows) and np.array_equal(h, np.full((len(test_rows), 3), 30, np.float32))
    expected = {"loss": float(h.sum()), "correct": None, "count": len(test_rows)}
    assert scores[0] == scores[1] == scores[(0, "again")] == scores[(1, "again")] == expected


def test_a_party_whose_loop_fails_before_its_hello_stops_the_label_owner_and_the_others_are_told():
    """Party 1's loop fails at its first step before anything is sent (an h of the wrong shape) while party 0
    has begun: its notice (a data owner may stop before its hello) stops the label owner's loop at once
    (PeerAborted naming party 1's reason), and party 0, waiting for its reply, is told so; before, the notice
    was refused (no run of it here) and party 0 waited out its peer deadline (PeerTimeout)."""
    fields = dict(FIELDS, parties=2, aggregate="concat")
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=2.0, peer_deadline_s=20.0, **fields), _answer_all)
    results: dict = {}
    first = _parties(served.server.endpoint, 1, fields, results)[0]
    deadline = time.monotonic() + 30
    while not served.server.peers[0].joined:        # party 0's hello was taken: its step 1 waits for party 1
        assert time.monotonic() < deadline, "party 0 never said hello"
        time.sleep(0.01)
    with pytest.raises(CutMisuse, match=r"h has shape \(4, 6\)"):
        with Cut.connect(served.server.endpoint, party=1, timeout_s=1.0, peer_deadline_s=20.0, **fields) as cut:
            cut.step(np.zeros((4, 6), np.float32))
    first.join(30)
    _, error = served.result()
    assert isinstance(error, PeerAborted) and "stage p1 stopped: its loop failed: CutMisuse: h has shape" in str(error)
    assert isinstance(results[0], PeerAborted) and "stage p1 stopped" in str(results[0]), results


@pytest.mark.parametrize("aggregate", ["sum", "concat"])
def test_replies_keep_the_gradient_the_loop_gave_when_the_loop_reuses_one_array(aggregate):
    """A label owner's loop that writes every gradient into one array it keeps and writes it again after
    ``batch.reply``: each party receives, and its kept replies (the saved state) hold, the gradient as it was
    when replied. (A party's part that was the loop's own array was sent at the next ``__next__`` and kept by
    reference, so it carried the array's later values.)"""
    fields = dict(FIELDS, parties=2, aggregate=aggregate)
    width = 6 if aggregate == "concat" else 3
    states = []

    def body(server):
        grad = np.empty((4, width), np.float32)
        for batch in server:
            grad[...] = batch.step
            batch.reply(1.0, grad)
            grad[...] = -1                  # the loop's array, written again before the replies leave
            states.append(server.state_dict())
    _, results = _serve_parties(fields, body, 2)
    for step in range(1, fields["steps"] + 1):
        for i in range(2):
            assert results[(i, step)][1].tolist() == [[float(step)] * 3] * 4, (i, step)
    kept = [(r["step"], t) for state in states for p in state["peers"] for r in p["replies"]
            for t in r["tensors"].values()]
    assert kept and all(np.all(t == step) for step, t in kept)



def test_a_label_owner_loop_that_fails_ends_at_once_and_every_waiting_party_is_told_why():
    """The loop computes past party 1's timeout_s (it resends on a fresh socket, which the notice sent where
    it was heard cannot reach), then fails. Its exception leaves the with block as it was raised, at once,
    not after liveness_s (30 s here); party 0, still at the socket it sent from, is told there, and party 1 in
    reply to its resent request. Before, the close waited liveness_s for party 0 to resend (it never did:
    it had the notice) and took a resend of party 1 from a socket it had closed as told, so party 1 waited
    out its peer deadline (PeerTimeout)."""
    fields = dict(FIELDS, parties=2, aggregate="concat")
    failure = RuntimeError("the loop's own bug")

    def body(server):
        for _ in server:
            time.sleep(0.25)              # party 1 (timeout_s 0.1) resends meanwhile
            raise failure

    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=30.0, peer_deadline_s=30.0, **fields), body)
    results: dict = {}

    def party(i: int, timeout_s: float) -> None:
        try:
            with Cut.connect(served.server.endpoint, party=i, timeout_s=timeout_s, peer_deadline_s=30.0,
                             **fields) as cut:
                cut.step(np.full((4, 3), i, np.float32))
        except Exception as e:          # noqa: BLE001 - handed to the test
            results[i] = e
    threads = [threading.Thread(target=party, args=(i, timeout), daemon=True) for i, timeout in ((0, 30.0), (1, 0.1))]
    for t in threads:
        t.start()
    _, error = served.result(timeout=10.0)
    assert error is failure
    for t in threads:
        t.join(10.0)
    for i in (0, 1):
        assert isinstance(results.get(i), PeerAborted), results
        assert "stage g stopped: its loop failed: RuntimeError: the loop's own bug" in str(results[i])


def test_a_party_whose_early_bye_is_refused_tells_the_label_owner_it_stopped():
    """A feature party's ``close(finished=True)`` before the last step: its bye is refused (every party takes
    part in every step) and its loop gets that ``PeerRejected``; the label owner, whose next step waits for
    that party, is told at once that it stopped (``PeerAborted`` naming it and the refusal), and the other
    party, waiting for its reply, is told in turn. Before, nothing was said: the label owner waited for the
    party for ``liveness_s + peer_deadline_s`` and then timed out (``PeerTimeout``)."""
    fields = dict(FIELDS, parties=2, aggregate="concat")
    served = Served(CutServer.bind("tcp://127.0.0.1:*", liveness_s=3.0, peer_deadline_s=5.0, **fields), _answer_all)
    results: dict = {}

    def party(i: int) -> None:
        try:
            with Cut.connect(served.server.endpoint, party=i, timeout_s=1.0, peer_deadline_s=10.0, **fields) as cut:
                cut.step(np.full((4, 3), i, np.float32))
                if i == 0:
                    cut.close(finished=True)
                cut.step(np.full((4, 3), i, np.float32))
        except Exception as e:          # noqa: BLE001 - handed to the test
            results[i] = e
    threads = [threading.Thread(target=party, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    _, error = served.result()
    assert isinstance(results[0], PeerRejected) and "bye after 1 steps of 2" in str(results[0]), results
    assert isinstance(error, PeerAborted), error
    assert "stage p0 stopped: its loop closed the cut after step 1 of 2 and its bye was refused" in str(error)
    assert isinstance(results[1], PeerAborted) and "stage g stopped" in str(results[1]), results
