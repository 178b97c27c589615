"""The verdicts on a run's evaluations and what they keep: keep_best's best step and its copy of the model (the
kept model), early stopping's last step, the final evaluation's scores on the test rows, and the step whose
loss a ReduceLROnPlateau scheduler took last.

A ``RunVerdicts`` is held by the stage's ``run.stage_state.StageState`` and rolls back with it: a checkpoint's
metadata holds ``state()`` and its arrays hold the kept model (``arrays``, under ``BEST_PREFIX``). It writes
no file and sends nothing: what a verdict asks of the stage (write its parameters, save a checkpoint) it
returns (``take``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from distgrad.errors import ConfigError
from distgrad.run.options import StageOptions
from distgrad.stage.records import best_evaluation_fields, evaluation_fields, kept_test_fields
from distgrad.stage.selection import Selection, Verdicts
from distgrad.stage.stage import Stage
from distgrad.wire import link

BEST_PREFIX = "best/"        # a checkpoint's arrays of the kept model (``RunVerdicts.best_copy``): best/params/NAME, best/state/NAME


class RunVerdicts:
    """What the evaluations of the run in progress decided, up to the stage's live step. ``verdicts`` stays the
    same object for its whole life (the stage holds it too, and reads it on a step's path)."""

    def __init__(self, opts: StageOptions) -> None:
        # The label owner's verdicts on the evaluations (keep_best, early_stopping): given here when this is
        # the last stage (``selection``), received otherwise; both are checkpointed with the stage.
        spec = next((s for s in opts.experiment.stages if s.name == opts.stage), None)
        self.selection = Selection(spec.keep_best, spec.early_stopping) if spec else Selection(None, None)
        self.verdicts = Verdicts()
        self.keeping_best = False       # the verdicts say which evaluation is the best: --save writes its step
        # With a validation split: the kept model (keep_best's best step's parameters and forward state, copied
        # when the verdict arrives; None: the live ones), which the final evaluation scores on the test rows,
        # and that evaluation's scores with the step of the kept model (``record_test``; None: not yet).
        self.best_copy: dict[str, dict[str, np.ndarray]] | None = None
        self.final_test: dict[str, Any] | None = None
        self.plateau_at = 0             # the step whose evaluation's loss a ReduceLROnPlateau took last

    def judge(self, step: int, result: dict[str, Any], last: bool, gives: bool) -> dict[str, Any]:
        """``result`` (the evaluation after ``step``; ``last``: the run's last step) with the verdicts this
        stage gives (``gives``: the last stage, by ``selection``); unchanged otherwise."""
        if gives and self.selection.active:
            result = {**result, **self.selection.judge(step, evaluation_fields(result), last)}
        return result

    def take(self, step: int, evaluation: Mapping[str, Any], stage: Stage) -> tuple[bool, bool]:
        """Record the verdict an evaluation after ``step`` carries (``best``, ``stop``), and give its loss to
        ``stage``'s ReduceLROnPlateau once, after the update of ``step``, before the next. Returns whether the
        scheduler took it, and whether the evaluation is the best so far (its model then copied when it was
        scored on the validation rows: the final evaluation scores that copy on the test rows)."""
        stepped = stage.plateau and stage.step == step and step > self.plateau_at \
            and isinstance(evaluation.get("loss"), float)
        if stepped:
            stage.evaluated(evaluation["loss"])
            self.plateau_at = step
        self.keeping_best = self.keeping_best or "best" in evaluation
        best = self.verdicts.note(step, evaluation)
        if best and evaluation.get(link.HELD_OUT) == link.VALIDATION_ROWS:
            self.best_copy = {"params": {name: value.copy() for name, value in stage.params.items()},
                              "state": stage.forward_state()}
        return stepped, best

    def kept_model(self) -> dict[str, dict[str, np.ndarray]] | None:
        """The model the final evaluation scores (``stage.kept_model``): keep_best's copy of the best step's
        parameters and forward state; None (the live ones) without one."""
        return self.best_copy if self.verdicts.best_step else None

    def record_test(self, scores: Mapping[str, Any], after: int) -> int:
        """Keep the final evaluation's ``scores`` (the kept model on the test rows), made after step ``after``,
        for the summary and the checkpoints; returns the step the kept model comes from (keep_best's best
        step, else ``after``)."""
        step = self.verdicts.best_step if self.kept_model() is not None else after
        self.final_test = {**{k: v for k, v in scores.items() if k not in ("best", "stop")}, "step": step,
                           "after": after}
        return step

    def state(self) -> dict[str, Any]:
        """A checkpoint's ``verdicts``: the evaluations judged, the verdicts taken and what they keep."""
        return {"judged": self.selection.state(), "taken": self.verdicts.state(), "keeping_best": self.keeping_best,
                "final_test": self.final_test, "plateau_at": self.plateau_at}

    def load(self, saved: Any, step: int) -> None:
        """The evaluations judged and the verdicts taken up to ``step`` (a checkpoint's ``verdicts``; None:
        none, as at step 0); ``ConfigError`` when they cannot be read."""
        saved = saved or {"judged": [], "taken": {"best_step": 0, "stopped_at": 0}, "keeping_best": False}
        try:
            self.selection.load_state(saved["judged"], step)
            self.verdicts.load_state(saved["taken"], step)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"checkpoint of step {step}: its verdicts cannot be read: {e}") from e
        self.keeping_best = bool(saved.get("keeping_best"))
        test = saved.get("final_test")
        if test is not None and not (isinstance(test, dict) and isinstance(test.get("step"), int)
                                     and isinstance(test.get("after"), int) and isinstance(test.get("count"), int)):
            raise ConfigError(f"checkpoint of step {step}: its final evaluation is not a map of scores")
        self.final_test = test if test is not None and test["after"] == step else None
        if step == 0:
            self.best_copy = None
        plateau_at = saved.get("plateau_at", 0)
        self.plateau_at = plateau_at if isinstance(plateau_at, int) and plateau_at <= step else 0

    def arrays(self) -> dict[str, np.ndarray]:
        """The kept model as a checkpoint's arrays (``BEST_PREFIX``; {} without one)."""
        return {f"{BEST_PREFIX}{part}/{name}": value for part, values in (self.best_copy or {}).items()
                for name, value in values.items()}

    def load_best_copy(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The kept model a checkpoint's ``arrays`` hold, when the verdicts loaded (``load``) name a best step."""
        kept: dict[str, dict[str, np.ndarray]] = {"params": {}, "state": {}}
        for name, value in arrays.items():
            if name.startswith(BEST_PREFIX):
                part, key = name[len(BEST_PREFIX):].split("/", 1)
                kept.setdefault(part, {})[key] = np.array(value)
        self.best_copy = kept if kept["params"] and self.verdicts.best_step else None

    def summary_fields(self, best_given: bool) -> dict[str, Any]:
        """The summary's fields of the verdicts (``best_step``, ``stopped_early``), of the best evaluation
        (unless ``best_given``: the runner states it) and of the final evaluation on the test rows."""
        return {**self.verdicts.summary(), **({} if best_given else self._best_evaluation()),
                **kept_test_fields(self.final_test)}

    def _best_evaluation(self) -> dict[str, Any]:
        """On the stage that judges the evaluations (kept in its checkpoints): the summary's
        ``best_evaluation``, the scores of the step ``keep_best`` kept ({} when none was kept)."""
        judged = dict(self.selection.history)
        return best_evaluation_fields([{"step": step, **{k: v for k, v in fields.items()
                                                         if k not in ("test_count", "validation_count")}}
                                       for step, fields in judged.items()], self.verdicts.best_step)
