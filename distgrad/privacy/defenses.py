"""Defenses on what crosses the cut: pure functions of what a party sends and a seeded generator.

A party applies its defenses after its own computation and before the wire codec
(``distgrad.wire.wirecodec.Senders``): the label owner to the activation-gradient rows
it sends up, a data owner to the activation rows it sends down. The sender computes
with its own exact values; only what crosses is defended. Every random draw of its row
defenses comes from ``defense_rng``: a pure function of (the run's noise secret, the stage,
the tensor stream, the step, the digest of the values defended), where the secret is fresh
for each run and kept in the stage's checkpoints (``privacy.releases.NoiseLedger``), so two
runs never share a draw, and a defended run is bitwise equal to ``--in-process`` given the
same secret, with micro-batches, with a codec, and through a restart from a checkpoint.

The settings are a stage's own (``Defenses``, parsed from its stage table by
``parse_defenses``), never the interface: the other party need not know them.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from distgrad.errors import ConfigError
from distgrad.privacy.labeldp import LabelDP, parse_label_dp
from distgrad.privacy.leaks import centred_distances
from distgrad.privacy.releases import NoiseLedger, digest

DTYPE = np.float32
TINY_VARIANCE = 1e-30      # a class's variance below this counts as this (a KL divergence stays finite)
DEFAULT_DELTA = 1e-5       # the delta of the clip_noise label-DP budget when the stage file gives none

ACTIVATION = "activation"   # the wire direction of a data owner's rows (distgrad.wire.wirecodec)

MARVELL_SPLITS = 64         # Marvell's search: how its KL bound is split between the two parts of the noise
MARVELL_GRID = 256          # and the grid of the negative class's variance along the class-mean difference


@dataclass(frozen=True)
class ClipNoise:
    """Each row scaled to norm at most ``max_norm`` (C), then N(0, (sigma*C)^2) noise added per element.
    ``delta``: the delta of the label-DP budget reported for it on the label owner. The target form gives
    ``epsilon`` instead of ``sigma`` (None until ``with_sigma`` sets the sigma chosen for the run's planned
    releases, ``privacy.budget.sigma_for_target``); the run then stops before a row would pass it."""

    max_norm: float
    sigma: float | None
    delta: float = DEFAULT_DELTA
    epsilon: float | None = None

    def with_sigma(self, sigma: float) -> "ClipNoise":
        """The same setting with its ``sigma`` chosen."""
        return replace(self, sigma=float(sigma))

    @property
    def noise(self) -> float:
        """``sigma``; raises ``ValueError`` for a target form whose sigma was not chosen yet."""
        if self.sigma is None:
            raise ValueError("clip_noise with a target epsilon: its sigma is chosen for the run's planned "
                             "releases before anything is sent (privacy.budget.sigma_for_target)")
        return self.sigma


@dataclass(frozen=True)
class Defenses:
    """One stage's defenses (all absent: nothing changes). ``clip_noise`` and ``max_norm`` act on the rows
    the stage sends; ``label_dp`` is randomized response on the label owner's training labels (``labeldp.LabelDP``);
    ``nopeek`` the weight of a data owner's distance-correlation term (``nopeek_gradient``); ``marvell`` the
    bound on the sum of KL divergences of the label owner's Marvell noise (``marvell_noise``)."""

    clip_noise: ClipNoise | None = None
    max_norm: bool = False
    label_dp: LabelDP | None = None
    nopeek: float | None = None
    marvell: float | None = None
    dp_sgd: float | None = None      # the label owner's own update as DP-SGD: its per-example clip bound

    def as_table(self) -> dict[str, Any]:
        """The stage-table keys that give these defenses (what ``parse_defenses`` reads back)."""
        table: dict[str, Any] = {}
        if self.clip_noise is not None:
            clip = self.clip_noise
            chosen = {"epsilon": clip.epsilon} if clip.epsilon is not None else {"sigma": clip.sigma}
            table["clip_noise"] = {"max_norm": clip.max_norm, **chosen,
                                   **({"delta": clip.delta} if clip.delta != DEFAULT_DELTA else {})}
        if self.max_norm:
            table["max_norm"] = True
        if self.label_dp is not None:
            table["label_dp"] = self.label_dp.as_table()
        if self.nopeek is not None:
            table["nopeek"] = {"weight": self.nopeek}
        if self.marvell is not None:
            table["marvell"] = {"bound": self.marvell}
        if self.dp_sgd is not None:
            table["dp_sgd"] = {"max_norm": self.dp_sgd}
        return table

    @property
    def withholds_loss(self) -> bool:
        """Whether the label owner's backward replies leave out the training loss: with ``dp_sgd`` and its
        ``clip_noise`` its guarantee is end to end (everything the data owner receives is a private release or
        computed from them), and the loss of a training micro-batch, a function of its true labels released
        without noise, would break it. The one place this is decided (``privacy.budget.END_TO_END_SCOPE``)."""
        return self.dp_sgd is not None and self.clip_noise is not None

    @property
    def on_rows(self) -> bool:
        """Whether anything is done to the rows the stage sends."""
        return self.clip_noise is not None or self.max_norm or self.marvell is not None

    def send(self, x: np.ndarray, rng: np.random.Generator, labels: Callable[[], np.ndarray]) -> np.ndarray:
        """What crosses for float32 rows ``x`` (the first axis is the rows): ``clip_noise``, then ``max_norm``,
        then ``marvell`` (which asks ``labels()`` for the rows' class ids)."""
        if self.clip_noise is not None:
            x = clip_noise(x, self.clip_noise.max_norm, self.clip_noise.noise, rng)
        if self.max_norm:
            x = max_norm_noise(x, rng)
        if self.marvell is not None:
            x = marvell_noise(x, labels(), self.marvell, rng)
        return x


@dataclass(frozen=True)
class SentRows:
    """A stage's row defenses bound to what it sends: the wire ``direction`` they act on (its activations or
    its activation gradients), the ``stage``'s name and its ``ledger`` (the run's noise secret and what was
    released, ``defense_rng``); ``labels(step)`` the class ids of a step's whole batch, as the stage trains on
    them (Marvell's; None without Marvell); ``rows(step, stream)`` the row numbers of the step's whole batch
    sent on ``stream`` when the stage walks its own rows (None: releases are not counted per row)."""

    defenses: Defenses
    direction: str
    stage: str
    ledger: NoiseLedger
    labels: Callable[[int], np.ndarray] | None = None
    rows: Callable[[int, str], np.ndarray] | None = None

    def apply(self, direction: str, x: np.ndarray, stream: str, step: int, micro_batch: int = 0,
              rows: np.ndarray | None = None) -> np.ndarray:
        """What crosses for ``x`` sent in ``direction`` on ``stream`` at ``step``: defended in the stage's
        direction, else ``x`` itself. ``x`` is micro-batch ``micro_batch`` of the step: the batch's rows
        ``[micro_batch * len(x), (micro_batch + 1) * len(x))``, or the row numbers ``rows`` when given (the
        data owner's choice, ``send_rows``). The release is recorded in the ledger first, which raises
        ``NoiseReuseError`` (other values for a step already released) or ``BudgetExhausted``."""
        if direction != self.direction:
            return x
        if rows is None and self.rows is not None:
            rows = np.asarray(self.rows(step, stream))[micro_batch * len(x):(micro_batch + 1) * len(x)]
        values = digest(x)
        self.ledger.release(step, stream, values, rows)
        return self.defenses.send(x, defense_rng(self.ledger.secret, self.stage, stream, step, values),
                                  lambda: self._labels(step, micro_batch, len(x)))

    def held_out(self, x: np.ndarray, purpose: str, step: int) -> np.ndarray:
        """What crosses for held-out or new rows' activations ``x`` sent by a data owner: an evaluation after
        step ``step - 1`` (``purpose`` ``"evaluation"``) or chunk ``step`` of a prediction (``"predict"``).
        The data owner's ``clip_noise`` acts on them as on its training rows, keyed by a stream of their own
        (never a training stream's draw) and the digest of ``x``, and the release is counted in the ledger
        (``NoiseLedger.release_held_out``). A label owner's defenses act on the gradients of training rows
        only: an evaluation sends none, so ``x`` is returned as it is."""
        if self.direction != ACTIVATION:
            return x
        values = digest(x)
        self.ledger.release_held_out(step, purpose, values, len(x))
        return self.defenses.send(x, defense_rng(self.ledger.secret, self.stage, f"{purpose}/{ACTIVATION}", step,
                                                 values), _no_labels)

    def _labels(self, step: int, micro_batch: int, rows: int) -> np.ndarray:
        if self.labels is None:
            raise ValueError("Marvell needs the rows' labels: bind the stage's labels to its SentRows")
        return np.asarray(self.labels(step))[micro_batch * rows:(micro_batch + 1) * rows]


def _no_labels() -> np.ndarray:
    raise ValueError("Marvell is the label owner's: held-out rows' activations carry no labels")


def defense_rng(secret: int, stage: str, stream: str, step: int, values: str = "") -> np.random.Generator:
    """The generator of a defense's draws for one tensor: a pure function of the run's noise ``secret``
    (``privacy.releases.fresh_secret``), the sending ``stage``, the tensor's ``stream`` (direction, peer,
    micro-batch), the ``step`` and the hex ``values`` digest of what the noise is added to (other values, other
    noise)."""
    words = [int(values[i:i + 8], 16) for i in range(0, len(values), 8)]
    return np.random.default_rng([secret, zlib.crc32(stage.encode()), zlib.crc32(stream.encode()), step, *words])


def row_norms(x: np.ndarray) -> np.ndarray:
    """The Euclidean norm of each row of ``x`` (every axis but the first), in float64."""
    return np.sqrt(np.sum(np.square(x.reshape(len(x), -1), dtype=np.float64), axis=1))


def clip_rows(x: np.ndarray, max_norm: float) -> np.ndarray:
    """``x`` with each row scaled down to norm at most ``max_norm`` (rows within it unchanged), float32."""
    norms = row_norms(x)
    factor = np.where(norms > max_norm, max_norm / np.where(norms > max_norm, norms, 1.0), 1.0)   # 0-rows: 1
    shape = (len(x),) + (1,) * (x.ndim - 1)
    return (x * factor.reshape(shape)).astype(DTYPE)


def clip_noise(x: np.ndarray, max_norm: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """``clip_rows(x, max_norm)`` plus N(0, (sigma * max_norm)^2) noise on every element, float32."""
    clipped = clip_rows(x, max_norm)
    if sigma == 0:
        return clipped
    return (clipped + rng.normal(0.0, sigma * max_norm, x.shape)).astype(DTYPE)


def dp_sgd_gradients(per_example: list[dict[str, np.ndarray]], max_norm: float, sigma: float, scale: float,
                     rng: np.random.Generator) -> dict[str, np.ndarray]:
    """DP-SGD (Abadi et al., 2016) of one batch: ``per_example[i]`` is example i's contribution to the
    batch loss's parameter gradients, ``scale`` times which is its own loss's gradient (the rows for a mean
    loss, 1 for a sum). Each example's own gradient (all parameters as one vector) is scaled to norm at most
    ``max_norm`` (C), they are summed, N(0, (sigma * C)^2) noise is added per element, and the sum divided by
    ``scale`` again: the batch gradient the update uses, float32. One example's label changes the sum by at
    most 2C: a Gaussian mechanism of noise multiplier sigma / 2, as ``clip_noise``'s rows."""
    if not per_example:
        raise ValueError("DP-SGD of an empty batch")
    names = list(per_example[0])
    total = {name: np.zeros(per_example[0][name].shape, np.float64) for name in names}
    for grads in per_example:
        norm = math.sqrt(sum(float(np.sum(np.square(grads[n].astype(np.float64) * scale))) for n in names))
        factor = scale * (min(1.0, max_norm / norm) if norm > 0 else 1.0)
        for name in names:
            total[name] += grads[name].astype(np.float64) * factor
    return {name: ((total[name] + rng.normal(0.0, sigma * max_norm, total[name].shape)) / scale).astype(DTYPE)
            for name in names}


def max_norm_noise(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Li et al.'s max-norm heuristic: each row j gets isotropic Gaussian noise of variance
    (max_k |x_k|^2 - |x_j|^2) / d per element (d: the row's elements), so that every row's expected squared
    norm is the batch's largest. No differential-privacy guarantee."""
    norms = row_norms(x)
    d = x[0].size if len(x) else 1
    std = np.sqrt(np.maximum(norms.max(initial=0.0) ** 2 - norms ** 2, 0.0) / d)
    noise = rng.standard_normal(x.shape) * std.reshape((len(x),) + (1,) * (x.ndim - 1))
    return (x + noise).astype(DTYPE)


def marvell_covariances(u: float, v: float, gap: float, dims: int, p: float,
                        bound: float) -> tuple[float, float, float, float]:
    """Marvell's noise (Li et al., ICLR 2022) for rows modelled per class as isotropic Gaussians: class 0 of
    per-element variance ``u``, class 1 of ``v``, their means ``gap`` apart, in ``dims`` dimensions, a
    fraction ``p`` of class 1. Returns (l0, m0, l1, m1): class c gets noise of variance ``lc`` along the
    difference of the class means and ``mc`` in every orthogonal direction, the least expected noise power
    ``p (l1 + (dims-1) m1) + (1-p) (l0 + (dims-1) m0)`` found such that the sum of the two KL divergences
    between the classes' perturbed distributions is at most ``bound``.

    The sum splits into a part along the mean difference (variances a0 = u + l0, a1 = v + l1):
    ``(a1/a0 + a0/a1 - 2 + gap^2 (1/a0 + 1/a1)) / 2``, and one across it: ``(dims-1) (r + 1/r - 2) / 2``
    with r the ratio of the two classes' orthogonal variances, which noise on the class of the smaller one
    brings towards 1. Every split of ``bound`` between the two parts (``MARVELL_SPLITS``) and every a0 of a
    grid (``MARVELL_GRID``) are tried, each with the least a1 and orthogonal noise that meet its share
    exactly (roots of quadratics), and the cheapest is kept: every candidate meets the bound."""
    u, v = max(u, TINY_VARIANCE), max(v, TINY_VARIANCE)
    gap2, others = gap * gap, max(dims - 1, 0)
    if marvell_sum_kl(u, v, u, v, gap, dims) <= bound:
        return 0.0, 0.0, 0.0, 0.0
    share = bound * np.arange(1, MARVELL_SPLITS + 1) / MARVELL_SPLITS           # the part along the difference
    # Across: the least noise on the smaller-variance class with (others/2)(r + 1/r - 2) <= bound - share.
    c = (bound - share) / max(others, 1)
    r = 1.0 + c - np.sqrt(c * c + 2.0 * c)
    across = np.maximum(r * max(u, v) - min(u, v), 0.0) if others else np.zeros_like(share)
    across_cost = (p if v < u else 1.0 - p) * others * across
    # Along: a0 on a grid; the least a1 >= v with a1^2 + a1 (gap^2 - 2 a0 (1 + share)) + a0^2 + gap^2 a0 <= 0.
    span = gap2 / share[:, None] + abs(u - v) + gap2
    a0 = u + span * np.linspace(0.0, 1.0, MARVELL_GRID)[None, :] ** 2
    b = 2.0 * a0 * (1.0 + share[:, None]) - gap2
    disc = b * b - 4.0 * (a0 * a0 + gap2 * a0)
    root = np.sqrt(np.maximum(disc, 0.0))
    a1 = np.maximum(v, (b - root) / 2.0)
    feasible = (disc >= 0) & ((b + root) / 2.0 >= a1) & (a0 > 0)
    cost = np.where(feasible, (1.0 - p) * (a0 - u) + p * (a1 - v) + across_cost[:, None], np.inf)
    i, j = np.unravel_index(int(np.argmin(cost)), cost.shape)
    m0, m1 = (0.0, float(across[i])) if v < u else (float(across[i]), 0.0)
    return float(a0[i, j] - u), m0, float(a1[i, j] - v), m1


def marvell_sum_kl(a0: float, a1: float, b0: float, b1: float, gap: float, dims: int) -> float:
    """KL(P1 || P0) + KL(P0 || P1) of two Gaussians in ``dims`` dimensions whose means are ``gap`` apart: class
    c of variance ``ac`` along the mean difference and ``bc`` in every direction across it."""
    return 0.5 * (a1 / a0 + a0 / a1 - 2.0 + gap * gap * (1.0 / a0 + 1.0 / a1)
                  + max(dims - 1, 0) * (b1 / b0 + b0 / b1 - 2.0))


def marvell_noise(x: np.ndarray, labels: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    """Li et al.'s Marvell on a label owner's gradient rows ``x`` of class ids ``labels`` (0 and 1): each row
    gets Gaussian noise whose covariance depends on its class (``marvell_covariances``, from the batch's class
    means and per-element variances), float32. Rows of a batch holding one class only are sent as they are
    (Marvell's noise is defined by the difference of the two classes). No differential-privacy guarantee."""
    labels = np.asarray(labels).reshape(-1)
    if len(labels) != len(x):
        raise ValueError(f"Marvell: {len(labels)} labels for {len(x)} rows")
    if not set(np.unique(labels).tolist()) <= {0, 1}:
        raise ValueError("Marvell is defined for two classes, labels 0 and 1")
    positive = labels == 1
    if positive.all() or not positive.any():
        return x
    flat = x.reshape(len(x), -1).astype(np.float64)
    mean1, mean0 = flat[positive].mean(axis=0), flat[~positive].mean(axis=0)
    diff = mean1 - mean0
    gap = float(np.linalg.norm(diff))
    u, v = float(flat[~positive].var(axis=0).mean()), float(flat[positive].var(axis=0).mean())
    l0, m0, l1, m1 = marvell_covariances(u, v, gap, flat.shape[1], float(positive.mean()), bound)
    along = np.where(positive, l1, l0)[:, None]
    across = np.where(positive, m1, m0)[:, None]
    unit = diff / gap if gap > 0 else np.zeros_like(diff)
    xi = rng.standard_normal(flat.shape)
    noise = np.sqrt(across) * xi + (np.sqrt(along) - np.sqrt(across)) * (xi @ unit)[:, None] * unit[None, :]
    return (flat + noise).reshape(x.shape).astype(DTYPE)


def distance_correlation_and_gradient(x: np.ndarray, z: np.ndarray) -> tuple[float, np.ndarray]:
    """The sample distance correlation dCor(x, z) of two sets of rows (Szekely et al., the V-statistic, as
    NoPeek uses it) and its gradient with respect to ``z`` (float32, shaped like ``z``); 0 and a zero
    gradient when either set has no spread."""
    n = len(x)
    _, a = centred_distances(x)
    b_raw, b = centred_distances(z)
    cov, var_x, var_z = (a * b).sum() / n ** 2, (a * a).sum() / n ** 2, (b * b).sum() / n ** 2
    if var_x <= 0 or var_z <= 0 or cov <= 0:
        return 0.0, np.zeros_like(z, dtype=DTYPE)
    squared = cov / math.sqrt(var_x * var_z)
    # d dCor^2 / d distances (A is fixed; <A, B> = <A, distances> and <B, B> = <distances, B> by centring)
    g = (a / math.sqrt(var_x * var_z) - cov * b / (math.sqrt(var_x) * var_z ** 1.5)) / n ** 2
    g /= 2.0 * math.sqrt(squared)                                  # d dCor = d dCor^2 / (2 dCor)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(b_raw > 0, 2.0 * g / b_raw, 0.0)
    flat = z.reshape(n, -1).astype(np.float64)
    grad = w.sum(axis=1)[:, None] * flat - w @ flat
    return math.sqrt(squared), grad.reshape(z.shape).astype(DTYPE)


def nopeek_gradient(x: np.ndarray, y: np.ndarray, dy: np.ndarray, weight: float) -> np.ndarray:
    """NoPeek (Vepakomma et al., 2020): the gradient of ``weight`` * dCor(x, y) added to the gradient ``dy``
    a data owner receives for its activations ``y`` of inputs ``x``, float32."""
    return (dy + DTYPE(weight) * distance_correlation_and_gradient(x, y)[1]).astype(DTYPE)


def randomized_response(labels: np.ndarray, classes: int, epsilon: float, rng: np.random.Generator) -> np.ndarray:
    """k-ary randomized response (epsilon-label-DP): each label kept with probability
    e^epsilon / (e^epsilon + k - 1), else replaced by one of the other k - 1 classes, uniformly."""
    labels = np.asarray(labels)
    keep = rng.random(labels.shape) < keep_probability(classes, epsilon)
    other = (labels + rng.integers(1, classes, labels.shape)) % classes
    return np.where(keep, labels, other).astype(labels.dtype)


def keep_probability(classes: int, epsilon: float) -> float:
    """The probability randomized response keeps a label of ``classes`` classes at ``epsilon``."""
    return 1.0 / (1.0 + (classes - 1) * math.exp(-epsilon))


def parse_defenses(table: Mapping[str, Any], stage: str) -> Defenses:
    """The defenses a stage table (``[stage]`` or ``[[stages]]``) sets. Raises ``ConfigError`` naming the key
    and the reason for a bad value."""
    clip = table.get("clip_noise")
    if clip is not None:
        clip = _clip_noise(clip, stage)
    max_norm = table.get("max_norm", False)
    if not isinstance(max_norm, bool):
        raise ConfigError(f"stage {stage!r}: 'max_norm' must be true or false, got {max_norm!r}")
    label_dp = table.get("label_dp")
    if label_dp is not None:
        label_dp = parse_label_dp(label_dp, stage)
    nopeek = _one_number_table(table, stage, "nopeek", "weight", "{ weight = w }")
    marvell = _one_number_table(table, stage, "marvell", "bound", "{ bound = P } (the bound on the sum of the KL "
                                "divergences between the two classes' rows)")
    dp_sgd = _one_number_table(table, stage, "dp_sgd", "max_norm", "{ max_norm = C } (the bound of each example's "
                               "parameter gradient; the noise is clip_noise's sigma)")
    return Defenses(clip, max_norm, label_dp, nopeek, marvell, dp_sgd)


def _one_number_table(table: Mapping[str, Any], stage: str, key: str, field: str, form: str) -> float | None:
    """The number > 0 of a defense written ``key = { field = number }`` in ``stage``'s table (None when
    absent); ``ConfigError`` naming the key and the form it must have otherwise."""
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {field}:
        raise ConfigError(f"stage {stage!r}: {key!r} must be {form}, got {value!r}")
    return _positive(value[field], f"stage {stage!r}: {key!r} {field}")


def _clip_noise(value: Any, stage: str) -> ClipNoise:
    where = f"stage {stage!r}: 'clip_noise'"
    keys = set(value) if isinstance(value, dict) else set()
    if (not isinstance(value, dict) or "max_norm" not in keys or len(keys & {"sigma", "epsilon"}) != 1
            or not keys <= {"max_norm", "sigma", "epsilon", "delta"}):
        raise ConfigError(f"{where} must be {{ max_norm = C, sigma = s }} or the target form {{ max_norm = C, "
                          f"epsilon = E }} (sigma chosen for the run's planned releases), each optionally with "
                          f"delta (of the label-DP budget), got {value!r}")
    delta = value.get("delta", DEFAULT_DELTA)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not 0 < delta < 1:
        raise ConfigError(f"{where} delta must be a number in (0, 1), got {delta!r}")
    max_norm = _positive(value["max_norm"], f"{where} max_norm")
    if "epsilon" in value:
        return ClipNoise(max_norm, None, float(delta), _positive(value["epsilon"], f"{where} epsilon"))
    sigma = value["sigma"]
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma < 0:
        raise ConfigError(f"{where} sigma must be a number >= 0 (the noise's standard deviation in units of "
                          f"max_norm), got {sigma!r}")
    return ClipNoise(max_norm, float(sigma), float(delta))


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where} must be a number > 0, got {value!r}")
    return float(value)
