"""Where a prediction's results go (``distgrad predict``, the label owner): its output file (``.npy``, or
``.csv`` with the rows' IDs or numbers first) and, with ``--output-scores``, the rows' scores, written whole
(``write_atomic``) and never over a file already there unless told to (``--force``: ``check_output`` before
anything is served, ``_place_new`` when it writes). Text that reaches the CSV (IDs, the ID column's name,
class names) is written as cells no spreadsheet evaluates and no terminal obeys (``text_cell``).
"""

from __future__ import annotations

import csv
import io
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from distgrad.errors import ConfigError, OutputWriteError
from distgrad.stage.records import write_atomic, writing


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")    # a spreadsheet takes a cell beginning so for a formula


def text_cell(text: str) -> str:
    """``text`` (a row's ID, the ID column's name) as a CSV cell that stays text: every control or other
    non-printable character written as its Python escape (``\\x1b``, ``\\t``, ``\\n``, ``\\u202e``), so
    none reaches a terminal, and a cell beginning with ``= + - @``, a tab or a carriage return (after
    spaces) prefixed with a single quote, so a spreadsheet shows it rather than evaluating it."""
    escaped = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return "'" + escaped if text.lstrip(" ").startswith(FORMULA_STARTS) else escaped


def _place_new(whole: Path, path: Path) -> None:
    """Put the written file ``whole`` at ``path``, which must not exist: a hard link, which is atomic and
    refused when ``path`` is there; where the file system has no hard links, a rename once ``path`` is
    found absent. ``OutputWriteError`` when ``path`` is there (another process wrote it meanwhile)."""
    try:
        os.link(whole, path)
        return
    except FileExistsError:
        pass
    except OSError:                           # no hard links here (some network or FAT file systems)
        if not (path.exists() or path.is_symlink()):
            os.replace(whole, path)
            return
    raise OutputWriteError(f"cannot write the predictions to {path}: the file appeared while this prediction ran "
                           f"(another process wrote it); it is left as it is")


def check_output(output: Path, output_scores: bool, overwrite: bool) -> None:
    """Refuse (``ConfigError``), before anything is served, an ``output`` that cannot be written: its folder
    missing, a folder of that name, or a file already there (another prediction's, say: ``NAME.scores.npy``
    too with ``output_scores`` and ``.npy``) unless ``overwrite`` (``--force``)."""
    if not output.parent.is_dir():
        raise ConfigError(f"--output {output}: the folder {output.parent} does not exist")
    paths = [output, scores_path(output)] if output_scores and output.suffix == ".npy" else [output]
    for path in paths:
        if path.is_dir():
            raise ConfigError(f"--output {output}: {path} is a folder; give a file name")
        if (path.exists() or path.is_symlink()) and not overwrite:
            raise ConfigError(f"--output {output}: {path} exists (another prediction's file?); give another name, "
                              f"or --force to overwrite it")


def scores_path(output: Path) -> Path:
    """Where an ``.npy`` output's scores go: ``NAME.scores.npy`` beside ``NAME.npy``."""
    return output.with_name(f"{output.stem}.scores.npy")


def _joined(scores: Mapping[int, np.ndarray], numbers: range) -> np.ndarray | None:
    """The chunks' scores in chunk order; None without scores."""
    return np.concatenate([scores[n] for n in numbers]) if scores else None


class PredictionFile:
    """The label owner's ``output`` (None on a middle stage, which writes nothing): ``write`` puts the
    predictions there whole, and beside an ``.npy`` their scores, never over a file already there unless
    ``overwrite`` (``--force``). Class ids are written as ``classes`` (the label owner's own class names by id,
    None: as ids), or as the names that travelled in the hello."""

    def __init__(self, output: Path | None, overwrite: bool, classes: list[str] | None,
                 log: logging.Logger) -> None:
        self.output, self.overwrite, self.classes, self.log = output, overwrite, classes, log

    def write_chunks(self, chunks: int, predictions: Mapping[int, np.ndarray], ids: Mapping[int, list[str]],
                     scores: Mapping[int, np.ndarray], id_name: str | None, classes: list[str] | None = None) -> int:
        """Write the predictions of chunks 1..``chunks`` in order, with their rows' IDs and scores where kept
        (``write``; ``classes``: the data owner's class names when the labels travel); returns the rows
        written."""
        numbers = range(1, chunks + 1)
        return self.write(np.concatenate([np.atleast_1d(predictions[n]) for n in numbers]), id_name,
                          [k for n in numbers for k in ids.get(n, [])], _joined(scores, numbers), classes)

    def write(self, predictions: np.ndarray, id_name: str | None = None, ids: list[str] | None = None,
              scores: np.ndarray | None = None, travelled: list[str] | None = None) -> int:
        """Write the predictions to ``output`` (``.npy``, or ``.csv`` whose first column is the rows' IDs,
        headed ``id_name``, both as ``text_cell`` writes them, or without IDs ``row``, the row's number from
        0), and their ``scores`` when
        given (CSV columns ``score_K``; beside an ``.npy``, ``NAME.scores.npy``); returns rows. Class ids
        are written as the class names: the label owner's own, or those that ``travelled`` in the hello."""
        assert self.output is not None
        classes = self.classes if travelled is None else travelled
        if classes is not None:
            predictions = self._named(predictions, classes)
        if self.output.suffix == ".npy":
            self._write_npy(self.output, predictions, scores)
        else:
            self._write_csv(self.output, predictions, id_name, ids, scores, classes)
        self.log.info("wrote %d predictions to %s", len(predictions), self.output)
        return len(predictions)

    def _write_npy(self, output: Path, predictions: np.ndarray, scores: np.ndarray | None) -> None:
        """The predictions as ``output``, and their ``scores`` (when given) beside it; where the predictions
        cannot be written, scores this prediction wrote are removed (no half pair left)."""
        if scores is not None:
            self._put(scores_path(output), lambda f: np.save(f, scores, allow_pickle=False))
        try:
            self._put(output, lambda f: np.save(f, predictions, allow_pickle=False))
        except OutputWriteError:
            if scores is not None and not self.overwrite:     # written by this prediction: no half pair left
                scores_path(output).unlink(missing_ok=True)
            raise

    def _write_csv(self, output: Path, predictions: np.ndarray, id_name: str | None, ids: list[str] | None,
                   scores: np.ndarray | None, classes: list[str] | None) -> None:
        """The predictions as the CSV ``output``: the rows' IDs (or numbers) first, then the predictions, then
        the ``scores`` (headed with the ``classes`` when there is one score per class)."""
        table = predictions.reshape(len(predictions), -1)
        columns = ["prediction"] if table.shape[1] == 1 else [f"prediction_{i}" for i in range(table.shape[1])]
        fmt = "%d" if predictions.dtype.kind == "i" else "%s" if predictions.dtype.kind == "U" else "%.9g"
        cells = [[text_cell(v) if isinstance(v, str) else fmt % v for v in row] for row in table.tolist()]
        if scores is not None:
            columns += ([f"score_{text_cell(c)}" for c in classes]
                        if classes is not None and len(classes) == scores.shape[1]
                        else [f"score_{i}" for i in range(scores.shape[1])])
            cells = [row + ["%.9g" % v for v in values] for row, values in zip(cells, scores)]
        keys = ([text_cell(key) for key in ids] if id_name is not None and ids is not None
                else [str(i) for i in range(len(table))])
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([text_cell(id_name) if id_name is not None else "row", *columns])
        writer.writerows([key, *row] for key, row in zip(keys, cells))
        text = out.getvalue().encode()
        self._put(output, lambda f: f.write(text))

    def _put(self, path: Path, write: Callable[[Any], object]) -> None:
        """Write ``path`` whole through ``write(file)``, never seen half written (``write_atomic``); unless
        ``overwrite``, a file that is there already (written since this stage checked at its start) is left as
        it is. Raises ``OutputWriteError`` naming ``path``: the prediction fails, its senders are told."""
        with writing(path, "the predictions to"):
            if self.overwrite:
                write_atomic(path, write)
                return
            whole = write_atomic(path.with_name(f".{path.name}.{os.getpid()}.whole"), write)
            try:
                _place_new(whole, path)
            finally:
                whole.unlink(missing_ok=True)

    @staticmethod
    def _named(predictions: np.ndarray, classes: list[str]) -> np.ndarray:
        """Class ids as the class names (a text array); ``ConfigError`` for an id without one (a model with
        more outputs than the training labels had classes)."""
        ids = np.asarray(predictions)
        if ids.dtype.kind not in "iu" or (len(ids) and not 0 <= int(ids.min()) <= int(ids.max()) < len(classes)):
            raise ConfigError(f"the predictions are not class ids 0 to {len(classes) - 1}, the classes "
                              f"{classes[:12]} the labels named")
        return np.array(classes, dtype=str)[ids]
