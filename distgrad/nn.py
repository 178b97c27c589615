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
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .errors import ConfigError

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
    """Uniform on +-sqrt(6 / (fan_in + fan_out)) for a (fan_in, fan_out) matrix."""
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
    ``micro_batch``: the index of the micro-batch within the step. Raises
    ``ValueError`` for a negative step or micro-batch.
    """

    training: bool = True
    step: int = 0
    micro_batch: int = 0

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
        for depth, (layer, layer_cache) in enumerate(zip(reversed(self.layers), reversed(cache))):
            dy, layer_grads = layer.backward(layer_cache, dy, need_dx or depth < last)
            grads.update(layer_grads)
        return dy, grads

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
               **{kind: ("type",) for kind in _ACTIVATIONS}}


def build_layer(spec: Mapping[str, Any], seed: int) -> Layer:
    """Build one layer from an experiment table such as ``{type = "dense", name = "h", in = 4, out = 8}``.

    Raises ``ConfigError`` for an unknown type or key (listing the valid ones) or a bad value.
    """
    if not isinstance(spec, Mapping):
        raise ConfigError(f"a layer must be a table such as {{ type = \"tanh\" }}, got {spec!r}")
    spec = dict(spec)
    kind = spec.pop("type", None)
    if not isinstance(kind, str) or kind not in _LAYER_KEYS:
        raise ConfigError(f"unknown layer type {kind!r}: use {', '.join(_LAYER_KEYS)}")
    if kind in _LAYER_KEYS:
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
    """Build a ``Sequential`` from a list of layer tables."""
    if not specs:
        raise ConfigError("a stage's model needs at least one layer")
    return Sequential([build_layer(s, seed) for s in specs])
