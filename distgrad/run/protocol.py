"""The rules of the protocol that every end of a cut shares, each written once.

A serving end (the serving stage of a daemon, the cut library's
``CutServer``, ``distgrad predict``) and a driving end (the driver of a
daemon, the cut library's ``Cut``) follow the same rules whatever hosts them:
how a message is decoded or refused, what a pong says, whose key a run is,
the order of a step's forwards, the bye and its replay, which replies and
evaluations are answered again from a cache, when an evaluation is due and
when a refusal calls for a new handshake. docs/protocol.md states them; this
module is where the code that follows them lives, so a hostile-peer fix is
made here once and holds at every end.
"""

from __future__ import annotations

import logging
import time
from typing import AbstractSet, Any, Callable, Mapping, Sequence, TypeVar

import numpy as np

from distgrad.config.experiment import MAX_STALENESS, Experiment, check_staleness
from distgrad.errors import ConfigError, PeerBusy, PeerRejected, ProtocolError
from distgrad.run.handshake import same_exactly
from distgrad.wire import messages as wire
from distgrad.wire.link import HELD_OUT
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.transport import POLL_TICK_S, Server, refusal_log
from distgrad.wire.wirecodec import ACTIVATION, Senders

OWNER_KEY_TEXT = "this run belongs to another client key"   # a run driven from a key other than its opener's
TRAINS_TEXT = "this stage trains (start 'distgrad predict' on this side to predict)"   # a hello asking to predict

# After an end's stop notices, how long with no request ends its wait for resent ones: a peer that closed its
# socket as the notice left resends on a fresh one after its first reconnection pause (link.RETRY_BACKOFF_S, 0.1 s).
NOTICE_QUIET_S = 0.2

Cached = TypeVar("Cached")


# -- refusals
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
            log_refusal(log, msg, e)
        return msg, refusal(msg, e), True


def log_refusal(log: logging.Logger, msg: Message | None, error: ProtocolError) -> None:
    """Log a refused message at WARNING through ``log``'s ``RefusalLog``: the first of its kind (message
    type and error code) in an interval in full, the repeats as a count."""
    refusal_log(log).note(f"{msg.type if msg else 'undecodable'} {error.code}", "refused %s: %.*s",
                          msg.describe() if msg else "an undecodable message", wire.ERROR_TEXT_MAX, error)


def refusal(msg: Message | None, error: ProtocolError) -> Message:
    """The error reply to a refused message, echoing its ids when it could be decoded."""
    if msg is None:
        return wire.error_message("", 0, error.code, str(error.args[0]))
    return wire.error_message(msg.run, msg.step, error.code, str(error.args[0]), msg.mb, msg.mbs)


def refused_text(msg: Message | None, reply: Message) -> str:
    """One line naming a refused message (``msg``, None when it did not decode) and why (its error
    ``reply``), as a later timeout's message quotes it."""
    return f"{msg.describe() if msg else 'an undecodable message'}: {reply.body['code']}: {reply.body['message']}"


# -- ping
def pong(msg: Message, stage: str, experiment: str, **fields: Any) -> Message:
    """The answer to ping ``msg``: this ``stage`` of ``experiment``, with what the end adds (a training
    end: the ``run`` it serves, its ``step``, ``client_live``, ...; ``distgrad predict``: its ``purpose``)."""
    return Message(wire.PONG, msg.run, msg.step, body={"stage": stage, "experiment": experiment, **fields})


# -- whose run, and what a message may be
def unknown_run(msg: Message, expected: str) -> ProtocolError:
    """The refusal of ``msg`` of a run this end does not serve (``expected``: what it should have been).
    An aborted notice is refused so too: it stops only the run it names, when that run is this end's."""
    what = f"an aborted notice of run {msg.run!r}" if is_abort_notice(msg) else f"{msg.type} for run {msg.run!r}"
    return ProtocolError(ErrorCode.RUN, f"{what}, expected {expected}")


def not_accepted(msg: Message, here: str = "a serving stage") -> ProtocolError:
    """The refusal of ``msg``, whose type this end (``here``) never takes."""
    return ProtocolError(ErrorCode.TYPE, f"{here} does not accept {msg.type!r} messages")



def check_owner(owner: str, peer_key: str, msg: Message | None = None) -> None:
    """With CURVE a run belongs to the key that opened it (``owner``, "" in plaintext): a message from
    another key (``msg``, when given, names an aborted notice as one) is refused (``ProtocolError``, code
    ``run``)."""
    if owner and peer_key != owner:
        lead = "an aborted notice not from the data owner: " if msg is not None and is_abort_notice(msg) else ""
        raise ProtocolError(ErrorCode.RUN, lead + OWNER_KEY_TEXT)


# -- hello
def hello_peer(body: Mapping[str, Any], experiment: str, clients: int = 0, parties: Sequence[str] = ()) -> int:
    """Which data owner a hello (``body``) comes from, one rule for every serving end of ``experiment``: one of
    the feature ``parties`` (vertical: told apart by its ``role``, with no ``client``), one of ``clients`` data
    owners in turn (its ``client``, 0 to ``clients`` - 1), else the one data owner (no ``client``, or 0).
    Anything else is refused (``ProtocolError``, code ``mismatch``) naming what the hello said."""
    if parties:
        if "client" in body:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(body['client'])}; the feature "
                                                    f"parties of {experiment!r} are told apart by their stage")
        role, names = body.get("role"), list(parties)
        if not isinstance(role, str) or role not in names:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello from stage {wire.show(role)}; this label owner serves the "
                                                    f"feature parties {names}")
        return names.index(role)
    index = body.get("client", None if clients else 0)
    if clients:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < clients:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(index)}; this stage serves "
                                                    f"clients 0 to {clients - 1} (give --client, or "
                                                    f"Cut.connect(..., client=C))")
        return index
    if not same_exactly(index, 0):
        raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(index)}; experiment {experiment!r} "
                                                f"has no [clients]")
    return 0


def check_takeover(msg: Message, run: str, since: float, silent_s: float, liveness_s: float, who: str, step: int,
                   under_way: int, owner: str, peer_key: str) -> None:
    """Whether hello ``msg`` may take the place of data owner ``who`` at a cut library's server, which serves
    ``run`` (opened at ``since``, seconds since the epoch; "" for none) for it, heard ``silent_s`` ago, with
    ``step`` steps applied and ``under_way`` micro-batches of the next taken: another run is refused while
    ``who`` is live (``liveness_s``: busy, naming the run and since when) or once that run has begun (the
    server never replaces a run at a step: docs/cut.md); the same run only from the key that opened it
    (``owner``; ``check_owner``). ``ProtocolError``, code ``run``."""
    if run and msg.run != run and silent_s < liveness_s:
        busy = wire.busy_text("run", run, since, who, silent_s, liveness_s)
        raise ProtocolError(ErrorCode.RUN, f"{busy}; cannot start run {msg.run!r}")
    if run and msg.run != run and (step or under_way):
        raise ProtocolError(ErrorCode.RUN, f"{who} is in run {run} at step {step} here, the hello is of run "
                                           f"{msg.run!r}: resume it with its run's checkpoint, or start the label "
                                           f"owner afresh")
    if run == msg.run:
        check_owner(owner, peer_key)


def check_lockstep(staleness: int) -> None:
    """A stage serving several data owners (clients or feature parties) takes lockstep steps only: a hello
    asking to keep ``staleness`` > 0 steps in flight is refused (``ProtocolError``, code ``mismatch``)."""
    if staleness:
        raise ProtocolError(ErrorCode.MISMATCH, f"hello has staleness={staleness}; a stage serving several data "
                                                f"owners (clients or feature parties) takes lockstep steps only")


def hello_fields(body: Mapping[str, Any], predicts: str = TRAINS_TEXT) -> tuple[int, int]:
    """A hello's ``eval_every`` and ``staleness``, checked (``ProtocolError``); it may not ask to predict
    (``predicts``: why not, here)."""
    if "purpose" in body:
        raise ProtocolError(ErrorCode.MISMATCH, f"hello has purpose={wire.show(body['purpose'])}; {predicts}")
    eval_every = body.get("eval_every", 0)
    if not isinstance(eval_every, int) or isinstance(eval_every, bool) or eval_every < 0:
        raise ProtocolError(ErrorCode.MALFORMED, f"hello has eval_every={wire.show(eval_every)}; expected an "
                                                 f"integer >= 0")
    staleness = body.get("staleness", 0)
    if not isinstance(staleness, int) or isinstance(staleness, bool) or not 0 <= staleness <= MAX_STALENESS:
        raise ProtocolError(ErrorCode.MALFORMED, f"hello has staleness={wire.show(staleness)}; expected an "
                                                 f"integer from 0 to {MAX_STALENESS}")
    return eval_every, staleness


def check_served_staleness(exp: Experiment, staleness: int) -> None:
    """Refuse (``ProtocolError``, ``mismatch``) a hello asking to keep ``staleness`` steps in flight that this
    end's experiment does not support (``config.experiment.check_staleness``: e.g. a codec with error
    feedback), as the data owner's own configuration would have: the same rule at both ends."""
    if staleness:
        try:
            check_staleness(exp, staleness)
        except ConfigError as e:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has staleness={staleness}: {e}") from e


# -- a step's forwards
def check_forward_order(msg: Message, step: int, mb: int, mbs: int, steps: int | None = None) -> None:
    """A forward must be micro-batch ``mb`` of ``mbs`` of step ``step``, the next one this end expects, and
    (when this end knows them: the cut library's interface) one of the run's ``steps``; anything else is
    refused (``ProtocolError``, code ``step``) naming both."""
    if msg.step != step or msg.mb != mb or msg.mbs != mbs:
        raise ProtocolError(ErrorCode.STEP, f"forward for step {msg.step} micro-batch {msg.mb}/{msg.mbs}; "
                                            f"expected step {step} micro-batch {mb}/{mbs}")
    if steps is not None and step > steps:
        raise ProtocolError(ErrorCode.STEP, f"forward for step {step}, but the interface has {steps} steps")


def prune_replies(cache: dict[tuple[int, int], Cached], oldest: int) -> dict[tuple[int, int], Cached]:
    """The replies of ``cache`` (by step and micro-batch) a peer may still ask for again: those of step
    ``oldest`` and later (the steps it may still have in flight)."""
    return {key: reply for key, reply in cache.items() if key[0] >= oldest}


def rejoin_step(held: list[int], step: int, cache: Mapping[tuple[int, int], Any], mbs: int, who: str,
                run: str) -> int:
    """The step a returning data owner (``who``) goes on from: the newest step it holds (``held``) from which
    every later step this side applied (up to ``step``) can be answered again from ``cache`` (its replies by
    step and micro-batch, ``mbs`` a step), plus one; ``ProtocolError`` (code ``run``) naming both sides' steps
    when there is none."""
    answerable = [h for h in held if h <= step and all(
        (t, mb) in cache for t in range(h + 1, step + 1) for mb in range(mbs))]
    if not answerable:
        again = sorted({t for t, _ in cache if t <= step})
        cached = f" (and can answer steps {wire.show(again)} again)" if again else ""
        raise ProtocolError(ErrorCode.RUN, f"{who} can return to steps {wire.show(held)} of run {run}, this label "
                                           f"owner stands at step {step}{cached}: resume both sides from "
                                           f"checkpoints of the same step")
    return max(answerable) + 1


def check_evaluation_step(msg: Message, applied: int, who: str, staleness: int = 0, under_way: int = 0) -> None:
    """An evaluation (not the final one) scores the held-out rows after step k, so it comes with step k + 1
    once the data owner ``who`` has applied k: between steps, when ``applied`` of its steps are applied here,
    or, with ``staleness`` S steps in flight, up to S steps before (this side may be that far ahead, even
    within a step: ``under_way``, the micro-batches of step ``applied + 1`` taken, refuse it in lockstep
    only). Anything else is refused (``ProtocolError``, code ``step``), with the same words at every end."""
    if applied + 1 - staleness <= msg.step <= applied + 1 and not (under_way and not staleness):
        return
    within = f" with step {applied + 1} under way" if under_way and not staleness else ""
    flight = f" ({staleness} steps in flight)" if staleness else ""
    raise ProtocolError(ErrorCode.STEP, f"evaluate for step {msg.step}, but {who} has {applied} steps applied "
                                        f"here{within}{flight}: the held-out rows are scored after a step, before "
                                        f"the next one's forwards")


def resent_evaluation(answered: Message | None, msg: Message) -> Message | None:
    """The reply ``answered`` when evaluate ``msg`` repeats the one it answered (same run, step and held-out
    rows, ``link.HELD_OUT``: the same scores, computed once), else None."""
    if answered is not None and (answered.run, answered.step) == (msg.run, msg.step) \
            and answered.body.get(HELD_OUT) == msg.body.get(HELD_OUT):
        return answered
    return None


# -- a peer that stopped
def is_abort_notice(msg: Message) -> bool:
    """``msg`` is a peer's notice that it stopped before the end (``wire.abort_notice``): an error message
    with code ``aborted``, which is not a request and gets no reply."""
    return msg.type == wire.ERROR and msg.body.get("code") == ErrorCode.ABORTED


def abort_reason(msg: Message) -> str:
    """Why the peer of abort notice ``msg`` stopped, as it said (cut to ``wire.ERROR_TEXT_MAX``)."""
    return str(msg.body.get("message", ""))[:wire.ERROR_TEXT_MAX]


def tell_why_stopped(server: Server, max_tensor_bytes: int, runs: AbstractSet[str], until: float,
                     answer: Callable[[Message], Message], once: bool = True,
                     stopped: Callable[[], bool] = lambda: False, awaited: AbstractSet[str] | None = None) -> bool:
    """Once an end has stopped, answer what the peers of ``runs`` send next with why (``answer(request)``, an
    ``aborted`` error), so none waits out its own deadline: a peer waiting for a reply resends its request on
    a fresh socket, where a reply sent earlier cannot reach it. Until ``until`` (``time.monotonic``) or
    ``stopped()``, each request of one of ``runs`` that decodes and is neither a ping nor an error (a stop
    notice) is answered; with ``once`` a run answered is not waited for again and the wait ends when each
    has been. With ``awaited`` (``notify_stopped``: the runs not reached otherwise) only those are waited
    for: every request of ``runs`` is answered, and the wait ends once each of ``awaited`` has been at a
    socket still connected (``Server.notify``) and no request came for ``NOTICE_QUIET_S`` (those on their
    way are answered too). Anything else is dropped unanswered. Returns whether any peer was answered."""
    answering, waiting, told = set(runs), set(runs if awaited is None else awaited), False
    heard = time.monotonic()
    while not stopped() and time.monotonic() < until:
        if not waiting and (awaited is None or time.monotonic() - heard >= NOTICE_QUIET_S):
            break
        request = server.receive(POLL_TICK_S)
        if request is None:
            continue
        heard = time.monotonic()
        envelope, frames, _ = request
        try:
            msg = wire.decode(frames, max_tensor_bytes)
        except ProtocolError:
            continue
        if msg.run in answering and msg.type not in (wire.PING, wire.ERROR):
            if awaited is None:
                server.reply(envelope, answer(msg))
                reached = True
            else:       # a request resent long ago may come from a socket closed since: that one tells no one
                reached = server.notify(envelope, answer(msg))
            told = told or reached
            if once and reached:
                waiting.discard(msg.run)
                if awaited is None:
                    answering.discard(msg.run)
    return told


def notify_stopped(server: Server, max_tensor_bytes: int, places: Mapping[str, Sequence[Sequence[bytes]]],
                   live: AbstractSet[str], until: float, notice: Callable[[str], Message]) -> bool:
    """A serving end whose loop stopped tells the peer of each run of ``places`` why (``notice(run)``, an
    ``aborted`` error), at every envelope it may wait at (``places[run]``), at once. A peer whose sockets there
    are all gone (it resends on a fresh one) gets it in reply to its next request instead: those of ``live``
    runs are waited for, until ``until`` (``time.monotonic``) at most; a peer reached is not, so the end
    stops at once (``tell_why_stopped``, which answers the requests already on their way too). One rule for
    every cut server. Returns whether any peer was told."""
    # Every place is tried (a list, not any's generator): which of them is the peer's live socket is unknown.
    reached = {run for run, envelopes in places.items()
               if any([server.notify(envelope, notice(run)) for envelope in envelopes])}
    told = tell_why_stopped(server, max_tensor_bytes, set(places), until, lambda msg: notice(msg.run),
                            awaited=set(live) & (set(places) - reached))
    return told or bool(reached)


# -- the end of a run
def check_bye(msg: Message, steps: int, who: str, under_way: int = 0) -> None:
    """A bye of data owner ``who`` (as messages name it) must say exactly the ``steps`` applied here for it,
    and come between steps: with none of step ``steps + 1``'s micro-batches taken (``under_way``: how many
    are). Else it is refused (``ProtocolError``, code ``step``), with the same words at every end."""
    said = msg.body.get("steps")
    if not same_exactly(said, steps):
        raise ProtocolError(ErrorCode.STEP, f"bye after {wire.show(said)} steps, but {who} has {steps} applied here")
    if under_way:
        raise ProtocolError(ErrorCode.STEP, f"bye after {steps} steps, but step {steps + 1} of {who} is under way "
                                            f"here ({under_way} of its micro-batches taken): say bye between steps")


def bye_reply(msg: Message, steps: int) -> Message:
    """The answer to bye ``msg`` after ``steps``; a repeated bye of the same run gets it again."""
    return Message(wire.BYE, msg.run, msg.step, body={"steps": steps})


# -- the driving end
def forward_message(senders: Senders, run: str, step: int, mb: int, mbs: int, y: np.ndarray, stream: str,
                    **travel: np.ndarray | None) -> Message:
    """The forward of micro-batch ``mb`` of ``mbs`` of step ``step``: its activation ``y`` coded on
    ``stream`` by ``senders`` (with error feedback), and what travels with it uncoded (``target``,
    ``rows``: this micro-batch's; None: not sent). Raises ``CodecRangeError`` for a value the codec
    cannot carry."""
    tensors = senders.message_tensors(ACTIVATION, y, stream, step)
    for name, value in travel.items():
        if value is not None:
            tensors[name] = value
    return Message(wire.FORWARD, run, step, mb, mbs, tensors=tensors)


def evaluation_due(step: int, steps: int, every: int) -> bool:
    """Whether the held-out rows are scored after ``step`` of ``steps``: after every ``every``-th step
    (none when 0) and after the last."""
    return step > 0 and (step == steps or (every > 0 and step % every == 0))


def shake_hands_again(e: PeerRejected) -> bool:
    """Whether refusal ``e`` means the serving end lost this run or step (it restarted, or rolled back):
    then the driving end shakes hands again and resends. A busy end (another run is its) is not one."""
    return e.code in (ErrorCode.RUN, ErrorCode.STEP) and not isinstance(e, PeerBusy)
