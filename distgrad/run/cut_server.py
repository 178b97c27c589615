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
machine, which reuses the same mechanisms instead: ``wire.transport.Server``
(bounded polls, CURVE, size limits), ``wire.messages.decode``,
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

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterator, Mapping

import numpy as np
import zmq

from distgrad.config.experiment import is_whole
from distgrad.errors import (CodecRangeError, ConfigError, CutMisuse, DistgradError, NonFiniteError, PeerAborted,
                             PeerTimeout, ProtocolError)
from distgrad.run.accepts import refuse_rows
from distgrad.run.cut_interface import (LAST, STATE_KEYS, STATE_VERSION, Bounds, CutSide, check_residuals,
                                       check_state, cut_side, torch_hint)
from distgrad.run.handshake import check_hello, common_step
from distgrad.run.protocol import (rejoin_step, abort_reason, bye_reply, check_bye, check_evaluation_step,
                                   check_forward_order, check_owner, check_served_staleness, decode_and_handle,
                                   check_takeover, hello_fields, hello_peer, is_abort_notice, not_accepted,
                                   notify_stopped, pong, prune_replies, refused_text, resent_evaluation, unknown_run)
from distgrad.stage.stage import ROWS_DTYPE, micro_batch
from distgrad.wire import messages as wire
from distgrad.wire.keys import CurveServer
from distgrad.wire.messages import ErrorCode, Message, frame_limit
from distgrad.wire.link import evaluation_reply
from distgrad.wire.transport import LINGER_MS, NOTICE_LINGER_MS, POLL_TICK_S, Server
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, Expected, Senders, TensorSpecs, WireTensor, stream_name

_BYE = object()          # what handling a bye returns: the run is over
REFUSED_TEXT_MAX = 300   # characters of the last refusal a PeerTimeout's message quotes
SERVER_STATE_KEYS = (*STATE_KEYS, "micro_batches", "replies")    # what a CutServer's state_dict holds
REPLY_KEYS = {"step", "mb", "mbs", "loss", "compute_s", "tensors"}   # each of its replies

# The loop's scoring of the held-out rows: (their activations, their row numbers) -> (loss, rows right or None).
Evaluate = Callable[[np.ndarray, np.ndarray], tuple[Any, Any]]


@dataclass
class Batch:
    """One micro-batch of step ``step`` from the data owner: ``h`` (its activation, float32, read-only),
    ``rows`` (its row numbers, int64: with ``send_rows`` those the data owner sent, checked by
    ``accepts.refuse_rows``; else in the shared sample order when this party has ``[data]``; else reading
    it raises ``CutMisuse``: nothing numbers the rows), micro-batch ``mb`` of ``mbs`` (``last``: the step's
    last). With several data owners (``run.cut_group``): ``client``, the data owner it is from
    (``[clients]``; else None), and ``parts``, each feature party's own embedding in party order, which
    ``h`` combines (vertical; else None). Answer it once with ``reply``."""

    step: int
    mb: int
    mbs: int
    h: np.ndarray
    known_rows: np.ndarray | None
    server: "CutServer" = field(repr=False)
    envelope: list[bytes] = field(repr=False, default_factory=list)
    replied: bool = False
    started: float = field(default_factory=time.perf_counter, repr=False)
    client: int | None = None
    parts: tuple[np.ndarray, ...] | None = field(default=None, repr=False)

    @property
    def last(self) -> bool:
        return self.mb == self.mbs - 1

    @property
    def rows(self) -> np.ndarray:
        if self.known_rows is None:
            raise CutMisuse(f"batch.rows of step {self.step}: nothing numbers this batch's rows (this label owner "
                            f"has no [data] and the interface no send_rows = true); give the label owner its "
                            f"[data] (its labels) or set send_rows = true on both sides")
        return self.known_rows

    def reply(self, loss: Any, grad: np.ndarray) -> None:
        """Answer with this micro-batch's ``loss`` (a float; reduced over its rows as the interface's
        ``reduction`` says) and ``grad`` = d(loss)/d(h) (float32, ``h``'s shape). Step your optimiser
        before replying to the last micro-batch: the step counts as applied once it is replied to. Raises
        ``CutMisuse`` for a second reply or a gradient of the wrong shape or dtype, ``NonFiniteError`` for
        a NaN or Inf loss or gradient (unless the interface allows them; the data owner is told too)."""
        self.server._reply(self, loss, grad)


class CutServer:
    """The label owner's side of the cut, bound at ``endpoint``, serving one data owner's run.

    Build it with ``CutServer.bind``; iterate it for the batches; it stops
    after the data owner's bye. ``step`` is the steps applied (replied to in
    full). Not thread-safe: one loop drives it.
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
        self.side, self.exp, self.bounds = side, side.exp, bounds
        self.log = logging.getLogger(f"distgrad.{side.stage}")
        self.upstream = self.exp.stage_names[-2]
        self.senders = Senders(self.exp.codecs)
        self.run_id = ""                 # the run being served ("" before the first hello)
        self.run_since = 0.0             # when it started here (seconds since the epoch)
        self.owner = ""                  # with CURVE: the key that opened it
        self.step = 0                    # steps applied
        self.next_mb = 0                 # micro-batches of step + 1 replied to
        self.staleness = 0               # steps the data owner keeps in flight (its hello says)
        self.step_rows: list[np.ndarray] = []   # send_rows: the rows of step + 1's micro-batches replied to
        self.mbs = side.micro_batches
        self.cache: dict[tuple[int, int], Message] = {}    # replies of the last staleness + 1 steps and the one
                                                           # in progress
        self.pending: list[tuple[list[bytes], Message]] = []   # replies to send at the next ``__next__``
        self.batch: Batch | None = None  # the one given out and not yet replied to
        self.joined, self.done, self.closed = False, False, False
        self.failure: DistgradError | None = None   # raised again by every later ``__next__``
        self.peer_envelope: list[bytes] | None = None    # where the run's data owner was last heard from
        self.refused = ""                # the last message refused, for a timeout's message
        self.bye: Message | None = None  # the reply to the bye that ended the run (a repeated bye gets it again)
        self.evaluate = evaluate                            # the loop's scoring
        self.evaluation: Message | None = None              # its last reply (run, step)
        self.test_rows = self._test_rows() if evaluate is not None else None
        specs = [self._expected(1, self.exp.send_rows).specs]
        if self.test_rows is not None:
            specs.append(self._expected(1).with_rows(len(self.test_rows)).specs)   # may exceed a batch
        self._bind_socket(endpoint, specs, ctx, curve_secret, allow)
        self.heard = time.monotonic()    # when the data owner was last heard (for the bounded wait)

    def _bind_socket(self, endpoint: str, specs: list[Any], ctx: zmq.Context | None,
                     curve_secret: str | Path | None, allow: str | Path | None) -> None:
        """Bind the server socket at ``endpoint``, its size limits those of the biggest of the messages
        ``specs`` describe, with CURVE when ``curve_secret`` and ``allow`` are given (both or neither:
        ``ConfigError``)."""
        if (curve_secret is None) != (allow is None):
            raise ConfigError("CURVE needs curve_secret and allow together (the --curve-secret and --allow of a "
                              "daemon)")
        limits = [frame_limit(spec) for spec in specs]
        self.max_frame, self.max_tensor = max(m for m, _ in limits), max(t for _, t in limits)
        ctx = ctx or zmq.Context.instance()
        self.curve = (CurveServer(ctx, Path(curve_secret), Path(allow))
                      if curve_secret is not None and allow is not None else None)
        try:
            self.server = Server(ctx, endpoint, self.max_frame, self.bounds.liveness_s, self.curve)
        except Exception:
            if self.curve is not None:
                self.curve.stop()
            raise
        self.endpoint = self.server.endpoint
        self.log.info("cut server of %s serving on %s (%s)", self.exp.name, self.endpoint,
                      "CURVE" if self.curve is not None else "plaintext")

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

    @property
    def scale(self) -> np.float32:
        """The float32 factor on the sum of a step's micro-batch gradients, as the daemons apply it (1 for
        one micro-batch or a ``sum`` reduction, 1/M for ``mean``)."""
        return self.side.scale(self.mbs)

    # -- the batches
    def __iter__(self) -> Iterator[Batch]:
        return self

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
        limit = self.bounds.liveness_s + self.bounds.peer_deadline_s
        while True:
            request = self.server.receive(POLL_TICK_S)
            if request is None:
                if time.monotonic() - self.heard > limit:
                    raise PeerTimeout(f"the data owner ({self.upstream}) of run {self.run_id or '(none yet)'} was "
                                      f"silent for more than {limit:g} s at step {self.step} (liveness "
                                      f"{self.bounds.liveness_s:g} s + peer deadline {self.bounds.peer_deadline_s:g} "
                                      f"s); restart it, or both sides from checkpoints of the same step"
                                      f"{'; the last message refused here: ' + self.refused if self.refused else ''}")
                continue
            out = self._answer(request, self._handle)
            if out is _BYE:
                self.done = True
                raise StopIteration
            if isinstance(out, Batch):
                self.batch = out
                return out

    def _next_batch_asked(self) -> None:
        """The loop asks for its next batch, one rule for every cut server: ``CutMisuse`` unless the server is
        open and the batch given out last has its reply; then the replies the loop made since leave."""
        self._check_open()
        if self.batch is not None and not self.batch.replied:
            raise CutMisuse(f"the loop asked for the next batch without replying to step {self.batch.step} "
                            f"micro-batch {self.batch.mb}/{self.batch.mbs}: call batch.reply first, in every iteration")
        self.batch = None
        self._flush()

    def _answer(self, request: tuple[list[bytes], list[Any], str],
                handle: Callable[[list[bytes], Message, str], Any]) -> Any:
        """``handle`` the received ``request``; a message it refuses (or that does not decode) gets the
        protocol's error reply, and None is returned."""
        envelope, frames, peer_key = request
        msg, out, refused = decode_and_handle(frames, self.max_tensor, lambda m: handle(envelope, m, peer_key),
                                              self.log)
        if not refused:
            return out
        self.refused = refused_text(msg, out)[:REFUSED_TEXT_MAX]
        self.server.reply(envelope, out)
        return None

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

    def _aborted(self, msg: Message, peer_key: str) -> None:
        """The data owner's notice that it stopped: ``PeerAborted`` for the loop, now and at every later
        ``__next__``. A notice of another run than this one's, or from another key, is refused as the daemons
        refuse it; any is taken before the first run (a data owner may stop before its hello: docs/cut.md)."""
        if self.run_id and msg.run != self.run_id:
            raise unknown_run(msg, f"run {self.run_id}")
        check_owner(self.owner, peer_key, msg)
        reason = abort_reason(msg)
        self.failure = PeerAborted(f"{reason} (the data owner of run {msg.run}; this side has applied "
                                   f"{self.step} steps)")
        self.log.warning("%s", self.failure)
        raise self.failure

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

    def _test_rows(self) -> np.ndarray:
        """The held-out rows of this party's ``[data]`` (``ConfigError`` when it has none)."""
        rows = getattr(self.side.data, "test_rows", None)
        if rows is None or not len(rows):
            raise ConfigError(f"evaluate= scores the held-out rows of stage {self.side.stage!r}'s [data], which "
                              f"holds none out: give its [data] a test_fraction > 0, as the data owner's")
        return np.asarray(rows, np.int64)

    def _evaluate(self, msg: Message) -> Message:
        """The loop's scores of the held-out rows (``evaluate``); a resent evaluation gets the same reply."""
        if self.evaluate is None or self.test_rows is None:
            raise ProtocolError(ErrorCode.TYPE, f"experiment {self.exp.name!r}: this label owner's own loop "
                                                f"scores no held-out rows (it gave CutServer.bind no evaluate=); "
                                                f"give the data owner's [data] test_fraction = 0")
        if (again := resent_evaluation(self.evaluation, msg)) is not None:
            return again
        check_evaluation_step(msg, self.step, f"client of run {self.run_id}", self.staleness, self.next_mb)
        h = self._expected(1).with_rows(len(self.test_rows)).receive(msg, self.exp.allow_nonfinite)
        self.evaluation = evaluation_reply(msg.run, msg.step,
                                           evaluation_scores(self.evaluate(h, self.test_rows), len(self.test_rows)))
        return self.evaluation

    def _expected(self, mbs: int, rows: bool = False) -> Expected:
        """What a forward of one of ``mbs`` micro-batches carries (with ``rows``: a training forward with
        ``send_rows``, its row numbers too), or with ``with_rows`` an evaluation."""
        shape = self.side.micro_shape(mbs)
        others: TensorSpecs = {"rows": ((shape[0],), ROWS_DTYPE)} if rows else {}
        return Expected(WireTensor(ACTIVATION, shape, self.exp.codecs[ACTIVATION]), others)

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

    def _checked(self, batch: Batch, loss: Any, grad: Any, shape: tuple[int, ...]) -> tuple[Any, str | None]:
        """The loop's reply to ``batch`` checked, one rule for every cut server: ``CutMisuse`` for a closed
        server, a second reply, a batch not in progress, or a gradient that is not float32 of ``shape``; then the
        loss as one number and, where it or the gradient is not finite (and the interface does not allow it),
        the text of the step's failure (else None)."""
        self._check_open()
        if batch.replied:
            raise CutMisuse(f"step {batch.step} micro-batch {batch.mb}/{batch.mbs} was replied to already; each "
                            f"batch gets exactly one reply")
        if batch is not self.batch:
            raise CutMisuse(f"step {batch.step} micro-batch {batch.mb} is not the batch in progress")
        if not isinstance(grad, np.ndarray) or grad.dtype != np.float32 or grad.shape != shape:
            raise CutMisuse(f"the gradient of step {batch.step} micro-batch {batch.mb} must be a float32 array of "
                            f"h's shape {shape}, got {type(grad).__name__} {getattr(grad, 'dtype', '')} "
                            f"{getattr(grad, 'shape', '')}{torch_hint(grad)}")
        value = _one_number(loss, f"the loss of step {batch.step}")
        if not self.exp.allow_nonfinite and not (np.isfinite(value) and wire.all_finite(grad)):
            what = "loss" if not np.isfinite(value) else "activation_grad"
            return value, (f"stage {self.side.stage}: non-finite {what} at step {batch.step}; nothing of this "
                           f"step was applied")
        return value, None

    def _reply(self, batch: Batch, loss: Any, grad: Any) -> None:
        value, nonfinite = self._checked(batch, loss, grad, self.side.micro_shape(batch.mbs))
        if nonfinite is not None:
            self._fail(batch, nonfinite)
        stream = stream_name(GRADIENT, batch.mb, batch.mbs)
        try:
            tensors = self.senders.message_tensors(GRADIENT, owned_copy(grad), stream, batch.step)
        except CodecRangeError as e:
            self._fail(batch, f"stage {self.side.stage}: {e}; nothing of this step was applied")
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

    def _fail(self, batch: Batch, text: str) -> None:
        """The loop's step failed: the data owner is told (``nonfinite_step``), the loop gets the error."""
        batch.replied = True
        self.failure = NonFiniteError(text)
        self.server.reply(batch.envelope, wire.error_message(self.run_id, batch.step, ErrorCode.NONFINITE_STEP,
                                                             text, batch.mb, batch.mbs))
        raise self.failure

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for envelope, reply in pending:
            self.server.reply(envelope, reply)

    # -- checkpoints
    def _check_savable(self) -> None:
        """``CutMisuse`` unless the loop may save now, one rule for every cut server: after the reply to a
        step's last micro-batch."""
        if self.batch is not None and not self.batch.replied:
            raise CutMisuse(f"state_dict before replying to step {self.batch.step} micro-batch {self.batch.mb}: "
                            f"reply first, then save (the saved state must hold the reply)")
        if self.next_mb:
            raise CutMisuse(f"state_dict in the middle of step {self.step + 1} (micro-batch {self.next_mb} of "
                            f"{self.mbs} is next): save after the reply to its last micro-batch (batch.last)")

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
        mbs, replies = state["micro_batches"], state["replies"]
        if not is_whole(mbs) or mbs < 1 or self.exp.batch % mbs:
            raise ConfigError(f"the state's micro_batches {wire.show(mbs)} is not a count that divides the "
                              f"batch ({self.exp.batch})")
        check_residuals(state["residuals"], self.side, GRADIENT, mbs)
        if not isinstance(replies, (list, tuple)):
            raise ConfigError(f"the state's replies must be a list, got {type(replies).__name__}")
        cache = {}
        for r in replies:
            reply = self._saved_reply(r, state["run"], step, mbs)
            cache[(reply.step, reply.mb)] = reply
        self.run_id, self.step, self.mbs, self.cache = state["run"], step, mbs, cache
        self.senders.load_state_arrays(state["residuals"])

    def _saved_reply(self, r: Any, run: str, step: int, mbs: int) -> Message:
        """One reply of a state's ``replies`` as the message it was (``saved_reply``)."""
        return saved_reply(r, run, step, mbs, self.side.micro_shape(mbs), self.exp)

    # -- the end
    def close(self) -> None:
        """Send the replies not sent yet, then close the socket (and CURVE's authenticator). After the
        run's last step, before the data owner's bye, the data owner is served first until its bye (an
        evaluation, a resent step, the bye), for at most ``liveness_s`` of its silence. Closed mid-run
        (before the last step, with no bye), the data owner is told (an ``aborted`` notice), so its
        ``cut.step`` raises ``PeerAborted`` at once. Raises ``PeerAborted`` when the data owner stops
        while it is served here."""
        self._close(None)

    def _close(self, failure: str | None) -> None:
        """Close as ``close`` does; ``failure``: why this side's loop failed, told to the data owner
        instead of the replies not sent yet (the loop may have failed before saving them: the data owner
        sends that step again to the loop resumed from its checkpoint)."""
        if self.closed:
            return
        notice, unsent = failure, [envelope for envelope, _ in self.pending]
        try:
            if failure is not None:
                self.pending = []
            else:
                self._flush()
                if self.bye is None and self.joined and self._complete():
                    self._await_bye()
                elif self.bye is None:
                    notice = (f"its loop closed the CutServer after step {self.step} of {self.exp.steps}, before "
                              f"the data owner's bye")
            if self.bye is not None:
                self._linger(self.bye)
        finally:
            self.closed = True
            told = False
            # Not after the bye, nor when the data owner was told already (nonfinite_step) or stopped itself.
            if notice is not None and self.bye is None and self.failure is None:
                told = self._notify(notice, unsent)
            self.server.close(NOTICE_LINGER_MS if told else LINGER_MS)
            if self.curve is not None:
                self.curve.stop()

    def _complete(self) -> bool:
        """Every step of a run is replied to here."""
        return bool(self.run_id) and self.step >= self.exp.steps and not self.next_mb

    def _notify(self, reason: str, unsent: list[list[bytes]]) -> bool:
        """Tell the data owner that this side stopped (``reason``), wherever it waits: the batch not replied
        to, the replies ``unsent``, where it was last heard from; at once (``protocol.notify_stopped``, the
        rule of every cut server): resending on a fresh socket meanwhile, which the notice cannot reach there,
        it gets it in reply to its next request (awaited while it is live, at most ``liveness_s``). Whether
        there was anyone to tell."""
        envelopes = [*unsent, self.peer_envelope]
        if self.batch is not None and not self.batch.replied:
            envelopes.append(self.batch.envelope)
        targets = list({tuple(e): e for e in envelopes if e}.values())
        if not targets:
            return False
        now = time.monotonic()
        live = {self.run_id} if self.joined and now - self.heard < self.bounds.liveness_s else set()
        told = notify_stopped(self.server, self.max_tensor, {self.run_id: targets}, live,
                              now + self.bounds.liveness_s,
                              lambda run: wire.abort_notice(run, self.side.stage, reason))
        self.log.warning("told the data owner of run %s that this side stopped: %s", self.run_id, reason)
        return told

    def _await_bye(self) -> None:
        """After the run's last step: serve the data owner (an evaluation, a step resent, a ping) until its
        bye, or until it is silent for ``liveness_s`` (at most ``liveness_s + peer_deadline_s`` in all)."""
        started = time.monotonic()
        latest = started + self.bounds.liveness_s + self.bounds.peer_deadline_s
        while time.monotonic() < min(latest, max(started, self.heard) + self.bounds.liveness_s):
            request = self.server.receive(POLL_TICK_S)
            if request is not None and self._answer(request, self._handle) is _BYE:
                self.done = True
                return
        self.log.warning("run %s: no bye from the data owner within liveness_s = %g s after the last step; closing "
                         "(every step is replied to here)", self.run_id, self.bounds.liveness_s)

    def _linger(self, bye: Message) -> None:
        """After the run's bye (``bye``: its reply): answer what is still arriving (a bye resent because its
        reply was lost, a ping; anything else is refused) until nothing has for ``POLL_TICK_S``, at most
        ``liveness_s``."""
        def ended(envelope: list[bytes], msg: Message, peer_key: str) -> Any:
            if msg.type == wire.PING or msg.type == wire.BYE and msg.run == bye.run:
                return self._handle(envelope, msg, peer_key)
            raise ProtocolError(ErrorCode.RUN, f"run {bye.run} ended with its bye; this label owner is "
                                               f"closing")

        self._answer_until_quiet(ended)

    def _answer_until_quiet(self, handle: Callable[[list[bytes], Message, str], Any]) -> None:
        """Answer what still arrives with ``handle`` (refusals get the protocol's error reply) until nothing has
        for ``POLL_TICK_S``, at most ``liveness_s``: one rule for every cut server's closing."""
        deadline = time.monotonic() + self.bounds.liveness_s
        while time.monotonic() < deadline:
            request = self.server.receive(POLL_TICK_S)
            if request is None:
                return
            self._answer(request, handle)

    def __enter__(self) -> "CutServer":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _traceback: object) -> None:
        if kind is None:
            self.close()
        else:
            self._close(f"its loop failed: {kind.__name__}: {error}")

    def _check_open(self) -> None:
        if self.closed:
            raise CutMisuse("this cut server is closed; bind a new one (CutServer.bind) to go on")


def _one_number(loss: Any, what: str) -> np.float32:
    """``loss`` as one float32 (a number, or an array or tensor of one element with no dimensions);
    ``CutMisuse`` naming ``what`` for anything else (a string, a loss per row: reduce it first)."""
    try:
        value = None if loss is None or isinstance(loss, (str, bytes)) else np.float32(loss)
    except (TypeError, ValueError, RuntimeError):      # RuntimeError: a torch tensor that requires grad
        value = None
    if value is None or np.ndim(value) != 0:
        raise CutMisuse(f"{what} must be one number (reduced over the rows as the interface's reduction says), "
                        f"got {type(loss).__name__} {getattr(loss, 'shape', '')}".rstrip() + torch_hint(loss))
    return np.float32(value)


def evaluation_scores(result: Any, count: int) -> dict[str, Any]:
    """The body of an evaluation reply from what the loop's ``evaluate`` returned for ``count`` held-out rows:
    ``(loss, correct)``, the loss one number and ``correct`` the rows right (a whole number from 0 to
    ``count``) or None. ``CutMisuse`` for anything else, here in the loop that returned it, rather than a
    malformed reply that the data owner would refuse."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise CutMisuse(f"evaluate must return (loss, correct): the held-out rows' loss and how many are right "
                        f"(None when the loss does not classify), got {wire.show(result)}")
    loss, correct = result
    if correct is not None and (not isinstance(correct, (int, np.integer)) or isinstance(correct, bool)
                                or not 0 <= correct <= count):
        raise CutMisuse(f"evaluate returned correct={wire.show(correct)}; give the number of rows right, from 0 to "
                        f"the {count} held-out rows, or None")
    return {"loss": float(_one_number(loss, "the loss evaluate returned")),
            "correct": None if correct is None else int(correct), "count": count}


def reply_state(m: Message) -> dict[str, Any]:
    """A cached reply as a saved state holds it (plain values and numpy arrays; ``saved_reply`` reads it)."""
    return {"step": m.step, "mb": m.mb, "mbs": m.mbs, "loss": m.body["loss"], "compute_s": m.body["compute_s"],
            "tensors": {n: np.array(t) for n, t in m.tensors.items()}}


def owned_copy(grad: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of a gradient the loop gave ``Batch.reply``: the reply keeps it (for a resend, a
    saved state) and may send it without a copy, while the loop may write its array again at once (one array
    reused for every gradient)."""
    return np.array(grad, order="C")


def saved_reply(r: Any, run: str, step: int, mbs: int, shape: tuple[int, ...], exp: Any) -> Message:
    """One reply of a saved state's ``replies`` (of run ``run``, steps 1..``step``, micro-batches of ``mbs``,
    a gradient of ``shape`` under ``exp``'s interface) as the message it was, checked as the data owner will
    check it when it is sent again (``ConfigError`` naming what is wrong)."""
    if not isinstance(r, Mapping) or set(r) != REPLY_KEYS:
        raise ConfigError(f"a reply of the state must hold exactly {sorted(REPLY_KEYS)}, got {wire.show(r)}")
    numbers = [r["loss"], r["compute_s"]]
    if not (is_whole(r["step"]) and 1 <= r["step"] <= step and r["mbs"] == mbs and is_whole(r["mb"])
            and 0 <= r["mb"] < mbs and isinstance(r["tensors"], Mapping)
            and all(isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) for v in numbers)):
        raise ConfigError(f"a reply of the state is not one of its steps 1..{step} (micro-batch of {mbs}) "
                          f"with a number loss and tensors: step {wire.show(r['step'])} mb "
                          f"{wire.show(r['mb'])}/{wire.show(r['mbs'])}")
    where = f"the state's reply to step {r['step']} micro-batch {r['mb']}"
    if not exp.allow_nonfinite and not np.isfinite(r["loss"]):
        raise ConfigError(f"{where} has loss {r['loss']!r}; this interface forbids NaN and Inf "
                          f"(allow_nonfinite), so it is not a reply this side saved")
    if not (np.isfinite(r["compute_s"]) and r["compute_s"] >= 0):
        raise ConfigError(f"{where} has compute_s {r['compute_s']!r}, not a number of seconds >= 0")
    reply = Message(wire.BACKWARD, run, r["step"], r["mb"], mbs,
                    body={"loss": float(r["loss"]), "compute_s": float(r["compute_s"])},
                    tensors={n: np.asarray(t) for n, t in r["tensors"].items()})
    grad = Expected(WireTensor(GRADIENT, shape, exp.codecs[GRADIENT]))
    try:       # decodes a copy, checked as the data owner checks the reply when it is sent again
        grad.receive(replace(reply, tensors=dict(reply.tensors)), allow_nonfinite=exp.allow_nonfinite)
    except (ProtocolError, ValueError, TypeError) as e:
        raise ConfigError(f"{where} is not a gradient of this interface: {e}") from e
    return reply
