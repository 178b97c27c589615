"""The rows a prediction takes (``distgrad predict``): new rows read from an ``--input`` file (``.npy``, or
``.csv`` as the stage's csv ``[data]`` reads its file), or the stage's held-out rows, scaled and prepared as
its training rows were; and an active label owner's own columns of them, matched to each chunk the parties
send (``OwnRows``). Every refusal is a ``ConfigError`` naming ``--input`` (and, for a CSV, the line and column of
a bad field), or for rows that cannot be matched a ``ProtocolError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from distgrad.wire import messages as wire
from distgrad.config.csvfile import CsvColumns, looks_like_header, number, shown
from distgrad.config.prepare import Preparation, prepares, read_cells, read_preparation
from distgrad.errors import ConfigError, ProtocolError
from distgrad.wire.messages import ErrorCode


@dataclass
class NewRows:
    """Rows to predict: float32 ``features`` ``(rows, ...)`` and, when they have them, their ``ids`` (one
    per row) from the column named ``id_name``."""

    features: np.ndarray
    ids: list[str] | None = None
    id_name: str = "id"


def feature_names(exp: Any, stage: str, table: Mapping[str, Any]) -> list[str] | None:
    """The names of stage ``stage``'s feature columns, in the order it takes them, or None when its data
    does not name them: an npz/npy ``[data]``'s ``feature_names`` (as ``distgrad split`` writes them), or
    a csv ``[data]`` with a header (its features given by name, or by index into its file's header);
    a vertical party's ``columns`` of them."""
    kind, names = table.get("kind"), None
    if kind in ("npz", "npy"):
        names = table.get("feature_names")
    elif kind == "csv" and table.get("header") and table.get("features") is not None:
        refs = table["features"] if isinstance(table["features"], list) else [table["features"]]
        if all(isinstance(ref, str) for ref in refs):
            names = list(refs)
        elif isinstance(table.get("path"), str) and (exp.spec(stage).base_dir / table["path"]).is_file():
            training = CsvColumns(exp.spec(stage).base_dir / table["path"], True)
            header = [name.strip() for name in training.first_row()]
            if all(isinstance(ref, str) or (isinstance(ref, int) and 0 <= ref < len(header)) for ref in refs):
                names = [ref if isinstance(ref, str) else header[ref] for ref in refs]
    columns = exp.spec(stage).columns
    if names is not None and columns is not None:
        names = [names[c] for c in columns] if all(0 <= c < len(names) for c in columns) else None
    return names


def _read_csv(path: Path, table: Any, id_column: int | str | None, names: list[str] | None,
              header_given: bool | None = None, prep: Preparation | None = None
              ) -> tuple[np.ndarray, list[str] | None, str, Callable[[int, int], str]]:
    """A CSV's feature columns (float64), IDs, ID column name, and where value ``(i, j)`` of the features
    is in the file (its line, and its column with the header's name), read as a csv ``[data]`` table reads
    them.

    The first line is a header where ``header_given`` (``--header``/``--no-header``) says so, else where
    the stage's csv ``table`` declares one (``header = true``; a first line of numbers is then refused,
    never dropped), or else when every one of its fields is a name (``csvfile.looks_like_header``). With
    a header and the stage's feature ``names``, the features are the columns of those names, in the
    stage's order (a header that does not name them all is refused); else a csv ``table``'s
    ``features``, or every column but the ID column. ``id_column`` (else the csv
    table's) names the ID column. With ``prep`` (the stage's saved data preparation) the feature columns
    are prepared by it (missing cells, categories, standardisation: ``Preparation.encode``)."""
    form = table if table.get("kind") == "csv" else {}
    reader, first = _opened(path, form, header_given)
    header = reader.names()
    id_ref = id_column if id_column is not None else form.get("id_column")
    features = form.get("features")
    by_name = [ref for ref in [id_ref, *(features if isinstance(features, list) else [features])]
               if isinstance(ref, str)]
    if header is None and by_name:
        raise ConfigError(f"columns are given by name ({by_name[0]!r}), but its first line is no header (a header is "
                          f"a line of names only, none a number, or --header): it holds "
                          f"{', '.join(shown(c) for c in first[:8])}{' ...' if len(first) > 8 else ''}")
    id_index = reader.indices(id_ref)[0] if id_ref is not None else None
    if id_index is not None and not 0 <= id_index < len(first):
        raise ConfigError(f"the ID column {id_ref!r} is not one of its {len(first)} columns")
    columns = _feature_columns(reader, header, len(first), names, features, id_index)
    if id_index is not None and id_index in columns:
        raise ConfigError(f"the ID column {id_ref!r} is also one of the features {features or names!r}")
    values = reader.numbers(columns) if prep is None else _prepared(reader, columns, prep)
    ids = reader.ids(id_ref) if id_ref is not None else None
    name = first[id_index].strip() if reader.header and id_index is not None else (
        id_ref if isinstance(id_ref, str) else "id")
    lines = reader.data()[0]

    def where(i: int, j: int) -> str:
        column = reader.column_label(columns[j]) if prep is None else f"prepared feature column {j + 1}"
        return f"line {lines[i]}, {column} (data row {i + 1})"

    return values, ids, name, where


def _opened(path: Path, form: Mapping[str, Any], header_given: bool | None) -> tuple[CsvColumns, list[str]]:
    """The CSV ``path`` open for reading, and its first line's fields; whether that line is a header is
    decided as ``_read_csv`` says (``header_given``, else the csv ``[data]`` ``form``'s ``header``, else
    ``looks_like_header``). ``ConfigError`` for a file with no rows, or a first line of numbers where the
    ``[data]`` declares a header."""
    reader = CsvColumns(path, False)
    first = reader.first_row()
    if not first:
        raise ConfigError("the file holds no rows")
    declared = bool(form.get("header", False))
    if header_given is None and declared and all(number(cell) is not None for cell in first):
        raise ConfigError("its first line holds only numbers, but the stage's [data] declares a header (header = "
                          "true): give the file a first line naming its columns (or --no-header)")
    reader.header = header_given if header_given is not None else declared or looks_like_header(first)
    return reader, first


def _feature_columns(reader: CsvColumns, header: list[str] | None, width: int, names: list[str] | None,
                     features: Any, id_index: int | None) -> list[int]:
    """The indices of the CSV's feature columns (it has ``width``): with a ``header``, those it names
    ``names`` (the stage's, in its order; ``ConfigError`` for a header that does not name them all), else the
    csv ``[data]``'s ``features``, else every column but ``id_index``."""
    if header is not None and names is not None:
        missing = [name for name in names if name not in header]
        if missing:
            raise ConfigError(f"its header does not name the feature column(s) {missing[:8]} of the stage, whose "
                              f"features are {names[:8]}{' ...' if len(names) > 8 else ''} (matched by name, in any "
                              f"order); its header is {header[:8]}{' ...' if len(header) > 8 else ''}")
        return reader.indices(list(names))
    if features is not None:
        return reader.indices(features)
    return [i for i in range(width) if i != id_index]


def _prepared(reader: CsvColumns, columns: list[int], prep: Preparation) -> np.ndarray:
    """The CSV's feature ``columns`` prepared as the stage's training rows were (float64): a category never
    seen in training, or a missing cell with nothing to fill it, is a ``ConfigError`` naming its line."""
    if len(columns) != len(prep.columns):
        raise ConfigError(f"{len(columns)} feature columns, but the stage's saved data preparation has "
                          f"{len(prep.columns)} ({[c.name for c in prep.columns][:8]})")
    lines, _ = reader.data()
    numbers = np.full((len(lines), len(columns)), np.nan)
    texts: dict[int, list[str]] = {}
    for j, (column, stats) in enumerate(zip(columns, prep.columns)):
        cells = reader.texts(column)[1]
        if stats.categories is not None:
            texts[j] = cells
        else:
            numbers[:, j] = read_cells(cells, lambda i, c=column: f"line {lines[i]}, {reader.column_label(c)} "
                                       f"(data row {i + 1})", prep.missing != "error")
    return prep.encode(numbers, texts, lambda i, j: f"line {lines[i]}, {reader.column_label(columns[j])} "
                       f"(data row {i + 1})", unseen="error")


def saved_preparation(exp: Any, stage: str, load: Path | None) -> Preparation | None:
    """The data preparation statistics saved beside stage ``stage``'s ``--load`` file
    (``prepare.read_preparation``), or None when its [data] prepares nothing or the stage keeps none of it
    (it holds neither feature columns nor, as the label owner, the class names: ``Experiment.preparation``
    saves nothing for it); ``ConfigError`` when they are needed and missing."""
    spec = exp.spec(stage)
    table = exp.data if spec.data is None else spec.data
    if not prepares(table) or load is None:
        return None
    holds_features = stage in exp.data_owners or (stage == exp.stage_names[-1] and exp.own_bottom)
    if not holds_features and not (stage == exp.label_owner and table.get("class_names")):
        return None
    return read_preparation(load)


def _array_cell(i: int, j: int) -> str:
    """Where value ``(i, j)`` of an array of rows is."""
    return f"data row {i + 1}, column {j + 1}"


def read_rows(path: Path, exp: Any, stage: str, id_column: int | str | None = None,
              header: bool | None = None, load: Path | None = None) -> NewRows:
    """New rows from ``path``, scaled like the stage's training data (its ``feature_scale``).

    ``.npy``: an array of rows. ``.csv``: read as the stage's csv ``[data]``
    reads its file (``header``, ``features`` by index or name, ``id_column``),
    or, when its data is of another kind, every column is a feature (but
    the ID column) and the first line is a header only when every field of
    it is a name; ``header`` (``--header``/``--no-header``) says whether it is
    one (``_read_csv``). When the stage's features have names
    (``feature_names``), a CSV header is matched to them by name. Every value
    must be a finite number. ``id_column`` (``--id-column``: a header name or
    an index) names the ID column, whose values travel with the rows and
    reach the label owner's output. When the stage's [data] prepares its
    rows, the statistics saved beside ``load`` (its ``--load`` file) prepare
    these rows alike (``saved_preparation``). Raises ``ConfigError`` naming
    ``--input`` (and, for a CSV, the line and column of a bad field).
    """
    spec = exp.spec(stage)
    table = exp.data if spec.data is None else spec.data
    scale = np.float32(table.get("feature_scale", 1.0))
    prep = saved_preparation(exp, stage, load)
    prep = prep if prep is not None and prep.columns else None
    ids, name = None, "id"

    where: Callable[[int, int], str] = _array_cell       # a CSV's cells: their line and named column (_read_csv)

    try:
        if path.suffix == ".npy":
            raw = _read_npy(path, id_column, header, prep)
        else:
            raw, ids, name, where = _read_csv(path, table, id_column, feature_names(exp, stage, table), header,
                                              prep)
        rows = _scaled(raw, scale, where)
    except (OSError, ValueError, TypeError) as e:
        raise ConfigError(f"--input {path}: cannot read rows: {e}") from e
    except ConfigError as e:
        raise ConfigError(f"--input {path}: {e}") from e
    # An active label owner's rows are its own feature columns, not what it receives.
    shape = exp.own_features_shape() if stage == exp.stage_names[-1] and exp.own_bottom else exp.input_shape(stage)
    width = shape[1:] if exp.batch is not None else shape
    if tuple(rows.shape[1:]) != tuple(width) or not len(rows):
        raise ConfigError(f"--input {path} has rows of shape {tuple(rows.shape[1:])} ({len(rows)} rows); stage "
                          f"{stage} takes rows of shape {tuple(width)}")
    return NewRows(rows, ids, name)


def _read_npy(path: Path, id_column: int | str | None, header: bool | None, prep: Preparation | None) -> Any:
    """The array an ``.npy`` ``--input`` holds, prepared by ``prep`` when given (its numeric feature columns:
    ``ValueError`` for another array, ``ConfigError`` when the stage encodes categories). ``ConfigError`` for
    an ``id_column`` or a ``header``, which only a CSV has."""
    if id_column is not None:
        raise ConfigError("--id-column names a column of a .csv --input; an .npy file has no IDs")
    if header is not None:
        raise ConfigError("--header and --no-header are about a .csv --input; an .npy file has no header")
    raw = np.load(path, allow_pickle=False)
    if prep is not None:
        if any(c.categories is not None for c in prep.columns):
            raise ConfigError("the stage one-hot encodes categorical columns, which an .npy file of numbers "
                              "cannot hold: give the rows as a .csv --input")
        if not isinstance(raw, np.ndarray) or raw.dtype.kind not in "biuf" or raw.ndim != 2 \
                or raw.shape[1] != len(prep.columns):
            raise ValueError(f"expected rows of the {len(prep.columns)} feature columns the stage prepares")
        raw = prep.encode(raw.astype(np.float64), {}, lambda i, j: f"data row {i + 1}, column {j + 1}",
                          unseen="error")
    return raw


def _scaled(raw: Any, scale: np.float32, where: Callable[[int, int], str]) -> np.ndarray:
    """The rows of ``raw`` flattened to float32 and multiplied by ``scale``. ``ValueError`` unless ``raw`` is a
    non-empty numeric array; ``ConfigError`` naming the value (``where`` it is) that is not finite, or not
    within float32 range once scaled."""
    if not isinstance(raw, np.ndarray) or raw.ndim < 1 or raw.dtype.kind not in "biuf" or not len(raw):
        raise ValueError("expected a non-empty numeric array of rows")
    with np.errstate(over="ignore", invalid="ignore"):        # a value beyond float32 is refused below
        rows = raw.reshape(len(raw), -1).astype(np.float32) * scale
    finite = np.isfinite(rows)
    if not finite.all():
        row, column = (int(i) for i in np.argwhere(~finite)[0])
        value = raw.reshape(len(raw), -1)[row, column]
        raise ConfigError(f"{where(row, column)}: {float(value)!r} is not a finite number"
                          f"{' within float32 range (once scaled)' if np.isfinite(value) else ''}")
    return rows


def held_out_rows(exp: Any, stage: str, seed: int, load: Path | None = None) -> NewRows:
    """The stage's held-out test rows (the default ``--input``; a validation split's validation rows left out),
    with their IDs when its data has an ``id_column``;
    prepared by the statistics saved beside ``load`` when its [data] prepares its rows."""
    data = exp.build_data(seed, stage=stage)
    prep = saved_preparation(exp, stage, load)
    if prep is not None and prep.columns:
        data.adopt(prep, f"{load}")
    if not len(data.test_rows):
        raise ConfigError(f"stage {stage}'s data holds out no rows: give --input FILE")
    ids = data.row_ids() if hasattr(data, "row_ids") else None
    tests = data.test_rows[data.validation_count:]          # not the validation rows of a validation split
    return NewRows(data.test_features()[data.validation_count:], None if ids is None else [ids[i] for i in tests],
                   data.id_name() if ids is not None else "id")


class OwnRows:
    """An active label owner's own feature columns of the rows a prediction takes (its ``--input``, or its
    held-out rows), matched to each chunk the parties send: by the rows' IDs when they carry them (the
    label owner's rows need the same ID column, in any order), else by position (the same row count)."""

    def __init__(self, rows: NewRows, batch: int) -> None:
        self.rows, self.batch = rows, batch
        self.index: dict[str, int] | None = None
        if rows.ids is not None:
            self.index = {key: i for i, key in enumerate(rows.ids)}
            if len(self.index) != len(rows.ids):
                raise ConfigError(f"the label owner's own rows repeat an ID of column {rows.id_name!r}: each row "
                                  f"needs its own to be matched with the parties' rows")

    def check(self, rows: int, id_name: str | None) -> None:
        """Refuse (``mismatch``) a hello whose rows these cannot be matched with: IDs of another column (or
        none where the parties send IDs), or, without IDs, another row count."""
        if id_name is not None and (self.index is None or id_name != self.rows.id_name):
            own = "no IDs" if self.index is None else f"IDs of column {self.rows.id_name!r}"
            raise ProtocolError(ErrorCode.MISMATCH, f"the parties send the IDs of column {id_name!r}; the label "
                                                    f"owner's own rows have {own}: give it an --input with the "
                                                    f"same ID column")
        if id_name is None and rows != len(self.rows.features):
            raise ProtocolError(ErrorCode.MISMATCH, f"the parties announce {rows} rows without IDs; the label "
                                                    f"owner holds {len(self.rows.features)} own rows, matched by "
                                                    f"position: give every side the same rows (or IDs)")

    def chunk(self, number: int, ids: list[str] | None, count: int) -> np.ndarray:
        """The own columns of chunk ``number``'s ``count`` rows: by their ``ids``, else by position."""
        if ids is None:
            start = (number - 1) * self.batch
            return self.rows.features[start:start + count]
        assert self.index is not None            # ``check`` refused IDs the own rows do not have
        missing = next((key for key in ids if key not in self.index), None)
        if missing is not None:
            raise ProtocolError(ErrorCode.MISMATCH, f"chunk {number}: row ID {wire.show(missing)} is not among the "
                                                    f"label owner's own rows (column {self.rows.id_name!r}): the "
                                                    f"parties' --input files and its own are not aligned")
        return self.rows.features[[self.index[key] for key in ids]]
