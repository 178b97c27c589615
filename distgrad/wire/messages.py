"""The wire format: a header frame, then one raw frame per tensor.

See docs/protocol.md for the specification. Control messages (hello, error,
bye, ...) have a self-describing msgpack header naming each tensor's dtype and
shape. The hot path, ``forward`` and ``backward``, has a fixed-layout binary
header (``BINARY_HEADER``: ids, loss, compute time, tensor count) and sends no
tensor descriptions at all: the receiver knows them from the handshake and
reads the frames against its per-step expectation (``FrameLayout``) in
``expect_tensors``, which checks every frame's byte length first.

``encode`` turns a ``Message`` into frames for ``send_multipart``; ``decode``
validates frames received from the network and raises ``ProtocolError`` (with
a code from ``ErrorCode``) before anything else looks at them. Nothing
received is ever unpickled or evaluated: headers are msgpack with size limits
or ``struct`` fields, tensors are raw bytes read with ``np.frombuffer``.
"""

from __future__ import annotations

import math
import operator
import re
import reprlib
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import msgpack
import numpy as np

from distgrad.errors import ProtocolError

PROTOCOL_VERSION = 5                  # 5: binary forward/backward headers; 4: wire codecs (float16, uint16, int8
                                      # tensors); 3: the hello carries the interface's fields (docs/protocol.md)
HEADER_MAX_BYTES = 64 * 1024          # a header is small and fixed in shape
MAX_TENSORS = 64                      # tensors in one message
MAX_NDIM = 8
MAX_DIM = 2**31 - 1                   # largest extent of one dimension
ERROR_TEXT_MAX = 1000                 # error replies are cut to this many characters
RUN_ID = re.compile(r"[A-Za-z0-9_.-]{0,128}")   # printable, so it is safe in log lines
DEFAULT_MAX_TENSOR_BYTES = 1 << 30    # without an expectation, 1 GiB per message at most
ALIGN_BYTES = 16                      # received tensors at other addresses are copied (see decode)
ALWAYS_COPY_BYTES = 64 * 1024         # received tensors smaller than this are copied whatever their address
RECEIVE_BUFFERS = 4                   # aligned buffers kept per expected tensor for misaligned frames (FrameLayout)

# Message types. "checkpoint" is reserved (receivers reject it as unsupported).
HELLO, WELCOME, FORWARD, BACKWARD, ERROR, BYE = "hello", "welcome", "forward", "backward", "error", "bye"
PING, PONG = "ping", "pong"
EVALUATE, EVALUATION = "evaluate", "evaluation"
AVERAGE = "average"                   # SplitFed: a client's first-stage parameters, and the reply: their mean
PREDICT, PREDICTED = "predict", "predicted"   # ``distgrad predict``: activations of new rows, and the bare ack
# ``distgrad align`` (distgrad/align.py): a party's join, a list of encrypted IDs, positions in a list,
# the digest of a party's aligned IDs.
ALIGN_JOIN, ALIGN_VALUES, ALIGN_POSITIONS = "align_join", "align_values", "align_positions"
ALIGN_DIGEST = "align_digest"
MESSAGE_TYPES = frozenset({HELLO, WELCOME, FORWARD, BACKWARD, ERROR, BYE, PING, PONG, EVALUATE, EVALUATION,
                           AVERAGE, PREDICT, PREDICTED, ALIGN_JOIN, ALIGN_VALUES, ALIGN_POSITIONS, ALIGN_DIGEST})
RESERVED_TYPES = frozenset({"checkpoint"})

# The binary header of the hot path's messages (docs/protocol.md, *Binary header*), little-endian:
# magic, version, type, flags, tensor count, run id length, reserved (0), step, mb, mbs, loss, compute_s;
# the run id's ASCII bytes follow. 0xC1 is the one byte msgpack never uses, so the first byte of a
# header frame tells the two forms apart.
BINARY_HEADER = struct.Struct("<BBBBBBHQIIdd")     # 40 bytes
BINARY_MAGIC = 0xC1
BINARY_TYPES: dict[str, int] = {FORWARD: 1, BACKWARD: 2}
_BINARY_NAMES = {code: name for name, code in BINARY_TYPES.items()}
_BACKWARD_CODE = BINARY_TYPES[BACKWARD]
RUN_ID_MAX = 128                       # characters (bytes) in a run id
# A backward reply's body says ``{LOSS_WITHHELD_KEY: true}`` instead of carrying a ``loss`` when its sender, the
# label owner, withholds the training loss (a guarantee of its covers everything it sends:
# ``Defenses.withholds_loss``); such a reply has the self-describing header (the binary one always has a loss).
# Records then hold null, and what a human reads says ``LOSS_WITHHELD``.
LOSS_WITHHELD_KEY = "loss_withheld"
LOSS_WITHHELD = "withheld by the label owner"
# BINARY_HEADER followed by the run id, one Struct per run id length: one call packs or unpacks a header frame,
# its run id included.
_HEADERS = [struct.Struct(BINARY_HEADER.format + f"{size}s") for size in range(RUN_ID_MAX + 1)]

# Tensor dtypes on the wire, always little-endian. float16, uint16 (bfloat16's bits) and int8 carry the
# parts of a coded tensor (``distgrad.wire.codecs``, ``distgrad.wire.wirecodec``).
DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "float16": np.dtype("<f2"),
    "uint16": np.dtype("<u2"),
    "int8": np.dtype("i1"),
}


# Little-endian (native here) dtypes to their wire names; any other dtype takes the slow path in encode.
_WIRE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_packb = msgpack.packb
_unpackb = msgpack.unpackb
_frombuffer_nd = np.ndarray
_vdot = np.vdot
_isfinite = math.isfinite

_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother = 3, 60, 60


class ErrorCode:
    """Codes carried by error replies (``body.code``)."""

    MALFORMED = "malformed"            # not a decodable distgrad message
    VERSION = "version"                # unsupported protocol version
    TYPE = "type"                      # unknown or unexpected message type
    TENSOR = "tensor"                  # frame count, dtype, shape or byte length wrong
    NONFINITE = "nonfinite"            # NaN or Inf where the experiment forbids them
    MISMATCH = "mismatch"              # handshake: experiment, seed or shapes differ
    RUN = "run"                        # unknown run id / no handshake yet / busy with another run
    STEP = "step"                      # out-of-order step
    STAGE = "stage"                    # the stage failed computing the step
    NONFINITE_STEP = "nonfinite_step"  # the stage's own loss or gradient is NaN/Inf: nothing applied, the run ends
    ABORTED = "aborted"                # a notice, not a reply: its sender stopped (``abort_notice``)


@dataclass(slots=True)
class Message:
    """One protocol message. ``tensors`` keeps insertion order (frame order).

    A received ``forward`` or ``backward`` (binary header) arrives with its
    tensor frames in ``frames`` (memoryviews) and no ``tensors`` yet: the
    header does not say what they hold, the receiver's expectation does
    (``expect_tensors`` reads them, checked, and sets ``frames`` back to None).
    """

    type: str
    run: str = ""
    step: int = 0
    mb: int = 0
    mbs: int = 1
    body: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    frames: tuple[Any, ...] | None = None

    def describe(self) -> str:
        return f"{self.type} run={self.run or '-'} step={self.step} mb={self.mb}/{self.mbs}"


def encode(msg: Message) -> list[Any]:
    """Frames for ``msg``: the header bytes, then each tensor's C-contiguous array. A ``forward`` or
    ``backward`` has the binary header, but for rows it would not carry as read (``_rows_as_read``) and a
    ``backward`` whose loss is withheld (``LOSS_WITHHELD_KEY``), which have the msgpack one.

    Arrays are passed as themselves (buffer protocol), so the transport can
    send them without a copy. Raises ``ValueError`` for a dtype the wire does
    not carry.
    """
    if msg.frames is not None:
        raise ValueError(f"{msg.describe()}: its tensor frames were never read (wire.expect_tensors)")
    code = BINARY_TYPES.get(msg.type)
    # A backward whose loss is withheld (``LOSS_WITHHELD_KEY``) is self-describing: the binary header's loss
    # field cannot say "none".
    if (code is not None and ("rows" not in msg.tensors or _rows_as_read(msg))
            and (code != _BACKWARD_CODE or LOSS_WITHHELD_KEY not in msg.body)):
        return _encode_binary(msg, code)
    specs, frames = [], []
    for name, array in msg.tensors.items():
        array, wire_name = _wire_array(name, array)
        specs.append([name, wire_name, list(array.shape)])
        frames.append(array)
    header = {"v": PROTOCOL_VERSION, "type": msg.type, "run": msg.run, "step": msg.step,
              "mb": msg.mb, "mbs": msg.mbs, "body": msg.body, "tensors": specs}
    return [_packb(header, use_bin_type=True), *frames]


def _rows_as_read(msg: Message) -> bool:
    """Whether a binary header would carry ``msg``'s ``rows`` (``send_rows``) as its receiver reads them:
    one int64 per row, shape ``(n,)``. Its shape and dtype do not travel, so rows of another shape (or
    dtype) with the same bytes would be read as valid rows; such a message goes with the self-describing
    msgpack header instead, which the receiver refuses naming the shape and dtype it got."""
    rows = msg.tensors.get("rows")
    return rows is None or (type(rows) is np.ndarray and rows.ndim == 1 and rows.dtype == _INT64)


_INT64 = np.dtype("<i8")


def _wire_array(name: str, array: Any) -> tuple[np.ndarray, str]:
    """``array`` as a C-contiguous little-endian array the wire carries, and its wire dtype name."""
    if type(array) is not np.ndarray or not array.flags.c_contiguous:
        array = np.asarray(array, order="C")  # keeps 0-d arrays 0-d (ascontiguousarray makes them 1-d)
    wire_name = _WIRE_NAMES.get(array.dtype)  # a dict lookup: ``dtype.name`` costs microseconds
    if wire_name is None:
        wire_name = array.dtype.name
        if wire_name not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot be sent; use one of {sorted(DTYPES)}")
        array = array.astype(DTYPES[wire_name])      # big-endian: the wire is little-endian
    return array, wire_name


_BUSY = re.compile(r"heard ([0-9.]+) s ago, taken as gone after ([0-9.eE+]+) s of silence")


def busy_text(what: str, run: str, since: float, who: str, silent_s: float, liveness_s: float) -> str:
    """The ``run`` error's text refusing a hello of another run while ``run`` (started at ``since``, seconds
    since the epoch) is live, ``who`` (its client) heard ``silent_s`` ago: ``busy with run 'r1' since
    2026-12-06T12:00:00Z (its client: heard 0.01 s ago, taken as gone after 10 s of silence)``.
    ``busy_silence`` reads the figures back."""
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(since)) if since else "an unknown time"
    return (f"busy with {what} {run!r} since {started} ({who}: heard {silent_s:.2f} s ago, taken as gone after "
            f"{liveness_s:g} s of silence)")


def busy_silence(text: str) -> tuple[float, float] | None:
    """``(silent_s, liveness_s)`` of a ``busy_text``; None for any other text."""
    found = _BUSY.search(text) if text.startswith("busy") else None
    return (float(found.group(1)), float(found.group(2))) if found else None


_BACKWARD_BODY = frozenset({"loss", "compute_s"})


def _encode_binary(msg: Message, code: int) -> list[Any]:
    """A forward's or backward's frames: ``BINARY_HEADER`` + run id, then the tensors, in order.

    Raises ``ValueError`` for what the binary header cannot carry: a body
    other than ``{}`` (forward) or ``loss`` and ``compute_s`` (backward), a
    run id that is not ASCII or longer than ``RUN_ID_MAX``, ids out of range.
    """
    body, tensors = msg.body, msg.tensors
    if code == _BACKWARD_CODE:
        if "loss" not in body or not body.keys() <= _BACKWARD_BODY:
            raise ValueError(f"{msg.describe()}: a backward's body is loss and compute_s, got {sorted(body)}")
        loss, compute_s = float(body["loss"]), float(body.get("compute_s", 0.0))
    elif body:
        raise ValueError(f"{msg.describe()}: a forward carries no body, got {sorted(body)}")
    else:
        loss = compute_s = 0.0
    run = msg.run.encode("ascii")
    if len(run) > RUN_ID_MAX or len(tensors) > MAX_TENSORS:
        raise ValueError(f"{msg.describe()}: run id over {RUN_ID_MAX} characters or over {MAX_TENSORS} tensors")
    try:
        header = _HEADERS[len(run)].pack(BINARY_MAGIC, PROTOCOL_VERSION, code, 0, len(tensors), len(run), 0,
                                         msg.step, msg.mb, msg.mbs, loss, compute_s, run)
    except struct.error as e:
        raise ValueError(f"{msg.describe()}: does not fit the binary header: {e}") from e
    frames: list[Any] = [header]
    for name, array in tensors.items():
        # an array the wire carries as it is (``_wire_array``'s first case) is taken without the call
        frames.append(array if type(array) is np.ndarray and array.flags.c_contiguous and array.dtype in _WIRE_NAMES
                      else _wire_array(name, array)[0])
    return frames


def _is_int(value: Any, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def decode(frames: Sequence[Any], max_tensor_bytes: int = DEFAULT_MAX_TENSOR_BYTES) -> Message:
    """Validate and decode one message's frames (no routing envelope).

    Tensors are read-only views of the received buffers: no copy, unless a
    buffer is small or not ``ALIGN_BYTES``-aligned (then one copy, ``_received``). Raises
    ``ProtocolError`` naming what is wrong, and nothing else, whatever the
    bytes; nothing is decoded past the first problem, and the sum of tensor
    sizes may not exceed ``max_tensor_bytes``.
    """
    try:
        if not frames:
            raise ProtocolError(ErrorCode.MALFORMED, "empty message")
        first = memoryview(frames[0])
        if first.nbytes and first[0] == BINARY_MAGIC:
            return _decode_binary(frames, first, max_tensor_bytes)
        return _decode_msgpack(frames, first, max_tensor_bytes)
    except ProtocolError:
        raise
    except (TypeError, ValueError, OverflowError, RecursionError, NotImplementedError) as e:
        # A backstop: hostile input must never escape as anything but a protocol error.
        raise ProtocolError(ErrorCode.MALFORMED, f"undecodable message: {type(e).__name__}: {show(str(e))}") from e


def show(value: Any) -> str:
    """A bounded repr for error messages about hostile values."""
    return _REPR.repr(value)


_UNPACK_LIMITS = dict(raw=False, strict_map_key=True, use_list=True, max_str_len=HEADER_MAX_BYTES,
                      max_bin_len=HEADER_MAX_BYTES, max_array_len=4096, max_map_len=256, max_ext_len=0)
_RUNS_SEEN: set[str] = set()      # run ids that passed RUN_ID (a run's messages skip the regex)
_RUNS_SEEN_MAX = 64


def _decode_msgpack(frames: Sequence[Any], first: memoryview, max_tensor_bytes: int) -> Message:
    """A message with a msgpack header (``first``, a view of frames[0])."""
    # The checks below are the specification's, in its order; they test exact types
    # (``type(x) is int`` is False for bools, as msgpack's True is not the integer 1).
    get = _unpack_header(first).get
    version = get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.VERSION, f"protocol version {show(version)} is not supported; this side speaks {PROTOCOL_VERSION}")
    msg_type = get("type")
    if type(msg_type) is not str or msg_type not in MESSAGE_TYPES:
        known = sorted(MESSAGE_TYPES)
        what = "reserved but not supported yet" if isinstance(msg_type, str) and msg_type in RESERVED_TYPES else "unknown"
        raise ProtocolError(ErrorCode.TYPE, f"message type {show(msg_type)} is {what}; known types: {known}")
    run = get("run")
    if type(run) is not str or (run not in _RUNS_SEEN and not _valid_run(run)):
        raise ProtocolError(ErrorCode.MALFORMED, f"'run' must be at most 128 characters from [A-Za-z0-9_.-], "
                                                 f"got {show(run)}")
    step, mb, mbs = get("step"), get("mb"), get("mbs")
    if not (type(step) is int and type(mb) is int and type(mbs) is int and step >= 0 and 0 <= mb < mbs):
        raise ProtocolError(ErrorCode.MALFORMED, f"need integers step >= 0 and 0 <= mb < mbs, got step={show(step)} mb={show(mb)} mbs={show(mbs)}")
    body = get("body")
    if type(body) is not dict:
        raise ProtocolError(ErrorCode.MALFORMED, f"'body' must be a map, got {type(body).__name__}")
    tensors = _msgpack_tensors(frames, get("tensors"), max_tensor_bytes)
    return Message(msg_type, run, step, mb, mbs, body, tensors)


def _unpack_header(first: memoryview) -> dict[Any, Any]:
    """The map of a msgpack header frame ``first``, unpacked within ``_UNPACK_LIMITS``. Raises
    ``ProtocolError`` (MALFORMED) for a frame over ``HEADER_MAX_BYTES``, bytes that are not msgpack, or a
    header that is not a map."""
    header_size = first.nbytes
    if header_size > HEADER_MAX_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"header frame is {header_size} bytes; the limit is {HEADER_MAX_BYTES}")
    try:
        header = _unpackb(first, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(ErrorCode.MALFORMED, f"header is not valid msgpack: {type(e).__name__}: {e}") from e
    if type(header) is not dict:
        raise ProtocolError(ErrorCode.MALFORMED, f"header must be a map, got {type(header).__name__}")
    return header


def _msgpack_tensors(frames: Sequence[Any], specs: Any, max_tensor_bytes: int) -> dict[str, np.ndarray]:
    """The tensors of a msgpack-header message: ``specs`` (its header's ``tensors``, a list of
    ``[name, dtype, shape]``) checked entry by entry against ``frames[1:]``, each tensor a read-only view of its
    frame (``_received``). Raises ``ProtocolError`` at the first entry, count, size or total over
    ``max_tensor_bytes`` that is wrong."""
    if type(specs) is not list or len(specs) > MAX_TENSORS:
        raise ProtocolError(ErrorCode.MALFORMED, f"'tensors' must be a list of at most {MAX_TENSORS} entries")
    if len(frames) != 1 + len(specs):
        raise ProtocolError(ErrorCode.TENSOR, f"header declares {len(specs)} tensors but {len(frames) - 1} tensor frames arrived")
    tensors: dict[str, np.ndarray] = {}
    total = 0
    for i, spec in enumerate(specs):
        if not (type(spec) is list and len(spec) == 3 and type(spec[0]) is str and type(spec[2]) is list):
            raise ProtocolError(ErrorCode.MALFORMED, f"tensor entry must be [name, dtype, shape], got {show(spec)}")
        name, dtype_name, shape = spec
        if name in tensors:
            raise ProtocolError(ErrorCode.TENSOR, f"tensor {show(name)} is declared twice")
        dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
        if dtype is None:
            raise ProtocolError(ErrorCode.TENSOR, f"tensor {show(name)}: dtype {show(dtype_name)} is not one of {sorted(DTYPES)}")
        expected = dtype.itemsize
        if len(shape) > MAX_NDIM:
            expected = -1
        else:
            for extent in shape:        # Python ints: exact for any declared size, and cheap
                if type(extent) is not int or not 0 <= extent <= MAX_DIM:
                    expected = -1
                    break
                expected *= extent
        if expected < 0:
            raise ProtocolError(ErrorCode.TENSOR, f"tensor {show(name)}: shape {show(shape)} must be at most "
                                                  f"{MAX_NDIM} integers in [0, {MAX_DIM}]")
        total += expected
        if total > max_tensor_bytes:
            raise ProtocolError(ErrorCode.TENSOR, f"tensors declare {total} bytes; this stage accepts at most {max_tensor_bytes}")
        buffer = memoryview(frames[i + 1])
        got = buffer.nbytes
        if got != expected:
            raise ProtocolError(ErrorCode.TENSOR, f"tensor {name!r}: {dtype_name}{tuple(shape)} needs {expected} bytes, frame has {got}")
        tensors[name] = _received(_frombuffer_nd(shape, dtype, buffer))    # a view of the frame, no copy
    return tensors


def _received(array: np.ndarray) -> np.ndarray:
    """A received tensor (a view of its frame) as the receiver computes with it: read-only, at an
    ``ALIGN_BYTES``-aligned address.

    ZeroMQ hands small frames out of its receive buffer at any offset. BLAS takes another code path
    (with other rounding) for misaligned data, so a misaligned tensor is copied: results must not
    depend on where a frame happened to land. Below ``ALWAYS_COPY_BYTES`` the tensor is copied
    without looking: a copy that small costs less than reading the address (``ndarray.ctypes``).
    """
    if array.nbytes < ALWAYS_COPY_BYTES or array.ctypes.data % ALIGN_BYTES:
        array = array.copy()
    array.setflags(write=False)                     # never written to
    return array


_RUN_NAMES: dict[bytes, str] = {}     # run ids of binary headers that passed RUN_ID, by their bytes
_nbytes_of = operator.attrgetter("nbytes")


def _decode_binary(frames: Sequence[Any], first: memoryview, max_tensor_bytes: int) -> Message:
    """A forward or backward with a binary header (``first``, a view of frames[0]); its tensor frames are left
    for ``expect_tensors``."""
    header_size = first.nbytes
    run_size = header_size - BINARY_HEADER.size
    if run_size < 0:
        raise ProtocolError(ErrorCode.MALFORMED, f"binary header of {header_size} bytes; it has at least "
                                                 f"{BINARY_HEADER.size}")
    if run_size <= RUN_ID_MAX:
        fields = _HEADERS[run_size].unpack_from(first)
    else:                                       # too long for any run id: refused below, in the order of the checks
        fields = (*BINARY_HEADER.unpack_from(first), b"")
    _, version, code, flags, count, declared_run_size, reserved, step, mb, mbs, loss, compute_s, raw_run = fields
    if version != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.VERSION, f"protocol version {version} is not supported; this side speaks "
                                               f"{PROTOCOL_VERSION}")
    msg_type = _BINARY_NAMES.get(code)
    if msg_type is None:
        raise ProtocolError(ErrorCode.TYPE, f"binary message type {code} is unknown; known: {_BINARY_NAMES}")
    if flags or reserved:
        raise ProtocolError(ErrorCode.MALFORMED, f"binary header has flags {flags} and reserved {reserved}; "
                                                 f"both must be 0")
    if declared_run_size != run_size or run_size > RUN_ID_MAX:
        raise ProtocolError(ErrorCode.MALFORMED, f"binary header of {header_size} bytes declares a run id of "
                                                 f"{declared_run_size} (at most {RUN_ID_MAX}) after "
                                                 f"{BINARY_HEADER.size}")
    run = _RUN_NAMES.get(raw_run)
    if run is None:                             # a run's first message: its later ones skip the call
        run = _admit_binary_run(raw_run)
    if not 0 <= mb < mbs:
        raise ProtocolError(ErrorCode.MALFORMED, f"need 0 <= mb < mbs, got mb={mb} mbs={mbs}")
    if code == _BACKWARD_CODE and not (math.isfinite(compute_s) and compute_s >= 0):
        # A duration: the driving stage chooses its staleness from it and records it in its summary.
        raise ProtocolError(ErrorCode.MALFORMED, f"a backward's compute_s is seconds, finite and >= 0, "
                                                 f"got {compute_s!r}")
    if len(frames) != 1 + count or count > MAX_TENSORS:
        raise ProtocolError(ErrorCode.TENSOR, f"header declares {count} tensors (at most {MAX_TENSORS}) but "
                                              f"{len(frames) - 1} tensor frames arrived")
    tensor_frames: tuple[memoryview, ...] = tuple(map(memoryview, frames[1:]))
    total = sum(map(_nbytes_of, tensor_frames))
    if total > max_tensor_bytes:
        raise ProtocolError(ErrorCode.TENSOR, f"tensor frames hold {total} bytes; this stage accepts at most "
                                              f"{max_tensor_bytes}")
    return Message(msg_type, run, step, mb, mbs, {"loss": loss, "compute_s": compute_s} if code == _BACKWARD_CODE
                   else {}, {}, tensor_frames)


def _admit_binary_run(raw_run: bytes) -> str:
    """The run id of a binary header's run bytes ``raw_run``, remembered in ``_RUN_NAMES`` once it passes
    ``RUN_ID``. Raises ``ProtocolError`` (MALFORMED) for any other bytes."""
    run = raw_run.decode("latin-1")              # any byte decodes; RUN_ID then admits ASCII only
    if not RUN_ID.fullmatch(run):
        raise ProtocolError(ErrorCode.MALFORMED, f"'run' must be at most 128 characters from "
                                                 f"[A-Za-z0-9_.-], got {show(raw_run)}")
    if len(_RUN_NAMES) >= _RUNS_SEEN_MAX:
        _RUN_NAMES.clear()
    _RUN_NAMES[raw_run] = run
    return run


class FrameLayout:
    """The tensors a binary-header message must carry, in frame order: each one's name, shape, dtype and
    byte length. A receiver's per-step expectation, computed once (``wirecodec.Expected.layout``) and
    checked against every message by ``read``."""

    __slots__ = ("specs", "entries", "_buffers", "_lock")

    def __init__(self, specs: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
        """``specs``: ``{name: (shape, dtype)}`` in frame order; raises ``ValueError`` for a dtype the wire
        does not carry."""
        entries = []
        for name, (shape, dtype) in specs.items():
            shape, dtype = tuple(int(extent) for extent in shape), np.dtype(dtype)
            if dtype not in _WIRE_NAMES:
                raise ValueError(f"tensor {name!r}: dtype {dtype} is not carried; use one of {sorted(DTYPES)}")
            size = dtype.itemsize
            for extent in shape:
                size *= extent
            entries.append((name, shape, dtype, size, size < ALWAYS_COPY_BYTES, dtype.kind == "f"))
        self.specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {e[0]: (e[1], e[2]) for e in entries}
        # (name, shape, dtype, byte length, copied whatever its address, a float checked for finiteness)
        self.entries: tuple[tuple[str, tuple[int, ...], np.dtype, int, bool, bool], ...] = tuple(entries)
        # Per entry, up to RECEIVE_BUFFERS aligned arrays a misaligned frame is copied into (``_aligned``).
        self._buffers: tuple[list[np.ndarray], ...] = tuple([] for _ in entries)
        self._lock = threading.Lock()

    def read(self, msg: Message, allow_nonfinite: bool = False) -> dict[str, np.ndarray]:
        """The tensors of ``msg.frames``: read-only views (copied when small or misaligned, as in
        ``decode``). Raises ``ProtocolError``: ``tensor`` for another frame count or a frame of another
        byte length, ``nonfinite`` for a float tensor holding NaN or Inf unless ``allow_nonfinite`` (as
        ``expect_tensors``: what arrives is checked unless the caller says otherwise). Changes nothing."""
        frames = msg.frames or ()
        entries = self.entries
        if len(frames) != len(entries):
            raise ProtocolError(ErrorCode.TENSOR, f"{msg.type} must carry {len(entries)} tensor frames "
                                                  f"{list(self.specs)}, got {len(frames)}")
        tensors = {}
        for (name, shape, dtype, size, small, floating), frame, buffers in zip(entries, frames, self._buffers):
            got = frame.nbytes
            if got != size:
                raise ProtocolError(ErrorCode.TENSOR, f"tensor {name!r}: {_WIRE_NAMES[dtype]}{shape} needs {size} "
                                                      f"bytes, frame has {got}")
            array = _frombuffer_nd(shape, dtype, frame)                 # a view of the frame, no copy
            if small:                                                   # as _received, its size known here
                array = array.copy()
            elif array.ctypes.data % ALIGN_BYTES:
                array = self._aligned(array, buffers)
            array.setflags(write=False)
            if floating and not allow_nonfinite and not all_finite(array):
                raise ProtocolError(ErrorCode.NONFINITE, f"tensor {name!r} holds NaN or Inf, which this "
                                                         f"experiment forbids")
            tensors[name] = array
        return tensors

    def _aligned(self, view: np.ndarray, buffers: list[np.ndarray]) -> np.ndarray:
        """A copy of ``view`` (a misaligned frame) at an aligned address, in one of ``buffers`` that nobody
        else holds any more (no view, no tensor, no frame in flight refers to it: its reference count says
        so), or in a new array, kept in ``buffers`` while they are fewer than ``RECEIVE_BUFFERS``. A step
        of fixed shapes thus copies into the same memory each time instead of allocating (and page-faulting)
        a new array; a tensor the receiver still holds is never written to."""
        with self._lock:
            for buffer in buffers:
                if _refcount(buffer) == _FREE_REFS:
                    buffer.setflags(write=True)
                    np.copyto(buffer, view)
                    return buffer
            buffer = view.copy()
            if len(buffers) < RECEIVE_BUFFERS:
                buffers.append(buffer)
            return buffer


_refcount = sys.getrefcount


def _free_refs() -> int:
    """The reference count ``FrameLayout._aligned`` reads for a pooled buffer that nobody else holds, measured
    in the same loop (the pool's list, the loop's name, the call's argument: 3 on CPython 3.10-3.13; measured,
    not assumed, as interpreters count borrowed references differently)."""
    pool = [np.empty(0)]
    for buffer in pool:
        return _refcount(buffer)
    raise AssertionError("unreachable")


_FREE_REFS = _free_refs()


def _valid_run(run: str) -> bool:
    if not RUN_ID.fullmatch(run):
        return False
    if len(_RUNS_SEEN) >= _RUNS_SEEN_MAX:
        _RUNS_SEEN.clear()
    _RUNS_SEEN.add(run)
    return True


def expect_tensors(msg: Message, expected: "Mapping[str, tuple[tuple[int, ...], np.dtype]] | FrameLayout",
                   allow_nonfinite: bool = False) -> None:
    """Check that ``msg`` carries exactly the named tensors with these shapes and dtypes.

    Float tensors must be finite unless ``allow_nonfinite``. Raises ``ProtocolError``. A binary-header
    message's frames (``msg.frames``) are read here against ``expected`` (pass a ``FrameLayout`` to skip
    building one); on success they become ``msg.tensors``, and a refused message is left unchanged.
    """
    if msg.frames is not None:
        layout = expected if isinstance(expected, FrameLayout) else FrameLayout(expected)
        msg.tensors, msg.frames = layout.read(msg, allow_nonfinite), None
        return
    if isinstance(expected, FrameLayout):
        expected = expected.specs
    tensors = msg.tensors
    if tensors.keys() != expected.keys() and set(tensors) != set(expected):
        raise ProtocolError(ErrorCode.TENSOR, f"{msg.type} must carry tensors {sorted(expected)}, got {sorted(tensors)}")
    for name, (shape, dtype) in expected.items():
        array = tensors[name]
        # The fast comparison first (a tuple shape and a dtype object, as the stages pass them);
        # the general one only when it fails.
        if (array.shape != shape or array.dtype != dtype) and (
                array.shape != tuple(shape) or array.dtype != np.dtype(dtype)):
            raise ProtocolError(ErrorCode.TENSOR, f"tensor {name!r}: expected {np.dtype(dtype).name}{tuple(shape)}, "
                                                  f"got {array.dtype.name}{array.shape}")
        if not allow_nonfinite and array.dtype.kind == "f" and not all_finite(array):
            raise ProtocolError(ErrorCode.NONFINITE, f"tensor {name!r} holds NaN or Inf, which this experiment forbids")


_FINITE_CHUNK = 1 << 18     # elements; bigger arrays are checked in pieces of this many
_DOT_DTYPES = frozenset({np.dtype("<f4"), np.dtype("<f8")})     # where BLAS computes ``np.vdot``


def all_finite(array: np.ndarray) -> bool:
    """Whether every element of a float array is finite (neither NaN nor +-Inf), in one pass over it and
    without a temporary of its size when it is finite.

    float32 and float64 arrays are first summed as squares (``np.vdot``, one
    BLAS call with no temporary): the sum is finite only when every element
    is (a NaN or an Inf makes it NaN or Inf), so a finite sum is the answer.
    Only an infinite or NaN sum (a non-finite element, or squares of finite
    values beyond the dtype's range) takes the exact check, ``isfinite``. A
    big array is checked in pieces into one small reused mask: one
    ``isfinite`` over 16 M floats would allocate (and page-fault) a 16 MB
    temporary, which costs more than the check itself.
    """
    if array.dtype in _DOT_DTYPES and array.flags.c_contiguous and _isfinite(_vdot(array, array)):
        return True     # (``vdot`` would copy an array that is not C-contiguous)
    if array.size <= 4 * _FINITE_CHUNK:
        return bool(np.isfinite(array).all())
    flat = array.reshape(-1)
    mask = np.empty(_FINITE_CHUNK, bool)
    for start in range(0, flat.size, _FINITE_CHUNK):
        piece = flat[start:start + _FINITE_CHUNK]
        out = mask[:piece.size]
        np.isfinite(piece, out=out)
        if not out.all():
            return False
    return True


def error_message(run: str, step: int, code: str, text: str, mb: int = 0, mbs: int = 1) -> Message:
    """An error reply echoing the request's run, step and micro-batch (text cut to ``ERROR_TEXT_MAX``)."""
    if len(text) > ERROR_TEXT_MAX:
        text = text[:ERROR_TEXT_MAX - 3] + "..."
    return Message(ERROR, run, step, mb, mbs, {"code": code, "message": text})


def abort_notice(run: str, stage: str, reason: str) -> Message:
    """The notice a party sends its peer when it stops before the end (``error``, code ``aborted``, ``step``
    0, so a peer waiting for any reply takes it): ``stage`` stopped, and why. Nobody answers it."""
    return error_message(run, 0, ErrorCode.ABORTED, f"stage {stage} stopped: {reason}")


def frame_limit(specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> tuple[int, int]:
    """(largest frame ZeroMQ may accept, total tensor bytes) for messages carrying these tensors."""
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in specs.values()]
    return max([HEADER_MAX_BYTES, *sizes]), sum(sizes)
