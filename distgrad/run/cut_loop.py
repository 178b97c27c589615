"""What every label-owner end of the cut shares with a user's own loop: ``Batch`` and ``LoopServer``.

``run.cut_server.CutServer`` (one data owner) and ``run.cut_group.GroupServer``
(several) serve the same kind of loop under the same rules, written here once:
the socket (bounded polls, CURVE, size limits of the biggest message
expected), a request answered or refused with the protocol's error reply (the
last refusal kept for a timeout's message), the loop's turn (a batch out, its
one reply checked, then the next; the replies leave when the next batch is
asked for), when a ``state_dict`` may be taken, a step the loop fails
(``nonfinite_step`` to its data owners), and the end of a run: the replies
sent, the byes awaited after the last step, what still arrives answered, and
a data owner told why when this side stops first (``protocol.notify_stopped``).
What differs (where a batch comes from, who its data owners are, what a
checkpoint holds) is each subclass's, behind the hooks named below.
"""

from __future__ import annotations

import abc
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NoReturn, TypeVar

import numpy as np
import zmq

from distgrad.errors import ConfigError, CutMisuse, DistgradError, NonFiniteError, PeerAborted, ProtocolError
from distgrad.run.cut_interface import Bounds, CutSide, one_loop, torch_hint
from distgrad.run.protocol import decode_and_handle, notify_stopped, refused_text
from distgrad.stage.stage import ROWS_DTYPE, micro_shape
from distgrad.wire import messages as wire
from distgrad.wire.keys import CurveServer
from distgrad.wire.messages import ErrorCode, Message, frame_limit
from distgrad.wire.transport import LINGER_MS, NOTICE_LINGER_MS, POLL_TICK_S, Server
from distgrad.wire.wirecodec import ACTIVATION, Expected, TensorSpecs, WireTensor

REFUSED_TEXT_MAX = 300   # characters of the last refusal a PeerTimeout's message quotes

# The loop's scoring of the held-out rows: (their activations, their row numbers) -> (loss, rows right or None).
Evaluate = Callable[[np.ndarray, np.ndarray], tuple[Any, Any]]

# How a server handles one decoded request: (envelope, message, the sender's CURVE key) -> what the loop sees.
Handler = Callable[[list[bytes], Message, str], Any]

Served = TypeVar("Served", bound="LoopServer")


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
    server: "LoopServer" = field(repr=False)
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


class LoopServer(abc.ABC):
    """The rules every label-owner end of the cut keeps with its loop and its data owners (the module's
    docstring). A subclass serves one topology: it binds with ``_bind_socket`` and provides ``__next__``,
    ``_handle`` (one request), ``_reply`` (the loop's answer to a batch), ``_flush`` and ``_drop_unsent``
    (the replies not sent yet), and the end of a run's hooks (``_all_said_bye``, ``_byes_due``,
    ``_owing_bye_heard``, ``_no_bye_yet``, ``_ended_runs``, ``_closing_text``, ``_waiting_places``,
    ``_tell_stopped``)."""

    server: Server
    curve: CurveServer | None
    # The calls of the loop, each of which one thread at a time may be inside (``cut_interface.one_loop``): they
    # are guarded wherever a subclass defines them.
    ONE_LOOP_CALLS = ("__next__", "_reply", "state_dict", "load_state_dict", "_close")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in LoopServer.ONE_LOOP_CALLS:
            if name in cls.__dict__:
                setattr(cls, name, one_loop(cls.__dict__[name]))
    endpoint: str
    max_frame: int
    max_tensor: int

    def __init__(self, side: CutSide, bounds: Bounds, evaluate: Evaluate | None) -> None:
        self.side, self.exp, self.bounds = side, side.exp, bounds
        self.log = logging.getLogger(f"distgrad.{side.stage}")
        self.mbs = side.micro_batches
        self.step = 0                    # steps applied
        self.next_mb = 0                 # micro-batches of the step in progress replied to
        self.batch: Batch | None = None  # the one given out and not yet replied to
        self.done, self.closed = False, False
        self.failure: DistgradError | None = None   # raised again by every later ``__next__``
        self.refused = ""                # the last message refused, for a timeout's message
        self.evaluate = evaluate                            # the loop's scoring
        self.test_rows = self._test_rows() if evaluate is not None else None
        self.silence_checked = -math.inf  # when ``_receive`` last checked the data owners' silence (monotonic)

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

    @property
    def scale(self) -> np.float32:
        """The float32 factor on the sum of a step's micro-batch gradients, as the daemons apply it (1 for
        one micro-batch or a ``sum`` reduction, 1/M for ``mean``)."""
        return self.side.scale(self.mbs)

    # -- the loop's turn
    def __iter__(self) -> Iterator[Batch]:
        return self

    @abc.abstractmethod
    def __next__(self) -> Batch:
        """The loop's next batch (``_next_batch_asked`` first), serving messages until one is ready."""

    def _next_batch_asked(self) -> None:
        """The loop asks for its next batch, one rule for every cut server: ``CutMisuse`` unless the server is
        open and the batch given out last has its reply; then the replies the loop made since leave."""
        self._check_open()
        if self.batch is not None and not self.batch.replied:
            raise CutMisuse(f"the loop asked for the next batch without replying to step {self.batch.step} "
                            f"micro-batch {self.batch.mb}/{self.batch.mbs}: call batch.reply first, in every iteration")
        self.batch = None
        self._flush()

    def _receive(self, started: float) -> tuple[list[bytes], list[Any], str] | None:
        """The next request, waiting a tick at most (None if none came). The silence of the data owners this
        side waits for is checked at least once a tick (``_check_silence``, ``started``: when this wait began)
        whether a request came or not: a peer that keeps sending (pings, refused messages, another run's)
        cannot hold off the ``PeerTimeout`` of a data owner that went silent."""
        request = self.server.receive(POLL_TICK_S)
        now = time.monotonic()
        if request is None or now - self.silence_checked >= POLL_TICK_S:
            self.silence_checked = now
            self._check_silence(started)
        return request

    @abc.abstractmethod
    def _check_silence(self, started: float) -> None:
        """``PeerTimeout`` naming the data owners this side waits for that have been silent for
        ``liveness_s + peer_deadline_s`` (counted from ``started`` at the earliest where the subclass says so)."""

    @abc.abstractmethod
    def _reply(self, batch: Batch, loss: Any, grad: Any) -> None:
        """The loop's reply to ``batch`` (``_checked`` first), kept to leave at the next ``_flush``."""

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
        value = one_number(loss, f"the loss of step {batch.step}")
        if not self.exp.allow_nonfinite and not (np.isfinite(value) and wire.all_finite(grad)):
            what = "loss" if not np.isfinite(value) else "activation_grad"
            return value, (f"stage {self.side.stage}: non-finite {what} at step {batch.step}; nothing of this "
                           f"step was applied")
        return value, None

    def _fail_step(self, batch: Batch, text: str, places: Iterable[tuple[str, list[bytes]]]) -> NoReturn:
        """The loop's step failed: the data owners of ``places`` (their run, where they wait) are told
        (``nonfinite_step``), the loop gets the error now and at every later ``__next__``."""
        batch.replied = True
        self.failure = NonFiniteError(text)
        for run, envelope in places:
            self.server.reply(envelope, wire.error_message(run, batch.step, ErrorCode.NONFINITE_STEP, text,
                                                           batch.mb, batch.mbs))
        raise self.failure

    @abc.abstractmethod
    def _flush(self) -> None:
        """Send the replies the loop made since the last batch was asked for."""

    @abc.abstractmethod
    def _drop_unsent(self) -> None:
        """Forget the replies not sent yet (the loop failed, maybe before saving them)."""

    # -- the messages
    @abc.abstractmethod
    def _handle(self, envelope: list[bytes], msg: Message, peer_key: str) -> Any:
        """The replies to ``msg`` from ``envelope`` (authenticated as ``peer_key``); raises ``ProtocolError`` to
        refuse it."""

    def _serve(self, request: tuple[list[bytes], list[Any], str]) -> None:
        """Answer one ``request`` received while the byes are awaited (``_await_byes``)."""
        self._answer(request, self._handle)

    def _answer(self, request: tuple[list[bytes], list[Any], str], handle: Handler) -> Any:
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

    def _peer_stopped(self, text: str) -> NoReturn:
        """A data owner said it stopped (``text``): ``PeerAborted`` for the loop, now and at every later
        ``__next__``."""
        self.failure = PeerAborted(text)
        self.log.warning("%s", self.failure)
        raise self.failure

    def _forward_expected(self, shape: tuple[int, ...], mbs: int, rows: bool) -> Expected:
        """What a forward of a data owner whose activation is ``shape`` for a whole batch carries in one of
        ``mbs`` micro-batches (with ``rows``: its row numbers too), or with ``with_rows`` an evaluation."""
        micro = micro_shape(shape, mbs)
        others: TensorSpecs = {"rows": ((micro[0],), ROWS_DTYPE)} if rows else {}
        return Expected(WireTensor(ACTIVATION, micro, self.exp.codecs[ACTIVATION]), others)

    # -- the held-out rows
    def _test_rows(self) -> np.ndarray:
        """The held-out rows of this party's ``[data]`` (``ConfigError`` when it has none)."""
        rows = getattr(self.side.data, "test_rows", None)
        if rows is None or not len(rows):
            raise ConfigError(f"evaluate= scores the held-out rows of stage {self.side.stage!r}'s [data], which "
                              f"holds none out: give its [data] a test_fraction > 0, as the data owner's")
        return np.asarray(rows, np.int64)

    def _scored_rows(self, whose: str) -> tuple[Evaluate, np.ndarray]:
        """The loop's ``evaluate`` and the held-out rows it scores; ``ProtocolError`` (code ``type``) for an
        evaluation when the loop scores none, telling ``whose`` [data] to hold none out."""
        if self.evaluate is None or self.test_rows is None:
            raise ProtocolError(ErrorCode.TYPE, f"experiment {self.exp.name!r}: this label owner's own loop "
                                                f"scores no held-out rows (it gave CutServer.bind no evaluate=); "
                                                f"give {whose} [data] test_fraction = 0")
        return self.evaluate, self.test_rows

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

    # -- the end
    def close(self) -> None:
        """Send the replies not sent yet, then close the socket (and CURVE's authenticator). After the
        run's last step, before the data owner's bye, the data owner is served first until its bye (an
        evaluation, a resent step, the bye), for at most ``liveness_s`` of its silence. Closed mid-run
        (before the last step, with no bye), the data owner is told (an ``aborted`` notice), so its
        ``cut.step`` raises ``PeerAborted`` at once. Raises ``PeerAborted`` when the data owner stops
        while it is served here."""
        self._close(None)

    @one_loop
    def _close(self, failure: str | None) -> None:
        """Close as ``close`` does; ``failure``: why this side's loop failed, told to the data owners
        instead of the replies not sent yet (the loop may have failed before saving them: a data owner
        sends that step again to the loop resumed from its checkpoint)."""
        if self.closed:
            return
        notice, waiting = failure, self._waiting_places()
        try:
            if failure is not None:
                self._drop_unsent()
            else:
                self._flush()
                if not self._all_said_bye() and self._byes_due():
                    self._await_byes()
                elif not self._all_said_bye():
                    notice = (f"its loop closed the CutServer after step {self.step} of {self.exp.steps}, before "
                              f"{self._whose_bye}")
            ended = self._ended_runs()
            if ended:
                self._linger(ended)
        finally:
            self.closed = True
            told = self._tell_stopped(notice, waiting) if notice is not None else False
            self.server.close(NOTICE_LINGER_MS if told else LINGER_MS)
            if self.curve is not None:
                self.curve.stop()

    _whose_bye = "the data owner's bye"     # what a run closed mid-run still waited for, in its notice

    @abc.abstractmethod
    def _all_said_bye(self) -> bool:
        """Whether every data owner of the run has said bye."""

    @abc.abstractmethod
    def _byes_due(self) -> bool:
        """Whether the byes not said yet are awaited at the close (every step is replied to)."""

    @abc.abstractmethod
    def _owing_bye_heard(self) -> float:
        """When the data owners that have not said bye were last heard (``time.monotonic``)."""

    @abc.abstractmethod
    def _no_bye_yet(self) -> str:
        """The start of the warning that the byes did not come: who did not say it."""

    @abc.abstractmethod
    def _ended_runs(self) -> set[str]:
        """The runs that ended here with their bye."""

    @abc.abstractmethod
    def _closing_text(self) -> str:
        """Why a request other than a ping or a bye resent is refused after the byes."""

    @abc.abstractmethod
    def _waiting_places(self) -> dict[str, list[list[bytes]]]:
        """Where the data owners that may still wait for this side wait (each one's run: its envelopes), as
        the close begins, before the replies not sent yet leave or are dropped."""

    @abc.abstractmethod
    def _tell_stopped(self, reason: str, places: dict[str, list[list[bytes]]]) -> bool:
        """Tell the data owners waiting at ``places`` (``_waiting_places``) that this side stopped
        (``reason``); whether anyone was told."""

    def _await_byes(self) -> None:
        """After the run's last step: serve the data owners (an evaluation, a step resent, a ping) until each
        said bye, or until those that have not are silent for ``liveness_s`` (at most ``liveness_s +
        peer_deadline_s`` in all)."""
        started = time.monotonic()
        latest = started + self.bounds.liveness_s + self.bounds.peer_deadline_s
        while not self._all_said_bye():
            if time.monotonic() >= min(latest, max(started, self._owing_bye_heard()) + self.bounds.liveness_s):
                self.log.warning("%s within liveness_s = %g s after the last step; closing (every step is replied "
                                 "to here)", self._no_bye_yet(), self.bounds.liveness_s)
                return
            request = self.server.receive(POLL_TICK_S)
            if request is not None:
                self._serve(request)
        self.done = True

    def _linger(self, ended: set[str]) -> None:
        """After the byes of the runs ``ended``: answer what is still arriving (a bye resent because its reply
        was lost, a ping; anything else is refused) until nothing has for ``POLL_TICK_S``, at most
        ``liveness_s``."""
        def after_bye(envelope: list[bytes], msg: Message, peer_key: str) -> Any:
            if msg.type == wire.PING or msg.type == wire.BYE and msg.run in ended:
                return self._handle(envelope, msg, peer_key)
            raise ProtocolError(ErrorCode.RUN, self._closing_text())

        deadline = time.monotonic() + self.bounds.liveness_s
        while time.monotonic() < deadline:
            request = self.server.receive(POLL_TICK_S)
            if request is None:
                return
            self._answer(request, after_bye)

    def _send_stop_notice(self, places: Mapping[str, list[list[bytes]]], live: set[str], reason: str) -> bool:
        """Tell the data owner of each run of ``places`` that this side stopped (``reason``), at each envelope
        it may wait at, at once (``protocol.notify_stopped``, the rule of every cut server): one that resends
        on a fresh socket meanwhile, which the notice cannot reach there, gets it in reply to its next request
        (awaited for the ``live`` runs, at most ``liveness_s``). Whether anyone was told."""
        return notify_stopped(self.server, self.max_tensor, places, live, time.monotonic() + self.bounds.liveness_s,
                              lambda run: wire.abort_notice(run, self.side.stage, reason))

    def __enter__(self: Served) -> Served:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _traceback: object) -> None:
        if kind is None:
            self.close()
        else:
            self._close(f"its loop failed: {kind.__name__}: {error}")

    def _check_open(self) -> None:
        if self.closed:
            raise CutMisuse("this cut server is closed; bind a new one (CutServer.bind) to go on")


def one_number(loss: Any, what: str) -> np.float32:
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
    return {"loss": float(one_number(loss, "the loss evaluate returned")),
            "correct": None if correct is None else int(correct), "count": count}


def owned_copy(grad: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of a gradient the loop gave ``Batch.reply``: the reply keeps it (for a resend, a
    saved state) and may send it without a copy, while the loop may write its array again at once (one array
    reused for every gradient)."""
    return np.array(grad, order="C")

