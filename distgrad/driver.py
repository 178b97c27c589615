"""The driving (first) stage: ``drive_first_stage`` owns the data and the step counter.

It connects, shakes hands, and for every step sends the activations of each
micro-batch and applies the gradients that come back, with retries on fresh
sockets and a rollback to a common step whenever the server has lost track.
"""


from __future__ import annotations

import time
import uuid
from typing import Any, Mapping

import numpy as np
import zmq

from . import wire
from .errors import ConfigError, Interrupted, PeerRejected, PeerTimeout, ProtocolError
from .inprocess import evaluation_fields
from .losses import build_loss
from .stage import check_micro_batches, combine_losses, micro_batch
from .progress import MetricsWriter, Progress
from .transport import POLL_TICK_S, Client, Traffic
from .wire import ErrorCode, Message

from .daemon import (PROGRESS_UPDATES, RETRY_BACKOFF_S, StageOptions, StageState, StopFlag, frame_limit,
                     micro_shape)


class _Driver:
    """The first stage's loop: handshake, steps, bye, with retries and rollbacks."""

    def __init__(self, opts: StageOptions, connect: str, stop: StopFlag, ctx: zmq.Context) -> None:
        exp = opts.experiment
        if exp.stage_index(opts.stage) != 0 or len(exp.stages) != 2:
            raise ConfigError(f"the driving stage is {exp.stage_names[0]!r} of a two-stage experiment; "
                              f"{exp.name!r} has stages {exp.stage_names}")
        self.opts, self.exp, self.connect, self.stop, self.ctx = opts, exp, connect, stop, ctx
        self.steps = exp.steps if opts.steps is None else opts.steps
        self.state = StageState(opts)
        self.log = self.state.log
        self.data = exp.build_data(opts.seed)
        loss = build_loss(exp.stages[-1].loss)
        self.target_dtype = loss.target_dtype
        check_micro_batches(exp, opts.micro_batches, self.data.feature_shape)
        self.scale = loss.micro_batch_scale(opts.micro_batches)
        self.reply_specs = {"activation_grad": (micro_shape(self.state.stage.output_shape, opts.micro_batches),
                                                np.dtype(np.float32))}
        self.max_frame, self.max_tensor = frame_limit(self.reply_specs)
        self.traffic = Traffic()
        self.metrics = MetricsWriter(opts.metrics_path)
        self.progress = Progress(opts.progress, self.steps)
        self.g_compute_s = 0.0
        self.client = self._new_client()
        self.arrived: dict[tuple[int, int], Message] = {}
        self.loss: float | None = None
        self.evaluation: dict[str, Any] | None = None

    def _new_client(self) -> Client:
        return Client(self.ctx, self.connect, self.max_frame, self.max_tensor, self.opts.liveness_s,
                      self.opts.security, self.traffic)

    def exchange(self, msg: Message) -> Message:
        """Send ``msg`` and return its reply, with the retries of ``_await``.

        A hello refused because the server is busy with another live run is
        retried too, until ``peer_deadline_s``.
        """
        deadline = time.monotonic() + self.opts.peer_deadline_s
        pause = RETRY_BACKOFF_S[0]
        while True:
            key = (msg.step, msg.mb)
            self.client.send(msg)
            try:
                return self._await({key: msg}, key)
            except PeerRejected as e:
                if e.code != ErrorCode.RUN or "busy" not in e.peer_message or time.monotonic() + pause > deadline:
                    raise
                self.log.warning("%s; retrying", e.peer_message)
            self._reconnect(pause)
            pause = min(pause * 2, RETRY_BACKOFF_S[1])

    def _await(self, pending: Mapping[tuple[int, int], Message], key: tuple[int, int]) -> Message:
        """The reply to ``pending[key]``; replies to other pending requests are kept for later.

        After each ``timeout_s`` without it, reconnect on a fresh socket and
        resend every pending request in order (the Lazy Pirate pattern), until
        ``peer_deadline_s``. Requests are idempotent on the server (a repeated
        forward gets its cached reply), so resending is always safe.
        """
        deadline = time.monotonic() + self.opts.peer_deadline_s
        pause = RETRY_BACKOFF_S[0]
        while True:
            reply = self.arrived.pop(key, None)
            if reply is not None:
                return reply
            try:
                reply = self.client.wait(self.state.run_id, pending.keys(), self.opts.timeout_s, self.stop.check,
                                         pending[key].describe)
            except PeerTimeout as e:
                if time.monotonic() + pause > deadline:
                    raise PeerTimeout(f"{e}; gave up after retrying for {self.opts.peer_deadline_s:g} s") from e
                self.log.warning("no reply from %s within %g s; reconnecting and retrying for up to %.0f s more",
                                 self.connect, self.opts.timeout_s, deadline - time.monotonic())
                self._reconnect(pause)
                pause = min(pause * 2, RETRY_BACKOFF_S[1])
                for request_key in sorted(pending):
                    self.client.send(pending[request_key])
                continue
            self.arrived[(reply.step, reply.mb)] = reply

    def _reconnect(self, pause: float) -> None:
        self.client.close(linger_ms=0)
        self._sleep(pause)
        self.client = self._new_client()

    def _sleep(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.stop.check()
            time.sleep(min(POLL_TICK_S, max(0.0, end - time.monotonic())))

    def handshake(self) -> None:
        """Hello/welcome; afterwards both stages stand at the newest step they both hold."""
        stage = self.state.stage
        hello = Message(wire.HELLO, self.state.run_id, 0, body={
            "role": self.opts.stage, "experiment": self.exp.name, "fingerprint": self.exp.fingerprint,
            "seed": self.opts.seed, "activation": {"shape": list(stage.output_shape), "dtype": "float32"},
            "labels_travel": self.exp.labels_travel, "steps": self.steps, "step": stage.step,
            "held": self.state.held(), "micro_batches": self.opts.micro_batches})
        welcome = self.exchange(hello)
        next_step = welcome.body.get("next_step")
        if (welcome.type != wire.WELCOME or not isinstance(next_step, int) or isinstance(next_step, bool)
                or next_step - 1 not in self.state.held()):
            raise ProtocolError(ErrorCode.RUN, f"expected a welcome at a step this stage holds {self.state.held()}, "
                                               f"got {welcome.describe()} {welcome.body}")
        self.state.rollback(next_step - 1)
        self.state.stage.accumulator.reset()
        self.log.info("run %s: connected to stage %s at %s; at step %d of %d", self.state.run_id,
                      welcome.body.get("stage"), self.connect, self.state.stage.step, self.steps)

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
        self.arrived.clear()

        def send(i: int) -> None:
            y, caches[i] = stage.forward(micro_batch(features, i, count))
            tensors = {"activation": y}
            if targets is not None:
                tensors["target"] = micro_batch(targets, i, count)
            msg = Message(wire.FORWARD, self.state.run_id, step, i, count, tensors=tensors)
            pending[(step, i)] = msg
            self.client.send(msg)

        for i in range(window):
            send(i)
        for i in range(count):
            reply = self._await(pending, (step, i))
            del pending[(step, i)]
            if reply.type != wire.BACKWARD:
                raise ProtocolError(ErrorCode.TYPE, f"expected a backward reply to step {step}, got {reply.type!r}")
            wire.expect_tensors(reply, self.reply_specs, self.exp.allow_nonfinite)
            loss = reply.body.get("loss")
            if not isinstance(loss, (int, float)) or isinstance(loss, bool):
                raise ProtocolError(ErrorCode.MALFORMED, f"backward reply to step {step} has loss {wire.show(loss)}")
            losses.append(np.float32(loss))
            compute = reply.body.get("compute_s")
            if isinstance(compute, float):
                self.g_compute_s += compute
            _, grads = stage.backward(caches.pop(i), reply.tensors["activation_grad"], need_dx=False)
            stage.accumulator.add(grads, i, count)
            if i + window < count:
                send(i + window)
        grads = stage.accumulator.take(self.scale)
        trace = self.state.trace
        if trace is not None and trace.enabled:
            grads_seen = {k: v.copy() for k, v in grads.items()}
        stage.apply(grads)
        self.loss = float(combine_losses(losses, self.scale))
        if trace is not None and trace.enabled:
            trace.write(step, self.loss, grads_seen, stage.params)
        self.state.after_step()

    def evaluate(self) -> None:
        """Held-out rows forward through both stages; the label owner scores them."""
        y, _ = self.state.stage.forward(self.data.test_features())
        tensors = {"activation": y}
        if self.exp.labels_travel:
            tensors["target"] = np.asarray(self.data.test_targets(), self.target_dtype)
        reply = self.exchange(Message(wire.EVALUATE, self.state.run_id, self.state.stage.step + 1, tensors=tensors))
        body = reply.body
        if reply.type != wire.EVALUATION or not isinstance(body.get("loss"), float) or not isinstance(body.get("count"), int):
            raise ProtocolError(ErrorCode.MALFORMED, f"expected an evaluation reply, got {reply.describe()}")
        self.evaluation = body
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
        finally:
            state.close()
            self.client.close()
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
                    self.exchange(Message(wire.BYE, self.state.run_id, stage.step + 1, body={"steps": stage.step}))
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
            if self.opts.progress != "bar" and (step % every == 0 or step == self.steps):
                now = time.perf_counter()
                rate = (step - last_step) / (now - last_report) if now > last_report else float("nan")
                last_report, last_step = now, step
                self.log.info("step %d/%d loss %.6g (%.0f steps/s)", step, self.steps, self.loss, rate)


def drive_first_stage(opts: StageOptions, connect: str, stop: StopFlag,
                      ctx: zmq.Context | None = None) -> dict[str, Any]:
    """Train ``opts.steps`` steps against the serving stage at ``connect``; return the summary.

    Retries an unanswered request on a fresh socket until ``opts.peer_deadline_s``
    and then raises ``PeerTimeout`` naming the endpoint; raises
    ``PeerRejected`` when the server refuses a message for good (e.g. another
    experiment), ``Interrupted`` on a signal, after saving a checkpoint.
    """
    return _Driver(opts, connect, stop, ctx or zmq.Context.instance()).run()
