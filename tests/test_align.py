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



def test_the_documented_agreed_order_is_the_order_the_files_are_written_in():
    """docs/security.md says what order the aligned files hold (what a party learns from it): ascending ID
    text, not the order of the encrypted values, which is what ``_agreed_rows`` does."""
    table = al.Table(Path("t.csv"), ["id", "x"], [["b", "1"], ["c", "2"], ["a", "3"]], 0)
    assert [table.rows[i][0] for i in al._agreed_rows(table, [2, 0, 1])] == ["a", "b", "c"]
    text = (Path(__file__).parent.parent / "docs" / "security.md").read_text()
    section = text.split("## Aligning the parties' rows")[1].split("\n## ")[0]
    flat = " ".join(section.split())
    assert "The agreed order is the order of the fully encrypted common values" not in flat
    assert "by ascending ID text, the agreed order its file is written and trained in" in flat

def test_digests_are_bound_to_their_sender_and_tags_to_both_ends():
    """A digest names its sender, so a party's own digest never passes for another's; a tag from A to B is
    what B computes with its own secret and A's public key, and neither B to A's nor C's."""
    from nacl.bindings import crypto_scalarmult_base
    ids = ["alice", "bob"]
    digests = {s: al.aligned_digest("0123456789abcdef", s, ids) for s in range(3)}
    assert len(set(digests.values())) == 3
    assert al.aligned_digest("0123456789abcdef", 1, ids) != al.aligned_digest("0123456789abcdee", 1, ids)
    assert al.aligned_digest("0123456789abcdef", 1, ids) != al.aligned_digest("0123456789abcdef", 1, ids[::-1])
    secrets_ = [al.new_key() for _ in range(3)]
    public = [crypto_scalarmult_base(k) for k in secrets_]
    a_to_b = al.digest_tag(secrets_[0], public[1], public[0], public[1], digests[1])
    assert a_to_b == al.digest_tag(secrets_[1], public[0], public[0], public[1], digests[1])     # B checks it
    assert a_to_b != al.digest_tag(secrets_[1], public[0], public[1], public[0], digests[1])     # B to A
    assert a_to_b != al.digest_tag(secrets_[2], public[1], public[0], public[1], digests[1])     # C forging
    assert a_to_b != al.digest_tag(secrets_[0], public[1], public[0], public[1], digests[2])


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


def test_ids_that_match_only_an_identical_spelling_are_named_and_kept_as_they_are(tmp_path, caplog):
    """IDs are exact text, so ' 7' never matches another party's '7', nor 'Jose' + a combining accent its
    'José': the party is warned (how many, the first one and its line), its IDs unchanged; clean IDs, none."""
    import logging
    import unicodedata
    path = tmp_path / "p.csv"
    decomposed = unicodedata.normalize("NFD", "José")
    path.write_text(f"id,b\n1,2\n 7,3\n8 ,4\n{decomposed},5\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="distgrad.align"):
        table = al.read_table(path, "id")
    assert table.ids == ["1", " 7", "8 ", decomposed]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2, warned
    assert "2 of 4 IDs have spaces around them, the first ' 7' on line 3" in warned[0]
    assert "1 of 4 IDs are not in Unicode NFC form" in warned[1] and "'Jose\\u0301' on line 5" in warned[1]
    caplog.clear()
    path.write_text("id,b\n1,2\nJosé,3\n", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="distgrad.align"):
        al.read_table(path, "id")
    assert not caplog.records


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
        # A folder as --out: refused now, not once the protocol is done (the coordinator failed there, with a
        # traceback, after the other parties had written their files).
        ([good, "--id-column", "id", "--out", tmp_path, "--bind", "tcp://127.0.0.1:*", "--parties", "2"],
         "is not a file"),
        ([good, "--id-column", "id", "--out", tmp_path, "--connect", "tcp://127.0.0.1:5"], "is not a file"),
        ([good, "--id-column", "nope", "--out", out, "--connect", "tcp://127.0.0.1:5"], "no column named 'nope'"),
        ([dup, "--id-column", "person", "--out", out, "--connect", "tcp://127.0.0.1:5"],
         "ID 'p1' appears twice in column 'person', on lines 2 and 4"),
        ([tmp_path / "missing.csv", "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:5"],
         "cannot read"),
        ([good, "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:5", "--server-key", good],
         "CURVE needs"),
        ([good, "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:5", "--min-common", "0"],
         "--min-common must be a whole number from 1"),
        ([good, "--id-column", "id", "--out", out, "--bind", "tcp://127.0.0.1:*", "--parties", "2", "--party-keys",
          tmp_path], "--party-keys is for a party that connects"),
        ([good, "--id-column", "id", "--out", out, "--connect", "tcp://127.0.0.1:5", "--party-keys", tmp_path],
         "--party-keys needs CURVE"),
    ]
    for args, message in cases:
        result = run_main(["align", *args])
        assert result.returncode == 2, (args, result)
        assert message in result.stderr, (message, result.stderr)
    assert not out.exists()


# ---------------------------------------------------------------- processes

@pytest.mark.slow     # at scale; three parties of a few hundred IDs align in test_three_parties_with_party_keys_align
def test_three_parties_of_10000_ids_agree_row_for_row(tmp_path):
    """Three real processes over tcp, 10,000 IDs each, partial overlaps, rows in different
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
        assert "aligned 2000 common IDs of this party's 10000 rows (3 parties) into" in p.output
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
        # Without --party-keys a party cannot tell the other party's digest from one the coordinator made.
        assert all("no --party-keys, so the other party's digest cannot be checked" in p.output
                   for p in procs[1:])
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
                    "tcp://127.0.0.1:*", "--parties", "3", "--ready-file", ready, "--name", "hospital-a"],
                   tmp_path / "a.log")]
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
        assert "(hospital-a 3, " in p.output, p.output     # the coordinator's --name, not ignored (then b, c as they joined)
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
        fake.send(wire.Message(wire.ALIGN_JOIN, "", 0, body={"name": "mallory", "rows": 3, "parties": 3,
                                                             "version": al.ALIGN_VERSION}))
        welcome = fake.receive()
        assert welcome.type == wire.WELCOME and welcome.body == {"parties": 3, "index": 1,
                                                                 "version": al.ALIGN_VERSION}
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
    """Two dishonest parties, each joining second of three: one returns party 1's list
    encrypted honestly but reversed (party 1 would write rows outside the intersection), one answers
    "undo your shuffle" with other valid positions (the coordinator would). The parties compare digests
    of their aligned IDs before anyone writes: a party whose rows differ from the coordinator's refuses the
    coordinator's commitment, every party exits 4 and no file is written."""
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
    # reorder: bank's rows are wrong; unshuffle: the coordinator's are, so the first party to answer refuses
    refusing = ["bank"] if variant == "reorder" else ["bank", "mallory"]
    assert any(f"party {name} failed: mismatch: the coordinator's digest does not match" in procs[0].output
               for name in refusing), output
    assert "digest does not match" in procs[1].output or "the coordinator stopped" in procs[1].output, output
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


# ---------------------------------------------------------------- a dishonest coordinator

class DishonestCoordinator(StageProcess):
    """``tests/align_dishonest.py VARIANT RECORD ARGS``: a coordinator that attacks party 1 (the victim)."""

    def __init__(self, variant: str, record: Path, args: list, log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "align_dishonest.py"), variant,
                                      str(record), *map(str, args)], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=pinned_env())


def attack_sets(parties: int, common: int, victim_private: int) -> list[list[str]]:
    """The coordinator's, the victim's and (for 3 parties) party 2's IDs: ``common`` IDs all hold, the victim
    ``victim_private`` more that no other party holds, the others some of their own."""
    shared = [f"person-{i:04d}" for i in range(common)]
    sets = [shared + [f"coordinator-only-{i}" for i in range(60)],
            shared + [f"victim-only-{i}" for i in range(victim_private)]]
    if parties == 3:
        sets.append(shared + [f"other-only-{i}" for i in range(60)])
    return sets


def attack(tmp_path: Path, variant: str, sets: list[list[str]], keys: bool = False,
           victim_args: tuple = ()) -> tuple[list[int], list[StageProcess], dict]:
    """A dishonest coordinator running ``variant`` against honest parties (real processes, tcp or, with keys,
    CURVE over tcp); party 1 joins first. Returns the honest parties' exit codes, all processes (the
    coordinator first) and the coordinator's record of what the parties sent it."""
    rng = random.Random(19)
    names = ["coordinator", "victim", "other"][:len(sets)]
    for n, ids in zip(names, sets):
        write_party(tmp_path / f"{n}.csv", n, ids, rng)
    ready, record = tmp_path / "ready", tmp_path / "record.json"
    coordinator_keys: list = []
    party_keys: dict[str, list] = {n: [] for n in names[1:]}
    if keys:
        key_dir = _keys(tmp_path, *names)
        coordinator_keys = ["--curve-secret", key_dir / "coordinator.key_secret", "--allow", tmp_path / "allow"]
        party_keys = {n: ["--curve-secret", key_dir / f"{n}.key_secret", "--server-key", key_dir / "coordinator.key",
                          "--party-keys", tmp_path / "allow"] for n in names[1:]}
    procs: list[StageProcess] = [DishonestCoordinator(variant, record, [
        tmp_path / "coordinator.csv", "--id-column", "person", "--out", tmp_path / "coordinator.out", "--bind",
        "tcp://127.0.0.1:*", "--parties", str(len(sets)), "--ready-file", ready, "--peer-deadline", "30",
        *coordinator_keys], tmp_path / "coordinator.log")]
    try:
        endpoint = wait_for_file(ready, procs[0])
        for n in names[1:]:
            procs.append(start([tmp_path / f"{n}.csv", "--id-column", "person", "--out", tmp_path / f"{n}.out",
                                "--connect", endpoint, "--name", n, "--peer-deadline", "30", *party_keys[n],
                                *(victim_args if n == "victim" else ())], tmp_path / f"{n}.log"))
            wait_for_text(procs[0], f"party {n} joined")           # the victim is party 1
        codes = [p.wait(ALIGN_DEADLINE_S) for p in procs[1:]]
        procs[0].wait(ALIGN_DEADLINE_S)
    finally:
        for p in procs:
            p.stop()
    import json
    return codes, procs, json.loads(record.read_text())


def answers_to_final(record: dict, index: int) -> list[dict]:
    """The messages party ``index`` sent the coordinator after its answer to "undo your shuffle": what it
    said to its final positions and the coordinator's commitment."""
    sent = [m for m in record["messages"] if m["party"] == index]
    last = max(i for i, m in enumerate(sent) if m["type"] == wire.ALIGN_POSITIONS)
    return sent[last + 1:]


@pytest.mark.parametrize("parties", [2, 3])
def test_a_coordinator_that_echoes_a_party_s_digest_cannot_make_it_write_rows_outside_the_intersection(
        tmp_path, parties):
    """The victim holds 106 IDs, 55 of them common. The coordinator names all 106 rows as common and would
    send the victim's own digest back as its own (and every other party's): that made an honest party write
    51 rows outside the intersection and exit 0. Now the coordinator must commit first to the IDs it names,
    which it cannot for IDs it does not hold: the victim refuses (exit 4), writes nothing and never sends
    its digest, so there is nothing to echo."""
    codes, procs, record = attack(tmp_path, "echo", attack_sets(parties, 55, 51))
    output = "\n".join(p.output for p in procs)
    assert codes[0] == 4, output
    assert "the coordinator's digest does not match the 106 rows it asked party victim to write" in procs[1].output
    assert not (tmp_path / "victim.out").exists()
    answers = answers_to_final(record, 1)
    assert [m["type"] for m in answers] == ["error"] and answers[0]["body"]["code"] == "mismatch", answers
    assert not any(m["type"] == wire.ALIGN_DIGEST for m in record["messages"] if m["party"] == 1)


@pytest.mark.parametrize("keys", [False, True])
def test_a_party_s_own_digest_relayed_back_as_another_s_is_refused(tmp_path, keys):
    """Three parties, honest positions and commitments; then the coordinator relays to the victim its own
    digest (with keys, its own tag for party 2) as party 2's. A digest is bound to its sender: the victim
    exits 4 and writes nothing."""
    codes, procs, record = attack(tmp_path, "reflect", attack_sets(3, 40, 10), keys=keys)
    output = "\n".join(p.output for p in procs)
    assert codes[0] == 4, output
    assert "party 2's digest, as the coordinator relays it, is not of the 40 IDs party victim holds" \
        in procs[1].output, output
    assert not (tmp_path / "victim.out").exists()


def test_another_party_s_digest_relayed_as_the_coordinator_s_is_refused(tmp_path):
    """The coordinator lets party 2 answer first and sends its digest to the victim as its own commitment.
    Digests are bound to their sender: the victim refuses (exit 4, no file) without sending its own, and
    the coordinator's abort stops party 2 (exit 4)."""
    codes, procs, record = attack(tmp_path, "relay", attack_sets(3, 40, 10))
    output = "\n".join(p.output for p in procs)
    assert codes == [4, 4], output
    assert "the coordinator's digest does not match the 40 rows it asked party victim to write" \
        in procs[1].output, output
    assert not (tmp_path / "victim.out").exists() and not (tmp_path / "other.out").exists()
    assert [m["type"] for m in answers_to_final(record, 1)] == ["error"]


def test_with_party_keys_a_coordinator_cannot_forge_another_party_s_digest(tmp_path):
    """Three parties with CURVE and --party-keys. Party 2 never answers; the coordinator relays to the victim
    a digest of the victim's rows it computed itself as party 2's, tagged with the only secret it holds (its
    own). The victim checks party 2's tag against party 2's public key and refuses (exit 4, no file)."""
    codes, procs, record = attack(tmp_path, "forge", attack_sets(3, 40, 10), keys=True)
    output = "\n".join(p.output for p in procs)
    assert codes[0] == 4, output
    assert "party 2's digest is not tagged by the holder of key" in procs[1].output, output
    assert not (tmp_path / "victim.out").exists()
    assert not (tmp_path / "other.out").exists()


def test_without_party_keys_a_coordinator_can_speak_for_another_party(tmp_path):
    """The documented limit (docs/security.md): in plaintext nothing tells the victim party 2's digest from
    one the coordinator computed, so the forgery passes when the coordinator holds the IDs it names (here the
    true intersection, so the victim's file is still right; party 2 never confirmed it)."""
    codes, procs, _ = attack(tmp_path, "forge", attack_sets(3, 40, 10))
    assert codes[0] == 0, "\n".join(p.output for p in procs)
    assert len(read_csv(tmp_path / "victim.out")) == 41


@pytest.mark.parametrize("parties", [2, 3])
def test_a_coordinator_asking_for_99_shared_rows_and_one_unknown_gets_no_oracle(tmp_path, parties):
    """The coordinator names 99 common rows and one it does not know, and commits to the 99 plus a guess.
    The victim refuses (exit 4, no file) and answers only "mismatch": nothing it sends after the final
    positions is a value computed from its hundredth ID, so the coordinator has nothing to brute-force
    offline. The check: every digest the victim could have sent of those 100 IDs (as any sender, and as the
    previous protocol did) for every ID the victim holds outside the intersection appears nowhere in what
    it sent."""
    import hashlib
    sets = attack_sets(parties, 100, 51)
    codes, procs, record = attack(tmp_path, "guess", sets)
    output = "\n".join(p.output for p in procs)
    assert codes[0] == 4, output
    assert "the coordinator's digest does not match the 100 rows it asked party victim to write" in procs[1].output
    assert not (tmp_path / "victim.out").exists()
    answers = answers_to_final(record, 1)
    assert [m["type"] for m in answers] == ["error"] and answers[0]["body"]["code"] == "mismatch", answers
    sent = repr(answers)
    run, shared = record["run"], sorted(sets[1][:100])
    for unknown in sets[1][100:]:
        for k in range(100):                           # whichever of the 100 common rows the coordinator dropped
            ids = sorted(shared[:k] + shared[k + 1:] + [unknown])
            candidates = [al.aligned_digest(run, s, ids) for s in range(parties)]
            v1 = hashlib.sha256(b"distgrad-align-ids-v1\x00" + run.encode() + len(ids).to_bytes(8, "little"))
            for key in ids:
                v1.update(len(key.encode()).to_bytes(8, "little") + key.encode())
            candidates.append(v1.hexdigest())
            assert not any(c in sent for c in candidates)
    assert not (tmp_path / "coordinator.out").exists()


@pytest.mark.parametrize("parties", [2, 3])
def test_a_one_row_intersection_is_refused_even_with_a_correct_commitment(tmp_path, parties):
    """The coordinator asks every party to undo its shuffle of one common position and to write that one row,
    committing correctly to its ID: below --min-common (default 10) every party refuses before it sends any
    digest (exit 1, no file)."""
    codes, procs, record = attack(tmp_path, "one_row", attack_sets(parties, 40, 10))
    output = "\n".join(p.output for p in procs)
    assert codes == [1] * (parties - 1), output
    assert "fewer than --min-common 10" in output
    assert not any(m["type"] == wire.ALIGN_DIGEST for m in record["messages"])
    assert not any((tmp_path / f"{n}.out").exists() for n in ("victim", "other"))


def test_min_common_refuses_small_intersections_and_can_be_lowered(tmp_path):
    """Honest parties with 5 common IDs: refused under the default --min-common 10 (every party exits 1, no
    file), aligned with --min-common 5; a party asking for more than the coordinator refuses for everyone."""
    rng = random.Random(8)
    ids = {"a": [str(i) for i in range(8)], "b": [str(i) for i in range(3, 12)]}      # 3..7 common
    for n, own in ids.items():
        write_party(tmp_path / f"{n}.csv", n, own, rng)

    def run(tag: str, a_args: list, b_args: list) -> tuple[list[int], list[StageProcess]]:
        ready = tmp_path / f"ready-{tag}"
        procs = [start([tmp_path / "a.csv", "--id-column", "person", "--out", tmp_path / f"a-{tag}.out", "--bind",
                        "tcp://127.0.0.1:*", "--parties", "2", "--ready-file", ready, *a_args], tmp_path / f"a-{tag}.log")]
        try:
            endpoint = wait_for_file(ready, procs[0])
            procs.append(start([tmp_path / "b.csv", "--id-column", "person", "--out", tmp_path / f"b-{tag}.out",
                                "--connect", endpoint, *b_args], tmp_path / f"b-{tag}.log"))
            return [p.wait(ALIGN_DEADLINE_S) for p in procs], procs
        finally:
            for p in procs:
                p.stop()

    codes, procs = run("default", [], [])
    assert codes == [1, 1], "\n".join(p.output for p in procs)
    assert "only 5 IDs are common to the 2 parties, fewer than --min-common 10" in procs[0].output
    codes, procs = run("lowered", ["--min-common", "5"], ["--min-common", "5"])
    assert codes == [0, 0], "\n".join(p.output for p in procs)
    assert [line[1] for line in read_csv(tmp_path / "b-lowered.out")[1:]] == ["3", "4", "5", "6", "7"]
    codes, procs = run("party", ["--min-common", "5"], ["--min-common", "6"])
    assert codes == [1, 1], "\n".join(p.output for p in procs)
    assert "fewer than --min-common 6" in procs[1].output
    assert not any((tmp_path / f"{n}-{t}.out").exists() for n in "ab" for t in ("default", "party"))


def test_three_parties_with_party_keys_align(tmp_path):
    """CURVE with --party-keys on every party: each party's digest is tagged for every other party, and
    the honest alignment agrees row for row."""
    rng = random.Random(12)
    sets = overlapping_sets(200, rng)
    names = ["co", "p1", "p2"]
    tables = [write_party(tmp_path / f"{n}.csv", n, ids, rng) for n, ids in zip(names, sets)]
    keys = _keys(tmp_path, *names)
    outs = [tmp_path / f"{n}.out.csv" for n in names]
    ready = tmp_path / "ready"
    procs = [start([tmp_path / "co.csv", "--id-column", "person", "--out", outs[0], "--bind", "tcp://127.0.0.1:*",
                    "--parties", "3", "--ready-file", ready, "--curve-secret", keys / "co.key_secret", "--allow",
                    tmp_path / "allow"], tmp_path / "co.log")]
    try:
        endpoint = wait_for_file(ready, procs[0])
        for n, out in zip(names[1:], outs[1:]):
            procs.append(start([tmp_path / f"{n}.csv", "--id-column", "person", "--out", out, "--connect", endpoint,
                                "--name", n, "--curve-secret", keys / f"{n}.key_secret", "--server-key",
                                keys / "co.key", "--party-keys", tmp_path / "allow"], tmp_path / f"{n}.log"))
        assert [p.wait(ALIGN_DEADLINE_S) for p in procs] == [0, 0, 0], "\n".join(p.output for p in procs)
    finally:
        for p in procs:
            p.stop()
    check_aligned(outs, tables, [read_csv(tmp_path / f"{n}.csv")[0] for n in names])
    assert not any("no --party-keys" in p.output for p in procs)


def test_party_keys_that_are_not_usable_exit_2_before_anything_connects(tmp_path):
    good = tmp_path / "a.csv"
    good.write_text("id,x\n1,2\n")
    keys = _keys(tmp_path, "co", "p1")
    curve = ["--curve-secret", keys / "p1.key_secret", "--server-key", keys / "co.key"]
    own_only = tmp_path / "own"
    own_only.mkdir()
    (own_only / "p1.key").write_bytes((keys / "p1.key").read_bytes())
    (own_only / "co.key").write_bytes((keys / "co.key").read_bytes())
    cases = [(tmp_path / "missing", "is not a directory"), (tmp_path / "own" / "p1.key", "is not a directory"),
             (tmp_path / "allow" / ".." / "own", "holds only this party's or the coordinator's key"),
             (tmp_path / "keys" / "none", "is not a directory")]
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", "holds no *.key files"))
    low_order = tmp_path / "low"                   # the zero point: X25519 with it is refused
    low_order.mkdir()
    from zmq.utils import z85
    text = (keys / "co.key").read_text()
    zero = z85.encode(bytes(32)).decode()
    (low_order / "zero.key").write_text(text.replace(text.split('public-key = "')[1].split('"')[0], zero))
    cases.append((low_order, "holds no usable public key"))
    keygen(tmp_path / "others", "p2")               # a usable key, but other users may swap it or add one
    (tmp_path / "others").chmod(0o777)
    cases.append((tmp_path / "others", "others is writable by other users"))
    keygen(tmp_path / "loose", "p2")
    (tmp_path / "loose" / "p2.key").chmod(0o620)
    cases.append((tmp_path / "loose", "p2.key is writable by other users"))
    for directory, message in cases:
        result = run_main(["align", good, "--id-column", "id", "--out", tmp_path / "o.csv", "--connect",
                           "tcp://127.0.0.1:5", *curve, "--party-keys", directory])
        assert result.returncode == 2 and message in result.stderr, (directory, result)
    assert not (tmp_path / "o.csv").exists()


def test_an_old_party_and_an_old_coordinator_are_refused_with_the_version(tmp_path, zmq_ctx):
    """The parties check each other's digests in a new order (align protocol 2): a join without the version
    (an older distgrad) is refused with an error naming both versions and the coordinator exits 2; a party
    whose coordinator's welcome carries no version exits 4 naming them, before it sends any list."""
    rng = random.Random(9)
    write_party(tmp_path / "a.csv", "a", [str(i) for i in range(20)], rng)
    ready = tmp_path / "ready"
    coordinator = start([tmp_path / "a.csv", "--id-column", "person", "--out", tmp_path / "a.out", "--bind",
                         "tcp://127.0.0.1:*", "--parties", "2", "--ready-file", ready], tmp_path / "a.log")
    try:
        fake = FakeParty(zmq_ctx, wait_for_file(ready, coordinator))
        fake.send(wire.Message(wire.ALIGN_JOIN, "", 0, body={"name": "old", "rows": 20, "parties": 2}))
        error = fake.receive()
        assert coordinator.wait(ALIGN_DEADLINE_S) == 2
    finally:
        coordinator.stop()
    assert error.type == wire.ERROR and error.body["code"] == "version", error
    assert "party 'old' speaks align protocol 1, this coordinator 2" in error.body["message"]
    assert "party 'old' speaks align protocol 1, this coordinator 2" in coordinator.output

    router = zmq_ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    party = start([tmp_path / "a.csv", "--id-column", "person", "--out", tmp_path / "b.out", "--connect",
                   f"tcp://127.0.0.1:{port}", "--peer-deadline", "20"], tmp_path / "b.log")
    try:
        assert router.poll(20_000), party.output
        envelope, *frames = router.recv_multipart()
        join = wire.decode(frames)
        assert join.type == wire.ALIGN_JOIN and join.body["version"] == al.ALIGN_VERSION
        router.send_multipart([envelope, *wire.encode(wire.Message(wire.WELCOME, "0123456789abcdef", 0,
                                                                   body={"parties": 2, "index": 1}))])
        assert party.wait(ALIGN_DEADLINE_S) == 4, party.output
        sent = []
        while router.poll(2000):
            sent.append(wire.decode(router.recv_multipart()[1:]))
    finally:
        party.stop()
        router.close(0)
    assert "the coordinator speaks align protocol 1, this party 2" in party.output
    assert [m.type for m in sent if m.type != wire.PING] == [wire.ERROR]
    assert not (tmp_path / "b.out").exists()


def test_aligned_rows_to_a_device_or_fifo_are_written_into_it_never_replaced(tmp_path):
    """``align --out /dev/null`` (shown with a FIFO, which a test may make) writes into the device: the atomic
    rename of a temporary file would put a regular file where the device was."""
    import os
    import select
    import stat

    path = tmp_path / "t.csv"
    path.write_text("id,x\nb,2\na,1\n")
    table = al.read_table(path, "id")
    fifo = tmp_path / "aligned.csv"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        al.write_aligned(table, [0, 1], fifo)
        assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a file"
        assert select.select([reader], [], [], 5.0)[0], "nothing was written into the FIFO"
        assert os.read(reader, 1 << 16).decode().splitlines()[0] == "id,x"
    finally:
        os.close(reader)


def test_repeated_joins_under_a_taken_name_keep_the_coordinator_bounded(zmq_ctx):
    """A sender that keeps joining under a name already taken is refused each time, and the coordinator keeps
    one line per name with a count: its list of refusals (named by its timeout's message) grew by one entry per
    attempt, without bound."""
    from distgrad.wire.transport import Server

    server = Server(zmq_ctx, "tcp://127.0.0.1:*")
    try:
        coord = al._Coordinator(server, 3, 60.0, lambda: None, 1 << 20)

        def join(routing_id: bytes, name: str) -> None:
            coord.join([routing_id], wire.Message(wire.ALIGN_JOIN, "", 0, body={
                "name": name, "rows": 5, "parties": 3, "version": al.ALIGN_VERSION}))

        join(b"first", "p1")
        for i in range(500):
            join(b"again%d" % i, "p1")
        assert len(coord.parties) == 1 and coord.joining
        assert coord.refused == {"a second party named 'p1'": 500}
        coord.started -= 61.0
        with pytest.raises(Exception, match=r"refused: a second party named 'p1' \(500 times\)\);"):
            coord.check_deadlines(time.monotonic())
    finally:
        server.close(0)
