"""The label owner's end of the cut for several data owners: vertical feature parties, or clients in turn.

``CutServer.bind`` builds a ``GroupServer`` when the interface has
``aggregate`` (vertical feature parties, each a ``Cut`` of its own) or
``[clients]`` (several data owners, each a ``Cut`` with its ``client``). The
loop is the one of a single data owner: iterate for ``Batch``es, reply to each
once. What a batch is follows the daemons' topologies:

- vertical: micro-batch ``mb`` of step k of every party's embedding of the
  same rows, combined as a daemon label owner combines them
  (``model.aggregate.combine``, party order): ``batch.h`` is the combined
  activation, ``batch.parts`` each party's own. The loop's gradient with
  respect to ``batch.h`` is split by ``model.aggregate.split`` and each party
  gets its own part. A step needs every party: one silent past the bounds is a
  ``PeerTimeout`` naming it.
- clients: each step, every client's micro-batches in client order (a daemon's
  turn order; a client that said bye early is skipped); ``batch.client`` is
  whose. Each client has its own shard of the rows (``batch.rows``) and its own
  codec streams. The client whose turn it is, silent past the bounds, is a
  ``PeerTimeout`` naming it (a daemon drops it and goes on; a loop decides
  itself: resume it, or end the run).

Every peer has its own run id (its ``Cut``'s), owner key, codec streams and
cache of its last step's replies, under the rules of one data owner
(``run.protocol``, ``run.cut_server``): the hello through
``run.handshake.check_hello``, a resent step answered from the cache, the
replies leaving at the next ``__next__`` (after whatever the loop saved), a
``state_dict`` between steps that resumes every peer. Lockstep only (no steps
in flight), as a daemon serving several peers. Held-out rows are scored for
vertical parties (``evaluate=``: every party's held-out embeddings combined,
the same scores to each, as a daemon label owner scores them); with clients
``evaluate=`` is refused (a daemon scores each client between rounds, which a
loop of its own cannot interleave).

What every label-owner end keeps with its loop (the socket, the loop's turn, a
failed step, the byes and the stop notice at the end) is its base's,
``run.cut_loop.LoopServer``; each data owner's record, and what concerns them
all, is ``run.cut_owners``; what a checkpoint holds, ``run.cut_state``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, NoReturn

import numpy as np
import zmq

from distgrad.errors import CodecRangeError, ConfigError, CutMisuse, PeerTimeout, ProtocolError
from distgrad.model import aggregate
from distgrad.run.accepts import refuse_rows
from distgrad.run.cut_interface import STATE_VERSION, Bounds, CutSide
from distgrad.run.cut_loop import Batch, Evaluate, LoopServer, evaluation_scores, owned_copy
from distgrad.run.cut_server import CutServer
from distgrad.run.cut_owners import DataOwners, Peer
from distgrad.run.cut_state import GROUP_STATE_KEYS, PEER_STATE_KEYS, check_group_state, saved_peer
from distgrad.run.handshake import check_hello, common_step
from distgrad.run.protocol import (rejoin_step, abort_reason, bye_reply, check_bye, check_evaluation_step,
                                   check_forward_order, check_lockstep, check_owner, check_takeover, hello_fields,
                                   is_abort_notice, not_accepted, pong, prune_replies,
                                   resent_evaluation, unknown_run)
from distgrad.wire import messages as wire
from distgrad.wire.link import evaluation_reply
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import GRADIENT, Expected, stream_name

# Where they were defined before ``run.cut_state`` and ``run.cut_owners`` held them: still importable from here.
__all__ = ["GROUP_STATE_KEYS", "PEER_STATE_KEYS", "GroupServer", "Peer"]


class GroupServer(CutServer, serves_several=True):
    """A ``CutServer`` for several data owners (see the module's docstring); build it with
    ``CutServer.bind``. ``step`` counts the steps applied: a step of every party (vertical), or a round
    of every client's step (clients). One loop drives it (``cut_interface.one_loop``)."""

    def __init__(self, side: CutSide, endpoint: str, *, bounds: Bounds = Bounds(),
                 curve_secret: str | Path | None = None, allow: str | Path | None = None,
                 evaluate: Evaluate | None = None, ctx: zmq.Context | None = None) -> None:
        exp = side.exp
        if evaluate is not None and not exp.vertical:
            raise ConfigError("evaluate=: a CutServer of several clients scores no held-out rows (a daemon scores "
                              "each client between rounds, which a loop of its own cannot interleave); give the "
                              "clients' [data] test_fraction = 0, or run the label owner as the daemon")
        # Not CutServer's __init__: the state of its one data owner is each ``Peer``'s here.
        LoopServer.__init__(self, side, bounds, evaluate)
        self.vertical = exp.vertical
        self.owners = DataOwners(side)
        self.peers = self.owners.peers
        # ``step``: steps applied (vertical) or rounds done (clients); ``next_mb``: micro-batches of the step
        # (or turn) in progress replied to.
        self.turn = 0                    # clients: whose turn it is in the round
        self.unsent: list[tuple[Peer, Message]] = []      # replies to send at the next ``__next__``
        self.told: set[int] = set()      # peers that need no notice when this side stops (they know)
        self.waiting_logged: tuple[str, ...] = ()    # the silent data owners the last waiting warning named
        specs = [self._forward_specs(p).specs for p in self.peers]
        if self.test_rows is not None:      # the held-out rows' embeddings may exceed a batch
            specs += [self._forward_specs(p).with_rows(len(self.test_rows)).specs for p in self.peers]
        self._bind_socket(endpoint, specs, ctx, curve_secret, allow)

    # -- the batches
    def __next__(self) -> Batch:
        """The next micro-batch to compute (every party's, combined; or the next client's in turn); first
        sends the replies the loop made since the last call. Stops after every data owner's bye. Raises
        ``CutMisuse`` when the batch given out last has no reply, ``PeerTimeout`` when a data owner this
        side waits for stays silent for ``liveness_s + peer_deadline_s`` (naming it), ``PeerAborted`` when
        one said it stopped."""
        self._next_batch_asked()
        started = time.monotonic()
        while True:
            if self.failure is not None:
                raise self.failure
            if self.done or self._all_said_bye():
                self.done = True
                raise StopIteration
            self._score_held_out()
            batch = self._ready()
            if batch is not None:
                self.batch = batch
                return batch
            request = self._receive(started)
            if request is not None:
                self._answer(request, self._handle)

    def _ready(self) -> Batch | None:
        """The next batch when its data owners' forwards are all in, else None."""
        if self._complete():
            return None
        k, mb = self.step + 1, self.next_mb
        if self.vertical:
            taken = self.owners.take_all(k, mb)
            if taken is None:
                return None
            parts = tuple(h for h, _ in taken)
            rows = self.owners.common_rows(k, mb, self.mbs, [r for _, r in taken])
            if isinstance(rows, str):
                self.owners.give_back(mb)
                for p in self.peers:
                    if p.envelope is not None:
                        self.server.reply(p.envelope, wire.error_message(p.run, k, ErrorCode.MISMATCH, rows, mb,
                                                                         self.mbs))
                return None
            h = aggregate.combine(str(self.exp.aggregate), list(parts))
            h.setflags(write=False)
            return Batch(k, mb, self.mbs, h, rows, self, parts=parts)
        forward = self.owners.take_turn(self.turn, k, mb, self.mbs)
        return None if forward is None else Batch(k, mb, self.mbs, *forward, self, client=self.turn)

    def _awaited(self) -> list[Peer]:
        """The data owners this side waits for now: those whose part of the next batch is missing, or after
        the last step those that have not said bye."""
        if self._complete():
            return [p for p in self.peers if p.bye is None]
        key = (self.step + 1, self.next_mb)
        if self.vertical:
            return [p for p in self.peers if key not in p.waiting]
        return [self.peers[self.turn]]

    def _check_silence(self, started: float) -> None:
        """Log which data owners this side waits for once they are silent for ``liveness_s`` (and when they
        are back), as a daemon label owner does; ``PeerTimeout`` naming those silent for ``liveness_s +
        peer_deadline_s`` (counted from the start of this wait at the earliest)."""
        limit = self.bounds.liveness_s + self.bounds.peer_deadline_s
        now = time.monotonic()
        awaited = [(p, now - max(p.heard, started)) for p in self._awaited()]
        why = ("a step needs every feature party" if self.vertical and not self._complete()
               else "its turn has come" if not self._complete() else "its bye is due")
        lost = tuple(p.name for p, quiet in awaited if quiet > self.bounds.liveness_s)
        if lost and lost != self.waiting_logged:
            self.log.warning("waiting for %s: silent for more than %g s at step %d (%s); the others wait, up to "
                             "peer_deadline_s = %g s more", ", ".join(lost), self.bounds.liveness_s, self.step + 1,
                             why, self.bounds.peer_deadline_s)
        elif not lost and self.waiting_logged:
            self.log.info("%s back at step %d", ", ".join(self.waiting_logged), self.step + 1)
        self.waiting_logged = lost
        silent = [p for p, quiet in awaited if quiet > limit]
        if not silent:
            return
        names = ", ".join(p.name for p in silent)
        raise PeerTimeout(f"{names} of {self.exp.name} silent for more than {limit:g} s at step {self.step + 1} "
                          f"({why}; liveness {self.bounds.liveness_s:g} s + peer deadline "
                          f"{self.bounds.peer_deadline_s:g} s); restart it from its checkpoint, or every side from "
                          f"checkpoints of the same step"
                          f"{'; the last message refused here: ' + self.refused if self.refused else ''}")

    # -- the messages
    def _handle(self, envelope: list[bytes], msg: Message, peer_key: str) -> Any:
        """Answer ``msg`` (or keep a forward until its batch is ready); raises ``ProtocolError`` to refuse it
        (nothing changes then)."""
        if msg.type == wire.PING:
            now = time.monotonic()
            self.server.reply(envelope, pong(msg, self.side.stage, self.exp.name, run="", step=self.step,
                                             waiting_for=[p.role if self.vertical else p.index
                                                          for p in self._awaited()],
                                             client_live=any(now - p.heard < self.bounds.liveness_s
                                                             for p in self.peers)))
            return None
        if is_abort_notice(msg):
            self._aborted(msg, peer_key)
        if msg.type == wire.HELLO:
            self.server.reply(envelope, self._welcome(envelope, msg, peer_key))
            return None
        peer = self.owners.of_run(msg)
        if msg.type == wire.BYE and peer.bye is not None:
            self.server.reply(envelope, peer.bye)      # a repeated bye: its reply again
            return None
        check_owner(peer.owner, peer_key)
        if msg.type == wire.FORWARD:
            self._keep_forward(peer, envelope, msg)
        elif msg.type == wire.BYE:
            self._bye(peer, envelope, msg)
        elif msg.type == wire.EVALUATE:
            self._keep_evaluation(peer, envelope, msg)
        else:
            raise not_accepted(msg)
        peer.heard, peer.envelope = time.monotonic(), envelope
        return None

    def _aborted(self, msg: Message, peer_key: str) -> NoReturn:
        """A data owner's notice that it stopped: ``PeerAborted`` for the loop, now and later; the others
        are told when this side closes. A notice of no run served here, or from another key than the one
        that opened that run, is refused as the daemons refuse it (``unknown_run``, ``check_owner``) once
        every data owner has a run here; until then any is taken (a data owner may stop before its hello,
        e.g. its loop's first ``h`` has the wrong shape, while the others have begun)."""
        joined = [p for p in self.peers if p.run]
        sender = next((p for p in joined if p.run == msg.run), None)
        if len(joined) == len(self.peers) and sender is None:
            raise unknown_run(msg, f"one of the runs {self.owners.runs()}")
        if sender is not None:
            check_owner(sender.owner, peer_key, msg)
            self.told.add(sender.index)
        who = sender.name if sender is not None else "a data owner"
        self._peer_stopped(f"{abort_reason(msg)} ({who}, run {msg.run}; this side has applied {self.step} steps)")

    def _welcome(self, envelope: list[bytes], msg: Message, peer_key: str) -> Message:
        """Take a data owner's run up at its step, or at the step before it when its replies of that step
        are cached here; anything else is refused naming both steps (as with one data owner)."""
        body = msg.body
        peer = self.owners.of_hello(body)
        mbs = check_hello(body, peer.role, self.exp, self.exp.seed, peer.shape, here=self.side.stage)
        _, staleness = hello_fields(body, "this label owner trains in its own loop and predicts nothing")
        check_lockstep(staleness)
        held: list[int] = body.get("held")          # type: ignore[assignment]
        common_step([], held)                                    # validates ``held``
        now = time.monotonic()
        # A live run is busy whatever its step; a silent one mid-run cannot be taken over by another run.
        check_takeover(msg, peer.run, peer.since, now - peer.heard, self.bounds.liveness_s, peer.name, peer.step,
                       peer.taken, peer.owner, peer_key)
        self.owners.check_own(peer, msg.run, peer_key)
        if mbs != self.mbs and (self.step or self.next_mb or any(p.run for p in self.peers if p is not peer)):
            raise ProtocolError(ErrorCode.MISMATCH, f"hello asks for {mbs} micro-batches, but this run's other "
                                                    f"data owners take {self.mbs}")
        next_step = rejoin_step(held, peer.step, peer.cache, mbs, peer.name, msg.run)
        if msg.run != peer.run:
            self.log.info("%s starts run %s", peer.name, msg.run)
        peer.take_up(msg.run, peer_key, envelope, now, self.exp.codecs)
        self.mbs = mbs
        self.log.info("%s said hello (run %s, %d micro-batches); next step %d", peer.name, msg.run, mbs, next_step)
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.side.stage, "next_step": next_step})

    def _forward_specs(self, peer: Peer, mbs: int = 1) -> Expected:
        """What a forward of ``peer`` of one of ``mbs`` micro-batches carries (its rows with ``send_rows``)."""
        return self._forward_expected(peer.shape, mbs, self.exp.send_rows)

    def _keep_forward(self, peer: Peer, envelope: list[bytes], msg: Message) -> None:
        """Keep ``peer``'s forward until its batch is ready; a resent one gets its cached reply, or (the loop
        computes it now) its reply when it is made."""
        cached = peer.cache.get((msg.step, msg.mb))
        if cached is not None:
            self.server.reply(envelope, cached)      # a resent request: its reply again, computed once
            return
        k = peer.step + 1
        if msg.step == k and msg.mbs == self.mbs and 0 <= msg.mb < peer.taken:
            return                                   # resent while the loop computes it: replied when made
        check_forward_order(msg, k, msg.mb if peer.taken <= msg.mb < self.mbs else peer.taken, self.mbs,
                            self.exp.steps)
        h = self._forward_specs(peer, self.mbs).receive(msg, self.exp.allow_nonfinite)
        rows = None
        if self.exp.send_rows:
            refuse_rows(peer.data, msg, [r for mb, r in peer.step_rows.items() if mb != msg.mb])
            rows = np.array(msg.tensors["rows"])
            peer.step_rows[msg.mb] = rows
        peer.waiting[(msg.step, msg.mb)] = (h, rows)

    def _keep_evaluation(self, peer: Peer, envelope: list[bytes], msg: Message) -> None:
        """Keep ``peer``'s held-out embeddings until every party's of the step are in (``_score_held_out``); a
        resent evaluation gets its reply again."""
        _, test_rows = self._scored_rows("the data owners'")
        if (again := resent_evaluation(peer.evaluated, msg)) is not None:
            self.server.reply(envelope, again)
            return
        check_evaluation_step(msg, peer.step, peer.name, under_way=peer.taken)
        if msg.step != self.step + 1:       # every data owner evaluates between the run's steps
            raise ProtocolError(ErrorCode.STEP, f"evaluate for step {msg.step}, but this run has {self.step} steps "
                                                f"applied here: the held-out rows are scored between its steps")
        specs = self._forward_specs(peer).with_rows(len(test_rows))
        peer.evaluate = (msg.step, specs.receive(msg, self.exp.allow_nonfinite))

    def _score_held_out(self) -> None:
        """Once every party sent its held-out embeddings of the same step: combined as a batch is, scored by
        the loop's ``evaluate``, the same scores to each party (a daemon label owner's evaluation)."""
        if self.evaluate is None or self.test_rows is None:
            return
        parts = self.owners.held_out(self.step + 1)
        if parts is None:
            return
        h = aggregate.combine(str(self.exp.aggregate), parts)
        h.setflags(write=False)
        body = evaluation_scores(self.evaluate(h, self.test_rows), len(self.test_rows))
        for p in self.peers:
            p.evaluated = evaluation_reply(p.run, self.step + 1, body)
            p.evaluate = None
            if p.envelope is not None:
                self.server.reply(p.envelope, p.evaluated)

    def _bye(self, peer: Peer, envelope: list[bytes], msg: Message) -> None:
        """``peer``'s bye: it has applied its steps. A feature party says it after the last step (a step needs
        every party); a client may leave earlier, and its turns are skipped then."""
        check_bye(msg, peer.step, peer.name, peer.taken)
        if self.vertical and peer.step < self.exp.steps:
            raise ProtocolError(ErrorCode.STEP, f"bye after {peer.step} steps of {self.exp.steps}: every feature "
                                                f"party takes part in every step (end the run with every party's "
                                                f"loop, or stop it)")
        peer.bye = bye_reply(msg, peer.step)
        self.server.reply(envelope, peer.bye)
        self.log.info("%s finished run %s after %d steps", peer.name, peer.run, peer.step)
        if not self.vertical and not self._complete() and peer.index == self.turn and not self.next_mb:
            self._next_turn()

    # -- the replies
    def _reply(self, batch: Batch, loss: Any, grad: Any) -> None:
        value, nonfinite = self._checked(batch, loss, grad, batch.h.shape)
        peers = self.peers if batch.client is None else [self.peers[batch.client]]
        if nonfinite is not None:
            self._fail_peers(batch, peers, nonfinite)
        grads = (aggregate.split(str(self.exp.aggregate), np.ascontiguousarray(grad), self.owners.widths)
                 if self.vertical else [grad])
        stream = stream_name(GRADIENT, batch.mb, batch.mbs)
        try:
            # A part that is still the loop's array is copied (``owned_copy``): the loop may write it again.
            sent = [p.senders.message_tensors(GRADIENT, owned_copy(g) if np.may_share_memory(g, grad)
                                              else np.ascontiguousarray(g), stream, batch.step)
                    for p, g in zip(peers, grads)]
        except CodecRangeError as e:
            for p in peers:
                p.senders.discard()
            self._fail_peers(batch, peers, f"stage {self.side.stage}: {e}; nothing of this step was applied")
        body = {**peers[0].senders.reply_body(value), "compute_s": time.perf_counter() - batch.started}
        for p, tensors in zip(peers, sent):
            reply = Message(wire.BACKWARD, p.run, batch.step, batch.mb, batch.mbs, tensors=tensors, body=dict(body))
            p.cache[(batch.step, batch.mb)] = reply
            self.unsent.append((p, reply))
        batch.replied = True
        if not batch.last:
            self.next_mb += 1
            return
        for p in peers:
            p.step, p.taken, p.step_rows = batch.step, 0, {}
            p.senders.commit()
            p.cache = prune_replies(p.cache, p.step)
        self.next_mb = 0
        if self.vertical:
            self.step = batch.step
        else:
            self._next_turn()

    def _next_turn(self) -> None:
        """Clients: the next client in client order that has not said bye; after the last, the round is done."""
        following = [p.index for p in self.peers[self.turn + 1:] if p.bye is None]
        if following:
            self.turn = following[0]
            return
        self.step += 1
        staying = [p.index for p in self.peers if p.bye is None]
        self.turn = staying[0] if staying and not self._complete() else 0

    def _fail_peers(self, batch: Batch, peers: list[Peer], text: str) -> NoReturn:
        """The loop's step failed: its data owners are told (``nonfinite_step``) and need no other notice,
        the loop gets the error."""
        self.told.update(p.index for p in peers)
        self._fail_step(batch, text, [(p.run, p.envelope) for p in peers if p.envelope is not None])

    def _flush(self) -> None:
        unsent, self.unsent = self.unsent, []
        for peer, reply in unsent:
            if peer.envelope is not None:
                self.server.reply(peer.envelope, reply)

    def _drop_unsent(self) -> None:
        self.unsent = []

    # -- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint of this loop must hold to resume the cut, taken after the reply to a step's
        (with clients: a client's turn's) last micro-batch (``CutMisuse`` otherwise): the step, whose turn
        it is, and each data owner's run, step, replies of its last step and codec residuals, as plain
        values and numpy arrays."""
        self._check_savable()
        return {"version": STATE_VERSION, "interface": self.exp.interface_fingerprint, "step": self.step,
                "turn": self.turn, "micro_batches": self.mbs, "peers": self.owners.state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Stand where ``state`` (a ``state_dict`` of a server of this interface) says, before the first
        batch; every data owner says hello again. ``ConfigError`` naming what is wrong, before anything
        changes."""
        self._check_open()
        if any(p.joined for p in self.peers) or self.batch is not None:
            raise CutMisuse("load_state_dict after the run began; load it before the first batch "
                            "(or CutServer.bind(..., state=...))")
        step, mbs, turn, entries = check_group_state(state, self.exp, len(self.peers))
        loaded = [saved_peer(e, p.name, p.index, p.shape, self.side, step, turn, mbs)
                  for p, e in zip(self.peers, entries)]
        if not self.vertical and step < self.exp.steps and entries[turn]["finished"]:
            raise ConfigError(f"the state's turn is client {turn}'s, which said bye")
        self.owners.load(loaded, entries)
        self.step, self.turn, self.mbs = step, turn, mbs

    # -- the end
    def _complete(self) -> bool:
        """Every step of the run is replied to here."""
        return self.step >= self.exp.steps and not self.next_mb

    def _all_said_bye(self) -> bool:
        return self.owners.all_said_bye()

    _whose_bye = "every data owner's bye"

    def _byes_due(self) -> bool:
        return self._complete() and self.failure is None

    def _owing_bye_heard(self) -> float:
        return max([0.0] + [p.heard for p in self.peers if p.bye is None])

    def _no_bye_yet(self) -> str:
        return f"no bye from {', '.join(p.name for p in self.peers if p.bye is None)}"

    def _ended_runs(self) -> set[str]:
        return {p.run for p in self.peers if p.bye is not None}

    def _closing_text(self) -> str:
        return "this label owner is closing; its data owners said bye"

    def _serve(self, request: tuple[list[bytes], list[Any], str]) -> None:
        """Answer one request received while the byes are awaited; the held-out rows are scored once every
        party's are in."""
        self._answer(request, self._handle)
        self._score_held_out()

    def _waiting(self) -> list[Peer]:
        """The data owners heard from that have neither said bye nor stopped themselves."""
        return [p for p in self.peers if p.bye is None and p.index not in self.told and p.envelope is not None]

    def _waiting_places(self) -> dict[str, list[list[bytes]]]:
        """Each data owner that may wait (``_waiting``), where it was last heard from."""
        return {p.run: [p.envelope] for p in self._waiting() if p.envelope is not None}

    def _tell_stopped(self, reason: str, places: dict[str, list[list[bytes]]]) -> bool:
        """Tell the data owners at ``places`` that this side stopped (``reason``, ``_send_stop_notice``).
        Whether there was anyone to tell."""
        targets = self._waiting()
        now = time.monotonic()
        live = {p.run for p in targets if now - p.heard < self.bounds.liveness_s}
        told = self._send_stop_notice(places, live, reason)
        if targets:
            self.log.warning("told %s that this side stopped: %s", ", ".join(p.name for p in targets), reason)
        return told
