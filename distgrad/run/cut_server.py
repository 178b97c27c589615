"""The label owner's end of the cut as a library: ``CutServer``, for a training loop that is the caller's own.

Iterating a ``CutServer`` yields each micro-batch the data owner (a
``distgrad-stage`` daemon or a ``Cut``) sends as a ``Batch``; the loop
computes its loss, back-propagates, steps its own optimiser after a step's
last micro-batch and calls ``batch.reply(loss, grad)``. The reply is computed
and cached then, and leaves when the loop asks for the next batch (or the
server closes): after whatever the loop body saved. So a loop that saves its
checkpoint with ``state_dict()`` after every step can be killed at any point
and resumed from it with no lost or doubled step: the data owner resends an
unanswered step and gets the cached reply; the loop never sees a step twice.

Why not ``run.serving.ServingStage``: that state machine owns the stage's
computation, parameters, step engine and checkpoints (``StageState``) and
runs the update itself after the reply (``settle``); here the loop owns all
of those and computation happens between two calls of ``__next__``, on the
caller's thread. Hosting it would mean an adapter stage whose every method
hands control back to the caller mid-``handle`` (inverting the serving loop)
and a checkpoint format that is the caller's: more code than this one-peer
machine, which reuses the same mechanisms instead: its base
``run.cut_loop.LoopServer`` (the rules every label-owner end keeps with its
loop, written once for this class and ``run.cut_group.GroupServer``),
``run.cut_state`` (its checkpoint), ``wire.transport.Server`` (bounded
polls, CURVE, size limits), ``wire.messages.decode``,
``wire.wirecodec`` (codecs, error feedback), ``run.handshake.check_hello``
(the interface compared field by field) and ``run.protocol``, the rules it
shares with the daemons (refusals, ping, owner key, step order, the bye and its
replay, the reply and evaluation caches), written once for both. It serves
one data owner (no ``[clients]``), with the steps in flight its hello asks
for (staleness: the replies of the last S+1 steps are kept); docs/cut.md is
the contract.

The end of a run: the data owner's bye stops the iteration. A loop that
leaves after its last step, before the bye, is still served until the bye
comes (``close``, at most ``liveness_s`` of silence). A loop that stops
before (an exception leaving the ``with`` block, or a ``close`` mid-run)
tells the data owner why with the protocol's ``aborted`` notice
(``wire.abort_notice``, as ``distgrad predict`` does), and the data owner's
notice stops this loop at once (``PeerAborted``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar, Mapping, NoReturn

import numpy as np
import zmq

from distgrad.errors import CodecRangeError, ConfigError, CutMisuse, PeerTimeout, ProtocolError
from distgrad.run.accepts import refuse_rows
from distgrad.run.cut_interface import LAST, STATE_VERSION, Bounds, CutSide, check_residuals, check_state, cut_side
from distgrad.run.cut_loop import (REFUSED_TEXT_MAX, Batch, Evaluate, LoopServer, evaluation_scores, owned_copy)
from distgrad.run.cut_state import (REPLY_KEYS, SERVER_STATE_KEYS, check_micro_batches, reply_state, saved_replies,
                                    saved_reply)
from distgrad.run.handshake import check_hello, common_step
from distgrad.run.protocol import (rejoin_step, abort_reason, bye_reply, check_bye, check_evaluation_step,
                                   check_forward_order, check_owner, check_served_staleness, check_takeover,
                                   hello_fields, hello_peer, is_abort_notice, not_accepted, pong, prune_replies,
                                   resent_evaluation, unknown_run)
from distgrad.stage.stage import micro_batch
from distgrad.wire import messages as wire
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.link import evaluation_reply
from distgrad.wire.wirecodec import GRADIENT, Expected, Senders, stream_name

# Where they were defined before ``run.cut_loop`` and ``run.cut_state`` held them: still importable from here.
__all__ = ["Batch", "CutServer", "Evaluate", "REFUSED_TEXT_MAX", "REPLY_KEYS", "SERVER_STATE_KEYS",
           "evaluation_scores", "owned_copy", "reply_state", "saved_reply"]

_BYE = object()          # what handling a bye returns: the run is over


class CutServer(LoopServer):
    """The label owner's side of the cut, bound at ``endpoint``, serving one data owner's run.

    Build it with ``CutServer.bind``; iterate it for the batches; it stops
    after the data owner's bye. ``step`` is the steps applied (replied to in
    full). One loop drives it: a call from a second thread while one is inside is ``CutMisuse``
    (``cut_interface.one_loop``).
    """

    # The server of several data owners (vertical parties, clients in turn) ``bind`` builds for their
    # interface: ``run.cut_group.GroupServer``, which names itself here when its module is imported
    # (``distgrad.cut`` imports it), as it builds on this class.
    several: ClassVar[type["CutServer"] | None] = None

    def __init_subclass__(cls, serves_several: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if serves_several:
            CutServer.several = cls

    def __init__(self, side: CutSide, endpoint: str, *, bounds: Bounds = Bounds(),
                 curve_secret: str | Path | None = None, allow: str | Path | None = None,
                 evaluate: Evaluate | None = None, ctx: zmq.Context | None = None) -> None:
        if type(self) is CutServer and (side.exp.vertical or side.exp.federated):
            raise ConfigError("an interface of several data owners ('aggregate' or [clients]) is served by "
                              "CutServer.bind, which builds the server for them")
        super().__init__(side, bounds, evaluate)
        self.upstream = self.exp.stage_names[-2]
        self.senders = Senders(self.exp.codecs)
        self.run_id = ""                 # the run being served ("" before the first hello)
        self.run_since = 0.0             # when it started here (seconds since the epoch)
        self.owner = ""                  # with CURVE: the key that opened it
        self.staleness = 0               # steps the data owner keeps in flight (its hello says)
        self.step_rows: list[np.ndarray] = []   # send_rows: the rows of step + 1's micro-batches replied to
        self.cache: dict[tuple[int, int], Message] = {}    # replies of the last staleness + 1 steps and the one
                                                           # in progress
        self.pending: list[tuple[list[bytes], Message]] = []   # replies to send at the next ``__next__``
        self.joined = False
        self.peer_envelope: list[bytes] | None = None    # where the run's data owner was last heard from
        self.bye: Message | None = None  # the reply to the bye that ended the run (a repeated bye gets it again)
        self.evaluation: Message | None = None              # the last reply to an evaluation (run, step)
        specs = [self._expected(1, self.exp.send_rows).specs]
        if self.test_rows is not None:
            specs.append(self._expected(1).with_rows(len(self.test_rows)).specs)   # may exceed a batch
        self._bind_socket(endpoint, specs, ctx, curve_secret, allow)
        self.heard = time.monotonic()    # when the data owner was last heard (for the bounded wait)

    @classmethod
    def bind(cls, endpoint: str, interface: str | Path | Mapping[str, Any] | None = None, *,
             state: Mapping[str, Any] | None = None, liveness_s: float | None = None,
             peer_deadline_s: float | None = None, curve_secret: str | Path | None = None,
             allow: str | Path | None = None, evaluate: Evaluate | None = None, ctx: zmq.Context | None = None,
             **fields: Any) -> "CutServer":
        """A ``CutServer`` bound at ``endpoint`` (``tcp://HOST:PORT``, port ``*`` for any; ``ipc://PATH``)
        for ``interface`` (this party's stage file, or its fields as keyword arguments), resumed from
        ``state`` (a ``state_dict``) when given. ``liveness_s`` and ``peer_deadline_s`` bound how long a
        silent data owner is waited for (then ``PeerTimeout``); ``curve_secret`` and ``allow`` are CURVE's
        secret key file and allowed-clients directory. ``evaluate(h, rows) -> (loss, correct)``: how the loop
        scores the held-out rows when the data owner sends them (a daemon with ``test_fraction`` > 0): their
        activations and row numbers in, the loss and how many rows are right (None when the loss does not
        classify) out; it is called inside ``__next__`` and must change no state. Raises ``ConfigError``."""
        given = {k: v for k, v in (("liveness_s", liveness_s), ("peer_deadline_s", peer_deadline_s))
                 if v is not None}
        side = cut_side(LAST, interface, fields)
        if side.exp.vertical or side.exp.federated:
            if CutServer.several is None:
                raise ConfigError("an interface of several data owners is served by distgrad.run.cut_group's "
                                  "server: import distgrad.cut (or distgrad.torch), which brings it")
            cls = CutServer.several
        server = cls(side, endpoint, bounds=Bounds(**given), curve_secret=curve_secret, allow=allow,
                     evaluate=evaluate, ctx=ctx)
        if state is not None:
            try:
                server.load_state_dict(state)
            except Exception:
                server.close()
                raise
        return server

    # -- the batches
    def __next__(self) -> Batch:
        """The next micro-batch to compute; first sends the replies the loop made since the last call.
        Stops after the data owner's bye. Raises ``CutMisuse`` when the batch given out last has no reply,
        ``PeerTimeout`` when the data owner stays silent for ``liveness_s + peer_deadline_s``,
        ``PeerAborted`` when it said it stopped (its reason in the message)."""
        self._next_batch_asked()
        if self.failure is not None:
            raise self.failure
        if self.done:
            raise StopIteration
        started = time.monotonic()      # silence counts from here: while the loop computed, the data owner waited
        while True:
            request = self._receive(started)
            if request is None:
                continue
            out = self._answer(request, self._handle)
            if out is _BYE:
                self.done = True
                raise StopIteration
            if isinstance(out, Batch):
                self.batch = out
                return out

    def _check_silence(self, started: float) -> None:
        """``PeerTimeout`` once the data owner has been silent (nothing of it accepted) for ``liveness_s +
        peer_deadline_s`` while the loop waits: counted from ``started`` (when the loop asked for the next batch)
        or the data owner's last message, whichever is later; the loop's own computing is not its silence."""
        limit = self.bounds.liveness_s + self.bounds.peer_deadline_s
        if time.monotonic() - max(self.heard, started) > limit:
            raise PeerTimeout(f"the data owner ({self.upstream}) of run {self.run_id or '(none yet)'} was "
                              f"silent for more than {limit:g} s at step {self.step} (liveness "
                              f"{self.bounds.liveness_s:g} s + peer deadline {self.bounds.peer_deadline_s:g} "
                              f"s); restart it, or both sides from checkpoints of the same step"
                              f"{'; the last message refused here: ' + self.refused if self.refused else ''}")

    def _handle(self, envelope: list[bytes], msg: Message, peer_key: str) -> Any:
        """Answer ``msg`` now, or return what the loop must see (a ``Batch``, ``_BYE``); raises
        ``ProtocolError`` to refuse it (nothing changes then)."""
        if msg.type == wire.PING:
            open_run = self.run_id if self.bye is None else ""      # protocol.md: "" when no run is open
            self.server.reply(envelope, pong(msg, self.side.stage, self.exp.name, run=open_run, step=self.step,
                                             client_live=time.monotonic() - self.heard < self.bounds.liveness_s))
            return None
        if is_abort_notice(msg):
            self._aborted(msg, peer_key)
        if msg.type == wire.BYE and self.bye is not None and msg.run == self.bye.run:
            self.server.reply(envelope, self.bye)      # a repeated bye of the ended run: its reply again
            return None
        if msg.type == wire.HELLO:
            self.server.reply(envelope, self._hello(msg, peer_key))
            self.heard, self.peer_envelope = time.monotonic(), envelope
            return None
        if not self.joined or msg.run != self.run_id:
            raise unknown_run(msg, f"run {self.run_id}" if self.joined else "a hello first")
        check_owner(self.owner, peer_key)
        out: Any = None
        if msg.type == wire.FORWARD:
            out = self._forward(envelope, msg)
        elif msg.type == wire.BYE:
            check_bye(msg, self.step, f"client of run {self.run_id}", self.next_mb)
            self.bye, out = bye_reply(msg, self.step), _BYE
            self.server.reply(envelope, self.bye)
            self.log.info("run %s finished after %d steps", self.run_id, self.step)
        elif msg.type == wire.EVALUATE:
            self.server.reply(envelope, self._evaluate(msg))
        else:
            raise not_accepted(msg)
        self.heard = time.monotonic()    # the data owner is heard by what is accepted (protocol.md: live)
        self.peer_envelope = envelope
        return out

    def _aborted(self, msg: Message, peer_key: str) -> NoReturn:
        """The data owner's notice that it stopped: ``PeerAborted`` for the loop, now and at every later
        ``__next__``. A notice of another run than this one's, or from another key, is refused as the daemons
        refuse it; any is taken before the first run (a data owner may stop before its hello: docs/cut.md)."""
        if self.run_id and msg.run != self.run_id:
            raise unknown_run(msg, f"run {self.run_id}")
        check_owner(self.owner, peer_key, msg)
        self._peer_stopped(f"{abort_reason(msg)} (the data owner of run {msg.run}; this side has applied "
                           f"{self.step} steps)")

    def _hello(self, msg: Message, peer_key: str) -> Message:
        """Take the run up at the data owner's step, or at the step before it when this side can answer
        that step again from its cache; anything else is refused naming both steps."""
        body = msg.body
        hello_peer(body, self.exp.name)                          # one data owner: a hello naming a client is refused
        mbs = check_hello(body, self.upstream, self.exp, self.exp.seed, self.side.shape, here=self.side.stage)
        _, staleness = hello_fields(body, "this label owner trains in its own loop and predicts nothing")
        check_served_staleness(self.exp, staleness)
        held: Any = body.get("held")                             # from the wire: common_step checks it
        common_step([], held)                                    # validates ``held``
        # A live run is busy whatever its step; a silent one mid-run cannot be taken over by another run.
        check_takeover(msg, self.run_id, self.run_since, time.monotonic() - self.heard, self.bounds.liveness_s,
                       "the data owner", self.step, self.next_mb, self.owner, peer_key)
        if self.next_mb and mbs != self.mbs:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello asks for {mbs} micro-batches, but step {self.step + 1} "
                                                    f"is under way here in {self.mbs}")
        # The newest step the data owner holds from which every later step this side applied can be
        # answered again from the cache (the steps it sent but did not see answered, or had in flight).
        next_step = rejoin_step(held, self.step, self.cache, self.mbs, "the data owner", msg.run)
        if msg.run != self.run_id:
            self.log.info("run %s started by %s", msg.run, body.get("role"))
            self.cache, self.senders = {}, Senders(self.exp.codecs)
        if msg.run != self.run_id:
            self.run_since = time.time()
        self.run_id, self.owner, self.mbs, self.joined = msg.run, peer_key, mbs, True
        self.staleness = staleness
        self.log.info("run %s: the data owner said hello (%d micro-batches); next step %d", msg.run, mbs, next_step)
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.side.stage, "next_step": next_step})

    def _evaluate(self, msg: Message) -> Message:
        """The loop's scores of the held-out rows (``evaluate``); a resent evaluation gets the same reply."""
        evaluate, test_rows = self._scored_rows("the data owner's")
        if (again := resent_evaluation(self.evaluation, msg)) is not None:
            return again
        check_evaluation_step(msg, self.step, f"client of run {self.run_id}", self.staleness, self.next_mb)
        h = self._expected(1).with_rows(len(test_rows)).receive(msg, self.exp.allow_nonfinite)
        self.evaluation = evaluation_reply(msg.run, msg.step,
                                           evaluation_scores(evaluate(h, test_rows), len(test_rows)))
        return self.evaluation

    def _expected(self, mbs: int, rows: bool = False) -> Expected:
        """What a forward of one of ``mbs`` micro-batches carries (with ``rows``: a training forward with
        ``send_rows``, its row numbers too), or with ``with_rows`` an evaluation."""
        return self._forward_expected(self.side.shape, mbs, rows)

    def _forward(self, envelope: list[bytes], msg: Message) -> Batch | None:
        cached = self.cache.get((msg.step, msg.mb))
        if cached is not None:
            self.server.reply(envelope, cached)      # a resent request: its reply again, computed once
            return None
        k = self.step + 1
        check_forward_order(msg, k, self.next_mb, self.mbs, self.exp.steps)
        h = self._expected(self.mbs, self.exp.send_rows).receive(msg, self.exp.allow_nonfinite)
        rows = None
        if self.exp.send_rows:           # the data owner's loader chose them: checked as the daemons do
            refuse_rows(self.side.data, msg, self.step_rows[:msg.mb])
            rows = np.array(msg.tensors["rows"])
        elif self.side.data is not None:
            rows = micro_batch(self.side.rows(k), msg.mb, self.mbs)
        return Batch(k, msg.mb, self.mbs, h, rows, self, envelope)

    def _reply(self, batch: Batch, loss: Any, grad: Any) -> None:
        value, nonfinite = self._checked(batch, loss, grad, self.side.micro_shape(batch.mbs))
        if nonfinite is not None:
            self._fail_step(batch, nonfinite, [(self.run_id, batch.envelope)])
        stream = stream_name(GRADIENT, batch.mb, batch.mbs)
        try:
            tensors = self.senders.message_tensors(GRADIENT, owned_copy(grad), stream, batch.step)
        except CodecRangeError as e:
            self._fail_step(batch, f"stage {self.side.stage}: {e}; nothing of this step was applied",
                            [(self.run_id, batch.envelope)])
        reply = Message(wire.BACKWARD, self.run_id, batch.step, batch.mb, batch.mbs, tensors=tensors,
                        body={**self.senders.reply_body(value), "compute_s": time.perf_counter() - batch.started})
        batch.replied = True
        self.cache[(batch.step, batch.mb)] = reply
        self.pending.append((batch.envelope, reply))
        if batch.known_rows is not None:
            self.step_rows = [*self.step_rows[:batch.mb], batch.known_rows]
        if batch.last:
            self.step, self.next_mb, self.step_rows = batch.step, 0, []
            self.senders.commit()
            self.cache = prune_replies(self.cache, self.step - self.staleness)
        else:
            self.next_mb += 1

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for envelope, reply in pending:
            self.server.reply(envelope, reply)

    def _drop_unsent(self) -> None:
        self.pending = []

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of this loop must hold to resume the cut, taken after the reply to a step's
        last micro-batch (``CutMisuse`` otherwise): the run, the step and the replies of that step (so a
        resent step is answered from them), as plain values and numpy arrays; no pickle is needed."""
        self._check_savable()
        replies = [reply_state(m) for m in self.cache.values()]
        return {"version": STATE_VERSION, "interface": self.exp.interface_fingerprint, "run": self.run_id,
                "step": self.step, "micro_batches": self.mbs, "replies": replies,
                "residuals": self.senders.state_arrays()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Stand where ``state`` (a ``state_dict``) says, before the first batch; the data owner must say
        hello again."""
        self._check_open()
        if self.joined:
            raise CutMisuse("load_state_dict after the run began; load it before the first batch "
                            "(or CutServer.bind(..., state=...))")
        step = check_state(state, self.exp, SERVER_STATE_KEYS, "CutServer")
        mbs, replies = check_micro_batches(state["micro_batches"], self.exp), state["replies"]
        check_residuals(state["residuals"], self.side, GRADIENT, mbs)
        if not isinstance(replies, (list, tuple)):
            raise ConfigError(f"the state's replies must be a list, got {type(replies).__name__}")
        cache = saved_replies(replies, state["run"], step, mbs, self.side.shape, self.exp)
        self.run_id, self.step, self.mbs, self.cache = state["run"], step, mbs, cache
        self.senders.load_state_arrays(state["residuals"])

    # -- the end
    def _complete(self) -> bool:
        """Every step of a run is replied to here."""
        return bool(self.run_id) and self.step >= self.exp.steps and not self.next_mb

    def _all_said_bye(self) -> bool:
        return self.bye is not None

    def _byes_due(self) -> bool:
        return self.joined and self._complete()

    def _owing_bye_heard(self) -> float:
        return self.heard

    def _no_bye_yet(self) -> str:
        return f"run {self.run_id}: no bye from the data owner"

    def _ended_runs(self) -> set[str]:
        return set() if self.bye is None else {self.bye.run}

    def _closing_text(self) -> str:
        assert self.bye is not None      # asked only after the bye (``_linger``)
        return f"run {self.bye.run} ended with its bye; this label owner is closing"

    def _waiting_places(self) -> dict[str, list[list[bytes]]]:
        """Wherever the data owner may wait: the replies not sent yet, the batch not replied to, where it was
        last heard from."""
        envelopes = [*(envelope for envelope, _ in self.pending), self.peer_envelope]
        if self.batch is not None and not self.batch.replied:
            envelopes.append(self.batch.envelope)
        targets = list({tuple(e): e for e in envelopes if e}.values())
        return {self.run_id: targets} if targets else {}

    def _tell_stopped(self, reason: str, places: dict[str, list[list[bytes]]]) -> bool:
        """Tell the data owner at ``places`` that this side stopped (``reason``, ``_send_stop_notice``); not
        after its bye, nor when it was told already (``nonfinite_step``) or stopped itself. Whether there
        was anyone to tell."""
        if self.bye is not None or self.failure is not None or not places:
            return False
        live = ({self.run_id} if self.joined and time.monotonic() - self.heard < self.bounds.liveness_s
                else set())
        told = self._send_stop_notice(places, live, reason)
        self.log.warning("told the data owner of run %s that this side stopped: %s", self.run_id, reason)
        return told
