"""Watching a run: a progress bar for terminals; metrics lines and TensorBoard events for files.

The driving stage reports every step to a ``Progress``. In a terminal it
draws a one-line bar (step, loss, the latest held-out scores, steps/s, ETA)
at most ``REDRAW_S`` apart; elsewhere the periodic log lines serve. Under the
launcher the stage emits ``progress`` lines that the launcher turns into the
bar on its own terminal. Each step's record (a ``MetricsWriter`` line) goes
to every *step writer* of the run, made in one place: ``step_writers``. A
serving or middle stage writes its own records (``StageRecords``): each party
reports what only it knows, its own learning rate among them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import IO, Any, Callable, Mapping

from distgrad.jsontext import json_text
from distgrad.errors import ConfigError, OutputWriteError
from distgrad.privacy.meter import METER_FIGURES
from distgrad.stage.engine import StepRecord
from distgrad.stage.records import close_after_failure, is_special, read_trace, write_atomic, writing
from distgrad.wire.messages import LOSS_WITHHELD

REDRAW_S = 0.1           # shortest time between two redraws of the bar
BAR_WIDTH = 24
PROGRESS_PREFIX = "progress "


def render_bar(step: int, steps: int, loss: float | None, rate: float | None,
               test: Mapping[str, Any] | None = None) -> str:
    """``[#####-----] 450/900 loss 1.2e-03 test 0.31 acc 0.912 auc 0.987 2300 steps/s ETA 0.2 s``.

    ``loss`` None: the label owner's replies carried none (``loss withheld by the label owner``).

    ``rate`` (steps/s) is None or not positive before it can be measured
    (the first step seen): the bar then shows ``- steps/s ETA -``. ``test``
    is the latest evaluation (``test_loss``, ``test_accuracy`` when
    classifying, ``test_NAME`` of the label owner's metrics, each shown by
    NAME); without one the bar has no ``test`` part. It may also hold
    this stage's latest privacy-meter window, shown as ``NAME value/chance``.
    """
    done = int(BAR_WIDTH * step / steps) if steps else BAR_WIDTH
    loss_text = f"{loss:.4g}" if loss is not None else LOSS_WITHHELD
    if rate is not None and rate > 0:
        speed = f"{rate:.0f} steps/s ETA {(steps - step) / rate:.1f} s"
    else:
        speed = "- steps/s ETA -"
    held_out = ""
    kind = "validation" if test and test.get("validation_loss") is not None else "test"   # a validation split's
    if test and test.get(f"{kind}_loss") is not None:
        held_out = f" {kind} {test[f'{kind}_loss']:.4g}"
        held_out += "".join(f" {'acc' if key.endswith('_accuracy') else key.split('_', 1)[1]} {value:.3f}"
                            for key, value in test.items() if _is_score(key) and value is not None)
    for name in METER_FIGURES:   # the data owner's privacy meter: its latest window beside the chance level
        if test and test.get(name) is not None:
            held_out += f" {name} {test[name]:.3f}/{test[name + '_chance']:.3f}"
    return f"[{'#' * done}{'-' * (BAR_WIDTH - done)}] {step}/{steps} loss {loss_text}{held_out} {speed}"


def _is_score(key: str) -> bool:
    """A held-out score besides the loss: ``test_accuracy``, ``test_auc``, ... (not ``test_count``); with a
    validation split ``validation_accuracy``, ..."""
    return key.startswith(("test_", "validation_")) and key not in ("test_loss", "test_count", "validation_loss",
                                                                     "validation_count")


class Progress:
    """Reports steps as a bar (``mode="bar"``), as ``progress`` lines (``"lines"``) or not at all."""

    def __init__(self, mode: str, steps: int, stream: IO[str] | None = None) -> None:
        if mode not in ("bar", "lines", "off"):
            raise ValueError(f"unknown progress mode {mode!r}")
        self.mode, self.steps, self.stream = mode, steps, stream or sys.stderr
        self.started = time.perf_counter()
        self.last_draw = 0.0
        self.first_step: int | None = None
        self.test: dict[str, Any] = {}      # the latest evaluation, shown on the bar until the next

    def update(self, step: int, loss: float | None, force: bool = False,
               test: Mapping[str, Any] | None = None) -> None:
        """Report ``step``; ``test``: this step's evaluation (``test_loss`` and the scores), which is
        always drawn (and, in ``lines`` mode, written on this step's line)."""
        if self.mode == "off":
            return
        now = time.perf_counter()
        if self.first_step is None:
            self.first_step, self.started = step - 1, now
        if test:
            self.test = {**self.test, **test}      # an evaluation, a meter's window: each keeps the other
        elif not force and now - self.last_draw < REDRAW_S:
            return
        self.last_draw = now
        elapsed = now - self.started
        rate = (step - self.first_step) / elapsed if elapsed > 0 else None
        if self.mode == "bar":
            self.stream.write("\r" + render_bar(step, self.steps, loss, rate, self.test) + "\x1b[K")
        else:
            self.stream.write(PROGRESS_PREFIX + json_text({"step": step, "steps": self.steps, "loss": loss,
                                                            "rate": rate, **(test or {})}) + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.mode == "bar" and self.last_draw:
            self.stream.write("\n")
            self.stream.flush()


class MetricsWriter:
    """One JSON line per step: step, loss, the stage's learning rate ``lr``, wall time, bytes, compute and
    wait times (seconds), and the held-out ``test_loss``, ``test_accuracy`` and the label owner's other
    ``test_NAME`` scores on the lines of the steps that evaluated (a serving stage's lines: ``StageRecords``)."""

    def __init__(self, path: Path | None, append: bool = False) -> None:
        """Raises ``OutputWriteError`` naming ``path`` when it cannot be written (as do ``write`` and ``close``).
        ``append`` (a stage started with ``--resume``) keeps the lines there until ``rollback`` says which stand."""
        self._file: IO[str] | None = None
        self.path = path
        if path is not None:
            with writing(path, "the metrics"):
                path.parent.mkdir(parents=True, exist_ok=True)
                # a line at a time: a stage killed (SIGKILL) leaves the line of every step it recorded, and whole
                self._file = open(path, "a" if append else "w", encoding="utf-8", buffering=1)

    def rollback(self, step: int) -> None:
        """Keep only the lines of steps up to ``step`` (a resumed run's: the steps its checkpoint holds; 0: a new
        run), and a line cut short by a kill dropped; the file is replaced whole (``write_atomic``)."""
        if self._file is None or self.path is None or is_special(self.path):
            return
        file, self._file = self._file, None
        with writing(self.path, "the metrics"):
            file.close()
            kept = [line for line in read_trace(self.path, tolerate_torn=True)
                    if isinstance(line, dict) and isinstance(line.get("step"), int) and line["step"] <= step]
            text = "".join(json_text(line, separators=(",", ":")) + "\n" for line in kept).encode("utf-8")
            write_atomic(self.path, lambda f: f.write(text))
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def write(self, record: dict[str, Any]) -> None:
        """One line; ``OutputWriteError`` when it cannot be written (disk full), after which the file is closed
        (what it could not take is dropped, so ``close`` does not fail again)."""
        if self._file is not None:
            try:
                with writing(self.path, "the metrics"):
                    self._file.write(json_text(record, separators=(",", ":")) + "\n")
            except OutputWriteError:
                file, self._file = self._file, None
                close_after_failure(file)
                raise

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            with writing(self.path, "the metrics"):
                file.close()



TENSORBOARD_MISSING = "--tensorboard needs tensorboardX, an optional extra: pip install 'distgrad[tensorboard]'"


def check_tensorboard() -> None:
    """Raise ``ConfigError`` (exit 2) telling how to install the TensorBoard writer when it is missing."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError as e:
        raise ConfigError(TENSORBOARD_MISSING) from e


class TensorBoardWriter:
    """TensorBoard event files in ``directory`` from the same records as ``MetricsWriter``.

    Scalars, each at its step: ``train/loss``; ``train/lr`` (the stage's learning rate); ``test/loss``,
    ``test/accuracy`` and ``test/NAME`` of each of the label owner's metrics at the steps that evaluated;
    ``speed/steps_per_s``
    (1 / ``step_s``); ``speed/bytes_per_step`` (sent + received since the
    previous record: the first counts the handshake too, and an evaluation's
    traffic counts in the step after it); ``privacy/NAME`` and ``privacy/NAME_chance`` for each privacy meter
    figure (``distgrad.privacy.meter.METER_FIGURES``: the windows' and the strongest attacks') at the steps
    that closed a window (the label owner's meter of feature party P: ``privacy/P/NAME``; of client K, on its record: ``privacy/clientK/NAME``). Written by tensorboardX, imported
    only here; without it the constructor raises ``ConfigError``.
    """

    def __init__(self, directory: Path | None) -> None:
        self._writer = None
        self._bytes = 0
        if directory is None:
            return
        check_tensorboard()
        from tensorboardX import SummaryWriter

        directory.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(logdir=str(directory))

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            return
        step, add = record["step"], self._writer.add_scalar
        if record.get("loss") is not None:
            add("train/loss", record["loss"], step)
        if record.get("lr") is not None:
            add("train/lr", record["lr"], step)
        for key, value in record.items():
            if (key in ("test_loss", "validation_loss") or _is_score(key)) and value is not None:
                add("/".join(key.split("_", 1)), value, step)     # test/accuracy, validation/accuracy
        if record.get("step_s", 0) > 0:
            add("speed/steps_per_s", 1.0 / record["step_s"], step)
        owner = f"client{record['client']}/" if record.get("client") is not None else ""
        for key, value in record.items():   # NAME, or PARTY/NAME: the label owner's meter of a feature party
            if key.rsplit("/", 1)[-1] in METER_FIGURES and value is not None:
                add(f"privacy/{owner}{key}", value, step)
                add(f"privacy/{owner}{key}_chance", record[f"{key}_chance"], step)
        if "bytes_sent" in record:
            total = record["bytes_sent"] + record["bytes_received"]
            add("speed/bytes_per_step", total - self._bytes, step)
            self._bytes = total

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def step_writers(metrics_path: Path | None, tensorboard_dir: Path | None,
                 append: bool = False) -> list[MetricsWriter | TensorBoardWriter]:
    """Where each step's record goes: a metrics file (``append``: ``MetricsWriter``'s), TensorBoard events,
    both or neither (only those asked for). Raises ``ConfigError`` for ``tensorboard_dir`` without tensorboardX."""
    writers: list[MetricsWriter | TensorBoardWriter] = [MetricsWriter(metrics_path, append)]
    try:
        writers.append(TensorBoardWriter(tensorboard_dir))
    except ConfigError:
        writers[0].close()
        raise
    return [writer for writer in writers if writer.enabled]


class StageRecords:
    """A serving or middle stage's own step records (``--metrics``, ``--tensorboard`` on it), written by an
    observer of its step engine: one per applied update with ``step``, ``loss`` (the step's loss, which a
    middle stage passes up and so knows too), ``lr`` (its learning rate), ``wall_s`` (since it began serving) and,
    serving several clients, the ``client`` whose step it was; ``extra(step, client)``: more fields of the step
    (the label owner's privacy-meter window that closed after that client's update; a middle stage's bytes to
    and from the stage below). A stage that keeps serving writes every run's steps, in order. Raises
    ``ConfigError`` for ``tensorboard_dir`` without tensorboardX."""

    def __init__(self, metrics_path: Path | None, tensorboard_dir: Path | None,
                 extra: Callable[[int, int | None], Mapping[str, Any]] | None = None) -> None:
        self.writers = step_writers(metrics_path, tensorboard_dir)
        self.started = time.perf_counter()
        self.extra = extra

    def __call__(self, step: StepRecord) -> None:
        record = {"step": step.step, "loss": step.loss, "lr": step.lr, "wall_s": time.perf_counter() - self.started}
        if step.client is not None:
            record["client"] = step.client
        if self.extra is not None:
            record.update(self.extra(step.step, step.client))
        for writer in self.writers:
            writer.write(record)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
