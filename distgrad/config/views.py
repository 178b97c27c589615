"""Sources over another source: a feature party's columns (``ColumnView``) and a label owner's labels under
label DP (``RandomizedLabels``: randomized once; ``ReleasedLabels``: released during training).

Each keeps the source's rows, order and held-out rows, so every party walks the same rows; what it does not
change it hands on to the source.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np

from distgrad.config.batches import DataSource, RowBatches
from distgrad.config.prepare import Preparation
from distgrad.errors import ConfigError
from distgrad.model.nn import Shape
from distgrad.privacy.defenses import randomized_response
from distgrad.privacy.releases import RunSecret


class SourceView(DataSource):
    """A source over ``source``: its rows, order, shards and held-out rows are the source's, as are its shapes
    and label kind (copied at construction) and every attribute a subclass does not define (``__getattr__``).
    A subclass defines what it changes: the features it shows, or the training targets."""

    def __init__(self, source: DataSource) -> None:
        self._source = source
        self.feature_shape, self.target_shape = source.feature_shape, source.target_shape
        self.target_dtype, self.has_labels, self.test_rows = source.target_dtype, source.has_labels, source.test_rows
        self.validation_count = source.validation_count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)      # rows, batches, epoch_order, test_targets, ...: the source's

    def features(self, step: int) -> np.ndarray:
        return self._source.features(step)

    def targets(self, step: int) -> np.ndarray:
        return self._source.targets(step)

    def true_targets(self, step: int) -> np.ndarray:
        return self._source.true_targets(step)

    def shard(self, index: int, count: int) -> None:
        self._source.shard(index, count)

    def check_readable(self) -> None:
        self._source.check_readable()


class ColumnView(SourceView):
    """A feature party's columns of another source's features (a vertical experiment's ``columns``).

    ``features``/``test_features`` keep only ``columns`` (indices into the
    last axis, in the order given); everything else (rows, order, targets,
    held-out rows) is the source's own, so every party walks the same rows.
    """

    feature_shape: Shape

    def __init__(self, source: DataSource, columns: list[int]) -> None:
        shape = source.feature_shape
        if shape is None:
            raise ConfigError("'columns' selects feature columns, but this data holds no features")
        width = shape[-1]
        if (not columns or len(set(columns)) != len(columns)
                or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < width for c in columns)):
            raise ConfigError(f"'columns' must list distinct feature columns from 0 to {width - 1}, got {columns!r}")
        super().__init__(source)
        self._columns = np.asarray(columns, np.intp)
        self.feature_shape = (*shape[:-1], len(columns))

    def features(self, step: int) -> np.ndarray:
        return np.ascontiguousarray(self._source.features(step)[..., self._columns])

    def features_at(self, rows: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(self._source.features_at(rows)[..., self._columns])  # type: ignore[attr-defined]

    def test_features(self) -> np.ndarray:
        return np.ascontiguousarray(self._source.test_features()[..., self._columns])  # type: ignore[attr-defined]

    def preparation(self) -> Preparation | None:
        """The source's statistics of this party's columns only (each party keeps its own)."""
        prep = self._source.preparation()  # type: ignore[attr-defined]
        if prep is not None and prep.columns:
            prep.columns = [prep.columns[c] for c in self._columns.tolist()]
        return prep

    def adopt(self, saved: Preparation, where: str) -> None:
        """Saved statistics of this party's columns: the source keeps its other columns' own."""
        full = self._source.preparation()  # type: ignore[attr-defined]
        if full is None or len(saved.columns) != len(self._columns):
            raise ConfigError(f"{where}: the saved data preparation does not fit this stage's columns")
        for c, column in zip(self._columns.tolist(), saved.columns):
            full.columns[c] = column
        self._source.adopt(full, where)  # type: ignore[attr-defined]


class RandomizedLabels(SourceView):
    """A label owner's rows with its training labels randomized once (``label_dp``): k-ary randomized response
    at ``epsilon`` (``privacy.defenses.randomized_response``), k the classes its labels hold (0 to the largest).

    Each row's randomized label is drawn once for every row from (the stage's run secret ``key``, ``stage``):
    never from the seed, which the other party may know. ``key`` is read when the labels are asked for, so they
    are the same in every epoch of a run, the same after a resume (the secret is kept in the checkpoint) and
    in every process that holds the run's secret, and another run's (another secret's) are drawn afresh. The
    held-out labels (``test_targets``) stay true. Everything else is the source's own.
    """

    def __init__(self, source: RowBatches, epsilon: float, key: RunSecret, stage: str) -> None:
        labels = source.all_targets()       # type: ignore[attr-defined]
        self.classes = int(labels.max()) + 1 if len(labels) else 0
        if self.classes < 2:
            raise ConfigError(f"'label_dp' randomizes class ids among at least 2 classes; the labels hold "
                              f"{self.classes}")
        super().__init__(source)
        self._labels, self.epsilon, self.key, self.stage = labels, epsilon, key, stage
        self._drawn: tuple[int, np.ndarray] | None = None        # (the secret, its randomized labels)

    @property
    def noisy(self) -> np.ndarray:
        """Every row's randomized label, by row number, drawn from the run secret's current value."""
        secret = self.key.value
        if self._drawn is None or self._drawn[0] != secret:
            rng = np.random.default_rng([secret, zlib.crc32(self.stage.encode()), zlib.crc32(b"label_dp")])
            self._drawn = secret, randomized_response(self._labels, self.classes, self.epsilon, rng)
        return self._drawn[1]

    def targets(self, step: int) -> np.ndarray:
        return self.noisy[self._source._rows(step)]  # type: ignore[attr-defined]

    def targets_at(self, rows: np.ndarray) -> np.ndarray:
        return self.noisy[rows]

    def true_targets(self, step: int) -> np.ndarray:
        return self._source.targets(step)


class ReleasedLabels(SourceView):
    """A label owner's rows whose training labels are released during training (``label_dp`` with ``stages``,
    RR-with-prior: ``privacy.labeldp.LabelRelease``, which the label owner's stage holds): its training targets
    are the rows' numbers (int64, ``(batch,)`` like class ids), which the stage turns into randomized labels
    when it first trains on each row. The held-out labels (``test_targets``) and ``true_targets`` stay true;
    everything else is the source's own."""

    def targets(self, step: int) -> np.ndarray:
        return np.asarray(self._source._rows(step), np.int64)  # type: ignore[attr-defined]

    def targets_at(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, np.int64)

    def true_targets(self, step: int) -> np.ndarray:
        return self._source.targets(step)
