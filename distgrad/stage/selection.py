"""The label owner's verdict on each held-out evaluation: the best so far (``keep_best``), and whether
the run stops here (``early_stopping``).

One ``Selection`` sees a run's evaluations in step order and judges each one (with a validation split,
its validation rows' figures: ``judged_field``);
its verdict travels to every other party in the ``evaluation`` reply
(``best``, ``stop``), so every party keeps the parameters of the same step and
ends at the same step, over processes as ``--in-process``. A metric improves
downwards when ``metrics.LOWER_IS_BETTER`` says so (loss, mse, mae), else
upwards; a tie is no improvement (the earlier step stays the best), and an
undefined score (None) never improves.
"""

from __future__ import annotations

from typing import Any, Mapping

from distgrad.model.metrics import LOWER_IS_BETTER


def field_metric(field: str) -> str:
    """``test_accuracy`` (or ``validation_accuracy``) -> ``accuracy``: the metric a reported field scores."""
    return field.removeprefix("validation_") if field.startswith("validation_") else field.removeprefix("test_")


def judged_field(field: str, fields: Mapping[str, Any]) -> str:
    """The field of an evaluation's ``fields`` that ``field`` (e.g. ``test_accuracy``) judges: with a
    validation split, the validation rows' (``validation_accuracy``), never the test rows'."""
    return ("validation_" if "validation_loss" in fields else "test_") + field_metric(field)


def _improves(value: float | None, best: float | None, lower: bool) -> bool:
    if value is None or value != value:     # undefined, or NaN
        return False
    return best is None or (value < best if lower else value > best)


class Selection:
    """Judges evaluations for ``keep_best`` (a reported field, e.g. ``test_accuracy``) and
    ``early_stopping`` (``{"metric": field, "patience": K}``: stop once K evaluations in a row have not
    improved on the best of that field). Either may be None.

    It keeps the scores it judged by step: judging a step again (a repeated or rolled-back evaluation)
    first forgets that step and every later one, so a verdict depends only on the evaluations of the
    steps up to it, as in an uninterrupted run."""

    def __init__(self, keep_best: str | None, early_stopping: Mapping[str, Any] | None) -> None:
        self.keep_best = keep_best
        self.watched = early_stopping["metric"] if early_stopping else None
        self.patience = int(early_stopping["patience"]) if early_stopping else 0
        self.history: list[tuple[int, dict[str, Any]]] = []     # (step, scores) of every evaluation judged

    @property
    def active(self) -> bool:
        """Whether there is anything to judge."""
        return self.keep_best is not None or self.watched is not None

    def judge(self, step: int, fields: Mapping[str, Any], last: bool) -> dict[str, bool]:
        """The verdict on the evaluation after ``step`` (``fields``: ``records.evaluation_fields``):
        ``best`` (keep_best: the best so far) and ``stop`` (early_stopping: end the run after this step;
        never after the ``last`` step, which ends it anyway); empty when neither is set."""
        self.history = [(s, f) for s, f in self.history if s < step] + [(step, dict(fields))]
        verdict: dict[str, bool] = {}
        if self.keep_best is not None:
            verdict["best"] = self._improved(self.keep_best)[-1]
        if self.watched is not None:
            stale = 0
            for improved in self._improved(self.watched):
                stale = 0 if improved else stale + 1
            verdict["stop"] = not last and stale >= self.patience
        return verdict

    def state(self) -> list[list[Any]]:
        """What a checkpoint keeps: ``[step, scores]`` of every evaluation judged (``load_state`` reads it)."""
        return [[step, fields] for step, fields in self.history]

    def load_state(self, saved: Any, upto: int) -> None:
        """The evaluations of a checkpoint (``state``) of the steps up to ``upto``; raises ``ValueError``
        when ``saved`` is not what ``state`` writes."""
        if not isinstance(saved, list) or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], int)
                                                  and isinstance(e[1], dict) for e in saved):
            raise ValueError(f"the saved evaluations are not [step, scores] pairs: {saved!r:.80}")
        self.history = [(step, dict(fields)) for step, fields in saved if step <= upto]

    def _improved(self, field: str) -> list[bool]:
        """For each evaluation judged, in step order: whether it improved on the best of ``field`` before it."""
        lower, best, out = field_metric(field) in LOWER_IS_BETTER, None, []
        for _, fields in self.history:
            value = fields.get(judged_field(field, fields))
            out.append(_improves(value, best, lower))
            best = value if out[-1] else best
        return out


class Verdicts:
    """What one party learnt from the verdicts it received (or, on the label owner, gave): the step of
    the best evaluation and the step the run stopped early at; the same on every party."""

    def __init__(self) -> None:
        self.best_step = 0      # 0: no evaluation was judged the best (or keep_best is not set)
        self.stopped_at = 0     # 0: the run did not stop early

    def note(self, step: int, verdict: Mapping[str, Any]) -> bool:
        """Record the verdict on the evaluation after ``step``; True when it is the best so far."""
        if verdict.get("best"):
            self.best_step = step
        if verdict.get("stop"):
            self.stopped_at = step
        return bool(verdict.get("best"))

    def forget_after(self, step: int) -> None:
        """Steps after ``step`` were rolled back: their verdicts no longer hold."""
        self.best_step = self.best_step if self.best_step <= step else 0
        self.stopped_at = self.stopped_at if self.stopped_at <= step else 0

    def state(self) -> dict[str, int]:
        """What a checkpoint keeps (``load_state`` reads it)."""
        return {"best_step": self.best_step, "stopped_at": self.stopped_at}

    def load_state(self, saved: Any, upto: int) -> None:
        """The verdicts of a checkpoint (``state``) on the steps up to ``upto``; raises ``ValueError``
        when ``saved`` is not what ``state`` writes."""
        if not isinstance(saved, dict) or not all(isinstance(saved.get(k), int) for k in ("best_step", "stopped_at")):
            raise ValueError(f"the saved verdicts are not {{best_step, stopped_at}}: {saved!r:.80}")
        self.best_step, self.stopped_at = saved["best_step"], saved["stopped_at"]
        self.forget_after(upto)

    def summary(self) -> dict[str, int]:
        """The summary's fields: ``best_step`` and ``stopped_early`` (the step), each when it happened."""
        return {**({"best_step": self.best_step} if self.best_step else {}),
                **({"stopped_early": self.stopped_at} if self.stopped_at else {})}
