"""What the driving stage records after a step (``DriverRecords``): the evaluation of the held-out rows when it
is due (and one owed after a handshake), each applied step's record to the metrics file and TensorBoard, the
progress bar or log line, and the privacy meter's figures.

Built on ``driver_state.DriverState``; the base of ``driver_steps.DriverSteps``, whose steps report the records
queued here while a reply is awaited.
"""


from __future__ import annotations

import time
from typing import Any

import numpy as np

from distgrad.errors import ProtocolError
from distgrad.run.driver_state import DriverState
from distgrad.stage.records import evaluation_entry, loss_text, scores_text
from distgrad.stage.stage import held_out_part, kept_model
from distgrad.wire import messages as wire
from distgrad.wire.link import check_evaluation, final_body, is_final
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import EVALUATION, TEST

EVALUATION_TYPES = frozenset({wire.EVALUATION})    # an evaluation's reply (with steps in flight, a forward's
                                                   # may share its step and micro-batch)


class DriverRecords(DriverState):
    """Evaluations and the records of applied steps: ``_after_step`` queues a step's record (with its
    evaluation when due), ``_report`` writes what is queued, ``evaluate`` asks the stage below for scores."""

    def evaluate(self, final: bool = False) -> dict[str, Any]:
        """Held-out rows forward through every stage (changing none); the label owner scores them.
        Returns and records ``records.evaluation_entry`` of the step this stage stands at. With a validation
        split these are the validation rows; ``final``: the test rows instead, once, after the last step, with
        the kept model on every stage (``StageState.kept_model``), recorded for the summary only
        (``StageState.record_test``; returned as they came)."""
        step = self.state.stage.step
        part, _ = held_out_part(self.validation, final)
        # Called only for data that holds out rows (``holds_out``): the held-out rows' methods are those
        # sources' (forwarded by the wrappers' __getattr__), not ``DataSource``'s.
        with kept_model(self.state.stage, self.state.kept_model() if final else None):
            y, _ = self.state.stage.forward(self.data.test_features()[part],  # type: ignore[attr-defined]
                                            training=False)
        tensors = self.state.senders.evaluation_tensors(y, step + 1, TEST if final else EVALUATION)
        if self.exp.labels_travel:
            tensors["target"] = np.asarray(self.data.test_targets(), self.target_dtype)[part]  # type: ignore[attr-defined]
        msg = Message(wire.EVALUATE, self.state.run_id, step + 1, body=final_body(final), tensors=tensors)
        if self.in_flight:
            # Replies to the steps in flight may come first (one shares this step and micro-batch): kept.
            pending = {key: request for requests in self.pending.values() for key, request in requests.items()}
            pending[(msg.step, msg.mb)] = msg
            self.link.send(msg)
            reply = self.link.await_reply(pending, (msg.step, msg.mb), EVALUATION_TYPES)
        else:
            reply = self.link.exchange(msg)
        body = check_evaluation(reply)
        if final != is_final(reply):
            raise ProtocolError(ErrorCode.MALFORMED, f"stage {self.below} answered the {'final ' if final else ''}"
                                                     f"evaluation after step {step} with scores of other rows")
        if final:
            self.state.record_test(body)
            return body
        self.evaluation = body
        entry = evaluation_entry(step, body)
        self.evaluations.append(entry)
        self.log.info("step %d: %s loss %.6g%s", step, "validation" if self.validation else "test", body["loss"],
                      scores_text(entry))
        self.state.take_verdict(step, body)
        if body.get("stop"):
            self.steps = step       # early stopping: the label owner ends the run on every party here
        return entry

    def _owes_evaluation(self) -> bool:
        """A feature party back in a vertical run at a step whose evaluation it has not taken: the stage
        below waits for every party's held-out embeddings of that step before the next step. A stage with
        ReduceLROnPlateau back at a step whose evaluation its scheduler has not taken owes it too."""
        if not self.may_owe:
            return False                # nothing is owed without held-out rows (``_evaluation_due``)
        step = self.state.stage.step
        if self.plateau and 0 < step < self.steps and self._evaluation_due(step):
            return self.state.plateau_at < step     # its scheduler steps on that evaluation before the next update
        return (self.vertical and 0 < step < self.steps and self._evaluation_due(step)
                and not (self.evaluations and self.evaluations[-1]["step"] == step))

    def _after_step(self) -> None:
        """After each applied step: the evaluation when it is due (its verdicts may end the run here), then
        the step's record (with the evaluation's scores) queued for ``_report``. The record is queued even
        when the evaluation fails (without its scores): the step was applied."""
        step, now, loss = self.state.engine.stage.step, time.perf_counter(), self.loss
        record = None
        if self.writers:
            wait = self.traffic.wait_s - self.wait_before
            record = {
                "step": step, "loss": loss, "lr": self.state.stage.learning_rate(),
                "wall_s": now - self.started, "step_s": now - self.step_started,
                "bytes_sent": self.traffic.sent, "bytes_received": self.traffic.received,
                "f_compute_s": now - self.step_started - wait, "f_wait_s": wait,
                "g_compute_s": self.g_compute_s - self.g_before}
        test: dict[str, Any] = {}
        try:
            if self._evaluation_due(step):
                test.update((key, value) for key, value in self.evaluate().items() if key != "step")
        finally:
            if self.leaks:
                test.update(self.leaks)
                self.leaks = {}
            self.unreported.append((step, loss, now, record, test))

    def _report(self) -> None:
        """The steps ``_after_step`` queued, in order: each one's record to each step writer, the bar or a
        log line. Called while the next step's replies are awaited (``_while_waiting``), at the end of the
        run and when it fails, so that every applied step is reported."""
        while self.unreported:      # each taken before it is written: a failing writer does not write it twice
            step, loss, now, record, test = self.unreported.pop(0)
            if record is not None:
                record.update(test)
                for writer in self.writers:
                    writer.write(record)
            self.progress.update(step, loss, force=step == self.steps, test=test)
            if self.opts.progress == "off" and (step % self.report_every == 0 or step == self.steps):
                elapsed = now - self.last_report
                rate = (step - self.last_step) / elapsed if elapsed > 0 else float("nan")
                self.last_report, self.last_step = now, step
                self.log.info("step %d/%d loss %s (%.0f steps/s)", step, self.steps, loss_text(loss), rate)
