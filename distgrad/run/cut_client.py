"""The data owner's end of the cut as a library: ``Cut``, for a training loop that is the caller's own.

``Cut.step(h)`` sends one step's activation down to the label owner (a
``distgrad-stage`` daemon or a ``CutServer``) and returns its loss and the
gradient of that loss with respect to ``h``; the caller back-propagates it and
steps its own optimiser. Everything on the wire is the daemons' (protocol
version 5): the hello through ``run.handshake``, the requests, bounded waits
and retries through ``wire.link.DownstreamLink`` (a request unanswered for
``timeout_s`` is resent on a fresh socket until ``peer_deadline_s``, then
``PeerTimeout``; the label owner answers a resent step from its cache), the
codecs through ``wire.wirecodec.Senders``, and the rules it shares with the
driver (when an evaluation is due, when a refusal calls for a new handshake)
through ``run.protocol``. What the loop hands it (an activation, its micro-batches, a step's rows, held-out
activations) is checked before anything is sent, in ``run.cut_inputs``. docs/cut.md is the contract.

Steps are the caller's: ``step`` counts the steps this side has applied, and
a loop resuming from its own checkpoint says where it stands
(``load_state_dict`` of what ``state_dict`` gave when the checkpoint was
written, or ``Cut.connect(..., step=k, run=RUN_ID)``). The hello offers only
that step (``held = [step]``): the label owner resumes there, or answers a
step it already computed from its cache, or refuses naming both steps.

A loop that stops before the run's end (an exception leaving the ``with``
block, or ``close(finished=False)`` mid-run) tells the label owner why with
the protocol's ``aborted`` notice (``wire.abort_notice``, as ``distgrad
predict`` does), so its loop stops at once with ``PeerAborted``; the label
owner's notice reaches this side the same way.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import zmq

from distgrad.errors import (CodecRangeError, ConfigError, CutMisuse, NonFiniteError, PeerAborted, PeerRejected,
                             PeerTimeout, ProtocolError)
from distgrad.run import handshake
from distgrad.run.protocol import evaluation_due, forward_message, shake_hands_again
from distgrad.run.cut_inputs import (check_held_out, check_micro_batches, check_order_rows, checked_activation,
                                    finite_activation, sent_rows)
from distgrad.run.cut_interface import (FIRST, STATE_KEYS, STATE_VERSION, Bounds, CutSide, check_residuals,
                                       check_run, check_state, check_step, cut_side, one_loop)
from distgrad.stage.engine import combine_losses
from distgrad.stage.stage import micro_batch
from distgrad.wire import messages as wire
from distgrad.wire.keys import CurveClient
from distgrad.wire.link import DownstreamLink, LinkSettings, check_evaluation, check_reply
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.transport import NOTICE_LINGER_MS
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, Expected, Senders, WireTensor, stream_name



class Cut:
    """A connection from the data owner's own loop to the label owner serving at ``endpoint``.

    Build it with ``Cut.connect``. The handshake happens at the first
    ``step`` (so ``load_state_dict`` may come first). One loop drives it: a
    call from a second thread while one is inside is ``CutMisuse`` (``cut_interface.one_loop``).
    """

    def __init__(self, side: CutSide, endpoint: str, *, step: int = 0, run: str | None = None,
                 bounds: Bounds = Bounds(), curve_secret: str | Path | None = None,
                 server_key: str | Path | None = None, ctx: zmq.Context | None = None) -> None:
        if (curve_secret is None) != (server_key is None):
            raise ConfigError("CURVE needs curve_secret and server_key together (the --curve-secret and "
                              "--server-key of a daemon)")
        self.side, self.exp, self.endpoint = side, side.exp, endpoint
        self.log = logging.getLogger(f"distgrad.{side.stage}")
        self.applied = check_step(step, self.exp.steps)     # the steps this loop has applied
        if step and run is None:
            raise ConfigError(f"step={step} resumes a run: give its run id too (run=, the cut's run_id when it "
                              f"was saved), or resume from a state_dict, which holds both")
        self.run_id = uuid.uuid4().hex if run is None else check_run(run)
        self.senders = Senders(self.exp.codecs)
        self.mbs = side.micro_batches
        security = (CurveClient(Path(curve_secret), Path(server_key))
                    if curve_secret is not None and server_key is not None else None)
        self.reply_specs = Expected(WireTensor(GRADIENT, side.micro_shape(self.mbs), self.exp.codecs[GRADIENT]))
        self.link = DownstreamLink(LinkSettings(side.stage, bounds.timeout_s, bounds.liveness_s,
                                                bounds.peer_deadline_s, relays=self.exp.relays_below(side.stage)),
                                   endpoint, lambda: None,
                                   ctx or zmq.Context.instance(), security, self.reply_specs)
        self.joined = False         # shook hands at ``step``
        self.closed = False
        self.stopped = False        # the label owner's last evaluation said stop (early stopping)
        self.refused = False        # the label owner refused this side's last hello: it is not this run's peer
        self.peer_stopped = False   # the label owner said it stopped (an aborted notice)
        self.below = self.exp.downstream(side.stage)
        self.evaluated: tuple[str, int, bytes] | None = None   # run, step and digest of the last evaluation sent

    @classmethod
    def connect(cls, endpoint: str, interface: str | Path | Mapping[str, Any] | None = None, *, step: int = 0,
                run: str | None = None, state: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                liveness_s: float | None = None, peer_deadline_s: float | None = None,
                curve_secret: str | Path | None = None, server_key: str | Path | None = None,
                ctx: zmq.Context | None = None, party: int | str | None = None, client: int | None = None,
                **fields: Any) -> "Cut":
        """A ``Cut`` to the label owner at ``endpoint`` for ``interface`` (this party's stage file, or its
        fields as keyword arguments: ``run.cut_interface.cut_side``), standing at ``step`` (the steps this
        loop has applied) of run ``run`` (its ``run_id``; needed with a ``step`` > 0), or at the ``state`` a
        ``state_dict`` gave (not both). ``party``: which feature party of a vertical interface this loop is (its
        index or stage name; a party's stage file names it already); ``client``: which data owner of an
        interface with ``[clients]`` (0 to count - 1; its shard of the rows). ``timeout_s``, ``liveness_s`` and
        ``peer_deadline_s`` bound the waits as the daemons' flags do; ``curve_secret`` and ``server_key``
        are CURVE's key files. Raises ``ConfigError`` for a bad interface or setting."""
        given = {k: v for k, v in (("timeout_s", timeout_s), ("liveness_s", liveness_s),
                                   ("peer_deadline_s", peer_deadline_s)) if v is not None}
        if state is not None and (step or run is not None):
            raise ConfigError(f"give the cut's state= (which holds its step and run) or step= and run=, not both "
                              f"(got state= with step={step!r}, run={wire.show(run)})")
        cut = cls(cut_side(FIRST, interface, fields, party, client), endpoint, step=step, run=run, bounds=Bounds(**given),
                  curve_secret=curve_secret, server_key=server_key, ctx=ctx)
        if state is not None:
            try:
                cut.load_state_dict(state)
            except Exception:
                cut.closed = True           # nothing was sent: nobody to tell
                cut.link.close(linger_ms=0)
                raise
        return cut

    # -- the steps
    def rows(self, step: int | None = None) -> np.ndarray:
        """The row numbers of ``step`` (default: the next) in the interface's shared sample order."""
        return self.side.rows(self.applied + 1 if step is None else step)

    @property
    def scale(self) -> np.float32:
        """The float32 factor the daemons put on the sum of a step's micro-batch gradients (1 for one
        micro-batch or a ``sum`` reduction, 1/M for ``mean``): see ``step_micro_batches``."""
        return self.side.scale(self.mbs)

    def step_micro_batches(self, hs: list[np.ndarray], rows: Any = None, step: int | None = None
                           ) -> tuple[np.float32 | None, list[np.ndarray]]:
        """``step`` with ``h`` as its M micro-batches (``hs``: M float32 arrays, each a micro-batch's
        activation, computed from it alone, as a daemon computes them): returns the step's loss and each
        micro-batch's own gradient d(loss_i)/d(h_i), unscaled. A loop that back-propagates them in order,
        adding up its parameter gradients, and multiplies the sum by ``scale`` before stepping computes
        bit for bit what a daemon data owner does with ``--micro-batches M`` (``step`` returns the
        combined gradient, which back-propagated at once is equal only to float32 rounding)."""
        check_micro_batches(hs, self.mbs, self.side.micro_shape(self.mbs))
        losses, grads = self._step(np.concatenate(hs), rows, step)
        return _step_loss(losses, self.scale), [np.array(g, np.float32) for g in grads]

    def step(self, h: np.ndarray, rows: Any = None, step: int | None = None
             ) -> tuple[np.float32 | None, np.ndarray]:
        """One step: send ``h`` (float32, the interface's activation shape for a whole batch), wait for the
        label owner's replies and return ``(loss, dh)``: the step's loss and d(loss)/d(h), float32, the
        same shape as ``h``. ``rows``: the row numbers ``h`` was computed from, one per row; with the
        interface's ``send_rows`` they are sent (any order, e.g. a loader's own shuffle; required, checked
        by ``_sent_rows`` here and refused by the label owner naming a row it may not train on), else
        optional and checked against the shared order. ``step`` (optional) must be the next step. With M
        micro-batches, ``h`` is sent as M of them; the loss and ``dh`` are the daemons' (their sums times
        the micro-batch scale; ``step_micro_batches`` gives each micro-batch's own). The loss is None when
        the label owner withholds it (its replies carry none: a guarantee of its, ``dp_sgd`` with
        ``clip_noise``, covers everything it sends, and the training loss is computed from the true labels).

        Raises ``CutMisuse`` for a wrong shape, dtype, rows or step, a closed cut, or a run the label owner's
        early stopping ended (``stopped``); ``PeerTimeout`` when the label owner stays silent past
        ``peer_deadline_s``; ``PeerRejected`` when it refuses;
        ``NonFiniteError`` for a NaN or Inf in ``h`` (nothing sent) or in its reply (unless the interface allows
        them).
        """
        losses, grads = self._step(h, rows, step)
        if len(grads) == 1:
            return losses[0], np.array(grads[0], np.float32)
        return _step_loss(losses, self.scale), np.concatenate(grads) * self.scale

    @one_loop
    def _step(self, h: np.ndarray, rows: Any, step: int | None
              ) -> tuple[list[np.float32 | None], list[np.ndarray]]:
        """Step ``applied + 1`` of the whole batch ``h``: its micro-batches' losses and gradients."""
        self._check_open()
        k = self.applied + 1
        if step is not None and step != k:
            raise CutMisuse(f"step {step} given, but this cut has applied {self.applied} steps, so the next is {k}; "
                            f"steps go one by one (to resume from a checkpoint, Cut.connect(..., step=STEP) or "
                            f"load_state_dict)")
        if k > self.exp.steps:
            raise CutMisuse(f"all {self.exp.steps} steps of the interface are done; call close()")
        if self.stopped:
            raise CutMisuse(f"the label owner's early stopping ended the run after step {self.applied} (its last "
                            f"evaluation said stop, cut.stopped): end the loop and call close(), which ends the run "
                            f"on both sides at that step")
        h = finite_activation(checked_activation(h, self.side.shape), self.exp.allow_nonfinite, self.side.stage,
                              f"step {k}")
        sent = sent_rows(rows, len(h), k) if self.exp.send_rows else None
        if sent is None and rows is not None:
            check_order_rows(rows, self.side.rows(k), len(h), k)
        losses, grads = self._joined(lambda: self._exchange(k, h, sent))
        self.senders.commit()
        self.applied = k
        return losses, grads

    def _joined(self, request: Callable[[], Any]) -> Any:
        """``request()`` after the handshake; once more after a new handshake when the label owner lost this
        run or step (it restarted)."""
        for attempt in (0, 1):
            try:
                if not self.joined:
                    self._handshake()
                return request()
            except PeerRejected as e:
                if e.code == ErrorCode.ABORTED:
                    raise self._aborted(e) from e
                if attempt or self.refused or not shake_hands_again(e):
                    raise
                # The label owner restarted or lost this run: shake hands again, then send the request again.
                self.log.warning("%s; shaking hands again", e.peer_message)
                self.joined = False

    # -- held-out rows
    @property
    def test_rows(self) -> np.ndarray:
        """The held-out row numbers of this party's ``[data]`` (``test_fraction``), in the order
        ``evaluate`` takes their activations (``ConfigError`` without ``[data]``)."""
        if self.side.data is None:
            raise ConfigError(f"stage {self.side.stage!r} has no [data], so its held-out rows are unknown here")
        return np.asarray(self.side.data.test_rows, np.int64)

    @property
    def evaluation_due(self) -> bool:
        """Whether the interface's ``eval_every`` asks for an evaluation after the steps applied: after every
        ``eval_every``-th step and the last, as the daemons evaluate (False while none is applied, and with
        ``eval_every = 0`` but after the last step)."""
        return evaluation_due(self.applied, self.exp.steps, self.exp.eval_every)

    @one_loop
    def evaluate(self, h: np.ndarray) -> dict[str, Any]:
        """Score the held-out rows with the label owner as it stands after the steps applied: send ``h``,
        their activations (float32, one row per held-out row of ``test_rows`` in that order, each of the
        interface's activation row shape), as the protocol's ``evaluate``, and return its reply:
        ``loss``, ``correct`` (rows right, None when the loss does not classify), ``count`` (rows
        scored) and, when the label owner gives them, ``metrics``, ``best`` and ``stop`` (a daemon's
        ``keep_best`` and ``early_stopping`` verdicts; after ``stop``, end the loop: ``close()`` then
        ends the run). Changes nothing on either side but the verdicts. Once per step: the same ``h`` again
        gets the same reply (the label owner's, kept), other activations at the same step are ``CutMisuse``.

        Raises ``CutMisuse`` for a wrong dtype or shape, ``PeerRejected`` when the label owner refuses
        (it holds no rows out, or another count), ``PeerTimeout`` as ``step`` does."""
        self._check_open()
        check_held_out(h, self.side)
        k = self.applied + 1
        h = finite_activation(np.ascontiguousarray(h), self.exp.allow_nonfinite, self.side.stage,
                              f"the evaluation after step {self.applied}")
        digest = hashlib.sha256(h.tobytes()).digest()
        if self.evaluated is not None and self.evaluated[:2] == (self.run_id, k) and self.evaluated[2] != digest:
            raise CutMisuse(f"the held-out rows were scored after step {self.applied} already, from other "
                            f"activations: the label owner answers a repeated evaluation at one step with its first "
                            f"scores (as a resent request), so these would not be scored. Evaluate once per step, "
                            f"with the model as it stands (e.g. model.eval() and torch.no_grad() for h)")
        try:
            tensors = self.senders.evaluation_tensors(h, k)
        except CodecRangeError as e:
            raise NonFiniteError(f"stage {self.side.stage}: {e}; the evaluation was not sent") from e
        self.evaluated = (self.run_id, k, digest)
        result = self._joined(lambda: check_evaluation(
            self.link.exchange(Message(wire.EVALUATE, self.run_id, k, tensors=tensors))))
        self.stopped = bool(result.get("stop"))
        return result

    def _exchange(self, k: int, h: np.ndarray, rows: np.ndarray | None
                  ) -> tuple[list[np.float32 | None], list[np.ndarray]]:
        """Send step ``k``'s micro-batches (all at once; with ``rows``, each with its row numbers) and
        collect their replies in order."""
        count = self.mbs
        pending: dict[tuple[int, int], Message] = {}
        self.link.arrived.clear()
        self.senders.discard()              # a step sent again is coded from the same residuals
        for i in range(count):
            try:
                msg = forward_message(self.senders, self.run_id, k, i, count, micro_batch(h, i, count),
                                      stream_name(ACTIVATION, i, count),
                                      rows=None if rows is None else micro_batch(rows, i, count))
            except CodecRangeError as e:
                raise NonFiniteError(f"stage {self.side.stage}: {e}; nothing of step {k} was sent") from e
            pending[(k, i)] = msg
            self.link.send(msg)
        losses: list[np.float32 | None] = []
        grads = []
        for i in range(count):
            reply = self.link.await_reply(pending, (k, i))
            loss, dy = check_reply(reply, k, self.reply_specs, self.exp.allow_nonfinite, self.below)
            losses.append(loss)
            grads.append(dy)
        return losses, grads

    def _announced_evaluations(self) -> int:
        """The ``eval_every`` this data owner's hello announces: the interface's when it holds rows out and is
        the one data owner (a daemon label owner then tells what its verdicts can act on, as for a daemon data
        owner's hello); else 0, since with several a daemon would wait for each announced evaluation at the end of
        its round, which this loop makes only when it calls ``evaluate``."""
        one = not (self.exp.federated or self.exp.vertical)
        holds_out = self.side.data is not None and len(self.side.data.test_rows) > 0
        return self.exp.eval_every if one and holds_out else 0

    def _handshake(self) -> None:
        """Hello at ``step``; the label owner must take this run up there."""
        hello = handshake.hello(self.exp, self.side.stage, self.exp.seed, self.side.shape, self.run_id, [self.applied],
                                self.exp.steps, self.mbs, self.side.client, self._announced_evaluations())
        try:
            self.link.handshake(hello)
        except PeerRejected as e:
            self.refused = e.code != ErrorCode.ABORTED
            raise
        except ProtocolError as e:
            self.refused = True
            if e.code != ErrorCode.RUN:
                raise
            raise ProtocolError(ErrorCode.RUN, f"the label owner did not take run {self.run_id} up at step "
                                               f"{self.applied}, where this side stands ({e}); resume both sides "
                                               f"from checkpoints of the same step") from e
        self.joined, self.refused = True, False

    def _aborted(self, e: PeerRejected) -> PeerAborted:
        """The label owner's ``aborted`` notice (``e``) as the error this side raises."""
        self.peer_stopped = True
        return PeerAborted(f"{e.peer_message} (the label owner of run {self.run_id}; this side has applied "
                           f"{self.applied} steps)")

    # -- checkpoints
    @one_loop
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of this loop must hold to resume the cut: a small dict of plain values and
        float32 arrays (the codec's error-feedback residuals, with ``topk:K+ef``). Save it with the
        model and optimiser after each step; no pickle is needed."""
        return {"version": STATE_VERSION, "interface": self.exp.interface_fingerprint, "run": self.run_id,
                "step": self.applied, "residuals": self.senders.state_arrays()}

    @one_loop
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Stand where ``state`` (a ``state_dict``) says; the next step shakes hands there."""
        self._check_open()
        self.applied = check_state(state, self.exp, STATE_KEYS, "Cut")
        check_residuals(state["residuals"], self.side, ACTIVATION, self.mbs)
        self.run_id = state["run"]
        self.senders.load_state_arrays(state["residuals"])
        self.joined = False

    # -- the end
    def close(self, finished: bool | None = None) -> None:
        """Close the connection. ``finished`` (default: every step of the interface is done, or the last
        ``evaluate`` said stop) says bye first, so the label owner ends the run; a loop stopping early for
        good passes True. Closed before the run's end without a bye (``finished=False``), the cut tells the
        label owner so (an ``aborted`` notice): its loop raises ``PeerAborted`` at once, and both sides
        resume later from checkpoints of the same step. After the last step, a bye the label owner leaves
        unanswered (it left after replying to every step) is logged, not raised: the run is complete on
        both sides. Raises ``PeerTimeout`` or ``PeerRejected`` (``PeerAborted``) for a bye before the last
        step that is not answered or refused; a refused one (a feature party may not leave early) tells the
        label owner that this side stopped, as ``finished=False`` does."""
        self._close(finished, None)

    @one_loop
    def _close(self, finished: bool | None, failure: str | None) -> None:
        """Close, saying bye when ``finished`` (as ``close``); ``failure``: why this side's loop failed, sent
        to the label owner instead (no bye)."""
        if self.closed:
            return
        notice = failure
        try:
            complete = self.applied >= self.exp.steps or self.stopped
            if failure is None and (complete if finished is None else finished):
                try:
                    self._bye()
                except PeerRejected as e:
                    # A bye refused before the run's end (a feature party may not leave early): the label owner
                    # would wait for this side's next step, so it is told that this side stopped.
                    if not complete:
                        notice = (f"its loop closed the cut after step {self.applied} of {self.exp.steps} and "
                                  f"its bye was refused ({e.peer_message})")
                    raise
            elif failure is None and not complete:
                notice = (f"its loop closed the cut after step {self.applied} of {self.exp.steps}, before the run's "
                          f"end (close(finished=False))")
        finally:
            self.closed = True
            # Not to a label owner that stopped itself or refused this side's hello (another run is its).
            told = notice is not None and not self.peer_stopped and not self.refused
            if told and notice is not None:
                self.link.send(wire.abort_notice(self.run_id, self.side.stage, notice))
            self.link.close(linger_ms=NOTICE_LINGER_MS if told else 0)

    def _bye(self) -> None:
        """The run's bye, answered by the label owner, which then ends its loop."""
        bye = Message(wire.BYE, self.run_id, self.applied + 1, body={"steps": self.applied})
        try:
            if not self.joined:
                self._handshake()
            self.link.exchange(bye)
        except PeerRejected as e:
            if e.code == ErrorCode.ABORTED:
                raise self._aborted(e) from e
            raise
        except PeerTimeout as e:
            if self.applied < self.exp.steps:
                raise
            # Its reply to the last step came, and it replies only once its loop applied the step.
            self.log.warning("the label owner did not answer the bye (%s); every step was applied on both sides, "
                             "so the run is complete", e)

    def __enter__(self) -> "Cut":
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, _traceback: object) -> None:
        if kind is None:
            self.close()
        else:   # no bye (the loop may resume from its checkpoint), but the label owner is told why
            self._close(False, f"its loop failed: {kind.__name__}: {error}")

    def _check_open(self) -> None:
        if self.closed:
            raise CutMisuse("this cut is closed; connect a new one (Cut.connect) to go on")


def _step_loss(losses: list[np.float32 | None], scale: np.float32) -> np.float32 | None:
    """A step's loss from its micro-batches' (``combine_losses``); None when the label owner withheld them."""
    if any(loss is None for loss in losses):
        return None
    return combine_losses([loss for loss in losses if loss is not None], scale)
