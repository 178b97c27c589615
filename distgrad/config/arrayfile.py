"""Rows read from ``.npz``, ``.npy`` or CSV files (``ArrayFile``): a file data source and its settings.

``ArrayFile`` checks a ``[data]`` table's settings, splits the file's rows
into held-out and training rows (``batches.held_out_split``) and serves the
features and labels as the training arrays take them. Reading the files,
the rows' IDs and the data preparation are its parts' (``fileparts``,
``rowids``, ``preparedtable``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from distgrad.config.batches import RowBatches, held_out_split
from distgrad.config.fileparts import FileParts
from distgrad.config.labelvalues import cast_labels, label_vector
from distgrad.config.prepare import Preparation
from distgrad.config.preparedtable import PreparedTable
from distgrad.config.rowids import IdColumn, row_id_digest
from distgrad.errors import ConfigError
from distgrad.model.nn import DTYPE


def _check_settings(kind: str, label_dtype: str, test_fraction: float, validation_fraction: float, header: bool,
                    path: str | None) -> None:
    """``ConfigError`` for a file data setting out of range, or one this kind of file would ignore."""
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


def _split_seed(seed: int, split_seed: Any) -> int:
    """The seed of the held-out split: ``split_seed`` when given (a non-negative integer, else
    ``ConfigError``), else the experiment's ``seed``."""
    if split_seed is not None and (isinstance(split_seed, bool) or not isinstance(split_seed, int)
                                   or split_seed < 0):
        raise ConfigError(f"split_seed must be a non-negative integer, got {split_seed!r}")
    return seed if split_seed is None else int(split_seed)


def _checked_names(names: Any, kind: str, feature_ref: Any, width: int) -> list[str] | None:
    """``feature_names`` if it names each of the ``width`` feature columns once (``ConfigError`` if not)."""
    if names is None:
        return None
    if kind == "csv" or feature_ref is None:
        raise ConfigError("feature_names names the feature columns of npz or npy data (a csv file's header "
                          "names its own)")
    if (not isinstance(names, list) or len(names) != width or len(set(names)) != len(names)
            or not all(isinstance(n, str) and n.strip() for n in names)):
        raise ConfigError(f"feature_names must list {width} distinct names, one per feature column, got "
                          f"{names!r}")
    return list(names)


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

    Its parts: ``files`` (``fileparts.FileParts``: reading a part),
    ``id_column`` (``rowids.IdColumn``: the rows' IDs), ``table``
    (``preparedtable.PreparedTable``: the rows kept, the statistics, the
    class names). The held-out split (``batches.held_out_split``) and the
    walk of the training rows (``RowBatches``) are ``batches``'s.
    """

    def __init__(self, kind: str, base_dir: Path, seed: int, batch: int = 32, test_fraction: float = 0.2,
                 feature_scale: float = 1.0, label_dtype: str = "int64", path: str | None = None,
                 features: Any = "x", labels: Any = "y", header: bool = False, split_seed: int | None = None,
                 id_column: int | str | None = None, feature_names: Any = None, missing: str = "error",
                 standardize: bool = False, categorical: Any = None, class_names: bool = False,
                 validation_fraction: float = 0.0) -> None:
        _check_settings(kind, label_dtype, test_fraction, validation_fraction, header, path)
        self.kind, self.base_dir, self.batch = kind, base_dir, int(batch)
        self.path = base_dir / path if path is not None else None
        if features is None and labels is None:
            raise ConfigError(f"{kind} data needs 'features', 'labels' or both")
        self.feature_ref, self.label_ref, self.header = features, labels, bool(header)
        self.files = FileParts(kind, base_dir, self.path, self.header)
        self.files.check_header_line()
        self.id_ref = id_column
        self.id_column = IdColumn(self.files, id_column, features, labels)
        if features is not None and labels is not None:
            self.files.check_apart(features, labels)
        self.has_labels = labels is not None
        self.feature_scale, self.test_fraction = DTYPE(feature_scale), float(test_fraction)
        self.target_dtype = np.dtype(label_dtype)
        self.table = PreparedTable(self.files, features, labels, categorical, missing, bool(standardize),
                                   bool(class_names), self.target_dtype, self.feature_scale)
        self.prepared = self.table.prepared
        self.seed = _split_seed(seed, split_seed)
        self.rows, width = self._feature_geometry()
        self.test_rows, self.train_rows, self.validation_count = held_out_split(
            self.rows, self.seed, self.test_fraction, validation_fraction)
        if not 1 <= self.batch <= len(self.train_rows):
            raise ConfigError(f"batch must be in [1, {len(self.train_rows)}] (the training rows), got {self.batch}")
        self.batches_per_epoch = len(self.train_rows) // self.batch
        if self.prepared and features is not None:
            width = self.table.feature_cells()[0].shape[1]
        self._feature_names = _checked_names(feature_names, kind, features, width)
        if self.prepared and features is not None:      # the statistics: every training row of this file's
            width = self.table.learn(self.feature_names_raw(), self.train_rows).width
        self.feature_shape = (self.batch, width) if features is not None else None
        self.target_shape = (self.batch,) if self.target_dtype.kind == "i" else (self.batch, 1)
        self._features: np.ndarray | None = None
        self._labels: np.ndarray | None = None
        self._epoch, self._order = -1, np.arange(0)

    def _feature_geometry(self) -> tuple[int, int]:
        """Rows and feature columns (0 without features), reading only array headers where it can."""
        if self.prepared:                      # the width is the preparation's
            if self.table.kept is not None:
                return len(self.table.kept), 0
            return (len(self.table.feature_cells()[0]) if self.feature_ref is not None
                    else len(self.table.file_label_cells())), 0
        if self.feature_ref is None:
            return len(self._all_labels_raw()), 0
        if self.kind in ("npz", "npy"):
            shape = self.files.array(self.feature_ref, header_only=True).shape
        else:
            columns = self.files.csv_columns(self.feature_ref)
            shape = (len(self.files.read_csv(columns[:1])), len(columns))
        if len(shape) < 2:
            raise ConfigError(f"features must be a 2-D array (rows, columns), got shape {shape}")
        return int(shape[0]), int(np.prod(shape[1:]))

    # -- names and IDs

    def feature_names(self) -> list[str] | None:
        """The feature columns' names in order: a csv header's, or ``feature_names``; None when unnamed.
        With categorical columns, the prepared columns' (``NAME=CATEGORY`` for each category)."""
        if self.feature_ref is None:
            return None
        if self.table.categorical_ref is not None:
            assert self.table.statistics is not None, "categorical columns are prepared when the source is built"
            return self.table.statistics.output_names()
        if self.kind != "csv":
            return self._feature_names
        if not self.header:
            return None
        names = self.files.csv_file().names() or []
        return [names[c] if c < len(names) else str(c) for c in self.files.csv_columns(self.feature_ref)]

    def feature_names_raw(self) -> list[str]:
        """The feature columns' names before preparation: a header's, given names, else their positions."""
        if self.kind == "csv" and self.header:
            names = self.files.csv_file().names() or []
            return [names[c] if c < len(names) else str(c) for c in self.files.csv_columns(self.feature_ref)]
        width = self.table.feature_cells()[0].shape[1]
        return list(self._feature_names) if self._feature_names else [str(c) for c in range(width)]

    def row_ids(self) -> list[str] | None:
        """The rows' IDs in file order; None without ``id_column``."""
        return self.id_column.ids(self.table.kept, self.rows)

    def row_id_digest(self) -> str | None:
        """The digest of the rows' IDs in file order (``row_id_digest``); None without ``id_column``."""
        ids = self.row_ids()
        return None if ids is None else row_id_digest(ids)

    def id_name(self) -> str:
        """The ID column's name: its header name, or ``id`` for a column given by index without a header."""
        return self.id_column.name()

    # -- reading, each part only when it is asked for

    def check_readable(self) -> None:
        """Read every part this source holds (features, labels, IDs), so that a bad file, a column that is no
        number (a word among the labels) or IDs that name no row are a ``ConfigError`` now, not when a step
        first asks for them."""
        if self.feature_ref is not None:
            self._all_features()
        if self.has_labels:
            self._all_labels()
        self.row_ids()

    def own_parts(self) -> dict[str, np.ndarray]:
        """Every row of the parts this party holds, as its file stores them (before ``feature_scale`` and
        ``label_dtype``): ``"features"`` and/or ``"labels"``, and ``"ids"`` (strings) with an ``id_column``.
        ``distgrad split`` copies them to the party."""
        parts = {"features": self.files.read(self.feature_ref)} if self.feature_ref is not None else {}
        ids = self.row_ids()
        if ids is not None:
            parts["ids"] = np.array(ids, dtype=str)
        return {**parts, "labels": self._all_labels_raw()} if self.has_labels else parts

    def _all_features(self) -> np.ndarray:
        """Every row's features (float32 times ``feature_scale``), read once: ``ConfigError`` for a value that
        is no finite number or beyond float32's range."""
        if self.feature_ref is None:
            raise ConfigError("this party's data holds no features (give 'features' in its [data])")
        if self._features is None and self.prepared:
            self._features = self.table.features(self.feature_scale)
        if self._features is None:
            raw = self.files.read(self.feature_ref)
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
                where = (self.table.where_cell(row, column) if self.kind != "csv"
                         else self.files.where_row(row, self.files.csv_columns(self.feature_ref)[column]))
                raise ConfigError(f"{where}: {value!r} {why}")
            self._features = features
        return self._features

    def _all_labels_raw(self) -> np.ndarray:
        """Every file row's label as the file stores it, one per row: ``ConfigError`` for labels that are no
        numbers (class names need ``class_names``) or not one value per row."""
        if self.label_ref is None:
            raise ConfigError("this party's data holds no labels (give 'labels' in its [data])")
        if self.kind == "csv" and (isinstance(self.label_ref, (list, bool)) or not isinstance(self.label_ref, (int, str))):
            raise ConfigError(f"csv labels are one column, by index or header name, got {self.label_ref!r}")
        try:
            raw = self.files.read(self.label_ref)
        except ConfigError as e:
            if self.kind != "csv" or "not a number" not in str(e):
                raise
            raise ConfigError(f"{e} (labels are numbers: class ids 0, 1, ... or values; for class names, set "
                              f"class_names = true in this [data])") from e

        def label_file() -> str:         # read only for an error
            return self.files.label_file(self.label_ref)

        if self.kind == "csv":
            raw = raw[:, 0]
        elif raw.dtype.kind not in "biuf":
            raise ConfigError(f"{label_file()}: the labels are {raw.dtype} values, not numbers (class ids 0, "
                              f"1, ... or values): for class names, set class_names = true in this [data]")
        # (A NaN among float32 values is kept: the run fails at that step, or studies it under allow_nonfinite;
        # a class id is checked whole and in range by ``_all_labels``.)
        return label_vector(raw, label_file)

    def _all_labels(self) -> np.ndarray:
        """Every row's label as ``label_dtype``, shaped ``(rows, *target_shape[1:])``, read once:
        ``ConfigError`` naming the row of a class id that is not a whole number or a value the cast changes."""
        if self._labels is None and self.prepared:
            self._labels = self.table.labels(self.rows).reshape((self.rows, *self.target_shape[1:]))
        if self._labels is None:
            raw = self._all_labels_raw()
            if len(raw) != self.rows:
                raise ConfigError(f"{len(raw)} labels for {self.rows} rows of features")
            if self.target_dtype.kind == "i" and raw.dtype.kind == "f":
                whole = np.isfinite(raw) & (raw == np.round(raw))
                if not whole.all():
                    row = int(np.argmin(whole))
                    raise ConfigError(f"{self.files.where_row(row, self.label_ref)}: label {float(raw[row])!r} is "
                                      f"not a class id (a whole number); for values, set label_dtype = \"float32\"")
            labels = cast_labels(raw, self.target_dtype, lambda row: self.files.where_row(row, self.label_ref))
            self._labels = labels.reshape((self.rows, *self.target_shape[1:]))
        return self._labels

    # -- data preparation (``preparedtable``): missing cells, standardize, categorical, class_names

    def classes(self) -> list[str]:
        """class_names: the class names by id, from every row's label (``prepare.class_order``)."""
        return self.table.classes()

    def preparation(self) -> Preparation | None:
        """This party's statistics (its feature columns' and, holding labels with class_names, its class
        names), or None when its [data] prepares nothing."""
        return self.table.preparation()

    def adopt(self, saved: Preparation, where: str) -> None:
        """Use ``saved`` statistics (a ``--load`` file's, a checkpoint's) instead of learning them: raises
        ``ConfigError`` naming ``where`` when they do not fit this data (other columns or categories)."""
        self.table.adopt(saved, where)
        self._features = None           # prepared afresh with the statistics adopted

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
