"""Generated data sources: the seed's ramp and seeded synthetic regression and classification tables.

Every stage regenerates the same arrays from the seed, so nothing about them
crosses the wire.
"""

from __future__ import annotations

import numpy as np

from distgrad.config.batches import DataSource, RowBatches
from distgrad.errors import ConfigError
from distgrad.model.nn import DTYPE, Shape


class Ramp(DataSource):
    """The seed's data: ``x = float32(start + delta * i)`` with ``i = step - 1``, target ``x``.

    ``x`` is computed in double precision and then cast, as the seed feeds a
    Python float to a float32 placeholder. Unbatched: shape ``(size,)``.
    """

    feature_shape: Shape

    def __init__(self, start: float = 1.0, delta: float = -0.1, size: int = 1) -> None:
        self.start, self.delta = float(start), float(delta)
        self.feature_shape = self.target_shape = (int(size),)

    def features(self, step: int) -> np.ndarray:
        return np.full(self.feature_shape, self.start + self.delta * (step - 1), DTYPE)

    def targets(self, step: int) -> np.ndarray:
        return self.features(step)


class SyntheticRegression(RowBatches):
    """Seeded regression data from a fixed random teacher ``tanh(X @ A) @ B + noise``.

    ``samples`` rows of ``features`` inputs and ``outputs`` targets; batches of
    ``batch`` rows walk a per-epoch permutation drawn from the data seed.
    Every stage regenerates the same arrays from the seed, so nothing about
    them crosses the wire; the features stay with the first stage and the
    targets with the label owner.
    """

    def __init__(self, seed: int, samples: int = 1024, features: int = 4, outputs: int = 1,
                 hidden: int = 8, batch: int = 32, noise: float = 0.01) -> None:
        if batch < 1 or samples < batch:
            raise ConfigError(f"synthetic_regression needs 1 <= batch <= samples, got batch={batch}, samples={samples}")
        rng = np.random.default_rng([seed, 7])
        self.x = rng.normal(size=(samples, features)).astype(DTYPE)
        a = rng.normal(size=(features, hidden)) / np.sqrt(features)
        b = rng.normal(size=(hidden, outputs)) / np.sqrt(hidden)
        y = np.tanh(self.x.astype(np.float64) @ a) @ b + noise * rng.normal(size=(samples, outputs))
        self.y = y.astype(DTYPE)
        self.seed, self.batch = seed, batch
        self.train_rows = np.arange(samples)
        self.batches_per_epoch = samples // batch
        self.feature_shape, self.target_shape = (batch, features), (batch, outputs)
        self._epoch, self._order = -1, np.arange(0)

    @property
    def row_count(self) -> int:
        return len(self.x)

    def features_at(self, rows: np.ndarray) -> np.ndarray:
        return self.x[rows]

    def targets_at(self, rows: np.ndarray) -> np.ndarray:
        return self.y[rows]

    def all_targets(self) -> np.ndarray:
        """Every row's target, by row number."""
        return self.y


class SyntheticClassification(SyntheticRegression):
    """Seeded classification data: ``classes`` Gaussian blobs in ``features`` dimensions.

    Targets are int64 class ids ``(batch,)``; batching as in ``SyntheticRegression``.
    """

    target_dtype = np.dtype(np.int64)

    def __init__(self, seed: int, samples: int = 1024, features: int = 784, classes: int = 10,
                 batch: int = 32, spread: float = 1.0) -> None:
        if batch < 1 or samples < batch:
            raise ConfigError(f"synthetic_classification needs 1 <= batch <= samples, got batch={batch}, samples={samples}")
        if classes < 2:
            raise ConfigError(f"synthetic_classification needs at least 2 classes, got {classes}")
        rng = np.random.default_rng([seed, 13])
        centres = rng.normal(size=(classes, features))
        self.y = rng.integers(0, classes, size=samples).astype(np.int64)
        self.x = (centres[self.y] + spread * rng.normal(size=(samples, features))).astype(DTYPE)
        self.seed, self.batch = seed, batch
        self.train_rows = np.arange(samples)
        self.batches_per_epoch = samples // batch
        self.feature_shape, self.target_shape = (batch, features), (batch,)
        self._epoch, self._order = -1, np.arange(0)
