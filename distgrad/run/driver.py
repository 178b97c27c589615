"""The driving (first) stage: ``drive_first_stage`` owns the data and the step counter.

It connects to the next stage (the last one, or a middle stage that passes
everything on), shakes hands, and for every step sends the activations of
each micro-batch and applies the gradients that come back, with retries on
fresh sockets (``link.DownstreamLink``) and a rollback to a common step
whenever a stage below has lost track. After every ``eval_every``-th step and
the last it evaluates the held-out rows through every stage; each step's
record (and its evaluation) goes to the metrics file and the progress line.
What needs no reply is done while one is awaited rather than between a reply
and the next forward (``_while_waiting``): the records of the steps applied,
and the next step's batch.
"""


from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, Iterator

import numpy as np
import zmq

from distgrad.config.experiment import MAX_STALENESS, client_stage_name
from distgrad.run import handshake
from distgrad.run.autostaleness import PINGS, LinkProbe, time_compute

from distgrad.wire import messages as wire
from distgrad.errors import (ConfigError, Interrupted, PeerRejected, PeerTimeout, ProtocolError, StageError,
                             peer_text)
from distgrad.wire.link import DownstreamLink, check_evaluation, check_reply, final_body, is_final
from distgrad.run.metering import Guarding, Metering, by_owner, step_rows
from distgrad.privacy.meter import INPUTS
from distgrad.run.options import PROGRESS_UPDATES, StageOptions, StopFlag
from distgrad.run.progress import Progress, step_writers
from distgrad.run.protocol import evaluation_due, forward_message, shake_hands_again
from distgrad.stage.records import (best_evaluation_fields, evaluation_entry, evaluation_fields, loss_text,
                                    scores_text)
from distgrad.stage.stage import ROWS_DTYPE, as_of, backward_specs, held_out_part, kept_model, micro_batch
from distgrad.run.stage_state import StageState, finished_run, lock_checkpoint_dir, nothing_to_do
from distgrad.threads import one_compute_thread
from distgrad.wire.transport import NOTICE_LINGER_MS, Traffic
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.masking import SecureSumCodec
from distgrad.wire.wirecodec import ACTIVATION, EVALUATION, GRADIENT, TEST, stream_name

BACKWARD_TYPES = frozenset({wire.BACKWARD})        # a forward's reply (with steps in flight, an evaluation's
EVALUATION_TYPES = frozenset({wire.EVALUATION})    # may share its step and micro-batch)
PING_TIMEOUT_S = 1.0      # how long to wait for the stage below to say whom it waits for, after giving up on it
MASK_RUNS_POLL_S = 0.05   # between pings asking the label owner for every feature party's run (secure aggregation)


class _Driver:
    """The first stage's loop: handshake, steps, bye, with retries and rollbacks."""

    last_report: float          # when the log last reported the rate (``_run`` starts it, ``_report`` moves it)
    last_step: int              # the step it reported then

    def __init__(self, opts: StageOptions, connect: str, stop: StopFlag, ctx: zmq.Context) -> None:
        exp = opts.experiment
        exp.check_role(opts.stage, binds=False, connects=True)
        self.opts, self.exp, self.connect, self.stop = opts, exp, connect, stop
        self.steps = opts.total_steps
        self.state = StageState(opts)
        self.log = self.state.log
        self.data = exp.build_data(opts.seed, client=opts.client, stage=opts.stage)
        self.average_every = exp.clients.average_every if exp.clients.mode == "splitfed" else 0
        self.target_dtype = self.data.target_dtype
        self.reply_specs = backward_specs(self.state.stage, opts.micro_batches, exp.codecs[GRADIENT])
        self.below = exp.downstream(opts.stage)         # the stage replying, named in errors about its replies
        self.traffic = Traffic()
        self.writers = step_writers(opts.metrics_path, opts.tensorboard_dir)   # metrics file, TensorBoard
        self.progress = Progress(opts.progress, self.steps)
        self.eval_every = opts.evaluate_every
        self.holds_out = len(self.data.test_rows) > 0
        # With a validation split: the evaluations during the run forward the validation rows only; the test rows
        # cross once, after the last step, with the kept model (``evaluate(final=True)``).
        self.validation = self.data.validation_count
        # The privacy meter reads what this stage sends; its latest window's figures join the step's record.
        self.leaks: dict[str, float] = {}
        self.metering = (Metering(opts.meter_kind, self.state.engine, self.data.features,
                                  self.eval_every if self.holds_out else 0, self.steps, self._leaked, self.log,
                                  step_rows(self.data))
                         if opts.meter_kind else None)
        max_r2 = exp.spec(opts.stage).input_guard if exp.has_stage(opts.stage) else None
        self.guarding = (Guarding(self.state.engine, self.data.features, max_r2,
                                  client_stage_name(opts.stage, opts.client), self.log,
                                  step_rows(self.data))
                         if max_r2 is not None else None)
        for name, kept in (("meter", self.metering), ("guard", self.guarding)):
            if kept is not None:
                self.state.keep(name, kept)       # checkpointed with the stage: they outlive a restart
        self.g_compute_s = 0.0
        params = self.state.stage.params
        self.link = DownstreamLink(opts.link, connect, stop.check, ctx, opts.security, self.reply_specs,
                                   self.traffic,
                                   {n: (v.shape, v.dtype) for n, v in params.items()} if self.average_every else None)
        self.staleness = opts.steps_in_flight
        # --staleness auto: step 1 runs in lockstep and measures the link (``probe``), then S is chosen. The
        # history keeps the initial parameters meanwhile, which the forwards of steps 2..S+1 use.
        self.probe: LinkProbe | None = None
        if opts.auto_staleness:
            self.state.history.depth = MAX_STALENESS
        # Steps sent but not yet applied (staleness): step -> (parameter version of its forward, caches by
        # micro-batch), and its requests still unanswered.
        self.in_flight: dict[int, tuple[int, dict[int, Any]]] = {}
        self.pending: dict[int, dict[tuple[int, int], Message]] = {}
        self.loss: float | None = None
        # The label owner's replies carry no training loss (it withholds it, ``wire.LOSS_WITHHELD``): the
        # records then hold null, and the log, the bar and the summary say why.
        self.loss_withheld = False
        self.evaluation: dict[str, Any] | None = None          # the latest evaluation's reply
        self.evaluations: list[dict[str, Any]] = []            # every one: ``records.evaluation_entry``
        # Checkpointed with the stage, so that a resumed run neither evaluates (and releases) a step again
        # nor loses the entries before the kill.
        self.state.extra_meta = lambda: {"evaluations": self.evaluations, **self._staleness_meta(),
                                         **self._loss_fields()}
        # Fixed for the run: the micro-batches kept in flight, each one's error-feedback stream.
        self.window = opts.window
        self.streams = [stream_name(ACTIVATION, i, opts.micro_batches) for i in range(opts.micro_batches)]
        # Work done while a reply is awaited (``_while_waiting``): the next step's batch, fetched ahead
        # (step, batch), and the applied steps not yet reported (``_after_step`` queues them for ``_report``).
        self.next_batch: tuple[int, tuple[np.ndarray, np.ndarray | None, np.ndarray | None]] | None = None
        self.unreported: list[tuple[int, float | None, float, dict[str, Any] | None, dict[str, Any]]] = []
        # Decisions fixed for the run, taken once rather than asked of the experiment and stage every step
        # (the lockstep step's path is short: ``step_once``). Whether the rate follows the evaluations
        # depends on the stage file's schedule, which a rollback's rebuilt stage keeps.
        self.labels_travel, self.send_rows, self.vertical = exp.labels_travel, exp.send_rows, exp.vertical
        self.plateau = self.state.stage.plateau
        self.may_owe = self.holds_out and (self.plateau or self.vertical)     # ``_owes_evaluation`` can be True
        self.micro_batches, self.auto_staleness = opts.micro_batches, opts.auto_staleness

    def handshake(self) -> None:
        """Hello/welcome; afterwards every stage stands at the newest step they all hold."""
        stage = self.state.stage
        held = self.state.held()
        hello = handshake.hello(
            self.exp, self.opts.stage, self.opts.seed, stage.output_shape, self.state.run_id, held, self.steps,
            self.opts.micro_batches, self.opts.client, self.eval_every if self.holds_out else 0,
            staleness=self.staleness)
        masked = self.state.senders.codec(ACTIVATION)
        if isinstance(masked, SecureSumCodec) and masked.masks is not None:
            hello.body["mask_tags"] = masked.masks.tags()   # the label owner checks that every pair agrees
        common = self.link.handshake(hello, self.opts.client)
        if isinstance(masked, SecureSumCodec) and masked.masks is not None:
            self._bind_masks(masked)
        self.in_flight, self.pending = {}, {}      # steps in flight are sent again from the common step
        if common in held:
            self.state.rollback(common)
            self.state.history.rewind(self.state.stage)     # as before the first of them
        else:
            # Dropped by the serving stage of several clients: go on from here at its next step.
            self.log.warning("the serving stage goes on with this client at step %d; it has parameters of step "
                             "%d (steps %d to %d are skipped)", common + 1, self.state.stage.step,
                             self.state.stage.step + 1, common)
            self.state.stage.step = common
        self.state.engine.reset()
        # Evaluations of steps rolled back are taken again when those steps are. A feature party evaluates
        # a due step again after every handshake at it (``_owes_evaluation``): the label owner, resumed or
        # rolled back to that step, waits for every party's held-out embeddings of it.
        step = self.state.stage.step
        again = self.exp.vertical and 0 < step < self.steps and self._evaluation_due(step)
        self.evaluations = [e for e in self.evaluations if e["step"] < step or (e["step"] == step and not again)]
        self.state.verdicts.forget_after(step)
        self.log.info("run %s: at step %d of %d", self.state.run_id, self.state.stage.step, self.steps)

    def _bind_masks(self, masked: SecureSumCodec) -> None:
        """Secure aggregation: bind this party's masks to the run (``PairMasks.for_run``), every party's run
        id as the label owner names them (``mask_runs``, this party's own at its place), from the welcome or,
        until every party has said hello, from pongs asked every ``MASK_RUNS_POLL_S``. Raises ``PeerTimeout``
        after ``peer_deadline_s`` without them, ``ProtocolError`` for run ids that are not this run's."""
        runs, started = self.link.welcome.get("mask_runs"), time.monotonic()
        while runs is None:
            if time.monotonic() - started > self.opts.peer_deadline_s:
                raise PeerTimeout(f"stage {self.below} did not name every feature party's run within "
                                  f"{self.opts.peer_deadline_s:g} s (--peer-deadline): the masks of secure "
                                  f"aggregation need every party's hello first")
            self.stop.check()
            time.sleep(MASK_RUNS_POLL_S)
            runs = self.link.ping(self.state.run_id, self.opts.timeout_s).body.get("mask_runs")
        self.state.senders.use(ACTIVATION, masked.for_run(runs, self.state.run_id))
        self.log.info("run %s: masks bound to the feature parties' runs %s", self.state.run_id, runs)

    def step_once(self) -> None:
        """One step: every micro-batch's forward and backward, then one update.

        Up to ``opts.window`` micro-batches are in flight (all of them for
        gpipe, ``--in-flight`` for 1f1b, two by default), so this stage computes
        micro-batch i+1 while the server works on i, and holds at most that
        many forward caches. Gradients are summed in micro-batch order whatever
        the schedule and window, which is the order the in-process path uses.
        Once the first forwards are sent it does what needs no reply
        (``_while_waiting``). With staleness S > 0, ``_step_in_flight`` instead.
        """
        if self.auto_staleness and self.probe is None:
            self._probe_step()
            return
        if self.staleness:
            self._step_in_flight()
            return
        stage, engine, count = self.state.stage, self.state.engine, self.micro_batches
        step = stage.step + 1
        if count == 1 and not (self.average_every and step % self.average_every == 0):
            self._lockstep_step(step)
            return
        batch = self._batch(step)
        window = self.window
        pending: dict[tuple[int, int], Message] = {}
        caches: dict[int, Any] = {}
        self.link.arrived.clear()
        for i in range(window):
            self._send(step, i, batch, pending, caches)
        self._while_waiting(step)

        def micro_batches() -> Iterator[tuple[dict[str, np.ndarray], np.float32 | None]]:
            for i in range(count):          # each reply's backward, then the forward the window lets out
                loss, dy = self._reply(pending, step, i)
                _, grads = stage.backward(caches.pop(i), dy, need_dx=False)
                yield grads, loss
                if i + window < count:
                    self._send(step, i + window, batch, pending, caches)

        averaging = self.average_every and step % self.average_every == 0
        self.loss = engine.apply_step(step, count, micro_batches(),
                                      between=(lambda: self._average(step)) if averaging else None)

    def _lockstep_step(self, step: int) -> None:
        """``step_once`` of a step of one micro-batch, in lockstep (no steps in flight, no average after it):
        the same messages, checks and update in the same order, without the machinery of a window of
        micro-batches (the common case, so the one whose per-step cost counts most)."""
        engine = self.state.engine
        msg, cache = self._forward(step, 0, self._batch(step))
        pending = {(step, 0): msg}
        self.link.arrived.clear()
        self.link.send(msg)
        self._while_waiting(step)
        loss, dy = self._reply(pending, step, 0)
        _, grads = engine.stage.backward(cache, dy, need_dx=False)
        engine.add(0, 1, grads, loss)
        self.loss = engine.update(step, 1)

    def _send(self, step: int, i: int, batch: tuple[np.ndarray, np.ndarray | None, np.ndarray | None],
              pending: dict[tuple[int, int], Message], caches: dict[int, Any]) -> None:
        """Send the forward of micro-batch ``i`` of step ``step``; keep the request in ``pending`` and the
        forward's cache in ``caches``."""
        msg, caches[i] = self._forward(step, i, batch)
        pending[(step, i)] = msg
        self.link.send(msg)

    def _while_waiting(self, last_sent: int) -> None:
        """What needs no reply, done once the forwards up to step ``last_sent`` are sent and before their
        replies are awaited, instead of between a reply and the next forward: the reports of the steps
        applied so far (``_report``), and the batch of step ``last_sent + 1`` (a function of the step alone,
        not of the parameters), which ``_batch`` then returns."""
        if self.unreported:
            self._report()
        if last_sent < self.steps and (self.next_batch is None or self.next_batch[0] != last_sent + 1):
            self.next_batch = (last_sent + 1, self._fetch_batch(last_sent + 1))

    def _batch(self, step: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Step ``step``'s batch (``_fetch_batch``), fetched while waiting for earlier replies when it was."""
        ahead, self.next_batch = self.next_batch, None
        return ahead[1] if ahead is not None and ahead[0] == step else self._fetch_batch(step)

    def _fetch_batch(self, step: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Step ``step``'s features, its targets when they travel, and its row numbers with ``send_rows``."""
        targets = np.asarray(self.data.targets(step), self.target_dtype) if self.labels_travel else None
        # send_rows is refused for data without numbered rows (``check_send_rows``); ``step_rows`` is theirs
        # (``RowBatches``, forwarded by ``ColumnView``'s __getattr__), not ``DataSource``'s.
        rows = (np.asarray(self.data.step_rows(step), ROWS_DTYPE)  # type: ignore[attr-defined]
                if self.send_rows else None)
        return self.data.features(step), targets, rows

    def _forward(self, step: int, i: int, batch: tuple[np.ndarray, np.ndarray | None, np.ndarray | None]
                 ) -> tuple[Message, Any]:
        """Micro-batch ``i`` of step ``step`` forward through this stage: the message and the cache."""
        features, targets, rows = batch
        count = self.micro_batches
        y, cache = self.state.engine.stage.forward(micro_batch(features, i, count), i)
        # This stage computes on with ``y`` itself; only what crosses is coded.
        return forward_message(self.state.engine.senders, self.state.run_id, step, i, count, y, self.streams[i],
                               target=None if targets is None else micro_batch(targets, i, count),
                               rows=None if rows is None else micro_batch(rows, i, count)), cache

    def _reply(self, pending: dict[tuple[int, int], Message], step: int,
               i: int) -> tuple[np.float32 | None, np.ndarray]:
        """The loss (None: withheld by the label owner) and activation gradient of micro-batch ``i`` of step
        ``step`` (one of ``pending``, which loses it), with the stage below's compute time counted."""
        # With steps in flight a reply of another type may share the key (an evaluation's): it waits its turn.
        reply = self.link.await_reply(pending, (step, i), BACKWARD_TYPES if self.staleness else None)
        del pending[(step, i)]
        loss, dy = check_reply(reply, step, self.reply_specs, self.exp.allow_nonfinite, self.below)
        if loss is None:
            self.loss_withheld = True
        compute = reply.body.get("compute_s")
        if isinstance(compute, float):
            self.g_compute_s += compute
        return loss, dy

    def _step_in_flight(self) -> None:
        """Staleness S: send the forward of step c+S+1 (c: the updates applied), then complete step c+1:
        its replies, its backward with the parameters and activations of its forward, its update.

        The forward of step t uses the parameters after update t-1-S, which
        are the live ones when it is sent in order; after a (re)handshake the
        steps c+1..c+S are sent again with theirs (``ParameterHistory``).
        """
        stage, engine, count, depth = self.state.stage, self.state.engine, self.opts.micro_batches, self.staleness
        done = stage.step
        last_sent = min(done + depth + 1, self.steps)
        for step in range(done + 1, last_sent + 1):
            if step not in self.in_flight:
                self._send_in_flight(step)
        self._while_waiting(last_sent)
        step = done + 1
        version, caches = self.in_flight[step]
        pending = {key: msg for entry_step in sorted(self.in_flight) for key, msg in self.pending[entry_step].items()}

        def micro_batches() -> Iterator[tuple[dict[str, np.ndarray], np.float32 | None]]:
            for i in range(count):          # each backward with the parameters its forward had
                loss, dy = self._reply(pending, step, i)
                del self.pending[step][(step, i)]
                with self._as_of(version, step):
                    _, grads = stage.backward(caches.pop(i), dy, need_dx=False)
                yield grads, loss

        def before_update() -> None:
            del self.in_flight[step], self.pending[step]
            self.state.history.before_update(stage)

        self.loss = engine.apply_step(step, count, micro_batches(), before=before_update)

    def _probe_step(self) -> None:
        """``--staleness auto``: this stage's compute timed (``time_compute``), the fastest ping, then step 1 in
        lockstep, as every S computes it (its forward, as those of steps 2..S+1, uses the initial parameters), its wait timed;
        then S from ``choose_staleness``, and hello again so that the stage below keeps the replies of S + 1
        steps (run/autostaleness.py)."""
        stage = self.state.stage
        f_compute = time_compute(stage, self._batch(stage.step + 1)[0], self.opts.micro_batches)
        ping = self._ping_s()
        traffic = self.traffic
        wait, g_compute, sent, received = traffic.wait_s, self.g_compute_s, traffic.sent, traffic.received
        self._step_in_flight()                       # with staleness 0: step 1 alone
        wait, g_compute = traffic.wait_s - wait, self.g_compute_s - g_compute
        self.probe = LinkProbe(round_trip_s=wait, ping_s=ping, f_compute_s=f_compute, g_compute_s=g_compute,
                               bytes_down=traffic.sent - sent, bytes_up=traffic.received - received)
        self.staleness = self.probe.choose()
        self.state.history.depth = self.staleness
        if not self.staleness:
            self.state.history.clear()
        probe = self.probe
        self.log.info("staleness auto: S = %d (round trip + transfer %.2f ms, ping %.2f ms; step at the bound "
                      "%.2f ms: link %.2f ms, compute f %.2f ms, %s %.2f ms; %d bytes down, %d up per step); "
                      "--staleness %d runs the same computation", self.staleness, 1e3 * probe.round_trip_s,
                      1e3 * probe.ping_s, 1e3 * probe.step_s, 1e3 * probe.link_s, 1e3 * probe.f_compute_s,
                      self.below, 1e3 * probe.g_compute_s, probe.bytes_down,
                      probe.bytes_up, self.staleness)
        if self.staleness:
            self.handshake()

    def _ping_s(self) -> float:
        """The fastest of ``PINGS`` round trips of a ping to the stage below (which answers it at once)."""
        fastest = float("inf")
        for _ in range(PINGS):
            started = time.perf_counter()
            self.link.ping(self.state.run_id, self.opts.timeout_s)
            fastest = min(fastest, time.perf_counter() - started)
        return fastest

    def _send_in_flight(self, step: int) -> None:
        """Send every micro-batch of step ``step``, computed with the parameters after update step-1-S."""
        version = step - 1 - self.staleness
        batch = self._batch(step)
        caches: dict[int, Any] = {}
        pending: dict[tuple[int, int], Message] = {}
        self.state.history.before_forward(step, self.state.stage)
        with self._as_of(version, step):
            for i in range(self.opts.micro_batches):
                self._send(step, i, batch, pending, caches)
        self.in_flight[step] = (version, caches)
        self.pending[step] = pending

    def _as_of(self, version: int, step: int) -> contextlib.AbstractContextManager[None]:
        """The stage as it computed step ``step``'s forward: its parameters after update ``version``
        (``stage.as_of``)."""
        stage = self.state.stage
        return as_of(stage, self.state.history.at(version, stage), step)

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

    def _leaked(self, step: int, figures: dict[str, float]) -> None:
        """A window of the privacy meter closed after ``step``: its figures go with that step's record."""
        self.leaks = figures

    def _evaluation_due(self, step: int) -> bool:
        """Evaluate after ``step``: every ``eval_every``-th step and the last, when rows are held out."""
        return self.holds_out and evaluation_due(step, self.steps, self.eval_every)

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

    def _staleness_meta(self) -> dict[str, Any]:
        """The staleness S a checkpoint's steps in flight belong to (not yet known before ``--staleness auto``
        has chosen it)."""
        return {} if self.auto_staleness and self.probe is None else {"staleness": self.staleness}

    def _check_resumed_staleness(self) -> None:
        """Raise ``ConfigError`` when the checkpoint just resumed was written with another staleness: its
        parameter versions and forwards are those of its steps in flight, and a run that changed S part way
        would be no run's computation (with a larger S the versions it needs are not even kept)."""
        saved = self.state.resumed_meta.get("staleness")
        if isinstance(saved, int) and not isinstance(saved, bool) and saved != self.staleness:
            raise ConfigError(f"stage {self.opts.instance}: the checkpoint of step {self.state.resumed_step} was "
                              f"written with staleness {saved}, and this run asks for {self.staleness}: its steps "
                              f"in flight are those of staleness {saved}. Resume with --staleness {saved}, or start "
                              f"a new run (without --resume)")

    def run(self) -> dict[str, Any]:
        state = self.state
        if not (self.opts.resume and state.resume_latest()):
            state.begin(uuid.uuid4().hex)
        else:
            self._check_resumed_staleness()
            state.open_trace(append=True)
            self.loss_withheld = state.resumed_meta.get("training_loss") == wire.LOSS_WITHHELD
            saved = state.resumed_meta.get("evaluations", [])
            self.evaluations = [dict(e) for e in saved if isinstance(e, dict) and isinstance(e.get("step"), int)
                                and e["step"] <= state.stage.step] if isinstance(saved, list) else []
            if state.verdicts.stopped_at:       # early stopping ended the run there before the kill
                self.steps = min(self.steps, state.verdicts.stopped_at)
        started = time.perf_counter()
        told = False
        try:
            self._run()
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
            finally:
                state.close()
                self.link.close(linger_ms=NOTICE_LINGER_MS if told else None)
                for writer in self.writers:
                    writer.close()
                self.progress.close()
        return state.summary("completed", started, self.loss, endpoint=self.connect,
                             micro_batches=self.opts.micro_batches, schedule=self.opts.schedule,
                             # with steps in flight every micro-batch of a step is sent at once
                             in_flight=self.opts.micro_batches if self.staleness else self.opts.window,
                             staleness=self.staleness,
                             **({"staleness_auto": self.probe.fields(self.staleness)} if self.probe else {}),
                             **evaluation_fields(self.evaluation),
                             **({"evaluations": self.evaluations} if self.holds_out else {}),
                             **best_evaluation_fields(self.evaluations, state.verdicts.best_step),
                             **self._meter_fields(), **self._loss_fields())

    def _loss_fields(self) -> dict[str, Any]:
        """``training_loss``: ``wire.LOSS_WITHHELD`` once a reply came without a loss (the summary's
        ``final_loss`` is then null), else nothing."""
        return {"training_loss": wire.LOSS_WITHHELD} if self.loss_withheld else {}

    def _meter_fields(self) -> dict[str, Any]:
        """The summary's fields of this data owner's meter and guard; in a run of several data owners
        (clients, feature parties) under ``input_meters``, named by this one (``metering.by_owner``)."""
        fields = {**(self.metering.summary_fields() if self.metering else {}),
                  **(self.guarding.summary_fields() if self.guarding else {})}
        if self.exp.federated or self.exp.vertical:
            return by_owner(INPUTS, client_stage_name(self.opts.stage, self.opts.client), fields)
        return fields

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

    def _run(self) -> None:
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
                    self._report()
                    self.state.save()
                    if self.holds_out and not (self.evaluations and self.evaluations[-1]["step"] == stage.step):
                        self.evaluate()     # e.g. resumed after the last step, or its evaluation was refused
                    if self.validation and self.state.final_test is None:
                        self.evaluate(final=True)   # the test rows, once: the kept model's (resumed: done before)
                    self.link.exchange(Message(wire.BYE, self.state.run_id, stage.step + 1, body={"steps": stage.step}))
                    self.state.save(final_loss=self.loss, finished=True)   # a rerun with --resume: nothing to do
                    self.state.save_parameters()
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
