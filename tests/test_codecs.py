"""distgrad.wire.codecs against oracles written another way (pure-Python bits, struct, per-element loops).

Bit-level claims are checked bitwise (``assert_same_bits``); every codec's
parts are checked against its ``wire_specs`` and byte count; every error path
names what is wrong. Pure math: no sockets, no processes.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from distgrad.wire import messages as wire
from distgrad.wire.codecs import (TENSOR_CODE, BFloat16Codec, Codec, ErrorFeedback, Float16Codec, Int8Codec, NoneCodec,
                                  TopKCodec, make_sender, parse_codec)
from distgrad.errors import CodecRangeError, ConfigError, ProtocolError

ALL = ["none", "float16", "bfloat16", "int8", "topk:1", "topk:3", "topk:3+ef"]
SHAPES = [(4, 3), (2, 3, 2), (5,), (0, 3), (3, 1)]
FAST = settings(max_examples=40, deadline=None)

finite_floats = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)


def f32(bits: list[int]) -> np.ndarray:
    """float32 array with these exact bit patterns (no trip through Python floats, which would quiet NaNs)."""
    return np.array(bits, np.uint32).view(np.float32)


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def sample(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# ---------------------------------------------------------------- names

@pytest.mark.parametrize("text, expected", [
    ("none", NoneCodec()), ("float16", Float16Codec()), ("bfloat16", BFloat16Codec()), ("int8", Int8Codec()),
    ("topk:5", TopKCodec(5)), ("topk:5+ef", TopKCodec(5, error_feedback=True)), ("topk:007", TopKCodec(7)),
])
def test_parse_codec_names_and_canonical_spelling(text, expected):
    codec = parse_codec(text)
    assert codec == expected and parse_codec(codec.name) == codec and str(codec) == codec.name
    assert codec.error_feedback == text.endswith("+ef")


@pytest.mark.parametrize("text", ["", "None", "fp16", "float16 ", "topk", "topk:", "topk:0", "topk:-1", "topk:1.5",
                                  "topk:x", "topk:3+EF", "topk:3ef", "topk:3+ef+ef", "int8+ef"])
def test_parse_codec_rejects_bad_names(text):
    with pytest.raises(ConfigError, match=repr(text).replace("+", r"\+").replace(".", r"\.")):
        parse_codec(text)


def test_parse_codec_rejects_non_strings_and_topk_rejects_bad_k():
    with pytest.raises(ConfigError, match="must be a string"):
        parse_codec(8)                              # type: ignore[arg-type]
    for k in (0, -2, True, 2.0):
        with pytest.raises(ConfigError, match="K must be an integer >= 1"):
            TopKCodec(k)                            # type: ignore[arg-type]


# ---------------------------------------------------------------- what crosses

@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("shape", SHAPES)
def test_parts_match_wire_specs_and_bytes(name, shape):
    codec = parse_codec(name)
    rows, n = (1, shape[0]) if len(shape) == 1 else (shape[0], int(np.prod(shape[1:])))
    k = getattr(codec, "k", 0)
    if k > n:
        with pytest.raises(ConfigError):
            codec.wire_specs(shape)
        return
    x = sample(shape)
    parts = codec.encode(x, "activation", 1)
    specs = codec.wire_specs(shape)
    assert list(parts) == list(specs)
    for part, array in parts.items():
        assert (array.shape, array.dtype) == specs[part] and array.flags.c_contiguous
    assert codec.wire_bytes(shape) == sum(a.nbytes for a in parts.values())
    expected = {"none": 4 * rows * n, "float16": 2 * rows * n, "bfloat16": 2 * rows * n, "int8": rows * n + 4 * rows}
    assert codec.wire_bytes(shape) == expected.get(name, 8 * rows * k)
    message = wire.Message(wire.FORWARD, tensors=dict(parts))
    wire.expect_tensors(message, specs)            # the receiver's check takes the specs as they are
    decoded = codec.decode(parts, shape)
    assert decoded.dtype == np.float32 and decoded.shape == shape
    assert_same_bits(decoded, codec.roundtrip(x))


@pytest.mark.parametrize("name", ALL)
def test_row_codecs_are_the_same_on_micro_batches(name):
    """A micro-batch's rows encode as they do inside the whole batch (every codec works per row or entry)."""
    codec = parse_codec(name)
    x = sample((6, 5), seed=3)
    parts = [codec.roundtrip(x[i:i + 2]) for i in (0, 2, 4)]
    assert_same_bits(np.concatenate(parts), codec.roundtrip(x))


def test_none_is_the_tensor_itself():
    x = sample((3, 2))
    assert NoneCodec().roundtrip(x) is x


def test_tensor_code_is_the_wire_code():
    assert TENSOR_CODE == wire.ErrorCode.TENSOR


# ---------------------------------------------------------------- float16

def float16_oracle(value: float) -> float | None:
    """IEEE half by struct (round half to even from the exact double); None where it overflows."""
    try:
        return struct.unpack("<e", struct.pack("<e", value))[0]
    except OverflowError:
        return None


def test_float16_against_struct_on_edges():
    values = [0.0, -0.0, 1.0, 1 + 2**-11, 1 + 3 * 2**-11, -(1 + 3 * 2**-11), 65504.0, 65519.0, -65519.0, 2**-24,
              2**-25, 2**-25 * 1.5, 1e-8, 0.1, -3.14159, 2**-14, 2**-14 - 2**-24]
    x = np.array(values, np.float32)
    got = Float16Codec().roundtrip(x, "a", 0)
    want = np.array([float16_oracle(float(v)) for v in x], np.float32)
    assert_same_bits(got, want)


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 6)),
                  elements=st.floats(-65519, 65519, width=32)))
@FAST
def test_float16_property(x):
    want = np.array([float16_oracle(float(v)) for v in x.ravel()], np.float32).reshape(x.shape)
    assert_same_bits(Float16Codec().roundtrip(x), want)


@pytest.mark.parametrize("value", [65520.0, -65520.0, 1e5, 3e38])
def test_float16_overflow_names_tensor_and_step(value):
    assert float16_oracle(value) is None
    x = np.array([[1.0, value]], np.float32)
    with pytest.raises(CodecRangeError, match=r"tensor 'gradient' at step 12: value .* at index \(0, 1\)") as e:
        Float16Codec().encode(x, "gradient", 12)
    assert (e.value.codec, e.value.tensor, e.value.step) == ("float16", "gradient", 12)
    assert isinstance(e.value, ValueError)


def test_float16_carries_nan_and_inf_as_themselves():
    x = np.array([np.nan, np.inf, -np.inf], np.float32)
    got = Float16Codec().roundtrip(x)
    assert np.isnan(got[0]) and got[1] == np.inf and got[2] == -np.inf


# ---------------------------------------------------------------- bfloat16

def bfloat16_oracle(bits: int) -> int:
    """The bfloat16 bits of a float32 bit pattern, by integer comparison of the dropped half."""
    if (bits & 0x7F800000) == 0x7F800000 and bits & 0x007FFFFF:
        return (bits >> 16) | 0x0040                    # NaN: quiet, sign and upper payload kept
    upper, lower = bits >> 16, bits & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1
    return upper


EDGE_BITS = [
    0x3F800000,     # 1.0 exactly
    0x3F808000,     # tie, even upper half: stays
    0x3F818000,     # tie, odd upper half: up to even
    0xBF818000,     # negative tie: magnitude up
    0x3F808001,     # just above the tie: up
    0x3F807FFF,     # just below the tie: down
    0x3F80FFFF,     # carries into the next mantissa
    0x3FFFFFFF,     # carries into the exponent
    0x00008000,     # subnormal tie to even (zero)
    0x00018000,     # subnormal tie up
    0x80000000,     # -0.0
    0x7F7F7FFF,     # largest value that stays finite
    0x7F800000, 0xFF800000,                  # +-Inf
    0x7FC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,  # NaN: quiet, low payload, negative, signalling
]


def test_bfloat16_against_integer_oracle_on_edges():
    parts = BFloat16Codec().encode(f32(EDGE_BITS), "a", 0)
    assert parts["bits"].tolist() == [bfloat16_oracle(b) for b in EDGE_BITS]
    decoded = BFloat16Codec().decode(parts, (len(EDGE_BITS),))
    assert decoded.view(np.uint32).tolist() == [bfloat16_oracle(b) << 16 for b in EDGE_BITS]
    assert np.isnan(decoded[-4:]).all()


@given(st.lists(st.integers(0, 2**32 - 1).filter(lambda b: not 0x7F7F8000 <= b & 0x7FFFFFFF <= 0x7F7FFFFF),
                min_size=1, max_size=20))
@FAST
def test_bfloat16_property(bits):
    assert BFloat16Codec().encode(f32(bits))["bits"].tolist() == [bfloat16_oracle(b) for b in bits]


@pytest.mark.parametrize("bits", [0x7F7F8000, 0xFF7FFFFF])
def test_bfloat16_overflow_to_inf_is_an_error(bits):
    with pytest.raises(CodecRangeError, match=r"bfloat16: tensor 'act' at step 4: .*rounds to Inf"):
        BFloat16Codec().encode(f32([0x3F800000, bits]), "act", 4)


# ---------------------------------------------------------------- int8

def int8_oracle(rows: np.ndarray) -> tuple[list[list[int]], list[np.float32], np.ndarray]:
    """(codes, scales, decoded) element by element with float32 scalars and Python's round (ties to even);
    codes clipped to +-127, which matters only for subnormal scales."""
    codes, scales, decoded = [], [], []
    for row in rows:
        scale = np.float32(max((abs(float(v)) for v in row), default=0.0)) / np.float32(127)
        q = [0 if scale == 0 else min(127, max(-127, round(float(np.float32(v) / scale)))) for v in row]
        codes.append(q)
        scales.append(scale)
        decoded.append([np.float32(c) * scale for c in q])
    return codes, scales, np.array(decoded, np.float32).reshape(rows.shape)


@pytest.mark.parametrize("x", [
    [[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [-3.0, 3.0, 1.5]],      # a zero row; max hit at both signs
    [[127.0, 63.5, -0.5], [254.0, 1.0, -127.0]],                 # ties: 63.5 and -0.5 round to even codes
    [[-1e-3, 2e-3, 5e4], [1e30, -1e-30, 7.0]],
])
def test_int8_against_oracle(x):
    x = np.array(x, np.float32)
    codes, scales, decoded = int8_oracle(x)
    parts = Int8Codec().encode(x, "a", 0)
    assert parts["q"].tolist() == codes and parts["q"].dtype == np.int8
    assert_same_bits(parts["scale"], np.array(scales, np.float32))
    assert_same_bits(Int8Codec().decode(parts, x.shape), decoded)
    assert [abs(c) for c in parts["q"][np.arange(len(x)), np.abs(x).argmax(axis=1)]] == [
        127 if s else 0 for s in scales]                        # every row's max hits +-127 exactly


def test_int8_one_dimensional_tensor_is_one_row():
    x = np.array([0.25, -1.0, 0.5, 0.0], np.float32)
    parts = Int8Codec().encode(x)
    assert parts["scale"].shape == (1,) and parts["q"].shape == (4,)
    codes, scales, decoded = int8_oracle(x[None])
    assert parts["q"].tolist() == codes[0]
    assert_same_bits(Int8Codec().roundtrip(x), decoded[0])


def test_int8_zero_rows_decode_to_positive_zeros():
    x = np.array([[0.0, -0.0], [0.0, 0.0]], np.float32)
    parts = Int8Codec().encode(x)
    assert parts["scale"].tolist() == [0.0, 0.0] and not parts["q"].any()
    assert_same_bits(Int8Codec().decode(parts, x.shape), np.zeros((2, 2), np.float32))


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 8)), elements=finite_floats))
@FAST
def test_int8_property(x):
    codes, _, decoded = int8_oracle(x)
    assert Int8Codec().encode(x)["q"].tolist() == codes
    assert_same_bits(Int8Codec().roundtrip(x), decoded)


def test_int8_codes_fit_without_clipping_for_every_normal_scale():
    """|rint(m / (m / 127))| == 127 for every float32 mantissa: the ratio depends on the mantissa only while
    m / 127 is normal, so one exponent covers every m >= 127 * 2**-126 (all 2**23 of them, exhaustively)."""
    m = (np.uint32(0x3F800000) + np.arange(2**23, dtype=np.uint32)).view(np.float32)      # [1, 2)
    ratio = m / (m / np.float32(127))
    assert ratio.dtype == np.float32 and np.rint(ratio).min() == np.rint(ratio).max() == 127
    smallest = np.float32(127 * 2.0**-126)
    assert (smallest / np.float32(127)) == np.float32(2.0**-126)                            # still normal there


def test_int8_subnormal_scales_are_clipped_and_underflow_to_zeros():
    tiny = np.float32(2.0**-149)                   # the smallest subnormal
    x = np.array([[190 * tiny, -tiny], [63 * tiny, tiny]], np.float32)
    parts = Int8Codec().encode(x)
    assert parts["scale"].view(np.uint32).tolist() == [1, 0]    # 190/127 -> 1 unit; 63/127 -> 0
    assert parts["q"].tolist() == [[127, -1], [0, 0]]          # 190 without the clip; a zero row
    Int8Codec().decode(parts, x.shape)                          # and the receiver accepts it


# ---------------------------------------------------------------- topk

def topk_oracle(rows: np.ndarray, k: int) -> np.ndarray:
    out = np.zeros_like(rows)
    for r, row in enumerate(rows):
        for i in sorted(range(len(row)), key=lambda i: (-abs(float(row[i])), i))[:k]:
            out[r, i] = row[i]
    return out


def test_topk_ties_go_to_the_lower_index():
    x = np.array([[1.0, -2.0, 2.0, -2.0, 0.5], [0.0, -0.0, 0.0, 3.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0]], np.float32)
    parts = TopKCodec(2).encode(x)
    assert parts["indices"].tolist() == [[1, 2], [0, 3], [0, 1]]
    assert parts["values"].tolist() == [[-2.0, 2.0], [0.0, 3.0], [1.0, 1.0]]
    assert_same_bits(TopKCodec(2).decode(parts, x.shape), topk_oracle(x, 2))


def test_topk_ties_on_long_rows():
    """Rows long enough that an unstable sort (numpy's quicksort past 16 entries) would break ties differently."""
    x = np.random.default_rng(5).choice(np.array([-2.0, -1.0, 0.0, 1.0, 2.0], np.float32), size=(3, 200))
    for k in (1, 37, 120, 200):
        assert_same_bits(TopKCodec(k).roundtrip(x), topk_oracle(x, k))


def test_topk_k_equal_to_the_row_sends_everything_and_more_is_a_config_error():
    x = sample((3, 4))
    assert_same_bits(TopKCodec(4).roundtrip(x), x + np.float32(0))
    with pytest.raises(ConfigError, match=r"K = 5 is more than the 4 entries per row .* use K <= 4"):
        TopKCodec(5).encode(x)
    with pytest.raises(ConfigError, match="K = 7 is more than the 6 entries"):
        TopKCodec(7).wire_specs((2, 3, 2))


def test_topk_one_dimensional_tensor_is_one_row():
    x = np.array([0.5, -3.0, 1.0, 3.0], np.float32)
    parts = TopKCodec(3).encode(x)
    assert parts["indices"].tolist() == [[1, 2, 3]]
    assert_same_bits(TopKCodec(3).roundtrip(x), topk_oracle(x[None], 3)[0])


@given(hnp.arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 8)),
                  elements=st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -2.5, 7.0])), st.integers(1, 8))
@FAST
def test_topk_property(x, k):
    k = min(k, x.shape[1])
    assert_same_bits(TopKCodec(k).roundtrip(x), topk_oracle(x, k))


# ---------------------------------------------------------------- error feedback

def test_error_feedback_against_a_loop_and_through_a_checkpoint():
    codec = parse_codec("topk:2+ef")
    steps = [sample((2, 5), seed=s) for s in range(4)]
    feedback, residual = ErrorFeedback(codec), np.zeros((2, 5), np.float32)
    saved = None
    for step, x in enumerate(steps):
        total = x + residual
        want = topk_oracle(total, 2)
        residual = np.where(want != 0, np.float32(0), total).astype(np.float32)
        if step % 2:
            parts = feedback.encode(x, "activation/mb0", step)
            got = codec.decode(parts, x.shape)
        else:
            got = feedback.roundtrip(x, "activation/mb0", step)
        assert_same_bits(got, want)
        assert_same_bits(feedback.state_arrays()["activation/mb0"], residual)
        if step == 1:
            saved = feedback.state_arrays()
    restored = ErrorFeedback(codec)
    restored.load_state_arrays(saved)
    again = ErrorFeedback(codec)
    again.load_state_arrays(saved)
    for step in (2, 3):
        assert_same_bits(restored.roundtrip(steps[step], "activation/mb0", step),
                         again.roundtrip(steps[step], "activation/mb0", step))
    assert_same_bits(restored.state_arrays()["activation/mb0"], residual)


def test_make_sender_keeps_state_only_for_error_feedback():
    assert make_sender(parse_codec("topk:2")) == parse_codec("topk:2")
    sender = make_sender(parse_codec("topk:2+ef"))
    assert isinstance(sender, ErrorFeedback) and sender.codec == parse_codec("topk:2+ef")
    assert make_sender(parse_codec("topk:2+ef")) is not sender          # a fresh residual per sender


def test_error_feedback_keeps_names_apart_and_a_failed_call_changes_nothing():
    feedback = ErrorFeedback(parse_codec("int8"))
    feedback.roundtrip(sample((2, 3)), "a", 0)
    feedback.roundtrip(sample((4,)), "b", 0)
    before = feedback.state_arrays()
    assert list(before) == ["a", "b"]
    with pytest.raises(CodecRangeError):
        feedback.roundtrip(np.full((2, 3), np.nan, np.float32), "a", 1)
    with pytest.raises(ValueError, match=r"tensor 'a' has shape \(3, 2\) at step 1, but its residual has shape"):
        feedback.roundtrip(sample((3, 2)), "a", 1)
    after = feedback.state_arrays()
    for name in before:
        assert_same_bits(after[name], before[name])
    with pytest.raises(ConfigError, match="residual 'a' must be a float32 array, got float64"):
        feedback.load_state_arrays({"a": np.zeros(2)})
    feedback.reset()
    assert feedback.state_arrays() == {}


# ---------------------------------------------------------------- errors

@pytest.mark.parametrize("name", ["int8", "topk:1"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_int8_and_topk_refuse_nonfinite_values(name, value):
    with pytest.raises(CodecRangeError, match=r"tensor 'g' at step 9: value .* at index \(1, 0\).*only finite"):
        parse_codec(name).encode(np.array([[1.0, 2.0], [value, 0.0]], np.float32), "g", 9)


@pytest.mark.parametrize("name", ["int8", "topk:1"])
def test_row_codecs_need_an_axis(name):
    with pytest.raises(ConfigError, match="at least one axis"):
        parse_codec(name).wire_specs(())


@pytest.mark.parametrize("name", ALL)
def test_encode_takes_only_float32(name):
    with pytest.raises(TypeError, match="tensor 'x' must be a float32 ndarray, got float64"):
        parse_codec(name).encode(np.zeros((2, 3)), "x", 0)


def _bad(codec: Codec, shape, **changes) -> None:
    parts = dict(codec.encode(sample(shape)))
    parts.update(changes)
    with pytest.raises(ProtocolError) as e:
        codec.decode(parts, shape)
    assert e.value.code == TENSOR_CODE


def test_decode_rejects_what_no_encoder_sends():
    shape = (2, 4)
    with pytest.raises(ProtocolError, match=r"sends parts \['values'\], got \['bits'\]"):
        NoneCodec().decode({"bits": np.zeros(shape, np.uint16)}, shape)
    with pytest.raises(ProtocolError, match=r"part 'values' must be float16\(2, 4\), got float32\(2, 4\)"):
        Float16Codec().decode({"values": np.zeros(shape, np.float32)}, shape)
    _bad(BFloat16Codec(), shape, bits=np.zeros((2, 3), np.uint16))
    int8 = Int8Codec()
    _bad(int8, shape, q=np.full(shape, -128, np.int8))
    _bad(int8, shape, scale=np.array([1.0, -1.0], np.float32))
    _bad(int8, shape, scale=np.array([1.0, np.nan], np.float32))
    _bad(int8, shape, scale=np.array([1.0, 0.0], np.float32))          # codes but scale 0
    topk = TopKCodec(2)
    for indices in ([[1, 0], [0, 1]], [[0, 0], [0, 1]], [[0, 4], [0, 1]], [[-1, 1], [0, 1]]):
        _bad(topk, shape, indices=np.array(indices, np.int32))
    _bad(topk, shape, values=np.array([[1, np.inf], [0, 1]], np.float32))
    _bad(topk, shape, indices=np.zeros((2, 2), np.int64))
