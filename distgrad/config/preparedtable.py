"""The preparation of a file data source's table (``distgrad.config.prepare``): missing cells, standardized
and categorical feature columns, class names for the labels.

``PreparedTable`` owns what a ``[data]``'s preparation settings decide: the
file rows kept (``missing = "drop_rows"``), their cells, the statistics
learnt from the training rows (or adopted from a saved run), the class names,
and the prepared features and labels. Every party that reads the same table
with the same settings keeps the same rows and learns the same statistics.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from distgrad.config.fileparts import FileParts
from distgrad.config.keys import is_whole
from distgrad.config.labelvalues import cast_labels, label_vector
from distgrad.config.prepare import MISSING_HINT, MISSING_MODES, Preparation, class_order, is_missing, read_cells
from distgrad.errors import ConfigError
from distgrad.model.nn import DTYPE


class PreparedTable:
    """The preparation of the parts ``feature_ref`` and ``label_ref`` (None: not held) of ``files``.

    ``prepared`` is False when the settings prepare nothing (``missing = "error"``, no ``standardize``,
    ``categorical`` or ``class_names``). Raises ``ConfigError`` at construction for settings this data cannot
    take, saying why, and (``drop_rows``) when every row has a missing cell.
    """

    def __init__(self, files: FileParts, feature_ref: Any, label_ref: Any, categorical_ref: Any, missing: str,
                 standardize: bool, class_names: bool, target_dtype: np.dtype, feature_scale: float) -> None:
        self.files, self.feature_ref, self.label_ref = files, feature_ref, label_ref
        self.missing, self.standardize, self.class_names = missing, standardize, class_names
        self.categorical_ref, self.target_dtype = categorical_ref, target_dtype
        self.prepared = missing != "error" or standardize or categorical_ref is not None or class_names
        self._check(feature_scale)
        self.kept: np.ndarray | None = None        # drop_rows: the file's rows kept, in order (None: every row)
        self._cells: tuple[np.ndarray, dict[int, list[str]]] | None = None
        self.statistics: Preparation | None = None  # the feature columns' (``learn``, ``adopt``)
        self._classes: list[str] | None = None
        if self.missing == "drop_rows":
            self.kept = self._kept_rows()

    def _check(self, feature_scale: float) -> None:
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
        if self.feature_ref is None and feature_scale != 1:
            raise ConfigError(f"feature_scale = {float(feature_scale):g} scales feature columns, but this [data] "
                              f"holds none (only labels, which are never scaled): remove it from this party's "
                              f"[data], and give it to the [data] of the party that holds the features")
        if self.label_ref is None and self.class_names:
            raise ConfigError("class_names names the label column's values, but this [data] holds no labels: remove "
                              "it from this party's [data], and give it to the label owner's")
        if self.categorical_ref is not None:
            self._check_categorical()

    def _check_categorical(self) -> None:
        """``ConfigError`` unless ``categorical`` lists distinct feature columns of csv data."""
        refs = self.categorical_ref
        if (not isinstance(refs, list) or not refs
                or not all(isinstance(r, str) or (is_whole(r) and r >= 0) for r in refs)
                or len(set(refs)) != len(refs)):
            raise ConfigError(f"categorical must list distinct feature columns (header names or indices), got "
                              f"{refs!r}")
        if self.files.kind != "csv":
            raise ConfigError(f"categorical names text columns of csv data; {self.files.kind} data holds numbers "
                              f"only: one-hot encode them in the file, or give the data as csv")
        if self.feature_ref is None:
            raise ConfigError("categorical names feature columns, but this party's [data] holds no features")
        features = self.files.csv_columns(self.feature_ref)
        outside = [r for r, c in zip(refs, self.files.csv_columns(refs)) if c not in features]
        if outside:
            raise ConfigError(f"categorical column(s) {outside} are not among the features {self.feature_ref!r}")

    # -- where a row is: the file's rows, of which ``kept`` are this source's

    def where_file_row(self, row: int) -> int:
        """The file's data row (from 0) of row ``row`` (from 0) of this source."""
        return int(self.kept[row]) if self.kept is not None else row

    def where_cell(self, row: int, column: int) -> str:
        """How an error names feature column ``column`` (from 0) of row ``row`` of this source."""
        row = self.where_file_row(row)
        files = self.files
        if files.kind == "csv":
            csv_file = files.csv_file()
            label = csv_file.column_label(files.csv_columns(self.feature_ref)[column])
            return f"csv data {files.path} line {csv_file.data()[0][row]}, {label} (data row {row + 1})"
        return f"{files.path if files.kind == 'npz' else files.base_dir / str(self.feature_ref)}: " \
               f"data row {row + 1}, feature column {column + 1}"

    # -- the cells, and the rows kept

    def file_feature_cells(self) -> tuple[np.ndarray, dict[int, list[str]]]:
        """Every file row's feature cells: numbers (float64, NaN where missing and missing cells are allowed;
        a categorical column's NaN) and the categorical columns' text, by feature column."""
        allow = self.missing != "error"
        files = self.files
        if files.kind != "csv":
            return self._file_feature_numbers(allow), {}
        csv_file = files.csv_file()
        columns = files.csv_columns(self.feature_ref)
        categorical = set(files.csv_columns(self.categorical_ref)) if self.categorical_ref is not None else set()
        lines, _ = csv_file.data()
        numbers = np.full((len(lines), len(columns)), np.nan)
        texts: dict[int, list[str]] = {}
        for j, column in enumerate(columns):
            _, cells = csv_file.texts(column)
            if column in categorical:
                texts[j] = cells
                continue
            numbers[:, j] = read_cells(cells, lambda i, c=column: f"csv data {files.path} line {lines[i]}, "
                                       f"{csv_file.column_label(c)} (data row {i + 1})", allow, MISSING_HINT)
        return numbers, texts

    def _file_feature_numbers(self, allow: bool) -> np.ndarray:
        """npz or npy data's feature cells (``file_feature_cells``), NaN refused unless ``allow``."""
        files = self.files
        raw = files.read(self.feature_ref)
        if raw.dtype.kind not in "biuf":
            raise ConfigError(f"the features of {files.path or files.base_dir} are {raw.dtype}, not numbers")
        numbers = raw.reshape(len(raw), -1).astype(np.float64)
        if np.isinf(numbers).any():         # no value to fill in or scale (a missing one is NaN)
            row, column = (int(i) for i in np.argwhere(np.isinf(numbers))[0])
            where = files.path if files.kind == "npz" else files.base_dir / str(self.feature_ref)
            raise ConfigError(f"{where}: data row {row + 1}, feature column {column + 1}: {float(numbers[row, column])!r} "
                              f"is not a finite number (a missing value is NaN, which missing = \"mean\", "
                              f"\"median\" or \"drop_rows\" accept)")
        if not allow and np.isnan(numbers).any():
            row, column = (int(i) for i in np.argwhere(np.isnan(numbers))[0])
            raise ConfigError(f"{self.where_cell(row, column)}: the value is missing (NaN); set missing = "
                              f"\"mean\", \"median\" or \"drop_rows\" in [data] to accept missing values")
        return numbers

    def file_label_cells(self) -> list[str]:
        """Every file row's label as text (a csv cell, or an array value written as text)."""
        files = self.files
        if files.kind == "csv":
            if isinstance(self.label_ref, (list, bool)) or not isinstance(self.label_ref, (int, str)):
                raise ConfigError(f"csv labels are one column, by index or header name, got {self.label_ref!r}")
            return files.csv_file().texts(files.csv_columns(self.label_ref)[0])[1]
        raw = label_vector(files.read(self.label_ref), lambda: files.label_file(self.label_ref))
        if raw.dtype.kind == "S":           # bytes (as numpy.savez keeps a bytes array): their text, not "b'...'"
            try:
                return [v.decode("utf-8") for v in raw.tolist()]
            except UnicodeDecodeError as e:
                raise ConfigError(f"{files.label_file(self.label_ref)}: the labels are bytes that are not UTF-8 "
                                  f"text ({e}): save them as a text array (.astype(str))") from e
        return ["" if raw.dtype.kind == "f" and np.isnan(v) else str(v) for v in raw.tolist()]

    def _kept_rows(self) -> np.ndarray:
        """drop_rows: the file rows with no missing cell among the parts this [data] names (features and
        labels), so every party reading the same table keeps the same rows."""
        keep: np.ndarray | None = None
        if self.feature_ref is not None:
            numbers, texts = self.file_feature_cells()
            keep = ~np.isnan(np.delete(numbers, list(texts), axis=1)).any(axis=1)
            for cells in texts.values():
                keep &= ~np.array([is_missing(c) for c in cells], bool)
        if self.label_ref is not None:
            labels = ~np.array([is_missing(c) for c in self.file_label_cells()], bool)
            if keep is not None and len(keep) != len(labels):
                raise ConfigError(f"{len(labels)} labels for {len(keep)} rows of features")
            keep = labels if keep is None else keep & labels
        assert keep is not None
        kept = np.flatnonzero(keep)
        if not len(kept):
            raise ConfigError(f"missing = \"drop_rows\" drops every row of {self.files.path or self.files.base_dir}: "
                              f"each has a missing cell")
        return kept

    def feature_cells(self) -> tuple[np.ndarray, dict[int, list[str]]]:
        """This source's rows' feature cells (``file_feature_cells`` of the rows kept)."""
        if self._cells is None:
            numbers, texts = self.file_feature_cells()
            if self.kept is not None:
                kept = self.kept.tolist()
                numbers, texts = numbers[self.kept], {j: [cells[i] for i in kept] for j, cells in texts.items()}
            self._cells = numbers, texts
        return self._cells

    def label_cells(self) -> list[str]:
        """This source's rows' labels as text (``file_label_cells`` of the rows kept)."""
        cells = self.file_label_cells()
        if self.kept is not None:
            cells = [cells[i] for i in self.kept.tolist()]
        return cells

    # -- the statistics and the class names

    def learn(self, names: list[str], train_rows: np.ndarray) -> Preparation:
        """Learn the feature columns' statistics (named ``names``) from the rows ``train_rows`` (every training
        row of the file, before any shard), once; later calls return them as learnt or adopted."""
        if self.statistics is None:
            numbers, texts = self.feature_cells()
            self.statistics = Preparation.learn(names, numbers, texts, train_rows, self.missing, self.standardize)
        return self.statistics

    def classes(self) -> list[str]:
        """class_names: the class names by id, from every row's label (``prepare.class_order``)."""
        if self._classes is None:
            self._classes = class_order([c.strip() for c in self.label_cells() if not is_missing(c)])
        return self._classes

    def preparation(self) -> Preparation | None:
        """This party's statistics (its feature columns' and, holding labels with class_names, its class
        names), or None when its [data] prepares nothing."""
        if not self.prepared:
            return None
        if self.feature_ref is not None:
            assert self.statistics is not None, "the statistics are learnt when the source is built"
            prep = copy.deepcopy(self.statistics)
        else:
            prep = Preparation(self.missing, self.standardize)
        if self.label_ref is not None and self.class_names:
            prep.classes = list(self.classes())
        return prep

    def adopt(self, saved: Preparation, where: str) -> None:
        """Use ``saved`` statistics (a ``--load`` file's, a checkpoint's) instead of those learnt: raises
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
            self.statistics = copy.deepcopy(saved)

    # -- the prepared parts

    def features(self, scale: np.floating) -> np.ndarray:
        """Every row's prepared features (float32) times ``scale``; ``ConfigError`` for a value beyond float32's
        range."""
        assert self.statistics is not None, "the statistics are learnt when the source is built"
        numbers, texts = self.feature_cells()
        prepared = self.statistics.encode(numbers, texts, self.where_cell, unseen="zeros")
        with np.errstate(over="ignore"):
            features = prepared.astype(DTYPE) * scale
        if not np.isfinite(features).all():
            row, column = (int(i) for i in np.argwhere(~np.isfinite(features))[0])
            raise ConfigError(f"{self.files.path or self.files.base_dir}: prepared feature column {column + 1} of "
                              f"data row {row + 1} is beyond float32's range (once scaled by feature_scale)")
        return features

    def labels(self, rows: int) -> np.ndarray:
        """The labels of the rows kept, which must be ``rows``: class ids by ``class_names``, else the cells as
        numbers (class ids checked whole), cast to ``label_dtype``."""
        cells = self.label_cells()
        if len(cells) != rows:
            raise ConfigError(f"{len(cells)} labels for {rows} rows of features")

        def where(row: int) -> str:
            return self.files.where_row(self.where_file_row(row), self.label_ref)

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
        return cast_labels(values, self.target_dtype, where)
