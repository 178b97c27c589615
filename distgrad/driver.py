"""The driving (first) stage: ``drive_first_stage`` owns the data and the step counter.

It connects to the next stage (the last one, or a middle stage that passes
everything on), shakes hands, and for every step sends the activations of
each micro-batch and applies the gradients that come back, with retries on
fresh sockets (``link.DownstreamLink``) and a rollback to a common step
whenever a stage below has lost track.
"""


from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import zmq

from . import wire
from .errors import ConfigError, Interrupted, PeerRejected, PeerTimeout, ProtocolError, StageError
from .inprocess import evaluation_fields
from .losses import build_loss
from .stage import check_micro_batches, combine_losses, micro_batch
from .progress import MetricsWriter, Progress
from .link import DownstreamLink, check_evaluation, check_reply
from .transport import Traffic
from .wire import ErrorCode, Message

from .daemon import (PROGRESS_UPDATES, StageOptions, StageState, StopFlag, finished_run, lock_checkpoint_dir,
                     micro_shape, nothing_to_do)


class _Driver:
    """The first stage's loop: handshake, steps, bye, with retries and rollbacks."""

    def __init__(self, opts: StageOptions, connect: str, stop: StopFlag, ctx: zmq.Context) -> None:
        exp = opts.experiment
        if exp.stage_index(opts.stage) != 0 or len(exp.stages) < 2:
            raise ConfigError(f"the driving stage is the first stage {exp.stage_names[0]!r} of an experiment with "
                              f"two or more stages; {exp.name!r} has stages {exp.stage_names}")
        self.opts, self.exp, self.connect, self.stop = opts, exp, connect, stop
        self.steps = exp.steps if opts.steps is None else opts.steps
        self.state = StageState(opts)
        self.log = self.state.log
        self.data = exp.build_data(opts.seed, client=opts.client)
        self.average_every = exp.clients.average_every if exp.clients.mode == "splitfed" else 0
        loss = build_loss(exp.stages[-1].loss)
        self.target_dtype = loss.target_dtype
        check_micro_batches(exp, opts.micro_batches, self.data.feature_shape)
        self.scale = loss.micro_batch_scale(opts.micro_batches)
        self.reply_specs = {"activation_grad": (micro_shape(self.state.stage.output_shape, opts.micro_batches),
                                                np.dtype(np.float32))}
        self.traffic = Traffic()
        self.metrics = MetricsWriter(opts.metrics_path)
        self.progress = Progress(opts.progress, self.steps)
        self.g_compute_s = 0.0
        params = self.state.stage.params
        self.link = DownstreamLink(opts, connect, stop, ctx, opts.security, self.reply_specs, self.traffic,
                                   {n: (v.shape, v.dtype) for n, v in params.items()} if self.average_every else None)
        self.loss: float | None = None
        self.evaluation: dict[str, Any] | None = None

    def handshake(self) -> None:
        """Hello/welcome; afterwards every stage stands at the newest step they all hold."""
        stage = self.state.stage
        held = self.state.held()
        common = self.link.handshake(self.exp, self.opts.seed, stage.output_shape, self.state.run_id,
                                     held, self.steps, self.opts.micro_batches, self.opts.client)
        if common in held:
            self.state.rollback(common)
        else:
            # Dropped by the serving stage of several clients: go on from here at its next step.
            self.log.warning("the serving stage goes on with this client at step %d; it has parameters of step "
                             "%d (steps %d to %d are skipped)", common + 1, self.state.stage.step,
                             self.state.stage.step + 1, common)
            self.state.stage.step = common
        self.state.stage.accumulator.reset()
        self.log.info("run %s: at step %d of %d", self.state.run_id, self.state.stage.step, self.steps)

    def step_once(self) -> None:
        """One step: every micro-batch's forward and backward, then one update.

        Up to ``window`` micro-batches are in flight (all of them for gpipe,
        two for 1f1b), so this stage computes micro-batch i+1 while the server
        works on i. Gradients are summed in micro-batch order whatever the
        schedule, which is the order the in-process path uses.
        """
        stage, count = self.state.stage, self.opts.micro_batches
        step = stage.step + 1
        features = self.data.features(step)
        targets = np.asarray(self.data.targets(step), self.target_dtype) if self.exp.labels_travel else None
        window = count if self.opts.schedule == "gpipe" else min(count, 2)
        pending: dict[tuple[int, int], Message] = {}
        caches: dict[int, Any] = {}
        losses: list[np.float32] = []
        self.link.arrived.clear()

        def send(i: int) -> None:
            y, caches[i] = stage.forward(micro_batch(features, i, count))
            tensors = {"activation": y}
            if targets is not None:
                tensors["target"] = micro_batch(targets, i, count)
            msg = Message(wire.FORWARD, self.state.run_id, step, i, count, tensors=tensors)
            pending[(step, i)] = msg
            self.link.send(msg)

        for i in range(window):
            send(i)
        for i in range(count):
            reply = self.link.await_reply(pending, (step, i))
            del pending[(step, i)]
            loss, dy = check_reply(reply, step, self.reply_specs, self.exp.allow_nonfinite,
                                   self.exp.stage_names[1])
            losses.append(loss)
            compute = reply.body.get("compute_s")
            if isinstance(compute, float):
                self.g_compute_s += compute
            _, grads = stage.backward(caches.pop(i), dy, need_dx=False)
            stage.accumulator.add(grads, i, count)
            if i + window < count:
                send(i + window)
        grads = stage.accumulator.take(self.scale)
        stage.check_grads(grads)
        trace = self.state.trace
        if trace is not None and trace.wants(step):
            grads_seen = {k: v.copy() for k, v in grads.items()}
        stage.apply(grads)
        self.loss = float(combine_losses(losses, self.scale))
        if self.average_every and step % self.average_every == 0:
            self._average(step)
        if trace is not None and trace.wants(step):
            trace.write(step, self.loss, grads_seen, stage.params)
        self.state.after_step()

    def _average(self, step: int) -> None:
        """SplitFed: send this client's parameters, take the mean of every client's in their place."""
        params = self.state.stage.params
        reply = self.link.exchange(Message(wire.AVERAGE, self.state.run_id, step, tensors=params))
        if reply.type != wire.AVERAGE:
            raise ProtocolError(ErrorCode.TYPE, f"expected an average reply to step {step}, got {reply.type!r}")
        wire.expect_tensors(reply, {name: (value.shape, value.dtype) for name, value in params.items()},
                            self.exp.allow_nonfinite)
        for name, value in params.items():
            value[...] = reply.tensors[name]

    def evaluate(self) -> None:
        """Held-out rows forward through both stages; the label owner scores them."""
        y, _ = self.state.stage.forward(self.data.test_features())
        tensors = {"activation": y}
        if self.exp.labels_travel:
            tensors["target"] = np.asarray(self.data.test_targets(), self.target_dtype)
        reply = self.link.exchange(Message(wire.EVALUATE, self.state.run_id, self.state.stage.step + 1,
                                           tensors=tensors))
        body = self.evaluation = check_evaluation(reply)
        fields = evaluation_fields(body)
        self.log.info("test loss %.6g%s", body["loss"],
                      f", test accuracy {fields['test_accuracy']:.4f}" if "test_accuracy" in fields else "")

    def _record(self, step: int, started: float, step_started: float, wait_before: float,
                g_before: float) -> None:
        now = time.perf_counter()
        wait = self.traffic.wait_s - wait_before
        self.metrics.write({
            "step": step, "loss": self.loss, "wall_s": now - started, "step_s": now - step_started,
            "bytes_sent": self.traffic.sent, "bytes_received": self.traffic.received,
            "f_compute_s": now - step_started - wait, "f_wait_s": wait, "g_compute_s": self.g_compute_s - g_before})

    def run(self) -> dict[str, Any]:
        state = self.state
        if not (self.opts.resume and state.resume_latest()):
            state.begin(uuid.uuid4().hex)
        else:
            state.open_trace(append=True)
        started = time.perf_counter()
        try:
            self._run()
        except (Interrupted, PeerTimeout):
            state.save()            # between steps the state is consistent: a restart continues here
            raise
        except PeerRejected as e:
            if e.code == ErrorCode.NONFINITE_STEP:
                # A stage below found a non-finite loss or gradient and applied nothing: a stage
                # failed (exit 1); this stage sent nothing wrong, so it is no refusal (exit 4).
                raise StageError(e.peer_message) from e
            raise
        finally:
            state.close()
            self.link.close()
            self.metrics.close()
            self.progress.close()
        return state.summary("completed", started, self.loss, endpoint=self.connect,
                             micro_batches=self.opts.micro_batches, schedule=self.opts.schedule,
                             **evaluation_fields(self.evaluation))

    def _run(self) -> None:
        self.handshake()
        every = max(1, self.steps // PROGRESS_UPDATES)
        started = last_report = time.perf_counter()
        last_step = self.state.stage.step
        while True:
            stage = self.state.stage
            step_started, wait_before, g_before = time.perf_counter(), self.traffic.wait_s, self.g_compute_s
            try:
                if stage.step >= self.steps:
                    self.state.save()
                    if len(self.data.test_rows):
                        self.evaluate()
                    self.link.exchange(Message(wire.BYE, self.state.run_id, stage.step + 1, body={"steps": stage.step}))
                    self.state.save(self.loss, finished=True)     # a rerun with --resume has nothing to do
                    return
                self.step_once()
            except PeerRejected as e:
                if e.code not in (ErrorCode.RUN, ErrorCode.STEP):
                    raise
                # The server restarted or lost our run: agree on a step again.
                self.log.warning("%s; shaking hands again", e.peer_message)
                self.handshake()
                continue
            step = self.state.stage.step
            if self.metrics.enabled:
                self._record(step, started, step_started, wait_before, g_before)
            self.progress.update(step, self.loss, force=step == self.steps)
            if self.opts.progress == "off" and (step % every == 0 or step == self.steps):
                now = time.perf_counter()
                rate = (step - last_step) / (now - last_report) if now > last_report else float("nan")
                last_report, last_step = now, step
                self.log.info("step %d/%d loss %.6g (%.0f steps/s)", step, self.steps, self.loss, rate)


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
