"""A stage's connection to the stage below it: requests, bounded waits, retries, the handshake.

The first stage drives its chain through a ``DownstreamLink``; a middle stage
passes what it receives on through one. Every wait is bounded by
``timeout_s`` and by what is left of ``peer_deadline_s``; an unanswered request is resent on a fresh socket
(the Lazy Pirate pattern) until ``peer_deadline_s``, which is safe because the stage
below answers a repeated request from its cache without a second update.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Mapping

import numpy as np
import zmq

from distgrad.wire import messages as wire
from distgrad.errors import NonFiniteError, PeerBusy, PeerRejected, PeerTimeout, ProtocolError
from distgrad.wire.transport import POLL_TICK_S, Client, SocketSecurity, Traffic
from distgrad.wire.messages import ErrorCode, Message, frame_limit
from distgrad.wire.wirecodec import Expected

RETRY_BACKOFF_S = (0.1, 2.0)       # first and largest pause between reconnection attempts
MIN_WAIT_S = 0.01                  # the shortest last wait before the peer deadline
# A hello refused as busy is sent again after at least BUSY_PROBE_S, while the other run's client stays silent
# (it may have stopped). Unheard, its silence grows by the time between the stage's two refusals, which is at
# least the time from the first refusal's arrival to the second hello's sending, whatever the round trips took;
# so it was heard in between when its silence grew by less than that, less BUSY_HEARD_SLACK_S (the rounding of
# the two figures, written with two decimals).
BUSY_PROBE_S = 0.5
BUSY_HEARD_SLACK_S = 0.02
# How much longer than its peer deadline a side waits for a reply, per stage beneath the stage below that passes
# requests on (a middle stage of a chain): that stage answers with why it stopped (naming the stage that went
# silent under it) only once its own wait there gives up, which began after this side's and may end a
# reconnection pause later (RETRY_BACKOFF_S[1]); the rest is for its answer's way up.
RELAY_GRACE_S = 3.0

Specs = Mapping[str, tuple[tuple[int, ...], np.dtype]]


@dataclass(frozen=True)
class LinkSettings:
    """The bounds of one connection: who this side is (``name``, in logs and hellos) and, in seconds,
    how long one reply may take, how long a silent peer is still live, how long to retry before
    giving up, and how long to spin before blocking; ``relays``: the stages beneath the stage below
    that pass requests on (``Experiment.relays_below``), each adding ``RELAY_GRACE_S`` to the wait."""

    name: str
    timeout_s: float
    liveness_s: float
    peer_deadline_s: float
    spin_s: float = 0.0
    relays: int = 0

    @property
    def give_up_s(self) -> float:
        """How long a request is retried before ``PeerTimeout``: the peer deadline, and the time a stage
        below that passes requests on needs to say why it stopped first."""
        return self.peer_deadline_s + self.relays * RELAY_GRACE_S


class DownstreamLink:
    """Requests from one stage to the stage serving at ``connect``.

    ``reply_specs`` are the tensors a backward reply must carry (one
    micro-batch's activation gradient, as its codec sends it; None: replies
    carry no tensors, as in ``distgrad predict``); they bound what this side
    accepts.
    Replies to other pending requests that arrive while waiting for one are
    kept until asked for.
    """

    def __init__(self, settings: LinkSettings, connect: str, check_stop: Callable[[], None], ctx: zmq.Context,
                 security: SocketSecurity | None, reply_specs: Expected | None, traffic: Traffic | None = None,
                 other_replies: Specs | None = None) -> None:
        self.opts, self.connect, self.check_stop, self.ctx, self.security = settings, connect, check_stop, ctx, security
        self.reply_specs = reply_specs
        # The biggest reply is a backward one (an evaluation carries no tensors), or one of
        # ``other_replies`` (a SplitFed average: the first stage's parameters).
        self.other_limits = frame_limit(other_replies) if other_replies else (0, 0)
        self.max_frame, self.max_tensor = self._limits()
        self.traffic = traffic or Traffic()
        self.log = logging.getLogger(f"distgrad.{settings.name}")
        # Replies that came while waiting for another, by (step, micro-batch, type): with steps in flight
        # (staleness) a forward's reply and an evaluation's may share a step and micro-batch.
        self.arrived: dict[tuple[int, int, str], Message] = {}
        self.run_id = ""
        self.below = ""            # the stage below's name, from its welcome: its timeout names it
        self.welcome: dict[str, Any] = {}       # the body of the last handshake's welcome
        self.client = self._new_client()

    def set_reply_specs(self, reply_specs: Expected) -> None:
        """Expect other backward tensors (the micro-batch count changed); reconnects if limits grow."""
        self.reply_specs = reply_specs
        limits = self._limits()
        if limits != (self.max_frame, self.max_tensor):
            self.max_frame, self.max_tensor = limits
            self.client.close(linger_ms=0)
            self.client = self._new_client()

    def _limits(self) -> tuple[int, int]:
        frame, tensor = frame_limit(self.reply_specs.specs if self.reply_specs is not None else {})
        return max(frame, self.other_limits[0]), max(tensor, self.other_limits[1])

    def _new_client(self) -> Client:
        return Client(self.ctx, self.connect, self.max_frame, self.max_tensor, self.opts.liveness_s,
                      self.security, self.traffic, self.opts.spin_s)

    def send(self, msg: Message) -> None:
        self.client.send(msg)

    def ping(self, run: str, timeout_s: float) -> Message:
        """A ping to the stage below (which answers at once, whatever it is doing) and its pong; raises
        ``PeerTimeout`` without one within ``timeout_s``, ``ProtocolError`` for another reply."""
        pong = self.client.request(Message(wire.PING, run, 0), timeout_s, self.check_stop)
        if pong.type != wire.PONG:
            raise ProtocolError(ErrorCode.TYPE, f"expected a pong to a ping, got {pong.type!r}")
        return pong

    def exchange(self, msg: Message, types: Collection[str] | None = None) -> Message:
        """Send ``msg`` and return its reply (of one of ``types``, when given), with the retries of
        ``await_reply``.

        A hello refused because the stage below is busy with another live run
        raises ``PeerBusy``, naming that run and since when it runs there, as
        soon as that run's client is heard between two refusals (a second
        driver: waiting would only hide it behind a timeout). While that
        client stays silent (it may have stopped: this driver restarted
        without its checkpoints) the hello is sent again, until the stage
        takes it as gone (its liveness), within ``peer_deadline_s``.
        """
        started = time.monotonic()
        pause = RETRY_BACKOFF_S[0]
        last: tuple[float, float] | None = None      # (when, the other client's silence) of the last refusal
        while True:
            key = (msg.step, msg.mb)
            sent = time.monotonic()
            self.client.send(msg)
            try:
                return self.await_reply({key: msg}, key, types)
            except PeerRejected as e:
                if e.code != ErrorCode.RUN or not e.peer_message.startswith("busy"):
                    raise
                now, figures = time.monotonic(), wire.busy_silence(e.peer_message)
                busy = PeerBusy(e.code, e.peer_message, self.client.endpoint)
                if figures is None or now + max(pause, BUSY_PROBE_S) > started + self.opts.peer_deadline_s:
                    raise busy from None
                if last is not None and figures[0] + BUSY_HEARD_SLACK_S < last[1] + (sent - last[0]):
                    raise busy from None           # heard since the last refusal: it is live
                if last is not None:
                    self.log.warning("%s; its client is silent and may have stopped: retrying until the stage "
                                     "takes it as gone", e.peer_message)
                last = (now, figures[0])
                pause = max(pause, BUSY_PROBE_S)
            self._reconnect(pause)
            pause = min(pause * 2, RETRY_BACKOFF_S[1])

    def await_reply(self, pending: Mapping[tuple[int, int], Message], key: tuple[int, int],
                    types: Collection[str] | None = None) -> Message:
        """The reply to ``pending[key]`` (of one of ``types``, or an error, when given); replies to other
        pending requests, and of other types, are kept for later.

        After each ``timeout_s`` without it, reconnect on a fresh socket and
        resend every pending request in order, until ``peer_deadline_s`` (and
        a stage below that passes requests on has had the time to say why it
        stopped: ``LinkSettings.give_up_s``); then raise ``PeerTimeout`` naming
        the endpoint and, once its welcome named it, the stage below. Raises
        ``PeerRejected`` for an error reply (the reason of a stage below that
        stopped, too), ``ProtocolError`` for a malformed one.
        """
        if self.arrived:
            reply = self._take(key, types)
            if reply is not None:
                return reply
        deadline = time.monotonic() + self.opts.give_up_s
        pause = RETRY_BACKOFF_S[0]
        while True:
            # No wait outlasts the deadline, even with a --timeout longer than --peer-deadline.
            timeout_s = min(self.opts.timeout_s, max(deadline - time.monotonic(), MIN_WAIT_S))
            try:
                reply = self.client.wait(pending[key].run, pending.keys(), timeout_s, self.check_stop,
                                         pending[key].describe)
            except PeerTimeout as e:
                if time.monotonic() + pause > deadline:
                    who = f"stage {self.below!r} did not answer: " if self.below else ""
                    raise PeerTimeout(f"{who}{e}; gave up after retrying for {self.opts.give_up_s:g} s") from e
                self.log.warning("no reply from %s within %g s; reconnecting and retrying for up to %.0f s more",
                                 self.connect, timeout_s, deadline - time.monotonic())
                self._reconnect(pause)
                pause = min(pause * 2, RETRY_BACKOFF_S[1])
                for request_key in sorted(pending):
                    self.client.send(pending[request_key])
                continue
            if (reply.step, reply.mb) == key and (types is None or _wanted(reply.type, types)):
                return reply
            self.arrived[(reply.step, reply.mb, reply.type)] = reply     # another's: kept until asked for

    def _take(self, key: tuple[int, int], types: Collection[str] | None) -> Message | None:
        """An arrived reply to ``key`` of one of ``types`` (any, when None), removed from ``arrived``."""
        for step, mb, kind in self.arrived:
            if (step, mb) == key and _wanted(kind, types):
                return self.arrived.pop((step, mb, kind))
        return None

    def _reconnect(self, pause: float) -> None:
        self.client.close(linger_ms=0)
        end = time.monotonic() + pause
        while time.monotonic() < end:
            self.check_stop()
            time.sleep(min(POLL_TICK_S, max(0.0, end - time.monotonic())))
        self.client = self._new_client()

    def handshake(self, hello: Message, client: int | None = None) -> int:
        """Send ``hello`` (``handshake.hello``) and return the step the stage below stands at: one of the
        hello's ``held`` steps, or for a ``client`` of a stage serving several, possibly a later step
        (the steps it missed after being dropped). Raises ``ProtocolError`` for another answer."""
        self.run_id = hello.run
        self.arrived.clear()
        welcome = self.exchange(hello)
        held = hello.body["held"]
        next_step = welcome.body.get("next_step")
        if (welcome.type != wire.WELCOME or not isinstance(next_step, int) or isinstance(next_step, bool)
                or not (next_step - 1 in held or (client is not None and next_step - 1 > max(held)))):
            raise ProtocolError(ErrorCode.RUN, f"expected a welcome at a step this stage holds {held}, "
                                               f"got {welcome.describe()} {wire.show(welcome.body)}")
        stage = welcome.body.get("stage")
        self.welcome = welcome.body
        self.below = stage if isinstance(stage, str) and stage.isprintable() and len(stage) <= 64 else ""
        self.log.info("run %s: connected to stage %s at %s (%s); at step %d", hello.run,
                      wire.show(welcome.body.get("stage")), self.connect,
                      "CURVE: the link is encrypted" if self.security is not None else "plaintext", next_step - 1)
        return next_step - 1

    def close(self, linger_ms: int | None = None) -> None:
        if linger_ms is None:
            self.client.close()
        else:
            self.client.close(linger_ms)


def _wanted(kind: str, types: Collection[str] | None) -> bool:
    """Whether a reply of type ``kind`` answers a wait for ``types`` (any type when None; an error always)."""
    return types is None or kind in types or kind == wire.ERROR


def check_reply(reply: Message, step: int, specs: Expected, allow_nonfinite: bool,
                below: str) -> tuple[np.float32 | None, np.ndarray]:
    """``(loss, activation_grad)`` of stage ``below``'s backward reply to step ``step``, the gradient decoded
    with its codec (``specs.receive``); the loss is None when the reply says it is withheld (instead of a loss:
    ``wire.LOSS_WITHHELD_KEY``). A NaN or Inf in it raises ``NonFiniteError`` (a stage failed, exit 1)
    rather than a refusal, since this side sent nothing wrong; anything else that makes it no backward reply
    raises ``ProtocolError`` naming the stage, the step and the micro-batch of the reply."""
    try:
        if reply.type != wire.BACKWARD:
            raise ProtocolError(ErrorCode.TYPE, f"expected a backward reply to step {step}, got {reply.type!r}")
        dy = specs.receive(reply, allow_nonfinite)
        loss = reply.body.get("loss")
        withheld = reply.body.get(wire.LOSS_WITHHELD_KEY, False)
        if withheld is not False and (withheld is not True or "loss" in reply.body):
            raise ProtocolError(ErrorCode.MALFORMED, f"backward reply to step {step} has "
                                                     f"{wire.LOSS_WITHHELD_KEY} {wire.show(withheld)} and loss "
                                                     f"{wire.show(loss)}: true without a loss, or absent")
        if withheld:
            return None, dy
        if not isinstance(loss, (int, float)) or isinstance(loss, bool):
            raise ProtocolError(ErrorCode.MALFORMED, f"backward reply to step {step} has loss {wire.show(loss)}")
    except ProtocolError as e:
        if e.code != ErrorCode.NONFINITE:
            raise ProtocolError(e.code, f"stage {below}'s reply to step {step} micro-batch {reply.mb}/{reply.mbs}: "
                                        f"{e.args[0]}") from e
        raise NonFiniteError(f"stage {below}: non-finite activation_grad at step {step} in its reply; "
                             f"nothing of this step was applied here") from e
    loss = np.float32(loss)         # a float beyond float32's range is Inf here
    if not allow_nonfinite and not math.isfinite(loss):
        raise NonFiniteError(f"stage {below}: non-finite loss at step {step} in its reply; "
                             f"nothing of this step was applied here")
    return loss, dy


def check_evaluation(reply: Message) -> dict[str, Any]:
    """The body of an evaluation reply (``loss``, ``correct``, ``count``; ``metrics``, ``best`` and ``stop``
    when it has them; ``held_out``, which rows were scored, with a validation split: ``VALIDATION_ROWS`` or
    ``TEST_ROWS``); raises ``ProtocolError`` if it is not one."""
    if reply.type != wire.EVALUATION:
        raise ProtocolError(ErrorCode.MALFORMED, f"expected an evaluation reply, got {reply.describe()}")
    out = _scores(reply.body, reply)
    rows = reply.body.get(HELD_OUT)
    if rows is not None:
        if rows not in (VALIDATION_ROWS, TEST_ROWS):
            raise ProtocolError(ErrorCode.MALFORMED, f"evaluation reply has {HELD_OUT}={wire.show(rows)}: "
                                                     f"{VALIDATION_ROWS!r} or {TEST_ROWS!r}")
        out[HELD_OUT] = rows
    return out


def _scores(body: Any, reply: Message) -> dict[str, Any]:
    """The checked scores of one set of rows in an evaluation reply's body (``check_evaluation``)."""
    if not isinstance(body.get("loss"), float) or not isinstance(body.get("count"), int):
        raise ProtocolError(ErrorCode.MALFORMED, f"expected an evaluation reply, got {reply.describe()}")
    count, correct = body["count"], body.get("correct")
    if isinstance(count, bool) or count < 1:       # the held-out rows scored: an accuracy divides by it
        raise ProtocolError(ErrorCode.MALFORMED, f"evaluation reply has count={wire.show(count)}; at least 1")
    if correct is not None and (not isinstance(correct, int) or isinstance(correct, bool)
                                or not 0 <= correct <= count):
        raise ProtocolError(ErrorCode.MALFORMED, f"evaluation reply has correct={wire.show(correct)}; an int "
                                                 f"from 0 to count = {count}")
    out = {"loss": body["loss"], "correct": correct, "count": body["count"]}
    metrics = body.get("metrics")
    if metrics is not None:
        if not isinstance(metrics, dict) or not all(isinstance(name, str) and (value is None or isinstance(value, float))
                                                    for name, value in metrics.items()):
            raise ProtocolError(ErrorCode.MALFORMED, f"evaluation reply has metrics={wire.show(metrics)}: a map of "
                                                     f"names to floats (or nil)")
        out["metrics"] = metrics
    for verdict in ("best", "stop"):
        if verdict in body:
            if not isinstance(body[verdict], bool):
                raise ProtocolError(ErrorCode.MALFORMED, f"evaluation reply has {verdict}={wire.show(body[verdict])}")
            out[verdict] = body[verdict]
    return out


EVALUATION_SCORES = ("loss", "correct", "count", "metrics", "best", "stop")   # all an evaluation reply carries
# With a validation split an evaluation says which held-out rows it scores (request and reply body ``held_out``):
# the validation rows (every evaluation during the run, judged by keep_best and early_stopping), or the test
# rows (once, after the last step, with the kept model: ``is_final``). Without one the key is absent.
HELD_OUT, VALIDATION_ROWS, TEST_ROWS = "held_out", "validation", "test"


def is_final(msg: Message) -> bool:
    """``msg`` (an evaluate request or its reply) is the final evaluation: the kept model on the test rows."""
    return msg.body.get(HELD_OUT) == TEST_ROWS


def final_body(final: bool) -> dict[str, Any]:
    """The body of an evaluate request: ``{held_out: "test"}`` for the final evaluation, else empty (the label
    owner's own data says whether an evaluation during the run scores validation rows)."""
    return {HELD_OUT: TEST_ROWS} if final else {}


def evaluation_reply(run: str, step: int, result: Mapping[str, Any]) -> Message:
    """The label owner's reply to an evaluation: only the aggregate scores of ``result`` (``EVALUATION_SCORES``:
    the loss, the rows right, the rows scored, each metric's one number, the ``best``/``stop`` verdicts; and
    ``held_out``, which rows, with a validation split), no tensor and nothing per row, whatever else ``result``
    holds. Raises ``ValueError`` for a score that is not one number (a metric computed per row)."""
    body = _aggregate_scores(result, EVALUATION_SCORES)
    if result.get(HELD_OUT) in (VALIDATION_ROWS, TEST_ROWS):
        body[HELD_OUT] = result[HELD_OUT]
    return Message(wire.EVALUATION, run, step, body=body)


def _aggregate_scores(result: Mapping[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """The ``keys`` of ``result`` each as one number (metrics: a map of one number each; verdicts: bools)."""
    body: dict[str, Any] = {}
    for key in keys:
        if key not in result:
            continue
        value = result[key]
        if key == "metrics":
            if not isinstance(value, Mapping):
                raise ValueError(f"an evaluation's metrics are a map of names to numbers, got {type(value).__name__}")
            value = {str(name): _one_score(score, f"metric {name!r}") for name, score in value.items()}
        elif key in ("best", "stop"):
            value = bool(value)
        elif key == "loss":
            value = _one_score(value, "the loss")
        elif value is not None:
            value = int(_one_score(value, key))
        body[key] = value
    return body


def _one_score(value: Any, what: str) -> Any:
    """``value`` as one float (None stays None); ``ValueError`` for anything with more than one number."""
    if value is None:
        return None
    if isinstance(value, bool) or np.ndim(value) != 0:
        raise ValueError(f"an evaluation reply carries one number for {what}, got {type(value).__name__} "
                         f"of shape {np.shape(value)}: nothing per row leaves the label owner")
    return float(value)
