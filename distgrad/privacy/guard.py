"""A data owner's guard on how well the activations it sends can be inverted (pure numpy, below the wire).

``InputGuard`` keeps the ridge statistics (``leaks.RidgeStats``) of the
(input, activation) rows of the latest steps a data owner sent, split as the
data owner's ridge meter splits them (``meter.AttackMeter``: the public share
``leaks.public_rows``, a fifth of the rows, against the others), and scores
them as the label owner's best linear decoder with that public share would:
the R^2 of the private rows' inputs reconstructed by the best ridge decoder
fitted on the public rows (``leaks.ridge_r2``). A label owner that trains the
data owner's layers towards its own decoder (feature-space hijacking) raises
it; NoPeek lowers it. Its ``state`` goes into the data owner's checkpoints, so
a resumed run judges as the uninterrupted one.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Mapping

import numpy as np

from distgrad.privacy import leaks
from distgrad.privacy.meter import keys_array, read_keys

MIN_ROWS_PER_WIDTH = 4      # the guard judges once it holds this many rows per activation element (+1) ...
MIN_ROWS = 128              # ... and at least this many: fewer would fit the decoder to noise


def rows_needed(width: int) -> int:
    """The rows the guard holds before it scores activations of ``width`` elements a row: ``MIN_ROWS``, and
    ``MIN_ROWS_PER_WIDTH`` per element (+1). A run that sends fewer in all is never judged."""
    return max(MIN_ROWS, MIN_ROWS_PER_WIDTH * (width + 1))


Sent = tuple[np.ndarray, np.ndarray, np.ndarray, tuple[leaks.RidgeStats, leaks.RidgeStats]]
"""A micro-batch as the guard keeps it: its input rows, activation rows, which rows are public, and the ridge
statistics of its (public, private) rows."""


def _sent(x: np.ndarray, z: np.ndarray, public: np.ndarray) -> Sent:
    halves = (leaks.RidgeStats(), leaks.RidgeStats())
    for half, chosen in zip(halves, (public, ~public)):
        if chosen.any():
            half.add(z[chosen], x[chosen])
    return x, z, public, halves


class InputGuard:
    """The inversion R^2 of the rows a data owner sent over its latest steps (``score``), against ``max_r2``
    from step ``after`` + 1 on (``judges``: the first steps start from a layer's random initial values, which
    any decoder inverts well, before a defense such as NoPeek has acted).

    Fed each micro-batch as it is sent (``observe``), it scores the latest micro-batches whose rows together
    are the fewest that reach ``need`` rows (at least ``MIN_ROWS``, and ``MIN_ROWS_PER_WIDTH`` per activation
    element), so the score follows what is sent now. ``score`` is None until that many rows are held. A
    micro-batch sent again replaces the first. Told which steps are applied (``applied``), it forgets a
    micro-batch only once the applied steps' rows after it reach ``need`` (a step in flight may be rolled
    back and sent again); never told, every micro-batch sent counts."""

    def __init__(self, max_r2: float, after: int = 0) -> None:
        if not 0 < max_r2 <= 1:
            raise ValueError(f"'input_guard' max_r2 must be in (0, 1], got {max_r2}")
        if after < 0:
            raise ValueError(f"'input_guard' after must be a step count >= 0, got {after}")
        self.max_r2, self.after = max_r2, after
        self.need = MIN_ROWS
        self.final: int | None = None        # the last step applied (None: every step sent counts as applied)
        self._steps: OrderedDict[tuple[int, int], Sent] = OrderedDict()

    def observe(self, step: int, mb: int, inputs: np.ndarray, activations: np.ndarray,
                rows: np.ndarray | None = None) -> None:
        """Micro-batch ``mb`` of ``step``: its input rows, the activation rows sent for them and their row
        numbers (None: unnumbered; the public share is then every ``leaks.PUBLIC_EVERY``-th row)."""
        x, z = np.array(inputs), np.array(activations)
        if len(x) != len(z) or (rows is not None and len(rows) != len(z)):
            raise ValueError(f"{len(x)} input rows for {len(z)} activation rows")
        public = leaks.public_rows(rows) if rows is not None else np.arange(len(z)) % leaks.PUBLIC_EVERY == 0
        self._steps.pop((step, mb), None)
        self._steps[(step, mb)] = _sent(x, z, public)
        self.need = rows_needed(int(np.prod(z.shape[1:])))
        self._forget()

    def applied(self, step: int) -> None:
        """Step ``step`` is applied: what it sent is final (a rollback returns to it, or loads a checkpoint's
        ``state``)."""
        self.final = step
        self._forget()

    def _forget(self) -> None:
        """Drop the oldest micro-batches while the applied ones after each still hold ``need`` rows."""
        counts = [(key[0], self._count(key)) for key in self._steps]
        after = sum(count for step, count in counts[1:] if self.final is None or step <= self.final)
        for step, count in counts[1:]:
            if after < self.need:
                break
            self._steps.popitem(last=False)
            after -= count if self.final is None or step <= self.final else 0

    def _count(self, key: tuple[int, int]) -> int:
        return sum(half.count for half in self._steps[key][3])

    def score(self) -> float | None:
        """The inversion R^2 of the latest micro-batches that hold ``need`` rows (None: too few rows yet)."""
        keys, held = list(self._steps), 0
        start = len(keys)
        while start > 0 and held < self.need:
            start -= 1
            held += self._count(keys[start])
        if held < self.need:
            return None
        public, private = leaks.RidgeStats(), leaks.RidgeStats()
        for key in keys[start:]:
            a, b = self._steps[key][3]
            public, private = public.merged(a), private.merged(b)
        try:
            return leaks.ridge_r2(public, private)
        except (ValueError, np.linalg.LinAlgError):
            return None

    def judges(self, step: int) -> bool:
        """Whether the rows of ``step`` are judged: every step after the first ``after``."""
        return step > self.after

    def state(self, step: int) -> dict[str, np.ndarray]:
        """What the guard holds after ``step`` as arrays: ``need``, and the micro-batches of the steps up to it
        that it keeps (``keys``; ``inputs/I``, ``activations/I``, ``public/I``: the rows of the I-th), about
        ``need`` rows and the rows of one step more (the ridge statistics are computed again from them)."""
        keys = [key for key in self._steps if key[0] <= step]
        arrays = {"need": np.array(self.need, np.int64), "keys": keys_array(keys)}
        for i, key in enumerate(keys):
            x, z, public, _ = self._steps[key]
            arrays[f"inputs/{i}"], arrays[f"activations/{i}"], arrays[f"public/{i}"] = x, z, public
        return arrays

    def load_state(self, arrays: Mapping[str, np.ndarray], step: int) -> None:
        """The guard as ``state`` gave it after ``step``, instead of this one; ``ValueError`` when ``arrays``
        are not such a state."""
        kept: OrderedDict[tuple[int, int], Sent] = OrderedDict()
        for i, key in enumerate(read_keys(arrays)):
            names = (f"inputs/{i}", f"activations/{i}", f"public/{i}")
            if any(name not in arrays for name in names):
                raise ValueError(f"micro-batch {key} without its {', '.join(names)}")
            x, z, public = (np.array(arrays[name]) for name in names)
            if x.ndim < 1 or len(x) != len(z) or public.shape != (len(z),) or public.dtype != bool:
                raise ValueError(f"micro-batch {key}: input rows {x.shape}, activation rows {z.shape} and public "
                                 f"rows {public.shape} ({public.dtype}) do not pair")
            kept[key] = _sent(x, z, public)
        self.need = int(arrays.get("need", MIN_ROWS))
        self._steps, self.final = kept, step
        self._forget()
