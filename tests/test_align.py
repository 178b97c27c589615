"""``distgrad align``: private ID alignment of vertical parties.

The oracle is Python's set intersection of the parties' ID columns: the
aligned files must agree row for row, hold exactly the common IDs, and keep
each party's other columns attached to the right ID.
"""

from __future__ import annotations

import csv
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from distgrad import align as al
from distgrad.wire import messages as wire
from distgrad.errors import ConfigError, ProtocolError
from distgrad.wire.keys import keygen

from conftest import StageProcess, pinned_env, run_main, wait_for_file

ALIGN_DEADLINE_S = 60.0          # whole-run bound of a process in these tests


def write_party(path: Path, name: str, ids: list[str], rng: random.Random) -> dict[str, list[str]]:
    """A CSV of ``ids`` in a random order, the ID column second, two columns derived from the ID.
    Returns the rows by ID."""
    ids = ids[:]
    rng.shuffle(ids)
    rows = {i: [f"{name}:{i}", i, str(len(i) * 7 % 13)] for i in ids}
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([f"{name}_feature", "person", f"{name}_extra"])
        writer.writerows(rows[i] for i in ids)
    return rows


def read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="") as f:
        return list(csv.reader(f))


def overlapping_sets(size: int, rng: random.Random) -> tuple[list[str], list[str], list[str]]:
    """Three sets of ``size`` IDs with partial overlaps: some IDs in all three, some in exactly two, the rest
    in one (IDs of mixed shapes, a comma and non-ASCII among them)."""
    pool = [f"id-{n:07d}" for n in rng.sample(range(10**7), 3 * size)] + ["x,y", "Zoë", " spaced "]
    rng.shuffle(pool)
    all3, ab, bc, ca = pool[:size // 5], pool[size // 5:size // 4], pool[size // 4:size // 3], pool[size // 3:size // 2]
    rest = iter(pool[size // 2:])
    a, b, c = all3 + ab + ca, all3 + ab + bc, all3 + bc + ca
    for s in (a, b, c):
        s += [next(rest) for _ in range(size - len(s))]
    return a, b, c


def start(args: list, log: Path) -> StageProcess:
    return StageProcess(["align", *args], log, distgrad=True)


def wait_for_text(proc: StageProcess, text: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in proc.output:
        assert proc.proc.poll() is None, f"exited {proc.proc.returncode} before logging {text!r}:\n{proc.output}"
        assert time.monotonic() < deadline, f"{text!r} not logged within {timeout} s:\n{proc.output}"
        time.sleep(0.02)


def check_aligned(outs: list[Path], tables: list[dict[str, list[str]]], headers: list[list[str]]) -> list[str]:
    """The aligned files agree on the ID column row for row, hold exactly the common IDs, and each row is
    the party's own input row for that ID. Returns the agreed IDs."""
    common = set(tables[0]).intersection(*tables[1:])
    agreed = None
    for out, rows, header in zip(outs, tables, headers):
        lines = read_csv(out)
        assert lines[0] == header
        ids = [line[1] for line in lines[1:]]
        agreed = ids if agreed is None else agreed
        assert ids == agreed, f"{out}: another order than the first party's"
        assert set(ids) == common and len(ids) == len(common)
        assert not set(ids) - common, "an ID that is not common to all parties"
        assert all(line == rows[line[1]] for line in lines[1:]), f"{out}: a row not attached to its ID"
    return agreed


# ---------------------------------------------------------------- unit: the pieces

def test_encryption_commutes_and_tells_ids_apart():
    ids = ["alice", "bob", "Zoë", ""]
    hashed = al.hash_ids(ids)
    assert len(set(hashed)) == 4 and all(len(h) == al.VALUE_BYTES for h in hashed)
    a, b, c = al.new_key(), al.new_key(), al.new_key()
    abc = al.encrypt(al.encrypt(al.encrypt(hashed, a), b), c)
    assert abc == al.encrypt(al.encrypt(al.encrypt(hashed, c), a), b)
    assert len(set(abc)) == 4 and not set(abc) & set(hashed)
    assert al.hash_ids(["alice"]) == hashed[:1]         # deterministic: all parties hash alike
    assert al.unpack(al.pack(abc)) == abc


def test_a_low_order_point_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="low-order"):
        al.encrypt([bytes(32)], al.new_key())


def test_common_positions_match_set_intersection():
    rng = random.Random(3)
    lists = [rng.sample(range(200), 120) for _ in range(3)]
    values = [[v.to_bytes(32, "big") for v in values] for values in lists]
    positions = al.common_positions(values)
    common = sorted(set(lists[0]) & set(lists[1]) & set(lists[2]))
    for values_of_one, pos in zip(lists, positions):
        assert [values_of_one[p] for p in pos] == common
    assert [len(p) for p in al.common_positions([values[0][:5], values[0][5:10]])] == [0, 0]


def test_read_table_refuses_bad_files(tmp_path):
    path = tmp_path / "p.csv"
    cases = {
        "": "is empty",
        "id,b\n": "has a header but no rows",
        "a,b\n1,2\n": "has no column named 'id'",
        "id,b,id\n1,2,3\n": "names column 'id' more than once",
        "b,id\nx,7\ny,8\nz,7\n": "ID '7' appears twice in column 'id', on lines 2 and 4",
        "id,b\n1,2\n2\n": "line 3: 1 fields, but the header has 2",
        "id,b\n1,2\n,3\n": "line 3: the ID column 'id' is empty",
    }
    for text, message in cases.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
            al.read_table(path, "id")
    path.write_bytes(b"id\n\xff\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        al.read_table(path, "id")
    path.write_text("\nid,b\n1,2\n\n2,3\n")         # blank lines are skipped
    assert al.read_table(path, "id").ids == ["1", "2"]


def test_usage_errors_exit_2_before_anything_connects(tmp_path):
    good = tmp_path / "a.csv"
    good.write_text("id,x\n1,2\n")
    dup = tmp_path / "dup.csv"
    dup.write_text("x,person\n1,p1\n2,p2\n3,p1\n")
    out = tmp_path / "out.csv"
    cases = [
        ([good, "--id-column", "id", "--out", out, "--bind", "tcp://127.0.0.1:*"], "needs --parties"),
        ([good, "--id-column", "id", "--out", out, "--bind", "tcp://127.0.0.1:*", "--parties", "1"], "2 to 64"),
        ([good, "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:5", "--bind", "tcp://127.0.0.1:*",
          "--parties", "3"], "exactly one"),
        ([good, "--id-column", "id", "--out", out], "exactly one"),
        ([good, "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:*"], "wildcard"),
        ([good, "--id-column", "id", "--out", good, "--connect", "tcp://127.0.0.1:5"], "is the input file"),
        ([good, "--id-column", "id", "--out", tmp_path / "no" / "o.csv", "--connect", "tcp://127.0.0.1:5"],
         "does not exist"),
        ([good, "--id-column", "nope", "--out", out, "--connect", "tcp://127.0.0.1:5"], "no column named 'nope'"),
        ([dup, "--id-column", "person", "--out", out, "--connect", "tcp://127.0.0.1:5"],
         "ID 'p1' appears twice in column 'person', on lines 2 and 4"),
        ([tmp_path / "missing.csv", "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:5"],
         "cannot read"),
        ([good, "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:5", "--server-key", good],
         "CURVE needs"),
    ]
    for args, message in cases:
        result = run_main(["align", *args])
        assert result.returncode == 2, (args, result)
        assert message in result.stderr, (message, result.stderr)
    assert not out.exists()


# ---------------------------------------------------------------- processes

def test_three_parties_of_10000_ids_agree_row_for_row(tmp_path):
    """The issue's test: three real processes over tcp, 10,000 IDs each, partial overlaps, rows in different
    orders; the aligned files agree row for row and hold only IDs common to all."""
    rng = random.Random(15)
    sets = overlapping_sets(10_000, rng)
    names = ["labels", "bank", "shop"]
    tables = [write_party(tmp_path / f"{n}.csv", n, ids, rng) for n, ids in zip(names, sets)]
    outs = [tmp_path / f"{n}.aligned.csv" for n in names]
    ready = tmp_path / "ready"
    started = time.monotonic()
    procs = [start([tmp_path / "labels.csv", "--id-column", "person", "--out", outs[0], "--bind",
                    "tcp://127.0.0.1:*", "--parties", "3", "--ready-file", ready], tmp_path / "labels.log")]
    try:
        endpoint = wait_for_file(ready, procs[0])
        for n, out in zip(names[1:], outs[1:]):
            procs.append(start([tmp_path / f"{n}.csv", "--id-column", "person", "--out", out, "--connect", endpoint,
                                "--name", n, "--parties", "3"], tmp_path / f"{n}.log"))
        codes = [p.wait(ALIGN_DEADLINE_S) for p in procs]
        assert codes == [0, 0, 0], "\n".join(p.output for p in procs)
    finally:
        for p in procs:
            p.stop()
    elapsed = time.monotonic() - started
    agreed = check_aligned(outs, tables, [read_csv(tmp_path / f"{n}.csv")[0] for n in names])
    assert len(agreed) == 2_000
    for p in procs:
        assert f"aligned 2000 common IDs of this party's 10000 rows (3 parties) into" in p.output
    print(f"3 x 10,000 IDs aligned in {elapsed:.2f} s")


def _keys(tmp_path: Path, *names: str) -> Path:
    keys = tmp_path / "keys"
    for name in names:
        keygen(keys, name)
    allow = tmp_path / "allow"
    allow.mkdir()
    for name in names[1:]:
        (allow / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    return keys


def test_curve_over_ipc(tmp_path):
    """Keys given: three parties over ipc with CURVE; a party given another server key is refused and
    every side stops within the deadline with a clear error."""
    rng = random.Random(2)
    sets = overlapping_sets(300, rng)
    names = ["co", "p1", "p2"]
    tables = [write_party(tmp_path / f"{n}.csv", n, ids, rng) for n, ids in zip(names, sets)]
    keys = _keys(tmp_path, "co", "p1", "p2", "stranger")
    outs = [tmp_path / f"{n}.out.csv" for n in names]
    endpoint = f"ipc://{tmp_path}/align.sock"
    procs = [start([tmp_path / "co.csv", "--id-column", "person", "--out", outs[0], "--bind", endpoint, "--parties",
                    "3", "--curve-secret", keys / "co.key_secret", "--allow", tmp_path / "allow"],
                   tmp_path / "co.log")]
    try:
        for n, out in zip(names[1:], outs[1:]):
            procs.append(start([tmp_path / f"{n}.csv", "--id-column", "person", "--out", out, "--connect", endpoint,
                                "--name", n, "--curve-secret", keys / f"{n}.key_secret", "--server-key",
                                keys / "co.key"], tmp_path / f"{n}.log"))
        assert [p.wait(ALIGN_DEADLINE_S) for p in procs] == [0, 0, 0], "\n".join(p.output for p in procs)
        assert "CURVE: encrypted" in procs[0].output
    finally:
        for p in procs:
            p.stop()
    check_aligned(outs, tables, [read_csv(tmp_path / f"{n}.csv")[0] for n in names])

    # The wrong server key: the party cannot complete the handshake, so it never joins.
    outs = [tmp_path / "co2.csv", tmp_path / "p12.csv"]
    procs = [start([tmp_path / "co.csv", "--id-column", "person", "--out", outs[0], "--bind", endpoint + "2",
                    "--parties", "2", "--curve-secret", keys / "co.key_secret", "--allow", tmp_path / "allow",
                    "--peer-deadline", "1.5"], tmp_path / "co2.log"),
             start([tmp_path / "p1.csv", "--id-column", "person", "--out", outs[1], "--connect", endpoint + "2",
                    "--curve-secret", keys / "p1.key_secret", "--server-key", keys / "stranger.key",
                    "--peer-deadline", "1.5"], tmp_path / "p12.log")]
    try:
        assert [p.wait(ALIGN_DEADLINE_S) for p in procs] == [3, 3]
    finally:
        for p in procs:
            p.stop()
    assert "only 0 of the 1 other parties joined within 1.5 s" in procs[0].output
    assert "CURVE" in procs[1].output and "server-key" in procs[1].output
    assert not any(out.exists() for out in outs)


def test_no_common_id_is_an_error_everywhere_and_no_file_is_written(tmp_path):
    rng = random.Random(4)
    names = ["a", "b", "c"]
    sets = [["1", "2", "3"], ["3", "4"], ["1", "4", "5"]]      # every pair shares an ID, no ID is in all three
    for n, ids in zip(names, sets):
        write_party(tmp_path / f"{n}.csv", n, ids, rng)
    ready = tmp_path / "ready"
    procs = [start([tmp_path / "a.csv", "--id-column", "person", "--out", tmp_path / "a.out", "--bind",
                    "tcp://127.0.0.1:*", "--parties", "3", "--ready-file", ready], tmp_path / "a.log")]
    try:
        endpoint = wait_for_file(ready, procs[0])
        procs += [start([tmp_path / f"{n}.csv", "--id-column", "person", "--out", tmp_path / f"{n}.out",
                         "--connect", endpoint, "--name", n], tmp_path / f"{n}.log") for n in names[1:]]
        assert [p.wait(ALIGN_DEADLINE_S) for p in procs] == [1, 1, 1], "\n".join(p.output for p in procs)
    finally:
        for p in procs:
            p.stop()
    for p in procs:
        assert "no ID in common" in p.output
    assert sorted(f.name for f in tmp_path.iterdir()) == sorted(
        [*(f"{n}.csv" for n in names), *(f"{n}.log" for n in names), "ready"])


def test_a_missing_party_and_a_party_count_mismatch_fail_fast(tmp_path):
    """--parties 3 with one party only: the coordinator gives up within the deadline (exit 3) and tells
    the party that came (exit 3). A party started for 4 parties is refused (exit 4), and the coordinator
    stops with a configuration error (exit 2)."""
    rng = random.Random(5)
    for n in ("a", "b"):
        write_party(tmp_path / f"{n}.csv", n, ["1", "2", "3"], rng)
    ready = tmp_path / "ready"
    procs = [start([tmp_path / "a.csv", "--id-column", "person", "--out", tmp_path / "a.out", "--bind",
                    "tcp://127.0.0.1:*", "--parties", "3", "--ready-file", ready, "--peer-deadline", "1.5"],
                   tmp_path / "a.log")]
    try:
        endpoint = wait_for_file(ready, procs[0])
        procs.append(start([tmp_path / "b.csv", "--id-column", "person", "--out", tmp_path / "b.out", "--connect",
                            endpoint, "--name", "b"], tmp_path / "b.log"))
        # ALIGN_DEADLINE_S bounds each wait (a hang guard, 40 times the 1.5 s deadline); the message
        # names the 1.5 s the coordinator kept, which is what "fast" means here, on any machine.
        assert [p.wait(ALIGN_DEADLINE_S) for p in procs] == [3, 3], "\n".join(p.output for p in procs)
    finally:
        for p in procs:
            p.stop()
    assert "only 1 of the 2 other parties joined within 1.5 s (joined: b)" in procs[0].output
    assert "the coordinator gave up" in procs[1].output

    ready.unlink()
    procs = [start([tmp_path / "a.csv", "--id-column", "person", "--out", tmp_path / "a.out", "--bind",
                    "tcp://127.0.0.1:*", "--parties", "3", "--ready-file", ready], tmp_path / "a2.log")]
    try:
        endpoint = wait_for_file(ready, procs[0])
        procs.append(start([tmp_path / "b.csv", "--id-column", "person", "--out", tmp_path / "b.out", "--connect",
                            endpoint, "--parties", "4"], tmp_path / "b2.log"))
        assert [p.wait(ALIGN_DEADLINE_S) for p in procs] == [2, 4], "\n".join(p.output for p in procs)
    finally:
        for p in procs:
            p.stop()
    assert "was started for 4 parties, this coordinator for 3" in procs[0].output
    assert "was started for 4 parties, this coordinator for 3" in procs[1].output
    assert not (tmp_path / "a.out").exists() and not (tmp_path / "b.out").exists()


class FakeParty:
    """A party speaking the wire by hand over a DEALER: joins, then does what the test says."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: wire.Message) -> None:
        self.sock.send_multipart(wire.encode(msg))

    def receive(self, timeout_s: float = 10.0) -> wire.Message:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = wire.decode(self.sock.recv_multipart())
                if msg.type != wire.PING:
                    return msg
        raise AssertionError(f"no message within {timeout_s} s")


@pytest.mark.parametrize("behaviour", ["silent", "garbage", "wrong_count"])
def test_a_party_that_falls_silent_or_misbehaves_stops_everyone_cleanly(tmp_path, zmq_ctx, behaviour):
    """A party that joins and then goes silent (as if killed) makes the coordinator give up within the
    deadline, naming it (exit 3), and the honest party too; one that sends a bad list is refused (exit 4)."""
    rng = random.Random(6)
    for n in ("a", "b"):
        write_party(tmp_path / f"{n}.csv", n, [str(i) for i in range(50)], rng)
    ready = tmp_path / "ready"
    # Mallory's silence counts from its join, before b's process starts: on a busy machine that start alone
    # can outlast 1.5 s, so a bad message is sent under a deadline it cannot miss.
    deadline = "1.5" if behaviour == "silent" else "30"
    coordinator = start([tmp_path / "a.csv", "--id-column", "person", "--out", tmp_path / "a.out", "--bind",
                         "tcp://127.0.0.1:*", "--parties", "3", "--ready-file", ready, "--peer-deadline", deadline],
                        tmp_path / "a.log")
    honest = None
    try:
        endpoint = wait_for_file(ready, coordinator)
        fake = FakeParty(zmq_ctx, endpoint)
        fake.send(wire.Message(wire.ALIGN_JOIN, "", 0, body={"name": "mallory", "rows": 3, "parties": 3}))
        welcome = fake.receive()
        assert welcome.type == wire.WELCOME and welcome.body == {"parties": 3, "index": 1}
        honest = start([tmp_path / "b.csv", "--id-column", "person", "--out", tmp_path / "b.out", "--connect",
                        endpoint, "--name", "b"], tmp_path / "b.log")
        wait_for_text(coordinator, "party b joined")
        if behaviour == "garbage":
            fake.sock.send_multipart([b"\xc1 not msgpack"])
        elif behaviour == "wrong_count":
            values = np.zeros((5, 4), np.int64)          # announced 3 rows
            fake.send(wire.Message(wire.ALIGN_VALUES, welcome.run, 0, tensors={"values": values}))
        codes = [coordinator.wait(ALIGN_DEADLINE_S), honest.wait(ALIGN_DEADLINE_S)]
        error = fake.receive()
        assert error.type == wire.ERROR
    finally:
        coordinator.stop()
        if honest is not None:
            honest.stop()
    if behaviour == "silent":
        assert codes == [3, 3], coordinator.output + honest.output
        assert "party mallory sent nothing for 1.5 s" in coordinator.output
        assert error.body["code"] == "timeout"
    else:
        assert codes == [4, 4], coordinator.output + honest.output
        assert "party mallory" in coordinator.output
        assert {"garbage": "undecodable", "wrong_count": "5 values, expected 3"}[behaviour] in coordinator.output
    assert not (tmp_path / "a.out").exists() and not (tmp_path / "b.out").exists()


class DishonestParty(StageProcess):
    """``tests/align_dishonest.py VARIANT ARGS``: a party that breaks the protocol in one answer."""

    def __init__(self, variant: str, args: list, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "align_dishonest.py"), variant,
                                      *map(str, args)], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=pinned_env())


@pytest.mark.parametrize("variant", ["reorder", "unshuffle"])
def test_a_dishonest_party_cannot_misalign_the_others(tmp_path, variant):
    """The issue's two dishonest parties, each joining second of three: one returns party 1's list
    encrypted honestly but reversed (party 1 would write rows outside the intersection), one answers
    "undo your shuffle" with other valid positions (the coordinator would). The parties compare digests
    of their aligned IDs before anyone writes: every party exits 4 and no file is written."""
    rng = random.Random(21)
    sets = overlapping_sets(300, rng)
    names = ["labels", "bank", "mallory"]
    for n, ids in zip(names, sets):
        write_party(tmp_path / f"{n}.csv", n, ids, rng)
    outs = [tmp_path / f"{n}.aligned.csv" for n in names]
    ready = tmp_path / "ready"
    procs = [start([tmp_path / "labels.csv", "--id-column", "person", "--out", outs[0], "--bind",
                    "tcp://127.0.0.1:*", "--parties", "3", "--ready-file", ready], tmp_path / "labels.log")]
    try:
        endpoint = wait_for_file(ready, procs[0])
        procs.append(start([tmp_path / "bank.csv", "--id-column", "person", "--out", outs[1], "--connect", endpoint,
                            "--name", "bank"], tmp_path / "bank.log"))
        wait_for_text(procs[0], "party bank joined")                 # bank is party 1, mallory party 2
        procs.append(DishonestParty(variant, [tmp_path / "mallory.csv", "--id-column", "person", "--out", outs[2],
                                              "--connect", endpoint, "--name", "mallory"], tmp_path / "mallory.log"))
        codes = [p.wait(ALIGN_DEADLINE_S) for p in procs]
    finally:
        for p in procs:
            p.stop()
    output = "\n".join(p.output for p in procs)
    assert codes == [4, 4, 4], output
    wrong = {"reorder": "bank", "unshuffle": "bank, mallory"}[variant]    # who differs from the coordinator
    assert f"the aligned ID lists differ: {wrong} ended with other IDs" in procs[0].output, output
    assert "no party writes its file" in procs[1].output, output
    assert not any(out.exists() for out in outs)


def test_a_bad_value_is_named_by_its_index_in_the_whole_list():
    """A low-order point past the first chunk is named by its place in the list, not in its chunk."""
    good = al.hash_ids(["alice"])[0]
    values = [good] * (al.CHUNK_IDS + 5) + [bytes(32)]
    with pytest.raises(ProtocolError, match=f"value {al.CHUNK_IDS + 5} of a list of {al.CHUNK_IDS + 6} is a "
                                            f"low-order point"):
        al.encrypt(values, al.new_key())


def test_a_party_gives_its_last_message_the_peer_deadline_to_leave(tmp_path, monkeypatch):
    """The bye is a party's last message and has no reply: its socket is closed with a linger of the peer
    deadline, not the default 200 ms that dropped it under load (the coordinator then waited out its deadline
    for a bye the party had sent, and exited 3 with no file). Real sockets; only the close is observed."""
    import threading
    rng = random.Random(3)
    ids = [f"id{i}" for i in range(50)]
    for name in ("a", "b"):
        write_party(tmp_path / f"{name}.csv", name, ids, rng)
    closes: list[int] = []
    close = al.Client.close
    monkeypatch.setattr(al.Client, "close", lambda self, linger_ms=200: (closes.append(linger_ms),
                                                                          close(self, linger_ms))[1])
    ready = tmp_path / "ready"
    coordinator = al.AlignOptions(tmp_path / "a.csv", "person", tmp_path / "a.out.csv", bind="tcp://127.0.0.1:*",
                                  parties=2, ready_file=ready, peer_deadline_s=20.0)
    results: dict[str, object] = {}
    thread = threading.Thread(target=lambda: results.update(a=al.align(coordinator)), daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline and thread.is_alive(), "the coordinator did not bind"
        time.sleep(0.02)
    party = al.AlignOptions(tmp_path / "b.csv", "person", tmp_path / "b.out.csv", connect=ready.read_text(),
                            name="b", parties=2, peer_deadline_s=7.5)
    assert al.align(party).common == 50
    thread.join(20)
    assert results["a"].common == 50 and closes == [7500]
