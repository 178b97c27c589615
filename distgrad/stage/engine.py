"""The step engine: the one place where a stage's step is put together and applied.

Every runner (the in-process reference, the driving stage, the serving stage
of one or several clients, a middle stage) feeds a stage's step through a
``StepEngine`` in the same way, whatever carries the tensors:

1. ``add`` each micro-batch's parameter gradients in micro-batch order
   (0, 1, ...), with the micro-batch's loss where this stage knows it and, on
   the last stage, the activation gradient it sent up (for the trace);
2. ``update`` once per step: the gradients summed in that order times the
   loss's micro-batch scale, checked finite, copied for the trace, applied by
   the optimiser; the step's loss from the micro-batch losses; then whatever
   the runner does between the update and the record (the SplitFed average),
   the trace line, and the observers (checkpoint, metrics, progress).

The engine also holds what the stage encodes its outgoing tensors with
(``senders``, ``distgrad.wire.wirecodec``): the error-feedback residuals a step's
sends computed become the stage's with its update, and are forgotten with a
step that is dropped (``reset``), so they always match the parameters.

What differs between the runners (where activations come from, where
gradients go, whether the update comes after the reply) is when they call
these, never what they compute: that is what makes every topology bitwise
equal to the in-process reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Protocol

import numpy as np

from distgrad.config.experiment import Experiment
from distgrad.model.nn import Grads
from distgrad.stage.stage import Stage
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, Senders, stream_micro_batch, stream_peer


class GradAccumulator:
    """Sums the gradients of a step's micro-batches in a fixed order (0, 1, ...).

    Buffers are reused from step to step. With one micro-batch the gradients
    pass through untouched, so an unsplit step computes exactly what it would
    without this class. A parameter some micro-batches give no gradient (a torch
    module whose graph depends on the data) sums those that do, as torch's
    ``grad`` accumulation does; one no micro-batch of the step gives a gradient
    gets none, whatever an earlier step left in its buffer.
    """

    def __init__(self) -> None:
        self._sum: Grads = {}
        self._step: Grads = {}     # the buffers of ``_sum`` this step's micro-batches wrote, in first-seen order
        self._single: Grads | None = None
        self.count = 0          # micro-batches of the step in progress added so far (read-only outside)

    def add(self, grads: Grads, index: int, count: int) -> None:
        """Add micro-batch ``index`` of ``count``; ``index`` must follow the previous one."""
        if index != self.count:
            raise ValueError(f"micro-batch {index} accumulated out of order (expected {self.count})")
        self.count += 1
        if count == 1:
            self._single = grads
            return
        if index == 0:
            self._step = {}
        summed = self._step
        for name, g in grads.items():
            buffer = summed.get(name)
            if buffer is not None:
                buffer += g
                continue
            buffer = self._sum.get(name)
            if buffer is None or buffer.shape != g.shape or buffer.dtype != g.dtype:
                buffer = self._sum[name] = np.empty_like(g)
            np.copyto(buffer, g)
            summed[name] = buffer

    def take(self, scale: np.float32) -> Grads:
        """The accumulated gradients times ``scale`` (skipped when it is 1); resets the count."""
        count, self.count = self.count, 0
        if self._single is not None:
            grads, self._single = self._single, None
            return grads
        if count == 0:
            raise ValueError("no micro-batch was accumulated")
        grads, self._step = self._step, {}
        if scale != 1:
            for buffer in grads.values():
                buffer *= scale
        return grads

    def reset(self) -> None:
        """Forget a partly accumulated step (a rollback)."""
        self.count, self._single, self._step = 0, None, {}


def combine_losses(losses: list[np.float32], scale: np.float32) -> np.float32:
    """A step's loss from its micro-batch losses: summed in order, times ``scale``."""
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total * scale if len(losses) > 1 else total


def crossed_direction(exp: Experiment, first: bool, last: bool) -> str | None:
    """What a stage of ``exp`` sends across the cut, recorded in its trace as ``sent_DIRECTION``
    (``trace_crossed``): a data owner's (a first stage's, a client's, a feature party's) activations, the
    label owner's (last stage's) activation gradients. A middle stage and the only stage record nothing, nor
    does a feature party of ``secure_aggregation`` (what crosses is masked: its embedding reaches no one)."""
    if first == last or (first and exp.secure_aggregation):
        return None
    return ACTIVATION if first else GRADIENT


def crossed_names(exp: Experiment, stage: str) -> dict[str, str] | None:
    """How ``stage`` of a vertical experiment names what crossed by feature party, ``sent_DIRECTION/PARTY``
    (``StepEngine``'s ``crossed_names``: a stream's peer part -> the party): a party its own sends, the label
    owner each party's gradient by the stream it goes on. None elsewhere: one data owner, and ``[clients]``,
    whose trace lines each name their client."""
    if not exp.vertical:
        return None
    parties = exp.data_owners
    if stage in parties:
        return {"": stage}
    if stage != exp.stage_names[-1]:
        return None
    return {**{party: party for party in parties}, **({"": parties[0]} if len(parties) == 1 else {})}


class TraceSink(Protocol):
    """Where traced steps go (``records.TraceWriter``, or the in-process path's merger)."""

    def wants(self, step: int) -> bool: ...

    def write(self, step: int, loss: float | None, grads: Grads, params: Grads, client: int | None = None) -> None: ...


@dataclass(frozen=True)
class StepRecord:
    """What observers learn of an applied update."""

    step: int                      # the run's step (with several clients: the round)
    loss: float | None             # the step's loss, where this stage knows it
    client: int | None = None      # whose step it was, when a stage serves several clients
    lr: float | None = None        # the learning rate this update used (``Stage.learning_rate``)


class StepEngine:
    """Accumulates, scales, checks, applies, traces and reports one stage's steps.

    ``loss_scale(M)`` is the float32 factor the final loss gives the sum of M
    micro-batch gradients (``Loss.micro_batch_scale``). ``trace`` receives a
    line per traced step; with ``trace_sent``, the activation gradients this
    stage sent up go in it as ``activation_grad`` (the last stage's, as it
    computed them: before its defenses and codec). With ``trace_crossed`` (a
    direction, ``ACTIVATION`` or ``GRADIENT``), what the stage sent that way on
    a traced step goes in it as ``sent_DIRECTION`` (``sent_activation``,
    ``sent_activation_grad``): every micro-batch, in order, exactly as the
    receiver decoded it (after defenses and codec; read by a tap of
    ``senders``), which is what ``distgrad audit`` attacks. ``observers`` see
    every applied update. ``senders`` encode what the stage sends (default: no codec).
    """

    def __init__(self, stage: Stage, loss_scale: Callable[[int], np.float32], trace: TraceSink | None = None,
                 trace_sent: bool = False, senders: Senders | None = None, trace_crossed: str | None = None,
                 crossed_names: Mapping[str, str] | None = None) -> None:
        self.stage = stage
        self.senders = senders if senders is not None else Senders({})
        self.loss_scale = loss_scale
        self.trace_sent = trace_sent
        self.observers: list[Callable[[StepRecord], None]] = []
        self._scales: dict[int, np.float32] = {}        # loss_scale(M), computed once per M
        self._accumulator = GradAccumulator()
        self._losses: list[np.float32] = []
        self._sent: list[np.ndarray] = []
        # (step, name, micro-batch) -> what was received; the name is ``sent_DIRECTION``, with ``crossed_names``
        # (a vertical experiment's stages) ``sent_DIRECTION/PARTY`` by the stream's peer part
        self._crossed: dict[tuple[int, str, int], np.ndarray] = {}
        self._crossed_name = f"sent_{trace_crossed}" if trace_crossed is not None else ""
        self._crossed_names = crossed_names
        self._crossed_taps = self.senders.taps[trace_crossed] if trace_crossed is not None else None
        self.trace = trace

    @property
    def trace(self) -> TraceSink | None:
        return self._trace

    @trace.setter
    def trace(self, trace: TraceSink | None) -> None:
        """The trace may be given later (``StageState.open_trace``). What crosses is tapped (``_record_crossed``)
        only while a trace can write a line: a disabled ``TraceWriter`` (no ``--trace``) costs no tap per send."""
        self._trace = trace
        # A disabled ``TraceWriter`` stays so (``wants`` is always False): it is not asked every step.
        self._tracing = tapping = trace is not None and getattr(trace, "enabled", True)
        taps = self._crossed_taps
        if taps is not None:
            if tapping and self._record_crossed not in taps:
                taps.append(self._record_crossed)
            elif not tapping and self._record_crossed in taps:
                taps.remove(self._record_crossed)

    def _record_crossed(self, received: Callable[[], np.ndarray], stream: str, step: int) -> None:
        """A tap: keep what crossed on a step the trace writes (a micro-batch sent again replaces it)."""
        if self._trace is not None and self._trace.wants(step):
            name = self._crossed_name
            if self._crossed_names is not None:
                peer = stream_peer(stream)
                name = f"{name}/{self._crossed_names.get(peer, peer)}"
            self._crossed[(step, name, stream_micro_batch(stream)[0])] = np.array(received(), copy=True)

    @property
    def done(self) -> int:
        """Micro-batches of the step in progress added so far."""
        return self._accumulator.count

    def reset(self) -> None:
        """Forget a partly accumulated step (a rollback, a dropped client, a failure)."""
        self._accumulator.reset()
        self._losses, self._sent = [], []
        self._crossed = {}
        self.senders.discard()

    def add(self, mb: int, mbs: int, grads: Grads, loss: np.float32 | None = None,
            sent: np.ndarray | None = None) -> None:
        """Micro-batch ``mb`` of ``mbs``: its parameter gradients, its loss where this stage knows it,
        and the activation gradient sent up (kept for the trace only). ``mb`` must follow the last one."""
        self._accumulator.add(grads, mb, mbs)
        if loss is not None:
            self._losses.append(loss)
        if sent is not None and self.trace_sent and self._trace is not None:
            self._sent.append(sent)

    def apply_step(self, step: int, mbs: int, micro_batches: Iterable[tuple[Grads, np.float32 | None]],
                   before: Callable[[], None] | None = None, between: Callable[[], None] | None = None,
                   client: int | None = None) -> float | None:
        """Step ``step`` whole: the parameter gradients (and the loss, where this stage knows it) of each of
        its ``mbs`` micro-batches, as ``micro_batches`` yields them in micro-batch order, added (``add``);
        then ``before`` (if given) and the update (``update``, with ``between`` and ``client`` as there).
        ``micro_batches`` may compute each one when it is asked for (a driver receives each reply and sends
        the next forward in between). Raises ``ValueError`` (the step forgotten) when it yields another
        number of micro-batches than ``mbs``."""
        for mb, (grads, loss) in enumerate(micro_batches):
            self.add(mb, mbs, grads, loss)
        if self.done != mbs:
            added = self.done
            self.reset()
            raise ValueError(f"step {step}: {added} micro-batches were added, expected {mbs}")
        if before is not None:
            before()
        return self.update(step, mbs, between, client)

    def update(self, step: int, mbs: int, between: Callable[[], None] | None = None,
               client: int | None = None) -> float | None:
        """Apply step ``step`` from its ``mbs`` added micro-batches; return the step's loss (None when this
        stage saw no loss).

        Raises ``NonFiniteError`` (nothing applied, the step forgotten) when a
        gradient is NaN or infinite and the experiment forbids it. ``between``
        runs after the update and before the trace line and the observers.
        """
        stage = self.stage
        scale = self._scales.get(mbs)
        if scale is None:
            scale = self._scales[mbs] = self.loss_scale(mbs)
        grads = self._accumulator.take(scale)
        try:
            stage.check_grads(grads)
        except Exception:
            self.reset()
            raise
        trace = self._trace
        traced = ({name: g.copy() for name, g in grads.items()}
                  if self._tracing and trace is not None and trace.wants(step) else None)
        stage.apply(grads)
        self.senders.commit()           # before the observers: a checkpoint holds the residuals of this step
        losses = self._losses
        loss = (float(losses[0]) if len(losses) == 1 else float(combine_losses(losses, scale))) if losses else None
        sent, self._losses, self._sent = self._sent, [], []
        if between is not None:
            between()
        if traced is not None and trace is not None:
            if sent:
                traced["activation_grad"] = np.concatenate(sent) if len(sent) > 1 else sent[0]
            crossed: dict[str, list[np.ndarray]] = {}
            for key in sorted(key for key in self._crossed if key[0] == step):     # by name, micro-batch order
                crossed.setdefault(key[1], []).append(self._crossed.pop(key))
            for name, parts in crossed.items():
                traced[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
            extra = {} if client is None else {"client": client}
            trace.write(step, loss, traced, stage.params, **extra)
        if self.observers:
            record = StepRecord(step, loss, client, stage.learning_rate())
            for observer in self.observers:
                observer(record)
        return loss
