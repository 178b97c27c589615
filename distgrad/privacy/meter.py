"""The live leak meter: a window of what one stage sent, scored with ``distgrad.privacy.leaks``.

A stage's meter is fed, for each micro-batch it sends across the cut, the
rows exactly as the receiver gets them (after any defense and codec) and the
secret rows they belong to: the label owner's labels, or the data owner's raw
inputs (``observe``). After each applied step the runner asks for the
window's figures (``close``): every ``window`` steps and at the run's last
step (which the runner says) they are computed from the steps since the previous window and those
steps are forgotten. The meter only reads: it copies what it is given and
sends, draws and changes nothing, so a metered run is bitwise the unmetered.

Only a sample of a window's steps is scored (``wants``: ``SAMPLED_STEPS``
evenly spaced ones, every micro-batch of each), which keeps the meter's cost
low; the sample is a function of the step alone, so every runner scores the
same rows. A micro-batch observed again (sent again after a rollback) replaces the
earlier one; steps rolled back past are dropped (``rollback``). After a
restart from a checkpoint a window holds only the steps run since.

Figures (each beside its chance level, ``NAME_chance``):

* labels: ``leaks.label_figures`` of the window's rows: ``label_recovery``
  and ``cosine_auc``; ``norm_auc`` and ``direction_auc`` when its labels are
  the two classes 0 and 1 (Li et al.);
* inputs: ``leaks.input_figures``: ``distance_correlation``, the mean over
  the window's micro-batches of each one's distance correlation between
  input and activation rows.

The offline audit reports the same figures through the same two functions,
so on the same rows the two agree exactly.

A figure that cannot be scored on a window (a single class, a regression's
real-valued targets) is left out of it.
"""

from __future__ import annotations

import numpy as np

from distgrad.privacy import leaks

LABELS, INPUTS = "labels", "inputs"      # what a meter guards: the label owner's or the data owner's secret
DEFAULT_WINDOW = 50                      # steps per window when the run does not evaluate periodically
SAMPLED_STEPS = 4      # steps of a window scored (evenly spaced): what keeps the meter's cost near 10% of a step
FIGURES = ("label_recovery", "cosine_auc", "norm_auc", "direction_auc", "distance_correlation")   # each has NAME_chance


def sampled(offset: int, window: int) -> bool:
    """Whether the step ``offset`` steps after a window's first is scored in a window of ``window`` steps: every
    ``window // SAMPLED_STEPS``-th (every step of a window shorter than ``2 * SAMPLED_STEPS``). The one rule
    of which steps the meter scores, which the offline audit applies too."""
    return (offset % window) % max(1, window // SAMPLED_STEPS) == 0


def window_steps(eval_every: int) -> int:
    """A meter's window: the run's evaluation period, else ``DEFAULT_WINDOW``."""
    return eval_every if eval_every > 0 else DEFAULT_WINDOW


class LeakMeter:
    """Scores what one stage sends over windows of ``window`` steps; ``kind`` is ``LABELS`` or ``INPUTS``."""

    def __init__(self, kind: str, window: int) -> None:
        if kind not in (LABELS, INPUTS):
            raise ValueError(f"unknown meter kind {kind!r}; use {LABELS!r} or {INPUTS!r}")
        if window < 1:
            raise ValueError(f"a meter's window must be at least one step, got {window}")
        self.kind, self.window = kind, window
        self._rows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}   # (step, mb) -> (secret, sent)

    def wants(self, step: int) -> bool:
        """Whether ``step`` is scored: every ``window // SAMPLED_STEPS``-th step (every step of a short window),
        counted from each window's first; what the other steps send is not looked at."""
        return sampled(step - 1, self.window)

    def observe(self, step: int, mb: int, secret: np.ndarray, sent: np.ndarray) -> None:
        """Micro-batch ``mb`` of ``step``: its secret rows and the rows sent for them, as received (kept only
        when the meter ``wants`` the step)."""
        if not self.wants(step):
            return
        secret, sent = np.asarray(secret), np.asarray(sent)
        if len(secret) != len(sent):
            raise ValueError(f"{len(secret)} secret rows for {len(sent)} sent rows")
        self._rows[(step, mb)] = (secret.copy(), sent.copy())

    def rollback(self, step: int) -> None:
        """The run stands at ``step`` again: forget what later steps sent."""
        self._rows = {key: value for key, value in self._rows.items() if key[0] <= step}

    def close(self, step: int, last: bool = False) -> dict[str, float] | None:
        """After applying ``step`` (``last``: the run's last): when a window closes (every ``window`` steps and
        at the last), its figures, and the window is forgotten; else None."""
        if step % self.window and not last:
            return None
        keys = sorted(key for key in self._rows if key[0] <= step)
        taken = [self._rows.pop(key) for key in keys]
        if not taken:
            return None
        return self._labels(taken) if self.kind == LABELS else self._inputs(taken)

    @staticmethod
    def _labels(taken: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
        labels = np.concatenate([secret.reshape(len(secret), -1) for secret, _ in taken])
        rows = np.concatenate([sent.reshape(len(sent), -1) for _, sent in taken])
        if labels.shape[1] == 1:
            labels = labels[:, 0]
        if labels.ndim == 1 and not np.array_equal(labels, np.round(labels)):
            return {}                        # real-valued targets: nothing to recover by class
        return leaks.label_figures(rows, labels)

    @staticmethod
    def _inputs(taken: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, float]:
        return leaks.input_figures(taken)
