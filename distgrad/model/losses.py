"""Losses for the last stage: value and gradient with respect to the prediction.

``forward_backward(pred, target)`` returns ``(loss, dpred)``: ``loss`` is a
float32 scalar, ``dpred`` has the shape of ``pred``. Everything is float32;
targets are float32 except for ``SoftmaxCrossEntropy`` (int64 class ids).
"""

from __future__ import annotations

import abc
from typing import Any, Mapping

import numpy as np

from distgrad.errors import ConfigError
from distgrad.model.buffers import REUSE_MIN_BYTES, BufferRing
from distgrad.model.nn import DTYPE, Shape


class Loss(abc.ABC):
    target_dtype: np.dtype = np.dtype(DTYPE)
    reduction: str = "mean"      # "sum" or "mean" over the batch: how micro-batch gradients combine
    classifies: bool = False     # targets are class ids, the output one score per class

    def micro_batch_scale(self, count: int) -> np.float32:
        """Factor applied to the sum of ``count`` micro-batch gradients (and losses) so
        that, in exact arithmetic, it equals the whole batch's gradient."""
        return DTYPE(1) if self.reduction == "sum" else DTYPE(1) / DTYPE(count)

    def target_shape(self, pred_shape: Shape) -> Shape:
        """The target shape that goes with a prediction of ``pred_shape``."""
        return pred_shape

    @abc.abstractmethod
    def forward_backward(self, pred: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        """Return ``(loss, d(loss)/d(pred))``."""

    def correct(self, pred: np.ndarray, target: np.ndarray) -> int | None:
        """How many predictions are right, for losses that classify; None otherwise."""
        return None

    def predict(self, pred: np.ndarray) -> np.ndarray:
        """What the model predicts from the last stage's output: the output itself (regression)."""
        return pred

    def scores(self, pred: np.ndarray) -> np.ndarray:
        """The scores behind ``predict`` (``distgrad predict --output-scores``), float32 of ``pred``'s shape:
        here the raw output (regression)."""
        return np.asarray(pred, DTYPE)


def softmax(pred: np.ndarray, axis: int = 1) -> np.ndarray:
    """Class probabilities from logits along ``axis`` (float32; the largest logit is subtracted first)."""
    shifted = np.asarray(pred, DTYPE) - np.max(pred, axis=axis, keepdims=True)
    exp = np.exp(shifted)
    return exp / exp.sum(axis=axis, keepdims=True, dtype=DTYPE)


def sigmoid(pred: np.ndarray) -> np.ndarray:
    """Probabilities from logits, one per element (float32; no overflow for large negative logits)."""
    pred = np.asarray(pred, DTYPE)
    exp = np.exp(-np.abs(pred))
    return np.where(pred >= 0, DTYPE(1) / (DTYPE(1) + exp), exp / (DTYPE(1) + exp)).astype(DTYPE)


class SumSquaredError(Loss):
    """``sum((pred - target)**2)``: the seed's ``tf.square(output - y)`` over its one element.

    The gradient is ``(pred - target) * 2``, TensorFlow's Square gradient. For a prediction and target of the
    same float32 shape it is written into an array of ``BufferRing`` (the same values): a large gradient of a
    fixed shape is then not allocated afresh every step once nothing holds the last one.
    """

    reduction = "sum"

    def __init__(self) -> None:
        self._square: np.ndarray | None = None     # reused for diff * diff (never returned)
        self._gradients = BufferRing()

    def forward_backward(self, pred: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        if (type(pred) is np.ndarray and pred.nbytes >= REUSE_MIN_BYTES and type(target) is np.ndarray
                and pred.dtype == DTYPE and target.dtype == DTYPE and pred.shape == target.shape):
            diff = np.subtract(pred, target, out=self._gradients.take(pred.shape, pred.dtype))
        else:
            diff = pred - target
        square = self._square
        if square is None or square.shape != diff.shape or square.dtype != diff.dtype:
            square = self._square = np.empty_like(diff)
        np.multiply(diff, diff, out=square)
        loss = DTYPE(np.add.reduce(square, axis=None, dtype=DTYPE))    # what np.sum(diff * diff, dtype=DTYPE) does
        diff *= DTYPE(2)                        # diff is this call's own array: the gradient, in place
        return loss, diff


class MeanSquaredError(Loss):
    """``mean((pred - target)**2)`` over every element."""

    def forward_backward(self, pred: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        diff = pred - target
        loss = DTYPE(np.mean(diff * diff, dtype=DTYPE))
        return loss, diff * DTYPE(2.0 / diff.size)


class SoftmaxCrossEntropy(Loss):
    """Mean over the batch of ``-log softmax(logits)[label]``.

    ``pred`` is ``(batch, classes)`` logits, ``target`` is ``(batch,)`` int64
    class ids in ``[0, classes)``.
    """

    target_dtype = np.dtype(np.int64)
    classifies = True

    def target_shape(self, pred_shape: Shape) -> Shape:
        if len(pred_shape) != 2:
            raise ConfigError(f"softmax cross-entropy takes (batch, classes) logits, got {pred_shape}")
        return (pred_shape[0],)

    def forward_backward(self, pred: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        # Each step in as few numpy calls as the float32 results allow (a call on a batch of 32 costs more
        # than its arithmetic): the reductions as ``ufunc.reduce`` (what ``.max``/``.sum`` call, without
        # their Python layer), in place where the array is this call's own, and each row's label found by
        # its flat index (row * classes + label) in C order. ``log_prob`` keeps ``pred``'s memory order:
        # numpy's sum along a row adds in an order that depends on it.
        batch, classes = pred.shape
        kind = target.dtype.kind
        if kind not in "iu":        # a float or bool id would pass the unsigned check below, cut or as 0/1
            raise ValueError(f"class ids must be integers, got {target.dtype} targets")
        # One reduction checks both ends: a negative id is huge as an unsigned one.
        if np.maximum.reduce(target.astype(np.uint64), axis=None, initial=0) >= classes:
            raise ValueError(f"class ids must lie in [0, {classes}), got {target.min()}..{target.max()}")
        if kind == "u":
            target = target.astype(np.intp)     # uint64 plus the intp offsets below would be float64
        picks = self._offsets(batch, classes) + target
        log_prob = pred - np.maximum.reduce(pred, axis=1, keepdims=True)
        log_norm = np.add.reduce(np.exp(log_prob), axis=1, keepdims=True)
        log_prob -= np.log(log_norm, out=log_norm)
        # The mean of the picked log-probabilities as ``np.mean(picked, dtype=float32)`` computes it: the
        # float32 sum divided by the count in float64, then cast back (negating is exact either way).
        loss = DTYPE(-(float(np.add.reduce(log_prob.reshape(-1).take(picks), axis=None, dtype=DTYPE)) / batch))
        dpred = np.exp(log_prob, order="C")     # C order: its flat view below is itself, not a copy
        dpred.reshape(-1)[picks] -= DTYPE(1)
        dpred /= DTYPE(batch)                   # dpred is this call's own array
        return loss, dpred

    def _offsets(self, batch: int, classes: int) -> np.ndarray:
        """Each row's first flat index, ``row * classes`` (kept between calls of the same shape)."""
        offsets = self.__dict__.get("_row_offsets")
        if offsets is None or offsets.shape != (batch,) or self.__dict__.get("_classes") != classes:
            offsets = self._row_offsets = np.arange(0, batch * classes, classes)
            self._classes = classes
        return offsets

    def correct(self, pred: np.ndarray, target: np.ndarray) -> int | None:
        return int((pred.argmax(axis=1) == target).sum())

    def predict(self, pred: np.ndarray) -> np.ndarray:
        """The class ids (int64, ``(rows,)``): the largest logit's index, the lower one on a tie."""
        return pred.argmax(axis=1).astype(np.int64)

    def scores(self, pred: np.ndarray) -> np.ndarray:
        """Each class's probability (float32, ``(rows, classes)``): the softmax of the logits."""
        return softmax(pred)


_LOSSES: dict[str, type[Loss]] = {
    "sum_squared_error": SumSquaredError,
    "mean_squared_error": MeanSquaredError,
    "softmax_cross_entropy": SoftmaxCrossEntropy,
}


class TorchLoss(Loss):
    """A ``torch.nn`` loss class that a module stage names, e.g. ``{ type = "CrossEntropyLoss" }``.

    Torch computes it (``distgrad.stage.torch_stage``); this object tells the rest
    of distgrad what it needs to know: the targets' dtype and shape (int64
    class ids ``(batch,)`` for ``CLASS_ID`` losses, float32 like the
    prediction otherwise), the ``reduction`` ("mean" or "sum": how micro-batch
    gradients combine) and, for class-id losses, how many predictions are
    right. ``options`` are the class's keyword arguments.
    """

    CLASS_ID = ("CrossEntropyLoss", "NLLLoss")
    ELEMENTWISE = ("MSELoss", "L1Loss", "SmoothL1Loss", "HuberLoss", "BCELoss", "BCEWithLogitsLoss")

    def __init__(self, type_name: str, options: Mapping[str, Any]) -> None:
        if type_name not in self.CLASS_ID + self.ELEMENTWISE:
            raise ConfigError(f"unknown loss {type_name!r}: a torch module stage takes a torch.nn loss class, one "
                              f"of {sorted(self.CLASS_ID + self.ELEMENTWISE)}, or a distgrad loss, one of "
                              f"{sorted(_LOSSES)}")
        self.type, self.options = type_name, dict(options)
        self.reduction = self.options.get("reduction", "mean")
        if self.reduction not in ("mean", "sum"):
            raise ConfigError(f"loss {type_name}: 'reduction' must be \"mean\" or \"sum\" (distgrad combines "
                              f"micro-batches by it), got {self.reduction!r}")
        self.classifies = type_name in self.CLASS_ID
        self.target_dtype = np.dtype(np.int64) if self.classifies else np.dtype(DTYPE)

    def target_shape(self, pred_shape: Shape) -> Shape:
        if not self.classifies:
            return pred_shape
        if len(pred_shape) < 2:
            raise ConfigError(f"{self.type} takes (batch, classes, ...) scores, got {pred_shape}")
        return (pred_shape[0], *pred_shape[2:])

    def forward_backward(self, pred: np.ndarray, target: np.ndarray) -> tuple[np.float32, np.ndarray]:
        raise ConfigError(f"loss {self.type} is a torch.nn loss, computed by torch: give its stage a module or "
                          f"framework = \"torch\", or use a distgrad loss ({sorted(_LOSSES)})")

    def correct(self, pred: np.ndarray, target: np.ndarray) -> int | None:
        return int((pred.argmax(axis=1) == target).sum()) if self.classifies else None

    def predict(self, pred: np.ndarray) -> np.ndarray:
        """Class ids (int64, the largest score's index) for a class-id loss; else the output itself."""
        return pred.argmax(axis=1).astype(np.int64) if self.classifies else pred

    def scores(self, pred: np.ndarray) -> np.ndarray:
        """Probabilities where the loss defines them, float32 of ``pred``'s shape: the softmax over the
        classes (axis 1) for ``CrossEntropyLoss``, ``exp`` of the log-probabilities ``NLLLoss`` takes, the
        sigmoid of ``BCEWithLogitsLoss``'s logits; else (``BCELoss``, whose outputs are probabilities, and
        the regression losses) the raw output."""
        if self.type == "CrossEntropyLoss":
            return softmax(pred)
        if self.type == "NLLLoss":
            return np.exp(np.asarray(pred, DTYPE))
        if self.type == "BCEWithLogitsLoss":
            return sigmoid(pred)
        return super().scores(pred)


def build_loss(spec: Any) -> Loss:
    """Build a loss from its experiment name (or a table with ``type``)."""
    if isinstance(spec, Mapping):
        if set(spec) - {"type"}:
            raise ConfigError(f"unknown loss keys {sorted(set(spec) - {'type'})}: a loss table has only 'type'")
        spec = spec.get("type")
    name = spec if isinstance(spec, str) else repr(spec)
    if name not in _LOSSES:
        raise ConfigError(f"unknown loss {name!r}: use one of {sorted(_LOSSES)}")
    return _LOSSES[name]()


def build_module_loss(spec: Any) -> Loss:
    """The loss of a torch module stage: a distgrad loss (its name, or a table with only ``type``), or a
    ``torch.nn`` loss class with its keyword arguments (``TorchLoss``), e.g. ``{ type = "MSELoss",
    reduction = "sum" }``. Raises ``ConfigError`` for an unknown name or a reduction other than mean/sum."""
    name = spec.get("type") if isinstance(spec, Mapping) else spec
    if isinstance(name, str) and name in _LOSSES:
        return build_loss(spec)
    if not isinstance(name, str):
        raise ConfigError(f"a loss needs a 'type' (a torch.nn loss class or one of {sorted(_LOSSES)}), got {spec!r}")
    return TorchLoss(name, {k: v for k, v in spec.items() if k != "type"} if isinstance(spec, Mapping) else {})
