"""How the label owner of a vertical experiment combines its feature parties' embeddings, and splits the gradient.

Pure float32 math, no I/O. Each of K feature parties sends the label owner
its embedding of the same rows, ``parts[k]`` of shape ``(rows, ..., w_k)``;
``combine`` makes the label owner's input from them and ``split`` gives each
party exactly the gradient of its own embedding:

* ``concat``: the parts side by side along the last axis, in party order;
  party k's gradient is its own columns of the input's gradient;
* ``sum``: ``((parts[0] + parts[1]) + parts[2]) + ...`` in party order (all
  shapes equal); every party's gradient is the input's gradient;
* ``mean``: the sum divided by ``float32(K)``; every party's gradient is the
  input's gradient divided by ``float32(K)``.

The in-process reference and the serving stage call these same functions in
the same order, so a vertical run over the wire is bitwise equal to it.

With ``secure_aggregation`` (``sum`` and ``mean`` only) every party's
embedding is first rounded to fixed point (``quantise``: int64 of
``round(x * 2**FRACTION_BITS)``, as uint64 bits) and the parts are added as
integers modulo 2**64 (``combine_fixed``): pairwise masks a party adds to its
part over the wire (``distgrad.wire.masking``) cancel exactly in that sum,
and the in-process reference adds the unmasked integers, so the two stay
bitwise equal. The total becomes float32 once, at the end (``dequantise``).
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import numpy as np

from distgrad.errors import CodecRangeError, ConfigError
from distgrad.model.nn import DTYPE, ForwardContext, Grads, Layer, Sequential, Shape

AGGREGATES = ("concat", "sum", "mean")
SECURE_AGGREGATES = ("sum", "mean")     # the aggregates ``secure_aggregation`` can hide the parts of
FRACTION_BITS = 32      # fixed point of secure aggregation: a unit is 2**-32 (about 2.3e-10)
SUM_BITS = 62           # the parts' exact total stays below 2**62 in magnitude: no int64 overflow
SECURE_SUM = "secure_sum"   # the name secure aggregation's values cross the wire under (its codec's)


def combined_shape(kind: str, shapes: Sequence[Shape]) -> Shape:
    """The shape of the combined input from the parts' shapes; ``ConfigError`` when they do not fit
    (``concat``: equal but for the last axis; ``sum``/``mean``: all equal)."""
    if kind not in AGGREGATES:
        raise ConfigError(f"'aggregate' must be one of {list(AGGREGATES)}, got {kind!r}")
    shapes = [tuple(shape) for shape in shapes]
    if not shapes:
        raise ConfigError("a vertical experiment needs at least one feature party")
    if kind == "concat":
        if any(len(s) < 1 or s[:-1] != shapes[0][:-1] for s in shapes):
            raise ConfigError(f"aggregate = \"concat\" joins the parties' embeddings along their last axis: "
                              f"the other axes must agree, got {shapes}")
        return (*shapes[0][:-1], sum(s[-1] for s in shapes))
    if any(s != shapes[0] for s in shapes):
        raise ConfigError(f"aggregate = {kind!r} adds the parties' embeddings: their shapes must be equal, got "
                          f"{shapes}")
    return shapes[0]


def combine(kind: str, parts: Sequence[np.ndarray]) -> np.ndarray:
    """The label owner's float32 input from the parties' embeddings (in party order)."""
    if kind == "concat":
        return np.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    if kind == "mean":
        total = total / DTYPE(len(parts))
    return total


def split(kind: str, grad: np.ndarray, widths: Sequence[int]) -> list[np.ndarray]:
    """Each party's gradient (contiguous float32, in party order) from the gradient of the combined input;
    ``widths[k]`` is party k's last-axis width (used by ``concat``)."""
    if kind == "concat":
        return columns(grad, widths) if len(widths) > 1 else [grad]
    if kind == "mean":
        grad = grad / DTYPE(len(widths))
    return [grad if k == 0 else grad.copy() for k in range(len(widths))]   # a backward may reuse its input


def columns(x: np.ndarray, widths: Sequence[int]) -> list[np.ndarray]:
    """``x``'s last axis cut into parts of ``widths`` (the first ``sum(widths)`` columns), each a contiguous
    copy. Parts of one width are copied by one numpy call into one block (each part a view of a row of
    it): a label owner's gradient at K parties costs one copy, not K."""
    count, width = len(widths), widths[0]
    if list(widths).count(width) == count and x.shape[-1] == count * width:
        lead = x.shape[:-1]
        block = np.empty((count, *lead, width), x.dtype)
        # (..., K * w) -> (..., K, w) -> (K, ..., w): part k's columns become row k of the block.
        np.copyto(block, x.reshape(*lead, count, width).transpose(len(lead), *range(len(lead)), len(lead) + 1))
        return list(block)
    edges = list(itertools.accumulate(widths, initial=0))
    return [np.ascontiguousarray(x[..., edges[k]:edges[k + 1]]) for k in range(count)]


class OwnBottom(Layer):
    """The first layer of a vertical label owner that holds features too (its ``bottom``).

    Its input is the parties' embeddings and the label owner's own feature
    columns side by side along the last axis (``join_input``); it runs
    ``bottom`` over the own columns and combines the parties' embeddings and
    that output (``combine``, the label owner last, as one more party). Its
    backward gives ``bottom`` the gradient of its own embedding and returns the
    parties' gradients (``split``) side by side, with zeros for the own columns.
    """

    def __init__(self, kind: str, widths: Sequence[int], bottom: Sequential) -> None:
        super().__init__()
        self.kind, self.widths, self.bottom = kind, list(widths), bottom
        self.edges = list(itertools.accumulate(self.widths, initial=0))    # where each party's columns start
        self.params = bottom.params

    def _parts(self, x: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        edges = self.edges
        return [x[..., edges[k]:edges[k + 1]] for k in range(len(self.widths))], x[..., edges[-1]:]

    def output_shape(self, shape: Shape) -> Shape:
        own = self.bottom.output_shape((*shape[:-1], shape[-1] - sum(self.widths)))
        return combined_shape(self.kind, [(*shape[:-1], w) for w in self.widths] + [own])

    def forward(self, x: np.ndarray, ctx: ForwardContext | None = None) -> tuple[np.ndarray, Any]:
        parts, own = self._parts(x)
        embedding, cache = self.bottom.forward(np.ascontiguousarray(own), ctx)
        return combine(self.kind, [*parts, embedding]), (cache, embedding.shape[-1], own.shape)

    def backward(self, cache: Any, dy: np.ndarray, need_dx: bool = True) -> tuple[np.ndarray | None, Grads]:
        bottom_cache, width, own_shape = cache
        *parts, mine = split(self.kind, dy, [*self.widths, width])
        _, grads = self.bottom.backward(bottom_cache, mine, need_dx=False)
        dx = np.concatenate([*parts, np.zeros(own_shape, DTYPE)], axis=-1) if need_dx else None
        return dx, grads


def join_input(parts: Sequence[np.ndarray], own: np.ndarray | None, kind: str, secure: bool = False) -> np.ndarray:
    """The label owner's input: the parties' embeddings combined, or (a label owner with its own
    ``bottom``) them and its own feature columns side by side, for ``OwnBottom`` to combine. ``secure``:
    the parts are fixed point (``combine_fixed``; no own columns then)."""
    if secure:
        if own is not None:
            raise ConfigError("secure aggregation does not combine the label owner's own 'bottom'")
        return combine_fixed(kind, parts)
    if own is None:
        return combine(kind, parts)
    return np.concatenate([*parts, own.astype(DTYPE, copy=False)], axis=-1)


def split_input(grad: np.ndarray, own: bool, kind: str, widths: Sequence[int]) -> list[np.ndarray]:
    """Each party's gradient from the gradient of ``join_input``'s result."""
    if not own:
        return split(kind, grad, widths)
    return columns(grad, widths)


def fixed_point_limit(parties: int) -> float:
    """The largest magnitude a party's embedding value may have under secure aggregation of ``parties``
    parts: ``2**(SUM_BITS - FRACTION_BITS) / parties`` (2**30 / K, about 1.07e9 / K), so that the exact
    total of the K rounded parts fits in int64."""
    return float(2.0 ** (SUM_BITS - FRACTION_BITS) / parties)


def quantise(x: np.ndarray, parties: int, tensor: str = "activation", step: int = 0) -> np.ndarray:
    """float32 ``x`` in fixed point: ``round(x * 2**FRACTION_BITS)`` (half to even, computed exactly in
    float64) as the uint64 bits of that int64. Raises ``CodecRangeError`` naming the first value that is
    NaN, infinite or beyond ``fixed_point_limit(parties)`` (``tensor`` and ``step`` name it)."""
    wide = np.asarray(x, np.float64)
    limit = fixed_point_limit(parties)
    bad = ~(np.abs(wide) < limit)                # NaN compares False: it is bad too
    if bad.any():
        index = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), wide.shape))
        raise CodecRangeError(SECURE_SUM, tensor, step,
                              f"value {float(wide[index])!r} at index {index} cannot be summed securely: secure "
                              f"aggregation of {parties} parties carries finite values of magnitude below "
                              f"{limit:.6g} (2**{SUM_BITS - FRACTION_BITS} / {parties})")
    return np.rint(np.ldexp(wide, FRACTION_BITS)).astype(np.int64).view(np.uint64)


def dequantise(total: np.ndarray) -> np.ndarray:
    """The float32 of a fixed-point total (uint64 bits of an int64): ``float32(float64(t) * 2**-F)``."""
    return np.ldexp(total.view(np.int64).astype(np.float64), -FRACTION_BITS).astype(DTYPE)


def combine_fixed(kind: str, parts: Sequence[np.ndarray]) -> np.ndarray:
    """The label owner's float32 input from the parties' fixed-point parts (``quantise``'s, masked or
    not: int64 or uint64 bits), added modulo 2**64 in party order; ``mean`` divides by ``float32(K)``
    after, as ``combine`` does. Masks that cancel pairwise leave exactly the unmasked total."""
    if kind not in SECURE_AGGREGATES:
        raise ConfigError(f"secure aggregation adds the parties' embeddings: aggregate must be one of "
                          f"{list(SECURE_AGGREGATES)}, got {kind!r}")
    total = np.array(parts[0], copy=True).view(np.uint64)
    for part in parts[1:]:
        total += np.asarray(part).view(np.uint64)        # wraps modulo 2**64 by design
    result = dequantise(total)
    if kind == "mean":
        result = result / DTYPE(len(parts))
    return result
