"""Secure aggregation's pairwise masks: what a vertical feature party adds to its fixed-point embedding so
that the label owner sees only the parties' sum (``secure_aggregation``; docs/privacy.md).

Every pair of feature parties ``(i, j)``, ``i < j`` in stage order, shares a
key that only the two of them can derive: X25519 of one's CURVE secret key and
the other's public key (``crypto_scalarmult`` through PyNaCl, as ``distgrad
align`` does), hashed with both public keys (``pair_key``). Each party is
configured with the other parties' public keys (``--party-keys DIR``, one
``NAME.key`` per party, ``load_party_keys``); nothing the label owner relays
goes into a key, so it cannot put a key of its own in a party's place.

A run's masks are bound to the run: its session (``mask_session``) is
BLAKE2b of every feature party's run id, in party order. Each party
contributes its own (a fresh random id for every run it begins, its
checkpoint's on ``--resume``) and learns the others' from the label owner
(the welcome's or a pong's ``mask_runs``, which must name this party's own
run id at its place), so a party's masks are new in every run it begins,
whatever run ids the other parties or the label owner name: the masked
values of two runs made with the same keys do not share a mask. A resumed
run names the same run ids, so it draws the same masks, bit for bit. All
parties of a run bind to the one list the label owner relays, and a party
that begins a new run sends every other party to say hello again and bind
to the new list (``Parties.join``); a list that names other runs for the
other parties gives masks that do not cancel, never an earlier run's.

For a tensor named ``tensor`` (its stream: ``activation/mb0of2``, or
``activation`` for held-out rows) at ``step``, the pair's mask is the first
``8 * n`` bytes of SHAKE-256 of the pair key, the session and that context,
read as ``n`` little-endian uint64 (``pair_mask``). Party ``i`` adds the
masks of the pairs ``(i, j > i)`` and subtracts those of ``(j < i, i)``,
modulo 2**64 (``PairMasks.mask``): summed over every party the masks cancel
exactly, and each party's masked part alone is uniformly distributed to
anyone without the keys of its pairs. Masks are drawn only once bound to a
run (``PairMasks.for_run``; unbound, encoding raises ``ConfigError``).
``SecureSumCodec`` is the activation codec that rounds the embedding to
fixed point (``aggregate.quantise``) and adds the mask; the receiver keeps
the masked integers for ``aggregate.combine_fixed``.

Every masked contribution says which session it was masked for: its
``session`` part, the first ``SESSION_TAG_BYTES`` bytes of the session
(``session_tag``; public, as the run ids are). The party that sums refuses,
through ``unmatched_sessions``, the contributions of a micro-batch or an
evaluation whose tags differ from one another or from the session of the
run ids it names itself (``mask_runs``): masks of two sessions do not
cancel, and their sum is noise, not the parties' embeddings. The in-process
reference masks nothing: it adds the unmasked fixed point, which the masked
parts sum to exactly, so the masks never change a result.

Within a run a mask is a function of the pair, the stream and the step: a
tensor sent again with the same values (a resend, a rollback, a resume)
crosses as the same integers. A label owner that sent a party other
gradients the second time would see two values under one mask (their
difference): docs/privacy.md says what that means.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from distgrad.errors import ConfigError, ProtocolError
from distgrad.model.aggregate import SECURE_SUM, quantise
from distgrad.wire.codecs import Codec, Parts, Shape, WireSpecs
from distgrad.wire.messages import RUN_ID, ErrorCode, Message, show
from distgrad.wire.wirecodec import ACTIVATION

PAIR_DOMAIN = b"distgrad-secure-aggregation-pair-v1\x00"   # domain separation of a pair's key
MASK_DOMAIN = b"distgrad-secure-aggregation-mask-v2\x00"   # of a mask drawn from it (v2: bound to the run)
SESSION_DOMAIN = b"distgrad-secure-aggregation-session-v1\x00"   # of a run's session (every party's run id)
TAG_DOMAIN = b"distgrad-secure-aggregation-tag-v1\x00"     # of the tag that shows two parties share it
KEY_BYTES = 32                                              # an X25519 key
SESSION_TAG_BYTES = 8          # of its session a masked contribution names (``session_tag``): crosses every step
SESSION_PART = "session"       # the ``SecureSumCodec`` part that carries it (``activation.session``)
_I8 = np.dtype("i1")
_I64 = np.dtype("<i8")
_U64 = np.dtype("<u8")


def raw_key(z85_key: bytes | str, what: str) -> bytes:
    """A CURVE key's 32 raw bytes from its 40 Z85 characters; ``ConfigError`` naming ``what`` otherwise."""
    from zmq.utils import z85
    try:
        raw = z85.decode(z85_key) if len(z85_key) == 40 else b""
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"{what} is not a Z85 CURVE key") from e
    if len(raw) != KEY_BYTES:
        raise ConfigError(f"{what} is not a CURVE key (40 Z85 characters)")
    return raw


def pair_key(secret: bytes, own_public: bytes, peer_public: bytes, own_first: bool) -> bytes:
    """The key a pair of parties shares: BLAKE2b of X25519(``secret``, ``peer_public``) and both public
    keys, the pair's first party's (lower stage index) first, so both parties derive the same.
    Raises ``ConfigError`` for a peer key that is a low-order point."""
    from nacl.bindings import crypto_scalarmult
    from nacl.exceptions import CryptoError

    try:
        shared = crypto_scalarmult(secret, peer_public)
    except CryptoError as e:
        raise ConfigError("a party's public key is a low-order point: it shares no secret with anyone") from e
    first, second = (own_public, peer_public) if own_first else (peer_public, own_public)
    return hashlib.blake2b(PAIR_DOMAIN + shared + first + second, digest_size=KEY_BYTES).digest()


def mask_session(runs: Sequence[str]) -> bytes:
    """The session of a run's masks: BLAKE2b of ``runs``, every feature party's run id in party order
    (each length-prefixed, so no two lists give the same bytes). Raises ``ValueError`` for a run id that is
    not one (``messages.RUN_ID``, not empty)."""
    parts = [SESSION_DOMAIN, len(runs).to_bytes(8, "little")]
    for run in runs:
        if not isinstance(run, str) or not run or not RUN_ID.fullmatch(run):
            raise ValueError(f"{show(run)} is not a run id (1 to 128 of A-Z a-z 0-9 _ . -)")
        raw = run.encode("ascii")
        parts += [len(raw).to_bytes(8, "little"), raw]
    return hashlib.blake2b(b"".join(parts), digest_size=KEY_BYTES).digest()


def session_tag(session: bytes) -> bytes:
    """What a masked contribution says of the session it was masked for (``mask_session``): its first
    ``SESSION_TAG_BYTES`` bytes. The session is a hash of run ids the label owner relays, so the tag hides
    nothing and tells two sessions apart."""
    if len(session) != KEY_BYTES:
        raise ValueError(f"a mask session is {KEY_BYTES} bytes (mask_session), got {len(session)}")
    return bytes(session[:SESSION_TAG_BYTES])


def pair_mask(key: bytes, session: bytes, tensor: str, step: int, count: int) -> np.ndarray:
    """``count`` uint64 of the pair ``key``'s mask in run ``session`` (``mask_session``) for ``tensor`` at
    ``step`` (SHAKE-256, little-endian)."""
    if len(session) != KEY_BYTES:
        raise ValueError(f"a mask session is {KEY_BYTES} bytes (mask_session), got {len(session)}")
    name = tensor.encode("utf-8")
    context = (MASK_DOMAIN + key + session + len(name).to_bytes(8, "little") + name
               + int(step).to_bytes(8, "little"))
    return np.frombuffer(hashlib.shake_256(context).digest(8 * count), _U64).copy()


def pair_tag(key: bytes) -> str:
    """A short public digest of a pair key: the two parties of a pair give the same tag exactly when they
    derived the same key (the label owner compares them; the tag tells it nothing of the key)."""
    return hashlib.blake2b(TAG_DOMAIN + key, digest_size=16).hexdigest()


@dataclass(frozen=True)
class PairMasks:
    """Party ``own`` (an index into ``parties``, the feature parties in stage order), the key it shares
    with every other party (``keys[name]``) and the run its masks are bound to (``for_run``; None: none
    yet, and ``mask`` refuses)."""

    parties: tuple[str, ...]
    own: int
    keys: Mapping[str, bytes] = field(repr=False)
    runs: tuple[str, ...] | None = None
    session: bytes | None = field(default=None, repr=False)

    def for_run(self, runs: object, own_run: str | None = None) -> PairMasks:
        """These keys bound to the run of ``runs``, every feature party's run id in party order (what the
        label owner relays: ``mask_runs``). ``own_run``: this party's own run id, which ``runs`` must name at
        its place (no one else chooses this party's part of the session). Raises ``ProtocolError``
        (``mismatch``) unless ``runs`` is one valid run id per party."""
        if (not isinstance(runs, (list, tuple)) or len(runs) != len(self.parties)
                or not all(isinstance(run, str) for run in runs)):
            raise ProtocolError(ErrorCode.MISMATCH, f"mask_runs={show(runs)}: expected the run id of each "
                                                    f"feature party ({', '.join(self.parties)}), in that order")
        if own_run is not None and runs[self.own] != own_run:
            raise ProtocolError(ErrorCode.MISMATCH, f"mask_runs names run {show(runs[self.own])} for party "
                                                    f"{self.parties[self.own]}, whose run is {own_run}: its masks "
                                                    f"are bound to its own run")
        try:
            session = mask_session(runs)
        except ValueError as e:
            raise ProtocolError(ErrorCode.MISMATCH, f"mask_runs: {e}") from e
        return replace(self, runs=tuple(runs), session=session)

    def mask(self, shape: Shape, tensor: str, step: int) -> np.ndarray:
        """This party's uint64 mask of ``shape`` for ``tensor`` at ``step`` of its run (``for_run``): + the
        pairs where it comes first, - those where it comes second (mod 2**64); the masks of all parties of
        the run sum to zero. Raises ``ConfigError`` when the masks are bound to no run."""
        if self.session is None:
            raise ConfigError("secure aggregation: masks are drawn for a run; bind them to it first "
                              "(PairMasks.for_run with every feature party's run id)")
        count = math.prod(shape)
        total = np.zeros(count, _U64)
        for index, name in enumerate(self.parties):
            if index != self.own:
                drawn = pair_mask(self.keys[name], self.session, tensor, step, count)
                if index > self.own:
                    total += drawn
                else:
                    total -= drawn
        return total.reshape(shape)

    def tags(self) -> dict[str, str]:
        """``{other party: pair_tag}``: what this party says it shares with each other party."""
        return {name: pair_tag(key) for name, key in self.keys.items()}


def load_party_keys(directory: Path, parties: Sequence[str], own: str, public_z85: bytes,
                    secret_z85: bytes) -> PairMasks:
    """The masks of feature party ``own`` of ``parties``, from its CURVE key pair (Z85, as
    ``keys.CurveClient`` holds it) and ``directory/NAME.key`` of every other party. Raises ``ConfigError``
    naming the directory or the file (missing, not a key, this party's own key, the same key twice)."""
    from distgrad.wire.keys import check_trusted, load_public

    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"--party-keys {directory} is not a directory of the other feature parties' public "
                          f"keys (NAME.key each)")
    check_trusted(directory, "--party-keys directory")
    own_public = raw_key(public_z85, "this party's public key")
    secret = raw_key(secret_z85, "this party's secret key")
    index = list(parties).index(own)
    keys, seen = {}, {own_public: f"this party's own key ({own})"}
    for position, name in enumerate(parties):
        if name == own:
            continue
        path = directory / f"{name}.key"
        if not path.is_file():
            raise ConfigError(f"--party-keys {directory} has no {name}.key: secure aggregation needs the public "
                              f"key of every other feature party, named by its stage ({', '.join(parties)})")
        check_trusted(path, "party key file")
        public = raw_key(load_public(path), str(path))
        if public in seen:
            raise ConfigError(f"{path} holds the same key as {seen[public]}: every feature party has its own key")
        seen[public] = str(path)
        try:
            keys[name] = pair_key(secret, own_public, public, index < position)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from e
    return PairMasks(tuple(parties), index, keys)


def check_tags(tags: Mapping[str, Mapping[str, str]]) -> str | None:
    """What is wrong with the tags every feature party said (``{party: {other: tag}}``, ``PairMasks.tags``),
    or None when every pair agrees: then their masks cancel in the sum."""
    names = list(tags)
    for i, first in enumerate(names):
        for second in names[i + 1:]:
            one, other = tags[first].get(second), tags[second].get(first)
            if one is None or one != other:
                return (f"feature parties {first} and {second} do not share a mask key (their --party-keys "
                        f"disagree with the keys they run with: {first}'s {second}.key must be {second}'s public "
                        f"key and the other way round); their masks would not cancel")
    return None


def read_tags(value: object, parties: Sequence[str], own: str) -> dict[str, str]:
    """A hello's ``mask_tags`` from party ``own``, checked: one 32-hex-digit tag per other party. Raises
    ``ProtocolError`` (``mismatch``) otherwise."""
    others = [name for name in parties if name != own]
    if not isinstance(value, dict) or sorted(value) != sorted(others) or not all(
            isinstance(tag, str) and len(tag) == 32 and all(c in "0123456789abcdef" for c in tag)
            for tag in value.values()):
        raise ProtocolError(ErrorCode.MISMATCH, f"party {own} says no mask key for each other party "
                                                f"({', '.join(others)}): with secure aggregation every feature "
                                                f"party runs with --party-keys")
    return {str(name): str(tag) for name, tag in value.items()}


@dataclass(frozen=True)
class SecureSumCodec(Codec):
    """The activation codec of a feature party under secure aggregation among ``parties`` parties: the
    embedding in fixed point (``aggregate.quantise``), plus this party's ``masks`` (None: unmasked, what
    the in-process reference and a receiver hold), as int64 (part ``masked``), and the tag of the session
    the masks are bound to (part ``session``: ``SESSION_TAG_BYTES`` int8, ``session_tag``), which the
    receiver keeps beside the decoded tensor (``kept_parts``) for ``unmatched_sessions``. ``decode`` gives
    the (masked) integers themselves, not float32: only their sum over every party means something
    (``aggregate.combine_fixed``). ``roundtrip`` is the unmasked fixed point, whose sum equals the sum of
    the masked parts exactly."""

    parties: int = 2
    masks: PairMasks | None = field(default=None, compare=False, repr=False)

    name = SECURE_SUM
    kept_parts = (SESSION_PART,)    # the summing party compares the sessions of every contribution

    def _specs(self, shape: Shape) -> WireSpecs:
        return {"masked": (shape, _I64), SESSION_PART: ((SESSION_TAG_BYTES,), _I8)}

    def _encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        if self.masks is None:
            raise ConfigError("secure aggregation: this party has no mask keys (--curve-secret and --party-keys)")
        fixed = quantise(x, self.parties, tensor_name, step)
        fixed += self.masks.mask(x.shape, tensor_name, step)     # raises unless bound to a session
        assert self.masks.session is not None
        return {"masked": fixed.view(_I64),
                SESSION_PART: np.frombuffer(session_tag(self.masks.session), _I8).copy()}

    def _decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        return parts["masked"]

    def for_run(self, runs: object, own_run: str | None = None) -> SecureSumCodec:
        """This codec with its masks bound to the run of ``runs`` (``PairMasks.for_run``)."""
        if self.masks is None:
            raise ConfigError("secure aggregation: this party has no mask keys (--curve-secret and --party-keys)")
        return replace(self, masks=self.masks.for_run(runs, own_run))

    def roundtrip(self, x: np.ndarray, tensor_name: str = "tensor", step: int = 0) -> np.ndarray:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32:
            raise TypeError(f"codec {self.name}: tensor {tensor_name!r} must be a float32 ndarray")
        return quantise(x, self.parties, tensor_name, step).view(_I64)


def received_tag(msg: Message, tensor: str = ACTIVATION) -> bytes | None:
    """The session tag a received message's masked ``tensor`` names (its ``TENSOR.session`` part, which
    ``WireTensor.unpack`` keeps), None when it carries none."""
    tag = msg.tensors.get(f"{tensor}.{SESSION_PART}")
    if not isinstance(tag, np.ndarray) or tag.dtype != _I8 or tag.shape != (SESSION_TAG_BYTES,):
        return None
    return tag.tobytes()


def unmatched_sessions(contributions: Sequence[tuple[str, Message]], runs: Sequence[object], what: str) -> str | None:
    """Why the masked contributions of ``what`` (e.g. ``step 3 micro-batch 0``) may not be summed, or None
    when they may: ``contributions`` are ``(who, message)`` of every party summed (``who`` names it in the
    text, e.g. ``party b``), ``runs`` the run ids the summing party names itself (its ``mask_runs``). Every
    message must name (``received_tag``) the session of ``runs``: masks of two sessions do not cancel. The
    text names each party whose session differs, the sessions, and what to do."""
    try:
        expected: bytes | None = session_tag(mask_session([run if isinstance(run, str) else "" for run in runs]))
    except ValueError:
        expected = None             # not every party's run is known: no contribution can be bound to them
    tags = [(who, received_tag(msg)) for who, msg in contributions]
    off = [who for who, tag in tags if tag is None or tag != expected]
    if not off:
        return None
    by_tag: dict[bytes | None, list[str]] = {}
    for who, tag in tags:
        by_tag.setdefault(tag, []).append(who)
    said = "; ".join(f"{', '.join(names)} masked for session {tag.hex()}" if tag is not None else
                     f"{', '.join(names)} named no session" for tag, names in by_tag.items())
    named = (f"this stage names the runs {show(list(runs))} (mask_runs), session {expected.hex()}"
             if expected is not None else "this stage has not named every feature party's run yet")
    return (f"secure aggregation: the masks of {what} would not cancel, so nothing was summed or applied: "
            f"{', '.join(off)} masked for another session than the runs this stage names, and must say hello "
            f"again to bind {'its' if len(off) == 1 else 'their'} masks to them (restart the parties with "
            f"--resume). {said}; {named}")
