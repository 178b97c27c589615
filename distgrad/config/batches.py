"""Data sources' contract and the walk of numbered rows: which rows are held out, and which rows each step takes.

A source answers, for a 1-based step number, the features (the first stage's
input) and the targets (the label owner's part). Batches are a pure function
of the step, so the data position is just the step counter: a stage that
resumes at step ``k`` sees exactly the batch it would have seen.

``held_out_split`` splits a file's rows into held-out (validation, test) and
training rows once, by the split seed; ``RowBatches`` walks the training rows
in batches, in a per-epoch order drawn from the seed and the epoch alone, and
shares them out between data owners (``shard``).
"""

from __future__ import annotations

import abc

import numpy as np

from distgrad.errors import ConfigError
from distgrad.model.nn import DTYPE, Shape


class DataSource(abc.ABC):
    feature_shape: Shape | None                # None: this party's data holds no features
    target_shape: Shape
    has_labels: bool = True                   # False: this party's data holds no labels
    target_dtype: np.dtype = np.dtype(DTYPE)
    test_rows: np.ndarray = np.arange(0)      # held-out rows for evaluation; none unless the source has them
    # With a validation split: the first ``validation_count`` of ``test_rows`` are validation rows (what the
    # evaluations during training score and keep_best / early_stopping judge); the rest are the test rows,
    # whose figures are reported only for the kept model. 0: every held-out row is a test row.
    validation_count: int = 0

    @abc.abstractmethod
    def features(self, step: int) -> np.ndarray:
        """float32 array of ``feature_shape`` for 1-based ``step``."""

    def shard(self, index: int, count: int) -> None:
        """Keep only data owner ``index``'s share of ``count``: every ``count``-th training row.

        Held-out rows stay shared, so every owner is scored on the same rows.
        Raises ``ConfigError`` for a source without rows to share out.
        """
        raise ConfigError(f"{type(self).__name__} data cannot be split between {count} data owners")

    @abc.abstractmethod
    def targets(self, step: int) -> np.ndarray:
        """Array of ``target_shape`` and ``target_dtype`` for 1-based ``step``."""

    def check_readable(self) -> None:
        """Read every part of the data this source holds, raising ``ConfigError`` for a bad one, so that a
        run's preflight finds it before any stage starts. Generated data has nothing to read."""

    def true_targets(self, step: int) -> np.ndarray:
        """The label owner's own labels of ``step`` as they are, before any defense changes what it trains on
        (``label_dp``): what the privacy meter measures a leak of."""
        return self.targets(step)


def held_out_split(rows: int, seed: int, test_fraction: float, validation_fraction: float = 0.0
                   ) -> tuple[np.ndarray, np.ndarray, int]:
    """How a file's ``rows`` (numbered from 0) are split by ``seed`` (its ``split_seed``): ``(held-out rows,
    training rows, validation count)``. The rows are shuffled once; the first ``round(rows * test_fraction)``
    are the test rows, the next ``round(rows * validation_fraction)`` the validation rows; the held-out rows
    are the validation rows then the test rows, each sorted; the training rows the rest, in shuffled order.
    ``ConfigError`` when a validation split leaves no validation or no test row."""
    order = np.random.default_rng([seed, 17]).permutation(rows)
    n_test = int(round(rows * test_fraction))
    if validation_fraction <= 0:
        return np.sort(order[:n_test]), order[n_test:], 0
    n_validation = int(round(rows * validation_fraction))
    if n_validation < 1 or n_test < 1:
        raise ConfigError(f"validation_fraction = {validation_fraction} and test_fraction = {test_fraction} of "
                          f"{rows} rows leave {n_validation} validation and {n_test} test rows: each needs at "
                          f"least one")
    validation = np.sort(order[n_test:n_test + n_validation])
    return np.concatenate([validation, np.sort(order[:n_test])]), order[n_test + n_validation:], n_validation


class RowBatches(DataSource):
    """A source of numbered rows walked in batches: ``train_rows`` (shuffled afresh every epoch),
    ``batch`` rows a step, ``seed`` for the shuffles; the last partial batch of an epoch is left out."""

    train_rows: np.ndarray
    batch: int
    batches_per_epoch: int
    seed: int
    rows: int                 # how many rows are numbered (``row_count``), for a source that does not compute it
    _epoch: int = -1
    _order: np.ndarray = np.arange(0)
    _training_mask: np.ndarray | None = None     # by row number: a training row of this data owner (built once)

    _ORDER_KEY = 11        # the stream of per-epoch shuffles, apart from the data's own draws

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The training rows of 0-based ``epoch`` in the order its batches take them: a permutation drawn
        from the seed and the epoch alone, so every party computes the same one."""
        return self.train_rows[np.random.default_rng([self.seed, self._ORDER_KEY, epoch]).permutation(len(self.train_rows))]

    def step_rows(self, step: int) -> np.ndarray:
        """The row numbers 1-based ``step`` trains on, in batch order: what a forward's ``rows`` carries
        with ``send_rows`` (``features``/``targets`` of the step are ``features_at``/``targets_at`` of them)."""
        return self._rows(step)

    @property
    def row_count(self) -> int:
        """How many rows are numbered: the training and held-out rows of every data owner."""
        return self.rows

    def refused_row(self, rows: np.ndarray) -> tuple[int, str] | None:
        """The first of row numbers ``rows`` that may not be trained on here, and why (out of range, held
        out for evaluation, another data owner's), or None when every one may."""
        count = self.row_count
        outside = (rows < 0) | (rows >= count)
        if outside.any():
            return int(rows[np.argmax(outside)]), f"out of range (the rows are 0 to {count - 1})"
        if self._training_mask is None:
            self._training_mask = np.zeros(count, bool)
            self._training_mask[self.train_rows] = True
        refused = ~self._training_mask[rows]
        if not refused.any():
            return None
        row = int(rows[np.argmax(refused)])
        if row in set(self.test_rows.tolist()):
            return row, "held out for evaluation"
        return row, "not one of this data owner's training rows (another client's shard)"

    def features_at(self, rows: np.ndarray) -> np.ndarray:
        """The features of row numbers ``rows``, in that order."""
        raise ConfigError(f"{type(self).__name__} data holds no features")

    def targets_at(self, rows: np.ndarray) -> np.ndarray:
        """The targets of row numbers ``rows``, in that order."""
        raise ConfigError(f"{type(self).__name__} data holds no labels")

    def features(self, step: int) -> np.ndarray:
        return self.features_at(self._rows(step))

    def targets(self, step: int) -> np.ndarray:
        return self.targets_at(self._rows(step))

    def _rows(self, step: int) -> np.ndarray:
        epoch, index = divmod(step - 1, self.batches_per_epoch)
        if epoch != self._epoch:
            self._order = self.epoch_order(epoch)
            self._epoch = epoch
        return self._order[index * self.batch:(index + 1) * self.batch]

    def shard(self, index: int, count: int) -> None:
        """Keep every ``count``-th training row, from row ``index`` (see ``DataSource.shard``)."""
        if not 0 <= index < count:
            raise ConfigError(f"data owner {index} does not exist: there are {count} (0 to {count - 1})")
        rows = self.train_rows[index::count]
        if len(rows) < self.batch:
            raise ConfigError(f"data owner {index} of {count} gets {len(rows)} training rows, fewer than a batch "
                              f"of {self.batch}")
        self.train_rows, self.batches_per_epoch = rows, len(rows) // self.batch
        self._epoch, self._training_mask = -1, None
