"""Wire codecs: how a float32 tensor (activations, activation gradients) crosses the wire.

Pure numpy, no I/O. A codec turns one float32 tensor into a few named,
C-contiguous wire arrays (``encode``), and turns those back into the float32
tensor the receiver computes with (``decode``). ``roundtrip`` is the two in
one: the value an in-process run must use to be bitwise equal to a run over
the wire. Codecs are chosen per direction by name (``parse_codec``), from the
simplest to the lossiest:

========== ======================================= ==================================
name       wire arrays (for a tensor of ``shape``) receiver computes with
========== ======================================= ==================================
none       values float32 ``shape``                x itself
float16    values float16 ``shape``                float32(float16(x)), RNE
bfloat16   bits uint16 ``shape``                   the upper 16 bits of x after
                                                   round-to-nearest-even on its bits
int8       q int8 ``shape``, scale float32 (R,)    float32(q) * scale, per row
topk:K     values float32 (R, K),                  per row the K largest |x| (ties to
           indices int32 (R, K)                    the lower index), zeros elsewhere
========== ======================================= ==================================

Rows are the first axis: a tensor of shape ``(B, ...)`` has ``R = B`` rows of
``prod(shape[1:])`` entries each; a 1-D tensor is one row (``R = 1``).
``int8`` and ``topk:K`` need at least one axis (``check_shape``).

``topk:K+ef`` is ``topk:K`` with error feedback: the sender adds what it
dropped at the previous step to this step's tensor before selecting. The
codec itself stays stateless; the residual lives in an ``ErrorFeedback``
that the sending stage owns and checkpoints (``state_arrays``).

Errors: a bad codec name or a shape the codec cannot carry is a
``ConfigError`` (at configuration time); a value the codec cannot carry is a
``CodecRangeError`` naming the tensor and the step (the sender's side, before
anything is sent); wire arrays that no encoder could have produced are a
``ProtocolError`` with code ``"tensor"`` (the receiver's side).
"""

from __future__ import annotations

import abc
import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from distgrad.errors import CodecRangeError, ConfigError, ProtocolError
from distgrad.wire.messages import all_finite

Shape = tuple[int, ...]
WireSpecs = dict[str, tuple[Shape, np.dtype]]
Parts = dict[str, np.ndarray]

CODEC_NAMES = ("none", "float16", "bfloat16", "int8", "topk:K", "topk:K+ef")   # for help texts
TENSOR_CODE = "tensor"      # wire.ErrorCode.TENSOR (wire sits above this module; a test keeps them equal)
INT8_LEVELS = 127           # int8 codes are in [-127, 127]; -128 is never sent
FLOAT16_MAX = 65504.0       # largest finite float16

_F32 = np.dtype("<f4")
_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
_I8 = np.dtype("i1")
_I32 = np.dtype("<i4")
_TOPK = re.compile(r"topk:([0-9]+)(\+ef)?")


def parse_codec(text: str) -> "Codec":
    """The codec named ``text``: ``none``, ``float16``, ``bfloat16``, ``int8``, ``topk:K`` or ``topk:K+ef``.

    ``K`` is a decimal integer >= 1 (the entries kept per row); ``+ef`` turns
    on error feedback (see ``ErrorFeedback``). Names are case-sensitive and
    without spaces. ``codec.name`` is the canonical spelling (``topk:08`` ->
    ``topk:8``), the one to record in the handshake fingerprint. Raises
    ``ConfigError`` naming the bad value.
    """
    if not isinstance(text, str):
        raise ConfigError(f"a codec name must be a string, got {text!r} ({type(text).__name__})")
    simple: dict[str, Callable[[], Codec]] = {"none": NoneCodec, "float16": Float16Codec,
                                              "bfloat16": BFloat16Codec, "int8": Int8Codec}
    if text in simple:
        return simple[text]()
    match = _TOPK.fullmatch(text)
    if match:
        k = int(match.group(1))
        if k < 1:
            raise ConfigError(f"codec {text!r}: K must be an integer >= 1, got {k}")
        return TopKCodec(k, error_feedback=match.group(2) is not None)
    raise ConfigError(f"unknown codec {text!r}; use one of {', '.join(CODEC_NAMES)} (K an integer >= 1)")


def _rows(shape: Shape) -> tuple[int, int]:
    """(rows, entries per row) of a tensor of at least one axis."""
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def _tensor_error(message: str) -> ProtocolError:
    return ProtocolError(TENSOR_CODE, message)


class Codec(abc.ABC):
    """One wire codec. Subclasses fill in ``_specs``, ``_encode``, ``_decode`` (and ``_check_parts``).

    Every public method takes shapes as tuples of ints and float32 tensors;
    all codecs are stateless and deterministic.
    """

    name: str = ""
    error_feedback: bool = False      # only topk:K+ef: the sender keeps an ErrorFeedback residual
    carries_nonfinite: bool = True    # NaN and Inf cross as themselves (int8 and topk:K refuse them)
    # Parts the receiver keeps beside the decoded tensor, under their message names (``NAME.PART``): what a
    # check across several messages reads (secure aggregation's session tag, ``masking.SecureSumCodec``).
    kept_parts: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.name

    def check_shape(self, shape: Shape) -> None:
        """Raise ``ConfigError`` if tensors of ``shape`` cannot be sent with this codec."""
        for d in shape:
            if not isinstance(d, int) or d < 0:
                raise ConfigError(f"codec {self.name}: shape {shape!r} must be non-negative integers")

    def wire_specs(self, shape: Shape) -> WireSpecs:
        """``{part: (shape, dtype)}``, in frame order, of what crosses for a tensor of ``shape``.

        Exactly what ``encode`` returns and ``decode`` accepts; the receiver
        checks a message against it (``wire.expect_tensors`` takes it as is).
        """
        shape = tuple(shape)
        self.check_shape(shape)
        return self._specs(shape)

    def wire_bytes(self, shape: Shape) -> int:
        """Bytes of tensor data that cross for one tensor of ``shape`` (headers not counted)."""
        return sum(math.prod(s) * d.itemsize for s, d in self.wire_specs(shape).values())

    def encode(self, x: np.ndarray, tensor_name: str = "tensor", step: int = 0) -> Parts:
        """The wire arrays for float32 ``x`` (C-contiguous; ``none`` may return ``x`` itself).

        ``tensor_name`` and ``step`` only name the tensor in a
        ``CodecRangeError`` (a value this codec cannot carry). Raises
        ``ConfigError`` for a shape ``check_shape`` refuses and ``TypeError``
        for anything but a float32 ndarray.
        """
        if not isinstance(x, np.ndarray) or x.dtype != _F32:
            what = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
            raise TypeError(f"codec {self.name}: tensor {tensor_name!r} must be a float32 ndarray, got {what}")
        self.check_shape(x.shape)
        return self._encode(np.ascontiguousarray(x), tensor_name, step)

    def decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        """The float32 tensor of ``shape`` that ``parts`` (received from the network) encode.

        Raises ``ProtocolError`` (code ``"tensor"``) when the parts differ
        from ``wire_specs(shape)`` in names, shapes or dtypes, or hold what no
        encoder produces (see each codec). NaN and Inf that the codec carries
        (none, float16, bfloat16) pass: the caller applies the experiment's
        finiteness rule to the result. The result never aliases ``parts``
        except for ``none``.
        """
        shape = tuple(shape)
        specs = self.wire_specs(shape)
        if set(parts) != set(specs):
            raise _tensor_error(f"codec {self.name} sends parts {list(specs)}, got {sorted(parts)}")
        for part, (part_shape, dtype) in specs.items():
            array = parts[part]
            if not isinstance(array, np.ndarray) or array.shape != part_shape or array.dtype != dtype:
                got = f"{array.dtype.name}{array.shape}" if isinstance(array, np.ndarray) else type(array).__name__
                raise _tensor_error(f"codec {self.name}: part {part!r} must be {dtype.name}{part_shape}, got {got}")
        self._check_parts(parts, shape)
        return self._decode(parts, shape)

    def roundtrip(self, x: np.ndarray, tensor_name: str = "tensor", step: int = 0) -> np.ndarray:
        """``decode(encode(x), x.shape)``: the value the receiver computes with (without re-validating).

        The in-process path calls this at the points where tensors would
        cross. Raises as ``encode``.
        """
        return self._decode(self.encode(x, tensor_name, step), x.shape)

    # -- for subclasses ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def _specs(self, shape: Shape) -> WireSpecs:
        """The parts a tensor of ``shape`` crosses as: ``{name: (shape, dtype)}``."""

    @abc.abstractmethod
    def _encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        """The parts of float32 ``x`` (``CodecRangeError`` for a value the codec cannot carry)."""

    def _check_parts(self, parts: Mapping[str, np.ndarray], shape: Shape) -> None:
        """Raise ``ProtocolError`` for well-shaped parts that no encoder produces."""

    @abc.abstractmethod
    def _decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        """The float32 tensor of ``shape`` the receiver computes with."""


def _refuse_overflow(codec: str, x: np.ndarray, infinite: np.ndarray, tensor_name: str, step: int, why: str) -> None:
    """Raise ``CodecRangeError`` naming the first finite entry of ``x`` whose code is infinite (``infinite``)."""
    if infinite.any():
        overflow = infinite & np.isfinite(x)
        if overflow.any():
            raise CodecRangeError(codec, tensor_name, step, f"{_first_bad(x, overflow)} {why}")


def _first_bad(x: np.ndarray, bad: np.ndarray) -> str:
    """``x[i]`` at the first index where ``bad`` holds, for error messages."""
    index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), x.shape))
    return f"value {float(x[index])!r} at index {index}"


@dataclass(frozen=True)
class NoneCodec(Codec):
    """``none``: the float32 tensor itself (the default)."""

    name = "none"

    def _specs(self, shape: Shape) -> WireSpecs:
        return {"values": (shape, _F32)}

    def _encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        return {"values": x}

    def _decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        return parts["values"]


@dataclass(frozen=True)
class Float16Codec(Codec):
    """``float16``: ``x.astype(float16)`` (round to nearest even), computed with as float32.

    A finite value that float16 cannot hold (|x| >= 65520, which rounds to
    Inf) raises ``CodecRangeError``; NaN and +-Inf cross as themselves.
    Values below float16's smallest subnormal (about 6e-8) become +-0.
    """

    name = "float16"

    def _specs(self, shape: Shape) -> WireSpecs:
        return {"values": (shape, _F16)}

    def _encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        with np.errstate(over="ignore"):            # overflow is reported below, with the tensor's name
            half = x.astype(_F16)
        _refuse_overflow(self.name, x, np.isinf(half), tensor_name, step,
                         f"is beyond float16's range (|x| <= {FLOAT16_MAX:g}); use bfloat16, or a model whose "
                         f"activations and gradients stay smaller")
        return {"values": half}

    def _decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        return parts["values"].astype(_F32)


@dataclass(frozen=True)
class BFloat16Codec(Codec):
    """``bfloat16``: the upper 16 bits of each float32 after round-to-nearest-even on its bit pattern.

    The bits cross as uint16 and come back as ``bits << 16``. Ties (lower
    half exactly 0x8000) round to the even upper half. NaN stays NaN: its
    upper 16 bits with the quiet bit (0x0040) set, so a NaN whose payload was
    only in the lower half does not turn into Inf; +-Inf stays +-Inf. A
    finite value that rounds to Inf (|x| >= 3.3961e38, i.e. bits >=
    0x7F7F8000) raises ``CodecRangeError`` rather than crossing as Inf.
    """

    name = "bfloat16"

    def _specs(self, shape: Shape) -> WireSpecs:
        return {"bits": (shape, _U16)}

    def _encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        u = x.view(np.uint32)
        upper = u >> np.uint32(16)
        # +0x7FFF rounds a lower half above 0x8000 up; the extra +1 for an odd upper half makes the tie go
        # to even. uint32 arithmetic wraps only for NaN bit patterns, which are replaced below.
        rounded = (u + (np.uint32(0x7FFF) + (upper & np.uint32(1)))) >> np.uint32(16)
        nan = np.isnan(x)
        if nan.any():
            rounded = np.where(nan, upper | np.uint32(0x0040), rounded)
        _refuse_overflow(self.name, x, (rounded & np.uint32(0x7FFF)) == np.uint32(0x7F80), tensor_name, step,
                         "rounds to Inf in bfloat16 (|x| < 3.3961e38 is needed)")
        return {"bits": rounded.astype(_U16)}

    def _decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        return (parts["bits"].astype(np.uint32) << np.uint32(16)).view(_F32)


class _RowCodec(Codec):
    """A codec that works per row: tensors need at least one axis, and values must be finite."""

    carries_nonfinite = False

    def check_shape(self, shape: Shape) -> None:
        super().check_shape(shape)
        if len(shape) == 0:
            raise ConfigError(f"codec {self.name} works per row and needs a tensor of at least one axis, "
                              f"got shape {shape}")

    def _check_finite(self, x: np.ndarray, tensor_name: str, step: int) -> None:
        if type(x) is np.ndarray and all_finite(x):
            return                      # the common case: one pass, no mask of x's size
        finite = np.isfinite(x)
        if not finite.all():
            raise CodecRangeError(self.name, tensor_name, step,
                                  f"{_first_bad(x, ~finite)}: {self.name} carries only finite values")


@dataclass(frozen=True)
class Int8Codec(_RowCodec):
    """``int8``: per row ``scale = float32(max|x|) / float32(127)``, ``q = rint(x / scale)`` as int8.

    All arithmetic in float32; ``rint`` rounds ties to even; decoded as
    ``float32(q) * scale``. A row of zeros has scale 0 and codes 0. While
    the scale is a normal float32 (max|x| >= 127 * 2**-126, about 1.5e-36),
    ``|x / scale| <= 127.00002`` so ``|q| <= 127`` without clipping. Below
    that the scale is subnormal (or 0) and inexact: ``x / scale`` is then
    clipped to [-127, 127], and a row whose scale underflows to 0 codes as
    zeros. NaN and Inf raise ``CodecRangeError``. The receiver rejects
    codes of -128, non-finite or negative scales, and non-zero codes in a
    row of scale 0.
    """

    name = "int8"

    def _specs(self, shape: Shape) -> WireSpecs:
        return {"q": (shape, _I8), "scale": ((_rows(shape)[0],), _F32)}

    def _encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        self._check_finite(x, tensor_name, step)
        rows = x.reshape(_rows(x.shape))
        scale = (np.abs(rows).max(axis=1, initial=0).astype(_F32) / np.float32(INT8_LEVELS)).astype(_F32)
        column = scale[:, None]
        ratio = np.zeros_like(rows)
        np.divide(rows, column, out=ratio, where=column != 0)
        np.rint(ratio, out=ratio)
        np.clip(ratio, -INT8_LEVELS, INT8_LEVELS, out=ratio)     # a no-op unless the scale is subnormal
        return {"q": ratio.astype(_I8).reshape(x.shape), "scale": scale}

    def _check_parts(self, parts: Mapping[str, np.ndarray], shape: Shape) -> None:
        q, scale = parts["q"], parts["scale"]
        if q.size and int(q.min()) < -INT8_LEVELS:
            raise _tensor_error(f"codec int8: code -128 in 'q' (codes are in [-{INT8_LEVELS}, {INT8_LEVELS}])")
        if not (np.isfinite(scale).all() and (scale >= 0).all()):
            raise _tensor_error("codec int8: every 'scale' must be finite and >= 0")
        zero = scale == 0
        if zero.any() and np.any(q.reshape(_rows(shape))[zero]):
            raise _tensor_error("codec int8: a row of scale 0 must have codes 0")

    def _decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        rows = parts["q"].reshape(_rows(shape)).astype(_F32)
        rows *= parts["scale"][:, None]
        return rows.reshape(shape)


@dataclass(frozen=True)
class TopKCodec(_RowCodec):
    """``topk:K`` (``topk:K+ef``): per row the ``K`` entries of largest magnitude, the rest zero.

    Ties in magnitude go to the lower index (a stable sort of ``-|x|``);
    ``-0.0`` and ``0.0`` tie. Each row's kept entries cross as float32
    ``values`` with their int32 ``indices``, both of shape ``(R, K)``,
    ordered by increasing index. ``K`` larger than a row is a
    ``ConfigError`` (``check_shape``); ``K`` equal to it sends everything.
    NaN and Inf raise ``CodecRangeError``. The receiver rejects indices
    that are not strictly increasing within ``[0, row length)``, and
    non-finite values. ``error_feedback`` (``+ef``) is used by the sender's
    ``ErrorFeedback``; what crosses is the same.
    """

    k: int
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise ConfigError(f"codec topk: K must be an integer >= 1, got {self.k!r}")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"topk:{self.k}" + ("+ef" if self.error_feedback else "")

    def check_shape(self, shape: Shape) -> None:
        super().check_shape(shape)
        length = _rows(shape)[1]
        if self.k > length:
            raise ConfigError(f"codec {self.name}: K = {self.k} is more than the {length} entries per row of a "
                              f"tensor of shape {tuple(shape)}; use K <= {length}")

    def _specs(self, shape: Shape) -> WireSpecs:
        rows = _rows(shape)[0]
        return {"values": ((rows, self.k), _F32), "indices": ((rows, self.k), _I32)}

    def _encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        self._check_finite(x, tensor_name, step)
        rows = x.reshape(_rows(x.shape))
        largest = np.argsort(-np.abs(rows), axis=1, kind="stable")[:, :self.k]
        indices = np.sort(largest, axis=1).astype(_I32)
        return {"values": np.take_along_axis(rows, indices, axis=1), "indices": indices}

    def _check_parts(self, parts: Mapping[str, np.ndarray], shape: Shape) -> None:
        values, indices = parts["values"], parts["indices"]
        length = _rows(shape)[1]
        if indices.size and not (int(indices[:, 0].min()) >= 0 and int(indices[:, -1].max()) < length
                                 and bool((np.diff(indices, axis=1) > 0).all())):
            raise _tensor_error(f"codec {self.name}: 'indices' must be strictly increasing within each row "
                                f"and in [0, {length})")
        if not np.isfinite(values).all():
            raise _tensor_error(f"codec {self.name}: 'values' must be finite")

    def _decode(self, parts: Mapping[str, np.ndarray], shape: Shape) -> np.ndarray:
        rows = np.zeros(_rows(shape), _F32)
        np.put_along_axis(rows, parts["indices"].astype(np.intp), parts["values"], axis=1)
        return rows.reshape(shape)


class ErrorFeedback:
    """The sender's side of a codec with error feedback: a residual per tensor name.

    Each call adds the tensor's residual (what the codec dropped the last
    time this name was sent; zeros at first) to ``x``, encodes the sum and
    keeps ``sum - decoded`` as the new residual (for ``topk:K``: the sum with
    the sent entries zeroed). Name the tensor per micro-batch (e.g.
    ``"activation/mb1"``) so that each micro-batch carries its own residual
    to the next step. A call that raises leaves the residual unchanged. The
    residuals are stage state: checkpoint them with ``state_arrays`` and
    restore with ``load_state_arrays`` (also to undo a rolled-back step).
    Works with any codec; ``parse_codec`` turns it on only for ``topk:K+ef``.
    """

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self._residual: dict[str, np.ndarray] = {}

    def encode(self, x: np.ndarray, tensor_name: str, step: int) -> Parts:
        """Wire arrays of ``x`` plus its residual; updates the residual. Raises as ``Codec.encode``."""
        return self._send(x, tensor_name, step)[0]

    def roundtrip(self, x: np.ndarray, tensor_name: str, step: int) -> np.ndarray:
        """What the receiver computes with for ``x`` (the in-process twin of ``encode``); updates the residual."""
        return self._send(x, tensor_name, step)[1]

    def _send(self, x: np.ndarray, tensor_name: str, step: int) -> tuple[Parts, np.ndarray]:
        residual = self._residual.get(tensor_name)
        if residual is not None and residual.shape != x.shape:
            raise ValueError(f"error feedback: tensor {tensor_name!r} has shape {x.shape} at step {step}, but "
                             f"its residual has shape {residual.shape}; residuals need a fixed shape per name")
        total = x if residual is None else x + residual
        parts = self.codec.encode(total, tensor_name, step)
        decoded = self.codec._decode(parts, total.shape)
        self._residual[tensor_name] = total - decoded
        return parts, decoded

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Copies of the residuals by tensor name (sorted), for a checkpoint."""
        return {name: self._residual[name].copy() for name in sorted(self._residual)}

    def load_state_arrays(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Replace every residual with ``arrays`` (from ``state_arrays``); raises ``ConfigError`` for non-float32."""
        loaded = {}
        for name, array in arrays.items():
            if not isinstance(array, np.ndarray) or array.dtype != _F32:
                what = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
                raise ConfigError(f"error feedback residual {name!r} must be a float32 array, got {what}")
            loaded[name] = np.array(array, dtype=_F32, order="C")
        self._residual = loaded

    def reset(self) -> None:
        """Forget every residual (a fresh run)."""
        self._residual = {}


def make_sender(codec: Codec) -> Codec | ErrorFeedback:
    """What a sending stage encodes with: a fresh ``ErrorFeedback`` when ``codec.error_feedback``, else the codec.

    Both have ``encode(x, tensor_name, step)`` and ``roundtrip(x, tensor_name,
    step)``; only an ``ErrorFeedback`` has state to checkpoint.
    """
    return ErrorFeedback(codec) if codec.error_feedback else codec
