"""A serving stage: ``serve_stage`` binds and answers the stage above it.

The last stage computes the loss itself; a middle stage passes every request
on to the stage below it (``link.DownstreamLink``) and its own backward on up.
A ``hello`` opens (or resumes) a run, each ``forward`` runs the forward,
backward and update exactly once and returns the gradient with respect to
the activations, ``evaluate`` scores held-out rows, ``bye`` closes the run
and writes the summary. A micro-batch's parameter gradients, and a step's
optimiser update, are computed after the reply carrying the activation
gradient has left (``StageServer.settle``), so the stage above computes its
own backward and update meanwhile; nothing reads this stage's state before
they have run. Invalid input never changes state: a message is
fully validated before the stage computes anything, and a refusal from
below is passed up before this stage updates anything.
"""


from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

from . import wire
from .errors import ConfigError, NonFiniteError, PeerRejected, PeerTimeout, ProtocolError, StageError
from .experiment import MAX_PARTS, PART_VALUE_MAX, Experiment, fingerprint_parts
from .inprocess import evaluation_fields
from .losses import build_loss
from .link import DownstreamLink, check_evaluation, check_reply
from .stage import Stage, combine_losses, micro_batch
from .transport import POLL_TICK_S, Server
from .wire import ErrorCode, Message

from .daemon import (StageOptions, StageState, StopFlag, common_step, finished_run, frame_limit,
                     lock_checkpoint_dir, micro_shape, nothing_to_do, same_exactly, target_spec, tensor_specs)


class StageServer:
    """Protocol logic of a serving stage, free of its own socket so tests can call it.

    A middle stage ``connect``s to the stage below (the last stage gives
    None); ``stop`` and ``ctx`` serve that connection. ``handle(msg, now)`` returns the reply and raises
    ``ProtocolError`` for a message that must be refused (a refusal from
    below comes up with its code); a refused message changes nothing. A
    stage below that stays silent past ``peer_deadline_s`` raises
    ``PeerTimeout``. The caller sends each reply and then calls ``settle``,
    which computes what ``handle`` deferred (``handle`` itself settles
    first, so a caller that never calls ``settle`` sees the same results).
    """

    def __init__(self, opts: StageOptions, connect: str | None = None, stop: StopFlag | None = None,
                 ctx: zmq.Context | None = None) -> None:
        self.opts, self.exp = opts, opts.experiment
        index, count = self.exp.stage_index(opts.stage), len(self.exp.stages)
        if index == 0:
            raise ConfigError(f"stage {opts.stage!r} is the first stage of {self.exp.name!r}: it drives "
                              f"(--connect), it does not serve")
        if (connect is None) != (index == count - 1):
            raise ConfigError(f"stage {opts.stage!r} is {'the last' if index == count - 1 else 'a middle'} stage of "
                              f"{self.exp.name!r} (stages {self.exp.stage_names}): "
                              + ("it serves (--bind) and connects to nothing" if index == count - 1
                                 else f"it serves (--bind) and connects (--connect) to {self.exp.stage_names[index + 1]!r}"))
        self.upstream = self.exp.stage_names[index - 1]
        self.state = StageState(opts)
        self.log = self.state.log
        self.data = self.exp.build_data(opts.seed)   # the last stage reads only the targets; a middle one nothing
        self.target = target_spec(self.exp, opts.seed)
        self.final_loss = build_loss(self.exp.stages[-1].loss)     # how micro-batch gradients combine
        self.link = None if connect is None else DownstreamLink(
            opts, connect, stop or StopFlag(), ctx or zmq.Context.instance(), opts.downstream_security,
            self._reply_specs(1))
        self.specs = tensor_specs(self.state.stage, self.target, 1)
        rows = len(self.data.test_rows)
        self.eval_specs = {name: ((rows, *shape[1:]), dtype) for name, (shape, dtype) in self.specs.items()}
        # The largest message this stage accepts: a whole batch, or the held-out rows to evaluate.
        self.max_frame_bytes, self.max_tensor_bytes = (max(a, b) for a, b in zip(
            frame_limit(self.specs), frame_limit(self.eval_specs)))
        self.mbs = 1                        # micro-batches per step, as the run's hello said
        self.active = False                 # a run is open (possibly resumed from a checkpoint)
        self.last_seen = -math.inf          # when the open run's client last spoke
        self.lost_since: float | None = None
        self.started = time.perf_counter()
        self.loss: float | None = None
        # Replies by (step, mb) for the step in progress and the last applied one: a repeated
        # forward gets its reply again and causes no second update.
        self.cached: dict[tuple[int, int], Message] = {}
        self.mb_losses: list[np.float32] = []
        self.sent_back: list[np.ndarray] = []      # the step's activation gradients, for the trace
        self.finished: dict[str, Any] | None = None       # summary of the last completed run
        self.bye_reply: Message | None = None
        self.closing = False                # a bye was answered; finish_run completes the run
        self.evaluation: dict[str, Any] | None = None
        self.deferred: Callable[[], None] | None = None   # gradients (and update) of a micro-batch already answered
        # A non-finite loss or gradient of this stage (or reported from below): the run ends once the
        # stage above has been told (``failure_told``); nothing of that step is applied.
        self.failure: NonFiniteError | None = None
        self.failure_told = False
        if opts.resume and self.state.resume_latest():
            self.active = True
            self.last_seen = time.monotonic()      # its client gets a full liveness window to come back
            self.state.open_trace(append=True)

    @property
    def stage(self) -> Stage:
        return self.state.stage

    def live(self, now: float) -> bool:
        return self.active and now - self.last_seen <= self.opts.liveness_s

    def handle(self, msg: Message, now: float, peer_key: str = "") -> Message:
        """The reply to ``msg`` from the peer authenticated as ``peer_key`` ("" in plaintext).

        With CURVE, a run belongs to the key that opened it: other keys may
        not drive, rewind or end it.
        """
        self.settle()
        if self.failure is not None and msg.type != wire.PING:
            self.failure_told = True
            raise ProtocolError(ErrorCode.NONFINITE_STEP, str(self.failure))
        if msg.type == wire.PING:
            return Message(wire.PONG, msg.run, msg.step, body={
                "stage": self.opts.stage, "experiment": self.exp.name, "run": self.state.run_id if self.active else "",
                "step": self.stage.step, "client_live": self.live(now)})
        if msg.type == wire.BYE and self.finished is not None and msg.run == self.finished["run_id"]:
            return self.bye_reply                 # a repeated bye for the run that just completed
        if msg.type == wire.HELLO:
            return self._hello(msg, now, peer_key)
        if not self.active or msg.run != self.state.run_id:
            expected = f"run {self.state.run_id}" if self.active else "a hello first"
            raise ProtocolError(ErrorCode.RUN, f"{msg.type} for run {msg.run!r}, expected {expected}")
        self._check_owner(peer_key)
        if msg.type == wire.FORWARD:
            reply = self._forward(msg)
        elif msg.type == wire.EVALUATE:
            reply = self._evaluate(msg)
        elif msg.type == wire.BYE:
            reply = self._bye(msg)
        else:
            raise ProtocolError(ErrorCode.TYPE, f"a serving stage does not accept {msg.type!r} messages")
        self._seen(now)
        return reply

    def _check_owner(self, peer_key: str) -> None:
        if self.state.owner and peer_key != self.state.owner:
            raise ProtocolError(ErrorCode.RUN, "this run belongs to another client key")

    def _seen(self, now: float) -> None:
        if self.lost_since is not None:
            self.log.info("client of run %s is back", self.state.run_id)
        self.last_seen, self.lost_since = now, None

    def _hello(self, msg: Message, now: float, peer_key: str) -> Message:
        body = msg.body
        mbs = check_hello(body, self.upstream, self.exp, self.opts.seed, self.stage.input_shape, self.opts.stage)
        if self.active and msg.run == self.state.run_id:
            self._check_owner(peer_key)
            common = self._agree(msg, self.state.held(), body.get("held"), mbs)
            before = self.stage.step
            self.state.rollback(common)
            self.cached = {} if common != before else {k: v for k, v in self.cached.items() if k[0] <= common}
        elif self.live(now):
            raise ProtocolError(ErrorCode.RUN, f"busy with run {self.state.run_id} (its client is live); "
                                               f"cannot start run {msg.run!r}")
        else:
            self._agree(msg, [0], body.get("held"), mbs)
            if self.active:
                self.log.warning("run %s replaces run %s, whose client is gone", msg.run, self.state.run_id)
            self.state.begin(msg.run, owner=peer_key)
            self.active, self.finished, self.cached, self.loss, self.evaluation = True, None, {}, None, None
            self.started = time.perf_counter()
            self.log.info("run %s started by %s", msg.run, body.get("role"))
        self.mbs = mbs
        self.specs = tensor_specs(self.stage, self.target, mbs)
        self.stage.accumulator.reset()          # a step in progress starts again from its first micro-batch
        self.mb_losses, self.sent_back = [], []
        self._seen(now)
        return Message(wire.WELCOME, msg.run, msg.step,
                       body={"stage": self.opts.stage, "next_step": self.stage.step + 1})

    def _agree(self, msg: Message, ours: list[int], theirs: Any, mbs: int) -> int:
        """The step this stage and every stage above and below it hold (``ours``: this stage's).

        A middle stage asks the stage below with the steps both sides above
        hold; nothing changes here until it has agreed.
        """
        common = common_step(ours, theirs)           # also validates ``theirs``
        if self.link is None:
            return common
        both = sorted(set(ours) & set(theirs)) or [0]
        steps = msg.body.get("steps")
        self.link.set_reply_specs(self._reply_specs(mbs))
        try:
            return self.link.handshake(self.exp, self.opts.seed, self.stage.output_shape, msg.run, both,
                                       steps if isinstance(steps, int) and not isinstance(steps, bool) else 0, mbs)
        except PeerRejected as e:
            raise self._refused_below(e, msg) from e

    def _reply_specs(self, mbs: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        return {"activation_grad": (micro_shape(self.stage.output_shape, mbs), np.dtype(np.float32))}

    def _refused_below(self, e: PeerRejected, msg: Message) -> ProtocolError:
        """A refusal from the stage below, passed up with its code (so the driver can shake hands again)."""
        below = self.exp.stage_names[self.exp.stage_index(self.opts.stage) + 1]
        return ProtocolError(e.code, f"stage {below} refused {msg.type} step {msg.step}: {e.peer_message}")

    def _through(self, msg: Message, x: np.ndarray
                 ) -> tuple[np.float32, np.ndarray, Callable[[], dict[str, np.ndarray]]]:
        """A middle stage's micro-batch: forward, the stage below's reply, the backward's activation
        gradient, and a function computing its parameter gradients (no update)."""
        assert self.link is not None
        y, cache = self.stage.forward(x)
        tensors = {"activation": y}
        if "target" in msg.tensors:
            tensors["target"] = msg.tensors["target"]
        down = Message(wire.FORWARD, msg.run, msg.step, msg.mb, msg.mbs, tensors=tensors)
        key = (msg.step, msg.mb)
        self.link.send(down)
        try:
            reply = self.link.await_reply({key: down}, key)
        except PeerRejected as e:
            if e.code == ErrorCode.NONFINITE_STEP:
                raise NonFiniteError(e.peer_message) from e
            raise self._refused_below(e, msg) from e
        below = self.exp.stage_names[self.exp.stage_index(self.opts.stage) + 1]
        loss, dy = check_reply(reply, msg.step, self.link.reply_specs, self.exp.allow_nonfinite, below)
        dx, grads_later = self.stage.backward_deferred(cache, dy)
        return loss, dx, grads_later

    def _forward(self, msg: Message) -> Message:
        stage = self.stage
        key = (msg.step, msg.mb)
        cached = self.cached.get(key)
        if cached is not None:
            return cached                      # a repeated request: same reply, no second update
        done = stage.accumulator.count
        if msg.step != stage.step + 1 or msg.mbs != self.mbs or msg.mb != done:
            raise ProtocolError(ErrorCode.STEP, f"forward for step {msg.step} micro-batch {msg.mb}/{msg.mbs}; "
                                                f"expected step {stage.step + 1} micro-batch {done}/{self.mbs}")
        wire.expect_tensors(msg, self.specs, self.exp.allow_nonfinite)
        x = msg.tensors["activation"]
        started = time.perf_counter()
        try:
            if self.link is None:
                target = msg.tensors.get("target")
                if target is None:
                    target = micro_batch(self.data.targets(msg.step), msg.mb, msg.mbs)
                mb_loss, dx, grads_later = stage.loss_micro_batch_deferred(x, target)
                stage.check_finite("loss", mb_loss)
            else:
                mb_loss, dx, grads_later = self._through(msg, x)
            stage.check_finite("activation_grad", dx)
        except NonFiniteError as e:
            self._fail(e)
            self.failure_told = True
            raise ProtocolError(ErrorCode.NONFINITE_STEP, str(e)) from e
        except StageError as e:
            raise ProtocolError(ErrorCode.STAGE, str(e)) from e
        if msg.mb == 0:
            self.cached = {}                   # the previous step is complete on both sides
        self.mb_losses.append(mb_loss)
        trace = self.state.trace
        tracing = trace is not None and trace.wants(msg.step)
        if tracing and self.link is None:       # the merged trace has the last stage's activation gradient
            self.sent_back.append(dx)
        body = {"loss": float(mb_loss)}
        reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body=body,
                        tensors={"activation_grad": dx})
        self.cached[key] = reply
        body["compute_s"] = time.perf_counter() - started     # for the driver's metrics: this stage and those below
        self.deferred = lambda: self._accumulate(msg.step, msg.mb, msg.mbs, grads_later, dx)
        return reply

    def _accumulate(self, step: int, mb: int, mbs: int, grads_later: Callable[[], dict[str, np.ndarray]],
                    dx: np.ndarray) -> None:
        """A micro-batch's parameter gradients, added in micro-batch order; after the last, the update."""
        self.stage.accumulator.add(grads_later(), mb, mbs)
        if mb == mbs - 1:
            self._update(step, mbs, dx)

    def _update(self, step: int, mbs: int, last_dx: np.ndarray) -> None:
        """The optimiser update of ``step`` from its accumulated micro-batch gradients; trace; checkpoint."""
        stage, trace = self.stage, self.state.trace
        tracing = trace is not None and trace.wants(step)
        scale = self.final_loss.micro_batch_scale(mbs)
        applied = stage.accumulator.take(scale)
        stage.check_grads(applied)
        if tracing:
            traced = {k: v.copy() for k, v in applied.items()}
        stage.apply(applied)
        loss = combine_losses(self.mb_losses, scale)
        self.loss, self.mb_losses = float(loss), []
        if tracing:
            if self.link is None:
                traced["activation_grad"] = np.concatenate(self.sent_back) if mbs > 1 else last_dx
            trace.write(step, loss, traced, stage.params)
            self.sent_back = []
        self.state.after_step()

    def settle(self) -> None:
        """Run what ``handle`` deferred until its reply had been sent (gradients, update), if anything."""
        update, self.deferred = self.deferred, None
        if update is not None:
            try:
                update()
            except NonFiniteError as e:
                self._fail(e)       # told to the stage above in reply to its next message

    def _fail(self, e: NonFiniteError) -> None:
        """Note a non-finite loss or gradient: the step in progress is dropped, nothing applied."""
        self.log.error("%s", e)
        self.failure = e
        self.stage.accumulator.reset()
        self.mb_losses, self.sent_back, self.deferred = [], [], None

    def end_failed_run(self) -> NonFiniteError | None:
        """Once the stage above has been told of a failure: close the run ("failed", no checkpoint
        written) and return the failure; None while there is none to end."""
        failure = self.failure
        if failure is None or not self.failure_told:
            return None
        self.failure, self.failure_told = None, False
        if self.active:
            self.close_run("failed")
        return failure

    def _evaluate(self, msg: Message) -> Message:
        """Forward only on the held-out rows; changes no state."""
        if not len(self.data.test_rows):
            raise ProtocolError(ErrorCode.TYPE, f"experiment {self.exp.name!r} holds out no rows to evaluate")
        wire.expect_tensors(msg, self.eval_specs, self.exp.allow_nonfinite)
        target = msg.tensors.get("target")
        try:
            if self.link is None:
                result = self.stage.evaluate_last(msg.tensors["activation"],
                                                  self.data.test_targets() if target is None else target)
            else:
                y, _ = self.stage.forward(msg.tensors["activation"])
                tensors = {"activation": y, **({"target": target} if target is not None else {})}
                try:
                    result = check_evaluation(self.link.exchange(
                        Message(wire.EVALUATE, msg.run, msg.step, tensors=tensors)))
                except PeerRejected as e:
                    raise self._refused_below(e, msg) from e
        except StageError as e:
            raise ProtocolError(ErrorCode.STAGE, str(e)) from e
        self.evaluation = result
        return Message(wire.EVALUATION, msg.run, msg.step, body=result)

    def _bye(self, msg: Message) -> Message:
        steps = msg.body.get("steps")
        if not same_exactly(steps, self.stage.step):
            raise ProtocolError(ErrorCode.STEP, f"bye after {wire.show(steps)} steps, but this stage has applied {self.stage.step}")
        if self.link is not None:
            try:
                self.link.exchange(Message(wire.BYE, msg.run, msg.step, body={"steps": self.stage.step}))
            except PeerRejected as e:
                raise self._refused_below(e, msg) from e
        # The checkpoint and the summary (slow for a big model) are written by
        # ``finish_run`` after this reply has left, so the driver never waits for them.
        self.closing = True
        self.bye_reply = Message(wire.BYE, msg.run, msg.step, body={"steps": self.stage.step})
        return self.bye_reply

    def finish_run(self) -> None:
        """Complete the run a ``bye`` closed: final checkpoint and summary."""
        self.settle()
        if self.closing:
            self.closing = False
            self.state.save(self.loss, finished=True)      # a rerun with --resume has nothing to do
            self.finished = self.close_run("completed")

    def check_liveness(self, now: float) -> float | None:
        """Note a lost client; return for how long it has been lost (None while it is live)."""
        if not self.active or self.live(now):
            return None
        if self.lost_since is None:
            self.lost_since = now
            self.log.warning("client of run %s silent for more than %g s; keeping its state at step %d and "
                             "waiting for it (or a new run)", self.state.run_id, self.opts.liveness_s, self.stage.step)
        return now - self.lost_since

    def close_run(self, status: str) -> dict[str, Any]:
        self.settle()
        summary = self.state.summary(status, self.started, self.loss, **evaluation_fields(self.evaluation))
        self.state.close()
        self.active, self.cached = False, {}
        return summary


def announce(server: Server, opts: StageOptions, ready_file: Path | None,
             on_ready: Callable[[str], None] | None) -> None:
    """Log the bound endpoint, write it to ``ready_file`` (atomically) and pass it to ``on_ready``."""
    server_log = logging.getLogger(f"distgrad.{opts.stage}")
    server_log.info("stage %s of %s serving on %s (%s)", opts.stage, opts.experiment.name, server.endpoint,
                    "CURVE: the link is encrypted, and only allowed client keys are accepted" if server.authenticated
                    else "plaintext: not encrypted, any client accepted")
    if ready_file is not None:
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(server.endpoint)
        tmp.replace(ready_file)
    if on_ready is not None:
        on_ready(server.endpoint)


def decode_and_handle(frames: list[Any], max_tensor_bytes: int, handle: Callable[[Message], Any],
                      log: logging.Logger) -> tuple[Message | None, Any, bool]:
    """``(msg, handle(msg), False)`` for a request, or ``(msg or None, error reply, True)`` when
    it cannot be decoded or ``handle`` refuses it (raises ``ProtocolError``); refusals are logged."""
    msg: Message | None = None
    try:
        msg = wire.decode(frames, max_tensor_bytes)
        return msg, handle(msg), False
    except ProtocolError as e:
        if e.code != ErrorCode.NONFINITE_STEP:        # that one is this stage's failure, logged as an error
            log.warning("refused %s: %.*s", msg.describe() if msg else "an undecodable message",
                        wire.ERROR_TEXT_MAX, e)
        return msg, refusal(msg, e), True


def refusal(msg: Message | None, error: ProtocolError) -> Message:
    """The error reply to a refused message, echoing its ids when it could be decoded."""
    if msg is None:
        return wire.error_message("", 0, error.code, str(error.args[0]))
    return wire.error_message(msg.run, msg.step, error.code, str(error.args[0]), msg.mb, msg.mbs)


def serve(opts: StageOptions, bind: str, stop: StopFlag, connect: str | None = None, keep_serving: bool = False,
          ready_file: Path | None = None, ctx: zmq.Context | None = None,
          on_ready: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Serve runs on ``bind`` until one completes (or, with ``keep_serving``, until stopped).

    The last stage gives no ``connect``; a middle stage connects to the stage
    below it there (with ``opts.downstream_security``). Writes the bound
    endpoint to ``ready_file`` once listening (for launchers) and passes it to
    ``on_ready`` (for callers in this process). Returns the last run's
    summary. Raises ``PeerTimeout`` when a run's client stays lost for
    ``opts.peer_deadline_s`` (unless ``keep_serving``) or the stage below
    stays silent that long, and ``Interrupted`` on a signal, after saving a
    checkpoint. With ``--checkpoint-dir``, holds the stage's lock there while
    serving (``ConfigError`` if another process holds it); with ``--resume``
    and a finished run there, returns that run's summary at once without
    binding (with ``keep_serving``, serves new runs instead).
    """
    ctx = ctx or zmq.Context.instance()
    if opts.experiment.federated:
        from .federation import serve_clients
        return serve_clients(opts, bind, stop, keep_serving, ready_file, ctx, on_ready)
    lock = lock_checkpoint_dir(opts)
    try:
        done = finished_run(opts)
        if done is not None and not keep_serving:
            return nothing_to_do(opts, done)
        return _serve(opts, bind, stop, connect, keep_serving, ready_file, ctx, on_ready)
    finally:
        if lock is not None:
            lock.release()


def _serve(opts: StageOptions, bind: str, stop: StopFlag, connect: str | None, keep_serving: bool,
           ready_file: Path | None, ctx: zmq.Context, on_ready: Callable[[str], None] | None) -> dict[str, Any] | None:
    logic = StageServer(opts, connect, stop, ctx)
    log = logic.log
    server = Server(ctx, bind, logic.max_frame_bytes, opts.liveness_s, opts.security, opts.spin_s)
    try:
        announce(server, opts, ready_file, on_ready)
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            lost_for = logic.check_liveness(now)
            if lost_for is not None and lost_for > opts.peer_deadline_s and not keep_serving:
                raise PeerTimeout(f"client of run {logic.state.run_id} lost for more than "
                                  f"{opts.liveness_s + opts.peer_deadline_s:g} s at step {logic.stage.step}; giving up")
            if request is None:
                continue
            envelope, frames, peer_key = request
            msg, reply, refused = decode_and_handle(frames, logic.max_tensor_bytes,
                                                    lambda m: logic.handle(m, now, peer_key), log)
            server.reply(envelope, reply)
            logic.settle()
            failure = logic.end_failed_run()
            if failure is not None:
                if not keep_serving:
                    raise failure
                log.error("run %s failed; waiting for the next run", msg.run if msg else "?")
                continue
            if refused:
                continue
            logic.finish_run()
            if msg.type == wire.BYE and logic.finished is not None:
                log.info("run %s completed: %d steps, final loss %s", msg.run, logic.finished["steps"],
                         logic.finished["final_loss"])
                if not keep_serving:
                    return logic.finished
    finally:
        try:
            logic.settle()
            if logic.active and logic.failure is None:
                logic.state.save()          # skipped once a save has failed: that error is the one reported
                logic.close_run("interrupted")
            elif logic.active:
                logic.close_run("failed")   # no checkpoint: the last one saved stays the newest
        finally:
            server.close()
            if logic.link is not None:
                logic.link.close(linger_ms=0)


