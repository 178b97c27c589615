"""Optimisers, in order of increasing complexity: SGD, then Adam.

Both update parameters in place, in float32, from ``grads`` keyed like
``params``. Update ``t`` (the 1-based count of this optimiser's updates)
uses the learning rate ``schedule(t)`` (``schedules.py``; a plain ``lr`` is a
constant schedule, its float32 value used as it is). ``state_dict`` /
``load_state_dict`` carry everything the next step depends on, the update
count included (for checkpoints); optimiser state never crosses the wire.
"""

from __future__ import annotations

import abc
import inspect
from typing import Any, Mapping

import numpy as np

from distgrad.errors import ConfigError
from distgrad.model.schedules import Constant, Schedule, check_rate, optimizer_schedule

F32 = np.float32


def _f32(value: float) -> np.float32:
    with np.errstate(over="ignore"):
        return F32(value)


class Optimizer(abc.ABC):
    """``schedule`` gives the learning rate of each update; ``updates`` counts the updates applied so far."""

    def __init__(self, lr: float | Schedule) -> None:
        # A number is checked as the float32 actually used: 1e-50 is 0 and 1e40 is inf there.
        self.schedule: Schedule = lr if isinstance(lr, Schedule) else Constant(lr)
        self.updates = 0

    @property
    def lr(self) -> np.float32:
        """The learning rate the next update uses: ``schedule(updates + 1)``."""
        return self.schedule(self.updates + 1)

    def _next_lr(self) -> np.float32:
        """Count one more update and return its learning rate."""
        self.updates += 1
        return self.schedule(self.updates)

    def _load_updates(self, state: Mapping[str, Any]) -> None:
        value = np.asarray(state["updates"])
        if not (value.shape == () and value.dtype.kind in "iuf" and np.isfinite(value) and value >= 0
                and value == np.floor(value)):
            raise ValueError(f"invalid optimizer update count {state['updates']!r} (must be a whole number >= 0)")
        self.updates = int(value)

    @abc.abstractmethod
    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        """Apply one update to every parameter that has a gradient."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything the next step depends on, as numpy arrays and numbers; ``updates`` is the update count."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned; ``KeyError`` for a missing entry (``updates`` included),
        ``ValueError`` for an update count that is not a whole number >= 0."""


class SGD(Optimizer):
    """``w -= g * lr_t`` (TensorFlow's ApplyGradientDescent), ``lr_t`` the schedule's rate of update t."""

    def __init__(self, lr: float | Schedule = 0.01) -> None:
        super().__init__(lr)

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        lr = self._next_lr()
        for name, g in grads.items():
            params[name] -= g * lr

    def state_dict(self) -> dict[str, Any]:
        return {"updates": np.array(self.updates, np.int64)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_updates(state)


class Adam(Optimizer):
    """Adam as TensorFlow 1's ApplyAdam kernel computes it, in float32.

    Per step, with the beta powers starting at ``beta1`` and ``beta2`` and
    ``lr_t`` the schedule's float32 rate of update t (``lr`` itself unless a
    schedule is given)::

        alpha = lr_t * sqrt(1 - beta2_power) / (1 - beta1_power)
        m += (g - m) * (1 - beta1)
        v += (g * g - v) * (1 - beta2)
        w -= (m * alpha) / (sqrt(v) + epsilon)
        beta1_power *= beta1; beta2_power *= beta2

    Every constant is cast to float32 before use, so ``1 - beta1`` is
    ``float32(1) - float32(0.9)``. The beta powers are shared by all the
    parameters of one optimiser, as in TF1's ``AdamOptimizer``.
    """

    def __init__(self, lr: float | Schedule = 0.001, beta1: float = 0.9, beta2: float = 0.999,
                 epsilon: float = 1e-8) -> None:
        super().__init__(lr)
        check_rate("epsilon", epsilon)
        for name, beta in (("beta1", beta1), ("beta2", beta2)):
            if not (0 <= beta < 1 and _f32(beta) < 1):  # 0.99999999 is 1 in float32
                raise ConfigError(f"Invalid {name}: {beta} (must be in [0, 1) as a float32)")
        self.beta1, self.beta2, self.epsilon = F32(beta1), F32(beta2), F32(epsilon)
        self.one = F32(1)
        self.beta1_power, self.beta2_power = self.beta1, self.beta2
        self.m: dict[str, np.ndarray] = {}
        self.v: dict[str, np.ndarray] = {}
        # Per parameter, looked up once a step: its m and v (those of the dicts above) and two scratch buffers.
        self._slots: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def step(self, params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray]) -> None:
        one, epsilon = self.one, self.epsilon
        alpha = self._next_lr() * np.sqrt(one - self.beta2_power) / (one - self.beta1_power)
        c1, c2 = one - self.beta1, one - self.beta2
        slots = self._slots
        for name, g in grads.items():
            w = params[name]
            slot = slots.get(name)
            if slot is None:
                slot = slots[name] = self._slot(name, w)
            m, v, t, u = slot
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
            u += epsilon
            t /= u
            w -= t
        self.beta1_power = self.beta1_power * self.beta1
        self.beta2_power = self.beta2_power * self.beta2

    def _slot(self, name: str, like: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Parameter ``name``'s m and v (zeros before its first update) and two scratch buffers of its shape."""
        m = self.m.get(name)
        if m is None:
            m = self.m[name] = np.zeros_like(like)
            self.v[name] = np.zeros_like(like)
        return m, self.v[name], np.empty_like(like), np.empty_like(like)

    def state_dict(self) -> dict[str, Any]:
        return {
            "updates": np.array(self.updates, np.int64),
            "beta1_power": np.array(self.beta1_power, F32),
            "beta2_power": np.array(self.beta2_power, F32),
            "m": {k: v.copy() for k, v in self.m.items()},
            "v": {k: v.copy() for k, v in self.v.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._load_updates(state)
        self.beta1_power = F32(state["beta1_power"])
        self.beta2_power = F32(state["beta2_power"])
        self.m = {k: np.array(v, F32) for k, v in state["m"].items()}
        self.v = {k: np.array(v, F32) for k, v in state["v"].items()}
        self._slots = {}


OPTIMIZERS: dict[str, type[Optimizer]] = {"adam": Adam, "sgd": SGD}    # the optimizer table's ``type``
# Each optimizer's name as torch.optim spells it, accepted beside the lower-case one: a PyTorch user writes
# { type = "Adam" } for a layer list as for a module.
TORCH_SPELLINGS: dict[str, str] = {"Adam": "adam", "SGD": "sgd"}


def optimizer_names() -> list[str]:
    """Every accepted ``type`` of an optimizer table: the lower-case names and torch.optim's spellings."""
    return [spelling for name in OPTIMIZERS for spelling in
            (name, *[torch for torch, ours in TORCH_SPELLINGS.items() if ours == name])]


def optimizer_kind(kind: Any) -> str:
    """The optimizer ``kind`` names (``"adam"`` for ``"adam"`` or ``"Adam"``); ``ConfigError`` listing
    every accepted name otherwise."""
    if isinstance(kind, str) and kind in OPTIMIZERS:
        return kind
    if isinstance(kind, str) and kind in TORCH_SPELLINGS:
        return TORCH_SPELLINGS[kind]
    raise ConfigError(f"unknown optimizer {kind!r}: use one of {', '.join(optimizer_names())}")


def _option_names(cls: type[Optimizer]) -> list[str]:
    return [name for name in inspect.signature(cls.__init__).parameters if name != "self"]


def build_optimizer(spec: Mapping[str, Any]) -> Optimizer:
    """Build an optimiser from an experiment table such as ``{type = "adam", lr = 0.1}``.

    Keys: ``type`` (``"adam"``, the default, or ``"sgd"``; torch.optim's ``"Adam"`` and ``"SGD"`` too), the class's
    hyperparameters (``lr``; for Adam also ``beta1``, ``beta2``,
    ``epsilon``), and optionally ``schedule``, a table that makes ``lr`` the
    start of a learning-rate schedule (``distgrad.model.schedules``; update t is
    the optimiser's t-th)::

        schedule = { type = "constant" }                                    # the default: lr throughout
        schedule = { type = "exponential", decay_rate = 0.5, decay_steps = 100, staircase = true }
        schedule = { type = "piecewise", boundaries = [100, 300], values = [0.01, 0.003, 0.001] }
        schedule = { type = "cosine", decay_steps = 800, alpha = 0.0 }

    ``exponential``: ``lr * decay_rate ** ((t-1) / decay_steps)``, the
    exponent floored with ``staircase`` (default false). ``piecewise``:
    ``values[i]`` up to and including update ``boundaries[i]``, then the next
    value; the rates are the ``values``, so the table has no ``lr``.
    ``cosine``: from ``lr`` at update 1 down to ``lr * alpha`` (default 0) at
    update ``decay_steps + 1`` and after. Any type also takes
    ``warmup_steps = W`` (default 0): updates ``1..W`` rise linearly to the
    schedule's first rate (``rate * t / W``), then the schedule runs from its
    own update 1, its step counts starting after the warm-up::

        optimizer = { type = "adam", lr = 0.003, schedule = { type = "cosine", decay_steps = 800, warmup_steps = 50 } }

    (A TOML inline table must fit on one line; a longer one can be written as
    a ``[stages.optimizer]`` table under its ``[[stages]]``.) Each rate is a
    float32 computed by the float32 operations, in the order, that its class
    in ``distgrad.model.schedules`` lists, and update t uses rate t (the count is
    ``state_dict()["updates"]``, so a resumed optimiser continues it). With
    ``{type = "constant"}`` or no schedule, every update uses ``float32(lr)``
    exactly as without schedules.

    Raises ``ConfigError`` for an unknown type or option (listing the valid
    ones), for a value that is not a real number (a string or a boolean), and
    for any bad schedule key, type or value (``schedules.optimizer_schedule``),
    each named in the message.
    """
    spec = dict(spec)
    kind = optimizer_kind(spec.pop("type", "adam"))
    classes = OPTIMIZERS
    valid = [*_option_names(classes[kind]), "schedule"]
    unknown = sorted(set(spec) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for optimizer {kind!r}; valid options: "
                          f"{', '.join(['type', *valid])}")
    schedule_spec = spec.pop("schedule", None)
    options: dict[str, Any] = {}            # numbers, and "lr" may be a schedule
    for k, v in spec.items():
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"invalid option {k!r} for optimizer {kind!r}: {v!r} is not a number")
        options[k] = float(v)
    if schedule_spec is not None:
        default_lr = inspect.signature(classes[kind].__init__).parameters["lr"].default
        options["lr"] = optimizer_schedule(kind, schedule_spec, spec.get("lr"), default_lr)
    return classes[kind](**options)
