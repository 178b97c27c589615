"""Data preparation of one party's table: missing cells, standardised columns, one-hot categories, class
names. Pure: cells in, float64 / int64 arrays out; no files, no sockets.

The statistics (``Preparation``) are learnt from the party's own training rows only, kept by that party,
saved beside its parameters (``preparation_path``) and in its checkpoints, and applied alike to its
training rows, its held-out rows and the new rows of ``distgrad predict``:

* a feature column is either numbers or, when named in ``categorical``, categories (any text);
* ``missing``: ``"error"`` refuses a missing cell (``MISSING_CELLS``); ``"mean"`` / ``"median"`` fill a
  number column's missing cell with its training rows' mean / median (a category column's missing cell
  becomes an all-zero one-hot row); ``"drop_rows"`` leaves out every row with a missing cell (the
  caller keeps the parties' rows aligned);
* ``standardize``: each number column becomes ``(x - mean) / std`` with the mean and the (population)
  standard deviation of its present values in the training rows (a constant column: std 1);
* a category column becomes one column per category seen in the training rows (sorted), 1 where the
  row holds it; a category the training rows never held is refused at predict time (``ConfigError``),
  or, at training time (a held-out row), encoded as an all-zero row;
* class names: the label column's distinct values sorted (numerically when every one is a number, else
  as text) are class ids 0, 1, ...; predictions are written back as these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from distgrad.config.csvfile import cell_problem, number, shown
from distgrad.errors import ConfigError
from distgrad.jsontext import json_text, parse_json

MISSING_MODES = ("error", "mean", "median", "drop_rows")
# What a cell holds when its value is missing (compared with the cell stripped of spaces).
MISSING_CELLS = frozenset({"", "NA", "N/A", "n/a", "na", "NaN", "nan", "NAN", "null", "NULL", "Null", "None",
                           "none", "?", "<NA>", "#N/A", "-"})
PREPARATION_OPTIONS = ("missing", "standardize", "categorical", "class_names")    # the [data] keys of this module
FORMAT = 1          # the version of the saved statistics' JSON


def is_missing(cell: str) -> bool:
    """Whether a text cell holds no value (``MISSING_CELLS``)."""
    return cell.strip() in MISSING_CELLS


def class_order(values: Sequence[str]) -> list[str]:
    """The distinct ``values`` in class-id order: by number when every one is a number, else as text."""
    distinct = sorted(set(values))
    if all(number(v) is not None for v in distinct):
        return sorted(distinct, key=lambda v: (float(v), v))
    return distinct


@dataclass
class Column:
    """One feature column's statistics: ``name``; a number column's ``fill`` (its missing cells' value,
    None without imputation), ``mean`` and ``std`` (None without standardisation); a category column's
    ``categories`` (None for a number column)."""

    name: str
    fill: float | None = None
    mean: float | None = None
    std: float | None = None
    categories: list[str] | None = None

    @property
    def width(self) -> int:
        return 1 if self.categories is None else len(self.categories)

    def output_names(self) -> list[str]:
        """The names of the columns this one becomes (``name=category`` for each category)."""
        return [self.name] if self.categories is None else [f"{self.name}={c}" for c in self.categories]


@dataclass
class Preparation:
    """A party's statistics: ``columns`` (its feature columns, in order; empty without features),
    ``classes`` (the label owner's class names by id; None without ``class_names``), and the settings
    they serve (``missing``, ``standardize``)."""

    missing: str = "error"
    standardize: bool = False
    columns: list[Column] = field(default_factory=list)
    classes: list[str] | None = None

    @property
    def width(self) -> int:
        """Feature columns once prepared."""
        return sum(column.width for column in self.columns)

    def output_names(self) -> list[str]:
        return [name for column in self.columns for name in column.output_names()]

    def to_json(self) -> dict[str, Any]:
        """The statistics as JSON (floats exactly: a float64 survives JSON's text)."""
        return {"format": FORMAT, "missing": self.missing, "standardize": self.standardize,
                "columns": [{k: v for k, v in vars(c).items() if v is not None} for c in self.columns],
                **({"classes": self.classes} if self.classes is not None else {})}

    @classmethod
    def from_json(cls, saved: Any, where: str) -> "Preparation":
        """The statistics ``to_json`` wrote; ``ConfigError`` naming ``where`` for anything else."""
        try:
            if not isinstance(saved, dict) or saved.get("format") != FORMAT:
                raise ValueError("not distgrad's saved data preparation (format 1)")
            columns = []
            for item in saved["columns"]:
                column = Column(name=str(item["name"]))
                for key in ("fill", "mean", "std"):
                    if key in item:
                        setattr(column, key, float(item[key]))
                if "categories" in item:
                    column.categories = [str(c) for c in item["categories"]]
                columns.append(column)
            classes = saved.get("classes")
            return cls(str(saved["missing"]), bool(saved["standardize"]), columns,
                       None if classes is None else [str(c) for c in classes])
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: cannot read the saved data preparation: {e}") from e

    # -- learning the statistics

    @classmethod
    def learn(cls, names: list[str], numbers: np.ndarray, texts: dict[int, list[str]], train_rows: np.ndarray,
              missing: str, standardize: bool) -> "Preparation":
        """The statistics of feature columns ``names`` from the ``train_rows`` only: ``numbers`` (float64
        ``(rows, columns)``, NaN where a cell is missing; a category column's values unused) and ``texts``
        (column index -> its cells, for the category columns). ``ConfigError`` for a number column without
        a present value in the training rows, or a category column without a category."""
        prep = cls(missing, standardize)
        for j, name in enumerate(names):
            if j in texts:
                cells = [texts[j][i].strip() for i in train_rows.tolist()]
                categories = sorted({c for c in cells if not is_missing(c)})
                if not categories:
                    raise ConfigError(f"categorical column {name!r} holds no category in the training rows")
                prep.columns.append(Column(name, categories=categories))
                continue
            present = numbers[train_rows, j]
            present = present[~np.isnan(present)]
            column = Column(name)
            if missing in ("mean", "median") or standardize:
                if not len(present):
                    raise ConfigError(f"feature column {name!r} holds no value in the training rows, so it has no "
                                      f"mean or median to fill with or scale by")
            if missing == "mean":
                column.fill = _finite(np.mean, present)
            elif missing == "median":
                column.fill = _finite(np.median, present)
            if standardize:
                column.mean = _finite(np.mean, present)
                std = _finite(np.std, present)
                column.std = std if std > 0 else 1.0
            prep.columns.append(column)
        return prep

    # -- applying them

    def encode(self, numbers: np.ndarray, texts: dict[int, list[str]], where: Any, unseen: str) -> np.ndarray:
        """The prepared features, float64 ``(rows, width)``: ``numbers`` and ``texts`` as ``learn`` takes
        them. A missing cell left (``missing = "error"``, or NaN with nothing to fill) raises ``ConfigError``
        naming it (``where(row, column)``: how an error names a cell); a category the statistics do not know
        is refused (``unseen = "error"``) or encoded as zeros (``"zeros"``)."""
        rows = len(numbers)
        out = np.zeros((rows, self.width), np.float64)
        at = 0
        for j, column in enumerate(self.columns):
            if column.categories is not None:
                index = {c: k for k, c in enumerate(column.categories)}
                for i, cell in enumerate(texts[j]):
                    text = cell.strip()
                    if is_missing(text):
                        if self.missing in ("error", "drop_rows"):
                            raise ConfigError(f"{where(i, j)}: {shown(cell)} is a missing category (missing = "
                                              f"{self.missing!r}; \"mean\" or \"median\" in [data] encode it as "
                                              f"all zeros)")
                        continue
                    k = index.get(text)
                    if k is None:
                        if unseen == "error":
                            raise ConfigError(f"{where(i, j)}: category {shown(text)} of column {column.name!r} "
                                              f"was never seen in the training rows, whose categories are "
                                              f"{column.categories[:12]}")
                        continue
                    out[i, at + k] = 1.0
            else:
                values = numbers[:, j].copy()
                gaps = np.isnan(values)
                if gaps.any():
                    if column.fill is None:
                        row = int(np.argmax(gaps))
                        if self.missing == "drop_rows":
                            raise ConfigError(f"{where(row, j)}: the cell is missing; training left out such rows "
                                              f"(missing = \"drop_rows\"), but a row to predict needs every cell")
                        raise ConfigError(f"{where(row, j)}: the cell is missing (set missing = \"mean\", "
                                          f"\"median\" or \"drop_rows\" in [data] to accept missing cells)")
                    values[gaps] = column.fill
                if column.mean is not None and column.std is not None:
                    with np.errstate(over="ignore"):
                        scaled = (values - column.mean) / column.std
                    far = ~np.isfinite(scaled)      # x - mean beyond float64 (values near its limit): divide first
                    scaled[far] = values[far] / column.std - column.mean / column.std
                    values = scaled
                out[:, at] = values
            at += column.width
        return out

    def class_ids(self, labels: Sequence[str], where: Any) -> np.ndarray:
        """int64 class ids of ``labels`` (text cells) by ``classes``; ``ConfigError`` for an unknown one."""
        assert self.classes is not None
        index = {c: k for k, c in enumerate(self.classes)}
        out = np.empty(len(labels), np.int64)
        for i, label in enumerate(labels):
            k = index.get(label.strip())
            if k is None:
                raise ConfigError(f"{where(i)}: label {shown(label)} is not one of the classes {self.classes[:12]}")
            out[i] = k
        return out


def _finite(statistic: Any, present: np.ndarray) -> float:
    """``statistic`` (``np.mean``, ``np.median`` or ``np.std``) of the finite float64 ``present`` values, computed
    on the values divided by their largest magnitude (and multiplied back) where the plain sum overflows: a
    column with values near float64's limit still gets a finite statistic."""
    with np.errstate(over="ignore", invalid="ignore"):
        value = float(statistic(present))
    if not np.isfinite(value):
        scale = float(np.max(np.abs(present)))
        value = scale * float(statistic(present / scale))
    return value


MISSING_HINT = " (set missing = \"mean\", \"median\" or \"drop_rows\" in [data] to accept missing cells)"


def finite_numbers(cells: Sequence[str]) -> np.ndarray | None:
    """``cells`` as float64 when every one is a number ``number`` takes (ASCII, no ``_``, finite), parsed at
    once; None when one is not (``read_cells`` then says which)."""
    try:            # numpy parses text as float() does; what float() takes beyond ``number`` is caught after
        values = np.array(cells, dtype=np.float64)
    except ValueError:
        return None
    joined = "".join(cells)
    return values if joined.isascii() and "_" not in joined and bool(np.isfinite(values).all()) else None


def read_cells(cells: Sequence[str], where: Any, allow_missing: bool, hint: str = "") -> np.ndarray:
    """Number cells as float64, NaN for a missing one (``is_missing``) when ``allow_missing``; ``ConfigError``
    (``where(i)`` names the cell; ``hint`` follows when the cell is a missing one) for a cell that is neither
    a finite number nor, when allowed, missing."""
    gaps = np.zeros(len(cells), bool)
    if allow_missing and len(cells):
        gaps = np.isin(np.char.strip(np.array(cells, dtype=str)), sorted(MISSING_CELLS))
    present = [c for c, gap in zip(cells, gaps.tolist()) if not gap] if gaps.any() else list(cells)
    numbers = finite_numbers(present)
    if numbers is not None:         # every cell a finite number or a missing one: no call per cell
        out = np.full(len(cells), np.nan)
        out[~gaps] = numbers
        return out
    out = np.empty(len(cells), np.float64)
    for i, cell in enumerate(cells):
        value = number(cell)
        if value is None:
            if allow_missing and is_missing(cell):
                out[i] = np.nan
                continue
            raise ConfigError(f"{where(i)}: {cell_problem(cell)}{hint if is_missing(cell) else ''}")
        out[i] = value
    return out


def preparation_path(parameters: str | Path) -> Path:
    """Where a party's statistics go beside its parameters file: ``NAME.prep.json`` beside ``NAME.npz``
    (or ``NAME.pt``)."""
    path = Path(parameters)
    return path.with_name(f"{path.stem}.prep.json")


def preparation_text(prep: Preparation) -> bytes:
    """The file ``write_preparation`` (``distgrad.stage.records``) writes: ``prep`` as JSON."""
    return (json_text(prep.to_json(), strict=True, indent=1) + "\n").encode()


def read_preparation(parameters: str | Path) -> Preparation:
    """The statistics saved beside the parameters file ``parameters`` (``write_preparation``);
    ``ConfigError`` when they are missing or unreadable."""
    path = preparation_path(parameters)
    try:
        saved = parse_json(path.read_bytes(), str(path))
    except FileNotFoundError as e:
        raise ConfigError(f"{path} is missing: the [data] of this stage prepares its rows (missing, standardize, "
                          f"categorical or class_names), and their statistics were saved there beside "
                          f"{Path(parameters).name} by --save; copy it along with the parameters") from e
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the saved data preparation: {e}") from e
    except ConfigError as e:
        raise ConfigError(f"cannot read the saved data preparation: {e}") from e
    return Preparation.from_json(saved, str(path))


def prepares(table: Any) -> bool:
    """Whether a [data] table asks for any preparation (``PREPARATION_OPTIONS``)."""
    return isinstance(table, dict) and any(table.get(k) not in (None, False, "error") for k in PREPARATION_OPTIONS)
