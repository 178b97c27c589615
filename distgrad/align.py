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
   values (random to everyone; positions travel in that order). For each list
   it finds the positions of the common values in that order; those of ``L_0`` travel back through
   parties n-1 .. 1, each undoing its shuffle.
3. Each party receives its positions and maps them to its rows through its
   permutation: its rows of the common IDs, sorted by ID (the order every
   party then trains in: all of them know the common IDs, so sorting tells
   nobody anything new, and the file does not depend on the keys).
4. The parties check that they all hold the same aligned IDs before anyone
   writes, in an order that gives a dishonest coordinator nothing to test
   a guess against. ``aligned_digest(run, sender, ids)`` is the SHA-256 of
   the run id, the sender's index and the IDs in the agreed order: bound to
   who sends it, so a party's own digest sent back to it never matches what
   it expects from another party. The coordinator speaks first: it sends
   each party its final positions together with its own digest (index 0), a
   commitment it can make only if it holds the IDs it asks that party to
   write. The party checks the commitment against its rows and answers with
   its own digest only when it matches; otherwise it answers only that it
   refuses (exit 4, no file). So no party ever sends a value computed from
   IDs the coordinator did not already name, and a coordinator that asks for
   99 shared rows and one it does not know gets one online guess per run,
   never an offline brute force. The coordinator checks every party's digest
   and relays to each party the others'; a party writes its file only when
   every other party's digest matches its rows. With CURVE keys and
   ``--party-keys`` each party also tags its digest for every other party
   with a key that only the two of them share (HMAC, keyed with X25519 of
   their CURVE keys), so the coordinator cannot relay to a party a digest
   that another party did not send. A count of final positions below
   ``--min-common`` (default ``DEFAULT_MIN_COMMON``) is refused by every
   party (exit 1).

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
import hmac
import logging
import os
import secrets
import tempfile
import time
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence, cast

import numpy as np
import zmq

from distgrad.wire import messages as wire
from distgrad.stage.records import is_special
from distgrad.errors import ConfigError, DistgradError, PeerRejected, PeerTimeout, ProtocolError
from distgrad.config.csvfile import open_csv
from distgrad.run.options import check_wait
from distgrad.wire.transport import (LINGER_MS, Client, Server, SocketSecurity, check_endpoint, poll_frames,
                                     send_frames)

log = logging.getLogger("distgrad.align")

# The protocol's constants.
ALIGN_VERSION = 2                         # align's protocol, in align_join and welcome; 1 had no field
HASH_DOMAIN = b"distgrad-align-v2\x00"   # domain separation of the ID hash; a new version changes it
VALUE_BYTES = 32                          # an X25519 u-coordinate; sent as int64 (count, 4)
VALUE_WORDS = VALUE_BYTES // 8
MAX_IDS = 1 << 24                         # IDs per party: lists of at most 512 MiB
MAX_PARTIES = 64
CHUNK_IDS = 2048                          # IDs hashed or encrypted between two looks at the socket
# Error codes of align's error messages (besides wire.ErrorCode's).
ABORTED, TIMEOUT, MISMATCH, NO_COMMON, TOO_FEW = "aborted", "timeout", "mismatch", "no_common", "too_few"
DIGEST_DOMAIN = b"distgrad-align-ids-v2\x00"   # domain separation of the aligned IDs' digest
TAG_DOMAIN = b"distgrad-align-tag-v2\x00"      # domain separation of the key a party tags its digest with
DEFAULT_MIN_COMMON = 10                   # fewer common IDs than this: every party refuses (exit 1)
MAX_PARTY_KEYS = 256                      # public keys in a --party-keys directory

# Timing constants.
HEARTBEAT_INTERVAL_S = 1.0                # a busy or waiting side tells its peers it is alive this often
POLL_TICK_S = 0.1                         # longest a wait sleeps before checking deadlines and the stop flag
DEFAULT_PEER_DEADLINE_S = 60.0            # a peer silent this long (no heartbeat either) is given up
DEFAULT_LIVENESS_S = 10.0                 # ZMTP heartbeat timeout of the connections

StopCheck = Callable[[], None]


class NoCommonIds(DistgradError, RuntimeError):
    """The parties hold no ID in common: no party writes an aligned file (exit 1)."""


class TooFewCommon(NoCommonIds):
    """Fewer IDs are common than a party's ``--min-common``: no party writes an aligned file (exit 1)."""


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
    empty ID, an ID that appears twice, or more than ``MAX_IDS`` rows. IDs
    that would silently fail to match another party's spelling of them
    (``inexact_ids``) are logged as a warning, naming the first one's line.
    """
    path = Path(path)
    try:
        with open_csv(path) as f:       # a regular file only; a leading byte-order mark is no name
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
    table = Table(path, header, rows, index)
    for warning in inexact_ids(table, first_line):
        log.warning("%s", warning)
    return table


def inexact_ids(table: Table, lines: dict[str, int]) -> list[str]:
    """Why some of ``table``'s IDs may not match the same IDs as another party writes them, one line per
    kind (``lines``: each ID's line in the file): spaces around an ID, and text not in Unicode NFC form (an
    accent as a separate mark: it looks the same as the composed letter but is other text). Nothing is
    changed: IDs are compared as exact text, so ``' 7'`` never matches ``'7'``."""
    checks = (("have spaces around them", lambda key: key != key.strip()),
              ("are not in Unicode NFC form (an accent as a separate mark)",
               lambda key: unicodedata.normalize("NFC", key) != key))
    found = []
    for what, odd in checks:
        odd_ids = [key for key in table.ids if odd(key)]
        if odd_ids:
            found.append(f"{table.path}: {len(odd_ids)} of {len(table.rows)} IDs {what}, the first "
                         f"{ascii(odd_ids[0][:64])} on line {lines[odd_ids[0]]}; IDs are compared as exact text, so "
                         f"they match only another party's IDs spelt exactly alike: clean them in every party's "
                         f"file the same way before aligning")
    return found


def write_aligned(table: Table, rows: Sequence[int], out: Path) -> None:
    """Write ``table``'s header, then its rows ``rows`` in the agreed order, to ``out``, atomically.

    The agreed order is ascending ID (Python's string order of the ID text),
    which every party computes alike from the common IDs it now knows, so an
    alignment of the same files is the same file whatever the protocol's
    random keys and shuffles were (and a training run on it is reproducible).
    The file appears whole or not at all (a temporary file beside it, then a
    rename), with mode 0600: it holds the party's private columns. Raises
    ``ConfigError`` naming ``out`` when it cannot be written.
    """
    rows = _agreed_rows(table, rows)
    out = Path(out)
    if is_special(out):             # /dev/null, a FIFO: written into, never replaced by the rename
        try:
            with open(out, "w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f, lineterminator="\n")
                writer.writerow(table.header)
                writer.writerows(table.rows[i] for i in rows)
        except OSError as e:
            raise ConfigError(f"cannot write the aligned rows to {out}: {e.strerror or e}") from e
        return
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    except OSError as e:
        raise ConfigError(f"cannot write the aligned rows to {out}: {e.strerror or e}") from e
    try:
        with os.fdopen(fd, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f, lineterminator="\n")
            writer.writerow(table.header)
            writer.writerows(table.rows[i] for i in rows)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        raise ConfigError(f"cannot write the aligned rows to {out}: {e.strerror or e}") from e
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


def aligned_digest(run: str, sender: int, ids: Sequence[str]) -> str:
    """SHA-256 (hex) of an aligned ID list as party ``sender`` (its index, 0 the coordinator) states it: the
    domain, the run id, the sender, the count, then each ID's UTF-8 bytes with their length, in the order
    given (the agreed order: ascending ID). Equal digests mean the same IDs in the same order from the same
    sender in the same run: a digest sent back to the party that sent it never passes for another's."""
    digest = hashlib.sha256(DIGEST_DOMAIN + run.encode("ascii") + sender.to_bytes(8, "little")
                            + len(ids).to_bytes(8, "little"))
    for key in ids:
        data = key.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()


@dataclass(frozen=True)
class PartyKeys:
    """A connecting party's CURVE key pair and the public keys of the other parties it trusts (32 raw bytes
    each), to tag its digest for each of them and check theirs (``digest_tag``)."""

    public: bytes
    secret: bytes
    trusted: frozenset[bytes]

    @classmethod
    def load(cls, public_z85: bytes, secret_z85: bytes, server_z85: bytes, directory: Path) -> "PartyKeys":
        """The key pair (Z85, as ``keys.CurveClient`` holds it) and every ``*.key`` in ``directory`` but this
        party's own and the coordinator's. Raises ``ConfigError`` naming the directory or the file."""
        from distgrad.wire.keys import check_trusted, load_public

        directory = Path(directory)
        if not directory.is_dir():
            raise ConfigError(f"--party-keys {directory} is not a directory of the other parties' public keys")
        check_trusted(directory, "--party-keys directory")
        files = sorted(directory.glob("*.key"))
        if not files:
            raise ConfigError(f"--party-keys {directory} holds no *.key files: copy each other party's NAME.key "
                              f"there")
        if len(files) > MAX_PARTY_KEYS:
            raise ConfigError(f"--party-keys {directory} holds {len(files)} keys, more than {MAX_PARTY_KEYS}")
        own, server = _raw_key(public_z85, "this party's public key"), _raw_key(server_z85, "--server-key")
        secret = _raw_key(secret_z85, "this party's secret key")
        trusted = set()
        for path in files:
            check_trusted(path, "party key file")
            key = _raw_key(load_public(path), str(path))
            try:
                digest_tag(secret, key, own, key, "0" * 64)
            except ProtocolError as e:
                raise ConfigError(f"{path} holds no usable public key: {e}") from e
            trusted.add(key)
        trusted -= {own, server}
        if not trusted:
            raise ConfigError(f"--party-keys {directory} holds only this party's or the coordinator's key: it "
                              f"needs the other parties' public keys")
        return cls(own, secret, frozenset(trusted))


def _raw_key(z85_key: bytes | str, what: str) -> bytes:
    """A CURVE key's 32 raw bytes from its 40 Z85 characters; ``ConfigError`` naming ``what`` otherwise."""
    from zmq.utils import z85
    try:
        raw = z85.decode(z85_key) if len(z85_key) == 40 else b""
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{what} is not a Z85 CURVE key") from e
    if len(raw) != 32:
        raise ConfigError(f"{what} is not a CURVE key (40 Z85 characters)")
    return raw


def _show_key(raw: bytes) -> str:
    from zmq.utils import z85
    return z85.encode(raw).decode("ascii")


def digest_tag(secret: bytes, peer: bytes, sender: bytes, recipient: bytes, digest: str) -> str:
    """HMAC-SHA256 (hex) of ``digest`` under a key that only the parties with public keys ``sender`` and
    ``recipient`` can derive: X25519 of one's ``secret`` and the other's public key ``peer``, hashed with
    both public keys in that order, so a tag from A to B never passes for one from B to A. Raises
    ``ProtocolError`` for a peer key that is a low-order point."""
    from nacl.bindings import crypto_scalarmult
    from nacl.exceptions import CryptoError

    try:
        shared = crypto_scalarmult(secret, peer)
    except CryptoError as e:
        raise ProtocolError(wire.ErrorCode.MALFORMED, f"public key {_show_key(peer)} is a low-order point") from e
    key = hashlib.sha256(TAG_DOMAIN + shared + sender + recipient).digest()
    return hmac.new(key, digest.encode("ascii"), hashlib.sha256).hexdigest()


def _agreed_rows(table: Table, rows: Sequence[int] | np.ndarray) -> list[int]:
    """``rows`` of ``table`` in the agreed order: ascending ID (Python's string order of the ID text)."""
    return sorted((int(i) for i in rows), key=lambda i: table.rows[i][table.id_index])


def _hex64(value: Any, what: str) -> str:
    """``value`` if it is 64 lower-case hex digits (a digest or a tag), else a ``ProtocolError`` naming it."""
    if type(value) is not str or len(value) != 64 or set(value) - set("0123456789abcdef"):
        raise ProtocolError(wire.ErrorCode.MALFORMED, f"{what} must be 64 hex digits, got {wire.show(value)}")
    return value


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
    if code in (NO_COMMON, TOO_FEW):
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

    @property
    def answer(self) -> wire.Message:
        """The reply ``_Coordinator.wait_all`` waited for: set once it returns."""
        assert self.reply is not None, f"party {self.name} has not replied yet"
        return self.reply


@dataclass
class _Coordinator:
    server: Server
    parties_wanted: int
    deadline_s: float
    check_stop: StopCheck
    max_bytes: int
    name: str = "coordinator"           # its --name, in log lines and errors
    run: str = field(default_factory=lambda: secrets.token_hex(8))
    parties: dict[bytes, _Party] = field(default_factory=dict)    # by routing id
    joining: bool = True
    refused: dict[str, int] = field(default_factory=dict)     # why a join was refused -> how often (bounded:
    #                                                              one entry per joined party's name)
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
            for each in self.parties.values():
                self.send(each, wire.Message(wire.PING, self.run, 0))
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
        version = msg.body.get("version", 1)
        if version != ALIGN_VERSION:
            text = (f"party {wire.show(name)} speaks align protocol {wire.show(version)}, this coordinator "
                    f"{ALIGN_VERSION}: run the same distgrad release on every party")
            self.refuse(envelope, wire.ErrorCode.VERSION, text)
            raise ConfigError(text)
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
        if any(p.name == name for p in self.parties.values()) or name == self.name:
            why = f"a second party named {name!r}"
            self.refused[why] = self.refused.get(why, 0) + 1
            self.refuse(envelope, MISMATCH, f"another party is already named {name!r}: give each party its own --name")
            return
        party = _Party(envelope, name, len(self.parties) + 1, rows, time.monotonic())
        self.parties[envelope[0]] = party
        self.send(party, wire.Message(wire.WELCOME, self.run, 0, body={"parties": self.parties_wanted,
                                                                        "index": party.index,
                                                                        "version": ALIGN_VERSION}))
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
            refused = "; refused: " + ", ".join(why + (f" ({n} times)" if n > 1 else "")
                                                for why, n in self.refused.items()) if self.refused else ""
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
        code = (TIMEOUT if isinstance(error, PeerTimeout) else TOO_FEW if isinstance(error, TooFewCommon)
                else NO_COMMON if isinstance(error, NoCommonIds) else ABORTED)
        for party in self.parties.values():
            self.send(party, wire.error_message(self.run, 0, code, f"the coordinator stopped: {error}"))


COORDINATOR_NAME = "coordinator"


def _coordinate(coord: _Coordinator, table: Table, out: Path, min_common: int) -> AlignResult:
    n = coord.parties_wanted
    ring, own_order, lists = _exchange(coord, table)
    positions = common_positions(lists)
    common = len(positions[0])
    log.info("%d IDs are common to all %d parties", common, n)
    sizes = ", ".join([f"{coord.name} {len(table.rows)}", *(f"{p.name} {p.rows}" for p in ring)])
    if common == 0:
        raise NoCommonIds(f"the {n} parties have no ID in common ({sizes} IDs): there is nothing to align")
    if common < min_common:
        raise TooFewCommon(f"only {common} IDs are common to the {n} parties, fewer than --min-common "
                           f"{min_common}: no party writes a file")
    mapped = _unshuffle(coord, ring, positions[0], len(table.rows))
    rows = _agreed_rows(table, own_order[mapped])
    ids = [table.rows[i][table.id_index] for i in rows]
    _settle(coord, ring, {party.index: positions[party.index] for party in ring}, ids)
    write_aligned(table, rows, out)
    return AlignResult(common, len(table.rows), n, out)


def _exchange(coord: _Coordinator, table: Table) -> tuple[list[_Party], np.ndarray, list[list[bytes]]]:
    """Steps 0 and 1: every party's list in, then the rounds of encryption. Returns the parties in ring
    order, the coordinator's secret order of its own rows, and every list under every key."""
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
        lists[party.index] = _values_of(party.answer, party.rows, f"party {party.name}")
    sizes = ", ".join([f"{coord.name} {len(table.rows)}", *(f"{p.name} {p.rows}" for p in ring)])
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
            lists[i] = _values_of(party.answer, len(lists[i]), f"party {party.name}")
    for party in ring:
        if len(set(lists[party.index])) != len(lists[party.index]):
            raise ProtocolError(wire.ErrorCode.TENSOR, f"party {party.name}'s list holds a value twice")
    return ring, own_order, lists


def _unshuffle(coord: _Coordinator, ring: list[_Party], positions: np.ndarray, rows: int) -> np.ndarray:
    """Step 2: ``positions`` in the coordinator's list as party n-1 shuffled it, back through parties
    n-1 .. 1, each undoing its shuffle: the positions in the coordinator's own secret order."""
    mapped = positions
    for party in reversed(ring):
        coord.order(party, _positions_message(coord.run, party.index, mapped, final=False), wire.ALIGN_POSITIONS)
        coord.wait_all()
        mapped = _positions_of(party.answer, rows, len(positions), f"party {party.name}")
    return mapped


def _settle(coord: _Coordinator, ring: list[_Party], final: dict[int, np.ndarray], ids: list[str]) -> None:
    """Steps 3 and 4: each party's final positions (``final``, by index) with the coordinator's commitment
    to ``ids``, its own aligned IDs; then every party's digest checked and the others' relayed to each.
    Raises ``AlignmentDiffers`` when a party's digest is not of ``ids``."""
    n = coord.parties_wanted
    commitment = aligned_digest(coord.run, 0, ids)
    for party in ring:
        coord.order(party, _positions_message(coord.run, n, final[party.index], final=True, digest=commitment),
                    wire.ALIGN_DIGEST)
    coord.wait_all()
    answers = {party.index: _answer_of(party.answer, f"party {party.name}") for party in ring}
    differ = [p.name for p in ring
              if not hmac.compare_digest(answers[p.index]["digest"], aligned_digest(coord.run, p.index, ids))]
    if differ:
        raise AlignmentDiffers(f"the aligned ID lists differ: {', '.join(differ)} ended with other IDs (or another "
                               f"order) than {coord.name} ({len(differ)} of {n - 1} parties). A party did "
                               f"not follow the protocol (it reordered a list it encrypted, or undid its shuffle "
                               f"wrongly); no party writes its file")
    log.info("every party holds the same %d IDs in the same order", len(ids))
    for party in ring:
        others = [_relayed(answers[j], j, answers[party.index].get("key")) for j in sorted(answers) if j != party.index]
        coord.order(party, wire.Message(wire.ALIGN_DIGEST, coord.run, n + 1, body={"others": others}), wire.BYE)
    coord.wait_all()


def _answer_of(msg: wire.Message, who: str) -> dict[str, Any]:
    """A party's ``align_digest`` answer, checked: ``digest``, and with party keys its ``key`` and ``tags``."""
    body = msg.body
    if msg.tensors or set(body) - {"digest", "key", "tags"} or ("key" in body) != ("tags" in body):
        raise ProtocolError(wire.ErrorCode.MALFORMED, f"{who}: align_digest carries 'digest', and 'key' with "
                                                      f"'tags' or neither, got {wire.show(sorted(body))}")
    answer: dict[str, Any] = {"digest": _hex64(body.get("digest"), f"{who}'s digest")}
    if "key" in body:
        tags = body["tags"]
        if type(body["key"]) is not str or len(body["key"]) != 40 or type(tags) is not dict \
                or len(tags) > MAX_PARTY_KEYS or not all(type(k) is str and len(k) == 40 for k in tags):
            raise ProtocolError(wire.ErrorCode.MALFORMED, f"{who}: 'key' must be a Z85 public key and 'tags' "
                                                          f"map at most {MAX_PARTY_KEYS} such keys to tags")
        answer["key"] = body["key"]
        answer["tags"] = {k: _hex64(v, f"{who}'s tag") for k, v in tags.items()}
    return answer


def _relayed(answer: dict[str, Any], index: int, recipient: str | None) -> dict[str, Any]:
    """Party ``index``'s digest as the coordinator relays it to the party whose key is ``recipient``."""
    relayed: dict[str, Any] = {"index": index, "digest": answer["digest"]}
    if recipient is not None and recipient in answer.get("tags", {}):
        relayed.update(key=answer["key"], tag=answer["tags"][recipient])
    return relayed


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


def _take_part(link: _Link, table: Table, out: Path, parties: int | None, min_common: int,
               keys: PartyKeys | None) -> AlignResult:
    link.send(wire.Message(wire.ALIGN_JOIN, "", 0, body={"name": link.name, "rows": len(table.rows),
                                                          "parties": parties or 0, "version": ALIGN_VERSION}))
    welcome = link.receive("the welcome")
    n, index = welcome.body.get("parties"), welcome.body.get("index")
    if welcome.type != wire.WELCOME or not (type(n) is int and 2 <= n <= MAX_PARTIES and type(index) is int
                                            and 1 <= index < n):
        raise ProtocolError(wire.ErrorCode.TYPE, f"the coordinator answered the join with {welcome.describe()} "
                                                 f"{wire.show(welcome.body)}, not a welcome")
    link.run = welcome.run                   # from here on an error goes back to the coordinator
    version = welcome.body.get("version", 1)
    if version != ALIGN_VERSION:
        raise ProtocolError(wire.ErrorCode.VERSION, f"the coordinator speaks align protocol {wire.show(version)}, "
                                                    f"this party {ALIGN_VERSION}: run the same distgrad release "
                                                    f"on every party")
    log.info("party %s joined an alignment of %d parties (run %s)", link.name, n, link.run)
    if n > 2 and keys is None and link.client.curve:
        others = "party's digest" if n == 3 else f"{n - 2} parties' digests"
        log.warning("party %s: no --party-keys, so the other %s cannot be checked as theirs: a dishonest "
                    "coordinator holding IDs this party holds could make it write them although another party "
                    "does not hold them (docs/security.md)", link.name, others)
    key = new_key()
    own_order = shuffle_order(len(table.rows))
    ids = table.ids
    link.send(_values_message(link.run, 0, encrypt(hash_ids([ids[i] for i in own_order], link.tick), key,
                                                   link.tick)))
    log.debug("sent this party's encrypted list")
    shuffles: dict[int, np.ndarray] = {}     # round -> the permutation this party applied to L_0 then
    unshuffled: int | None = None            # how many positions it was asked to map back
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
            asked = _positions_of(msg, len(order), None, "the coordinator")
            _check_common(len(asked), len(table.rows), min_common, "undo its shuffle of")
            unshuffled = len(asked)
            link.send(_positions_message(link.run, msg.step, order[asked]))
        elif msg.type == wire.ALIGN_POSITIONS and rounds_done == n - 1 and msg.step == n \
                and msg.body.get("final") is True and not shuffles:
            positions = _positions_of(msg, len(table.rows), None, "the coordinator")
            _check_common(len(positions), len(table.rows), min_common, "write")
            if unshuffled is not None and len(positions) != unshuffled:
                raise ProtocolError(wire.ErrorCode.TENSOR, f"the coordinator asked this party to undo its shuffle "
                                                           f"of {unshuffled} common positions, then named "
                                                           f"{len(positions)} common rows")
            commitment = _hex64(msg.body.get("digest"), "the coordinator's digest (in its final positions)")
            rows = _agreed_rows(table, own_order[positions])
            aligned = [table.rows[i][table.id_index] for i in rows]
            if not hmac.compare_digest(commitment, aligned_digest(link.run, 0, aligned)):
                raise AlignmentDiffers(f"the coordinator's digest does not match the {len(aligned)} rows it asked "
                                       f"party {link.name} to write: it does not hold those IDs, or a party did "
                                       f"not follow the protocol; this party sends no digest and writes no file")
            link.send(wire.Message(wire.ALIGN_DIGEST, link.run, n, body=_answer(link.run, index, aligned, keys)))
            answer = link.receive("the other parties' digests")
            if answer.type != wire.ALIGN_DIGEST or answer.step != n + 1:
                raise ProtocolError(wire.ErrorCode.TYPE, f"unexpected {answer.describe()} from the coordinator "
                                                         f"while the other parties' digests were awaited")
            _check_others(answer, link.run, n, index, aligned, keys, link.name)
            write_aligned(table, rows, out)
            link.send(wire.Message(wire.BYE, link.run, n + 1))
            return AlignResult(len(positions), len(table.rows), n, out)
        else:
            raise ProtocolError(wire.ErrorCode.TYPE, f"unexpected {msg.describe()} from the coordinator after "
                                                     f"{rounds_done} of {n - 1} rounds")


def _check_common(count: int, rows: int, min_common: int, what: str) -> None:
    """A count of common IDs the coordinator names: at least ``min_common`` (else ``TooFewCommon``) and at
    most this party's ``rows``."""
    if count < min_common:
        raise TooFewCommon(f"the coordinator asked this party to {what} {count} common rows, fewer than "
                           f"--min-common {min_common}: it writes no file and sends no digest")
    if count > rows:
        raise ProtocolError(wire.ErrorCode.TENSOR, f"the coordinator asked this party to {what} {count} common "
                                                   f"rows, more than its {rows} rows")


def _answer(run: str, index: int, aligned: list[str], keys: PartyKeys | None) -> dict[str, Any]:
    """This party's ``align_digest`` body: its digest, and with party keys a tag of it for every other party."""
    digest = aligned_digest(run, index, aligned)
    if keys is None:
        return {"digest": digest}
    return {"digest": digest, "key": _show_key(keys.public),
            "tags": {_show_key(peer): digest_tag(keys.secret, peer, keys.public, peer, digest)
                     for peer in sorted(keys.trusted)}}


def _check_others(msg: wire.Message, run: str, n: int, index: int, aligned: list[str], keys: PartyKeys | None,
                  name: str) -> None:
    """Every other party's digest, as the coordinator relays it: one per index but the coordinator's and this
    party's, each of ``aligned`` as that party states it, and with party keys tagged for this party by a
    distinct trusted key. Raises ``AlignmentDiffers`` otherwise."""
    others, seen, keys_seen = msg.body.get("others"), set(), set()
    if msg.tensors or type(others) is not list or len(others) != n - 2:
        raise ProtocolError(wire.ErrorCode.MALFORMED, f"the coordinator must relay the other {n - 2} parties' "
                                                      f"digests as a list 'others', got {wire.show(others)}")
    for other in others:
        j = other.get("index") if type(other) is dict else None
        if type(j) is not int or not 1 <= j < n or j == index or j in seen:
            raise ProtocolError(wire.ErrorCode.MALFORMED, f"the coordinator relayed a digest of party index "
                                                          f"{wire.show(j)}: each of 1 to {n - 1} but {index} once")
        seen.add(j)
        digest = _hex64(other.get("digest"), f"party {j}'s digest")
        if not hmac.compare_digest(digest, aligned_digest(run, j, aligned)):
            raise AlignmentDiffers(f"party {j}'s digest, as the coordinator relays it, is not of the {len(aligned)} "
                                   f"IDs party {name} holds: the parties' lists differ; this party writes no file")
        if keys is None:
            continue
        peer = other.get("key")
        if type(peer) is not str or "tag" not in other:
            raise AlignmentDiffers(f"party {j}'s digest comes without a tag for party {name}'s key: with "
                                   f"--party-keys every party must be given the others' keys; no file written")
        try:
            raw = _raw_key(peer, f"party {j}'s key")
        except ConfigError:
            raw = b""
        if raw not in keys.trusted or raw in keys_seen:
            raise AlignmentDiffers(f"party {j}'s digest is tagged with key {wire.show(peer)}, not one of "
                                   f"--party-keys (or one that tagged another party's digest); no file written")
        keys_seen.add(raw)
        tag = _hex64(other.get("tag"), f"party {j}'s tag")
        if not hmac.compare_digest(tag, digest_tag(keys.secret, raw, raw, keys.public, digest)):
            raise AlignmentDiffers(f"party {j}'s digest is not tagged by the holder of key {peer}: the "
                                   f"coordinator relayed a digest that party did not send; no file written")


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
    min_common: int = DEFAULT_MIN_COMMON    # fewer common IDs: refused (exit 1)
    party_keys: Path | None = None          # a party with CURVE: the other parties' public keys (*.key)

    def __post_init__(self) -> None:
        if (self.bind is None) == (self.connect is None):
            raise ConfigError("give --bind ENDPOINT (the coordinator) or --connect ENDPOINT (another party), "
                              "exactly one of them")
        check_endpoint(cast(str, self.bind or self.connect), bind=self.bind is not None)
        if self.parties is not None and not 2 <= self.parties <= MAX_PARTIES:
            raise ConfigError(f"--parties counts every party, the coordinator included: 2 to {MAX_PARTIES}, "
                              f"got {self.parties}")
        if self.bind is not None and self.parties is None:
            raise ConfigError("the coordinator (--bind) needs --parties N: how many parties align, itself included")
        if self.connect is not None and self.ready_file is not None:
            raise ConfigError("--ready-file is for the coordinator (--bind)")
        check_wait("--peer-deadline", self.peer_deadline_s)     # the stages' rule: every wait is bounded
        check_wait("--liveness", self.liveness_s)
        if type(self.min_common) is not int or not 1 <= self.min_common <= MAX_IDS:
            raise ConfigError(f"--min-common must be a whole number from 1 to {MAX_IDS}, got {self.min_common!r}")
        if self.party_keys is not None and self.bind is not None:
            raise ConfigError("--party-keys is for a party that connects (--connect): the coordinator checks "
                              "every party's digest itself")
        if self.name is None:
            self.name = COORDINATOR_NAME if self.bind is not None else f"party-{os.getpid()}"
        if not 0 < len(self.name) <= 128 or not self.name.isprintable():
            raise ConfigError(f"--name must be 1 to 128 printable characters, got {self.name!r}")
        self.input, self.out = Path(self.input), Path(self.out)
        if not self.out.parent.is_dir():
            raise ConfigError(f"cannot write {self.out}: directory {self.out.parent} does not exist")
        if self.out.exists() and not self.out.is_file():
            raise ConfigError(f"--out {self.out} exists and is not a file (a directory?): give the path of the "
                              f"aligned CSV file to write")
        if not os.access(self.out.parent, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot write {self.out}: directory {self.out.parent} is not writable")
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
    refusal or a bad message, ``NoCommonIds`` when no ID is common or fewer
    than ``min_common`` (``TooFewCommon``; no party writes a file),
    ``AlignmentDiffers`` when the parties' aligned IDs differ. With
    ``party_keys``, ``security`` must be a ``keys.CurveClient``.
    """
    table = table if table is not None else read_table(options.input, options.id_column)
    keys = None
    if options.party_keys is not None:
        if not all(hasattr(security, a) for a in ("public", "secret", "server_key")):
            raise ConfigError("--party-keys needs CURVE: --curve-secret and --server-key")
        curve: Any = security           # a CurveClient, or any object with its three keys
        keys = PartyKeys.load(curve.public, curve.secret, curve.server_key, options.party_keys)
    ctx = ctx or zmq.Context.instance()
    max_bytes = MAX_IDS * VALUE_BYTES
    if options.bind is not None:
        assert options.parties is not None          # AlignOptions requires --parties with --bind
        server = Server(ctx, options.bind, max_bytes + wire.HEADER_MAX_BYTES, options.liveness_s, security)
        coord = _Coordinator(server, options.parties, options.peer_deadline_s, check_stop, max_bytes,
                             name=cast(str, options.name))
        try:
            log.info("coordinating the alignment of %d parties on %s (%s); %d IDs here", options.parties,
                     server.endpoint, "CURVE: encrypted, allowed keys only" if server.authenticated else "plaintext",
                     len(table.rows))
            if options.ready_file is not None:
                tmp = options.ready_file.with_name(options.ready_file.name + ".tmp")
                tmp.write_text(server.endpoint)
                tmp.replace(options.ready_file)
            try:
                return _coordinate(coord, table, options.out, options.min_common)
            except BaseException as e:
                coord.abort(e)
                raise
        finally:
            server.close()
    # AlignOptions requires --bind or --connect, and names every party.
    assert options.connect is not None and options.name is not None
    client = Client(ctx, options.connect, max_bytes + wire.HEADER_MAX_BYTES, max_bytes, options.liveness_s, security)
    link = _Link(client, options.name, options.peer_deadline_s, check_stop, max_bytes)
    linger_ms = LINGER_MS
    try:
        try:
            result = _take_part(link, table, options.out, options.parties, options.min_common, keys)
        except (DistgradError, OSError) as e:
            # Errors the coordinator sent need no answer; this party's own refusals go back with their code.
            if link.run and not isinstance(e, (PeerRejected, PeerTimeout)) \
                    and (isinstance(e, TooFewCommon) or not isinstance(e, NoCommonIds)):
                code = TOO_FEW if isinstance(e, TooFewCommon) else MISMATCH if isinstance(e, AlignmentDiffers) \
                    else ABORTED
                link.send(wire.error_message(link.run, 0, code, f"party {options.name} failed: {e}"))
            raise
        # The bye is the last message and has no reply: close may take up to the peer deadline to deliver it
        # (a short linger dropped it under load, and the coordinator waited out its deadline for it).
        linger_ms = int(options.peer_deadline_s * 1000)
        return result
    finally:
        client.close(linger_ms)
