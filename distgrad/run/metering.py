"""A stage's privacy meter in a run: fed from the one pipeline of what the stage sends, reported per window.

``Metering`` taps the stage's ``Senders`` (``distgrad.wire.wirecodec``) in the
direction that leaves the party's secret behind (the label owner's
activation gradients, the data owner's activations): each micro-batch as the
receiver decodes it, paired with the secret rows it was computed from (the
labels or the raw inputs of that step's micro-batch, taken from the stage's
own data). After each applied update (a step-engine observer) it closes the
meter's window when due and hands the figures to ``report``; every window's
figures are kept for the summary (``summary_fields``). It reads only: the
run's parameters are bitwise those of an unmetered run.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

import numpy as np

from distgrad.privacy.meter import INPUTS, LABELS, LeakMeter, window_steps
from distgrad.stage.engine import StepEngine, StepRecord
from distgrad.stage.stage import micro_batch
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, stream_micro_batch

SUMMARY_KEYS = {LABELS: "label_leaks", INPUTS: "input_leaks"}     # the summary's list of windows, by kind
COST_KEYS = {LABELS: "label_meter_s", INPUTS: "input_meter_s"}     # the summary's wall seconds spent metering
Report = Callable[[int, dict[str, float]], None]


def figures_text(figures: Mapping[str, Any]) -> str:
    """``label_recovery 0.991 (chance 0.100), cosine_auc 0.970 (chance 0.500)``: each figure beside its chance
    (other entries, such as a window's ``step``, are left out)."""
    return ", ".join(f"{name} {value:.3f} (chance {figures[name + '_chance']:.3f})"
                     for name, value in figures.items() if name + "_chance" in figures)


class NoMetering:
    """A stage that meters nothing: ``Metering``'s calls do nothing, so a runner calls them unconditionally."""

    figures_at = None

    def set_run(self, eval_every: int, last_step: Any) -> None:
        """Nothing to set."""

    def finish(self, step: int) -> None:
        """No window to close."""

    def reset(self) -> None:
        """No window to forget."""

    def summary_fields(self) -> dict[str, Any]:
        """No figures."""
        return {}


class Metering:
    """The meter of the stage ``engine`` runs, guarding ``kind``; ``secret_of(step)`` is the whole batch of
    that step's secret rows (labels or inputs); ``eval_every`` the run's evaluation period (0: none, or no
    held-out rows) sets the window; ``last_step`` the run's last step when this stage knows it (else the
    runner calls ``finish``)."""

    def __init__(self, kind: str, engine: StepEngine, secret_of: Callable[[int], np.ndarray],
                 eval_every: int, last_step: int | None = None, report: Report | None = None,
                 log: logging.Logger | None = None) -> None:
        self.kind, self.secret_of, self.report, self.last_step = kind, secret_of, report, last_step
        self.meter = LeakMeter(kind, window_steps(eval_every))
        self.windows: list[dict[str, Any]] = []
        self.spent_s = 0.0                  # wall time in the tap and the windows: the meter's own cost
        self.log = log or logging.getLogger("distgrad.privacy")
        self._secret: tuple[int, np.ndarray] | None = None
        engine.senders.taps[GRADIENT if kind == LABELS else ACTIVATION].append(self._tap)
        engine.observers.append(self._after_update)

    def _tap(self, received: Callable[[], np.ndarray], stream: str, step: int) -> None:
        if not self.meter.wants(step):
            return
        started = time.perf_counter()
        mb, mbs = stream_micro_batch(stream)
        if self._secret is None or self._secret[0] != step:
            self._secret = (step, np.asarray(self.secret_of(step)))
        self.meter.observe(step, mb, micro_batch(self._secret[1], mb, mbs), received())
        self.spent_s += time.perf_counter() - started

    def set_run(self, eval_every: int, last_step: Any) -> None:
        """The run's evaluation period and last step, as a serving stage learns them from the hello: the
        windows follow the period and end at the last step (a last step that is no whole number: ``finish``
        closes the last window)."""
        self.meter.window = window_steps(eval_every)
        self.last_step = last_step if isinstance(last_step, int) and not isinstance(last_step, bool) else None

    def _after_update(self, record: StepRecord) -> None:
        self._close(record.step, record.step == self.last_step)

    def finish(self, step: int) -> None:
        """The run ended after ``step``: close the last window (when the stage did not know its last step)."""
        self._close(step, True)

    def _close(self, step: int, last: bool) -> None:
        started = time.perf_counter()
        figures = self.meter.close(step, last)
        self.spent_s += time.perf_counter() - started
        if not figures or any(w["step"] == step for w in self.windows):
            return           # nothing to score, or a window closed again after a rollback: the first stands
        self.windows.append({"step": step, **figures})
        self.log.info("privacy meter (%s) after step %d: %s", self.kind, step, figures_text(figures))
        if self.report is not None:
            self.report(step, figures)

    def figures_at(self, step: int) -> dict[str, float]:
        """The figures of the window that closed after ``step`` (none closed then: empty), for that step's
        record (``progress.StageRecords``, an observer after this one)."""
        latest = self.windows[-1] if self.windows else {}
        return {k: v for k, v in latest.items() if k != "step"} if latest.get("step") == step else {}

    def reset(self) -> None:
        """A new run: no window, no figures yet."""
        self.meter.rollback(-1)
        self.windows, self.spent_s = [], 0.0

    def summary_fields(self) -> dict[str, Any]:
        """``{"label_leaks" | "input_leaks": [{"step": ..., figures}, ...]}``: every window's figures; and
        ``label_meter_s`` | ``input_meter_s``: the wall seconds the meter spent (its cost to the run)."""
        return {SUMMARY_KEYS[self.kind]: self.windows, COST_KEYS[self.kind]: self.spent_s}
