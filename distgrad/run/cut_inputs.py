"""What the data owner's own loop hands its ``Cut``, checked before anything is sent: a step's activation
(float32, the interface's shape, finite unless the interface allows otherwise) or its micro-batches, the row
numbers it gives for a step (those of the shared sample order, or with ``send_rows`` its own, which cross), and
the held-out activations of an evaluation. Each refusal is a ``CutMisuse`` (a ``NonFiniteError`` for a NaN or
Inf) naming the step and what was wrong, and nothing of the step is sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from distgrad.errors import CutMisuse, NonFiniteError
from distgrad.run.cut_interface import CutSide, torch_hint
from distgrad.wire import messages as wire


def checked_activation(h: Any, shape: tuple[int, ...]) -> np.ndarray:
    """``h`` as a contiguous float32 array of the interface's activation ``shape`` for a batch, else
    ``CutMisuse``."""
    if not isinstance(h, np.ndarray) or h.dtype != np.float32:
        raise CutMisuse(f"h must be a float32 numpy array, got {type(h).__name__} "
                        f"{getattr(h, 'dtype', '')}".rstrip() + torch_hint(h))
    if h.shape != shape:
        raise CutMisuse(f"h has shape {h.shape}, the interface's activation for a batch is {shape}")
    return np.ascontiguousarray(h)


def check_micro_batches(hs: Any, mbs: int, shape: tuple[int, ...]) -> None:
    """``CutMisuse`` unless ``hs`` is a list (or tuple) of the step's ``mbs`` micro-batches, each a float32
    array of the micro-batch activation ``shape``."""
    if not isinstance(hs, (list, tuple)) or len(hs) != mbs:
        got = f"{len(hs)} of them" if isinstance(hs, (list, tuple)) else type(hs).__name__
        raise CutMisuse(f"step_micro_batches takes the step's {mbs} micro-batches as a list (the "
                        f"interface's micro_batches), got {got}")
    for i, part in enumerate(hs):
        if not isinstance(part, np.ndarray) or part.dtype != np.float32 or part.shape != shape:
            raise CutMisuse(f"micro-batch {i} must be a float32 array of shape {shape}, got "
                            f"{type(part).__name__} {getattr(part, 'dtype', '')} {getattr(part, 'shape', '')}"
                            f"{torch_hint(part)}")


def finite_activation(h: np.ndarray, allow_nonfinite: bool, stage: str, what: str) -> np.ndarray:
    """``h``, unless it holds a NaN or Inf the interface does not allow (``allow_nonfinite``): ``NonFiniteError``
    here, before it is sent, as a daemon data owner stops on its own activation (the label owner would refuse
    it). ``stage`` and ``what`` (the step, or the evaluation) name it."""
    if not allow_nonfinite and not wire.all_finite(h):
        raise NonFiniteError(f"stage {stage}: non-finite activation (h holds NaN or Inf) for {what}; "
                             f"nothing was sent. The interface does not allow_nonfinite: find where the "
                             f"encoder or its input went NaN or Inf (a learning rate too high, a bad row)")
    return h


def sent_rows(rows: Any, count: int, k: int) -> np.ndarray:
    """``send_rows``: the row numbers the loop gives for step ``k``, as the int64 array that crosses:
    integers, one per row of ``h`` (``count``), none twice (``CutMisuse`` otherwise). The label owner
    checks the rest (each row in range, a training row) and refuses the step naming the row."""
    if rows is None:
        raise CutMisuse(f"the interface has send_rows = true, so step {k} needs the row numbers h was "
                        f"computed from: cut.step(h, rows)")
    given = np.asarray(rows)
    if given.dtype.kind not in "iu" or (given.dtype.kind == "u" and given.size
                                         and given.max() > np.iinfo(np.int64).max):
        raise CutMisuse(f"the rows of step {k} must be integers (int64), got {given.dtype}")
    if given.shape != (count,):
        raise CutMisuse(f"the rows of step {k} have shape {given.shape}; send_rows takes one row number "
                        f"per row of h, shape ({count},)")
    unique, counts = np.unique(given, return_counts=True)
    if (counts > 1).any():
        raise CutMisuse(f"row {int(unique[np.argmax(counts > 1)])} appears twice in step {k}; a step trains "
                        f"on each row once")
    return given.astype(np.int64)


def check_order_rows(rows: Any, expected: np.ndarray, count: int, k: int) -> None:
    """Without ``send_rows``: ``CutMisuse`` unless the ``rows`` the loop gives for step ``k`` (one integer per
    row of ``h``, ``count`` of them) are the step's ``expected`` rows in the shared sample order."""
    given = np.asarray(rows)
    if given.ndim != 1 or given.dtype.kind not in "iu":
        raise CutMisuse(f"the rows of step {k} must be one integer per row of h, shape ({count},), got "
                        f"{given.dtype}{given.shape}")
    if given.shape != expected.shape or not np.array_equal(given, expected):
        raise CutMisuse(f"step {k} was given {_rows_differ(given, expected)}: take each step's rows from "
                        f"cut.rows(step) (or distgrad.torch.batch_sampler), which the label owner uses too; "
                        f"or, to let this loop use its own loader (its own shuffle or sampler), set "
                        f"send_rows = true in both parties' [interface]: the rows then travel with h")


def _rows_differ(given: np.ndarray, expected: np.ndarray) -> str:
    """How ``given`` rows differ from the step's ``expected`` ones, where a reader sees it: the counts when they
    differ, else the first position that does."""
    if len(given) != len(expected):
        return (f"{len(given)} rows {wire.show(given.tolist())}, but the shared sample order has {len(expected)} "
                f"for it, {wire.show(expected.tolist())}")
    at = int(np.flatnonzero(given != expected)[0])
    return (f"rows {wire.show(given.tolist())}, but the shared sample order has {wire.show(expected.tolist())}: "
            f"position {at} is row {given[at]}, the order's is {expected[at]}")


def check_held_out(h: Any, side: CutSide) -> None:
    """``CutMisuse`` unless ``h`` is a float32 array of held-out activations: the interface's activation row
    shape, at least one row, and one per held-out row of the side's [data] when it has one."""
    if not isinstance(h, np.ndarray) or h.dtype != np.float32:
        raise CutMisuse(f"h must be a float32 numpy array, got {type(h).__name__} "
                        f"{getattr(h, 'dtype', '')}".rstrip() + torch_hint(h))
    rows = len(side.data.test_rows) if side.data is not None else None
    if h.shape[1:] != side.shape[1:] or len(h) < 1 or rows is not None and len(h) != rows:
        wanted = f"({rows if rows is not None else 'rows'}, {', '.join(map(str, side.shape[1:]))})"
        raise CutMisuse(f"the held-out activations have shape {h.shape}; expected {wanted}: one row per "
                        f"held-out row{' of [data]' if rows is not None else ''}")
