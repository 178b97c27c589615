"""A file's labels as the training arrays take them: one value per row, cast to ``label_dtype`` without any
value changed by the cast (pure numpy; errors name the file or the row through the callables given)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from distgrad.errors import ConfigError


def label_vector(raw: Any, label_file: Callable[[], str]) -> np.ndarray:
    """The labels ``raw`` as a vector, one per row (shape ``(rows,)`` or ``(rows, 1)`` in the file);
    ``ConfigError`` naming ``label_file()`` for any other shape."""
    raw = np.asarray(raw)
    if raw.ndim == 0 or raw.size != len(raw):
        raise ConfigError(f"{label_file()}: the labels must be one value per row, shape (rows,), got "
                          f"shape {raw.shape}")
    return raw.reshape(len(raw))


def cast_labels(raw: np.ndarray, dtype: np.dtype, where: Callable[[int], str]) -> np.ndarray:
    """``raw`` as ``dtype`` (``label_dtype``); ``ConfigError`` naming the row (``where(row)``) of a value the
    cast would change: a class id beyond int64 (it would wrap around), a finite value float32 makes infinite
    (1e39)."""
    if dtype.kind == "i" and raw.dtype.kind in "uf":
        beyond = (raw >= 2.0 ** 63) | (raw < -2.0 ** 63)
        if beyond.any():
            row = int(np.argmax(beyond))
            raise ConfigError(f"{where(row)}: label {raw[row].item()!r} is not a class id: it is beyond int64's "
                              f"range")
    with np.errstate(over="ignore", invalid="ignore"):     # what a cast cannot hold is refused
        labels = raw.astype(dtype)
    if dtype.kind == "f":
        beyond = np.isfinite(raw) & ~np.isfinite(labels)
        if beyond.any():
            row = int(np.argmax(beyond))
            raise ConfigError(f"{where(row)}: label {float(raw[row])!r} is beyond {dtype}'s range")
    return labels
