"""Data sources. Each stage asks only for its own part.

A source answers, for a 1-based step number, the features (the first stage's
input) and the targets (the label owner's part). Batches are a pure function
of the step, so the data position is just the step counter: a stage that
resumes at step ``k`` sees exactly the batch it would have seen.

This module is the registry of the ``[data]`` kinds (``build_data``); the
sources live in their own modules, and every name is importable from here:

* ``batches``: the contract (``DataSource``), the held-out split and the walk
  of numbered rows in batches and epochs (``RowBatches``);
* ``generated``: the seed's ``Ramp`` and the synthetic tables;
* ``arrayfile``: rows read from npz, npy or csv files (``ArrayFile``), with
  its parts ``fileparts`` (reading), ``rowids`` (the rows' IDs) and
  ``preparedtable`` (missing cells, standardize, categories, class names);
* ``views``: a party's columns, and labels under label DP, over a source.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from distgrad.config.arrayfile import ArrayFile
from distgrad.config.batches import DataSource, RowBatches, held_out_split
from distgrad.config.fileparts import NPY_MAGIC, ZIP_MAGIC
from distgrad.config.generated import Ramp, SyntheticClassification, SyntheticRegression
from distgrad.config.rowids import ROW_ID_DIGEST_HEX, row_id_digest
from distgrad.config.views import ColumnView, RandomizedLabels, ReleasedLabels
from distgrad.errors import ConfigError

__all__ = ["ArrayFile", "ColumnView", "DataSource", "NPY_MAGIC", "ROW_ID_DIGEST_HEX", "Ramp", "RandomizedLabels",
           "ReleasedLabels", "RowBatches", "SyntheticClassification", "SyntheticRegression", "ZIP_MAGIC",
           "build_data", "held_out_split", "row_id_digest"]

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
