"""The serving stage: ``serve`` binds and answers the stage above it, one driver or several data owners.

The last stage computes the loss itself; a middle stage passes every request
on to the stage below it (``link.DownstreamLink``) and its own backward on up.
One state machine (``ServingStage``: the phases, the reply cache, liveness
and checkpoints) serves one peer (a two-stage run, a chain), the data owners
of an experiment with ``[clients]`` and the feature parties of a vertical
one: a ``Peer`` per peer, each with an explicit ``PeerStatus``. What differs
between these is its topology's (``topology.OnePeer``, ``topology.Clients``,
``parties.Parties``): who takes part in a step and in what order, what a
hello must agree on, how the messages of a step and the evaluations combine,
and what a rollback does. The topology decides and this stage acts: the
topology reads the run's state (``peers.RunState``, which only this stage
changes) and returns typed decisions (``decisions``: ``Take``, ``Computed``,
``Join``, ``Failure``, ``Evaluate``, ``Liveness``, ...), each applied here in
one place. The rules it shares with the cut library's
``CutServer`` and with ``distgrad predict`` (refusals, ping, the owner key,
step order, the bye and its replay, the reply and evaluation caches) are
``run.protocol``'s.

Every step of the run (a *round*) the peers taking part send their forwards,
in any order; this stage takes them in peer order (0, 1, ...), each peer's
micro-batches in order and then its update through the stage's
``StepEngine``. A request that arrives before its turn waits, unanswered,
until its turn comes, so the run is reproducible and bitwise equal to
``train_in_process``. The reply carrying the activation gradient leaves
first; the micro-batch's parameter gradients and the step's update run after
it (``settle``), so the stage above computes meanwhile. Nothing reads this
stage's state before they have run, and invalid input never changes state.

With one peer, a hello of the same run rolls both sides back to the newest
step they both hold; a hello of a new run replaces a run whose peer is gone.
With several, a peer this stage waits for that stays silent for
``liveness_s`` is dropped (the others go on) and may say hello again: it
takes part from the next round. With ``mode = "splitfed"``, after every
``average_every`` rounds each peer sends its parameters and gets back the
mean of all of them. A peer whose hello asks for an evaluation every K steps
(``eval_every``) is scored at the end of each K-th round, after the average,
before the next round starts, so every peer's score is that of the same
parameters as in ``train_in_process``. Checkpoints are taken at the end of a
round, after its average; with several clients each keeps the round's replies,
which a restarted stage gives again to a client whose reply the kill lost
(``kept_replies``).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

from distgrad.wire import messages as wire
from distgrad.run.accepts import Accepts
from distgrad.errors import CodecRangeError, ConfigError, DistgradError, NonFiniteError, PeerRejected, PeerTimeout, ProtocolError
from distgrad.config.experiment import client_stage_name, is_whole
from distgrad.run.metering import Metering, NoMetering, PeerMeters, step_rows
from distgrad.wire.link import DownstreamLink, evaluation_reply, is_final
from distgrad.run.options import StageOptions, StopFlag
from distgrad.run.parties import Parties
from distgrad.run.decisions import (Average, Computed, Evaluate, Failure, Gradients, Hearing, Join, Liveness,
                                    Resume, ScoreAgain, Transition)
from distgrad.run.peers import Envelope, Peer, PeerStatus, Phase, Reply, RunState
from distgrad.run.protocol import (abort_reason, bye_reply, check_bye, check_evaluation_step, check_forward_order,
                                   check_owner, check_served_staleness, decode_and_handle, hello_fields, log_refusal,
                                   not_accepted, pong, prune_replies, refusal, resent_evaluation, tell_why_stopped)
from distgrad.run.progress import StageRecords
from distgrad.stage.stage import Stage, backward_specs
from distgrad.run.stage_state import StageState, finished_run, lock_checkpoint_dir, nothing_to_do
from distgrad.threads import one_compute_thread
from distgrad.stage.records import writing
from distgrad.run.topology import Clients, OnePeer, Topology
from distgrad.wire.transport import NOTICE_LINGER_MS, POLL_TICK_S, Server
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import GRADIENT, stream_name

UNTOLD_WAIT_S = 10.0    # after one party stopped a run, how long the others' next requests are answered with why

# ``decode_and_handle``, ``hello_fields``, ``log_refusal`` and ``refusal`` are the protocol core's, named here too.
__all__ = ["Peer", "PeerStatus", "Phase", "ServingStage", "announce", "decode_and_handle", "hello_fields", "log_refusal",
           "refusal", "serve"]



class ServingStage:
    """Protocol logic of a serving stage, free of its own socket so tests can call it.

    ``handle(envelope, msg, now, peer_key)`` returns the replies to send now
    (to this peer or, when its message completed a turn, to others) and
    raises ``ProtocolError`` for a message that must be refused; a refused
    message changes nothing. The caller sends the replies and then calls
    ``settle``, which runs what ``handle`` deferred (``handle`` settles
    first, so a caller that never calls it sees the same results). ``tick(now)``
    drops or reports a silent peer. A middle stage ``connect``s to the stage
    below (``link``); a stage below that stays silent past ``peer_deadline_s``
    raises ``PeerTimeout``.

    This class is the one state machine of every topology: the phases, the
    reply cache, liveness and checkpoints; it alone changes the run's state
    (``run``, a ``peers.RunState``) and its peers. Who takes part in a step,
    what a hello must agree on and how the messages of a step combine is its
    ``topology``'s (``topology.OnePeer``, ``topology.Clients``,
    ``parties.Parties``), which reads ``run`` and returns its decisions
    (``decisions``); each kind is applied here in one place (``apply_join``,
    ``apply_computed``, ``apply_failure``, ``apply_liveness``, ``apply_resume``,
    ``answer``, ``transition``).
    """

    def __init__(self, opts: StageOptions, connect: str | None = None, stop: StopFlag | None = None,
                 ctx: zmq.Context | None = None) -> None:
        self.opts, self.exp = opts, opts.experiment
        self.exp.check_role(opts.stage, binds=True, connects=connect is not None)
        self.parties = self.exp.upstream(opts.stage)   # the stages above (a vertical experiment's parties)
        self.upstream = self.parties[0]
        self.run = RunState(peers=[], steps=None, now=time.monotonic())
        self.topology = topology_for(self)
        self.count = self.topology.count
        self.run.peers = [Peer(c) for c in range(self.count)]
        # With several peers this stage runs its own steps; one peer says when its run ends (bye).
        self.run.steps = self.topology.steps()
        self.state = StageState(opts, checkpoint_each_step=False)
        self.log = self.state.log
        self.engine = self.state.engine
        # The last stage reads only the targets (a shard per data owner); a middle one only how many rows are
        # held out (its stage file may hold no data: it then evaluates nothing).
        holds_data = self.exp.spec(opts.stage).data != {}
        self.data = self.topology.build_data(opts.seed, opts.stage) if holds_data else []
        # The label owner's privacy meter: the gradient rows it sends, against its own labels (several data
        # owners: one meter per client or feature party, each reading what that one receives).
        self.metering: Metering | PeerMeters | NoMetering = NoMetering()
        if opts.meter_kind and (self.exp.federated or self.exp.vertical):
            first = self.exp.stage_names[0]
            names = [client_stage_name(first, p.index) if self.exp.federated else self.parties[p.index]
                     for p in self.run.peers]
            self.metering = PeerMeters(self.engine, names, [self.topology.stream(p) for p in self.run.peers],
                                       [source.true_targets for source in self.data],
                                       [step_rows(source) for source in self.data], 0,
                                       clients=self.exp.federated, log=self.log)
        elif opts.meter_kind:
            self.metering = Metering(opts.meter_kind, self.engine, lambda step: self.data[0].true_targets(step), 0,
                                     log=self.log, rows_of=step_rows(self.data[0]))
        self.input_shapes = [self.topology.input_shape(index) for index in range(self.count)]
        self.codecs = self.exp.codecs
        self.link = None if connect is None else DownstreamLink(
            opts.link, connect, (stop or StopFlag()).check, ctx or zmq.Context.instance(), opts.downstream_security,
            backward_specs(self.stage, 1, self.codecs[GRADIENT]))
        self.accepts = Accepts(self.state, self.exp, self.input_shapes, self.data, self.link is not None,
                               self.upstream, opts.seed, opts.init)
        self.max_frame_bytes, self.max_tensor_bytes = self.accepts.max_frame_bytes, self.accepts.max_tensor_bytes
        self.metrics = self.exp.spec(opts.stage).metrics   # the last stage's held-out scores beyond the loss
        self.evaluating = False                            # some peer's evaluation waits (``advance``)
        self.new_run(start_round=1)
        self.finished: dict[str, Any] | None = None       # summary of the last completed run
        self.deferred: Gradients | None = None             # gradients (and update) of a micro-batch answered
        self.notices: list[Reply] = []                     # error replies to parties a rollback made stale
        self.untold: dict[str, str] = {}                   # a failed run's parties not yet told why (by run id)
        self.told_below = False                            # a middle stage passed an aborted notice down
        # What handles each message of a peer's run, by type (hello and ping: ``handle`` itself).
        self.handlers: dict[str, Callable[[Peer, Envelope, Message], list[Reply]]] = {
            wire.FORWARD: self._forward, wire.AVERAGE: self._average, wire.EVALUATE: self._evaluate,
            wire.BYE: self._bye, wire.ERROR: self._notice}
        if isinstance(self.metering, (Metering, PeerMeters)):
            self.state.keep("meter", self.metering)       # checkpointed with the stage: it outlives a restart
        if opts.resume and self.state.resume_latest():
            now = time.monotonic()
            self.apply_resume(self.topology.resumed(now), now)
            self.state.open_trace(append=True)

    # -- the run, as tests and tools read it
    @property
    def stage(self) -> Stage:
        return self.state.stage

    @property
    def peers(self) -> list[Peer]:
        return self.run.peers

    @peers.setter
    def peers(self, peers: list[Peer]) -> None:
        self.run.peers = peers

    @property
    def steps(self) -> int | None:
        """The run's steps when this stage counts them (several peers; early stopping ends them sooner)."""
        return self.run.steps

    @property
    def phase(self) -> Phase:
        return self.run.phase

    @property
    def round(self) -> int:
        return self.run.round

    @property
    def order(self) -> list[int]:
        return self.run.order

    @property
    def turn(self) -> int:
        return self.run.turn

    @property
    def owed(self) -> set[int]:
        return self.run.owed

    @property
    def active(self) -> bool:
        return self.run.active

    @property
    def lost_since(self) -> float | None:
        return self.run.lost_since

    @property
    def rounds_done(self) -> int:
        """Rounds (steps of the run) this stage has completed."""
        return self.run.rounds_done

    def encode(self, direction: str, x: np.ndarray, stream: str, step: int,
               rows: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The message tensors of ``x`` sent on ``stream`` (holding the peer's ``rows`` with ``send_rows``);
        a value its codec cannot carry fails the step (``NonFiniteError``: it would cross as Inf), naming the
        codec, the tensor and the step."""
        try:
            return self.engine.senders.message_tensors(direction, x, stream, step, rows)
        except CodecRangeError as e:
            raise NonFiniteError(f"stage {self.opts.stage}: {e}; nothing of this step was applied") from e

    def new_run(self, start_round: int, fresh: bool = True) -> None:
        """Wait for the peers of a run whose first round is ``start_round``; ``fresh``: a new run (not
        the same one going on after a rollback)."""
        run = self.run
        run.phase = Phase.JOINING
        run.round = start_round - 1
        run.order, run.turn, run.owed = [], 0, set()
        run.first_hello, run.lost_since = None, None
        run.joined_at = run.now
        self.closing = False                # its last bye was answered; ``finish_run`` completes it
        self.failure: DistgradError | None = None    # the one peer's run failed: it ends once told
        if fresh:
            self.metering.reset()
            self.started = time.perf_counter()
            self.loss: float | None = None
            run.active = False
        self.state.extra_meta, self.state.extra_arrays = self.topology.checkpoint_meta, self.topology.checkpoint_arrays

    def open_run(self) -> None:
        """A run is open from the first hello of several peers; this stage names it (each peer has its own)."""
        if not self.run.active:
            self.run.active = True
            if not self.state.run_id:
                self.state.begin(uuid.uuid4().hex)

    def live(self, now: float) -> bool:
        return self.run.active and any(p.live(now, self.opts.liveness_s) for p in self.run.peers)

    # -- messages
    def handle(self, envelope: Envelope, msg: Message, now: float, peer_key: str = "") -> list[Reply]:
        """The replies to ``msg`` (from ``envelope``, authenticated as ``peer_key``, "" in plaintext).

        With CURVE, a peer's run belongs to the key that opened it: other keys
        may not drive, rewind or end it.
        """
        self.run.now = now
        earlier = self.settle() if self.deferred is not None else []
        if msg.type == wire.PING:
            return earlier + [(envelope, self._pong(msg, now))]
        if msg.type == wire.HELLO:
            welcome = self._hello(envelope, msg, now, peer_key)
            notices, self.notices = self.notices, []
            return earlier + notices + [(envelope, welcome)] + self.advance(now)
        resent = self.topology.resent_reply(msg, peer_key)
        if isinstance(resent, ScoreAgain):              # the evaluation of a restarted stage's last round
            return earlier + [(envelope, reply) for _, reply in self.answer((resent.peer,), [resent.request])]
        if resent is not None:                          # answered before: the same reply
            return earlier + [(envelope, resent)]
        peer = self.topology.peer_of(msg)
        check_owner(peer.owner, peer_key, msg)
        if peer.status is PeerStatus.STALE and msg.type != wire.BYE:
            raise ProtocolError(ErrorCode.RUN, f"the run went back to step {self.run.round}: "
                                               f"{self.topology.name(peer)} must say hello again")
        if peer.failure is not None:
            failure, peer.failure = peer.failure, None
            self.apply_failure(self.topology.failed(peer, failure))
            raise ProtocolError(ErrorCode.NONFINITE_STEP, str(failure))
        handler = self.handlers.get(msg.type)
        if handler is None:
            raise not_accepted(msg)
        replies = handler(peer, envelope, msg)
        self._seen(peer, now)
        peer.envelope = envelope
        return earlier + replies + self.advance(now)

    def _pong(self, msg: Message, now: float) -> Message:
        return pong(msg, self.opts.stage, self.exp.name, run=self.topology.pong_run(),
                    step=self.topology.reported_step(), client_live=self.live(now), phase=self.run.phase.value,
                    clients_active=sum(p.taking_part() for p in self.run.peers), **self.topology.pong_fields(now))

    def _seen(self, peer: Peer, now: float) -> None:
        """A message from ``peer``: a sign of life, unless its topology says otherwise (``Hearing``)."""
        hearing = self.topology.heard(peer)
        if hearing is Hearing.IGNORED:
            return
        if hearing is Hearing.BACK:
            self.run.lost_since = None
        peer.last_seen = now

    def _hello(self, envelope: Envelope, msg: Message, now: float, peer_key: str) -> Message:
        """A peer (re)joins: the hello is checked (``ProtocolError``), then its topology places it."""
        topology, body = self.topology, msg.body
        index = topology.peer_index(body)          # whose hello, first: as every serving end asks
        mbs = topology.check_hello(body)
        eval_every, staleness = hello_fields(body)
        topology.check_staleness(staleness)
        check_served_staleness(self.exp, staleness)
        peer = self.run.peers[index]
        topology.check_owner(peer, msg, peer_key)
        topology.runs.clear()                       # whose run is whose may change: ``peer_of`` looks again
        joined = topology.join(peer, msg, mbs, eval_every, peer_key, now)
        self.apply_join(peer, joined)
        self.expect(peer, mbs)
        peer.eval_every, peer.staleness = eval_every, staleness
        peer.steps = body["steps"] if is_whole(body.get("steps")) else 0
        self.metering.set_run(eval_every, body.get("steps"))   # windows follow the evaluations, end as it says
        peer.waiting, peer.average, peer.evaluate, peer.failure = {}, None, None, None
        if not joined.still_owes:
            self.run.owed.discard(peer.index)       # it starts again after the step it would have evaluated
        self._seen(peer, now)
        peer.envelope = envelope
        if self.run.first_hello is None:
            self.run.first_hello = now
        self.log.info("%s said hello (run %s, %d micro-batches): next step %d", topology.name(peer), msg.run, mbs,
                      joined.next_step)
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.opts.stage, "next_step": joined.next_step})

    def apply_join(self, peer: Peer, d: Join) -> None:
        """Place ``peer`` as its topology decided (``Join``): the run this stage opens, rolls back to, begins
        or restarts for it, the other parties made stale, then the peer's own record."""
        if d.open_run:
            self.open_run()
        if d.rollback is not None:
            self.state.rollback(d.rollback)
        if d.begin:
            self.state.begin(d.run, owner=d.owner)
            self.finished, self.run.bye_replies = None, {}
            peer.evaluation, peer.evaluated, peer.tested, peer.loss = None, None, None, None
        if d.restart:
            self.new_run(start_round=d.step + 1, fresh=d.begin)
            self.run.active = True
        if d.stale:
            self._make_stale(peer, d.stale)
        if d.kept is None:
            peer.cached = {}
        else:
            first, last = d.kept
            peer.cached = {k: v for k, v in peer.cached.items() if first <= k[0] <= last}
        peer.run, peer.owner, peer.since = d.run, d.owner, d.since
        peer.status, peer.step = d.status, d.step
        if d.reset_engine:
            self.engine.reset()

    def _make_stale(self, cause: Peer, text: str) -> None:
        """Every party but ``cause`` must say hello again (the run went back): the replies they wait for
        are dropped, and each request of theirs waiting here gets an error reply saying ``text``."""
        for other in self.run.peers:
            other.cached = {}
            if other is cause or other.status is not PeerStatus.ACTIVE:
                continue
            self.notices += [(other.envelope, wire.error_message(m.run, m.step, ErrorCode.RUN, text, m.mb, m.mbs))
                             for m in other.waiting.values()]
            if other.evaluate is not None:
                m = other.evaluate
                self.notices.append((other.envelope, wire.error_message(m.run, m.step, ErrorCode.RUN, text)))
            other.status, other.waiting, other.evaluate = PeerStatus.STALE, {}, None

    def apply_resume(self, d: Resume, now: float) -> None:
        """Go on with the run of the checkpoint just loaded (``Resume``): the peers' runs as saved, the
        replies kept with it, and one peer's round at once."""
        for saved in d.peers:
            peer = self.run.peers[saved.peer]
            peer.run, peer.owner, peer.loss = saved.run, saved.owner, saved.loss
            if saved.step is not None:
                peer.step = saved.step
            if saved.status is not None:
                peer.status, peer.last_seen = saved.status, now
        self.new_run(start_round=d.round, fresh=False)     # the same run goes on: the meter keeps what it loaded
        self.run.active, self.run.now = True, now
        for index, (replies, averaged) in d.kept.items():
            peer = self.run.peers[index]
            peer.cached.update(replies)
            if averaged is not None:
                peer.averaged = averaged
        if d.begin_round:
            peer = self.run.peers[0]
            self.expect(peer, peer.mbs)             # until its hello says otherwise
            self.start_round()

    def expect(self, peer: Peer, mbs: int) -> None:
        """``peer`` sends ``mbs`` micro-batches a step: what its forwards carry and the stream of each reply's
        gradient (``topology.stream``), found once per hello rather than per message."""
        peer.mbs, peer.specs = mbs, self.accepts.forward(mbs, peer.index)
        peer.streams = [stream_name(GRADIENT, mb, mbs, self.topology.stream(peer)) for mb in range(mbs)]

    def refused_below(self, e: PeerRejected, msg: Message) -> ProtocolError:
        """A refusal from the stage below, passed up with its code (so the driver can shake hands again)."""
        below = self.exp.stage_names[self.exp.stage_index(self.opts.stage) + 1]
        return ProtocolError(e.code, f"stage {below} refused {msg.type} step {msg.step}: {e.peer_message}")

    def _forward(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        key = (msg.step, msg.mb)
        cached = peer.cached.get(key)
        if cached is not None:
            self._same_as_first(peer, key, msg)
            return [(envelope, cached)]                 # a repeated request: same reply, no second update
        if peer.status is PeerStatus.DROPPED:
            raise ProtocolError(ErrorCode.RUN, f"client {peer.index} was dropped (silent for more than "
                                               f"{self.opts.liveness_s:g} s when its turn came); say hello again")
        if key in peer.waiting and msg.mbs == peer.mbs:     # another count is refused below, as it is first
            digest = frames_digest(msg) if self.state.ledger is not None else None   # before it is read
            self.accepts.receive(peer, msg)
            peer.waiting[key] = msg                     # resent while waiting for its turn: still waiting,
            if digest is not None:                      # and this is what the step will be computed on
                peer.received[key] = digest
            return []
        stopped_at = self.state.verdicts.stopped_at
        if stopped_at and msg.step > stopped_at:        # the parties stop there; a data owner that goes on is refused
            raise ProtocolError(ErrorCode.STEP, f"forward for step {msg.step}: early stopping ended the run after "
                                                f"step {stopped_at} (the evaluation after it said stop); say bye")
        check_forward_order(msg, peer.step + 1, self.taken(peer), peer.mbs)
        if self.state.ledger is not None:               # kept while its reply may be asked for again
            peer.received = {k: v for k, v in peer.received.items() if k in peer.cached or k in peer.waiting}
            peer.received[key] = frames_digest(msg)
        self.accepts.receive(peer, msg)                 # checked, and decoded: nothing else sees parts
        peer.waiting[key] = msg                         # answered in its turn (``advance``)
        return []

    def taken(self, peer: Peer) -> int:
        """How many micro-batches of ``peer``'s next step this stage has taken: computed (in its turn) or
        waiting for it. The next forward must be that micro-batch; a bye, none (between steps)."""
        return (self.engine.done if self.topology.in_turn(peer) else 0) + len(peer.waiting)

    def _same_as_first(self, peer: Peer, key: tuple[int, int], msg: Message) -> None:
        """A resent forward answered from the reply cache by a stage whose defense draws noise must carry the
        tensors the first one did: ``ProtocolError`` (code ``stage``) otherwise, nothing changes."""
        first = peer.received.get(key)
        if self.state.ledger is None or first is None or msg.frames is None or frames_digest(msg) == first:
            return
        raise ProtocolError(ErrorCode.STAGE, f"step {msg.step} micro-batch {msg.mb} is sent again with other "
                                             f"activations than the first time (computed again on other input): "
                                             f"refused; its first answer stands")

    def _average(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        """A SplitFed peer's parameters for the average after its round (answered once every peer's are
        in: ``advance``); a resent request gets the same reply."""
        again = self.topology.check_average(peer, msg)
        if again is not None:
            return [(envelope, again)]
        peer.average = msg
        return []

    def _evaluate(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        self.accepts.evaluation(peer.index, msg).receive(msg, self.exp.allow_nonfinite)
        if is_final(msg):                               # the test rows are scored once: a resent one, same reply
            again = resent_evaluation(peer.tested, msg) or self._tested_before(msg)
            if again is not None:
                peer.tested = again
                return [(envelope, again)]
            last = self.state.verdicts.stopped_at or self.run.steps or peer.steps
            if last and msg.step != last + 1:
                raise ProtocolError(ErrorCode.STEP, f"a final evaluation (the kept model on the test rows) comes "
                                                    f"once, after the run's last step, {last}; got one after step "
                                                    f"{msg.step - 1}")
        elif self.run.steps is not None and (again := resent_evaluation(peer.evaluated, msg)) is not None:
            return [(envelope, again)]                    # resent: the same scores
        else:
            check_evaluation_step(msg, peer.step, self.topology.name(peer), peer.staleness, self.taken(peer))
        # Several peers: answered at the end of its round when its hello's eval_every says it is due then
        # (``round_done``), else once every round is done.
        peer.evaluate = msg
        self.evaluating = True
        return []

    def _notice(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        """An aborted notice from the peer whose run it is: as its topology says (``Topology.notice``). When
        that ends a run of several parties, every other party is told why (``_tell_the_others``)."""
        failure = self.topology.notice(peer, msg)
        self.apply_failure(failure)
        if failure.ends_run and self.link is not None:     # a middle stage: the stages below stop at once too
            self.link.send(wire.abort_notice(msg.run, self.opts.stage, f"the stage above stopped: {abort_reason(msg)}"))
            self.told_below = True
        return self._tell_the_others(peer, failure.error) if failure.ends_run and self.count > 1 else []

    def _tell_the_others(self, cause: Peer, error: DistgradError) -> list[Reply]:
        """The run ends because ``cause`` stopped: each other party's requests waiting here are answered with
        why (code ``aborted``, so its driver stops at once instead of waiting out its deadline); the parties
        with none waiting are ``untold`` (run id -> the text), which ``answer_untold`` answers next."""
        text = f"the run ends: {self.topology.name(cause)} stopped: {error}"
        replies: list[Reply] = []
        for other in self.run.peers:
            if other is cause or not other.run or other.status is PeerStatus.FINISHED:
                continue
            pending = [*other.waiting.values(), *([other.evaluate] if other.evaluate is not None else [])]
            replies += [(other.envelope, wire.error_message(m.run, m.step, ErrorCode.ABORTED, text, m.mb, m.mbs))
                        for m in pending]
            other.waiting, other.evaluate = {}, None
            if not pending:
                self.untold[other.run] = text
        return replies

    def answer_untold(self, msg: Message) -> list[Message]:
        """After a run of several parties ended because one stopped: the reply to ``msg`` from a party not yet
        told why (``_tell_the_others``; an ``aborted`` error), which is then told; nothing for another."""
        text = self.untold.pop(msg.run, None)
        return [] if text is None else [wire.error_message(msg.run, msg.step, ErrorCode.ABORTED, text, msg.mb,
                                                           msg.mbs)]

    def _bye(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        check_bye(msg, peer.step, self.topology.name(peer), self.taken(peer))
        if self.link is not None:
            try:
                self.link.exchange(Message(wire.BYE, msg.run, msg.step, body={"steps": peer.step}))
            except PeerRejected as e:
                raise self.refused_below(e, msg) from e
        if peer.status is not PeerStatus.FINISHED:
            self.log.info("%s finished after %d steps", self.topology.name(peer), peer.step)
        peer.status = PeerStatus.FINISHED
        reply = bye_reply(msg, peer.step)
        self.run.bye_replies[msg.run] = reply
        # The checkpoint and the summary (slow for a big model) are written by ``finish_run``
        # after this reply has left, so the driver never waits for them.
        self.closing = self.complete()
        return [(envelope, reply)]

    # -- the phases
    def start_round(self) -> None:
        """The next round, or the end of the run after the last. A peer rejoining takes part from it."""
        run = self.run
        run.round += 1
        if run.steps is not None and run.round > run.steps:
            run.phase = Phase.DONE
            self.log.info("every step is done; answering evaluations and byes")
            return
        for peer in run.peers:
            if peer.status is PeerStatus.REJOINING:
                peer.status = PeerStatus.ACTIVE
        run.order = self.topology.round_order()
        run.turn, run.phase = 0, Phase.ROUND

    def advance(self, now: float) -> list[Reply]:
        """Do every piece of work whose inputs have arrived, in the fixed order; return the replies."""
        replies: list[Reply] = []
        while self.deferred is None and self._advance_phase(now, replies):
            pass                            # a reply's gradients and update come before any later work
        if self.evaluating:
            answers = self.topology.answer_evaluations()
            if answers is not None:
                replies += self._answer_all(answers)
            self.evaluating = any(peer.evaluate is not None for peer in self.run.peers)
        return replies

    def _advance_phase(self, now: float, replies: list[Reply]) -> bool:
        """Do the next piece of work of the phase, adding its replies; False while it waits."""
        phase = self.run.phase
        if phase is Phase.ROUND:            # the hot path first
            take = self.topology.advance_round()
            if isinstance(take, Transition):
                return take is not Transition.WAIT and self.transition(take)
            msgs = [peer.waiting.pop(take.key) for peer in take.peers]
            replies += self.apply_computed(self.topology.compute(take.peers, msgs, now), now)
            return True
        if phase is Phase.JOINING:
            return self.transition(self.topology.advance_joining(now))
        if phase is Phase.AVERAGING:
            average = self.topology.advance_averaging()
            if average is None:
                return False
            replies += self._averaged(average, now)
            return True
        if phase is Phase.EVALUATING:
            evaluate = self.topology.advance_evaluating()
            if evaluate is None:
                return False
            replies += self._answer_all(evaluate)
            self.run.owed -= {peer.index for group in evaluate.groups for peer in group}
            if evaluate.then_start:
                self.run.owed = set()
                self.start_round()
            return evaluate.then_start
        return False

    def transition(self, to: Transition) -> bool:
        """Move the phase on as the topology decided; False for ``WAIT``."""
        if to is Transition.WAIT:
            return False
        if to is Transition.NEXT_TURN:
            self.run.turn += 1
        elif to is Transition.START_ROUND:
            self.start_round()
        elif to is Transition.END_ROUND:
            self.end_round()
        else:                               # ROUND_DONE: the round before the first, done before
            self.run.order = self.topology.round_order()
            self.round_done()
        return True

    def end_round(self) -> None:
        """Every peer of the round had its turn: its average (SplitFed), or its checkpoint and the next round.
        A round with an average is checkpointed with it (``_averaged``), never without it."""
        run = self.run
        if self.exp.clients.mode == "splitfed" and run.round % self.exp.clients.average_every == 0:
            run.phase = Phase.AVERAGING
            return
        self.state.after_step(run.round)
        self.round_done()

    def _averaged(self, d: Average, now: float) -> list[Reply]:
        """SplitFed: each peer of the round gets back the mean (``Average``); then the round's checkpoint,
        taken before these replies leave, holds them: a client whose reply the stage's kill lost gets it
        from the restarted stage (``Clients.resent_reply``)."""
        replies = []
        for p in d.peers:
            p.averaged = Message(wire.AVERAGE, p.run, self.run.round, tensors=d.mean)
            p.average, p.last_seen = None, now
            replies.append((p.envelope, p.averaged))
        self.state.after_step(self.run.round)
        self.round_done()
        return replies

    def round_done(self) -> None:
        """After a round (and its average): the peers due to evaluate after it are answered (phase
        EVALUATING) before the next round starts."""
        owed = self.topology.owed_after_round()
        if owed:
            self.run.owed, self.run.phase = owed, Phase.EVALUATING
            return
        self.start_round()

    # -- evaluations
    def _answer_all(self, d: Evaluate) -> list[Reply]:
        replies: list[Reply] = []
        for group in d.groups:
            requests = [peer.evaluate for peer in group]
            replies += self.answer(group, [m for m in requests if m is not None])
        return replies

    def answer(self, group: tuple[Peer, ...], requests: list[Message]) -> list[Reply]:
        """Score ``group``'s evaluation ``requests`` (``topology.score``), give the verdicts and answer each
        peer; no state changes but the peers' last evaluation (and the verdicts recorded). The final
        evaluation (``Scores.final``: the kept model's test rows) is recorded instead (``StageState.record_test``;
        with several clients, each client's own summary holds its figures), never judged."""
        scores = self.topology.score(group, requests)
        result = scores.result
        if result is not None and scores.final:
            if not self.exp.federated:
                self.state.record_test(result, self.topology.checkpoint_step())
        elif result is not None:
            result = self.judged(scores.step, result, scores.last)
        replies = []
        for peer, msg in zip(group, requests):
            peer.evaluate = None
            if result is None:
                code, text = scores.error or (ErrorCode.STAGE, "")
                replies.append((peer.envelope, wire.error_message(msg.run, msg.step, code, text)))
            elif scores.final:
                peer.tested = evaluation_reply(msg.run, msg.step, result)
                replies.append((peer.envelope, peer.tested))
            else:
                peer.evaluation = result
                peer.evaluated = evaluation_reply(msg.run, msg.step, result)
                replies.append((peer.envelope, peer.evaluated))
        return replies

    def _tested_before(self, msg: Message) -> Message | None:
        """A final evaluation this stage scored before it was restarted (its checkpoint holds the scores,
        ``StageState.final_test``): the reply, from those scores, without scoring the test rows again."""
        test = self.state.final_test
        if test is None or msg.run != self.state.run_id or msg.step != test["after"] + 1:
            return None
        return evaluation_reply(msg.run, msg.step, test)

    def judged(self, step: int, result: dict[str, Any], last: int | None) -> dict[str, Any]:
        """``result`` of the evaluation after ``step`` with its verdicts (``StageState.judged``; ``last``:
        the run's last step); early stopping ends the rounds after ``step`` when this stage counts them."""
        result = self.state.judged(step, result, step == last, gives=self.link is None)
        if result.get("stop") and self.run.steps is not None:
            self.run.steps = step
        return result

    # -- a micro-batch
    def apply_computed(self, d: Computed, now: float) -> list[Reply]:
        """What computing a micro-batch gave (``Computed``): its replies (each cached, its peer seen, when
        the step went through), the gradients deferred until they have left, or the failure (raising the
        refusal, if any, after it)."""
        if d.failure is not None:
            self.apply_failure(d.failure)
        if d.refusal is not None:
            raise d.refusal
        if d.gradients is not None:
            key = (d.gradients.step, d.gradients.mb)
            for peer, reply in d.answers:
                peer.cached[key] = reply
                peer.last_seen = now
            self.deferred = d.gradients
        return [(peer.envelope, reply) for peer, reply in d.answers]

    def accumulate(self, g: Gradients) -> None:
        """A micro-batch's parameter gradients, added in micro-batch order; after the last, the update
        (``g.peers``: whose turn it is, every party of a vertical round) and the next step's targets looked
        up (``Topology.prefetch``). After a step's first micro-batch each peer holds every reply of its earlier
        steps but those still in flight (staleness), so its reply cache keeps only these and this reply."""
        if g.mb == 0:           # in lockstep only this step's replies may be asked for again
            for peer in g.peers:
                peer.cached = prune_replies(peer.cached, g.step - peer.staleness)
        self.engine.add(g.mb, g.mbs, g.later(), g.loss, g.dx)
        if g.mb < g.mbs - 1:
            return
        self.loss = self.engine.update(g.step, g.mbs, client=g.client)
        for peer in g.peers:
            peer.loss, peer.step = self.loss, g.step
        self.run.turn += 1
        self.topology.prefetch(g.data, g.step + 1)

    def settle(self) -> list[Reply]:
        """Run what ``handle`` deferred until its reply had been sent (gradients, update, pruning the reply
        cache), if any; return the replies of the work that then became possible (send, then settle again).

        A non-finite gradient there applies nothing; the peer hears of it in
        reply to its next message (with several clients, it is dropped)."""
        gradients, self.deferred = self.deferred, None
        if gradients is None:
            return []
        try:
            self.accumulate(gradients)
        except NonFiniteError as e:
            self.log.error("%s", e)
            self.apply_failure(self.topology.deferred_failed(gradients.peers, e))   # whose micro-batch it was
        return self.advance(self.run.now)

    def apply_failure(self, d: Failure) -> None:
        """A failed step, as its topology decided (``Failure``)."""
        for peer in d.peers:
            if d.clear_waiting:
                peer.waiting.clear()
            if d.told_later:
                peer.failure = d.error
            if d.drop:
                self.drop(peer)
        if d.reset_engine:
            self.engine.reset()
        if d.ends_run:
            self.failure = d.error

    def drop(self, peer: Peer) -> None:
        """``peer`` no longer takes part (it may say hello again); its turn, if it was, ends."""
        if self.topology.current() is peer:
            self.engine.reset()
            self.run.turn += 1
        peer.status, peer.waiting = PeerStatus.DROPPED, {}
        self.run.owed.discard(peer.index)

    # -- liveness and the end of the run
    def tick(self, now: float) -> list[Reply]:
        """Report (one peer, parties) or drop (several clients) a peer this stage waits for that has been
        silent for ``liveness_s``; return the replies that unblocks."""
        self.run.now = now
        if not self.run.active:
            return []
        return self.apply_liveness(self.topology.tick(now), now)

    def apply_liveness(self, d: Liveness, now: float) -> list[Reply]:
        """Drop the silent peers its topology gave up on (``Liveness``), note since when the run is lost,
        and do the work that unblocks."""
        for peer in d.drop:
            self.drop(peer)
        self.run.lost_since = d.lost_since
        if d.drop:
            self.closing = self.complete()
        return self.advance(now) if d.drop or d.advance else []

    def missing_parties(self, now: float) -> list[Peer]:
        """The feature parties a vertical run waits for that have been silent for ``liveness_s``."""
        return self.topology.missing(now)

    def lost_message(self) -> str:
        """Why ``serve`` gives up on a run whose peers stayed lost for ``peer_deadline_s``."""
        return self.topology.lost_message()

    def complete(self) -> bool:
        """The run is over: its rounds are done (several peers) and every peer still taking part has said
        bye, one at least."""
        if self.run.steps is not None and self.run.phase is not Phase.DONE:
            return False
        return (all(p.status is not PeerStatus.ACTIVE for p in self.run.peers)
                and any(p.status is PeerStatus.FINISHED for p in self.run.peers))

    def finish_run(self) -> dict[str, Any] | None:
        """Complete the run whose last bye was answered: final checkpoint and summary (returned)."""
        if self.deferred is not None:
            self.settle()
        if not self.closing:
            return None
        self.closing = False
        # a rerun with --resume has nothing to do
        self.state.save(self.topology.checkpoint_step(), final_loss=self.loss, finished=True)
        self.state.save_parameters()
        done = self.topology.checkpoint_step()      # several clients: the rounds, not the updates
        self.metering.finish(self.stage.step if done is None else done)
        self.finished = self.close_run("completed")
        return self.finished

    def end_failed_run(self) -> DistgradError | None:
        """Once the one peer whose step failed has been told: close its run ("failed", no checkpoint
        written) and return the failure; None while there is none."""
        failure, self.failure = self.failure, None
        if failure is not None and self.run.active:
            self.close_run("failed")
        return failure

    def at_round_boundary(self) -> bool:
        """Between rounds: the live state is a whole step of the run (what a checkpoint may hold)."""
        return self.topology.at_round_boundary()

    def close_run(self, status: str) -> dict[str, Any]:
        """End the run with ``status``: its summary (returned); nobody takes part in it any more."""
        self.settle()
        summary = self.state.summary(status, self.started, self.loss, **self.topology.summary_fields(),
                                     **self.metering.summary_fields())
        self.state.close()
        self.run.active = False
        for peer in self.run.peers:
            peer.cached = {}
            if peer.taking_part():
                peer.status = PeerStatus.ABSENT     # the run is over: nobody takes part in it any more
        return summary


def topology_for(serving: ServingStage) -> Topology:
    """The topology of the stage ``serving`` (built as far as its ``exp`` and ``parties``): the feature
    parties of a vertical experiment (one party too when the label owner has its own ``bottom``: its embedding
    joins the party's), several clients, or one peer."""
    exp = serving.exp
    if exp.vertical and (len(serving.parties) > 1 or exp.own_bottom):
        return Parties(serving, len(serving.parties))
    if exp.clients.count > 1:
        return Clients(serving, exp.clients.count)
    return OnePeer(serving, exp.clients.count)


def announce(server: Server, opts: StageOptions, ready_file: Path | None,
             on_ready: Callable[[str], None] | None) -> None:
    """Log the bound endpoint, write it to ``ready_file`` (atomically) and pass it to ``on_ready``."""
    server_log = logging.getLogger(f"distgrad.{opts.stage}")
    server_log.info("stage %s of %s serving on %s (%s)", opts.stage, opts.experiment.name, server.endpoint,
                    "CURVE: the link is encrypted, and only allowed client keys are accepted" if server.authenticated
                    else "plaintext: not encrypted, any client accepted")
    if ready_file is not None:
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        with writing(ready_file, "the ready file"):
            ready_file.parent.mkdir(parents=True, exist_ok=True)      # as every file the run writes
            tmp.write_text(server.endpoint)
            tmp.replace(ready_file)
    if on_ready is not None:
        on_ready(server.endpoint)


@one_compute_thread()
def serve(opts: StageOptions, bind: str, stop: StopFlag, connect: str | None = None, keep_serving: bool = False,
          ready_file: Path | None = None, ctx: zmq.Context | None = None,
          on_ready: Callable[[str], None] | None = None) -> dict[str, Any] | None:
    """Serve runs on ``bind`` until one completes (or, with ``keep_serving``, until stopped).

    The last stage gives no ``connect``; a middle stage connects to the stage
    below it there (with ``opts.downstream_security``). Writes the bound
    endpoint to ``ready_file`` once listening (for launchers) and passes it to
    ``on_ready`` (for callers in this process). Returns the last run's
    summary. Raises ``PeerTimeout`` when the run's peers stay lost for
    ``opts.peer_deadline_s`` (unless ``keep_serving``) or the stage below
    stays silent that long, ``NonFiniteError`` when a peer's step failed (one
    peer, unless ``keep_serving``), and ``Interrupted`` on a signal, after
    saving a checkpoint. With ``--checkpoint-dir``, holds the stage's lock
    there while serving (``ConfigError`` if another process holds it); with
    ``--resume`` and a finished run there, returns that run's summary at once
    without binding (with ``keep_serving``, serves new runs instead).
    """
    if keep_serving and (opts.experiment.federated or opts.experiment.vertical):
        raise ConfigError("--keep-serving is not supported for a serving stage with several clients or parties")
    ctx = ctx or zmq.Context.instance()
    lock = lock_checkpoint_dir(opts)
    try:
        done = finished_run(opts)
        if done is not None and not keep_serving:
            return nothing_to_do(opts, done)
        return _serve(opts, bind, stop, connect, keep_serving, ready_file, ctx, on_ready)
    finally:
        if lock is not None:
            lock.release()


def _lost(server: Server, logic: ServingStage, now: float, keep_serving: bool) -> bool:
    """A tick of liveness: report or drop the peers silent for ``liveness_s`` and send what that unblocked
    (before any later message's replies). True, sending nothing, when the run's peers have stayed lost for
    ``peer_deadline_s`` and ``serve`` gives up (never with ``keep_serving``)."""
    replies = logic.tick(now)
    if logic.lost_since is not None and now - logic.lost_since > logic.opts.peer_deadline_s and not keep_serving:
        return True
    _send_and_settle(server, logic, replies)
    return False


def _answer_untold(server: Server, logic: ServingStage) -> None:
    """A run of several parties ended because one stopped: answer each other party's next request with why
    (``ServingStage.answer_untold``), for at most ``UNTOLD_WAIT_S``, so that none waits out its deadline."""
    deadline = time.monotonic() + UNTOLD_WAIT_S
    while logic.untold and time.monotonic() < deadline:
        request = server.receive(POLL_TICK_S)
        if request is None:
            continue
        envelope, frames, _ = request
        _, answer, refused = decode_and_handle(frames, logic.max_tensor_bytes, logic.answer_untold, logic.log)
        for reply in [answer] if refused else answer:
            server.reply(envelope, reply)
    logic.untold = {}


def _tell_above(server: Server, logic: ServingStage, envelope: Envelope, frames: list[Any],
                error: PeerTimeout, stop: StopFlag) -> None:
    """A middle stage whose stage below stopped answering while it passed ``frames`` on stops: the request
    is answered with why (code ``aborted``), and so is every request of that run for ``UNTOLD_WAIT_S`` (the
    driver's resends, each on a fresh socket: only the newest is still heard, and silence is the only sign
    that it was told); so the driver stops with the reason instead of waiting out its own deadline and
    asking whether this stage is running. A signal ends the wait (the stage then exits with ``error``)."""
    try:
        msg = wire.decode(frames, logic.max_tensor_bytes)
    except ProtocolError:
        return
    text = f"stage {logic.opts.stage} stopped: {error}"
    logic.log.error("%s; telling the stage above", text)
    def why(request: Message) -> Message:
        return wire.error_message(request.run, request.step, ErrorCode.ABORTED, text, request.mb, request.mbs)

    server.reply(envelope, why(msg))
    tell_why_stopped(server, logic.max_tensor_bytes, {msg.run}, time.monotonic() + UNTOLD_WAIT_S, why,
                     once=False, stopped=lambda: stop.signum is not None)


def _send_and_settle(server: Server, logic: ServingStage, replies: list[Reply]) -> None:
    """Send ``replies``, then run the work they deferred, and send what that work answered, until none."""
    while replies:                      # each reply leaves before the work it defers is done
        for envelope, reply in replies:
            server.reply(envelope, reply)
        replies = logic.settle()


def _record_fields(logic: ServingStage, step: int, client: int | None) -> dict[str, Any]:
    """A step's metrics beyond the step, loss and rate: the privacy meter's window that closed after it, and a
    middle stage's bytes sent to and received from the stage below so far (coded as they crossed, counted as
    the driving stage counts its own link's)."""
    figures = logic.metering.figures_at           # None without a meter
    fields: dict[str, Any] = dict(figures(step, client)) if figures is not None else {}
    if logic.link is not None:
        fields.update(bytes_sent=logic.link.traffic.sent, bytes_received=logic.link.traffic.received)
    return fields


def _serve(opts: StageOptions, bind: str, stop: StopFlag, connect: str | None, keep_serving: bool,
           ready_file: Path | None, ctx: zmq.Context, on_ready: Callable[[str], None] | None) -> dict[str, Any] | None:
    logic = ServingStage(opts, connect, stop, ctx)
    records = StageRecords(opts.metrics_path, opts.tensorboard_dir, functools.partial(_record_fields, logic))
    if records.writers:
        logic.engine.observers.append(records)
    server = Server(ctx, bind, logic.max_frame_bytes, opts.liveness_s, opts.security, opts.spin_s)
    status = "interrupted"
    try:
        announce(server, opts, ready_file, on_ready)
        ticked = -math.inf
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            if request is None or now - ticked >= POLL_TICK_S:     # liveness: once a tick, not per message
                ticked = now
                if _lost(server, logic, now, keep_serving):
                    status = logic.topology.lost_status()
                    raise PeerTimeout(logic.lost_message())
            if request is not None:
                envelope, frames, peer_key = request
                try:
                    msg, answer, refused = decode_and_handle(
                        frames, logic.max_tensor_bytes,
                        functools.partial(logic.handle, envelope, now=now, peer_key=peer_key), logic.log)
                except PeerTimeout as e:
                    if logic.link is not None:      # the stage below is gone: tell the stage above why
                        _tell_above(server, logic, envelope, frames, e, stop)
                    raise
                _send_and_settle(server, logic, [(envelope, answer)] if refused else answer)
            # Asked only when there is something to end or complete (a step's path is short).
            failure = logic.end_failed_run() if logic.failure is not None else None
            if failure is not None:
                status = "failed"
                _answer_untold(server, logic)
                if not keep_serving:
                    raise failure
                logic.log.error("the run failed; waiting for the next run")
                status = "interrupted"
                continue
            finished = logic.finish_run() if logic.closing or logic.deferred is not None else None
            if finished is not None:
                status = "completed"
                logic.log.info("%s", logic.topology.completed_message(finished))
                if not keep_serving:
                    return finished
    finally:
        try:
            logic.settle()
            if logic.active and logic.failure is None:
                if logic.at_round_boundary():
                    logic.state.save(logic.topology.checkpoint_step())   # skipped once a save failed
                else:
                    logic.log.warning("stopped mid-round: no checkpoint of it (the last one saved is kept)")
                logic.close_run(status)
            elif logic.active:
                logic.close_run("failed")   # no checkpoint: the last one saved stays the newest
        finally:
            server.close()
            records.close()
            if logic.link is not None:
                logic.link.close(linger_ms=NOTICE_LINGER_MS if logic.told_below else 0)


def frames_digest(msg: Message) -> str:
    """The SHA-256 of a received message's tensor frames, as they came (before they are read)."""
    h = hashlib.sha256()
    for frame in msg.frames or ():
        h.update(memoryview(frame))
    return h.hexdigest()
