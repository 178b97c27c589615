"""CSV files of numbers (and text IDs), read strictly, so that no row is ever lost or guessed.

* UTF-8 text; a byte-order mark at the start (what spreadsheet programs write
  as "CSV UTF-8") is dropped. Fields are quoted with ``"`` as the csv module
  writes them; blank lines are skipped. No line may have more fields than the
  first (the header, where there is one): an unquoted comma in a field would
  shift every field after it.
* A header is taken only where one is declared (``header = true``) or, where
  a reader may guess (``looks_like_header``), when every field of the first
  line is a name (``is_name``; or empty): a line of numbers with one bad field
  is a data row whose bad field is refused, never a header that silently
  drops the row.
* A number is ASCII decimal or scientific text (``1``, ``-2.5``, ``3e-4``;
  spaces around it allowed) of a finite value: ``0x13``, ``nan3``, ``1_000``,
  a NUL byte, ``nan``, ``inf`` and ``1e400`` (too large for float64) are
  refused naming the file's line (1-based, as an editor counts, the header
  line included), the column (1-based) and its header name.
"""

from __future__ import annotations

import csv
import math
import os
import stat
from pathlib import Path
from typing import IO, Any

import numpy as np

from distgrad.errors import ConfigError

CELL_SHOWN_MAX = 40          # characters of a refused field quoted in an error


def open_csv(path: Path) -> IO[str]:
    """``path`` opened to read as CSV text (UTF-8, a leading byte-order mark dropped). ``ConfigError`` unless
    it is a regular file: a device (``/dev/zero``), a pipe or a folder is never read (without bound, or
    blocking); ``OSError`` when it cannot be opened. Every reader of a CSV table opens it so."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))    # a pipe must not hold the open
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path} is not a regular file (a folder, a device or a pipe): give a CSV file")
        return open(fd, newline="", encoding="utf-8-sig", closefd=True)
    except BaseException:
        os.close(fd)
        raise


def number(cell: str) -> float | None:
    """``cell`` as a finite float, or None when it is no number (``parse_cell`` says why)."""
    text = cell.strip()
    if not text or not text.isascii() or "_" in text:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _number_like(text: str) -> bool:
    """``text`` reads as a float to Python, finite or not (``nan``, ``inf``, ``1e400``, ``1_0``, ``١``)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def is_name(cell: str) -> bool:
    """Whether ``cell`` can be a column's name in a header: printable text that is no number, not even a
    non-finite one, and does not begin as a number does (a digit, a sign or a point: ``0x13`` is a damaged
    number, not a name)."""
    text = cell.strip()
    return bool(text) and text.isprintable() and not _number_like(text) and text[0] not in "0123456789+-."


def looks_like_header(cells: list[str]) -> bool:
    """A first line is a header, when none is declared, only if every one of its fields is a name (or empty,
    as the unnamed index column pandas writes: an empty field is never data either), one at least."""
    return any(is_name(cell) for cell in cells) and all(is_name(cell) or not cell.strip() for cell in cells)


def shown(cell: str) -> str:
    """``cell`` quoted for an error message: control characters escaped, at most ``CELL_SHOWN_MAX`` characters."""
    return repr(cell if len(cell) <= CELL_SHOWN_MAX else cell[:CELL_SHOWN_MAX] + "...")


def cell_problem(cell: str) -> str:
    """Why ``cell`` is not a number a data file may hold."""
    text = cell.strip()
    if not text:
        return "is empty, not a number"
    if text.isascii() and "_" not in text and _number_like(text):
        return f"{shown(cell)} is not a finite number (values must be finite, within float64's range)"
    return f"{shown(cell)} is not a number"


class CsvColumns:
    """A CSV file read column by column: numbers (``numbers``) or text (``texts``). ``header``: the first
    line names the columns, which may then be given by name (``indices``). The file is parsed once."""

    def __init__(self, path: Path, header: bool) -> None:
        self.path, self.header = path, header
        self._records: tuple[list[int], list[list[str]]] | None = None
        self._shortest: int | None = None      # the fewest fields of a data row (once ``_check_width`` read them)

    def records(self) -> tuple[list[int], list[list[str]]]:
        """Every non-blank line's 1-based line number in the file and its fields (the header's included)."""
        if self._records is None:
            lines: list[int] = []
            rows: list[list[str]] = []
            try:
                with open_csv(self.path) as f:
                    reader = csv.reader(f)
                    while True:
                        start = reader.line_num + 1
                        row = next(reader, None)
                        if row is None:
                            break
                        if row and not (len(row) == 1 and not row[0].strip()):
                            lines.append(start)
                            rows.append(row)
            except OSError as e:
                raise ConfigError(f"cannot read {self.path}: {e.strerror or e}") from e
            except UnicodeDecodeError as e:
                raise ConfigError(f"{self.path} is not UTF-8 text (byte {e.start}): save it as CSV UTF-8") from e
            except csv.Error as e:
                raise ConfigError(f"{self.path} line {reader.line_num}: not readable as CSV: {e}") from e
            self._records = (lines, rows)
        return self._records

    def first_row(self) -> list[str]:
        """The fields of the first non-blank line (the header when there is one); [] for an empty file. Reads
        no further than that line unless the file was parsed already."""
        if self._records is None:
            try:
                with open_csv(self.path) as f:
                    return next((row for row in csv.reader(f) if row and not (len(row) == 1 and not row[0].strip())),
                                [])
            except (OSError, UnicodeDecodeError, csv.Error, ConfigError):
                pass                    # records() says what is wrong, naming the line
        rows = self.records()[1]
        return rows[0] if rows else []

    def names(self) -> list[str] | None:
        """The header's column names (spaces around them dropped); None without a header."""
        return [name.strip() for name in self.first_row()] if self.header else None

    def data(self) -> tuple[list[int], list[list[str]]]:
        """The data lines (the header left out): their line numbers and fields."""
        lines, rows = self.records()
        skip = int(self.header)
        return lines[skip:], rows[skip:]

    def column_label(self, column: int) -> str:
        """``column N`` (1-based) and, with a header, ``'NAME'``: how an error names column index ``column``."""
        names = self.names() if self.header else None
        if names is not None and column < len(names):
            return f"column {column + 1} {names[column]!r}"
        return f"column {column + 1}"

    def indices(self, ref: Any) -> list[int]:
        """Column indices of ``ref``: an index or a header name, or a list of them."""
        refs = ref if isinstance(ref, list) else [ref]
        if all(isinstance(r, int) for r in refs):
            return refs
        if not self.header:
            raise ConfigError("csv columns given by name need header = true")
        names = self.names() or []
        missing = [r for r in refs if isinstance(r, str) and r not in names]
        if missing:
            raise ConfigError(f"csv column not found: {', '.join(map(repr, missing))}; {self.path}'s header has "
                              f"{names}")
        twice = [r for r in refs if isinstance(r, str) and names.count(r) > 1]
        if twice:
            raise ConfigError(f"csv column {twice[0]!r} is named more than once in {self.path}'s header {names}")
        return [names.index(r) if isinstance(r, str) else r for r in refs]

    def _check_width(self, columns: list[int]) -> None:
        lines, rows = self.data()
        if not rows:
            raise ConfigError(f"csv data {self.path} holds no data rows")
        if self._shortest is None:          # the rows' widths are checked once, whatever the columns asked for
            first_line, first = self.records()[0][0], self.records()[1][0]
            wide = next((i for i, row in enumerate(rows) if len(row) > len(first)), None)
            if wide is not None:        # a text field's unquoted comma: every field after it would be misread
                raise ConfigError(f"csv data {self.path} line {lines[wide]}: {len(rows[wide])} fields, but line "
                                  f"{first_line} has {len(first)}: is a comma inside a field that is not quoted?")
            self._shortest = min(len(row) for row in rows)
        need = max(columns) + 1
        short = None if need <= self._shortest else next(i for i, row in enumerate(rows) if len(row) < need)
        if short is not None:
            raise ConfigError(f"csv data {self.path} line {lines[short]}: {len(rows[short])} fields, so no "
                              f"{self.column_label(need - 1)}")

    def numbers(self, columns: list[int]) -> np.ndarray:
        """The ``columns`` as float64 ``(rows, len(columns))``; ``ConfigError`` naming the line and column of
        a field that is no finite number (module doc)."""
        if not columns:
            raise ConfigError(f"csv data {self.path}: name at least one column")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in columns):
            raise ConfigError(f"csv data {self.path}: columns are indices from 0 or header names, got {columns}")
        self._check_width(columns)
        lines, rows = self.data()
        out = np.empty((len(rows), len(columns)), np.float64)
        for j, column in enumerate(columns):
            cells = [row[column] for row in rows]
            try:            # numpy parses as float() does; what float() takes beyond ``number`` is caught after
                out[:, j] = np.array(cells, dtype=np.float64)
                joined = "".join(cells)
                good = joined.isascii() and "_" not in joined and bool(np.isfinite(out[:, j]).all())
            except ValueError:
                good = False
            if not good:
                bad = next(i for i, cell in enumerate(cells) if number(cell) is None)
                raise ConfigError(f"csv data {self.path} line {lines[bad]}, {self.column_label(column)} (data row "
                                  f"{bad + 1}): {cell_problem(cells[bad])}")
        return out

    def texts(self, column: int) -> tuple[list[int], list[str]]:
        """Column ``column``'s fields as text, one per data row, and the rows' line numbers."""
        self._check_width([column])
        lines, rows = self.data()
        return lines, [row[column] for row in rows]

    def ids(self, ref: Any) -> list[str]:
        """The ID column ``ref`` (an index or a header name): one distinct, non-empty ID per row."""
        lines, keys = self.texts(self.indices(ref)[0])
        return checked_ids(keys, f"csv data {self.path}", ref, lines)


def checked_ids(ids: list[str], where: str, ref: Any, lines: list[int] | None = None) -> list[str]:
    """``ids`` if each is non-empty and names one row, else ``ConfigError`` naming ``where`` and the rows (by
    ``lines``, the file's line numbers, where given; else as data rows from 1)."""
    def row_name(i: int) -> str:
        return f"line {lines[i]}" if lines is not None else f"data row {i + 1}"

    seen: dict[str, int] = {}
    for i, key in enumerate(ids):
        if key == "":
            raise ConfigError(f"{where}: {row_name(i)} has an empty ID (id_column {ref!r})")
        if key in seen:
            plural = "lines" if lines is not None else "data rows"
            first = lines[seen[key]] if lines is not None else seen[key] + 1
            again = lines[i] if lines is not None else i + 1
            raise ConfigError(f"{where}: ID {shown(key)} is in {plural} {first} and {again} (id_column {ref!r}); "
                              f"each ID must name one row")
        seen[key] = i
    return ids
