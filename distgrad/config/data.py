"""Data sources. Each stage asks only for its own part.

A source answers, for a 1-based step number, the features (the first stage's
input) and the targets (the label owner's part). Batches are a pure function
of the step, so the data position is just the step counter: a stage that
resumes at step ``k`` sees exactly the batch it would have seen.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import inspect
import math
import zlib
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from distgrad.config.csvfile import CsvColumns, checked_ids, number
from distgrad.config.keys import is_whole
from distgrad.config.npzfile import READ_ERRORS
from distgrad.config.prepare import MISSING_HINT, MISSING_MODES, Preparation, class_order, is_missing, read_cells
from distgrad.errors import ConfigError
from distgrad.model.nn import DTYPE, Shape
from distgrad.privacy.defenses import randomized_response
from distgrad.privacy.releases import RunSecret

ROW_ID_DIGEST_HEX = 16          # hex digits of the row IDs' SHA-256 a party tells the others
NPY_MAGIC = b"\x93NUMPY"        # how every .npy file (and every member of an .npz) begins
ZIP_MAGIC = b"PK"               # how a zip archive (an .npz) begins


def _npy_header(f: Any) -> tuple[tuple[int, ...], bool, np.dtype]:
    """Shape, Fortran order and dtype from the ``.npy`` header at the start of the open file ``f``."""
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read(f)
    return tuple(shape), bool(fortran), np.dtype(dtype)


def _shaped(header: tuple[tuple[int, ...], bool, np.dtype]) -> np.ndarray:
    """A zero-byte stand-in with the header's shape and dtype (``np.lib.stride_tricks`` view, no allocation)."""
    shape, _, dtype = header
    return np.lib.stride_tricks.as_strided(np.empty(1, dtype), shape=shape, strides=(0,) * len(shape))


def _refuse_objects(where: str, dtype: np.dtype) -> None:
    """``ConfigError`` for an array of Python objects: numpy reads one only by unpickling it."""
    if dtype.hasobject:
        raise ConfigError(f"{where} cannot be read: it holds Python objects (dtype {dtype}), which numpy reads only "
                          f"by unpickling; distgrad never unpickles a data file: save text as a text array "
                          f"(.astype(str)) and numbers as a number array")


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


def row_id_digest(ids: list[str]) -> str:
    """``ROW_ID_DIGEST_HEX`` hex digits of the SHA-256 of ``ids`` in order (each ID's UTF-8 bytes with their
    length): equal for two parties whose files hold the same IDs in the same order."""
    digest = hashlib.sha256(len(ids).to_bytes(8, "little"))
    for key in ids:
        data = key.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:ROW_ID_DIGEST_HEX]


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


class ArrayFile(RowBatches):
    """Rows read from ``.npz``, ``.npy`` or CSV files, split into train and test rows.

    Each stage reads only its own part: the first stage the feature values,
    the label owner the labels (a stage that needs only the number of
    feature columns reads just the array header). Rows are shuffled once by
    ``split_seed``; the first ``test_fraction`` of them are held out for
    evaluation; training batches walk a per-epoch permutation of the rest.

    * ``npz``: ``path``, ``features`` and ``labels`` name members of one file.
    * ``npy``: ``features`` and ``labels`` are paths of two files.
    * ``csv``: ``path``; ``features`` a list of column indices or header
      names, ``labels`` one column; ``header = true`` when the first line
      names the columns.

    ``id_column`` (optional; csv: a column by index or header name, npz: a
    member of strings, as ``distgrad split`` writes it) holds the rows' IDs,
    which are no feature or label: the handshake compares a digest of the
    IDs (``row_id_digest``), so parties whose files do not hold the same IDs
    in the same order are refused before training.

    ``feature_names`` (optional; npz and npy, as ``distgrad split`` writes
    them from a csv header) names the feature columns in order, so that a CSV
    ``--input`` of ``distgrad predict`` is matched to them by name. A csv
    file with a header has its own names (``feature_names()``).

    Paths are relative to the experiment file. Features become float32 times
    ``feature_scale``; labels ``label_dtype`` (``int64`` class ids, shape
    ``(batch,)``, or ``float32`` values, shape ``(batch, 1)``). In a party's
    stage file ``features`` or ``labels`` is None (absent) when the party
    does not hold that part; the row count then comes from the part it holds
    (``feature_shape`` is None without features, ``has_labels`` False without
    labels), so the split and the shuffles are the same on every side.
    """

    def __init__(self, kind: str, base_dir: Path, seed: int, batch: int = 32, test_fraction: float = 0.2,
                 feature_scale: float = 1.0, label_dtype: str = "int64", path: str | None = None,
                 features: Any = "x", labels: Any = "y", header: bool = False, split_seed: int | None = None,
                 id_column: int | str | None = None, feature_names: Any = None, missing: str = "error",
                 standardize: bool = False, categorical: Any = None, class_names: bool = False,
                 validation_fraction: float = 0.0) -> None:
        if kind not in ("npz", "npy", "csv"):
            raise ConfigError(f"unknown file data kind {kind!r}")
        if label_dtype not in ("int64", "float32"):
            raise ConfigError(f"label_dtype must be int64 or float32, got {label_dtype!r}")
        if not 0 <= test_fraction < 1:
            raise ConfigError(f"test_fraction must be in [0, 1), got {test_fraction}")
        if not 0 <= validation_fraction < 1 or test_fraction + validation_fraction >= 1:
            raise ConfigError(f"validation_fraction must be in [0, 1) and leave training rows beside "
                              f"test_fraction = {test_fraction}, got {validation_fraction}")
        if validation_fraction > 0 and test_fraction == 0:
            raise ConfigError("validation_fraction splits validation rows from the test rows: it needs "
                              "test_fraction > 0 (rows to score the kept model on)")
        if header and kind != "csv":
            raise ConfigError(f"header = true says the first line of a csv file names its columns; {kind} data has "
                              f"no lines to name them, so it would do nothing: leave it out")
        if path is not None and kind == "npy":
            raise ConfigError("npy data reads one .npy file for the features and one for the labels, named by "
                              "'features' and 'labels', so 'path' would do nothing: leave it out (npz and csv "
                              "data name their one file by 'path')")
        self.kind, self.base_dir, self.batch = kind, base_dir, int(batch)
        self.path = base_dir / path if path is not None else None
        if features is None and labels is None:
            raise ConfigError(f"{kind} data needs 'features', 'labels' or both")
        self.feature_ref, self.label_ref, self.header = features, labels, bool(header)
        self.csv = CsvColumns(self.path, self.header) if kind == "csv" and self.path is not None else None
        if self.csv is not None and self.header and self.csv.path.is_file():
            first = self.csv.first_row()
            if first and all(number(cell) is not None for cell in first):
                raise ConfigError(f"csv data {self.path}: header = true, but line 1 holds only numbers, a row of "
                                  f"data that would be lost: give the file its header line (or header = false)")
        self.id_ref = id_column
        if id_column is not None:
            self._check_id_column()
        if features is not None and labels is not None:
            self._check_labels_apart()
        self.has_labels = labels is not None
        self.feature_scale, self.test_fraction = DTYPE(feature_scale), float(test_fraction)
        self.target_dtype = np.dtype(label_dtype)
        self.missing, self.standardize, self.class_names = missing, bool(standardize), bool(class_names)
        self.categorical_ref = categorical
        self.prepared = missing != "error" or self.standardize or categorical is not None or self.class_names
        self._check_preparation()
        self._kept: np.ndarray | None = None        # drop_rows: the file's rows kept, in order (None: every row)
        self._cells: tuple[np.ndarray, dict[int, list[str]]] | None = None
        self._label_cells: list[str] | None = None
        self._prep: Preparation | None = None
        self._classes: list[str] | None = None
        if self.missing == "drop_rows":
            self._kept = self._kept_rows()
        if split_seed is not None and (isinstance(split_seed, bool) or not isinstance(split_seed, int)
                                       or split_seed < 0):
            raise ConfigError(f"split_seed must be a non-negative integer, got {split_seed!r}")
        self.seed = seed if split_seed is None else int(split_seed)
        rows, width = self._feature_geometry()
        self.rows = rows
        self.test_rows, self.train_rows, self.validation_count = held_out_split(
            rows, self.seed, self.test_fraction, validation_fraction)
        if not 1 <= self.batch <= len(self.train_rows):
            raise ConfigError(f"batch must be in [1, {len(self.train_rows)}] (the training rows), got {self.batch}")
        self.batches_per_epoch = len(self.train_rows) // self.batch
        self._stat_rows = self.train_rows          # the statistics' rows: every training row of this file
        if self.prepared and features is not None:
            width = self._feature_cells()[0].shape[1]
        self._feature_names = self._checked_names(feature_names, width)
        if self.prepared and features is not None:
            width = self._feature_preparation().width
        self.feature_shape = (self.batch, width) if features is not None else None
        self.target_shape = (self.batch,) if self.target_dtype.kind == "i" else (self.batch, 1)
        self._features: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self._epoch, self._order = -1, np.arange(0)

    def _checked_names(self, names: Any, width: int) -> list[str] | None:
        """``feature_names`` if it names each of the ``width`` feature columns once (``ConfigError`` if not)."""
        if names is None:
            return None
        if self.kind == "csv" or self.feature_ref is None:
            raise ConfigError("feature_names names the feature columns of npz or npy data (a csv file's header "
                              "names its own)")
        if (not isinstance(names, list) or len(names) != width or len(set(names)) != len(names)
                or not all(isinstance(n, str) and n.strip() for n in names)):
            raise ConfigError(f"feature_names must list {width} distinct names, one per feature column, got "
                              f"{names!r}")
        return list(names)

    def feature_names(self) -> list[str] | None:
        """The feature columns' names in order: a csv header's, or ``feature_names``; None when unnamed.
        With categorical columns, the prepared columns' (``NAME=CATEGORY`` for each category)."""
        if self.feature_ref is None:
            return None
        if self.categorical_ref is not None:
            return self._feature_preparation().output_names()
        if self.kind != "csv":
            return self._feature_names
        if not self.header:
            return None
        names = self._csv_file().names() or []
        return [names[c] if c < len(names) else str(c) for c in self._csv_columns(self.feature_ref)]

    def _where_row(self, row: int, ref: Any) -> str:
        """How an error names data row ``row`` (from 0) of part ``ref``: the file and its line for csv."""
        if self.kind == "csv":
            csv_file = self._csv_file()
            column = csv_file.column_label(self._csv_columns(ref)[0])
            return f"csv data {self.path} line {csv_file.data()[0][row]}, {column}"
        return f"{self.path if self.kind == 'npz' else self.base_dir / str(ref)}: data row {row + 1}"

    def check_readable(self) -> None:
        """Read every part this source holds (features, labels, IDs), so that a bad file, a column that is no
        number (a word among the labels) or IDs that name no row are a ``ConfigError`` now, not when a step
        first asks for them."""
        if self.feature_ref is not None:
            self._all_features()
        if self.has_labels:
            self._all_labels()
        self.row_ids()

    # -- reading, each part only when it is asked for
    def _file(self, ref: Any) -> Path:
        path = self.path if self.kind != "npy" else self.base_dir / str(ref)
        if path is None or not path.is_file():
            raise ConfigError(f"data file {path} not found")
        return path

    def _feature_geometry(self) -> tuple[int, int]:
        """Rows and feature columns (0 without features), reading only array headers where it can."""
        if self.prepared:                      # the width is the preparation's
            if self._kept is not None:
                return len(self._kept), 0
            return (len(self._feature_cells()[0]) if self.feature_ref is not None
                    else len(self._file_label_cells())), 0
        if self.feature_ref is None:
            return len(self._all_labels_raw()), 0
        if self.kind in ("npz", "npy"):
            shape = self._array(self.feature_ref, header_only=True).shape
        else:
            columns = self._csv_columns(self.feature_ref)
            shape = (len(self._read_csv(columns[:1])), len(columns))
        if len(shape) < 2:
            raise ConfigError(f"features must be a 2-D array (rows, columns), got shape {shape}")
        return int(shape[0]), int(np.prod(shape[1:]))

    def _array(self, ref: Any, header_only: bool = False) -> np.ndarray:
        """Part ``ref`` of npz or npy data, read without unpickling (``header_only``: an empty array of its
        shape and dtype, read from the ``.npy`` header alone). ``ConfigError`` naming the file (and member) for a
        file that is no ``.npy`` / ``.npz``, one that is damaged or cut short, or an array of Python objects."""
        path = self._file(None if self.kind == "npz" else ref)
        where = f"{path} member {ref!r}" if self.kind == "npz" else str(path)
        writer = "numpy.savez" if self.kind == "npz" else "numpy.save"
        try:
            with open(path, "rb") as f:
                magic = f.read(len(NPY_MAGIC))
        except OSError as e:
            raise ConfigError(f"cannot read {path}: {e.strerror or e}") from e
        if not magic.startswith(NPY_MAGIC if self.kind == "npy" else ZIP_MAGIC):
            raise ConfigError(f"{path} is not a .{self.kind} file as {writer} writes it (it begins with "
                              f"{magic!r})")
        try:
            if self.kind == "npy":
                with open(path, "rb") as f:
                    header = _npy_header(f)
                    _refuse_objects(where, header[2])
                    if header_only:
                        return _shaped(header)
                return np.load(path, allow_pickle=False)
            try:
                npz = np.load(path, allow_pickle=False)
            except READ_ERRORS as e:
                raise ConfigError(f"{path} is not a readable .npz archive ({type(e).__name__}: {e})") from e
            with npz:
                self._check_member(npz, ref)
                names = set(npz.zip.namelist())
                with npz.zip.open(f"{ref}.npy" if f"{ref}.npy" in names else ref) as member:
                    header = _npy_header(member)
                _refuse_objects(where, header[2])
                return _shaped(header) if header_only else npz[ref]
        except ConfigError:
            raise
        except READ_ERRORS as e:
            raise ConfigError(f"{where} cannot be read: the file is damaged or not what {writer} writes "
                              f"({type(e).__name__}: {e})") from e

    def _check_member(self, npz: Any, ref: Any) -> None:
        """``ConfigError`` unless ``ref`` names an array of the npz file, listing the ones it has."""
        if not isinstance(ref, str) or ref not in npz.files:
            raise ConfigError(f"{self.path} has no array {ref!r}; its arrays are {sorted(npz.files)}")

    def _csv_file(self) -> CsvColumns:
        self._file(None)
        assert self.csv is not None
        return self.csv

    def _csv_columns(self, ref: Any) -> list[int]:
        return self._csv_file().indices(ref)

    def _read_csv(self, columns: list[int]) -> np.ndarray:
        return self._csv_file().numbers(columns)

    def _check_id_column(self) -> None:
        """``ConfigError`` unless ``id_column`` is one column of csv data, neither a feature nor the label."""
        if self.kind == "npy":
            raise ConfigError("id_column names a column of csv data or a member of an npz file; npy data has no "
                              "ID column")
        if self.kind == "npz":
            if not isinstance(self.id_ref, str) or self.id_ref in (self.feature_ref, self.label_ref):
                raise ConfigError(f"id_column of npz data names the member of the rows' IDs, not features or "
                                  f"labels, got {self.id_ref!r}")
            return
        if isinstance(self.id_ref, bool) or not isinstance(self.id_ref, (int, str)):
            raise ConfigError(f"id_column is one column, by index or header name, got {self.id_ref!r}")
        index = self._csv_columns(self.id_ref)[0]
        for part, ref in (("features", self.feature_ref), ("labels", self.label_ref)):
            if ref is not None and index in self._csv_columns(ref):
                raise ConfigError(f"id_column {self.id_ref!r} is also one of the {part}: the ID column holds "
                                  f"the rows' IDs, not data")

    def _check_labels_apart(self) -> None:
        """``ConfigError`` when the labels are also among the features (a csv column, an npz member, an npy
        file): the stage that reads the features would hold the labels, which only the label owner reads."""
        if self.kind == "csv":
            if isinstance(self.label_ref, (list, bool)) or not isinstance(self.label_ref, (int, str)):
                return                      # refused where the labels are read, with the reason
            shared = self.csv is not None and self.csv.path.is_file() and \
                self._csv_columns(self.label_ref)[0] in self._csv_columns(self.feature_ref)
        elif self.kind == "npy":
            shared = (self.base_dir / str(self.label_ref)).resolve() == (self.base_dir / str(self.feature_ref)).resolve()
        else:
            shared = self.label_ref == self.feature_ref
        if shared:
            raise ConfigError(f"{self.kind} data: labels {self.label_ref!r} are also among the features "
                              f"{self.feature_ref!r}: the stage that reads the features would hold the labels, "
                              f"which only the label owner may read")

    def row_ids(self) -> list[str] | None:
        """The rows' IDs in file order; None without ``id_column``."""
        if self.id_ref is None:
            return None
        if self.kind == "npz":
            raw = np.asarray(self._read_part(self.id_ref))
            if raw.ndim != 1 or raw.dtype.kind not in "Uiu":
                raise ConfigError(f"{self.path}: member {self.id_ref!r} (id_column) must be a vector of strings or "
                                  f"integers, got {raw.dtype} of shape {raw.shape}")
            ids = checked_ids([str(key) for key in raw.tolist()], str(self.path), self.id_ref)
        else:
            ids = self._csv_file().ids(self.id_ref)
        if self._kept is not None:
            ids = [ids[i] for i in self._kept.tolist()]
        if len(ids) != self.rows:
            raise ConfigError(f"csv data {self.path}: {len(ids)} IDs for {self.rows} rows")
        return ids

    def row_id_digest(self) -> str | None:
        """The digest of the rows' IDs in file order (``row_id_digest``); None without ``id_column``."""
        ids = self.row_ids()
        return None if ids is None else row_id_digest(ids)

    def id_name(self) -> str:
        """The ID column's name: its header name, or ``id`` for a column given by index without a header."""
        if isinstance(self.id_ref, str):
            return self.id_ref
        names = self._csv_file().first_row() if self.header else []
        return names[self.id_ref] if isinstance(self.id_ref, int) and self.id_ref < len(names) else "id"

    def _read_part(self, ref: Any) -> np.ndarray:
        """One part (features or labels) from the file(s), and nothing else; ``ConfigError`` for an array numpy
        cannot load without unpickling (Python objects, as a pandas column of text is saved)."""
        if self.kind in ("npz", "npy"):
            return self._array(ref)
        return self._read_csv(self._csv_columns(ref))

    def _all_features(self) -> np.ndarray:
        if self.feature_ref is None:
            raise ConfigError("this party's data holds no features (give 'features' in its [data])")
        if self._features is None and self.prepared:
            numbers, texts = self._feature_cells()
            prepared = self._feature_preparation().encode(numbers, texts, self._where_cell, unseen="zeros")
            with np.errstate(over="ignore"):
                features = prepared.astype(DTYPE) * self.feature_scale
            if not np.isfinite(features).all():
                row, column = (int(i) for i in np.argwhere(~np.isfinite(features))[0])
                raise ConfigError(f"{self.path or self.base_dir}: prepared feature column {column + 1} of data row "
                                  f"{row + 1} is beyond float32's range (once scaled by feature_scale)")
            self._features = features
        if self._features is None:
            raw = self._read_part(self.feature_ref)
            if raw.dtype.kind not in "biuf":
                raise ConfigError(f"the features of {self.path or self.base_dir / str(self.feature_ref)} are "
                                  f"{raw.dtype}, not numbers (real numbers: ints, floats or bools)")
            raw = raw.reshape(len(raw), -1)
            with np.errstate(over="ignore"):           # an overflow is refused below
                features = raw.astype(DTYPE) * self.feature_scale
            if not np.isfinite(features).all():
                row, column = (int(i) for i in np.argwhere(~np.isfinite(features))[0])
                value = float(raw[row, column])
                why = ("is beyond float32's range (once scaled by feature_scale)" if math.isfinite(value) else
                       "is not a finite number (for missing values set missing = \"mean\", \"median\" or "
                       "\"drop_rows\" in [data])")
                where = (self._where_cell(row, column) if self.kind != "csv"
                         else self._where_row(row, self._csv_columns(self.feature_ref)[column]))
                raise ConfigError(f"{where}: {value!r} {why}")
            self._features = features
        return self._features

    def _all_labels_raw(self) -> np.ndarray:
        if self.label_ref is None:
            raise ConfigError("this party's data holds no labels (give 'labels' in its [data])")
        if self.kind == "csv" and (isinstance(self.label_ref, (list, bool)) or not isinstance(self.label_ref, (int, str))):
            raise ConfigError(f"csv labels are one column, by index or header name, got {self.label_ref!r}")
        try:
            raw = self._read_part(self.label_ref)
        except ConfigError as e:
            if self.kind != "csv" or "not a number" not in str(e):
                raise
            raise ConfigError(f"{e} (labels are numbers: class ids 0, 1, ... or values; for class names, set "
                              f"class_names = true in this [data])") from e
        if self.kind == "csv":
            raw = raw[:, 0]
        elif raw.dtype.kind not in "biuf":
            raise ConfigError(f"{self._label_file()}: the labels are {raw.dtype} values, not numbers (class ids 0, "
                              f"1, ... or values): for class names, set class_names = true in this [data]")
        return self._label_vector(raw)

    def _label_file(self) -> str:
        """How an error names the labels' file (and member)."""
        return f"{self.path} member {self.label_ref!r}" if self.kind == "npz" else f"{self._file(self.label_ref)}"

    def _label_vector(self, raw: np.ndarray) -> np.ndarray:
        """The labels ``raw`` as a vector, one per row (shape ``(rows,)`` or ``(rows, 1)`` in the file);
        ``ConfigError`` for any other shape. (A NaN among float32 values is kept: the run fails at that step,
        or studies it under ``allow_nonfinite``; a class id is checked whole and in range by ``_all_labels``.)"""
        if raw.ndim == 0 or raw.size != len(raw):
            raise ConfigError(f"{self._label_file()}: the labels must be one value per row, shape (rows,), got "
                              f"shape {raw.shape}")
        return np.asarray(raw).reshape(len(raw))

    def _all_labels(self) -> np.ndarray:
        if self._labels is None and self.prepared:
            self._labels = self._prepared_labels().reshape((self.rows, *self.target_shape[1:]))
        if self._labels is None:
            raw = self._all_labels_raw()
            if len(raw) != self.rows:
                raise ConfigError(f"{len(raw)} labels for {self.rows} rows of features")
            if self.target_dtype.kind == "i" and raw.dtype.kind == "f":
                whole = np.isfinite(raw) & (raw == np.round(raw))
                if not whole.all():
                    row = int(np.argmin(whole))
                    raise ConfigError(f"{self._where_row(row, self.label_ref)}: label {float(raw[row])!r} is not a "
                                      f"class id (a whole number); for values, set label_dtype = \"float32\"")
            labels = self._cast_labels(raw, lambda row: self._where_row(row, self.label_ref))
            self._labels = labels.reshape((self.rows, *self.target_shape[1:]))
        return self._labels

    def _cast_labels(self, raw: np.ndarray, where: Any) -> np.ndarray:
        """``raw`` as ``label_dtype``; ``ConfigError`` naming the row (``where(row)``) of a value the cast would
        change: a class id beyond int64 (it would wrap around), a finite value float32 makes infinite (1e39)."""
        if self.target_dtype.kind == "i" and raw.dtype.kind in "uf":
            beyond = (raw >= 2.0 ** 63) | (raw < -2.0 ** 63)
            if beyond.any():
                row = int(np.argmax(beyond))
                raise ConfigError(f"{where(row)}: label {raw[row].item()!r} is not a class id: it is beyond int64's "
                                  f"range")
        with np.errstate(over="ignore", invalid="ignore"):     # what a cast cannot hold is refused
            labels = raw.astype(self.target_dtype)
        if self.target_dtype.kind == "f":
            beyond = np.isfinite(raw) & ~np.isfinite(labels)
            if beyond.any():
                row = int(np.argmax(beyond))
                raise ConfigError(f"{where(row)}: label {float(raw[row])!r} is beyond {self.target_dtype}'s range")
        return labels

    def own_parts(self) -> dict[str, np.ndarray]:
        """Every row of the parts this party holds, as its file stores them (before ``feature_scale`` and
        ``label_dtype``): ``"features"`` and/or ``"labels"``, and ``"ids"`` (strings) with an ``id_column``.
        ``distgrad split`` copies them to the party."""
        parts = {"features": self._read_part(self.feature_ref)} if self.feature_ref is not None else {}
        ids = self.row_ids()
        if ids is not None:
            parts["ids"] = np.array(ids, dtype=str)
        return {**parts, "labels": self._all_labels_raw()} if self.has_labels else parts

    # -- data preparation (distgrad.config.prepare): missing cells, standardize, categorical, class_names

    def _check_preparation(self) -> None:
        """``ConfigError`` for preparation settings this data cannot take, saying why."""
        if self.missing not in MISSING_MODES:
            raise ConfigError(f"missing must be one of {list(MISSING_MODES)}, got {self.missing!r}")
        if self.class_names and self.target_dtype.kind != "i":
            raise ConfigError("class_names maps the label column's values to class ids; it needs label_dtype = "
                              "\"int64\", not \"float32\" values")
        # A party's own [data] may hold only labels or only features: a key for the other part would do nothing.
        if self.feature_ref is None and (self.standardize or self.missing in ("mean", "median")):
            what = "standardize scales feature columns" if self.standardize else \
                f"missing = \"{self.missing}\" fills feature cells"
            raise ConfigError(f"{what}, but this [data] holds none (only "
                              f"labels, which are never filled in or scaled): remove it from this party's [data], "
                              f"and give it to the [data] of the party that holds the features")
        if self.feature_ref is None and self.feature_scale != 1:
            raise ConfigError(f"feature_scale = {float(self.feature_scale):g} scales feature columns, but this [data] "
                              f"holds none (only labels, which are never scaled): remove it from this party's "
                              f"[data], and give it to the [data] of the party that holds the features")
        if self.label_ref is None and self.class_names:
            raise ConfigError("class_names names the label column's values, but this [data] holds no labels: remove "
                              "it from this party's [data], and give it to the label owner's")
        if self.categorical_ref is None:
            return
        refs = self.categorical_ref
        if (not isinstance(refs, list) or not refs
                or not all(isinstance(r, str) or (is_whole(r) and r >= 0) for r in refs)
                or len(set(refs)) != len(refs)):
            raise ConfigError(f"categorical must list distinct feature columns (header names or indices), got "
                              f"{refs!r}")
        if self.kind != "csv":
            raise ConfigError(f"categorical names text columns of csv data; {self.kind} data holds numbers only: "
                              f"one-hot encode them in the file, or give the data as csv")
        if self.feature_ref is None:
            raise ConfigError("categorical names feature columns, but this party's [data] holds no features")
        features = self._csv_columns(self.feature_ref)
        outside = [r for r, c in zip(refs, self._csv_columns(refs)) if c not in features]
        if outside:
            raise ConfigError(f"categorical column(s) {outside} are not among the features {self.feature_ref!r}")

    def _where_file_row(self, row: int) -> int:
        """The file's data row (from 0) of row ``row`` (from 0) of this source."""
        return int(self._kept[row]) if self._kept is not None else row

    def _where_cell(self, row: int, column: int) -> str:
        """How an error names feature column ``column`` (from 0) of row ``row`` of this source."""
        row = self._where_file_row(row)
        if self.kind == "csv":
            csv_file = self._csv_file()
            label = csv_file.column_label(self._csv_columns(self.feature_ref)[column])
            return f"csv data {self.path} line {csv_file.data()[0][row]}, {label} (data row {row + 1})"
        return f"{self.path if self.kind == 'npz' else self.base_dir / str(self.feature_ref)}: data row {row + 1}, " \
               f"feature column {column + 1}"

    def _file_feature_cells(self) -> tuple[np.ndarray, dict[int, list[str]]]:
        """Every file row's feature cells: numbers (float64, NaN where missing and missing cells are allowed;
        a categorical column's NaN) and the categorical columns' text, by feature column."""
        allow = self.missing != "error"
        if self.kind != "csv":
            raw = self._read_part(self.feature_ref)
            if raw.dtype.kind not in "biuf":
                raise ConfigError(f"the features of {self.path or self.base_dir} are {raw.dtype}, not numbers")
            numbers = raw.reshape(len(raw), -1).astype(np.float64)
            if np.isinf(numbers).any():         # no value to fill in or scale (a missing one is NaN)
                row, column = (int(i) for i in np.argwhere(np.isinf(numbers))[0])
                where = self.path if self.kind == "npz" else self.base_dir / str(self.feature_ref)
                raise ConfigError(f"{where}: data row {row + 1}, feature column {column + 1}: {float(numbers[row, column])!r} "
                                  f"is not a finite number (a missing value is NaN, which missing = \"mean\", "
                                  f"\"median\" or \"drop_rows\" accept)")
            if not allow and np.isnan(numbers).any():
                row, column = (int(i) for i in np.argwhere(np.isnan(numbers))[0])
                raise ConfigError(f"{self._where_cell(row, column)}: the value is missing (NaN); set missing = "
                                  f"\"mean\", \"median\" or \"drop_rows\" in [data] to accept missing values")
            return numbers, {}
        csv_file = self._csv_file()
        columns = self._csv_columns(self.feature_ref)
        categorical = set(self._csv_columns(self.categorical_ref)) if self.categorical_ref is not None else set()
        lines, _ = csv_file.data()
        numbers = np.full((len(lines), len(columns)), np.nan)
        texts: dict[int, list[str]] = {}
        for j, column in enumerate(columns):
            _, cells = csv_file.texts(column)
            if column in categorical:
                texts[j] = cells
                continue
            numbers[:, j] = read_cells(cells, lambda i, c=column: f"csv data {self.path} line {lines[i]}, "
                                       f"{csv_file.column_label(c)} (data row {i + 1})", allow, MISSING_HINT)
        return numbers, texts

    def _file_label_cells(self) -> list[str]:
        """Every file row's label as text (a csv cell, or an array value written as text)."""
        if self.kind == "csv":
            if isinstance(self.label_ref, (list, bool)) or not isinstance(self.label_ref, (int, str)):
                raise ConfigError(f"csv labels are one column, by index or header name, got {self.label_ref!r}")
            return self._csv_file().texts(self._csv_columns(self.label_ref)[0])[1]
        raw = np.asarray(self._read_part(self.label_ref))
        if raw.ndim == 0 or raw.size != len(raw):
            raise ConfigError(f"{self._label_file()}: the labels must be one value per row, shape (rows,), got "
                              f"shape {raw.shape}")
        raw = raw.reshape(len(raw))
        if raw.dtype.kind == "S":           # bytes (as numpy.savez keeps a bytes array): their text, not "b'...'"
            try:
                return [v.decode("utf-8") for v in raw.tolist()]
            except UnicodeDecodeError as e:
                raise ConfigError(f"{self._label_file()}: the labels are bytes that are not UTF-8 text ({e}): save "
                                  f"them as a text array (.astype(str))") from e
        return ["" if raw.dtype.kind == "f" and np.isnan(v) else str(v) for v in raw.tolist()]

    def _kept_rows(self) -> np.ndarray:
        """drop_rows: the file rows with no missing cell among the parts this [data] names (features and
        labels), so every party reading the same table keeps the same rows."""
        keep: np.ndarray | None = None
        if self.feature_ref is not None:
            numbers, texts = self._file_feature_cells()
            keep = ~np.isnan(np.delete(numbers, list(texts), axis=1)).any(axis=1)
            for cells in texts.values():
                keep &= ~np.array([is_missing(c) for c in cells], bool)
        if self.label_ref is not None:
            labels = ~np.array([is_missing(c) for c in self._file_label_cells()], bool)
            if keep is not None and len(keep) != len(labels):
                raise ConfigError(f"{len(labels)} labels for {len(keep)} rows of features")
            keep = labels if keep is None else keep & labels
        assert keep is not None
        kept = np.flatnonzero(keep)
        if not len(kept):
            raise ConfigError(f"missing = \"drop_rows\" drops every row of {self.path or self.base_dir}: each has a "
                              f"missing cell")
        return kept

    def _feature_cells(self) -> tuple[np.ndarray, dict[int, list[str]]]:
        """This source's rows' feature cells (``_file_feature_cells`` of the rows kept)."""
        if self._cells is None:
            numbers, texts = self._file_feature_cells()
            if self._kept is not None:
                kept = self._kept.tolist()
                numbers, texts = numbers[self._kept], {j: [cells[i] for i in kept] for j, cells in texts.items()}
            self._cells = numbers, texts
        return self._cells

    def _feature_preparation(self) -> Preparation:
        """The feature columns' statistics, learnt from the training rows (or adopted: ``adopt``)."""
        if self._prep is None:
            numbers, texts = self._feature_cells()
            names = self.feature_names_raw()
            self._prep = Preparation.learn(names, numbers, texts, self._stat_rows, self.missing, self.standardize)
        return self._prep

    def feature_names_raw(self) -> list[str]:
        """The feature columns' names before preparation: a header's, given names, else their positions."""
        if self.kind == "csv" and self.header:
            names = self._csv_file().names() or []
            return [names[c] if c < len(names) else str(c) for c in self._csv_columns(self.feature_ref)]
        width = self._feature_cells()[0].shape[1]
        return list(self._feature_names) if self._feature_names else [str(c) for c in range(width)]

    def _prepared_labels(self) -> np.ndarray:
        """The labels of the rows kept: class ids by ``class_names``, else the cells as numbers."""
        cells = self._file_label_cells()
        if self._kept is not None:
            cells = [cells[i] for i in self._kept.tolist()]
        if len(cells) != self.rows:
            raise ConfigError(f"{len(cells)} labels for {self.rows} rows of features")

        def where(row: int) -> str:
            file_row = self._where_file_row(row)
            return self._where_row(file_row, self.label_ref)

        if self.class_names:
            missing = next((i for i, c in enumerate(cells) if is_missing(c)), None)
            if missing is not None:
                raise ConfigError(f"{where(missing)}: the label is missing (labels are never filled in; "
                                  f"missing = \"drop_rows\" leaves such rows out)")
            prep = Preparation(classes=self.classes())
            return prep.class_ids(cells, where)
        values = read_cells(cells, where, False)
        if self.target_dtype.kind == "i":
            whole = values == np.round(values)
            if not whole.all():
                row = int(np.argmin(whole))
                raise ConfigError(f"{where(row)}: label {float(values[row])!r} is not a class id (a whole number); "
                                  f"for values, set label_dtype = \"float32\", for names class_names = true")
        return self._cast_labels(values, where)

    def classes(self) -> list[str]:
        """class_names: the class names by id, from every row's label (``prepare.class_order``)."""
        if self._classes is None:
            cells = self._file_label_cells()
            if self._kept is not None:
                cells = [cells[i] for i in self._kept.tolist()]
            self._classes = class_order([c.strip() for c in cells if not is_missing(c)])
        return self._classes

    def preparation(self) -> Preparation | None:
        """This party's statistics (its feature columns' and, holding labels with class_names, its class
        names), or None when its [data] prepares nothing."""
        if not self.prepared:
            return None
        prep = copy.deepcopy(self._feature_preparation()) if self.feature_ref is not None else \
            Preparation(self.missing, self.standardize)
        if self.has_labels and self.class_names:
            prep.classes = list(self.classes())
        return prep

    def adopt(self, saved: Preparation, where: str) -> None:
        """Use ``saved`` statistics (a ``--load`` file's, a checkpoint's) instead of learning them: raises
        ``ConfigError`` naming ``where`` when they do not fit this data (other columns or categories)."""
        own = self.preparation()
        if own is None:
            raise ConfigError(f"{where}: this stage's [data] prepares nothing, but statistics were saved")
        if ([c.name for c in own.columns] != [c.name for c in saved.columns] or own.width != saved.width
                or saved.missing != own.missing or saved.standardize != own.standardize
                or (own.classes is not None and saved.classes != own.classes)):
            raise ConfigError(f"{where}: the saved data preparation does not fit this stage's [data] (other "
                              f"columns, categories, classes or settings than its own rows give)")
        if self.feature_ref is not None:
            self._prep, self._features = copy.deepcopy(saved), None

    # -- the DataSource contract

    _ORDER_KEY = 19

    def features_at(self, rows: np.ndarray) -> np.ndarray:
        return self._all_features()[rows]

    def targets_at(self, rows: np.ndarray) -> np.ndarray:
        return self._all_labels()[rows]

    def all_targets(self) -> np.ndarray:
        """Every row's label, by row number."""
        return self._all_labels()

    def test_features(self) -> np.ndarray:
        return self._all_features()[self.test_rows]

    def test_targets(self) -> np.ndarray:
        return self._all_labels()[self.test_rows]


class ColumnView(DataSource):
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
        self._source, self._columns = source, np.asarray(columns, np.intp)
        self.feature_shape = (*shape[:-1], len(columns))
        self.target_shape, self.target_dtype = source.target_shape, source.target_dtype
        self.has_labels, self.test_rows = source.has_labels, source.test_rows
        self.validation_count = source.validation_count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)      # rows, batches, epoch_order, ...: the source's

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

    def targets(self, step: int) -> np.ndarray:
        return self._source.targets(step)

    def true_targets(self, step: int) -> np.ndarray:
        return self._source.true_targets(step)

    def shard(self, index: int, count: int) -> None:
        self._source.shard(index, count)

    def check_readable(self) -> None:
        self._source.check_readable()


class RandomizedLabels(DataSource):
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
        self._source, self._labels, self.epsilon, self.key, self.stage = source, labels, epsilon, key, stage
        self._drawn: tuple[int, np.ndarray] | None = None        # (the secret, its randomized labels)
        self.feature_shape, self.target_shape = source.feature_shape, source.target_shape
        self.target_dtype, self.has_labels, self.test_rows = source.target_dtype, source.has_labels, source.test_rows
        self.validation_count = source.validation_count

    @property
    def noisy(self) -> np.ndarray:
        """Every row's randomized label, by row number, drawn from the run secret's current value."""
        secret = self.key.value
        if self._drawn is None or self._drawn[0] != secret:
            rng = np.random.default_rng([secret, zlib.crc32(self.stage.encode()), zlib.crc32(b"label_dp")])
            self._drawn = secret, randomized_response(self._labels, self.classes, self.epsilon, rng)
        return self._drawn[1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)      # rows, batches, test_targets, ...: the source's

    def features(self, step: int) -> np.ndarray:
        return self._source.features(step)

    def targets(self, step: int) -> np.ndarray:
        return self.noisy[self._source._rows(step)]

    def targets_at(self, rows: np.ndarray) -> np.ndarray:
        return self.noisy[rows]

    def true_targets(self, step: int) -> np.ndarray:
        return self._source.targets(step)

    def shard(self, index: int, count: int) -> None:
        self._source.shard(index, count)

    def check_readable(self) -> None:
        self._source.check_readable()


class ReleasedLabels(DataSource):
    """A label owner's rows whose training labels are released during training (``label_dp`` with ``stages``,
    RR-with-prior: ``privacy.labeldp.LabelRelease``, which the label owner's stage holds): its training targets
    are the rows' numbers (int64, ``(batch,)`` like class ids), which the stage turns into randomized labels
    when it first trains on each row. The held-out labels (``test_targets``) and ``true_targets`` stay true;
    everything else is the source's own."""

    def __init__(self, source: RowBatches) -> None:
        self._source = source
        self.feature_shape, self.target_shape = source.feature_shape, source.target_shape
        self.target_dtype, self.has_labels, self.test_rows = source.target_dtype, source.has_labels, source.test_rows
        self.validation_count = source.validation_count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)      # rows, batches, test_targets, all_targets, ...: the source's

    def features(self, step: int) -> np.ndarray:
        return self._source.features(step)

    def targets(self, step: int) -> np.ndarray:
        return np.asarray(self._source._rows(step), np.int64)

    def targets_at(self, rows: np.ndarray) -> np.ndarray:
        return np.asarray(rows, np.int64)

    def true_targets(self, step: int) -> np.ndarray:
        return self._source.targets(step)

    def shard(self, index: int, count: int) -> None:
        self._source.shard(index, count)

    def check_readable(self) -> None:
        self._source.check_readable()


_KINDS: dict[str, type[DataSource]] = {"ramp": Ramp, "synthetic_regression": SyntheticRegression,
                                       "synthetic_classification": SyntheticClassification,
                                       "npz": ArrayFile, "npy": ArrayFile, "csv": ArrayFile}
_INTERNAL = {"self", "kind", "base_dir"}     # constructor arguments that no experiment gives


def _check_option(kind: str, name: str, value: Any, annotation: str) -> None:
    """Raise ``ConfigError`` unless ``value`` fits the constructor's annotation (a real number for a float)."""
    allowed = {part.strip() for part in str(annotation).split("|")}
    if "Any" in allowed or (value is None and "None" in allowed):
        return
    if isinstance(value, bool):
        ok = "bool" in allowed
    elif isinstance(value, int):
        ok = bool(allowed & {"int", "float"})
    elif isinstance(value, float):
        ok = "float" in allowed and bool(np.isfinite(value))
    else:
        ok = isinstance(value, str) and "str" in allowed
    if not ok:
        wanted = " or ".join(sorted(allowed - {"None"})).replace("float", "real number").replace("int", "whole number").replace("str", "string")
        raise ConfigError(f"data kind {kind!r}: {name!r} must be a {wanted}, got {value!r}")


def build_data(spec: Mapping[str, Any], seed: int, base_dir: Path | None = None) -> DataSource:
    """Build the data source named by an experiment's ``[data]`` table.

    Raises ``ConfigError`` for an unknown kind or option (listing the valid
    ones) or a value of the wrong type (a string or boolean for a number).
    """
    spec = dict(spec)
    kind = spec.pop("kind", None)
    if not isinstance(kind, str) or kind not in _KINDS:
        raise ConfigError(f"unknown data kind {kind!r}: use ramp, synthetic_regression, synthetic_classification, "
                          f"npz, npy or csv")
    parameters = inspect.signature(_KINDS[kind].__init__).parameters
    internal = _INTERNAL | ({"seed"} if _KINDS[kind] is ArrayFile else set())     # files take split_seed
    valid = [name for name in parameters if name not in internal]
    unknown = sorted(set(spec) - set(valid))
    if unknown:
        raise ConfigError(f"unknown option(s) {unknown} for data kind {kind!r}; valid options: "
                          f"{', '.join(['kind', *valid])}")
    for name, value in spec.items():
        _check_option(kind, name, value, parameters[name].annotation)
    try:
        if kind == "ramp":
            return Ramp(**spec)
        if kind == "synthetic_regression":
            return SyntheticRegression(seed=spec.pop("seed", seed), **spec)
        if kind == "synthetic_classification":
            return SyntheticClassification(seed=spec.pop("seed", seed), **spec)
        return ArrayFile(kind, base_dir or Path.cwd(), seed, **spec)
    except TypeError as e:
        raise ConfigError(f"invalid options for data kind {kind!r}: {sorted(spec)} ({e})") from e
