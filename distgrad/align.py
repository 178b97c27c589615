"""Private alignment of vertical parties' rows by an ID column (``distgrad align``).

Several parties hold different columns of the same people, each a CSV file
with a header row and an ID column. ``align`` leaves every party with its own
rows of the IDs that all parties hold, in one agreed order, and shows no party
an ID outside that common set. docs/security.md (*Aligning the parties' rows*)
says exactly what each party learns; docs/protocol.md lists the messages.

The protocol is Diffie-Hellman private set intersection, for n parties in a
star. One party, the coordinator (index 0), binds; the others connect and are
numbered 1 to n-1 in the order they join. Every message goes through the
coordinator. Each party ``i`` hashes its IDs onto Curve25519 and encrypts them
with its own secret key: ``E_k(x) = X25519(k, H(x))``. These maps commute, so a
value encrypted by every party's key is the same whichever order the keys were
applied in, and equal values mean equal IDs.

0. Party ``i`` sends its list ``L_i``: its encrypted IDs in an order of its
   own, a secret random permutation (it keeps the map position -> row).
1. In round ``r`` = 1 .. n-1, list ``L_i`` is at party ``(i + r) mod n``, which
   applies its key and keeps the order, except that every party that handles
   the coordinator's own list ``L_0`` also shuffles it with a fresh secret
   permutation: otherwise the coordinator could tell which of its own IDs a
   party holds (``L_0`` under keys {0..m} and ``L_1`` under keys {1..m} differ
   by the coordinator's key alone).
2. The coordinator intersects the fully encrypted lists and sorts the common
   values: that is the agreed order. For each list it finds the positions of
   the common values in that order; those of ``L_0`` travel back through
   parties n-1 .. 1, each undoing its shuffle.
3. Each party receives its positions and maps them to its rows through its
   permutation: its rows of the common IDs, sorted by ID (the order every
   party then trains in: all of them know the common IDs, so sorting tells
   nobody anything new, and the file does not depend on the keys).
4. Every party sends the coordinator the SHA-256 of its aligned ID list
   (``aligned_digest``: the run id, then the IDs in the agreed order); the
   coordinator compares them with its own and answers each party with its
   digest, which the party compares with its own. Only then does any party
   write its file. A party that encrypted a list in another order than it
   was given, or undid its shuffle wrongly, leaves some party with other
   rows, so the digests differ and every party exits non-zero, writing
   nothing. The digest tells no party anything new: all of them know the
   common IDs once the protocol succeeds.

The curve is libsodium's (through PyNaCl): ``crypto_core_ed25519_from_uniform``
(Elligator 2) twice and ``crypto_core_ed25519_add`` hash an ID onto the
prime-order subgroup, as RFC 9380's random-oracle construction does;
``crypto_sign_ed25519_pk_to_curve25519`` gives that point's X25519
u-coordinate; ``crypto_scalarmult`` is X25519. No curve arithmetic is written
here.
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import secrets
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import zmq

from distgrad.wire import messages as wire
from distgrad.errors import ConfigError, DistgradError, PeerRejected, PeerTimeout, ProtocolError
from distgrad.wire.transport import (LINGER_MS, Client, Server, SocketSecurity, check_endpoint, poll_frames,
                                     send_frames)

log = logging.getLogger("distgrad.align")

# The protocol's constants.
HASH_DOMAIN = b"distgrad-align-v1\x00"   # domain separation of the ID hash; a new version changes it
VALUE_BYTES = 32                          # an X25519 u-coordinate; sent as int64 (count, 4)
VALUE_WORDS = VALUE_BYTES // 8
MAX_IDS = 1 << 24                         # IDs per party: lists of at most 512 MiB
MAX_PARTIES = 64
CHUNK_IDS = 2048                          # IDs hashed or encrypted between two looks at the socket
# Error codes of align's error messages (besides wire.ErrorCode's).
ABORTED, TIMEOUT, MISMATCH, NO_COMMON = "aborted", "timeout", "mismatch", "no_common"
DIGEST_DOMAIN = b"distgrad-align-ids-v1\x00"   # domain separation of the aligned IDs' digest

# Timing constants.
HEARTBEAT_INTERVAL_S = 1.0                # a busy or waiting side tells its peers it is alive this often
POLL_TICK_S = 0.1                         # longest a wait sleeps before checking deadlines and the stop flag
DEFAULT_PEER_DEADLINE_S = 60.0            # a peer silent this long (no heartbeat either) is given up
DEFAULT_LIVENESS_S = 10.0                 # ZMTP heartbeat timeout of the connections

StopCheck = Callable[[], None]


class NoCommonIds(DistgradError, RuntimeError):
    """The parties hold no ID in common: no party writes an aligned file (exit 1)."""


class AlignmentDiffers(ProtocolError):
    """The parties' aligned ID lists differ (a party did not follow the protocol): no party writes a file
    (exit 4)."""

    def __init__(self, message: str) -> None:
        super().__init__(MISMATCH, message)


def _no_stop() -> None:
    pass


# ---------------------------------------------------------------- the table

@dataclass
class Table:
    """A party's CSV file: its header, its data rows (lists of cells) and the ID column's index."""

    path: Path
    header: list[str]
    rows: list[list[str]]
    id_index: int

    @property
    def ids(self) -> list[str]:
        return [row[self.id_index] for row in self.rows]


def read_table(path: Path, id_column: str) -> Table:
    """Read a CSV file with a header row and an ID column named ``id_column``.

    IDs are compared as exact text (case and spaces count). Blank lines are
    skipped. Raises ``ConfigError`` naming the file (and the line) for an
    unreadable or empty file, a missing ID column, a row of another width, an
    empty ID, an ID that appears twice, or more than ``MAX_IDS`` rows.
    """
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:    # a leading byte-order mark is no name
            reader = csv.reader(f)
            header = next(reader, None)
            while header == []:
                header = next(reader, None)
            if header is None:
                raise ConfigError(f"{path} is empty: it needs a header row naming the columns, then one row per ID")
            if id_column not in header:
                raise ConfigError(f"{path} has no column named {id_column!r} (--id-column); its header is {header}")
            if header.count(id_column) > 1:
                raise ConfigError(f"{path} names column {id_column!r} more than once in its header {header}")
            index = header.index(id_column)
            rows: list[list[str]] = []
            first_line: dict[str, int] = {}
            for row in reader:
                if not row:
                    continue
                line = reader.line_num
                if len(row) != len(header):
                    raise ConfigError(f"{path} line {line}: {len(row)} fields, but the header has {len(header)}")
                key = row[index]
                if key == "":
                    raise ConfigError(f"{path} line {line}: the ID column {id_column!r} is empty")
                if key in first_line:
                    raise ConfigError(f"{path}: ID {wire.show(key)} appears twice in column {id_column!r}, on lines "
                                      f"{first_line[key]} and {line}; each ID must name one row")
                if len(rows) == MAX_IDS:
                    raise ConfigError(f"{path} has more than {MAX_IDS} rows, the most align takes")
                first_line[key] = line
                rows.append(row)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text: {e}") from e
    except csv.Error as e:
        raise ConfigError(f"{path} is not a readable CSV file: {e}") from e
    if not rows:
        raise ConfigError(f"{path} has a header but no rows: there is nothing to align")
    return Table(path, header, rows, index)


def write_aligned(table: Table, rows: Sequence[int], out: Path) -> None:
    """Write ``table``'s header, then its rows ``rows`` in the agreed order, to ``out``, atomically.

    The agreed order is ascending ID (Python's string order of the ID text),
    which every party computes alike from the common IDs it now knows, so an
    alignment of the same files is the same file whatever the protocol's
    random keys and shuffles were (and a training run on it is reproducible).
    The file appears whole or not at all (a temporary file beside it, then a
    rename), with mode 0600: it holds the party's private columns.
    """
    rows = _agreed_rows(table, rows)
    out = Path(out)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(table.header)
            writer.writerows(table.rows[i] for i in rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------- the curve

def new_key() -> bytes:
    """A fresh secret X25519 scalar (32 random bytes; X25519 clamps them)."""
    return secrets.token_bytes(32)


def hash_ids(ids: Sequence[str], tick: StopCheck = _no_stop) -> list[bytes]:
    """Each ID as the X25519 u-coordinate (32 bytes) of a point of Curve25519's prime-order subgroup.

    SHA-512 of the domain and the ID's UTF-8 bytes gives two field-element
    strings; Elligator 2 maps each to the subgroup and the points are added
    (RFC 9380's random-oracle shape), then converted to Montgomery form.
    ``tick`` is called between chunks of ``CHUNK_IDS``.
    """
    from nacl.bindings import (crypto_core_ed25519_add, crypto_core_ed25519_from_uniform,
                               crypto_sign_ed25519_pk_to_curve25519)

    sha512, out = hashlib.sha512, []
    for start in range(0, len(ids), CHUNK_IDS):
        for key in ids[start:start + CHUNK_IDS]:
            digest = sha512(HASH_DOMAIN + key.encode("utf-8")).digest()
            point = crypto_core_ed25519_add(crypto_core_ed25519_from_uniform(digest[:32]),
                                            crypto_core_ed25519_from_uniform(digest[32:]))
            out.append(crypto_sign_ed25519_pk_to_curve25519(point))
        tick()
    return out


def encrypt(values: Sequence[bytes], key: bytes, tick: StopCheck = _no_stop) -> list[bytes]:
    """``X25519(key, u)`` for every 32-byte ``u`` in ``values``, in order.

    ``tick`` is called between chunks. Raises ``ProtocolError`` for a value
    whose product is zero (a low-order point: never the hash of an ID).
    """
    from nacl.bindings import crypto_scalarmult
    from nacl.exceptions import CryptoError

    out: list[bytes] = []
    for start in range(0, len(values), CHUNK_IDS):
        for index in range(start, min(start + CHUNK_IDS, len(values))):
            try:
                out.append(crypto_scalarmult(key, values[index]))
            except CryptoError as e:
                raise ProtocolError(wire.ErrorCode.TENSOR, f"value {index} of a list of {len(values)} is a "
                                                           f"low-order point, not an encrypted ID") from e
        tick()
    return out


def aligned_digest(run: str, ids: Sequence[str]) -> str:
    """SHA-256 (hex) of this party's aligned ID list: the domain, the run id, the count, then each ID's
    UTF-8 bytes with their length, in the order given (the agreed order: ascending ID). Equal digests mean
    the same IDs in the same order; bound to the run, so one run's digest says nothing about another's."""
    digest = hashlib.sha256(DIGEST_DOMAIN + run.encode("ascii") + len(ids).to_bytes(8, "little"))
    for key in ids:
        data = key.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


def _agreed_rows(table: Table, rows: Sequence[int] | np.ndarray) -> list[int]:
    """``rows`` of ``table`` in the agreed order: ascending ID (Python's string order of the ID text)."""
    return sorted((int(i) for i in rows), key=lambda i: table.rows[i][table.id_index])


def _digest_of(msg: wire.Message, who: str) -> str:
    """The digest an ``align_digest`` message carries (64 lower-case hex digits)."""
    digest = msg.body.get("digest")
    if msg.tensors or type(digest) is not str or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
        raise ProtocolError(wire.ErrorCode.MALFORMED, f"{who}: align_digest must carry 'digest', 64 hex digits, "
                                                      f"got {wire.show(digest)}")
    return digest


def pack(values: Sequence[bytes]) -> np.ndarray:
    """32-byte values as an int64 array of shape (len, 4), the form they cross the wire in."""
    return np.frombuffer(b"".join(values), dtype="<i8").reshape(len(values), VALUE_WORDS)


def unpack(array: np.ndarray) -> list[bytes]:
    """The inverse of ``pack``."""
    data = array.tobytes()
    return [data[i:i + VALUE_BYTES] for i in range(0, len(data), VALUE_BYTES)]


def shuffle_order(count: int) -> np.ndarray:
    """A secret uniformly random permutation of ``range(count)`` (from the OS's CSPRNG)."""
    order = list(range(count))
    secrets.SystemRandom().shuffle(order)
    return np.array(order, dtype=np.int64)


def common_positions(lists: Sequence[Sequence[bytes]]) -> list[np.ndarray]:
    """For each list, the positions of the values every list holds, in the agreed order (ascending value).

    Each list must hold distinct values. Returns one int64 array per list,
    all of the same length.
    """
    common = set(lists[0]).intersection(*lists[1:])
    agreed = sorted(common)
    result = []
    for values in lists:
        where = {v: i for i, v in enumerate(values) if v in common}
        result.append(np.array([where[v] for v in agreed], dtype=np.int64))
    return result


# ---------------------------------------------------------------- the messages

def _values_message(run: str, step: int, values: Sequence[bytes], **body: Any) -> wire.Message:
    return wire.Message(wire.ALIGN_VALUES, run, step, body=body, tensors={"values": pack(values)})


def _positions_message(run: str, step: int, positions: np.ndarray, **body: Any) -> wire.Message:
    return wire.Message(wire.ALIGN_POSITIONS, run, step, body=body,
                        tensors={"positions": np.ascontiguousarray(positions, dtype=np.int64)})


def _values_of(msg: wire.Message, count: int | None, who: str) -> list[bytes]:
    """The values an ``align_values`` message carries, checked: ``count`` of them when given."""
    array = msg.tensors.get("values")
    if set(msg.tensors) != {"values"} or array is None or array.dtype != np.dtype("<i8") or array.ndim != 2 \
            or array.shape[1] != VALUE_WORDS:
        raise ProtocolError(wire.ErrorCode.TENSOR, f"{who}: align_values must carry one tensor 'values' of "
                                                   f"int64 (count, {VALUE_WORDS})")
    if count is not None and array.shape[0] != count:
        raise ProtocolError(wire.ErrorCode.TENSOR, f"{who}: {array.shape[0]} values, expected {count}")
    return unpack(array)


def _positions_of(msg: wire.Message, bound: int, count: int | None, who: str) -> np.ndarray:
    """The positions an ``align_positions`` message carries: distinct, in ``[0, bound)``, ``count`` of them."""
    array = msg.tensors.get("positions")
    if set(msg.tensors) != {"positions"} or array is None or array.dtype != np.dtype("<i8") or array.ndim != 1:
        raise ProtocolError(wire.ErrorCode.TENSOR, f"{who}: align_positions must carry one int64 vector 'positions'")
    if count is not None and len(array) != count:
        raise ProtocolError(wire.ErrorCode.TENSOR, f"{who}: {len(array)} positions, expected {count}")
    if len(array) and (array.min() < 0 or array.max() >= bound or len(np.unique(array)) != len(array)):
        raise ProtocolError(wire.ErrorCode.TENSOR, f"{who}: positions must be distinct and in [0, {bound})")
    return np.array(array, dtype=np.int64)


def _remote_error(msg: wire.Message, who: str) -> DistgradError:
    """The exception an error message from ``who`` stands for: a timeout stays a timeout (exit 3)."""
    code, text = str(msg.body.get("code", "?")), str(msg.body.get("message", ""))
    if code == TIMEOUT:
        return PeerTimeout(f"{who} gave up: {text}")
    if code == NO_COMMON:
        return NoCommonIds(f"{who}: {text}")
    return PeerRejected(code, f"{who}: {text}")


@dataclass
class AlignResult:
    """What ``align`` did: ``common`` IDs held by all ``parties``, out of this party's ``rows``."""

    common: int
    rows: int
    parties: int
    out: Path


# ---------------------------------------------------------------- the coordinator

@dataclass
class _Party:
    envelope: list[bytes]
    name: str
    index: int
    rows: int
    heard: float                                   # time.monotonic() of its last message
    expect: tuple[str, int] | None = None          # (type, step) of the reply awaited from it
    reply: wire.Message | None = None


@dataclass
class _Coordinator:
    server: Server
    parties_wanted: int
    deadline_s: float
    check_stop: StopCheck
    max_bytes: int
    run: str = field(default_factory=lambda: secrets.token_hex(8))
    parties: dict[bytes, _Party] = field(default_factory=dict)    # by routing id
    joining: bool = True
    refused: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    beat: float = field(default_factory=time.monotonic)

    def send(self, party: _Party, msg: wire.Message) -> None:
        try:
            send_frames(self.server.sock, wire.encode(msg), party.envelope)
        except zmq.ZMQError as e:
            log.debug("could not send %s to party %s: %s", msg.describe(), party.name, e)

    def refuse(self, envelope: list[bytes], code: str, text: str, step: int = 0) -> None:
        self.server.reply(envelope, wire.error_message("", step, code, text))

    def order(self, party: _Party, msg: wire.Message, reply_type: str) -> None:
        """Send ``msg`` to ``party`` and await a reply of ``reply_type`` with the same step."""
        party.expect, party.reply = (reply_type, msg.step), None
        party.heard = time.monotonic()      # its silence counts from now
        self.send(party, msg)

    def tick(self) -> None:
        """Handle every message already waiting, send heartbeats, check deadlines; never blocks."""
        while self.service(0.0):
            pass

    def service(self, wait_s: float) -> bool:
        """Handle at most one message, waiting up to ``wait_s`` for it. True if one came."""
        self.check_stop()
        now = time.monotonic()
        if now - self.beat >= HEARTBEAT_INTERVAL_S:
            self.beat = now
            for party in self.parties.values():
                self.send(party, wire.Message(wire.PING, self.run, 0))
        self.check_deadlines(now)
        received = self.server.receive(wait_s)
        if received is None:
            return False
        envelope, frames, _ = received
        party = self.parties.get(envelope[0])
        try:
            msg = wire.decode(frames, self.max_bytes)
        except ProtocolError as e:
            if party is None:
                self.refuse(envelope, e.code, str(e))
                return True
            raise ProtocolError(e.code, f"party {party.name} sent an undecodable message: {e}") from e
        if party is None:
            self.join(envelope, msg)
        else:
            self.handle(party, msg)
        return True

    def join(self, envelope: list[bytes], msg: wire.Message) -> None:
        if msg.type != wire.ALIGN_JOIN:
            self.refuse(envelope, wire.ErrorCode.TYPE, f"{msg.type} before align_join: join first")
            return
        if not self.joining:
            self.refuse(envelope, wire.ErrorCode.RUN, f"this alignment of {self.parties_wanted} parties is "
                                                      f"already under way")
            return
        name, rows, wanted = msg.body.get("name"), msg.body.get("rows"), msg.body.get("parties")
        if not (type(name) is str and 0 < len(name) <= 128 and type(rows) is int and 0 < rows <= MAX_IDS
                and type(wanted) is int and 0 <= wanted <= MAX_PARTIES):
            self.refuse(envelope, wire.ErrorCode.MALFORMED, f"align_join needs a name (1 to 128 characters), rows "
                                                            f"in [1, {MAX_IDS}] and parties (0: any)")
            return
        if wanted not in (0, self.parties_wanted):
            text = (f"party {wire.show(name)} was started for {wanted} parties, this coordinator for "
                    f"{self.parties_wanted} (--parties)")
            self.refuse(envelope, MISMATCH, text)
            raise ConfigError(text)
        if any(p.name == name for p in self.parties.values()) or name == COORDINATOR_NAME:
            self.refused.append(f"a second party named {name!r}")
            self.refuse(envelope, MISMATCH, f"another party is already named {name!r}: give each party its own --name")
            return
        party = _Party(envelope, name, len(self.parties) + 1, rows, time.monotonic())
        self.parties[envelope[0]] = party
        self.send(party, wire.Message(wire.WELCOME, self.run, 0, body={"parties": self.parties_wanted,
                                                                        "index": party.index}))
        party.expect = (wire.ALIGN_VALUES, 0)
        log.info("party %s joined with %d IDs (%d of %d parties)", name, rows, len(self.parties) + 1,
                 self.parties_wanted)
        if len(self.parties) == self.parties_wanted - 1:
            self.joining = False

    def handle(self, party: _Party, msg: wire.Message) -> None:
        party.heard = time.monotonic()
        if msg.type == wire.PING:
            return
        if msg.type == wire.ERROR:
            raise _remote_error(msg, f"party {party.name}")
        if msg.run != self.run or party.expect is None or (msg.type, msg.step) != party.expect:
            awaited = "nothing" if party.expect is None else f"{party.expect[0]} step {party.expect[1]}"
            raise ProtocolError(wire.ErrorCode.TYPE, f"party {party.name} sent {msg.describe()} while {awaited} "
                                                     f"of run {self.run} was awaited")
        party.reply, party.expect = msg, None

    def check_deadlines(self, now: float) -> None:
        if self.joining and now - self.started > self.deadline_s:
            joined = ", ".join(p.name for p in self.parties.values()) or "none"
            refused = f"; refused: {', '.join(self.refused)}" if self.refused else ""
            raise PeerTimeout(f"only {len(self.parties)} of the {self.parties_wanted - 1} other parties joined within "
                              f"{self.deadline_s:g} s (joined: {joined}{refused}); is every party running and "
                              f"connecting to {self.server.endpoint}?")
        for party in self.parties.values():
            if party.expect is not None and now - party.heard > self.deadline_s:
                raise PeerTimeout(f"party {party.name} sent nothing for {self.deadline_s:g} s while "
                                  f"{party.expect[0]} step {party.expect[1]} was awaited (it stopped, or "
                                  f"lost its connection)")

    def wait_all(self) -> None:
        """Until every party has joined and answered what it was asked, or a deadline passes."""
        while self.joining or any(p.expect is not None for p in self.parties.values()):
            self.service(POLL_TICK_S)

    def abort(self, error: BaseException) -> None:
        """Tell every party the alignment is over, best effort."""
        code = TIMEOUT if isinstance(error, PeerTimeout) else NO_COMMON if isinstance(error, NoCommonIds) else ABORTED
        for party in self.parties.values():
            self.send(party, wire.error_message(self.run, 0, code, f"the coordinator stopped: {error}"))


COORDINATOR_NAME = "coordinator"


def _coordinate(coord: _Coordinator, table: Table, out: Path) -> AlignResult:
    n = coord.parties_wanted
    key = new_key()
    own_order = shuffle_order(len(table.rows))
    ids = table.ids
    lists: list[list[bytes]] = [[] for _ in range(n)]
    lists[0] = encrypt(hash_ids([ids[i] for i in own_order], coord.tick), key, coord.tick)
    log.debug("own list encrypted; waiting for the parties' lists")
    coord.wait_all()
    ring = sorted(coord.parties.values(), key=lambda p: p.index)
    for party in ring:
        lists[party.index] = _values_of(party.reply, party.rows, f"party {party.name}")
    sizes = ", ".join([f"{COORDINATOR_NAME} {len(table.rows)}", *(f"{p.name} {p.rows}" for p in ring)])
    log.info("every party's list is in (%s IDs); %d rounds of encryption follow", sizes, n - 1)
    for r in range(1, n):
        for party in ring:
            i = (party.index - r) % n
            coord.order(party, _values_message(coord.run, r, lists[i], shuffle=i == 0), wire.ALIGN_VALUES)
        mine = n - r
        lists[mine] = encrypt(lists[mine], key, coord.tick)
        log.debug("round %d: encrypted list %d here; waiting for the parties", r, mine)
        coord.wait_all()
        log.debug("round %d: every list is back", r)
        for party in ring:
            i = (party.index - r) % n
            lists[i] = _values_of(party.reply, len(lists[i]), f"party {party.name}")
    for party in ring:
        if len(set(lists[party.index])) != len(lists[party.index]):
            raise ProtocolError(wire.ErrorCode.TENSOR, f"party {party.name}'s list holds a value twice")
    positions = common_positions(lists)
    common = len(positions[0])
    log.info("%d IDs are common to all %d parties", common, n)
    if common == 0:
        raise NoCommonIds(f"the {n} parties have no ID in common ({sizes} IDs): there is nothing to align")
    mapped = positions[0]                    # in the order party n-1 shuffled L_0 into; undo the shuffles
    for party in reversed(ring):
        coord.order(party, _positions_message(coord.run, party.index, mapped, final=False), wire.ALIGN_POSITIONS)
        coord.wait_all()
        mapped = _positions_of(party.reply, len(table.rows), common, f"party {party.name}")
    for party in ring:
        coord.order(party, _positions_message(coord.run, n, positions[party.index], final=True), wire.ALIGN_DIGEST)
    coord.wait_all()
    rows = _agreed_rows(table, own_order[mapped])
    digest = aligned_digest(coord.run, [table.rows[i][table.id_index] for i in rows])
    differ = [p.name for p in ring if _digest_of(p.reply, f"party {p.name}") != digest]
    if differ:
        raise AlignmentDiffers(f"the aligned ID lists differ: {', '.join(differ)} ended with other IDs (or another "
                               f"order) than {COORDINATOR_NAME} ({len(differ)} of {n - 1} parties). A party did "
                               f"not follow the protocol (it reordered a list it encrypted, or undid its shuffle "
                               f"wrongly); no party writes its file")
    log.info("every party holds the same %d IDs in the same order (digest %s...)", common, digest[:16])
    for party in ring:
        coord.order(party, wire.Message(wire.ALIGN_DIGEST, coord.run, n + 1, body={"digest": digest}), wire.BYE)
    coord.wait_all()
    write_aligned(table, rows, out)
    return AlignResult(common, len(table.rows), n, out)


# ---------------------------------------------------------------- a party

@dataclass
class _Link:
    client: Client
    name: str
    deadline_s: float
    check_stop: StopCheck
    max_bytes: int
    run: str = ""
    heard: float = field(default_factory=time.monotonic)
    beat: float = field(default_factory=time.monotonic)

    def send(self, msg: wire.Message) -> None:
        self.client.send(msg)
        self.beat = time.monotonic()

    def tick(self, step: int = 0) -> None:
        """While computing: a heartbeat when one is due, and the stop flag. Messages wait for ``receive``."""
        self.check_stop()
        if self.run and time.monotonic() - self.beat >= HEARTBEAT_INTERVAL_S:
            self.send(wire.Message(wire.PING, self.run, step))

    def receive(self, what: str) -> wire.Message:
        """The next message of the coordinator other than a heartbeat. Raises ``PeerTimeout`` after
        ``deadline_s`` of silence, the error's exception for an error message."""
        self.heard = time.monotonic()
        while True:
            self.tick()
            silent = time.monotonic() - self.heard
            if silent > self.deadline_s:
                hint = "" if self.run else f"; {self.client.unreachable_hint()}"
                raise PeerTimeout(f"the coordinator at {self.client.endpoint} sent nothing for {self.deadline_s:g} s "
                                  f"while {what} was awaited{hint}")
            frames = poll_frames(self.client.sock, min(POLL_TICK_S, self.deadline_s - silent + 0.01))
            if frames is None:
                continue
            self.heard = time.monotonic()
            msg = wire.decode(frames, self.max_bytes)
            if msg.type == wire.ERROR:
                raise _remote_error(msg, "the coordinator")
            if self.run and msg.run != self.run:
                raise ProtocolError(wire.ErrorCode.RUN, f"the coordinator sent {msg.describe()} of another run "
                                                        f"than {self.run}")
            if msg.type != wire.PING:
                return msg


def _take_part(link: _Link, table: Table, out: Path, parties: int | None) -> AlignResult:
    link.send(wire.Message(wire.ALIGN_JOIN, "", 0, body={"name": link.name, "rows": len(table.rows),
                                                          "parties": parties or 0}))
    welcome = link.receive("the welcome")
    n, index = welcome.body.get("parties"), welcome.body.get("index")
    if welcome.type != wire.WELCOME or not (type(n) is int and 2 <= n <= MAX_PARTIES and type(index) is int
                                            and 1 <= index < n):
        raise ProtocolError(wire.ErrorCode.TYPE, f"the coordinator answered the join with {welcome.describe()} "
                                                 f"{wire.show(welcome.body)}, not a welcome")
    link.run = welcome.run
    log.info("party %s joined an alignment of %d parties (run %s)", link.name, n, link.run)
    key = new_key()
    own_order = shuffle_order(len(table.rows))
    ids = table.ids
    link.send(_values_message(link.run, 0, encrypt(hash_ids([ids[i] for i in own_order], link.tick), key,
                                                   link.tick)))
    log.debug("sent this party's encrypted list")
    shuffles: dict[int, np.ndarray] = {}     # round -> the permutation this party applied to L_0 then
    rounds_done = 0
    while True:
        msg = link.receive(f"round {rounds_done + 1}" if rounds_done < n - 1 else "the positions")
        if msg.type == wire.ALIGN_VALUES and msg.step == rounds_done + 1 <= n - 1:
            shuffle = msg.step == index        # in round r party r holds the coordinator's list
            if msg.body.get("shuffle") is not shuffle:
                raise ProtocolError(wire.ErrorCode.MALFORMED, f"round {msg.step}: shuffle must be {shuffle} "
                                                              f"for party {index}")
            log.debug("round %d: encrypting a list of %d", msg.step, len(msg.tensors["values"]))
            values = encrypt(_values_of(msg, None, "the coordinator"), key, lambda: link.tick(msg.step))
            if shuffle:
                shuffles[msg.step] = order = shuffle_order(len(values))
                values = [values[i] for i in order]
            link.send(_values_message(link.run, msg.step, values))
            rounds_done += 1
        elif msg.type == wire.ALIGN_POSITIONS and rounds_done == n - 1 and msg.step == index \
                and msg.body.get("final") is False and index in shuffles:
            order = shuffles.pop(index)
            mapped = order[_positions_of(msg, len(order), None, "the coordinator")]
            link.send(_positions_message(link.run, msg.step, mapped))
        elif msg.type == wire.ALIGN_POSITIONS and rounds_done == n - 1 and msg.step == n \
                and msg.body.get("final") is True and not shuffles:
            positions = _positions_of(msg, len(table.rows), None, "the coordinator")
            if len(positions) == 0:
                raise ProtocolError(wire.ErrorCode.TENSOR, "the coordinator sent no positions: no common ID")
            rows = _agreed_rows(table, own_order[positions])
            digest = aligned_digest(link.run, [table.rows[i][table.id_index] for i in rows])
            link.send(wire.Message(wire.ALIGN_DIGEST, link.run, n, body={"digest": digest}))
            answer = link.receive("the coordinator's digest")
            if answer.type != wire.ALIGN_DIGEST or answer.step != n + 1:
                raise ProtocolError(wire.ErrorCode.TYPE, f"unexpected {answer.describe()} from the coordinator "
                                                         f"while its digest was awaited")
            if _digest_of(answer, "the coordinator") != digest:
                raise AlignmentDiffers(f"the coordinator's aligned ID list differs from party {link.name}'s: a "
                                       f"party did not follow the protocol; this party writes no file")
            write_aligned(table, rows, out)
            link.send(wire.Message(wire.BYE, link.run, n + 1))
            return AlignResult(len(positions), len(table.rows), n, out)
        else:
            raise ProtocolError(wire.ErrorCode.TYPE, f"unexpected {msg.describe()} from the coordinator after "
                                                     f"{rounds_done} of {n - 1} rounds")


# ---------------------------------------------------------------- the API

@dataclass
class AlignOptions:
    """One party's settings, checked at construction (``ConfigError`` naming the bad value).

    The coordinator gives ``bind`` and ``parties`` (every party, itself
    included); every other party gives ``connect`` and may give ``parties``,
    which must then match the coordinator's.
    """

    input: Path
    id_column: str
    out: Path
    bind: str | None = None
    parties: int | None = None
    connect: str | None = None
    name: str | None = None                 # default: "coordinator", or party-PID
    ready_file: Path | None = None          # coordinator: the bound endpoint is written here
    peer_deadline_s: float = DEFAULT_PEER_DEADLINE_S
    liveness_s: float = DEFAULT_LIVENESS_S

    def __post_init__(self) -> None:
        if (self.bind is None) == (self.connect is None):
            raise ConfigError("give --bind ENDPOINT (the coordinator) or --connect ENDPOINT (another party), "
                              "exactly one of them")
        check_endpoint(self.bind or self.connect, bind=self.bind is not None)
        if self.parties is not None and not 2 <= self.parties <= MAX_PARTIES:
            raise ConfigError(f"--parties counts every party, the coordinator included: 2 to {MAX_PARTIES}, "
                              f"got {self.parties}")
        if self.bind is not None and self.parties is None:
            raise ConfigError("the coordinator (--bind) needs --parties N: how many parties align, itself included")
        if self.connect is not None and self.ready_file is not None:
            raise ConfigError("--ready-file is for the coordinator (--bind)")
        if not self.peer_deadline_s > 0 or not self.liveness_s > 0:
            raise ConfigError(f"--peer-deadline and --liveness must be positive, got {self.peer_deadline_s} and "
                              f"{self.liveness_s}")
        if self.name is None:
            self.name = COORDINATOR_NAME if self.bind is not None else f"party-{os.getpid()}"
        if not 0 < len(self.name) <= 128 or not self.name.isprintable():
            raise ConfigError(f"--name must be 1 to 128 printable characters, got {self.name!r}")
        self.input, self.out = Path(self.input), Path(self.out)
        if not self.out.parent.is_dir():
            raise ConfigError(f"cannot write {self.out}: directory {self.out.parent} does not exist")
        if self.out.exists() and self.input.exists() and self.out.samefile(self.input):
            raise ConfigError(f"--out {self.out} is the input file: write the aligned rows to another file")


def align(options: AlignOptions, table: Table | None = None, *, security: SocketSecurity | None = None,
          check_stop: StopCheck = _no_stop, ctx: zmq.Context | None = None) -> AlignResult:
    """Align this party's rows with the other parties' by the ID column; write ``options.out``.

    ``table`` is the input already read (``read_table``), else it is read
    here. ``options.out`` gets this party's rows of the common IDs, in the
    agreed order, header and columns as in the input, only once everything
    succeeded. ``security`` is a ``keys.CurveServer`` (coordinator) or a
    ``keys.CurveClient``. Raises ``ConfigError`` for bad input, ``PeerTimeout``
    when a peer stays silent ``peer_deadline_s`` (or, for the coordinator, not
    every party joins within it), ``PeerRejected`` or ``ProtocolError`` for a
    refusal or a bad message, ``NoCommonIds`` when no ID is common (no party
    writes a file).
    """
    table = table if table is not None else read_table(options.input, options.id_column)
    ctx = ctx or zmq.Context.instance()
    max_bytes = MAX_IDS * VALUE_BYTES
    if options.bind is not None:
        server = Server(ctx, options.bind, max_bytes + wire.HEADER_MAX_BYTES, options.liveness_s, security)
        coord = _Coordinator(server, options.parties, options.peer_deadline_s, check_stop, max_bytes)
        try:
            log.info("coordinating the alignment of %d parties on %s (%s); %d IDs here", options.parties,
                     server.endpoint, "CURVE: encrypted, allowed keys only" if server.authenticated else "plaintext",
                     len(table.rows))
            if options.ready_file is not None:
                tmp = options.ready_file.with_name(options.ready_file.name + ".tmp")
                tmp.write_text(server.endpoint)
                tmp.replace(options.ready_file)
            try:
                return _coordinate(coord, table, options.out)
            except BaseException as e:
                coord.abort(e)
                raise
        finally:
            server.close()
    client = Client(ctx, options.connect, max_bytes + wire.HEADER_MAX_BYTES, max_bytes, options.liveness_s, security)
    link = _Link(client, options.name, options.peer_deadline_s, check_stop, max_bytes)
    linger_ms = LINGER_MS
    try:
        try:
            result = _take_part(link, table, options.out, options.parties)
        except (DistgradError, OSError) as e:
            if link.run and not isinstance(e, (PeerRejected, PeerTimeout, NoCommonIds)):
                link.send(wire.error_message(link.run, 0, ABORTED, f"party {options.name} failed: {e}"))
            raise
        # The bye is the last message and has no reply: close may take up to the peer deadline to deliver it
        # (a short linger dropped it under load, and the coordinator waited out its deadline for it).
        linger_ms = int(options.peer_deadline_s * 1000)
        return result
    finally:
        client.close(linger_ms)
