"""The rows' IDs of a file data source (``id_column``), and the digest of them the parties compare.

The IDs are no feature or label: the handshake compares a digest of them
(``row_id_digest``), so parties whose files do not hold the same IDs in the
same order are refused before training.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from distgrad.config.csvfile import checked_ids
from distgrad.config.fileparts import FileParts
from distgrad.errors import ConfigError

ROW_ID_DIGEST_HEX = 16          # hex digits of the row IDs' SHA-256 a party tells the others


def row_id_digest(ids: list[str]) -> str:
    """``ROW_ID_DIGEST_HEX`` hex digits of the SHA-256 of ``ids`` in order (each ID's UTF-8 bytes with their
    length): equal for two parties whose files hold the same IDs in the same order."""
    digest = hashlib.sha256(len(ids).to_bytes(8, "little"))
    for key in ids:
        data = key.encode("utf-8")
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.hexdigest()[:ROW_ID_DIGEST_HEX]


class IdColumn:
    """The ID column ``ref`` of a file data source's ``files`` (csv: a column by index or header name, npz: a
    member of strings or integers, as ``distgrad split`` writes it); ``ref`` None: the data has none.

    Raises ``ConfigError`` at construction unless ``ref`` is one column of csv data, or one npz member,
    neither a feature (``feature_ref``) nor the labels (``label_ref``); npy data has no ID column.
    """

    def __init__(self, files: FileParts, ref: int | str | None, feature_ref: Any, label_ref: Any) -> None:
        self.files, self.ref = files, ref
        if ref is not None:
            self._check(feature_ref, label_ref)

    def _check(self, feature_ref: Any, label_ref: Any) -> None:
        """``ConfigError`` unless ``id_column`` is one column of csv data, neither a feature nor the label."""
        if self.files.kind == "npy":
            raise ConfigError("id_column names a column of csv data or a member of an npz file; npy data has no "
                              "ID column")
        if self.files.kind == "npz":
            if not isinstance(self.ref, str) or self.ref in (feature_ref, label_ref):
                raise ConfigError(f"id_column of npz data names the member of the rows' IDs, not features or "
                                  f"labels, got {self.ref!r}")
            return
        if isinstance(self.ref, bool) or not isinstance(self.ref, (int, str)):
            raise ConfigError(f"id_column is one column, by index or header name, got {self.ref!r}")
        index = self.files.csv_columns(self.ref)[0]
        for part, ref in (("features", feature_ref), ("labels", label_ref)):
            if ref is not None and index in self.files.csv_columns(ref):
                raise ConfigError(f"id_column {self.ref!r} is also one of the {part}: the ID column holds "
                                  f"the rows' IDs, not data")

    def ids(self, kept: np.ndarray | None, rows: int) -> list[str] | None:
        """The IDs of the file rows ``kept`` (None: every row), in file order, which must be ``rows``; None
        without an ID column. ``ConfigError`` for IDs that are no vector of strings or integers, an empty or
        repeated ID, or another count of IDs than rows."""
        if self.ref is None:
            return None
        files = self.files
        if files.kind == "npz":
            raw = np.asarray(files.read(self.ref))
            if raw.ndim != 1 or raw.dtype.kind not in "Uiu":
                raise ConfigError(f"{files.path}: member {self.ref!r} (id_column) must be a vector of strings or "
                                  f"integers, got {raw.dtype} of shape {raw.shape}")
            ids = checked_ids([str(key) for key in raw.tolist()], str(files.path), self.ref)
        else:
            ids = files.csv_file().ids(self.ref)
        if kept is not None:
            ids = [ids[i] for i in kept.tolist()]
        if len(ids) != rows:
            raise ConfigError(f"csv data {files.path}: {len(ids)} IDs for {rows} rows")
        return ids

    def name(self) -> str:
        """The ID column's name: its header name, or ``id`` for a column given by index without a header."""
        if isinstance(self.ref, str):
            return self.ref
        names = self.files.csv_file().first_row() if self.files.header else []
        return names[self.ref] if isinstance(self.ref, int) and self.ref < len(names) else "id"
