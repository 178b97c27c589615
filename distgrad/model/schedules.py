"""Learning-rate schedules: the float32 learning rate of update ``t`` (``t = 1, 2, ...``).

Pure math for ``optim.py``: a schedule maps the 1-based count of an
optimiser's updates to a float32 rate, always by the same float32 operations
in the same order, so every process computes the same bits (the power and
cosine are numpy's and the platform's, as ``tanh`` is in ``nn.py``: equal
on machines with the same numpy build and CPU features). Hyperparameters
are cast to float32 once, at construction, and validated there (a bad value
is a ``ConfigError`` naming it). Sorted by increasing complexity. The decays
are TensorFlow 1's ``tf.train.exponential_decay`` and ``cosine_decay`` with
``global_step = t - 1``, the count of updates before this one, so update 1
uses the initial rate; piecewise boundaries count updates (TF's
``piecewise_constant`` compares the global step, one update later).

Step counts go through float32 (``float32(t - 1)``), exact for counts below
``2**24`` (16.7 million updates); past that they round like any float32.
"""

from __future__ import annotations

import abc
import bisect
import math
from typing import Any, Mapping, Sequence

import numpy as np

from distgrad.errors import ConfigError

F32 = np.float32
PI = F32(math.pi)
ONE, HALF = F32(1), F32(0.5)


def check_rate(what: str, value: float) -> np.float32:
    """``value`` as the float32 rate it is used as; ``ConfigError`` naming ``what`` unless it is positive
    and finite there (1e-50 is 0 and 1e40 is inf in float32)."""
    with np.errstate(over="ignore"):
        rate = F32(value)
    if not (value > 0 and np.isfinite(value) and 0 < rate < np.inf):
        raise ConfigError(f"Invalid {what}: {value}")
    return rate


class Schedule(abc.ABC):
    """The learning rate of each update, as a float32."""

    @abc.abstractmethod
    def __call__(self, t: int) -> np.float32:
        """The rate of update ``t`` (1-based: the first update is ``t = 1``)."""


class Constant(Schedule):
    """``lr`` for every update: the float32 value itself, with no arithmetic."""

    def __init__(self, lr: float) -> None:
        self.lr = check_rate("learning rate", lr)

    def __call__(self, t: int) -> np.float32:
        return self.lr


class ExponentialDecay(Schedule):
    """``lr * decay_rate ** p`` with ``p = (t - 1) / decay_steps``, ``floor(p)`` if ``staircase``.

    In float32, in this order: ``p = float32(t - 1) / float32(decay_steps)``;
    ``p = floor(p)`` (staircase only; exact: the floor of a correctly rounded
    quotient of two integers below ``2**24`` is the integer quotient);
    ``r = power(decay_rate, p)`` (the platform's ``powf``, through numpy's
    float32 scalar power); ``lr * r``. With staircase, updates
    ``1 .. decay_steps`` use ``lr``, the next ``decay_steps`` use
    ``lr * decay_rate``, and so on.
    """

    def __init__(self, lr: float, decay_rate: float, decay_steps: int, staircase: bool = False) -> None:
        self.lr = check_rate("learning rate", lr)
        self.decay_rate = check_rate("decay_rate", decay_rate)
        if self.decay_rate > ONE:
            raise ConfigError(f"Invalid decay_rate: {decay_rate} (must be in (0, 1]: a decay)")
        self.decay_steps = F32(_check_steps("decay_steps", decay_steps, minimum=1))
        self.staircase = bool(staircase)

    def __call__(self, t: int) -> np.float32:
        p = F32(t - 1) / self.decay_steps
        if self.staircase:
            p = np.floor(p)
        return self.lr * self.decay_rate ** p


class PiecewiseConstant(Schedule):
    """``values[i]`` for the updates ``boundaries[i-1] < t <= boundaries[i]``: no arithmetic.

    ``boundaries[i]`` is the last update that uses ``values[i]``; after the
    last boundary, ``values[-1]``. Boundaries are strictly increasing update
    counts >= 1, and there is one more value than boundaries.
    """

    def __init__(self, boundaries: Sequence[int], values: Sequence[float]) -> None:
        self.boundaries = [_check_steps(f"boundaries[{i}]", b, minimum=1) for i, b in enumerate(boundaries)]
        for i in range(1, len(self.boundaries)):
            if self.boundaries[i] <= self.boundaries[i - 1]:
                raise ConfigError(f"Invalid boundaries: {list(boundaries)} (must be strictly increasing; "
                                  f"boundaries[{i}] = {self.boundaries[i]} <= {self.boundaries[i - 1]})")
        if len(values) != len(self.boundaries) + 1:
            raise ConfigError(f"Invalid values: {list(values)} has {len(values)} entries; {len(self.boundaries)} "
                              f"boundaries need {len(self.boundaries) + 1} (one rate before each boundary "
                              f"and one after the last)")
        self.values = [check_rate(f"values[{i}]", v) for i, v in enumerate(values)]

    def __call__(self, t: int) -> np.float32:
        return self.values[bisect.bisect_left(self.boundaries, t)]


class CosineDecay(Schedule):
    """``lr * ((1 - alpha) * 0.5 * (1 + cos(pi * c)) + alpha)`` with ``c = min(t - 1, decay_steps) / decay_steps``.

    In float32, in this order: ``c = float32(min(t - 1, decay_steps)) /
    float32(decay_steps)``; ``x = float32(pi) * c``; ``k = cos(x)`` (numpy's
    float32 cosine); ``k = 0.5 * (1 + k)``; ``d = (1 - alpha) * k``, the
    constant ``1 - alpha`` being ``float32(1) - float32(alpha)``; ``d = d +
    alpha``; ``lr * d``. Update 1 uses ``lr``; from update ``decay_steps + 1``
    on, ``lr * alpha`` (0 with the default ``alpha = 0``).
    """

    def __init__(self, lr: float, decay_steps: int, alpha: float = 0.0) -> None:
        self.lr = check_rate("learning rate", lr)
        self.steps = _check_steps("decay_steps", decay_steps, minimum=1)
        self.decay_steps = F32(self.steps)
        if not (0 <= alpha <= 1):
            raise ConfigError(f"Invalid alpha: {alpha} (must be in [0, 1]: the final fraction of lr)")
        self.alpha = F32(alpha)
        self.one_minus_alpha = ONE - self.alpha

    def __call__(self, t: int) -> np.float32:
        c = F32(min(t - 1, self.steps)) / self.decay_steps
        k = HALF * (ONE + np.cos(PI * c))
        return self.lr * (self.one_minus_alpha * k + self.alpha)


class Warmup(Schedule):
    """A linear warm-up over the first ``warmup_steps`` updates, then ``after`` from its own update 1.

    For ``t <= warmup_steps``: ``after(1) * (float32(t) / float32(warmup_steps))``
    (the quotient first, then the product), rising to ``after(1)`` at
    ``t = warmup_steps``; for later updates ``after(t - warmup_steps)``, so a
    decay's ``decay_steps`` and ``boundaries`` count the updates after the
    warm-up.
    """

    def __init__(self, after: Schedule, warmup_steps: int) -> None:
        self.after = after
        self.steps = _check_steps("warmup_steps", warmup_steps, minimum=1)
        self.warmup_steps = F32(self.steps)
        self.target = after(1)

    def __call__(self, t: int) -> np.float32:
        if t <= self.steps:
            return self.target * (F32(t) / self.warmup_steps)
        return self.after(t - self.steps)


def _check_steps(name: str, value: Any, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value < minimum:
        raise ConfigError(f"Invalid {name}: {value!r} (must be a whole number of updates >= {minimum})")
    return int(value)


# What each schedule type takes besides the optimizer's lr (and warmup_steps, which every type takes).
SCHEDULE_OPTIONS: dict[str, tuple[str, ...]] = {
    "constant": (),
    "exponential": ("decay_rate", "decay_steps", "staircase"),
    "piecewise": ("boundaries", "values"),
    "cosine": ("decay_steps", "alpha"),
}
_REQUIRED = {"exponential": ("decay_rate", "decay_steps"), "piecewise": ("boundaries", "values"),
             "cosine": ("decay_steps",)}


def _number(kind: str, key: str, value: Any) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"invalid option {key!r} for schedule {kind!r}: {value!r} is not a number")
    return float(value)


def build_schedule(spec: Mapping[str, Any] | None, lr: float) -> Schedule:
    """The schedule of an optimizer table's ``schedule`` table (None: constant), around the table's ``lr``.

    ``spec`` is ``{type = "constant" | "exponential" | "piecewise" | "cosine", ...,
    warmup_steps = N}``; see ``optim.build_optimizer`` for the keys. Raises
    ``ConfigError`` naming the bad key or value: an unknown type (listing the
    valid ones) or key, a missing key, a wrong type, a non-positive or
    non-whole step count, non-increasing boundaries, a count of values that
    is not one more than the boundaries, a rate that is not positive in
    float32. For ``piecewise`` the rates are ``values`` and ``lr`` is unused
    (``build_optimizer`` refuses a table that gives both).
    """
    if spec is None:
        return Constant(lr)
    if not isinstance(spec, Mapping):
        raise ConfigError(f"'schedule' must be a table such as {{ type = \"cosine\", decay_steps = 1000 }}, "
                          f"got {spec!r}")
    spec = dict(spec)
    kind = spec.pop("type", None)
    if not isinstance(kind, str) or kind not in SCHEDULE_OPTIONS:
        raise ConfigError(f"unknown schedule type {kind!r}: use {', '.join(SCHEDULE_OPTIONS)}")
    valid = (*SCHEDULE_OPTIONS[kind], "warmup_steps")
    unknown = sorted(set(spec) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for schedule {kind!r}; valid options: "
                          f"{', '.join(['type', *valid])}")
    missing = [key for key in _REQUIRED.get(kind, ()) if key not in spec]
    if missing:
        raise ConfigError(f"schedule {kind!r} needs {', '.join(repr(k) for k in missing)}")
    warmup = _check_steps("warmup_steps", spec.pop("warmup_steps", 0), minimum=0)
    schedule: Schedule
    if kind == "constant":
        schedule = Constant(lr)
    elif kind == "exponential":
        staircase = spec.get("staircase", False)
        if not isinstance(staircase, bool):
            raise ConfigError(f"invalid option 'staircase' for schedule 'exponential': {staircase!r} "
                              f"is not true or false")
        schedule = ExponentialDecay(lr, _number(kind, "decay_rate", spec["decay_rate"]), spec["decay_steps"],
                                    staircase)
    elif kind == "piecewise":
        for key in ("boundaries", "values"):
            if not isinstance(spec[key], list):
                raise ConfigError(f"invalid option {key!r} for schedule 'piecewise': {spec[key]!r} is not a list")
        for i, v in enumerate(spec["values"]):
            _number(kind, f"values[{i}]", v)
        schedule = PiecewiseConstant(spec["boundaries"], spec["values"])
    else:
        schedule = CosineDecay(lr, spec["decay_steps"], _number(kind, "alpha", spec.get("alpha", 0.0)))
    return Warmup(schedule, warmup) if warmup else schedule


def optimizer_schedule(optimizer: str, spec: Any, lr: Any, default_lr: float) -> Schedule:
    """The schedule of optimizer table ``optimizer``'s ``schedule`` table ``spec``, around the table's ``lr``
    (None: the optimizer's ``default_lr``). A piecewise schedule gives its rates in ``values``, so a table
    that also gives ``lr`` is a ``ConfigError``; otherwise as ``build_schedule``."""
    if isinstance(spec, Mapping) and spec.get("type") == "piecewise" and lr is not None:
        raise ConfigError(f"optimizer {optimizer!r}: a piecewise schedule gives its rates in 'values'; "
                          f"remove 'lr' ({lr!r})")
    return build_schedule(spec, default_lr if lr is None else lr)


PLATEAU = "ReduceLROnPlateau"       # the one metric-driven scheduler: a numpy stage's takes torch's options
PLATEAU_OPTIONS = ("mode", "factor", "patience", "threshold", "threshold_mode", "cooldown", "min_lr", "eps")


class Plateau(Schedule):
    """``torch.optim.lr_scheduler.ReduceLROnPlateau``'s rule for a numpy stage: every update uses the current
    rate (float32 of a float64 ``rate``), which ``report(metric)``, after each evaluation, multiplies by
    ``factor`` (not below ``min_lr``; a change of at most ``eps`` is skipped) once ``patience`` reports in a
    row have not improved on the best (``mode`` "min": lower than ``best * (1 - threshold)``, or with
    ``threshold_mode`` "abs" ``best - threshold``; "max" the reverse), then waits ``cooldown`` reports."""

    DEFAULT_PATIENCE = 10       # torch's: the reports in a row without improvement before a reduction

    def __init__(self, lr: float, mode: str = "min", factor: float = 0.1, patience: int = DEFAULT_PATIENCE,
                 threshold: float = 1e-4, threshold_mode: str = "rel", cooldown: int = 0, min_lr: float = 0.0,
                 eps: float = 1e-8) -> None:
        if mode not in ("min", "max") or threshold_mode not in ("rel", "abs"):
            raise ConfigError(f"{PLATEAU}: mode is \"min\" or \"max\" and threshold_mode \"rel\" or \"abs\", got "
                              f"{mode!r} and {threshold_mode!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < 1:
            raise ConfigError(f"{PLATEAU}: factor must be a number in (0, 1), got {factor!r}")
        for name, value in (("patience", patience), ("cooldown", cooldown)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{PLATEAU}: {name} must be a non-negative integer, got {value!r}")
        for name, number in (("threshold", threshold), ("min_lr", min_lr), ("eps", eps)):
            if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < np.inf:
                raise ConfigError(f"{PLATEAU}: {name} must be a non-negative number, got {number!r}")
        self.rate = float(check_rate("learning rate", lr))
        self.mode, self.factor, self.patience, self.threshold = mode, float(factor), patience, float(threshold)
        self.threshold_mode, self.cooldown, self.min_lr, self.eps = threshold_mode, cooldown, float(min_lr), float(eps)
        self.best, self.bad, self.cooling = (np.inf if mode == "min" else -np.inf), 0, 0

    def __call__(self, t: int) -> np.float32:
        return F32(self.rate)

    def _better(self, value: float) -> bool:
        if self.mode == "min":
            bound = self.best * (1 - self.threshold) if self.threshold_mode == "rel" else self.best - self.threshold
            return value < bound
        bound = self.best * (1 + self.threshold) if self.threshold_mode == "rel" else self.best + self.threshold
        return value > bound

    def report(self, metric: float) -> None:
        """One evaluation's ``metric`` (its loss): the rate may drop, as torch's ``step(metric)`` does."""
        value = float(metric)
        if self._better(value):
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        if self.cooling > 0:
            self.cooling -= 1
            self.bad = 0
        if self.bad > self.patience:
            lowered = max(self.rate * self.factor, self.min_lr)
            if self.rate - lowered > self.eps:
                self.rate = lowered
            self.cooling, self.bad = self.cooldown, 0

    def state(self) -> np.ndarray:
        """What a checkpoint keeps: ``[rate, best, bad, cooling]`` as float64."""
        return np.array([self.rate, self.best, self.bad, self.cooling], np.float64)

    def load_state(self, saved: np.ndarray) -> None:
        """Restore ``state``; ``ValueError`` for anything else."""
        values = np.asarray(saved, np.float64)
        if values.shape != (4,) or not np.isfinite(values[0]) or values[0] <= 0:
            raise ValueError(f"{PLATEAU}: the saved state is not [rate, best, bad, cooling]: {values!r:.80}")
        self.rate, self.best, self.bad, self.cooling = float(values[0]), float(values[1]), int(values[2]), int(values[3])
