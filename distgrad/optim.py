"""Optimisers, in order of increasing complexity: SGD, then Adam.

Both update parameters in place, in float32, from ``grads`` keyed like
``params``. ``state_dict`` / ``load_state_dict`` carry everything the next
step depends on (for checkpoints); optimiser state never crosses the wire.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, Mapping

import numpy as np

from .errors import ConfigError

F32 = np.float32


def _f32(value: float) -> np.float32:
    with np.errstate(over="ignore"):
        return F32(value)


def _check_positive(name: str, value: float) -> None:
    # Also checked as the float32 actually used: 1e-50 is 0 and 1e40 is inf there.
    if not (value > 0 and np.isfinite(value) and 0 < _f32(value) < np.inf):
        raise ConfigError(f"Invalid {name}: {value}")


class Optimizer(abc.ABC):
    @abc.abstractmethod
    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """Apply one update to every parameter that has a gradient."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything the next step depends on, as numpy arrays and numbers."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


class SGD(Optimizer):
    """``w -= g * lr`` (TensorFlow's ApplyGradientDescent)."""

    def __init__(self, lr: float = 0.01) -> None:
        _check_positive("learning rate", lr)
        self.lr = F32(lr)

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        for name, g in grads.items():
            params[name] -= g * self.lr

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        return None


class Adam(Optimizer):
    """Adam as TensorFlow 1's ApplyAdam kernel computes it, in float32.

    Per step, with the beta powers starting at ``beta1`` and ``beta2``::

        alpha = lr * sqrt(1 - beta2_power) / (1 - beta1_power)
        m += (g - m) * (1 - beta1)
        v += (g * g - v) * (1 - beta2)
        w -= (m * alpha) / (sqrt(v) + epsilon)
        beta1_power *= beta1; beta2_power *= beta2

    Every constant is cast to float32 before use, so ``1 - beta1`` is
    ``float32(1) - float32(0.9)``. The beta powers are shared by all the
    parameters of one optimiser, as in TF1's ``AdamOptimizer``.
    """

    def __init__(self, lr: float = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8) -> None:
        _check_positive("learning rate", lr)
        _check_positive("epsilon", epsilon)
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not (0 <= beta < 1 and _f32(beta) < 1):  # 0.99999999 is 1 in float32
                raise ConfigError(f"Invalid {name}: {beta} (must be in [0, 1) as a float32)")
        self.lr, self.beta1, self.beta2, self.epsilon = F32(lr), F32(beta1), F32(beta2), F32(epsilon)
        self.one = F32(1)
        self.beta1_power, self.beta2_power = self.beta1, self.beta2
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        self._buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        one = self.one
        alpha = self.lr * np.sqrt(one - self.beta2_power) / (one - self.beta1_power)
        c1, c2 = one - self.beta1, one - self.beta2
        for name, g in grads.items():
            w = params[name]
            m = self.m.get(name)
            if m is None:
                m = self.m[name] = np.zeros_like(w)
                self.v[name] = np.zeros_like(w)
            v = self.v[name]
            t, u = self._scratch(name, w)
            # The same float32 operations in the same order as the formulas above,
            # written into reused buffers so a step allocates nothing.
            np.subtract(g, m, out=t)
            t *= c1
            m += t
            np.multiply(g, g, out=t)
            t -= v
            t *= c2
            v += t
            np.multiply(m, alpha, out=t)
            np.sqrt(v, out=u)
            u += self.epsilon
            t /= u
            w -= t
        self.beta1_power = self.beta1_power * self.beta1
        self.beta2_power = self.beta2_power * self.beta2

    def _scratch(self, name: str, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        pair = self._buffers.get(name)
        if pair is None or pair[0].shape != like.shape:
            pair = self._buffers[name] = (np.empty_like(like), np.empty_like(like))
        return pair

    def state_dict(self) -> dict[str, Any]:
        return {
            "beta1_power": np.array(self.beta1_power, F32),
            "beta2_power": np.array(self.beta2_power, F32),
            "m": {k: v.copy() for k, v in self.m.items()},
            "v": {k: v.copy() for k, v in self.v.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.beta1_power = F32(state["beta1_power"])
        self.beta2_power = F32(state["beta2_power"])
        self.m = {k: np.array(v, F32) for k, v in state["m"].items()}
        self.v = {k: np.array(v, F32) for k, v in state["v"].items()}


def _option_names(cls: type[Optimizer]) -> list[str]:
    return [name for name in inspect.signature(cls.__init__).parameters if name != "self"]


def build_optimizer(spec: Mapping[str, Any]) -> Optimizer:
    """Build an optimiser from an experiment table such as ``{type = "adam", lr = 0.1}``.

    Raises ``ConfigError`` for an unknown type or option (listing the valid
    ones) and for a value that is not a real number (a string or a boolean).
    """
    spec = dict(spec)
    kind = spec.pop("type", "adam")
    classes: dict[str, type[Optimizer]] = {"adam": Adam, "sgd": SGD}
    if not isinstance(kind, str) or kind not in classes:
        raise ConfigError(f"unknown optimizer {kind!r}: use adam or sgd")
    valid = _option_names(classes[kind])
    unknown = sorted(set(spec) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for optimizer {kind!r}; valid options: "
                          f"{', '.join(['type', *valid])}")
    options = {}
    for k, v in spec.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"invalid option {k!r} for optimizer {kind!r}: {v!r} is not a number")
        options[k] = float(v)
    return classes[kind](**options)
