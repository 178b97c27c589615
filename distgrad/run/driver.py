"""The driving (first) stage: ``drive_first_stage`` owns the data and the step counter.

It connects to the next stage (the last one, or a middle stage that passes
everything on), shakes hands, and for every step sends the activations of
each micro-batch and applies the gradients that come back, with retries on
fresh sockets (``link.DownstreamLink``) and a rollback to a common step
whenever a stage below has lost track. After every ``eval_every``-th step and
the last it evaluates the held-out rows through every stage; each step's
record (and its evaluation) goes to the metrics file and the progress line.

``_Driver`` is written in four classes, each the base of the next:
``driver_state.DriverState`` (what the stage holds, the handshake),
``driver_records.DriverRecords`` (evaluations, each step's record and
report), ``driver_steps.DriverSteps`` (the step engines) and ``_Driver``
(here: the run loop, its end and its failures).
"""


from __future__ import annotations

import sys
import time
from typing import Any

import zmq

from distgrad.config.experiment import client_stage_name
from distgrad.errors import Interrupted, PeerRejected, PeerTimeout, ProtocolError, StageError, peer_text
from distgrad.privacy.meter import INPUTS
from distgrad.run.driver_steps import DriverSteps
from distgrad.run.metering import by_owner
from distgrad.run.options import PROGRESS_UPDATES, StageOptions, StopFlag
from distgrad.run.protocol import shake_hands_again
from distgrad.run.stage_state import finished_run, lock_checkpoint_dir, nothing_to_do
from distgrad.stage.records import best_evaluation_fields, ending_fields, evaluation_fields
from distgrad.stage.stage import Stage
from distgrad.threads import one_compute_thread
from distgrad.wire import messages as wire
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.transport import NOTICE_LINGER_MS

PING_TIMEOUT_S = 1.0      # how long to wait for the stage below to say whom it waits for, after giving up on it


class _Driver(DriverSteps):
    """The first stage's loop: handshake, steps, bye, with retries and rollbacks."""

    def run(self) -> dict[str, Any]:
        """Start (or resume) the run and drive it to its bye; return the summary. ``Interrupted`` and
        ``PeerTimeout`` are raised after a checkpoint is saved; a stage below's refusal of a non-finite step
        is raised as ``StageError``; this stage's own failure is told to the stage below before it is raised.
        Every applied step is reported, and the link, files and bar closed, whatever happens."""
        state = self.state
        self._start()
        started = time.perf_counter()
        told = ended = False
        try:
            self._run()
            ended = True
        except Interrupted:
            state.save()            # between steps the state is consistent: a restart continues here
            raise
        except PeerTimeout as e:
            state.save()
            waiting_for = self._waiting_for()
            if waiting_for:
                raise PeerTimeout(f"{e}; stage {self.exp.downstream(self.opts.stage)} is waiting for "
                                  f"{', '.join(waiting_for)} (a step needs every feature party)") from e
            raise
        except PeerRejected as e:
            if e.code == ErrorCode.NONFINITE_STEP:
                # A stage below found a non-finite loss or gradient and applied nothing: a stage
                # failed (exit 1); this stage sent nothing wrong, so it is no refusal (exit 4).
                raise StageError(e.peer_message) from e
            raise
        except Exception as e:
            # This stage's own failure (its data, model or files): the stage below is told why at once (an
            # aborted notice), instead of waiting out its liveness for a step that will not come.
            told = self._tell_below(e)
            raise
        finally:
            try:
                self._report()
                if not ended:
                    self._ended_summary(started, sys.exc_info()[1])
            finally:
                state.close()
                self.link.close(linger_ms=NOTICE_LINGER_MS if told else None)
                for writer in self.writers:
                    writer.close()
                self.progress.close()
        return self._summary(started)

    def _run(self) -> None:
        """Handshake, then each step (or the evaluation owed first) and its record, until the last step
        (``_finish``); when the stage below has lost this run, shake hands again and go on from there."""
        self.handshake()
        self.report_every = max(1, self.steps // PROGRESS_UPDATES)
        self.started = self.last_report = time.perf_counter()
        self.last_step = self.state.stage.step
        while True:
            stage = self.state.engine.stage
            self.step_started, self.wait_before, self.g_before = (time.perf_counter(), self.traffic.wait_s,
                                                                  self.g_compute_s)
            try:
                if stage.step >= self.steps:
                    self._finish(stage)
                    return
                if self.may_owe and self._owes_evaluation():
                    self.evaluate()
                    continue
                self.step_once()
                self._after_step()
            except PeerRejected as e:
                if not shake_hands_again(e):
                    raise
                # The server restarted or lost our run: agree on a step again.
                self.log.warning("%s; shaking hands again", e.peer_message)
                self.handshake()

    def _finish(self, stage: Stage) -> None:
        """After the last step: its report, its evaluation if not taken yet, the test rows once (with a
        validation split), the bye, and the checkpoint of a finished run."""
        self._report()
        self.state.save()
        if self.holds_out and not (self.evaluations and self.evaluations[-1]["step"] == stage.step):
            self.evaluate()     # e.g. resumed after the last step, or its evaluation was refused
        if self.validation and self.state.final_test is None:
            self.evaluate(final=True)   # the test rows, once: the kept model's (resumed: done before)
        self.link.exchange(Message(wire.BYE, self.state.run_id, stage.step + 1, body={"steps": stage.step}))
        # --save first: a stage killed between the two, rerun with --resume, finds the run finished and writes
        # nothing, so its parameters must be on disk before the checkpoint that says so.
        self.state.save_parameters()
        self.state.save(final_loss=self.loss, finished=True)   # a rerun with --resume: nothing to do

    def _summary(self, started: float) -> dict[str, Any]:
        """The summary of a completed run that started at ``started`` (``time.perf_counter``)."""
        return self.state.summary("completed", started, self.loss, endpoint=self.connect,
                                  micro_batches=self.opts.micro_batches, schedule=self.opts.schedule,
                                  # with steps in flight every micro-batch of a step is sent at once
                                  in_flight=self.opts.micro_batches if self.staleness else self.opts.window,
                                  staleness=self.staleness,
                                  **({"staleness_auto": self.probe.fields(self.staleness)} if self.probe else {}),
                                  **evaluation_fields(self.evaluation),
                                  **({"evaluations": self.evaluations} if self.holds_out else {}),
                                  **best_evaluation_fields(self.evaluations, self.state.verdicts.best_step),
                                  **self._meter_fields(), **self._loss_fields())

    def _ended_summary(self, started: float, error: BaseException | None) -> None:
        """A run that ends on ``error`` still writes its summary (``--summary``): the steps applied, their last
        loss and the parameters, with ``status`` and ``error`` (``records.ending_fields``). Best effort: the
        error is what the stage ends with, so a summary that cannot be written is only logged."""
        if error is None or self.opts.summary_path is None:
            return
        try:
            self.state.summary(ending_fields(error)["status"], started, self.loss, error=str(error),
                               micro_batches=self.opts.micro_batches,
                               **({"evaluations": self.evaluations} if self.holds_out else {}),
                               **self._meter_fields(), **self._loss_fields())
        except Exception as e:     # noqa: BLE001 - the run's own error is the one to raise
            self.log.error("the summary of the run that ended could not be written: %s", e)

    def _meter_fields(self) -> dict[str, Any]:
        """The summary's fields of this data owner's meter and guard; in a run of several data owners
        (clients, feature parties) under ``input_meters``, named by this one (``metering.by_owner``)."""
        fields = {**(self.metering.summary_fields() if self.metering else {}),
                  **(self.guarding.summary_fields() if self.guarding else {})}
        if self.exp.federated or self.exp.vertical:
            return by_owner(INPUTS, client_stage_name(self.opts.stage, self.opts.client), fields)
        return fields

    def _tell_below(self, error: Exception) -> bool:
        """Send the stage below an ``aborted`` notice naming ``error`` (``peer_text``: no value of this stage's
        own; best effort: the link is closing); True when it was sent. Not once the run is over, nor before it has an id."""
        if not self.state.run_id:
            return False
        try:
            self.link.send(wire.abort_notice(self.state.run_id, self.opts.stage, f"it failed: {peer_text(error)}"))
        except Exception:           # noqa: BLE001 - the notice is a courtesy; the failure is what is raised
            return False
        return True

    def _waiting_for(self) -> list[str]:
        """The feature parties the stage below says it waits for (a vertical run), asked once after this
        stage gave up on it; empty when it does not answer or waits for none."""
        if not self.exp.vertical:
            return []
        try:
            pong = self.link.ping(self.state.run_id, PING_TIMEOUT_S)
        except (PeerTimeout, PeerRejected, ProtocolError):
            return []
        names = pong.body.get("waiting_for")
        return [name for name in names if isinstance(name, str)][:16] if isinstance(names, list) else []


@one_compute_thread()
def drive_first_stage(opts: StageOptions, connect: str, stop: StopFlag,
                      ctx: zmq.Context | None = None) -> dict[str, Any]:
    """Train ``opts.steps`` steps against the stage serving at ``connect``; return the summary.

    Retries an unanswered request on a fresh socket until ``opts.peer_deadline_s``
    and then raises ``PeerTimeout`` naming the endpoint; raises
    ``PeerRejected`` when the server refuses a message for good (e.g. another
    experiment), ``Interrupted`` on a signal, after saving a checkpoint.
    With ``--checkpoint-dir``, holds the stage's lock there for the whole run
    (``ConfigError`` if another process holds it); with ``--resume`` and a
    finished run there, returns that run's summary at once, connecting to
    nothing and writing no file.
    """
    lock = lock_checkpoint_dir(opts)
    try:
        done = finished_run(opts)
        if done is not None:
            return nothing_to_do(opts, done)
        return _Driver(opts, connect, stop, ctx or zmq.Context.instance()).run()
    finally:
        if lock is not None:
            lock.release()
