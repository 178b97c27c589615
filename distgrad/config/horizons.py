"""Settings that a run of a given length would accept and never let act: said at WARNING, not refused.

``check_run_settings`` (config/experiment.py) calls these once the run's steps are known (``--steps``, else the
file's steps or epochs), on every path that starts a training run: ``distgrad run``, ``distgrad-stage``, the
Python API; a stage that runs the steps its driving stage's hello says (``StageOptions.follows_steps``) at that
hello (``check_step_horizons``). A short trial of a file made for a longer run is ordinary use, so nothing here raises; a value these
checks cannot read is left to the check that builds the setting (the stage's optimizer, its scheduler).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterable, Iterator, Mapping, Protocol

from distgrad.config.keys import is_whole

log = logging.getLogger("distgrad.config")

CONSTANT_LR_ITERS = 5       # torch's ConstantLR default: the updates at the lowered rate before it returns to lr


class _Once(logging.Filter):
    """Passes each WARNING text logged by the thread that made it once; every other record always (another
    thread's, such as a run of its own in the same process, is never hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.said: set[str] = set()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        # A filter runs in the thread that logs: ``get_ident`` holds even where records keep no thread.
        if record.levelno != logging.WARNING or threading.get_ident() != self.thread:
            return True
        text = record.getMessage()
        if text in self.said:
            return False
        self.said.add(text)
        return True


@contextlib.contextmanager
def each_warning_once() -> Iterator[None]:
    """While it lasts, a WARNING of the configuration checks (this module's logger, ``distgrad.config``) that
    was logged already is not logged again: one command checks the same run in several places (its front end,
    the launcher, the options of each stage it looks at for a finished run), and says each warning once. Each
    stage process checks again and says it in its own log. Only this thread's warnings are filtered: a run
    checked meanwhile by another thread of the process (its own command, ``run_local``, ``serve_stage``)
    says its own."""
    once = _Once()
    log.addFilter(once)
    try:
        yield
    finally:
        log.removeFilter(once)


class StageSchedules(Protocol):
    """What these checks read of a stage's settings (``experiment.StageSpec`` has it)."""

    @property
    def name(self) -> str: ...

    @property
    def optimizer(self) -> Any: ...

    @property
    def scheduler(self) -> Mapping[str, Any] | None: ...


def rate_steps(spec: StageSchedules) -> Iterator[tuple[str, int, int, str, str]]:
    """Where stage ``spec``'s learning rate changes in steps, as ``(what, last, offset, placed, key)``: the rate
    first changes for update ``offset + last + 1`` (1-based updates), ``offset`` being a warm-up before the
    schedule's own count, ``placed`` names the value that places it and ``key`` the setting to change.
    Covered: the optimizer's ``schedule``, numpy's or a torch stage's ("piecewise": its first boundary;
    "exponential" with staircase: decay_steps), and a torch stage's ``scheduler`` (StepLR: step_size;
    MultiStepLR: its first milestone; ConstantLR: total_iters, after which it returns to lr; torch steps it
    once after each update). The other schedules change the rate at every update, or on evaluations
    (ReduceLROnPlateau: ``check_evaluation_horizon``)."""
    schedule: Any = spec.optimizer.get("schedule") if isinstance(spec.optimizer, Mapping) else None
    if isinstance(schedule, Mapping):
        warmup = _count(schedule.get("warmup_steps", 0)) or 0
        after = f", warmup_steps = {warmup}" if warmup else ""
        kind, boundary = schedule.get("type"), _first(schedule.get("boundaries"))
        decay = _count(schedule.get("decay_steps")) if schedule.get("staircase") is True else None
        if kind == "piecewise" and boundary is not None:
            yield (f"optimizer schedule 'piecewise' (boundaries = {schedule['boundaries']}{after})", boundary,
                   warmup, f"its first boundary, {boundary}", "a first boundary")
        if kind == "exponential" and decay is not None:
            yield (f"optimizer schedule 'exponential' (staircase, decay_steps = {decay}{after})", decay, warmup,
                   f"decay_steps = {decay}", "decay_steps")
    table: Mapping[str, Any] = spec.scheduler or {}
    size, milestone = _count(table.get("step_size")), _first(table.get("milestones"))
    if table.get("type") == "StepLR" and size is not None:
        yield f"scheduler StepLR (step_size = {size})", size, 0, f"step_size = {size}", "step_size"
    iters = _count(table.get("total_iters", CONSTANT_LR_ITERS))
    if table.get("type") == "ConstantLR" and iters is not None:
        default = "" if "total_iters" in table else ", torch's default"
        yield (f"scheduler ConstantLR (total_iters = {iters}{default})", iters, 0, f"total_iters = {iters}",
               "total_iters")
    if table.get("type") == "MultiStepLR" and milestone is not None:
        yield (f"scheduler MultiStepLR (milestones = {table['milestones']})", milestone, 0,
               f"its first milestone, {milestone}", "a first milestone")


def _count(value: Any) -> int | None:
    """``value`` if it is a whole count of updates >= 1, else None (left to the check that builds it)."""
    return int(value) if is_whole(value) and value >= 1 else None


def _first(value: Any) -> int | None:
    """The least of a non-empty list of counts >= 1 (a boundary or milestone 0 acts before the first update,
    so a list holding one is never all past the run), else None."""
    counts = [_count(v) for v in value] if isinstance(value, list) and value else [None]
    return None if None in counts else min(c for c in counts if c is not None)


def check_rate_horizon(stages: Iterable[tuple[StageSchedules, int]], steps: int, given: str) -> None:
    """Log a WARNING naming the stage, its schedule or scheduler, the step that places the first change of its
    rate and the run's ``steps`` (``given``: where they come from, e.g. ``--steps 50``) where every change lies
    at or past the stage's last update, so its rate never changes in this run (``rate_steps``). ``stages``:
    each stage's settings with the optimizer updates it makes in the run (a multiple of ``steps``)."""
    for spec, updates in stages:
        per_step = updates // steps
        for what, last, offset, placed, key in rate_steps(spec):
            if offset + last < updates:
                continue
            clients = f"{per_step} clients a step, " if per_step > 1 else ""
            warmup = f" after the warm-up of {offset} updates" if offset else ""
            fix = f"{key} below {updates - offset} or " if updates - offset > 1 else ""
            log.warning("stage %r: %s first changes the rate for update %d (%s%s), and the stage makes %d "
                        "updates in this run (%s%s): its rate never changes%s in this run. Give %srun at least %d "
                        "steps", spec.name, what, offset + last + 1, placed, warmup, updates, clients, given,
                        " after the warm-up" if offset else "", fix,
                        -(-(offset + last + 1) // per_step))


def check_checkpoint_horizon(every: Any, steps: int, given: str) -> None:
    """Log a WARNING naming ``--checkpoint-every`` and the run's ``steps`` (``given``: where they come from) where
    it would save no checkpoint that the run does not save without it: every K-th step is saved, and with K at
    or above the run's steps that is none before the last step, which a stage saves at the end of every run
    (besides step 0 when the run begins, and on SIGTERM/SIGINT or a lost peer). ``every`` 0 or None: not
    given; a bad value is left to the check that refuses it."""
    if not is_whole(every) or every <= 0 or every < steps:
        return
    log.warning("--checkpoint-every %d saves a checkpoint every %d steps, and this run has %d steps (%s): "
                "it saves none before the last one. The run's checkpoints are those a stage saves without it: "
                "step 0 when the run begins, step %d at its end (and the step it stands at on SIGTERM/SIGINT or "
                "when it gives up on a peer). Give --checkpoint-every K below %d to save during the run, or drop "
                "it", every, every, steps, given, steps, steps)
