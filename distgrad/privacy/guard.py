"""A data owner's guard on how well the activations it sends can be inverted (pure numpy, below the wire).

``InputGuard`` keeps the ridge statistics (``leaks.RidgeStats``) of the
(input, activation) rows of the latest steps a data owner sent, split as the
data owner's ridge meter splits them (``meter.AttackMeter``: the public share
``leaks.public_rows``, a fifth of the rows, against the others), and scores
them as the label owner's best linear decoder with that public share would:
the R^2 of the private rows' inputs reconstructed by the best ridge decoder
fitted on the public rows (``leaks.ridge_r2``). A label owner that trains the
data owner's layers towards its own decoder (feature-space hijacking) raises
it; NoPeek lowers it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from distgrad.privacy import leaks

MIN_ROWS_PER_WIDTH = 4      # the guard judges once it holds this many rows per activation element (+1) ...
MIN_ROWS = 128              # ... and at least this many: fewer would fit the decoder to noise


class InputGuard:
    """The inversion R^2 of the rows a data owner sent over its latest steps (``score``), against ``max_r2``
    from step ``after`` + 1 on (``judges``: the first steps start from a layer's random initial values, which
    any decoder inverts well, before a defense such as NoPeek has acted).

    Fed each micro-batch as it is sent (``observe``), it keeps the steps whose rows together are the fewest
    that reach ``need`` rows (at least ``MIN_ROWS``, and ``MIN_ROWS_PER_WIDTH`` per activation element), so the
    score follows what is sent now. ``score`` is None until that many rows are held. A micro-batch sent again
    replaces the first."""

    def __init__(self, max_r2: float, after: int = 0) -> None:
        if not 0 < max_r2 <= 1:
            raise ValueError(f"'input_guard' max_r2 must be in (0, 1], got {max_r2}")
        if after < 0:
            raise ValueError(f"'input_guard' after must be a step count >= 0, got {after}")
        self.max_r2, self.after = max_r2, after
        self.need = MIN_ROWS
        self._steps: OrderedDict[tuple[int, int], tuple[leaks.RidgeStats, leaks.RidgeStats]] = OrderedDict()

    def observe(self, step: int, mb: int, inputs: np.ndarray, activations: np.ndarray,
                rows: np.ndarray | None = None) -> None:
        """Micro-batch ``mb`` of ``step``: its input rows, the activation rows sent for them and their row
        numbers (None: unnumbered; the public share is then every ``leaks.PUBLIC_EVERY``-th row)."""
        x, z = np.asarray(inputs), np.asarray(activations)
        if len(x) != len(z) or (rows is not None and len(rows) != len(z)):
            raise ValueError(f"{len(x)} input rows for {len(z)} activation rows")
        public = leaks.public_rows(rows) if rows is not None else np.arange(len(z)) % leaks.PUBLIC_EVERY == 0
        halves = (leaks.RidgeStats(), leaks.RidgeStats())
        for half, chosen in zip(halves, (public, ~public)):
            if chosen.any():
                half.add(z[chosen], x[chosen])
        self._steps.pop((step, mb), None)
        self._steps[(step, mb)] = halves
        width = int(np.prod(z.shape[1:])) + 1
        need = max(MIN_ROWS, MIN_ROWS_PER_WIDTH * width)
        while len(self._steps) > 1 and self._held() - self._count(next(iter(self._steps))) >= need:
            self._steps.popitem(last=False)
        self.need = need

    def _count(self, key: tuple[int, int]) -> int:
        return sum(half.count for half in self._steps[key])

    def _held(self) -> int:
        return sum(self._count(key) for key in self._steps)

    def score(self) -> float | None:
        """The inversion R^2 of the rows held (None: too few rows yet)."""
        if not self._steps or self._held() < self.need:
            return None
        public, private = leaks.RidgeStats(), leaks.RidgeStats()
        for a, b in self._steps.values():
            public, private = public.merged(a), private.merged(b)
        try:
            return leaks.ridge_r2(public, private)
        except (ValueError, np.linalg.LinAlgError):
            return None

    def judges(self, step: int) -> bool:
        """Whether the rows of ``step`` are judged: every step after the first ``after``."""
        return step > self.after
