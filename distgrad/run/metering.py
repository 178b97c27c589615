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

``Metering`` and ``Guarding`` are checkpointed with their stage
(``checkpoint_state``, ``load_checkpoint_state``; ``StageState.keep``): a run
killed and resumed, or rolled back, meters and guards as the uninterrupted run.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

import msgpack
import numpy as np

from distgrad.errors import InputGuardStop
from distgrad.privacy.guard import InputGuard
from distgrad.privacy.meter import (INPUTS, LABELS, AttackMeter, LeakMeter, extremes, prefixed, under,
                                    window_steps)
from distgrad.stage.engine import StepEngine, StepRecord
from distgrad.stage.stage import micro_batch
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, Senders, stream_micro_batch, stream_peer

SUMMARY_KEYS = {LABELS: "label_leaks", INPUTS: "input_leaks"}     # the summary's list of windows, by kind
COST_KEYS = {LABELS: "label_meter_s", INPUTS: "input_meter_s"}     # the summary's wall seconds spent metering
ATTACK_KEYS = {LABELS: "label_attacks", INPUTS: "input_attacks"}   # the strongest attacks' windows, by kind
EXTREME_KEYS = {LABELS: "label_leak_extremes", INPUTS: "input_leak_extremes"}   # worst, mean, last, run
Report = Callable[[int, dict[str, float]], None]


def extremes_text(extreme: Mapping[str, Mapping[str, Any]]) -> str:
    """``ridge_r2 worst 0.812 (step 50), run 0.790, mean 0.640 (chance 0.000)``: each figure's worst window, its
    whole-run figure where it has one, and its mean over the windows."""
    parts = []
    for name, e in extreme.items():
        run = f", run {e['run']:.3f}" if "run" in e else ""
        parts.append(f"{name} worst {e['worst']:.3f} (step {e['worst_step']}){run}, mean {e['mean']:.3f} "
                     f"(chance {e['chance']:.3f})")
    return "; ".join(parts)


def step_rows(data: Any) -> Callable[[int], np.ndarray] | None:
    """The row numbers of a step's batch of ``data`` (``RowBatches.step_rows``), None for data without them."""
    return getattr(data, "step_rows", None)


def figures_text(figures: Mapping[str, Any]) -> str:
    """``label_recovery 0.991 (chance 0.100), cosine_auc 0.970 (chance 0.500)``: each figure beside its chance
    (other entries, such as a window's ``step``, are left out)."""
    return ", ".join(f"{name} {value:.3f} (chance {figures[name + '_chance']:.3f})"
                     for name, value in figures.items() if name + "_chance" in figures)


def meter_fields(kind: str, windows: list[dict[str, Any]], attack_windows: list[dict[str, Any]],
                 spent_s: float) -> dict[str, Any]:
    """A meter's summary fields (``Metering.summary_fields`` says which) from its windows' figures."""
    fields: dict[str, Any] = {SUMMARY_KEYS[kind]: windows, COST_KEYS[kind]: spent_s}
    if attack_windows:
        fields[ATTACK_KEYS[kind]] = attack_windows
    if windows or attack_windows:
        fields[EXTREME_KEYS[kind]] = extremes(windows) | extremes(attack_windows)
    return fields


def guard_fields(setting: tuple[float, int], peak: tuple[float, int] | None) -> dict[str, Any]:
    """``input_guard``: its ``max_r2``, ``after`` (``setting``) and the highest R^2 it judged (``peak_r2``, at
    ``peak_step``)."""
    entry: dict[str, Any] = {"max_r2": setting[0], "after": setting[1]}
    if peak is not None:
        entry.update(peak_r2=peak[0], peak_step=peak[1])
    return {"input_guard": entry}


def read_figures(arrays: Mapping[str, np.ndarray]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The closed windows' figures (window meter's, strongest attacks') of a meter's ``checkpoint_state``;
    ``ValueError`` when they cannot be read."""
    try:
        figures = msgpack.unpackb(np.asarray(arrays["figures"], np.uint8).tobytes(), raw=False)
    except (KeyError, ValueError, msgpack.UnpackException) as e:
        raise ValueError(f"its closed windows' figures cannot be read: {e}") from e
    if not (isinstance(figures, list) and len(figures) == 2 and all(
            isinstance(ws, list) and all(isinstance(w, dict) and isinstance(w.get("step"), int) for w in ws)
            for ws in figures)):
        raise ValueError("its closed windows' figures are not two lists of {step, figures} windows")
    return figures[0], figures[1]


def read_peak(arrays: Mapping[str, np.ndarray]) -> tuple[float, int] | None:
    """The guard's peak (R^2, step) of its ``checkpoint_state`` (None: none judged); ``ValueError`` when it is
    not one."""
    peak = np.asarray(arrays.get("peak", np.zeros(0)), np.float64)
    if peak.shape not in ((0,), (2,)):
        raise ValueError(f"its peak is not [R^2, step]: {peak!r}")
    return (float(peak[0]), int(peak[1])) if len(peak) else None


def checkpointed_fields(kind: str | None, setting: tuple[float, int] | None, meter: Mapping[str, np.ndarray],
                        guard: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The summary fields of a meter guarding ``kind`` and of a guard set to ``setting`` (None: none) as a
    finished run's final checkpoint holds them (their ``checkpoint_state`` arrays; the meter's time is not
    kept: 0). ``ValueError`` when they cannot be read."""
    fields: dict[str, Any] = {}
    if kind is not None and "figures" in meter:         # one meter (a label owner's of several peers: not kept)
        fields.update(meter_fields(kind, *read_figures(meter), 0.0))
    if setting is not None and guard:
        fields.update(guard_fields(setting, read_peak(guard)))
    return fields


class NoMetering:
    """A stage that meters nothing: ``Metering``'s calls do nothing, so a runner calls them unconditionally."""

    figures_at = None

    def set_run(self, eval_every: int, last_step: Any) -> None:
        """Nothing to set."""

    def received_activations(self, step: int, mb: int, mbs: int, activations: np.ndarray, peer: int = 0) -> None:
        """Nothing to classify."""

    def finish(self, step: int) -> None:
        """No window to close."""

    def reset(self) -> None:
        """No window to forget."""

    def summary_fields(self) -> dict[str, Any]:
        """No figures."""
        return {}


class Metering:
    """The meter of the stage ``engine`` runs, guarding ``kind``; ``secret_of(step)`` is the whole batch of
    that step's secret rows (labels or inputs); ``rows_of(step)`` its row numbers (None: the data does not
    number its rows, and the per-row attacks are not scored); ``eval_every`` the run's evaluation period (0: none, or no
    held-out rows) sets the window; ``last_step`` the run's last step when this stage knows it (else the
    runner calls ``finish``)."""

    def __init__(self, kind: str, engine: StepEngine, secret_of: Callable[[int], np.ndarray],
                 eval_every: int, last_step: int | None = None, report: Report | None = None,
                 log: logging.Logger | None = None,
                 rows_of: Callable[[int], np.ndarray] | None = None, peer: str = "",
                 client: int | None = None) -> None:
        self.kind, self.secret_of, self.report, self.last_step = kind, secret_of, report, last_step
        self.rows_of = rows_of
        # A label owner serving several data owners meters each apart (``PeerMeters``): only the streams sent
        # to ``peer`` (``stream_name``'s peer part), and windows closed by ``client``'s updates alone.
        self.peer, self.client = peer, client
        self.meter = LeakMeter(kind, window_steps(eval_every))
        self.attacks = AttackMeter(kind, window_steps(eval_every))
        self.windows: list[dict[str, Any]] = []
        self.attack_windows: list[dict[str, Any]] = []
        self.spent_s = 0.0                  # wall time in the tap and the windows: the meter's own cost
        self.log = log or logging.getLogger("distgrad.privacy")
        self._secret: tuple[int, np.ndarray, np.ndarray | None] | None = None
        engine.senders.taps[GRADIENT if kind == LABELS else ACTIVATION].append(self._tap)
        engine.observers.append(self._after_update)

    def _tap(self, received: Callable[[], np.ndarray], stream: str, step: int) -> None:
        if self.peer and stream_peer(stream) != self.peer:
            return
        started = time.perf_counter()
        mb, mbs = stream_micro_batch(stream)
        if self._secret is None or self._secret[0] != step:
            rows = None if self.rows_of is None else np.asarray(self.rows_of(step))
            self._secret = (step, np.asarray(self.secret_of(step)), rows)
        secret, rows = micro_batch(self._secret[1], mb, mbs), self._secret[2]
        sent = received()
        if self.meter.wants(step):
            self.meter.observe(step, mb, secret, sent)
        self.attacks.observe(step, mb, secret, sent, None if rows is None else micro_batch(rows, mb, mbs))
        self.spent_s += time.perf_counter() - started

    def received_activations(self, step: int, mb: int, mbs: int, activations: np.ndarray, peer: int = 0) -> None:
        """The label owner received ``activations`` for micro-batch ``mb`` of ``mbs`` of ``step`` (what the
        model-completion figure classifies; a stage whose data does not number its rows skips it); ``peer``:
        from which of several data owners (``PeerMeters`` routes it; one meter reads its own)."""
        if self.rows_of is None or self.kind != LABELS:
            return
        started = time.perf_counter()
        self.attacks.observe_activations(micro_batch(np.asarray(self.rows_of(step)), mb, mbs), activations)
        self.spent_s += time.perf_counter() - started

    def tap_received(self, senders: Senders) -> None:
        """Read what the label owner receives from the ``senders`` of the stage above it (in one process)."""
        def tap(received: Callable[[], np.ndarray], stream: str, step: int) -> None:
            mb, mbs = stream_micro_batch(stream)
            self.received_activations(step, mb, mbs, received())
        senders.taps[ACTIVATION].append(tap)

    def set_run(self, eval_every: int, last_step: Any) -> None:
        """The run's evaluation period and last step, as a serving stage learns them from the hello: the
        windows follow the period and end at the last step (a last step that is no whole number: ``finish``
        closes the last window)."""
        self.meter.window = self.attacks.window = window_steps(eval_every)
        self.last_step = last_step if isinstance(last_step, int) and not isinstance(last_step, bool) else None

    def _after_update(self, record: StepRecord) -> None:
        if self.client is not None and record.client != self.client:
            return          # another client's update: its step's rows for this client may not be sent yet
        self._close(record.step, record.step == self.last_step)

    def finish(self, step: int) -> None:
        """The run ended after ``step``: close the last window (when the stage did not know its last step)."""
        self._close(step, True)

    def _close(self, step: int, last: bool) -> None:
        started = time.perf_counter()
        figures = self.meter.close(step, last)
        attacks = self.attacks.close(step, last)
        self.spent_s += time.perf_counter() - started
        if attacks and not any(w["step"] == step for w in self.attack_windows):
            self.attack_windows.append({"step": step, **attacks})
        else:
            attacks = None
        if not figures or any(w["step"] == step for w in self.windows):
            figures = None   # nothing to score, or a window closed again after a rollback: the first stands
        else:
            self.windows.append({"step": step, **figures})
        if not figures and not attacks:
            return
        both = {**(figures or {}), **(attacks or {})}
        self.log.info("privacy meter (%s) after step %d: %s", self.kind, step, figures_text(both))
        if self.report is not None:
            self.report(step, both)

    def figures_at(self, step: int, client: int | None = None) -> dict[str, float]:
        """The figures of the window that closed after ``step`` (none closed then: empty), for that step's
        record (``progress.StageRecords``, an observer after this one; ``client``: the record's, unused)."""
        figures: dict[str, float] = {}
        for windows in (self.windows, self.attack_windows):
            latest = windows[-1] if windows else {}
            if latest.get("step") == step:
                figures.update({k: v for k, v in latest.items() if k != "step"})
        return figures

    def reset(self) -> None:
        """A new run: no window, no figures yet."""
        self.meter.rollback(-1)
        self.attacks = AttackMeter(self.kind, self.attacks.window)
        self.windows, self.attack_windows, self.spent_s = [], [], 0.0

    def checkpoint_state(self, step: int) -> dict[str, np.ndarray]:
        """The meter after ``step`` as arrays for that step's checkpoint: the open window (``window/...``), the
        strongest attacks' state (``attacks/...``) and the figures of every window closed up to ``step``
        (``figures``: msgpack). The window due at ``step`` is closed first (a no-op once closed): the
        checkpoint holds it whichever observer of the update runs first. Its time spent is not kept."""
        self._close(step, step == self.last_step)
        figures = [[w for w in windows if w["step"] <= step] for windows in (self.windows, self.attack_windows)]
        return {"figures": np.frombuffer(msgpack.packb(figures), np.uint8),
                **prefixed("window/", self.meter.state(step)), **prefixed("attacks/", self.attacks.state(step))}

    def load_checkpoint_state(self, arrays: Mapping[str, np.ndarray] | None, step: int) -> None:
        """The meter as ``checkpoint_state`` gave it after ``step`` (None: as at the run's start, which a
        checkpoint written without a meter gives too: the meter then counts from ``step`` on, and says so).
        Raises ``ValueError`` when ``arrays`` are not a meter's state."""
        self.reset()
        if arrays is None:
            if step:
                self.log.warning("privacy meter (%s): the checkpoint of step %d holds no meter state (written "
                                 "without the meter): its windows and whole-run figures count from step %d",
                                 self.kind, step, step + 1)
            return
        windows, attack_windows = read_figures(arrays)
        self.meter.load_state(under("window/", arrays))
        self.attacks.load_state(under("attacks/", arrays))
        self.windows, self.attack_windows = windows, attack_windows

    def summary_fields(self) -> dict[str, Any]:
        """``{"label_leaks" | "input_leaks": [{"step": ..., figures}, ...]}``: every window's figures;
        ``label_attacks`` | ``input_attacks``: every window's figures of the strongest attacks
        (``AttackMeter``); ``label_leak_extremes`` | ``input_leak_extremes``: each figure's worst window, mean,
        last and whole-run figure (``meter.extremes``); and ``label_meter_s`` | ``input_meter_s``: the wall
        seconds the meter spent (its cost to the run)."""
        return meter_fields(self.kind, self.windows, self.attack_windows, self.spent_s)


OWNER_KEYS = {LABELS: "label_meters", INPUTS: "input_meters"}   # the summary's meters, by data owner


def by_owner(kind: str, owner: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """A meter's (or guard's) summary ``fields`` in a run of several data owners (clients, feature parties):
    ``{"input_meters" | "label_meters": {owner: fields}}``, ``owner`` naming the data owner they are about
    (a feature party's stage, a client's ``f@K``); {} for no fields."""
    return {OWNER_KEYS[kind]: {owner: dict(fields)}} if fields else {}


class PeerMeters:
    """The label owner's meters when it serves several data owners: one ``Metering`` per client or feature
    party, each fed only the gradient rows sent to it (its streams) against its own rows' labels
    (``secrets[i]``, ``rows[i]``: as ``Metering``'s ``secret_of``, ``rows_of``), and each party's received
    activations (``received_activations``' ``peer``). With ``clients`` each meter's windows close on that
    client's updates (a round holds one update per client). ``names[i]`` names peer ``i`` in the summary
    (``label_meters``), ``streams[i]`` its streams' peer part (``clientK`` or the party's stage)."""

    def __init__(self, engine: StepEngine, names: list[str], streams: list[str],
                 secrets: list[Callable[[int], np.ndarray]], rows: list[Callable[[int], np.ndarray] | None],
                 eval_every: int, last_step: int | None = None, clients: bool = False,
                 log: logging.Logger | None = None) -> None:
        self.names, self.clients = names, clients
        self.meters = [Metering(LABELS, engine, secret, eval_every, last_step, log=log, rows_of=row,
                                peer=stream, client=index if clients else None)
                       for index, (stream, secret, row) in enumerate(zip(streams, secrets, rows))]

    def set_run(self, eval_every: int, last_step: Any) -> None:
        """As ``Metering.set_run``, for every peer's meter."""
        for meter in self.meters:
            meter.set_run(eval_every, last_step)

    def received_activations(self, step: int, mb: int, mbs: int, activations: np.ndarray, peer: int = 0) -> None:
        """Peer ``peer`` sent ``activations`` (its meter's model-completion input)."""
        self.meters[peer].received_activations(step, mb, mbs, activations)

    def tap_received(self, senders: Senders, peer: int) -> None:
        """Read what the label owner receives from peer ``peer``'s ``senders`` (in one process)."""
        self.meters[peer].tap_received(senders)

    def finish(self, step: int) -> None:
        for meter in self.meters:
            meter.finish(step)

    def reset(self) -> None:
        for meter in self.meters:
            meter.reset()

    def figures_at(self, step: int, client: int | None = None) -> dict[str, float]:
        """With clients, the figures of ``client``'s window that closed after ``step`` (its record's); with
        feature parties every party's, each named ``PARTY/NAME``."""
        if self.clients:
            return {} if client is None else self.meters[client].figures_at(step)
        return {f"{name}/{key}": value for name, meter in zip(self.names, self.meters)
                for key, value in meter.figures_at(step).items()}

    def checkpoint_state(self, step: int) -> dict[str, np.ndarray]:
        """Every peer's meter after ``step`` (``I/...``: peer I's ``Metering.checkpoint_state``)."""
        return {f"{index}/{key}": value for index, meter in enumerate(self.meters)
                for key, value in meter.checkpoint_state(step).items()}

    def load_checkpoint_state(self, arrays: Mapping[str, np.ndarray] | None, step: int) -> None:
        """Every peer's meter as ``checkpoint_state`` gave it (None: as at the run's start)."""
        for index, meter in enumerate(self.meters):
            meter.load_checkpoint_state(None if arrays is None else under(f"{index}/", arrays) or None, step)

    def summary_fields(self) -> dict[str, Any]:
        """``{"label_meters": {peer name: that peer's meter's ``Metering.summary_fields``}}``."""
        return {OWNER_KEYS[LABELS]: {name: meter.summary_fields() for name, meter in zip(self.names, self.meters)}}


def _unsent(step: int, mb: int, mbs: int) -> str:
    """What a guard stop at micro-batch ``mb`` of ``mbs`` of ``step`` kept back: the step's activations from
    that micro-batch on (those before it crossed already), and every part of the step's update."""
    if mb == 0:
        return f"nothing of step {step} was sent, applied or checkpointed"
    return (f"micro-batches {mb + 1} to {mbs} of step {step} were not sent (micro-batches 1 to {mb} had crossed "
            f"already), and nothing of the step was applied or checkpointed")


class Guarding:
    """A data owner's ``input_guard`` in a run: a tap on the activations ``engine``'s stage sends that feeds
    each micro-batch, as the receiver decodes it, with its input rows (``inputs_of(step)``: the step's batch)
    to an ``InputGuard``, and raises ``InputGuardStop`` before the micro-batch leaves when its inversion
    R^2 passes ``max_r2`` after its first ``after`` steps (the caller stops the run: nothing of the step is applied or checkpointed). It
    reads only: a guarded run that is not stopped is bitwise the unguarded. ``peak`` is the highest R^2 it
    measured."""

    def __init__(self, engine: StepEngine, inputs_of: Callable[[int], np.ndarray], setting: tuple[float, int],
                 stage: str, log: logging.Logger | None = None,
                 rows_of: Callable[[int], np.ndarray] | None = None) -> None:
        self.guard, self.inputs_of, self.stage, self.rows_of = InputGuard(*setting), inputs_of, stage, rows_of
        self.log = log or logging.getLogger("distgrad.privacy")
        self.peak: tuple[float, int] | None = None        # (R^2, step) over the applied steps
        self._judged: list[tuple[float, int]] = []         # (R^2, step) of the steps sent, not applied yet
        self._inputs: tuple[int, np.ndarray, np.ndarray | None] | None = None
        engine.senders.taps[ACTIVATION].append(self._tap)
        engine.observers.append(lambda record: self._applied(record.step))

    def _tap(self, received: Callable[[], np.ndarray], stream: str, step: int) -> None:
        mb, mbs = stream_micro_batch(stream)
        if self._inputs is None or self._inputs[0] != step:
            rows = None if self.rows_of is None else np.asarray(self.rows_of(step))
            self._inputs = (step, np.asarray(self.inputs_of(step)), rows)
        rows = self._inputs[2]
        self.guard.observe(step, mb, micro_batch(self._inputs[1], mb, mbs), received(),
                           None if rows is None else micro_batch(rows, mb, mbs))
        if not self.guard.judges(step):
            return
        score = self.guard.score()
        if score is None:
            return
        self._judged.append((score, step))
        if score > self.guard.max_r2:
            self.log.error("input_guard: step %d's activations reconstruct the inputs with R^2 %.3f > max_r2 %g",
                           step, score, self.guard.max_r2)
            raise InputGuardStop(
                f"stage {self.stage!r}: input_guard stopped the run before sending step {step}: its activations "
                f"reconstruct its inputs with R^2 {score:.3f} (the best ridge decoder fitted on the public fifth of "
                f"its latest {self.guard.need}+ rows), above max_r2 {self.guard.max_r2:g}. The label owner may be training "
                f"this stage towards its own decoder instead of the task; {_unsent(step, mb, mbs)}")

    def _applied(self, step: int) -> None:
        self.guard.applied(step)
        self.peak, self._judged = self._peak(step), [j for j in self._judged if j[1] > step]

    def _peak(self, step: float) -> tuple[float, int] | None:
        """The highest R^2 judged of the steps up to ``step`` (the first such step on a tie)."""
        peak = self.peak
        for score, judged in self._judged:
            if judged <= step and (peak is None or score > peak[0]):
                peak = (score, judged)
        return peak

    def checkpoint_state(self, step: int) -> dict[str, np.ndarray]:
        """The guard after ``step`` as arrays for that step's checkpoint: its latest rows (``guard/...``,
        ``InputGuard.state``) and the highest R^2 judged up to it (``peak``: [R^2, step], empty for none)."""
        peak = self._peak(step)
        return {"peak": np.array(peak if peak is not None else [], np.float64),
                **prefixed("guard/", self.guard.state(step))}

    def load_checkpoint_state(self, arrays: Mapping[str, np.ndarray] | None, step: int) -> None:
        """The guard as ``checkpoint_state`` gave it after ``step`` (None: as at the run's start; a checkpoint
        written without the guard gives that too, and the guard says so). Raises ``ValueError`` when
        ``arrays`` are not a guard's state."""
        self._judged, self.peak = [], None
        if arrays is None:
            self.guard.load_state({}, step)
            if step:
                self.log.warning("input_guard: the checkpoint of step %d holds no guard state (written without "
                                 "the guard): it judges the rows sent from step %d on", step, step + 1)
            return
        peak = read_peak(arrays)
        self.guard.load_state(under("guard/", arrays), step)
        self.peak = peak

    def summary_fields(self) -> dict[str, Any]:
        """``input_guard``: its ``max_r2``, ``after``, and the highest R^2 it judged (``peak_r2``, at ``peak_step``)."""
        return guard_fields((self.guard.max_r2, self.guard.after), self._peak(float("inf")))
