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
from pathlib import Path
from typing import Any, Callable

import zmq

from distgrad.wire import messages as wire
from distgrad.run.accepts import Accepts
from distgrad.errors import ConfigError, DistgradError, PeerRejected, PeerTimeout, ProtocolError
from distgrad.config.experiment import client_stage_name, is_whole
from distgrad.run.metering import Metering, NoMetering, PeerMeters, step_rows
from distgrad.wire.link import DownstreamLink, is_final
from distgrad.run.options import StageOptions, StopFlag
from distgrad.run.parties import Parties
from distgrad.run.decisions import (Gradients, Liveness,
                                    Resume, ScoreAgain)
from distgrad.run.peers import Envelope, Peer, PeerStatus, Phase, Reply, RunState
from distgrad.run.protocol import (abort_reason, bye_reply, check_bye, check_evaluation_step, check_forward_order,
                                   check_owner, check_served_staleness, decode_and_handle, hello_fields, log_refusal,
                                   not_accepted, pong, refusal, resent_evaluation, tell_why_stopped)
from distgrad.run.progress import StageRecords
from distgrad.run.serving_rounds import RoundMachine
from distgrad.stage.stage import backward_specs
from distgrad.run.stage_state import StageState, finished_run, lock_checkpoint_dir, nothing_to_do
from distgrad.threads import one_compute_thread
from distgrad.stage.records import writing
from distgrad.run.topology import Clients, OnePeer, Topology
from distgrad.wire.transport import NOTICE_LINGER_MS, POLL_TICK_S, Server
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import GRADIENT

UNTOLD_WAIT_S = 10.0    # after one party stopped a run, how long the others' next requests are answered with why

# ``decode_and_handle``, ``hello_fields``, ``log_refusal`` and ``refusal`` are the protocol core's, named here too.
__all__ = ["Peer", "PeerStatus", "Phase", "ServingStage", "announce", "decode_and_handle", "hello_fields", "log_refusal",
           "refusal", "serve"]



class ServingStage(RoundMachine):
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
        self.metering = self._meter()
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
        self.horizon_said = None                           # nothing said yet (``say_horizons``)
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

    def _meter(self) -> Metering | PeerMeters | NoMetering:
        """The label owner's privacy meter (``--meter``): the gradient rows it sends, against its own labels
        (several data owners: one meter per client or feature party, each reading what that one receives)."""
        kind, exp = self.opts.meter_kind, self.exp
        if not kind:
            return NoMetering()
        if exp.federated or exp.vertical:
            first = exp.stage_names[0]
            names = [client_stage_name(first, p.index) if exp.federated else self.parties[p.index]
                     for p in self.run.peers]
            return PeerMeters(self.engine, names, [self.topology.stream(p) for p in self.run.peers],
                              [source.true_targets for source in self.data],
                              [step_rows(source) for source in self.data], 0, clients=exp.federated, log=self.log)
        return Metering(kind, self.engine, lambda step: self.data[0].true_targets(step), 0, log=self.log,
                        rows_of=step_rows(self.data[0]))

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
        self.say_horizons(peer)
        peer.waiting, peer.average, peer.evaluate, peer.failure = {}, None, None, None
        if not joined.still_owes:
            self.run.owed.discard(peer.index)       # it starts again after the step it would have evaluated
        self._seen(peer, now)
        peer.envelope = envelope
        if self.run.first_hello is None:
            self.run.first_hello = now
        self.log.info("%s said hello (run %s, %d micro-batches): next step %d", topology.name(peer), msg.run, mbs,
                      joined.next_step)
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.opts.stage, "next_step": joined.next_step,
                                                              **topology.welcome_fields()})

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
        self.loss_withheld = self.state.resumed_meta.get("training_loss") == wire.LOSS_WITHHELD
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

    def finish_run(self) -> dict[str, Any] | None:
        """Complete the run whose last bye was answered: final checkpoint and summary (returned)."""
        if self.deferred is not None:
            self.settle()
        if not self.closing:
            return None
        self.closing = False
        # --save before the checkpoint marked finished, after which a rerun with --resume writes nothing
        self.state.save_parameters()
        self.state.save(self.topology.checkpoint_step(), final_loss=self.loss, finished=True)
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
                                     **self.metering.summary_fields(), **self.loss_fields())
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
                _answer(server, logic, request, now, stop)
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
            _leave_run(logic, status)
        finally:
            server.close()
            records.close()
            if logic.link is not None:
                logic.link.close(linger_ms=NOTICE_LINGER_MS if logic.told_below else 0)


def _answer(server: Server, logic: ServingStage, request: tuple[Envelope, list[Any], str], now: float,
            stop: StopFlag) -> None:
    """One request (envelope, frames, the sender's key): decoded, handled (``ServingStage.handle``) or refused,
    and answered, then what the replies deferred. A middle stage whose stage below is gone (``PeerTimeout``)
    tells the stage above why (``_tell_above``) before the error ends ``serve``."""
    envelope, frames, peer_key = request
    try:
        _, answer, refused = decode_and_handle(frames, logic.max_tensor_bytes,
                                               functools.partial(logic.handle, envelope, now=now, peer_key=peer_key),
                                               logic.log)
    except PeerTimeout as e:
        if logic.link is not None:
            _tell_above(server, logic, envelope, frames, e, stop)
        raise
    _send_and_settle(server, logic, [(envelope, answer)] if refused else answer)


def _leave_run(logic: ServingStage, status: str) -> None:
    """``serve`` stops (a return, an error, a signal): the deferred work is done, and a run still open is
    closed with ``status``, checkpointed first when the stage stands between rounds; a failed one is closed
    "failed" without a checkpoint (the last one saved stays the newest)."""
    logic.settle()
    if logic.active and logic.failure is None:
        if logic.at_round_boundary():
            logic.state.save(logic.topology.checkpoint_step())   # skipped once a save failed
        else:
            logic.log.warning("stopped mid-round: no checkpoint of it (the last one saved is kept)")
        logic.close_run(status)
    elif logic.active:
        logic.close_run("failed")


def frames_digest(msg: Message) -> str:
    """The SHA-256 of a received message's tensor frames, as they came (before they are read)."""
    h = hashlib.sha256()
    for frame in msg.frames or ():
        h.update(memoryview(frame))
    return h.hexdigest()
