"""Numpy layers with forward and backward side by side.

Contract shared by every layer:

* ``forward(x, ctx=None)`` takes a float32 array and returns ``(y, cache)``;
  the cache holds what ``backward`` needs, so several micro-batches can be
  in flight. ``ctx`` (a ``ForwardContext``: training or not, the step and
  the micro-batch) matters only to layers that behave differently in
  training or draw random numbers (``Dropout``); None means training, step
  0, micro-batch 0.
* ``backward(cache, dy, need_dx=True)`` returns ``(dx, grads)``: ``dx`` is
  d(loss)/d(x) with the shape of ``x`` (what a stage sends upstream), or None
  when ``need_dx`` is false (the first stage's input needs no gradient, and
  for a wide first layer that product is half the backward's work); ``grads``
  maps each parameter name to d(loss)/d(param). Inputs are never modified (they may be
  read-only views of received frames).
* ``backward_deferred(cache, dy)`` returns ``(dx, grads_later)``: the same
  ``dx`` now, and a function that computes the same ``grads`` when called
  (a serving stage sends ``dx`` upstream first). ``cache`` and ``dy`` must
  stay unchanged until then; layers without parameters compute everything
  at once.
* ``output_shape(shape)`` checks an input shape and returns the output shape,
  raising ``ConfigError`` on a mismatch, so a stage knows what to expect from
  its peer before any data moves.

All math is float32. The order of operations inside ``backward`` follows
TensorFlow 1's gradient functions where an experiment reproduces TF output.
No I/O, no logging.
"""

from __future__ import annotations

import abc
import math
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from distgrad.errors import ConfigError

DTYPE = np.float32
Shape = tuple[int, ...]
Grads = dict[str, np.ndarray]


# ---------------------------------------------------------------- initialisers

def param_rng(seed: int, param_name: str) -> np.random.Generator:
    """The generator that initialises one parameter.

    It depends only on the run's seed and the parameter's name, so a parameter
    gets the same initial value whichever process or stage builds it.
    """
    return np.random.default_rng([seed, zlib.crc32(param_name.encode())])


def truncated_normal(rng: np.random.Generator, shape: Shape, stddev: float = 0.01,
                     mean: float = 0.0) -> np.ndarray:
    """Normal samples, redrawing any more than two stddevs from the mean (TF's rule)."""
    out = rng.normal(mean, stddev, size=shape)
    bad = np.abs(out - mean) > 2 * stddev
    while bad.any():
        out[bad] = rng.normal(mean, stddev, size=int(bad.sum()))
        bad = np.abs(out - mean) > 2 * stddev
    return out.astype(DTYPE)


def glorot_uniform(rng: np.random.Generator, shape: Shape) -> np.ndarray:
    """Uniform on +-sqrt(6 / (fan_in + fan_out)).

    For a ``(fan_in, fan_out)`` matrix (and a vector, taken as ``(n, n)``) the
    fans are its sides; for a convolution kernel ``(out, in, kh, kw)`` they are
    ``in*kh*kw`` and ``out*kh*kw`` (Keras' and torch's rule).
    """
    if len(shape) == 4:
        receptive = shape[2] * shape[3]
        fan_in, fan_out = shape[1] * receptive, shape[0] * receptive
    else:
        fan_in, fan_out = shape[0], shape[-1]
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(DTYPE)


def make_initialiser(spec: Any) -> Callable[[np.random.Generator, Shape], np.ndarray]:
    """Build an initialiser from an experiment value.

    ``spec`` is a name (``"truncated_normal"``, ``"glorot_uniform"``,
    ``"zeros"``), a number (a constant fill) or a table with ``kind`` and
    options (``{kind = "truncated_normal", stddev = 0.1}``).
    """
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        value = float(spec)
        with np.errstate(over="ignore"):
            finite = bool(np.isfinite(DTYPE(value)))      # 1e40 is inf in float32
        if not finite:
            raise ConfigError(f"invalid initial value {spec!r}: not a finite float32 number")
        return lambda rng, shape: np.full(shape, value, DTYPE)
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, Mapping) or "kind" not in spec:
        raise ConfigError(f"invalid initialiser {spec!r}: give a name, a number or a table with 'kind'")
    options = {k: v for k, v in spec.items() if k != "kind"}
    kind = spec["kind"]
    if kind == "truncated_normal":
        stddev, mean = options.pop("stddev", 0.01), options.pop("mean", 0.0)
        for value in (stddev, mean):
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise ConfigError(f"truncated_normal stddev and mean must be numbers, got {value!r}")
        stddev, mean = float(stddev), float(mean)
        if not (stddev > 0 and np.isfinite(stddev)):
            raise ConfigError(f"invalid truncated_normal stddev: {stddev}")
        if not np.isfinite(mean):
            raise ConfigError(f"invalid truncated_normal mean: {mean}")
        init = lambda rng, shape: truncated_normal(rng, shape, stddev, mean)  # noqa: E731
    elif kind == "glorot_uniform":
        init = glorot_uniform
    elif kind == "zeros":
        init = lambda rng, shape: np.zeros(shape, DTYPE)  # noqa: E731
    else:
        raise ConfigError(f"unknown initialiser kind {kind!r}: use truncated_normal, glorot_uniform or zeros")
    if options:
        valid = {"truncated_normal": "kind, mean, stddev"}.get(kind, "kind")
        raise ConfigError(f"unknown options for initialiser {kind!r}: {sorted(options)}; valid options: {valid}")
    return init


# ---------------------------------------------------------------------- layers

@dataclass(frozen=True)
class ForwardContext:
    """What a forward pass may depend on besides its input and the parameters.

    ``training``: False for an evaluation (dropout is then the identity);
    ``step``: the 1-based step in progress (0 outside a run);
    ``micro_batch``: the index of the micro-batch within the step; ``stage``:
    the name of the stage computing (so two stages' dropouts of one name draw
    different masks). Raises ``ValueError`` for a negative step or micro-batch.
    """

    training: bool = True
    step: int = 0
    micro_batch: int = 0
    stage: str = ""

    def __post_init__(self) -> None:
        if self.step < 0 or self.micro_batch < 0:
            raise ValueError(f"step and micro-batch must be >= 0, got {self.step} and {self.micro_batch}")


TRAINING = ForwardContext()                # what ``ctx=None`` means


class Layer(abc.ABC):
    """Base class; a layer with no parameters keeps ``params`` empty."""

    def __init__(self) -> None:
        self.params: dict[str, np.ndarray] = {}

    @abc.abstractmethod
    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        """Return ``(y, cache)``; ``ctx`` None means ``TRAINING``."""

    @abc.abstractmethod
    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        """Return ``(dx, grads)`` for the cache of one ``forward`` call (``dx`` None unless ``need_dx``)."""

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        """``dx`` now and the parameter gradients when the returned function is called."""
        dx, grads = self.backward(cache, dy)
        assert dx is not None
        return dx, lambda: grads

    def output_shape(self, shape: Shape) -> Shape:
        return shape


class Scale(Layer):
    """Element-wise weight: ``y = x * w`` with ``w`` of shape ``(size,)``.

    ``x`` is ``(size,)`` or ``(batch, size)``; a batched gradient is summed
    over the batch. This is the seed's ``tf.multiply(x, w)``.
    """

    def __init__(self, name: str, size: int, init: Any, seed: int) -> None:
        super().__init__()
        if size < 1:
            raise ConfigError(f"scale layer {name!r}: size must be >= 1, got {size}")
        self.name = name
        self.params[name] = make_initialiser(init)(param_rng(seed, name), (size,))

    def output_shape(self, shape: Shape) -> Shape:
        size = self.params[self.name].shape[0]
        if len(shape) not in (1, 2) or shape[-1] != size:
            raise ConfigError(f"scale layer {self.name!r} takes (size,) or (batch, {size}), got {shape}")
        return shape

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        return x * self.params[self.name], x

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        x, w = cache, self.params[self.name]
        dw = x * dy
        if dw.ndim > w.ndim:
            dw = dw.sum(axis=0)
        return (dy * w if need_dx else None), {self.name: dw}


class Dense(Layer):
    """Affine map ``y = x @ W + b``; ``x`` is ``(batch, n_in)``, ``W`` is ``(n_in, n_out)``.

    Parameters are named ``NAME.W`` and ``NAME.b``.
    """

    def __init__(self, name: str, n_in: int, n_out: int, init: Any, seed: int,
                 bias_init: Any = "zeros") -> None:
        super().__init__()
        if n_in < 1 or n_out < 1:
            raise ConfigError(f"dense layer {name!r}: sizes must be >= 1, got {n_in}->{n_out}")
        self.name, self.n_in, self.n_out = name, n_in, n_out
        self.w_name, self.b_name = f"{name}.W", f"{name}.b"
        self.params[self.w_name] = make_initialiser(init)(param_rng(seed, self.w_name), (n_in, n_out))
        self.params[self.b_name] = make_initialiser(bias_init)(param_rng(seed, self.b_name), (n_out,))

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 2 or shape[1] != self.n_in:
            raise ConfigError(f"dense layer {self.name!r} takes (batch, {self.n_in}), got {shape}")
        return (shape[0], self.n_out)

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        y = x @ self.params[self.w_name]
        y += self.params[self.b_name]      # the same float32 addition as ``+ b``, without a second array
        return y, x

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        x = cache
        grads = {self.w_name: x.T @ dy, self.b_name: dy.sum(axis=0)}
        return (dy @ self.params[self.w_name].T if need_dx else None), grads

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        x, w_name, b_name = cache, self.w_name, self.b_name
        return dy @ self.params[w_name].T, lambda: {w_name: x.T @ dy, b_name: dy.sum(axis=0)}


class Identity(Layer):
    """``y = x``: no parameters and no arithmetic (the benchmark's "trivial compute").

    ``forward`` returns ``x`` itself and ``backward`` returns ``dy`` itself,
    without a copy; like every layer, it never writes to either.
    """

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        return x, None

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        return (dy if need_dx else None), {}


class ReLU(Layer):
    """``y = max(x, 0)``; the gradient at 0 is 0 (as in TF)."""

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        return np.maximum(x, DTYPE(0)), x

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        return (dy * (cache > 0) if need_dx else None), {}


class Tanh(Layer):
    """``y = tanh(x)``; ``dx = dy * (1 - y**2)``."""

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        y = np.tanh(x)
        return y, y

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        y = cache
        return (dy * (DTYPE(1) - y * y) if need_dx else None), {}


class Sigmoid(Layer):
    """``y = 1 / (1 + exp(-x))``, computed as ``(1 + tanh(x/2)) / 2`` so it never overflows."""

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        y = DTYPE(0.5) * (DTYPE(1) + np.tanh(DTYPE(0.5) * x))
        return y, y

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        y = cache
        return (dy * y * (DTYPE(1) - y) if need_dx else None), {}


# ------------------------------------------------------- images and sequences

def _pair(layer: str, key: str, value: Any, minimum: int) -> tuple[int, int]:
    """``value`` as (rows, columns): a whole number for both or a list of two, each ``>= minimum``."""
    values = tuple(value) if isinstance(value, (list, tuple)) and len(value) == 2 else (value, value)
    for v in values:
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < minimum:
            raise ConfigError(f"{layer}: {key!r} must be a whole number >= {minimum} or a list of two, got {value!r}")
    return int(values[0]), int(values[1])


def _windows(x: np.ndarray, kernel: tuple[int, int], stride: tuple[int, int]) -> np.ndarray:
    """Every ``kernel`` window of NCHW ``x``, ``stride`` apart: a read-only view ``(N, C, Ho, Wo, kh, kw)``."""
    return sliding_window_view(x, kernel, axis=(2, 3))[:, :, ::stride[0], ::stride[1]]


def _window_slice(offset: int, stride: int, count: int) -> slice:
    """The input rows (or columns) that kernel offset ``offset`` reads across ``count`` windows."""
    return slice(offset, offset + stride * (count - 1) + 1, stride)


def _image_shape(layer: str, shape: Shape, channels: int | None, kernel: tuple[int, int],
                 stride: tuple[int, int], padding: tuple[int, int]) -> tuple[int, int]:
    """``(Ho, Wo)`` of ``kernel`` windows over a padded NCHW ``shape``; ``ConfigError`` if it is not one."""
    if len(shape) != 4 or (channels is not None and shape[1] != channels):
        raise ConfigError(f"{layer} takes (batch, {channels if channels is not None else 'channels'}, height, "
                          f"width), got {shape}")
    height, width = shape[2] + 2 * padding[0], shape[3] + 2 * padding[1]
    if height < kernel[0] or width < kernel[1]:
        raise ConfigError(f"{layer}: a {kernel[0]}x{kernel[1]} window does not fit a {shape[2]}x{shape[3]} image "
                          f"padded by {padding}")
    return (height - kernel[0]) // stride[0] + 1, (width - kernel[1]) // stride[1] + 1


class Conv2D(Layer):
    """2-D convolution (cross-correlation, as in every deep-learning library) of NCHW images.

    ``x`` is ``(batch, n_in, H, W)``, ``y`` is ``(batch, n_out, Ho, Wo)`` with
    ``Ho = (H + 2*ph - kh) // sh + 1`` (likewise ``Wo``), zero padding.
    Parameters ``NAME.W`` ``(n_out, n_in, kh, kw)`` and ``NAME.b`` ``(n_out,)``;
    ``kernel``, ``stride``, ``padding`` are a number or a (rows, columns) pair.
    Computed as a Dense layer over im2col rows (one row per output pixel,
    ``n_in*kh*kw`` columns) with one matrix product; ``dx`` adds the column
    gradients back with one strided addition per kernel offset (col2im).
    The default ``init`` is glorot_uniform with ``fan_in = n_in*kh*kw``,
    ``fan_out = n_out*kh*kw``. Raises ``ConfigError`` for a size, kernel or
    stride below 1 or a negative padding.
    """

    def __init__(self, name: str, n_in: int, n_out: int, kernel: Any, seed: int, stride: Any = 1, padding: Any = 0,
                 init: Any = "glorot_uniform", bias_init: Any = "zeros") -> None:
        super().__init__()
        layer = f"conv2d layer {name!r}"
        if n_in < 1 or n_out < 1:
            raise ConfigError(f"{layer}: channels must be >= 1, got {n_in}->{n_out}")
        self.name, self.n_in, self.n_out = name, n_in, n_out
        self.kernel = _pair(layer, "kernel", kernel, 1)
        self.stride = _pair(layer, "stride", stride, 1)
        self.padding = _pair(layer, "padding", padding, 0)
        self.w_name, self.b_name = f"{name}.W", f"{name}.b"
        shape = (n_out, n_in, *self.kernel)
        self.params[self.w_name] = make_initialiser(init)(param_rng(seed, self.w_name), shape)
        self.params[self.b_name] = make_initialiser(bias_init)(param_rng(seed, self.b_name), (n_out,))

    def output_shape(self, shape: Shape) -> Shape:
        ho, wo = _image_shape(f"conv2d layer {self.name!r}", shape, self.n_in, self.kernel, self.stride, self.padding)
        return (shape[0], self.n_out, ho, wo)

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        (ph, pw), (kh, kw) = self.padding, self.kernel
        padded = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw))) if ph or pw else x
        windows = _windows(padded, self.kernel, self.stride)
        n, _, ho, wo = windows.shape[:4]
        cols = windows.transpose(0, 2, 3, 1, 4, 5).reshape(n * ho * wo, self.n_in * kh * kw)   # im2col: a copy
        rows = cols @ self.params[self.w_name].reshape(self.n_out, -1).T                     # (N*Ho*Wo, n_out)
        y = np.empty((n, self.n_out, ho, wo), rows.dtype)
        np.add(rows.reshape(n, ho, wo, self.n_out).transpose(0, 3, 1, 2), self.params[self.b_name][:, None, None],
               out=y)
        return y, (x.shape, cols)

    def _grads(self, cols: np.ndarray, dy_rows: np.ndarray) -> Grads:
        return {self.w_name: (dy_rows.T @ cols).reshape(self.params[self.w_name].shape),
                self.b_name: dy_rows.sum(axis=0)}

    def _dx(self, x_shape: Shape, dy: np.ndarray, dy_rows: np.ndarray) -> np.ndarray:
        (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.padding
        n, c, h, w = x_shape
        ho, wo = dy.shape[2:]
        dcols = dy_rows @ self.params[self.w_name].reshape(self.n_out, -1)                  # (N*Ho*Wo, C*kh*kw)
        dcols = np.ascontiguousarray(dcols.reshape(n, ho, wo, c, kh, kw).transpose(0, 3, 4, 5, 1, 2))
        dx = np.zeros((n, c, h + 2 * ph, w + 2 * pw), dcols.dtype)
        for i in range(kh):                 # col2im, offsets in row-major order: a fixed summation order
            for j in range(kw):
                dx[:, :, _window_slice(i, sh, ho), _window_slice(j, sw, wo)] += dcols[:, :, i, j]
        return np.ascontiguousarray(dx[:, :, ph:ph + h, pw:pw + w]) if ph or pw else dx

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        x_shape, cols = cache
        dy_rows = dy.transpose(0, 2, 3, 1).reshape(-1, self.n_out)
        return (self._dx(x_shape, dy, dy_rows) if need_dx else None), self._grads(cols, dy_rows)

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        x_shape, cols = cache
        dy_rows = dy.transpose(0, 2, 3, 1).reshape(-1, self.n_out)
        return self._dx(x_shape, dy, dy_rows), lambda: self._grads(cols, dy_rows)


class MaxPool2D(Layer):
    """The maximum of each ``kernel`` window of NCHW images, windows ``stride`` apart (default: the kernel).

    ``x`` is ``(batch, C, H, W)``, ``y`` is ``(batch, C, (H - kh) // sh + 1,
    (W - kw) // sw + 1)``; no padding, so rows and columns past the last whole
    window are dropped (their gradient is zero). Ties: a window's gradient
    goes to its first maximum in row-major order (numpy's ``argmax``), the
    others get zero. Raises ``ConfigError`` for a kernel or stride below 1.
    """

    def __init__(self, kernel: Any, stride: Any = None) -> None:
        super().__init__()
        self.kernel = _pair("maxpool2d layer", "kernel", kernel, 1)
        self.stride = self.kernel if stride is None else _pair("maxpool2d layer", "stride", stride, 1)

    def output_shape(self, shape: Shape) -> Shape:
        ho, wo = _image_shape("maxpool2d layer", shape, None, self.kernel, self.stride, (0, 0))
        return (shape[0], shape[1], ho, wo)

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        windows = _windows(x, self.kernel, self.stride)
        flat = windows.reshape(*windows.shape[:4], -1)             # a copy: (N, C, Ho, Wo, kh*kw)
        first = flat.argmax(axis=-1)
        return np.take_along_axis(flat, first[..., None], axis=-1)[..., 0], (x.shape, first)

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        if not need_dx:
            return None, {}
        x_shape, first = cache
        (kh, kw), (sh, sw) = self.kernel, self.stride
        ho, wo = dy.shape[2:]
        dx = np.zeros(x_shape, dy.dtype)
        for k in range(kh * kw):            # overlapping windows (stride < kernel) add up, in a fixed order
            i, j = divmod(k, kw)
            dx[:, :, _window_slice(i, sh, ho), _window_slice(j, sw, wo)] += np.where(first == k, dy, 0)
        return dx, {}


class Flatten(Layer):
    """``(batch, d1, d2, ...)`` to ``(batch, d1*d2*...)`` in C order (a view of a contiguous ``x``)."""

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) < 2:
            raise ConfigError(f"flatten layer takes (batch, ...), got {shape}")
        return (shape[0], math.prod(shape[1:]))

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        return x.reshape(x.shape[0], math.prod(x.shape[1:])), x.shape

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        return (dy.reshape(cache) if need_dx else None), {}


class Reshape(Layer):
    """Each row to ``shape`` in C order: ``(batch, ...)`` to ``(batch, *shape)`` (``[1, 8, 8]`` makes
    flat 64-pixel rows one-channel 8x8 images). Raises ``ConfigError`` for an empty shape or a size below 1."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        if (not isinstance(shape, (list, tuple)) or not shape
                or any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in shape)):
            raise ConfigError(f"reshape layer: 'shape' must be a list of whole numbers >= 1 (a row's shape, "
                              f"such as [1, 8, 8]), got {shape!r}")
        self.shape = tuple(shape)

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) < 1 or math.prod(shape[1:]) != math.prod(self.shape):
            raise ConfigError(f"reshape layer to {list(self.shape)} takes (batch, ...) with "
                              f"{math.prod(self.shape)} values a row, got {shape}")
        return (shape[0], *self.shape)

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        return x.reshape(x.shape[0], *self.shape), x.shape

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        return (dy.reshape(cache) if need_dx else None), {}


class Dropout(Layer):
    """Inverted dropout: in training, each element is zeroed with probability ``rate`` and the rest are
    scaled by ``float32(1 / (1 - rate))``; the identity when ``ctx.training`` is false or ``rate`` is 0.

    The mask is a pure function of (the run's ``seed``, the stage's and the
    layer's names, ``ctx.step``, ``ctx.micro_batch``) and the input's shape, so a resumed or
    distributed run draws exactly the masks of the in-process reference.
    Raises ``ConfigError`` unless ``0 <= rate < 1``.
    """

    def __init__(self, rate: float, name: str, seed: int) -> None:
        super().__init__()
        if not isinstance(rate, (int, float)) or isinstance(rate, bool) or not 0 <= rate < 1:
            raise ConfigError(f"dropout layer {name!r}: 'rate' must be a number in [0, 1), got {rate!r}")
        self.rate, self.name, self.seed = float(rate), name, seed
        self.scale = DTYPE(1.0 / (1.0 - self.rate))
        self._name_key = zlib.crc32(name.encode())

    def mask(self, shape: Shape, ctx: ForwardContext) -> np.ndarray:
        """float32 ``0`` (dropped) or ``scale`` (kept) per element, for the step and micro-batch of ``ctx``."""
        rng = np.random.default_rng([self.seed, zlib.crc32(ctx.stage.encode()), self._name_key, ctx.step,
                                     ctx.micro_batch])
        return (rng.random(shape, dtype=np.float32) >= DTYPE(self.rate)) * self.scale

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        ctx = TRAINING if ctx is None else ctx
        if not ctx.training or self.rate == 0:
            return x, None
        mask = self.mask(x.shape, ctx)
        return x * mask, mask

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        if not need_dx:
            return None, {}
        return (dy if cache is None else dy * cache), {}


EMBEDDING_VOCAB_MAX = 2 ** 24      # ids travel as float32, whose whole numbers are exact up to 2**24


class Embedding(Layer):
    """A lookup table: ``y[n, l] = W[ids[n, l]]``; ``x`` is ``(batch, L)`` ids, ``y`` is ``(batch, L, dim)``.

    Ids arrive as float32 (the wire's type) and are cast to int64; ``forward``
    raises ``ValueError`` naming the first id that is not a whole number in
    ``[0, vocab)``. Parameter ``NAME.W`` ``(vocab, dim)`` (default init:
    truncated normal, stddev 0.1); its gradient adds each position's ``dy`` row
    with ``np.add.at`` (ids in row-major order). ``dx`` is zeros: ids have no
    gradient. Raises ``ConfigError`` for sizes below 1 or a vocab above 2**24.
    """

    def __init__(self, name: str, vocab: int, dim: int, init: Any, seed: int) -> None:
        super().__init__()
        if not 1 <= vocab <= EMBEDDING_VOCAB_MAX or dim < 1:
            raise ConfigError(f"embedding layer {name!r}: vocab must be in [1, 2**24] and dim >= 1, "
                              f"got vocab {vocab}, dim {dim}")
        self.name, self.vocab, self.dim = name, vocab, dim
        self.w_name = f"{name}.W"
        self.params[self.w_name] = make_initialiser(init)(param_rng(seed, self.w_name), (vocab, dim))

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) != 2:
            raise ConfigError(f"embedding layer {self.name!r} takes ids of shape (batch, length), got {shape}")
        return (*shape, self.dim)

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        bad = ~((x >= 0) & (x < self.vocab) & (np.floor(x) == x))          # NaN fails every comparison
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"embedding layer {self.name!r}: id {x[where]!r} at {where} is not a whole number "
                             f"in [0, {self.vocab})")
        ids = x.astype(np.int64)
        return self.params[self.w_name][ids], (x.shape, ids)

    def _grads(self, ids: np.ndarray, dy: np.ndarray) -> Grads:
        dw = np.zeros(self.params[self.w_name].shape, dy.dtype)
        np.add.at(dw, ids, dy)
        return {self.w_name: dw}

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        x_shape, ids = cache
        return (np.zeros(x_shape, dy.dtype) if need_dx else None), self._grads(ids, dy)

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        x_shape, ids = cache
        return np.zeros(x_shape, dy.dtype), lambda: self._grads(ids, dy)


class LayerNorm(Layer):
    """``y = (x - mean) / sqrt(var + eps) * gamma + beta`` over the last axis (biased variance, as torch).

    ``x`` is ``(batch, ..., size)``; parameters ``NAME.gamma`` (ones) and
    ``NAME.beta`` (zeros), both ``(size,)``. Raises ``ConfigError`` for a size
    below 1 or an ``eps`` that is not a positive float32 number.
    """

    def __init__(self, name: str, size: int, eps: float = 1e-5) -> None:
        super().__init__()
        if size < 1:
            raise ConfigError(f"layernorm layer {name!r}: size must be >= 1, got {size}")
        if (not isinstance(eps, (int, float)) or isinstance(eps, bool) or not np.isfinite(eps)
                or not DTYPE(eps) > 0):
            raise ConfigError(f"layernorm layer {name!r}: 'eps' must be a positive float32 number, got {eps!r}")
        self.name, self.size, self.eps = name, size, DTYPE(eps)
        self.gamma_name, self.beta_name = f"{name}.gamma", f"{name}.beta"
        self.params[self.gamma_name] = np.ones(size, DTYPE)
        self.params[self.beta_name] = np.zeros(size, DTYPE)

    def output_shape(self, shape: Shape) -> Shape:
        if len(shape) < 2 or shape[-1] != self.size:
            raise ConfigError(f"layernorm layer {self.name!r} takes (batch, ..., {self.size}), got {shape}")
        return shape

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        centred = x - x.mean(axis=-1, keepdims=True)
        inv_std = DTYPE(1) / np.sqrt((centred * centred).mean(axis=-1, keepdims=True) + self.eps)
        normed = centred * inv_std
        return normed * self.params[self.gamma_name] + self.params[self.beta_name], (normed, inv_std)

    def _grads(self, normed: np.ndarray, dy: np.ndarray) -> Grads:
        return {self.gamma_name: (dy * normed).reshape(-1, self.size).sum(axis=0),
                self.beta_name: dy.reshape(-1, self.size).sum(axis=0)}

    def _dx(self, normed: np.ndarray, inv_std: np.ndarray, dy: np.ndarray) -> np.ndarray:
        d_normed = dy * self.params[self.gamma_name]
        return inv_std * (d_normed - d_normed.mean(axis=-1, keepdims=True)
                          - normed * (d_normed * normed).mean(axis=-1, keepdims=True))

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        normed, inv_std = cache
        return (self._dx(normed, inv_std, dy) if need_dx else None), self._grads(normed, dy)

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        normed, inv_std = cache
        return self._dx(normed, inv_std, dy), lambda: self._grads(normed, dy)


class Sequential(Layer):
    """Layers applied in order; parameter names must be unique."""

    def __init__(self, layers: Sequence[Layer]) -> None:
        super().__init__()
        self.layers = list(layers)
        for layer in self.layers:
            for name, value in layer.params.items():
                if name in self.params:
                    raise ConfigError(f"parameter name {name!r} is used twice")
                self.params[name] = value

    def output_shape(self, shape: Shape) -> Shape:
        for layer in self.layers:
            shape = layer.output_shape(shape)
        return shape

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(x, ctx)
            caches.append(cache)
        return x, caches

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        grads: Grads = {}
        last = len(self.layers) - 1
        dx: np.ndarray | None = dy
        for depth, (layer, layer_cache) in enumerate(zip(reversed(self.layers), reversed(cache))):
            if dx is None:
                raise TypeError(f"{type(self.layers[last - depth + 1]).__name__}.backward returned no dx with "
                                f"need_dx true")
            dx, layer_grads = layer.backward(layer_cache, dx, need_dx or depth < last)
            grads.update(layer_grads)
        return dx, grads

    def backward_deferred(self, cache: Any, dy: np.ndarray) -> tuple[np.ndarray, Callable[[], Grads]]:
        later = []
        for layer, layer_cache in zip(reversed(self.layers), reversed(cache)):
            dy, layer_later = layer.backward_deferred(layer_cache, dy)
            later.append(layer_later)

        def grads() -> Grads:
            out: Grads = {}
            for layer_later in later:          # the order ``backward`` fills its dict in
                out.update(layer_later())
            return out
        return dy, grads


# -------------------------------------------------------------------- builders

_ACTIVATIONS: dict[str, type[Layer]] = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid, "identity": Identity}


def _size(kind: str, key: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"layer {kind!r}: {key!r} must be a whole number, got {value!r}")
    return value


_LAYER_KEYS = {"scale": ("type", "name", "size", "init"), "dense": ("type", "name", "in", "out", "init", "bias_init"),
               "conv2d": ("type", "name", "in", "out", "kernel", "stride", "padding", "init", "bias_init"),
               "maxpool2d": ("type", "kernel", "stride", "padding"), "flatten": ("type",), "reshape": ("type", "shape"),
               "dropout": ("type", "rate", "name"), "embedding": ("type", "name", "vocab", "dim", "init"),
               "layernorm": ("type", "name", "size", "eps"),
               **{kind: ("type",) for kind in _ACTIVATIONS}}

EMBEDDING_INIT = {"kind": "truncated_normal", "stddev": 0.1}


def build_layer(spec: Mapping[str, Any], seed: int, index: int = 0) -> Layer:
    """Build one layer from an experiment table such as ``{type = "dense", name = "h", in = 4, out = 8}``.

    ``index`` is the layer's position in its model: a dropout without a
    ``name`` is named ``dropout{index}``. Raises ``ConfigError`` for an
    unknown type or key (listing the valid ones) or a bad value.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a layer must be a table such as {{ type = \"tanh\" }}, got {spec!r}")
    spec = dict(spec)
    kind = spec.pop("type", None)
    if not isinstance(kind, str) or kind not in _LAYER_KEYS:
        raise ConfigError(f"unknown layer type {kind!r}: use {', '.join(_LAYER_KEYS)}")
    unknown = sorted(set(spec) - set(_LAYER_KEYS[kind]))
    if unknown:
        raise ConfigError(f"unknown keys for layer {kind!r}: {unknown}; valid keys: {', '.join(_LAYER_KEYS[kind])}")
    if "name" in _LAYER_KEYS[kind] and "name" in spec and (not isinstance(spec["name"], str) or not spec["name"]):
        raise ConfigError(f"layer {kind!r}: 'name' must be a non-empty string, got {spec['name']!r}")
    try:
        if kind == "scale":
            layer: Layer = Scale(spec.pop("name"), _size(kind, "size", spec.pop("size", 1)),
                                 spec.pop("init", "truncated_normal"), seed)
        elif kind == "dense":
            layer = Dense(spec.pop("name"), _size(kind, "in", spec.pop("in")), _size(kind, "out", spec.pop("out")),
                          spec.pop("init", "glorot_uniform"), seed, spec.pop("bias_init", "zeros"))
        elif kind == "conv2d":
            layer = Conv2D(spec.pop("name"), _size(kind, "in", spec.pop("in")), _size(kind, "out", spec.pop("out")),
                           spec.pop("kernel"), seed, spec.pop("stride", 1), spec.pop("padding", 0),
                           spec.pop("init", "glorot_uniform"), spec.pop("bias_init", "zeros"))
        elif kind == "maxpool2d":
            if _pair("maxpool2d layer", "padding", spec.pop("padding", 0), 0) != (0, 0):
                raise ConfigError("maxpool2d layer: only 'padding' = 0 is supported")
            layer = MaxPool2D(spec.pop("kernel"), spec.pop("stride", None))
        elif kind == "flatten":
            layer = Flatten()
        elif kind == "reshape":
            layer = Reshape(spec.pop("shape"))
        elif kind == "dropout":
            layer = Dropout(spec.pop("rate"), spec.pop("name", f"dropout{index}"), seed)
        elif kind == "embedding":
            layer = Embedding(spec.pop("name"), _size(kind, "vocab", spec.pop("vocab")),
                              _size(kind, "dim", spec.pop("dim")), spec.pop("init", EMBEDDING_INIT), seed)
        elif kind == "layernorm":
            layer = LayerNorm(spec.pop("name"), _size(kind, "size", spec.pop("size")), spec.pop("eps", 1e-5))
        elif kind in _ACTIVATIONS:
            layer = _ACTIVATIONS[kind]()
        else:
            raise ConfigError(f"unknown layer type {kind!r}: use {', '.join(_LAYER_KEYS)}")
    except ConfigError:
        raise
    except KeyError as e:
        raise ConfigError(f"layer {kind!r} needs the key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"layer {kind!r}: invalid value ({e})") from e
    if spec:
        raise ConfigError(f"unknown keys for layer {kind!r}: {sorted(spec)}")
    return layer


def build_model(specs: Sequence[Mapping[str, Any]], seed: int) -> Sequential:
    """Build a ``Sequential`` from a list of layer tables.

    Raises ``ConfigError`` for an empty list, a bad layer, or two dropouts of
    one name (they would draw the same masks).
    """
    if not specs:
        raise ConfigError("a stage's model needs at least one layer")
    layers = [build_layer(s, seed, index) for index, s in enumerate(specs)]
    dropouts = [layer.name for layer in layers if isinstance(layer, Dropout)]
    twice = sorted({name for name in dropouts if dropouts.count(name) > 1})
    if twice:
        raise ConfigError(f"dropout name {twice[0]!r} is used twice (two such layers would draw the same masks)")
    return Sequential(layers)
