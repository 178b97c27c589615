"""Unit tests of the wire codec (distgrad.wire.messages): no sockets, no stages."""

from __future__ import annotations

import math
import struct
import tracemalloc
import weakref

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distgrad.wire import messages as wire
from distgrad.errors import ProtocolError
from distgrad.wire.messages import ErrorCode, Message

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPE_NAMES = sorted(wire.DTYPES)


# ------------------------------------------------------------------ helpers

def header(**fields) -> dict:
    """A valid forward header with no tensors; keyword fields override, ``...`` deletes a field."""
    h = {"v": wire.PROTOCOL_VERSION, "type": "forward", "run": "r1", "step": 1, "mb": 0, "mbs": 1, "body": {}, "tensors": []}
    for key, value in fields.items():
        if value is ...:
            del h[key]
        else:
            h[key] = value
    return h


def frames_of(h: dict, *tensor_frames: bytes) -> list[bytes]:
    return [msgpack.packb(h, use_bin_type=True), *tensor_frames]


def as_bytes(frames) -> list[bytes]:
    # memoryview(...).tobytes(), not bytes(...): bytes() of a 0-d integer array calls __index__.
    return [memoryview(f).tobytes() for f in frames]


def roundtrip(msg: Message) -> Message:
    return wire.decode(as_bytes(wire.encode(msg)))


def refused(frames, code: str, max_tensor_bytes: int = wire.DEFAULT_MAX_TENSOR_BYTES) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        wire.decode(frames, max_tensor_bytes)
    assert info.value.code == code, str(info.value)
    return info.value


def nested_list(depth: int) -> bytes:
    """msgpack bytes of a list nested ``depth`` deep (deeper than msgpack-python will pack)."""
    return b"\x91" * depth + b"\x00"


def raw_map(entries: dict[str, bytes]) -> bytes:
    """A msgpack map whose values are given as already-packed bytes."""
    assert len(entries) < 16
    out = bytes([0x80 | len(entries)])
    for key, packed in entries.items():
        out += msgpack.packb(key) + packed
    return out


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    assert a.dtype.name == b.dtype.name
    assert a.astype(a.dtype.newbyteorder("<")).tobytes() == b.astype(b.dtype.newbyteorder("<")).tobytes()


# ------------------------------------------------------------------ round trips

SHAPES = [(), (1,), (5,), (0,), (0, 3), (3, 0), (2, 3), (2, 3, 4), (1, 1, 1, 1, 1, 1, 1, 2)]


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_every_dtype_and_shape(dtype, shape):
    rng = np.random.default_rng(0)
    array = (rng.standard_normal(shape) * 1000).astype(dtype)
    msg = Message(wire.AVERAGE, "run-a", 3, 1, 4, {"k": [1, "x"]}, {"t": array})
    frames = wire.encode(msg)
    assert len(frames) == 2
    assert msgpack.unpackb(frames[0])["tensors"] == [["t", dtype, list(shape)]]
    got = roundtrip(msg)
    assert (got.type, got.run, got.step, got.mb, got.mbs, got.body) == (wire.AVERAGE, "run-a", 3, 1, 4, {"k": [1, "x"]})
    out = got.tensors["t"]
    assert out.shape == shape and out.dtype == wire.DTYPES[dtype]
    assert out.tobytes() == array.tobytes()
    assert not out.flags.writeable


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_special_float_and_extreme_int_values_are_bitwise_equal(dtype):
    if dtype.startswith("float"):
        array = np.array([np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0, np.finfo(dtype).tiny / 2], dtype)
    else:
        info = np.iinfo(dtype)      # unsigned (uint16) has no -1
        array = np.array([info.min, *([-1] if info.min < 0 else []), 0, 1, info.max], dtype)
    out = roundtrip(Message(wire.AVERAGE, tensors={"x": array})).tensors["x"]
    assert out.tobytes() == array.tobytes()


@pytest.mark.parametrize("make", [bytes, bytearray, lambda b: memoryview(bytearray(b))],
                         ids=["bytes", "bytearray", "memoryview"])
def test_decoded_tensors_are_read_only_views_of_the_frame(make):
    array = np.arange(wire.ALWAYS_COPY_BYTES // 4, dtype=np.float32).reshape(-1, 4)
    header_frame, tensor_frame = as_bytes(wire.encode(Message(wire.AVERAGE, tensors={"a": array})))
    buf = make(tensor_frame)
    out = wire.decode([header_frame, buf]).tensors["a"]
    assert np.array_equal(out, array)
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0, 0] = 1.0
    if not isinstance(buf, bytes):
        assert np.shares_memory(out, np.frombuffer(buf, np.uint8))
        memoryview(buf)[:4] = np.float32(42).tobytes()    # a write to the frame shows through: no copy
        assert out[0, 0] == 42


@pytest.mark.parametrize("offset", [0, 4])
def test_small_decoded_tensors_are_aligned_copies_of_the_frame(offset):
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    header_frame, tensor_frame = as_bytes(wire.encode(Message(wire.AVERAGE, tensors={"a": array})))
    buf = memoryview(bytearray(offset + len(tensor_frame)))[offset:]      # at any address, as ZeroMQ's
    buf[:] = tensor_frame
    out = wire.decode([header_frame, buf]).tensors["a"]
    assert np.array_equal(out, array) and not out.flags.writeable
    assert not np.shares_memory(out, np.frombuffer(buf, np.uint8))
    assert out.ctypes.data % wire.ALIGN_BYTES == 0


def test_encode_passes_contiguous_little_endian_arrays_without_copy():
    array = np.arange(6, dtype="<f8").reshape(2, 3)
    frames = wire.encode(Message(wire.AVERAGE, tensors={"a": array}))
    assert isinstance(frames[0], bytes)
    assert np.shares_memory(frames[1], array)


def test_big_endian_input_is_sent_little_endian():
    array = np.arange(6, dtype=">i4").reshape(2, 3) - 3
    frames = wire.encode(Message(wire.AVERAGE, tensors={"a": array}))
    assert msgpack.unpackb(frames[0])["tensors"] == [["a", "int32", [2, 3]]]
    assert memoryview(frames[1]).tobytes() == array.astype("<i4").tobytes()
    out = wire.decode(as_bytes(frames)).tensors["a"]
    assert out.dtype == np.dtype("<i4") and np.array_equal(out, array)


def test_non_contiguous_input_is_sent_in_c_order():
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    for array in (base[:, ::2], base.T, np.asfortranarray(base)):
        out = roundtrip(Message(wire.AVERAGE, tensors={"a": array})).tensors["a"]
        assert np.array_equal(out, array) and out.flags.c_contiguous


def test_tensor_order_is_frame_order():
    tensors = {name: np.full((2,), i, np.int64) for i, name in enumerate(["z", "a", "m", "b"])}
    got = roundtrip(Message(wire.AVERAGE, tensors=tensors))
    assert list(got.tensors) == ["z", "a", "m", "b"]
    assert [int(t[0]) for t in got.tensors.values()] == [0, 1, 2, 3]


@pytest.mark.parametrize("dtype", ["bool", "complex64", "uint8", "uint32", "int16", "object", "U3"])
def test_encode_refuses_dtypes_the_wire_does_not_carry(dtype):
    with pytest.raises(ValueError, match="cannot be sent"):
        wire.encode(Message(wire.AVERAGE, tensors={"a": np.zeros(2, dtype)}))


# ------------------------------------------------------------------ property: any valid message survives

SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=False) | st.text(max_size=20) | st.binary(max_size=20))
BODY_VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@st.composite
def tensors(draw):
    names = draw(st.lists(st.text(max_size=8), max_size=4, unique=True))
    out = {}
    for name in names:
        dtype = np.dtype(draw(st.sampled_from(DTYPE_NAMES)))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=3))
        out[name] = draw(hnp.arrays(dtype, shape))
    return out


@st.composite
def messages(draw):
    mbs = draw(st.integers(1, 2**32))
    return Message(
        type=draw(st.sampled_from(sorted(wire.MESSAGE_TYPES - wire.BINARY_TYPES.keys()))),   # msgpack headers
        run=draw(st.from_regex(r"[A-Za-z0-9_.-]{0,128}", fullmatch=True)),
        step=draw(st.integers(0, 2**64 - 1)),
        mb=draw(st.integers(0, mbs - 1)),
        mbs=mbs,
        body=draw(st.dictionaries(st.text(max_size=12), BODY_VALUES, max_size=5)),
        tensors=draw(tensors()),
    )


@FAST
@given(messages())
def test_any_valid_message_survives_encode_bytes_decode(msg):
    got = roundtrip(msg)
    assert (got.type, got.run, got.step, got.mb, got.mbs) == (msg.type, msg.run, msg.step, msg.mb, msg.mbs)
    assert got.body == msg.body
    assert list(got.tensors) == list(msg.tensors)
    for name, array in msg.tensors.items():
        assert_same(got.tensors[name], array)
        assert not got.tensors[name].flags.writeable


@FAST
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=5))
def test_random_frames_decode_or_raise_protocol_error(frames):
    try:
        wire.decode(frames)
    except ProtocolError as e:
        assert e.code in {ErrorCode.MALFORMED, ErrorCode.VERSION, ErrorCode.TYPE, ErrorCode.TENSOR}


@FAST
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=4), st.integers(0, 200), st.binary(max_size=8))
def test_corrupted_valid_header_decodes_or_raises_protocol_error(tensor_frames, cut, junk):
    # Closer to the real thing than pure noise: a valid header, truncated or extended, with random frames.
    packed = msgpack.packb(header(tensors=[["a", "float32", [2]], ["b", "int64", []]]))
    try:
        wire.decode([packed[:cut] + junk, *tensor_frames])
    except ProtocolError:
        pass


# ------------------------------------------------------------------ validation: each error and its code

def test_empty_message():
    assert "empty" in str(refused([], ErrorCode.MALFORMED))


def test_header_size_limit():
    base = len(msgpack.packb(header(body={"pad": ""})))
    pad_to_limit = wire.HEADER_MAX_BYTES - base - 2     # str8 -> str16 adds 2 bytes of length
    at_limit = msgpack.packb(header(body={"pad": "x" * pad_to_limit}))
    assert len(at_limit) == wire.HEADER_MAX_BYTES
    assert wire.decode([at_limit]).body["pad"] == "x" * pad_to_limit
    over = msgpack.packb(header(body={"pad": "x" * (pad_to_limit + 1)}))
    assert "limit" in str(refused([over], ErrorCode.MALFORMED))
    refused([b"\x00" * (wire.HEADER_MAX_BYTES + 1)], ErrorCode.MALFORMED)


@pytest.mark.parametrize("frame", [
    b"", b"\xc0\xc1", b"\xff\xfe garbage", b"\x85\xa1v",                    # empty, never-used byte, noise
    msgpack.packb(header())[:-3],                                            # truncated
    msgpack.packb(header()) + b"\x00",                                       # trailing data
    msgpack.packb({1: 2}),                                                   # non-string map key
    msgpack.packb(header(body={"k": msgpack.ExtType(1, b"x")})),            # ext types are refused
    nested_list(5000),                                                       # deeper than the unpacker's stack
], ids=["empty", "c1", "noise", "cut-map", "truncated", "trailing", "int-key", "ext", "deep"])
def test_undecodable_header(frame):
    assert "msgpack" in str(refused([frame], ErrorCode.MALFORMED))


@pytest.mark.parametrize("value", [[1, 2], 5, "hello", None, b"bytes"], ids=repr)
def test_header_not_a_map(value):
    assert "map" in str(refused([msgpack.packb(value, use_bin_type=True)], ErrorCode.MALFORMED))


@pytest.mark.parametrize("version", [1, 2, 3, 4, 6, 0, -1, "5", None, ..., 5.0])
def test_wrong_version(version):
    refused(frames_of(header(v=version)), ErrorCode.VERSION)


@pytest.mark.parametrize("msg_type", ["nope", "", "FORWARD", None, 3, ..., b"forward"])
def test_unknown_type(msg_type):
    assert "unknown" in str(refused(frames_of(header(type=msg_type)), ErrorCode.TYPE))


@pytest.mark.parametrize("msg_type", sorted(wire.RESERVED_TYPES))
def test_reserved_type(msg_type):
    assert "reserved" in str(refused(frames_of(header(type=msg_type)), ErrorCode.TYPE))


@pytest.mark.parametrize("run", [5, None, b"run", ["r"], "x" * 129, ...], ids=repr)
def test_bad_run(run):
    refused(frames_of(header(run=run)), ErrorCode.MALFORMED)


def test_run_ids_are_short_and_printable():
    assert wire.decode(frames_of(header(run="x" * 128))).run == "x" * 128
    assert wire.decode(frames_of(header(run="a-Z_0.9"))).run == "a-Z_0.9"
    for bad in ("é", "run\nINFO forged log line", "a b", "x" * 129):   # safe to put in a log line
        refused(frames_of(header(run=bad)), ErrorCode.MALFORMED)


@pytest.mark.parametrize("fields", [
    {"step": -1}, {"step": True}, {"step": 1.0}, {"step": None}, {"step": "1"}, {"step": ...},
    {"mb": -1}, {"mb": True}, {"mb": ...},
    {"mbs": 0}, {"mbs": -1}, {"mbs": False}, {"mbs": True}, {"mbs": 1.0}, {"mbs": ...},
    {"mb": 1, "mbs": 1}, {"mb": 3, "mbs": 2},
], ids=repr)
def test_bad_step_mb_mbs(fields):
    refused(frames_of(header(**fields)), ErrorCode.MALFORMED)


def test_step_mb_mbs_limits_accepted():
    got = wire.decode(frames_of(header(step=2**64 - 1, mb=6, mbs=7)))
    assert (got.step, got.mb, got.mbs) == (2**64 - 1, 6, 7)
    assert wire.decode(frames_of(header(step=0))).step == 0


@pytest.mark.parametrize("body", [[], None, "x", 1, ...], ids=repr)
def test_body_not_a_map(body):
    assert "body" in str(refused(frames_of(header(body=body)), ErrorCode.MALFORMED))


@pytest.mark.parametrize("specs", [{}, None, "a", 1, ...], ids=repr)
def test_tensors_not_a_list(specs):
    refused(frames_of(header(tensors=specs)), ErrorCode.MALFORMED)


def test_too_many_tensors():
    n = wire.MAX_TENSORS
    ok = [[f"t{i}", "int32", []] for i in range(n)]
    assert len(wire.decode(frames_of(header(tensors=ok), *[b"\0" * 4] * n)).tensors) == n
    over = ok + [["extra", "int32", []]]
    refused(frames_of(header(tensors=over), *[b"\0" * 4] * (n + 1)), ErrorCode.MALFORMED)


@pytest.mark.parametrize("declared,sent", [(1, 0), (2, 1), (0, 1), (1, 2), (2, 4)])
def test_frame_count_mismatch(declared, sent):
    specs = [[f"t{i}", "int32", []] for i in range(declared)]
    assert "frames" in str(refused(frames_of(header(tensors=specs), *[b"\0" * 4] * sent), ErrorCode.TENSOR))


@pytest.mark.parametrize("spec", [
    "a", ["a", "float32"], ["a", "float32", [1], 0], [1, "float32", [1]], [None, "float32", [1]],
    ["a", "float32", 1], ["a", "float32", {"0": 1}], ["a", "float32", None], {"name": "a"},
], ids=repr)
def test_bad_tensor_entry(spec):
    refused(frames_of(header(tensors=[spec]), b"\0" * 4), ErrorCode.MALFORMED)


def test_duplicate_tensor_name():
    specs = [["a", "int32", []], ["a", "int32", []]]
    assert "twice" in str(refused(frames_of(header(tensors=specs), b"\0" * 4, b"\0" * 4), ErrorCode.TENSOR))


@pytest.mark.parametrize("dtype", ["float16", "object", "<f4", "f4", "Float32", "bool", "uint8", "", None, 4])
def test_unknown_dtype(dtype):
    refused(frames_of(header(tensors=[["a", dtype, [1]]]), b"\0" * 4), ErrorCode.TENSOR)


@pytest.mark.parametrize("shape", [[-1], [2, -1], [1.0], [True], ["2"], [None], [[1]], [1] * (wire.MAX_NDIM + 1)],
                         ids=repr)
def test_bad_shape(shape):
    refused(frames_of(header(tensors=[["a", "int32", shape]]), b"\0" * 4), ErrorCode.TENSOR)


def test_max_ndim_accepted():
    shape = [1] * wire.MAX_NDIM
    assert wire.decode(frames_of(header(tensors=[["a", "int32", shape]]), b"\0" * 4)).tensors["a"].shape == tuple(shape)


def test_huge_declared_shape_rejected_without_allocating():
    tracemalloc.start()
    try:
        err = refused(frames_of(header(tensors=[["a", "float64", [2**40, 2**40]]]), b""), ErrorCode.TENSOR)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "at most" in str(err)
    assert peak < 1 << 20


def test_max_tensor_bytes_counts_all_tensors():
    specs = [["a", "float32", [4]], ["b", "int64", [2]]]        # 16 + 16 bytes
    frames = frames_of(header(tensors=specs), b"\0" * 16, b"\0" * 16)
    assert set(wire.decode(frames, max_tensor_bytes=32).tensors) == {"a", "b"}
    refused(frames, ErrorCode.TENSOR, max_tensor_bytes=31)
    refused(frames, ErrorCode.TENSOR, max_tensor_bytes=15)    # the first tensor alone is too big


@pytest.mark.parametrize("delta", [-1, 1, -8, 4096])
def test_byte_length_mismatch(delta):
    frames = frames_of(header(tensors=[["a", "float64", [2, 3]]]), b"\0" * (48 + delta))
    assert "bytes" in str(refused(frames, ErrorCode.TENSOR))


def test_zero_size_tensor_needs_an_empty_frame():
    assert wire.decode(frames_of(header(tensors=[["a", "float32", [0, 3]]]), b"")).tensors["a"].shape == (0, 3)
    refused(frames_of(header(tensors=[["a", "float32", [0, 3]]]), b"\0"), ErrorCode.TENSOR)


@pytest.mark.parametrize("fields,code", [
    ({"v": 1, "type": "nope"}, ErrorCode.VERSION),
    ({"type": "nope", "run": 5}, ErrorCode.TYPE),
    ({"run": 5, "step": -1}, ErrorCode.MALFORMED),
    ({"body": [], "tensors": [["a", "float16", [1]]]}, ErrorCode.MALFORMED),
], ids=["version-before-type", "type-before-run", "run-before-step", "body-before-tensors"])
def test_first_problem_wins(fields, code):
    refused(frames_of(header(**fields)), code)


def test_error_str_carries_code():
    err = refused(frames_of(header(v=1)), ErrorCode.VERSION)
    assert str(err).startswith("version: ") and isinstance(err, ValueError)


# ------------------------------------------------------------------ hostile values that once escaped decode
# Each of these used to escape decode() as something other than ProtocolError, which the serving loop
# does not catch: one such message would have stopped the serving stage.


@pytest.mark.parametrize("msg_type", [[1], {"a": 1}], ids=["list", "map"])
def test_unhashable_type_is_a_protocol_error(msg_type):
    refused(frames_of(header(type=msg_type)), ErrorCode.TYPE)


@pytest.mark.parametrize("dtype", [["float32"], {"a": 1}], ids=["list", "map"])
def test_unhashable_dtype_is_a_protocol_error(dtype):
    refused(frames_of(header(tensors=[["a", dtype, [1]]]), b"\0" * 4), ErrorCode.TENSOR)


@pytest.mark.parametrize("shape", [[0, 2**62], [0, 2**63], [0, 2**64 - 1], [0, 2**40, 2**40]], ids=str)
def test_zero_size_shape_with_huge_dim_is_a_protocol_error(shape):
    refused(frames_of(header(tensors=[["a", "float32", shape]]), b""), ErrorCode.TENSOR)


@pytest.mark.parametrize("field", ["v", "run"])
def test_deeply_nested_value_is_a_protocol_error(field):
    # 1020 levels (+1 for the header map): within the msgpack unpacker's stack of 1024 containers,
    # too deep for repr() in the error message, which raises RecursionError.
    entries = {k: msgpack.packb(v) for k, v in header().items()}
    entries[field] = nested_list(1020)
    with pytest.raises(ProtocolError):
        wire.decode([raw_map(entries)])


@pytest.mark.parametrize("version", [float(wire.PROTOCOL_VERSION), True, 2.0], ids=repr)
def test_a_version_that_is_a_float_or_a_bool_is_refused_only_the_integer_is_accepted(version):
    refused(frames_of(header(v=version)), ErrorCode.VERSION)
    assert wire.decode(frames_of(header(v=wire.PROTOCOL_VERSION))).step == 1


# ------------------------------------------------------------------ expect_tensors

SPECS = {"activation": ((2, 3), np.dtype(np.float32)), "target": ((2,), np.dtype(np.int64))}


def fwd(**tensors) -> Message:
    return Message(wire.FORWARD, "r", 1, tensors=tensors)


def good(**overrides) -> Message:
    t = {"activation": np.zeros((2, 3), np.float32), "target": np.zeros(2, np.int64)}
    t.update(overrides)
    return fwd(**{k: v for k, v in t.items() if v is not None})


def test_expect_tensors_accepts_exact_match():
    wire.expect_tensors(good(), SPECS)
    wire.expect_tensors(roundtrip(good()), SPECS)


@pytest.mark.parametrize("msg", [
    good(target=None), good(activation=None), good(extra=np.zeros(1, np.float32)), fwd(),
], ids=["missing-target", "missing-activation", "extra", "none"])
def test_expect_tensors_wrong_names(msg):
    with pytest.raises(ProtocolError) as info:
        wire.expect_tensors(msg, SPECS)
    assert info.value.code == ErrorCode.TENSOR


@pytest.mark.parametrize("msg", [
    good(activation=np.zeros((3, 2), np.float32)), good(activation=np.zeros((6,), np.float32)),
    good(activation=np.zeros((2, 3, 1), np.float32)), good(target=np.zeros((), np.int64)),
], ids=["transposed", "flat", "extra-dim", "scalar"])
def test_expect_tensors_wrong_shape(msg):
    with pytest.raises(ProtocolError) as info:
        wire.expect_tensors(msg, SPECS)
    assert info.value.code == ErrorCode.TENSOR


@pytest.mark.parametrize("msg", [
    good(activation=np.zeros((2, 3), np.float64)), good(activation=np.zeros((2, 3), np.int32)),
    good(target=np.zeros(2, np.int32)), good(target=np.zeros(2, np.float32)),
], ids=["f64-for-f32", "i32-for-f32", "i32-for-i64", "f32-for-i64"])
def test_expect_tensors_wrong_dtype(msg):
    with pytest.raises(ProtocolError) as info:
        wire.expect_tensors(msg, SPECS)
    assert info.value.code == ErrorCode.TENSOR


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_expect_tensors_nonfinite(bad):
    activation = np.zeros((2, 3), np.float32)
    activation[1, 2] = bad
    with pytest.raises(ProtocolError) as info:
        wire.expect_tensors(good(activation=activation), SPECS)
    assert info.value.code == ErrorCode.NONFINITE
    wire.expect_tensors(good(activation=activation), SPECS, allow_nonfinite=True)


def test_expect_tensors_checks_shape_before_finiteness():
    with pytest.raises(ProtocolError) as info:
        wire.expect_tensors(good(activation=np.full((3, 3), np.nan, np.float32)), SPECS)
    assert info.value.code == ErrorCode.TENSOR


def test_expect_tensors_does_not_check_int_finiteness():
    specs = {"i32": ((3,), np.int32), "i64": ((3,), np.int64)}
    msg = fwd(i32=np.array([np.iinfo(np.int32).min, 0, np.iinfo(np.int32).max], np.int32),
              i64=np.array([np.iinfo(np.int64).min, -1, np.iinfo(np.int64).max], np.int64))
    wire.expect_tensors(msg, specs)


def test_expect_tensors_accepts_zero_size_float():
    wire.expect_tensors(fwd(a=np.zeros((0, 3), np.float64)), {"a": ((0, 3), np.float64)})


# ------------------------------------------------------------------ error_message

def test_error_message_echoes_ids():
    msg = wire.error_message("run-7", 12, ErrorCode.STEP, "expected step 11", mb=2, mbs=3)
    assert (msg.type, msg.run, msg.step, msg.mb, msg.mbs) == (wire.ERROR, "run-7", 12, 2, 3)
    assert msg.body == {"code": "step", "message": "expected step 11"} and msg.tensors == {}
    got = roundtrip(msg)
    assert (got.type, got.run, got.step, got.mb, got.mbs, got.body) == (wire.ERROR, "run-7", 12, 2, 3, msg.body)


def test_error_message_defaults():
    msg = wire.error_message("", 0, ErrorCode.MALFORMED, "empty message")
    assert (msg.type, msg.run, msg.step, msg.mb, msg.mbs) == (wire.ERROR, "", 0, 0, 1)
    assert msg.body["code"] == "malformed"


def test_describe():
    assert Message(wire.FORWARD, "", 3, 1, 2).describe() == "forward run=- step=3 mb=1/2"


# ------------------------------------------------------------------ fast paths (hot-path work)

@pytest.mark.parametrize("where", [0, wire._FINITE_CHUNK - 1, wire._FINITE_CHUNK, -1])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_all_finite_big_arrays_are_checked_in_pieces_to_the_last_element(where, bad):
    a = np.ones((5 * wire._FINITE_CHUNK + 3,), np.float32)
    assert wire.all_finite(a)
    a[where] = bad
    assert not wire.all_finite(a)
    assert not wire.all_finite(a.reshape(-1, 1))


def test_all_finite_agrees_with_numpy_on_small_arrays():
    for a in (np.zeros((0,), np.float32), np.array(3e38, np.float32), np.full((3, 2), 3e38, np.float32),
              np.array([1.0, np.nan]), np.array([-np.inf], np.float32)):
        assert wire.all_finite(a) == bool(np.isfinite(a).all())


def test_all_finite_sums_squares_first_and_checks_exactly_only_when_the_sum_is_not_finite(monkeypatch):
    """float32/float64: one BLAS ``vdot`` answers for finite arrays; ``isfinite`` runs only when the sum of
    squares is NaN or Inf (a non-finite element, or finite squares beyond the dtype's range)."""
    exact = []
    isfinite = np.isfinite
    monkeypatch.setattr(np, "isfinite", lambda *a, **k: exact.append(1) or isfinite(*a, **k))
    assert wire.all_finite(np.ones((32, 256), np.float32)) and wire.all_finite(np.ones(3)) and exact == []
    assert wire.all_finite(np.full(4, 3e38, np.float32)) and len(exact) == 1      # squares overflow: exact check
    for bad in (np.nan, np.inf, -np.inf):
        a = np.zeros((2, 3), np.float32)
        a[1, 2] = bad
        assert not wire.all_finite(a) and not wire.all_finite(a.astype(np.float64))
    assert wire.all_finite(np.ones(3, np.float16)) and not wire.all_finite(np.array([1, np.inf], np.float16))


@pytest.mark.parametrize("first", [np.zeros((2, 2), np.uint8), np.float32(1), np.zeros(3, np.float64), "text"],
                         ids=["2-d", "0-d", "floats", "str"])
def test_a_header_frame_that_is_no_byte_buffer_is_malformed(first):
    refused([first, b"\0" * 4], ErrorCode.MALFORMED)


def test_a_binary_message_keeps_its_frames_as_memoryviews_and_its_layout_checks_finiteness_as_it_reads():
    """decode keeps a binary message's tensor frames as memoryviews (their byte lengths without another
    wrapper); FrameLayout.read checks each float tensor's finiteness while reading it, with no second pass."""
    x = np.array([[0, np.inf, 0], [0, 0, 0]], np.float32)
    frames = as_bytes(wire.encode(Message(wire.FORWARD, "r", 1, tensors={"activation": x,
                                                                         "target": np.zeros(2, np.int64)})))
    msg = wire.decode(frames)
    assert [type(frame) for frame in msg.frames] == [memoryview, memoryview]
    with pytest.raises(ProtocolError) as info:
        ACT.read(msg, allow_nonfinite=False)
    assert info.value.code == ErrorCode.NONFINITE and "'activation'" in str(info.value)
    tensors = ACT.read(msg, allow_nonfinite=True)
    assert np.isinf(tensors["activation"][0, 1]) and not tensors["target"].flags.writeable


def test_a_layout_checks_finiteness_unless_told_not_to():
    """FrameLayout.read, like expect_tensors, refuses a NaN or Inf by default: a caller that forgets the
    argument does not skip the check of what arrived."""
    x = np.array([[0, np.nan, 0], [0, 0, 0]], np.float32)
    msg = wire.decode(as_bytes(wire.encode(Message(wire.FORWARD, "r", 1, tensors={"activation": x,
                                                                                "target": np.zeros(2, np.int64)}))))
    with pytest.raises(ProtocolError) as info:
        ACT.read(msg)
    assert info.value.code == ErrorCode.NONFINITE and msg.frames is not None


def test_expect_tensors_accepts_list_shapes_and_dtype_classes():
    msg = Message(wire.AVERAGE, tensors={"a": np.zeros((2, 3), np.float32)})
    wire.expect_tensors(msg, {"a": ([2, 3], np.float32)})
    with pytest.raises(ProtocolError):
        wire.expect_tensors(msg, {"a": ([3, 2], np.float32)})
    with pytest.raises(ProtocolError):
        wire.expect_tensors(msg, {"a": ((2, 3), np.float64)})


def test_a_valid_run_id_seen_before_is_accepted_and_an_invalid_one_never():
    for _ in range(3):
        assert wire.decode(frames_of(header(run="run-1.ok"))).run == "run-1.ok"
        refused(frames_of(header(run="run 1")), ErrorCode.MALFORMED)
    for i in range(3 * wire._RUNS_SEEN_MAX):                # the cache of seen ids stays bounded
        wire.decode(frames_of(header(run=f"r{i}")))
    assert len(wire._RUNS_SEEN) <= wire._RUNS_SEEN_MAX


def test_tensors_decoded_from_writable_buffers_are_read_only_views():
    n = wire.ALWAYS_COPY_BYTES // 4                # smaller tensors are copied
    payload = bytearray(np.arange(n, dtype="<f4").tobytes())
    h = header(tensors=[["x", "float32", [n // 2, 2]]])
    msg = wire.decode([msgpack.packb(h, use_bin_type=True), payload])
    x = msg.tensors["x"]
    assert not x.flags.writeable and x[:2].tolist() == [[0.0, 1.0], [2.0, 3.0]]
    payload[0:4] = np.float32(9).tobytes()       # a view, not a copy
    assert x[0, 0] == 9


def test_encode_accepts_subclasses_and_scalars():
    frames = wire.encode(Message(wire.AVERAGE, tensors={"m": np.ma.masked_array([1.0, 2.0], dtype=np.float32),
                                                         "s": np.float32(2), "l": [1, 2]}))
    msg = wire.decode(as_bytes(frames))
    assert type(msg.tensors["m"]) is np.ndarray and msg.tensors["m"].tolist() == [1.0, 2.0]
    assert msg.tensors["s"].shape == () and msg.tensors["l"].dtype == np.int64


# ------------------------------------------------------------------ binary headers (forward, backward)

def binary_header(code: int = 1, count: int = 1, run: bytes = b"r1", step: int = 1, mb: int = 0, mbs: int = 1,
                  loss: float = 0.0, compute_s: float = 0.0, version: int = wire.PROTOCOL_VERSION, flags: int = 0,
                  reserved: int = 0, run_size: int | None = None) -> bytes:
    """A binary header packed field by field, as docs/protocol.md lays it out."""
    return wire.BINARY_HEADER.pack(0xC1, version, code, flags, count, len(run) if run_size is None else run_size,
                                   reserved, step, mb, mbs, loss, compute_s) + run


ACT = wire.FrameLayout({"activation": ((2, 3), np.float32), "target": ((2,), np.int64)})


def test_binary_forward_layout_byte_by_byte_and_its_tensors_read_against_the_expectation():
    x, t = np.arange(6, dtype=np.float32).reshape(2, 3), np.array([4, 5], np.int64)
    frames = as_bytes(wire.encode(Message(wire.FORWARD, "run-7", 2**40 + 3, 1, 4, tensors={"activation": x, "target": t})))
    assert frames[0] == binary_header(count=2, run=b"run-7", step=2**40 + 3, mb=1, mbs=4)
    assert len(frames[0]) == 40 + 5 and frames[0][:6] == bytes([0xC1, 5, 1, 0, 2, 5])
    msg = wire.decode(frames)
    assert (msg.type, msg.run, msg.step, msg.mb, msg.mbs, msg.body, msg.tensors) == (
        wire.FORWARD, "run-7", 2**40 + 3, 1, 4, {}, {})
    wire.expect_tensors(msg, ACT)
    assert msg.frames is None and list(msg.tensors) == ["activation", "target"]
    assert_same(msg.tensors["activation"], x)
    assert_same(msg.tensors["target"], t)
    assert not msg.tensors["activation"].flags.writeable


@pytest.mark.parametrize("loss", [0.1, float(np.float32(2.5e-3)), -0.0, math.inf, math.nan, 1e308])
def test_binary_backward_carries_loss_and_compute_time_bit_for_bit(loss):
    g = np.ones((2, 3), np.float32)
    msg = wire.decode(as_bytes(wire.encode(Message(wire.BACKWARD, "r", 9, 0, 1, {"loss": loss, "compute_s": 1.5e-5},
                                                   {"activation_grad": g}))))
    assert struct.pack("<d", msg.body["loss"]) == struct.pack("<d", loss) and msg.body["compute_s"] == 1.5e-5
    wire.expect_tensors(msg, {"activation_grad": ((2, 3), np.float32)}, allow_nonfinite=True)   # a mapping works too
    assert_same(msg.tensors["activation_grad"], g)


@pytest.mark.parametrize("frames, code", [
    ([binary_header(version=4), b"\0" * 24, b"\0" * 16], ErrorCode.VERSION),
    ([binary_header(code=0), b"\0" * 24], ErrorCode.TYPE),
    ([binary_header(code=3), b"\0" * 24], ErrorCode.TYPE),
    ([binary_header(flags=1), b"\0" * 24], ErrorCode.MALFORMED),
    ([binary_header(reserved=1), b"\0" * 24], ErrorCode.MALFORMED),
    ([binary_header()[:39]], ErrorCode.MALFORMED),                             # shorter than the fixed part
    ([binary_header(run_size=3), b"\0" * 24], ErrorCode.MALFORMED),             # run id length disagrees
    ([binary_header(run=b"x" * 129), b"\0" * 24], ErrorCode.MALFORMED),         # run id too long
    ([binary_header(run=b"a b"), b"\0" * 24], ErrorCode.MALFORMED),             # not a run id character
    ([binary_header(run=b"\xe9"), b"\0" * 24], ErrorCode.MALFORMED),
    ([binary_header(mb=1, mbs=1), b"\0" * 24], ErrorCode.MALFORMED),
    ([binary_header(mbs=0), b"\0" * 24], ErrorCode.MALFORMED),
    ([binary_header(count=2), b"\0" * 24], ErrorCode.TENSOR),                   # fewer frames than declared
    ([binary_header(count=65, run=b""), *[b""] * 65], ErrorCode.TENSOR),        # over MAX_TENSORS
], ids=["version", "type-0", "type-3", "flags", "reserved", "short", "run-size", "run-long", "run-char",
        "run-latin1", "mb", "mbs", "count", "too-many"])
def test_bad_binary_header_is_refused(frames, code):
    refused(frames, code)


def test_binary_frames_over_the_byte_limit_are_refused_before_anything_reads_them():
    refused([binary_header(count=2), b"\0" * 24, b"\0" * 16], ErrorCode.TENSOR, max_tensor_bytes=39)
    assert wire.decode([binary_header(count=2), b"\0" * 24, b"\0" * 16], max_tensor_bytes=40).frames


@pytest.mark.parametrize("frames", [[b"\0" * 24], [b"\0" * 24, b"\0" * 8, b""], [b"\0" * 20, b"\0" * 16],
                                    [b"\0" * 24, b"\0" * 17], [b"", b""]], ids=["count-1", "count-3", "short",
                                                                              "long", "empty"])
def test_binary_frames_that_do_not_fit_the_expectation_are_refused_and_change_nothing(frames):
    msg = wire.decode([binary_header(count=len(frames)), *frames])
    with pytest.raises(ProtocolError) as info:
        wire.expect_tensors(msg, ACT)
    assert info.value.code == ErrorCode.TENSOR
    assert msg.tensors == {} and len(msg.frames) == len(frames)


def test_binary_nonfinite_tensor_is_refused_and_changes_nothing():
    x = np.array([[0, np.nan, 0], [0, 0, 0]], np.float32)
    msg = wire.decode(as_bytes(wire.encode(Message(wire.FORWARD, "r", 1, tensors={"activation": x,
                                                                                   "target": np.zeros(2, np.int64)}))))
    with pytest.raises(ProtocolError) as info:
        wire.expect_tensors(msg, ACT)
    assert info.value.code == ErrorCode.NONFINITE and msg.tensors == {} and msg.frames
    wire.expect_tensors(msg, ACT, allow_nonfinite=True)
    assert np.isnan(msg.tensors["activation"][0, 1])


@pytest.mark.parametrize("msg", [
    Message(wire.FORWARD, "r", 1, body={"loss": 1.0}),
    Message(wire.BACKWARD, "r", 1, body={"compute_s": 1.0}),
    Message(wire.BACKWARD, "r", 1, body={"loss": 1.0, "extra": 2}),
    Message(wire.FORWARD, "r\u00e9", 1),
    Message(wire.FORWARD, "r", 2**64),
    Message(wire.FORWARD, "r", 1, 0, 2**32),
], ids=["forward-body", "no-loss", "extra", "run", "step", "mbs"])
def test_what_the_binary_header_cannot_carry_is_not_sent(msg):
    with pytest.raises(ValueError):
        wire.encode(msg)


def test_an_unread_message_is_not_sent_again():
    msg = wire.decode(as_bytes(wire.encode(Message(wire.FORWARD, "r", 1, tensors={"a": np.zeros(1, np.float32)}))))
    with pytest.raises(ValueError, match="never read"):
        wire.encode(msg)


@FAST
@given(st.sampled_from([wire.FORWARD, wire.BACKWARD]), st.from_regex(r"[A-Za-z0-9_.-]{0,128}", fullmatch=True),
       st.integers(0, 2**64 - 1), st.integers(1, 2**32 - 1).flatmap(lambda n: st.tuples(st.integers(0, n - 1),
                                                                                       st.just(n))),
       st.floats(width=32), tensors())
def test_any_binary_message_survives_encode_bytes_decode_read(kind, run, step, micro, loss, arrays):
    body = {"loss": loss, "compute_s": 0.25} if kind == wire.BACKWARD else {}
    got = roundtrip(Message(kind, run, step, *micro, body, arrays))
    assert (got.type, got.run, got.step, (got.mb, got.mbs)) == (kind, run, step, micro)
    assert struct.pack("<d", got.body.get("loss", 0.0)) == struct.pack("<d", body.get("loss", 0.0))
    wire.expect_tensors(got, {name: (a.shape, a.dtype.newbyteorder("<")) for name, a in arrays.items()},
                        allow_nonfinite=True)
    for name, array in arrays.items():
        assert_same(got.tensors[name], array)


@FAST
@given(st.binary(max_size=200), st.lists(st.binary(max_size=40), max_size=3))
def test_random_bytes_after_the_binary_magic_decode_or_raise_protocol_error(rest, tensor_frames):
    try:
        wire.decode([b"\xc1" + rest, *tensor_frames])
    except ProtocolError as e:
        assert e.code in {ErrorCode.MALFORMED, ErrorCode.VERSION, ErrorCode.TYPE, ErrorCode.TENSOR}


def misaligned_forward(x: np.ndarray) -> Message:
    """A decoded forward whose activation frame sits 8 bytes off an ALIGN_BYTES boundary, as libzmq hands
    out large frames."""
    raw = bytearray(x.nbytes + 2 * wire.ALIGN_BYTES)
    start = (-np.frombuffer(raw, np.uint8).ctypes.data) % wire.ALIGN_BYTES + 8
    frame = memoryview(raw)[start:start + x.nbytes]
    frame[:] = x.tobytes()
    header_frame = wire.encode(Message(wire.FORWARD, "r", 1, tensors={"activation": x}))[0]
    return wire.decode([header_frame, frame])


def test_a_misaligned_frame_is_copied_into_a_reused_buffer_only_when_nobody_holds_it():
    """A large misaligned tensor is copied to an aligned address; with fixed shapes the copy goes into the
    same memory each step (no allocation per step) once the previous step's tensor is dropped, and never
    into memory a tensor still held (or a view of it) refers to."""
    n = wire.ALWAYS_COPY_BYTES // 4 * 2
    layout = wire.FrameLayout({"activation": ((n,), np.float32)})
    first = layout.read(misaligned_forward(np.full(n, 1, np.float32)))["activation"]
    assert first.ctypes.data % wire.ALIGN_BYTES == 0 and not first.flags.writeable
    view, step_1 = first[:4], weakref.ref(first)
    del first
    second = layout.read(misaligned_forward(np.full(n, 2, np.float32)))["activation"]
    assert second is not step_1() and view.tolist() == [1, 1, 1, 1]       # the view still holds step 1's
    del view, second
    third = layout.read(misaligned_forward(np.full(n, 3, np.float32)))["activation"]
    assert third is step_1() and (third == 3).all() and not third.flags.writeable
    held = [layout.read(misaligned_forward(np.full(n, k, np.float32)))["activation"] for k in range(10)]
    assert [float(a[0]) for a in held] == list(range(10)) and (third == 3).all()
    assert len(layout._buffers[0]) == wire.RECEIVE_BUFFERS                       # the pool stays bounded


def test_a_refused_misaligned_frame_leaves_the_tensors_held_unchanged():
    n = wire.ALWAYS_COPY_BYTES // 4 * 2
    layout = wire.FrameLayout({"activation": ((n,), np.float32)})
    kept = layout.read(misaligned_forward(np.full(n, 1, np.float32)))["activation"]
    bad = np.full(n, 5, np.float32)
    bad[-1] = np.nan
    msg = misaligned_forward(bad)
    with pytest.raises(ProtocolError) as info:
        layout.read(msg)
    assert info.value.code == ErrorCode.NONFINITE and msg.frames is not None and (kept == 1).all()


def test_a_misaligned_frame_of_non_finite_values_is_read_when_the_experiment_allows_them():
    n = wire.ALWAYS_COPY_BYTES // 4 * 3
    layout = wire.FrameLayout({"activation": ((n,), np.float32)})
    x = np.full(n, 2, np.float32)
    x[n - 1] = np.inf
    got = layout.read(misaligned_forward(x), allow_nonfinite=True)["activation"]
    assert got.ctypes.data % wire.ALIGN_BYTES == 0 and got.tobytes() == x.tobytes()
    with pytest.raises(ProtocolError) as info:
        layout.read(misaligned_forward(x))
    assert info.value.code == ErrorCode.NONFINITE


class _Frames:
    """A stand-in for a monitor socket: ``recv_multipart`` gives ``frames``."""

    def __init__(self, *frames: bytes) -> None:
        self.frames, self.flags = list(frames), None

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        self.flags = flags
        return self.frames


def test_a_monitor_event_is_read_as_zeromq_writes_it():
    """The handshake watches read ZeroMQ's monitor events themselves (zmq.utils.monitor would load asyncio into
    every stage process): the event id and value of the first frame, whatever the endpoint; anything else is
    refused."""
    import zmq

    from distgrad.wire.transport import describe_handshake_failure, read_monitor_event

    for event, value in ((zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC),
                         (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 0)):
        sock = _Frames(struct.pack("=HI", event, value), b"tcp://127.0.0.1:5555")
        assert read_monitor_event(sock, 7) == (event, value) and sock.flags == 7
    sock = _Frames(struct.pack("=HI", zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400), b"")
    assert describe_handshake_failure(*read_monitor_event(sock), server=False) == \
        "the CURVE server refused this client's key (ZAP status 400)"
    for frames in ((b"\x00" * 5, b""), (b"\x00" * 6,), (b"\x00" * 6, b"", b"")):
        with pytest.raises(ValueError, match="not a ZeroMQ monitor event"):
            read_monitor_event(_Frames(*frames))
