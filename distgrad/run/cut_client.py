"""The data owner's end of the cut as a library: ``Cut``, for a training loop that is the caller's own.

``Cut.step(h)`` sends one step's activation down to the label owner (a
``distgrad-stage`` daemon or a ``CutServer``) and returns its loss and the
gradient of that loss with respect to ``h``; the caller back-propagates it and
steps its own optimiser. Everything on the wire is the daemons' (protocol
version 5): the hello through ``run.handshake``, the requests, bounded waits
and retries through ``wire.link.DownstreamLink`` (a request unanswered for
``timeout_s`` is resent on a fresh socket until ``peer_deadline_s``, then
``PeerTimeout``; the label owner answers a resent step from its cache), the
codecs through ``wire.wirecodec.Senders``. docs/cut.md is the contract.

Steps are the caller's: ``step`` counts the steps this side has applied, and
a loop resuming from its own checkpoint says where it stands
(``load_state_dict`` of what ``state_dict`` gave when the checkpoint was
written, or ``Cut.connect(..., step=k, run=RUN_ID)``). The hello offers only
that step (``held = [step]``): the label owner resumes there, or answers a
step it already computed from its cache, or refuses naming both steps.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import zmq

from distgrad.errors import CodecRangeError, ConfigError, CutMisuse, NonFiniteError, PeerRejected, ProtocolError
from distgrad.run import handshake
from distgrad.run.cut_interface import FIRST, Bounds, CutSide, cut_side
from distgrad.stage.engine import combine_losses
from distgrad.wire import messages as wire
from distgrad.wire.keys import CurveClient
from distgrad.wire.link import DownstreamLink, LinkSettings, check_reply
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, Expected, Senders, WireTensor, stream_name

STATE_VERSION = 1


class Cut:
    """A connection from the data owner's own loop to the label owner serving at ``endpoint``.

    Build it with ``Cut.connect``. The handshake happens at the first
    ``step`` (so ``load_state_dict`` may come first). Not thread-safe: one
    loop drives it.
    """

    def __init__(self, side: CutSide, endpoint: str, *, step: int = 0, run: str | None = None,
                 bounds: Bounds = Bounds(), curve_secret: str | Path | None = None,
                 server_key: str | Path | None = None, ctx: zmq.Context | None = None) -> None:
        if (curve_secret is None) != (server_key is None):
            raise ConfigError("CURVE needs curve_secret and server_key together (the --curve-secret and "
                              "--server-key of a daemon)")
        self.side, self.exp, self.endpoint = side, side.exp, endpoint
        self.log = logging.getLogger(f"distgrad.{side.stage}")
        self.applied = _check_step(step, self.exp.steps)     # the steps this loop has applied
        if step and run is None:
            raise ConfigError(f"step={step} resumes a run: give its run id too (run=, the cut's run_id when it "
                              f"was saved), or resume from a state_dict, which holds both")
        self.run_id = uuid.uuid4().hex if run is None else _check_run(run)
        self.senders = Senders(self.exp.codecs)
        self.mbs = side.micro_batches
        security = CurveClient(Path(curve_secret), Path(server_key)) if curve_secret is not None else None
        self.reply_specs = Expected(WireTensor(GRADIENT, side.micro_shape(self.mbs), self.exp.codecs[GRADIENT]))
        self.link = DownstreamLink(LinkSettings(side.stage, bounds.timeout_s, bounds.liveness_s,
                                                bounds.peer_deadline_s), endpoint, lambda: None,
                                   ctx or zmq.Context.instance(), security, self.reply_specs)
        self.joined = False         # shook hands at ``step``
        self.closed = False
        self.below = self.exp.stage_names[1]

    @classmethod
    def connect(cls, endpoint: str, interface: str | Path | Mapping[str, Any] | None = None, *, step: int = 0,
                run: str | None = None, state: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                liveness_s: float | None = None, peer_deadline_s: float | None = None,
                curve_secret: str | Path | None = None, server_key: str | Path | None = None,
                ctx: zmq.Context | None = None, **fields: Any) -> "Cut":
        """A ``Cut`` to the label owner at ``endpoint`` for ``interface`` (this party's stage file, or its
        fields as keyword arguments: ``run.cut_interface.cut_side``), standing at ``step`` (the steps this
        loop has applied) of run ``run`` (its ``run_id``; needed with a ``step`` > 0), or at the ``state`` a
        ``state_dict`` gave. ``timeout_s``, ``liveness_s`` and
        ``peer_deadline_s`` bound the waits as the daemons' flags do; ``curve_secret`` and ``server_key``
        are CURVE's key files. Raises ``ConfigError`` for a bad interface or setting."""
        given = {k: v for k, v in (("timeout_s", timeout_s), ("liveness_s", liveness_s),
                                   ("peer_deadline_s", peer_deadline_s)) if v is not None}
        cut = cls(cut_side(FIRST, interface, fields), endpoint, step=step, run=run, bounds=Bounds(**given),
                  curve_secret=curve_secret, server_key=server_key, ctx=ctx)
        if state is not None:
            cut.load_state_dict(state)
        return cut

    # -- the steps
    def rows(self, step: int | None = None) -> np.ndarray:
        """The row numbers of ``step`` (default: the next) in the interface's shared sample order."""
        return self.side.rows(self.applied + 1 if step is None else step)

    def step(self, h: np.ndarray, rows: Any = None, step: int | None = None) -> tuple[np.float32, np.ndarray]:
        """One step: send ``h`` (float32, the interface's activation shape for a whole batch), wait for the
        label owner's replies and return ``(loss, dh)``: the step's loss and d(loss)/d(h), float32, the
        same shape as ``h``. ``rows`` (optional): the row numbers ``h`` was computed from, checked against
        the shared order. ``step`` (optional) must be the next step. With M micro-batches, ``h`` is sent
        as M of them; the loss and ``dh`` are the daemons' (their sums times the micro-batch scale).

        Raises ``CutMisuse`` for a wrong shape, dtype, rows or step, or a closed cut; ``PeerTimeout`` when
        the label owner stays silent past ``peer_deadline_s``; ``PeerRejected`` when it refuses;
        ``NonFiniteError`` for a NaN or Inf in its reply (unless the interface allows them).
        """
        self._check_open()
        k = self.applied + 1
        if step is not None and step != k:
            raise CutMisuse(f"step {step} given, but this cut has applied {self.applied} steps, so the next is {k}; "
                            f"steps go one by one (to resume from a checkpoint, Cut.connect(..., step=STEP) or "
                            f"load_state_dict)")
        if k > self.exp.steps:
            raise CutMisuse(f"all {self.exp.steps} steps of the interface are done; call close()")
        h = self._checked(h)
        if rows is not None:
            expected = self.side.rows(k)
            given = np.asarray(rows).reshape(-1)
            if given.shape != expected.shape or not np.array_equal(given, expected):
                raise CutMisuse(f"step {k} was given rows {wire.show(given.tolist())}, but the shared sample "
                                f"order has {wire.show(expected.tolist())}: take each step's rows from "
                                f"cut.rows(step) (or distgrad.torch.batch_sampler), which the label owner uses too")
        for attempt in (0, 1):
            if not self.joined:
                self._handshake()
            try:
                loss, dh = self._exchange(k, h)
                break
            except PeerRejected as e:
                if attempt or e.code not in (ErrorCode.RUN, ErrorCode.STEP):
                    raise
                # The label owner restarted or lost this run: shake hands again, then send the step again.
                self.log.warning("%s; shaking hands again", e.peer_message)
                self.joined = False
        self.senders.commit()
        self.applied = k
        return loss, dh

    def _checked(self, h: Any) -> np.ndarray:
        if not isinstance(h, np.ndarray) or h.dtype != np.float32:
            raise CutMisuse(f"h must be a float32 numpy array, got {type(h).__name__} "
                            f"{getattr(h, 'dtype', '')}".rstrip())
        if h.shape != self.side.shape:
            raise CutMisuse(f"h has shape {h.shape}, the interface's activation for a batch is {self.side.shape}")
        return np.ascontiguousarray(h)

    def _exchange(self, k: int, h: np.ndarray) -> tuple[np.float32, np.ndarray]:
        """Send step ``k``'s micro-batches (all at once) and collect their replies in order."""
        count = self.mbs
        rows = len(h) // count if count > 1 else 0
        pending: dict[tuple[int, int], Message] = {}
        self.link.arrived.clear()
        self.senders.discard()              # a step sent again is coded from the same residuals
        for i in range(count):
            part = h if count == 1 else h[i * rows:(i + 1) * rows]
            try:
                tensors = self.senders.message_tensors(ACTIVATION, part, stream_name(ACTIVATION, i, count), k)
            except CodecRangeError as e:
                raise NonFiniteError(f"stage {self.side.stage}: {e}; nothing of step {k} was sent") from e
            msg = Message(wire.FORWARD, self.run_id, k, i, count, tensors=tensors)
            pending[(k, i)] = msg
            self.link.send(msg)
        losses, grads = [], []
        for i in range(count):
            reply = self.link.await_reply(pending, (k, i))
            loss, dy = check_reply(reply, k, self.reply_specs, self.exp.allow_nonfinite, self.below)
            losses.append(loss)
            grads.append(dy)
        scale = self.side.scale(count)
        if count == 1:
            return losses[0], np.array(grads[0], np.float32)
        return combine_losses(losses, scale), np.concatenate(grads) * scale

    def _handshake(self) -> None:
        """Hello at ``step``; the label owner must take this run up there."""
        hello = handshake.hello(self.exp, self.side.stage, self.exp.seed, self.side.shape, self.run_id, [self.applied],
                                self.exp.steps, self.mbs)
        try:
            self.link.handshake(hello)
        except ProtocolError as e:
            if e.code != ErrorCode.RUN:
                raise
            raise ProtocolError(ErrorCode.RUN, f"the label owner did not take run {self.run_id} up at step "
                                               f"{self.applied}, where this side stands ({e}); resume both sides "
                                               f"from checkpoints of the same step") from e
        self.joined = True

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of this loop must hold to resume the cut: a small dict of plain values and
        float32 arrays (the codec's error-feedback residuals, with ``topk:K+ef``). Save it with the
        model and optimiser after each step; no pickle is needed."""
        return {"version": STATE_VERSION, "interface": self.exp.interface_fingerprint, "run": self.run_id,
                "step": self.applied, "residuals": self.senders.state_arrays()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Stand where ``state`` (a ``state_dict``) says; the next step shakes hands there."""
        self._check_open()
        check_state(state, self.exp)
        self.run_id, self.applied = state["run"], _check_step(state["step"], self.exp.steps)
        self.senders.load_state_arrays(dict(state.get("residuals", {})))
        self.joined = False

    # -- the end
    def close(self, finished: bool | None = None) -> None:
        """Close the connection. ``finished`` (default: every step of the interface is done) says bye first,
        so the label owner ends the run; a loop stopping early for good passes True, one that will resume
        later False."""
        if self.closed:
            return
        try:
            if (self.applied >= self.exp.steps if finished is None else finished):
                if not self.joined:
                    self._handshake()
                self.link.exchange(Message(wire.BYE, self.run_id, self.applied + 1, body={"steps": self.applied}))
        finally:
            self.closed = True
            self.link.close(linger_ms=0)

    def __enter__(self) -> "Cut":
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.close(finished=False)   # a loop that failed does not end the run: it may resume

    def _check_open(self) -> None:
        if self.closed:
            raise CutMisuse("this cut is closed; connect a new one (Cut.connect) to go on")


def _check_step(step: Any, steps: int) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= steps:
        raise ConfigError(f"step must be the steps applied, an integer from 0 to {steps}, got {step!r}")
    return step


def check_state(state: Mapping[str, Any], exp: Any) -> None:
    """Check a ``state_dict``'s version, interface and run id (``ConfigError`` naming what differs)."""
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        raise ConfigError(f"not a cut state of version {STATE_VERSION}: {wire.show(state)}")
    if state.get("interface") != exp.interface_fingerprint:
        raise ConfigError("this state is of another interface (its fingerprint differs): resume with the "
                          "interface it was saved under")
    _check_run(state.get("run"))


def _check_run(run: Any) -> str:
    if not isinstance(run, str) or not run or not wire.RUN_ID.fullmatch(run):
        raise ConfigError(f"run id {wire.show(run)} is not one: 1 to 128 of A-Z a-z 0-9 _ . -")
    return run
