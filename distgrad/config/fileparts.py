"""Reading one part of a file data source (``npz``, ``npy`` or ``csv``) as the file stores it, and naming its rows.

A part is the features, the labels or the rows' IDs: an npz member, an npy
file, or csv columns. A part is read alone and without unpickling: numpy
never loads an array of Python objects here, and a damaged or foreign file is
a ``ConfigError`` naming the file (and member), never a traceback. Errors
about a value name where it is (``where_row``): the csv file's line and
column, or the npz/npy file's data row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from distgrad.config.csvfile import CsvColumns, number
from distgrad.config.npzfile import READ_ERRORS
from distgrad.errors import ConfigError

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


class FileParts:
    """Where a file data source's parts are and how each is read.

    ``kind`` is ``npz``, ``npy`` or ``csv``; ``path`` the npz or csv file
    (None for npy, whose parts name their own files, relative to
    ``base_dir``); ``header``: a csv file's first line names its columns.
    A part is given by its ``ref``: an npz member's name, an npy file's path,
    or csv columns by index or header name.
    """

    def __init__(self, kind: str, base_dir: Path, path: Path | None, header: bool) -> None:
        self.kind, self.base_dir, self.path, self.header = kind, base_dir, path, header
        self.csv = CsvColumns(path, header) if kind == "csv" and path is not None else None

    def check_header_line(self) -> None:
        """``ConfigError`` when ``header = true`` but the csv file's first line holds only numbers (a data row
        that would be lost)."""
        if self.csv is not None and self.header and self.csv.path.is_file():
            first = self.csv.first_row()
            if first and all(number(cell) is not None for cell in first):
                raise ConfigError(f"csv data {self.path}: header = true, but line 1 holds only numbers, a row of "
                                  f"data that would be lost: give the file its header line (or header = false)")

    def check_apart(self, feature_ref: Any, label_ref: Any) -> None:
        """``ConfigError`` when the labels are also among the features (a csv column, an npz member, an npy
        file): the stage that reads the features would hold the labels, which only the label owner reads."""
        if self.kind == "csv":
            if isinstance(label_ref, (list, bool)) or not isinstance(label_ref, (int, str)):
                return                      # refused where the labels are read, with the reason
            shared = self.csv is not None and self.csv.path.is_file() and \
                self.csv_columns(label_ref)[0] in self.csv_columns(feature_ref)
        elif self.kind == "npy":
            shared = (self.base_dir / str(label_ref)).resolve() == (self.base_dir / str(feature_ref)).resolve()
        else:
            shared = label_ref == feature_ref
        if shared:
            raise ConfigError(f"{self.kind} data: labels {label_ref!r} are also among the features "
                              f"{feature_ref!r}: the stage that reads the features would hold the labels, "
                              f"which only the label owner may read")

    def where_row(self, row: int, ref: Any) -> str:
        """How an error names data row ``row`` (from 0) of part ``ref``: the file and its line for csv."""
        if self.kind == "csv":
            csv_file = self.csv_file()
            column = csv_file.column_label(self.csv_columns(ref)[0])
            return f"csv data {self.path} line {csv_file.data()[0][row]}, {column}"
        return f"{self.path if self.kind == 'npz' else self.base_dir / str(ref)}: data row {row + 1}"

    def label_file(self, label_ref: Any) -> str:
        """How an error names the labels' file (and member)."""
        return f"{self.path} member {label_ref!r}" if self.kind == "npz" else f"{self.file(label_ref)}"

    def file(self, ref: Any) -> Path:
        """The file that holds part ``ref``; ``ConfigError`` when there is none."""
        path = self.path if self.kind != "npy" else self.base_dir / str(ref)
        if path is None or not path.is_file():
            raise ConfigError(f"data file {path} not found")
        return path

    def read(self, ref: Any) -> np.ndarray:
        """One part (features or labels) from the file(s), and nothing else; ``ConfigError`` for an array numpy
        cannot load without unpickling (Python objects, as a pandas column of text is saved)."""
        if self.kind in ("npz", "npy"):
            return self.array(ref)
        return self.read_csv(self.csv_columns(ref))

    def array(self, ref: Any, header_only: bool = False) -> np.ndarray:
        """Part ``ref`` of npz or npy data, read without unpickling (``header_only``: an empty array of its
        shape and dtype, read from the ``.npy`` header alone). ``ConfigError`` naming the file (and member) for a
        file that is no ``.npy`` / ``.npz``, one that is damaged or cut short, or an array of Python objects."""
        path = self.file(None if self.kind == "npz" else ref)
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
            return self._member(path, ref, where, header_only)
        except ConfigError:
            raise
        except READ_ERRORS as e:
            raise ConfigError(f"{where} cannot be read: the file is damaged or not what {writer} writes "
                              f"({type(e).__name__}: {e})") from e

    def _member(self, path: Path, ref: Any, where: str, header_only: bool) -> np.ndarray:
        """Member ``ref`` of the npz file at ``path`` (``array``'s npz case; ``where`` names it in errors)."""
        try:
            npz = np.load(path, allow_pickle=False)
        except READ_ERRORS as e:
            raise ConfigError(f"{path} is not a readable .npz archive ({type(e).__name__}: {e})") from e
        with npz:
            self.check_member(npz, ref)
            names = set(npz.zip.namelist())
            with npz.zip.open(f"{ref}.npy" if f"{ref}.npy" in names else ref) as member:
                header = _npy_header(member)
            _refuse_objects(where, header[2])
            return _shaped(header) if header_only else npz[ref]

    def check_member(self, npz: Any, ref: Any) -> None:
        """``ConfigError`` unless ``ref`` names an array of the npz file, listing the ones it has."""
        if not isinstance(ref, str) or ref not in npz.files:
            raise ConfigError(f"{self.path} has no array {ref!r}; its arrays are {sorted(npz.files)}")

    def csv_file(self) -> CsvColumns:
        """The csv file, once it is known to exist (``ConfigError`` if not)."""
        self.file(None)
        assert self.csv is not None
        return self.csv

    def csv_columns(self, ref: Any) -> list[int]:
        """The csv columns (indices from 0) that ``ref`` names (``CsvColumns.indices``)."""
        return self.csv_file().indices(ref)

    def read_csv(self, columns: list[int]) -> np.ndarray:
        """The csv file's ``columns`` as numbers (``CsvColumns.numbers``)."""
        return self.csv_file().numbers(columns)
