"""The driving stage's step engines (``DriverSteps``): one step's forwards, replies, backward and update.

``step_once`` picks the engine: a step of one micro-batch in lockstep (``_lockstep_step``: the common case,
whose per-step cost counts most), a window of micro-batches, S steps in flight (``_step_in_flight``), or
``--staleness auto``'s first step, which measures the link (``_probe_step``); SplitFed's average
(``_average``) comes between a step's gradients and its update. What needs no reply is done while one is
awaited rather than between a reply and the next forward (``_while_waiting``): the records of the steps
applied, and the next step's batch.

Built on ``driver_records.DriverRecords``; the base of ``driver._Driver``.
"""


from __future__ import annotations

import contextlib
import time
from typing import Any, Iterator

import numpy as np

from distgrad.errors import ProtocolError
from distgrad.run.autostaleness import PINGS, LinkProbe, time_compute
from distgrad.run.driver_records import DriverRecords
from distgrad.run.protocol import forward_message
from distgrad.stage.stage import ROWS_DTYPE, as_of, micro_batch
from distgrad.wire import messages as wire
from distgrad.wire.link import check_reply
from distgrad.wire.messages import ErrorCode, Message

BACKWARD_TYPES = frozenset({wire.BACKWARD})        # a forward's reply (with steps in flight, an evaluation's
                                                   # may share its step and micro-batch)


class DriverSteps(DriverRecords):
    """The step engines: ``step_once`` applies the next step, with the messages, checks and update in the
    order the in-process reference computes them."""

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

    def _probe_step(self) -> None:
        """``--staleness auto``: this stage's compute timed (``time_compute``), the fastest ping, then step 1 in
        lockstep, as every S computes it (its forward, as those of steps 2..S+1, uses the initial parameters), its wait timed;
        then S from ``choose_staleness``, and hello again so that the stage below keeps the replies of S + 1
        steps, and the forwards of steps 2..S+1 sent (run/autostaleness.py)."""
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
            # As with --staleness S, the S steps after the one applied (2..S+1: their forwards use the initial
            # parameters) are in flight before anything else goes down, so that the stage below answers step
            # 1's evaluation with its parameters after step min(1+S, steps), as that run's does.
            done = self.state.stage.step
            for step in range(done + 1, min(done + self.staleness, self.steps) + 1):
                self._send_in_flight(step)

    def _ping_s(self) -> float:
        """The fastest of ``PINGS`` round trips of a ping to the stage below (which answers it at once)."""
        fastest = float("inf")
        for _ in range(PINGS):
            started = time.perf_counter()
            self.link.ping(self.state.run_id, self.opts.timeout_s)
            fastest = min(fastest, time.perf_counter() - started)
        return fastest

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
