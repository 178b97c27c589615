"""The serving stage: ``serve`` binds and answers the stage above it, one driver or several data owners.

The last stage computes the loss itself; a middle stage passes every request
on to the stage below it (``link.DownstreamLink``) and its own backward on up.
One implementation serves one peer (a two-stage run, a chain) and the data
owners of an experiment with ``[clients]``: a ``Peer`` per data owner, each
with an explicit ``PeerStatus``.

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
round.
"""

from __future__ import annotations

import enum
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import zmq

from . import aggregate, wire
from .errors import CodecRangeError, ConfigError, NonFiniteError, PeerRejected, PeerTimeout, ProtocolError, StageError
from .experiment import MAX_STALENESS, build_stage_parts, client_stage_name
from .handshake import check_hello, common_step, hello, same_exactly
from .link import DownstreamLink, check_evaluation, check_reply
from .options import StageOptions, StopFlag
from .records import evaluation_fields
from .stage import TensorSpecs, average_parameters, backward_specs, forward_specs, micro_batch, target_spec
from .stage_state import StageState, finished_run, lock_checkpoint_dir, nothing_to_do
from .threads import one_compute_thread
from .transport import POLL_TICK_S, Server
from .wire import ErrorCode, Message, frame_limit
from .wirecodec import ACTIVATION, GRADIENT, Expected, stream_name

Envelope = list[bytes]
MAX_EVAL_ROWS = 1 << 16    # held-out rows a middle stage without data passes on in one evaluation,
MAX_EVAL_BYTES = 1 << 27   # and at most this many bytes of them (128 MiB)
Reply = tuple[Envelope, Message]


class PeerStatus(enum.Enum):
    """Where one peer (a driving stage, or one data owner) stands in the run."""

    ABSENT = "absent"          # has not said hello in this run
    ACTIVE = "active"          # takes part in the rounds
    REJOINING = "rejoining"    # said hello again after being dropped: takes part from the next round
    DROPPED = "dropped"        # silent when awaited, or its step failed; may say hello again
    STALE = "stale"            # a feature party whose run went back to an earlier step: says hello again
    FINISHED = "finished"      # said bye


class Phase(enum.Enum):
    """Where the run stands: waiting for its peers, in a round, averaging (SplitFed), or done."""

    JOINING = "joining"
    ROUND = "round"
    AVERAGING = "averaging"
    EVALUATING = "evaluating"      # between rounds: the peers due to evaluate are answered first
    DONE = "done"


@dataclass
class Peer:
    """What the serving stage knows of one peer."""

    index: int
    status: PeerStatus = PeerStatus.ABSENT
    run: str = ""
    owner: str = ""                   # CURVE key it said hello with ("" in plaintext)
    step: int = 0                     # its steps completed here
    mbs: int = 1
    eval_every: int = 0               # it evaluates after every K-th step (its hello says; 0: at the end only)
    staleness: int = 0                # steps it keeps in flight (its hello says): replies of as many are kept
    specs: Expected | None = None     # what its forwards carry (its micro-batch count, the activation codec)
    last_seen: float = -math.inf      # its last message, or the last reply to it
    envelope: Envelope = field(default_factory=list)
    waiting: dict[tuple[int, int], Message] = field(default_factory=dict)   # forwards before their turn
    cached: dict[tuple[int, int], Message] = field(default_factory=dict)    # replies of its step in progress
    average: Message | None = None    # its parameters for the averaging in progress
    averaged: Message | None = None   # the reply to its last averaging
    evaluate: Message | None = None   # its evaluation request, answered once no other peer can change us
    evaluated: Message | None = None  # the reply to its last evaluation (a resent request gets it again)
    loss: float | None = None
    evaluation: dict[str, Any] | None = None
    failure: NonFiniteError | None = None   # its step failed after the reply: told on its next message

    def taking_part(self) -> bool:
        return self.status in (PeerStatus.ACTIVE, PeerStatus.REJOINING)

    def live(self, now: float, liveness_s: float) -> bool:
        return self.taking_part() and now - self.last_seen <= liveness_s


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
    """

    def __init__(self, opts: StageOptions, connect: str | None = None, stop: StopFlag | None = None,
                 ctx: zmq.Context | None = None) -> None:
        self.opts, self.exp = opts, opts.experiment
        self.exp.check_role(opts.stage, binds=True, connects=connect is not None)
        self.parties = self.exp.upstream(opts.stage)   # the stages above (a vertical experiment's parties)
        self.upstream = self.parties[0]
        self.vertical = self.exp.vertical and len(self.parties) > 1   # a step takes every party's embedding
        self.count = len(self.parties) if self.vertical else self.exp.clients.count
        self.shared = self.count > 1                 # several data owners share this stage
        # With several peers this stage runs its own steps; one peer says when its run ends (bye).
        self.steps: int | None = opts.total_steps if self.shared else None
        self.state = StageState(opts, checkpoint_each_step=False)
        self.log = self.state.log
        self.engine = self.state.engine
        # The last stage reads only the targets (a shard per data owner); a middle one only how many rows are
        # held out (its stage file may hold no data: it then evaluates nothing).
        holds_data = self.exp.spec(opts.stage).data != {}
        if holds_data and self.vertical:              # every party's rows are the same rows: one label source
            self.data = [self.exp.build_data(opts.seed, stage=opts.stage)] * self.count
        else:
            self.data = [self.exp.build_data(opts.seed, client=c if self.shared else None, stage=opts.stage)
                         for c in range(self.count)] if holds_data else []
        # What each peer's forward carries: a party's own embedding (vertical), else this stage's input.
        self.input_shapes = ([self.exp.cuts[self.exp.stage_index(name)] for name in self.parties] if self.vertical
                             else [self.stage.input_shape] * self.count)
        self.target = target_spec(self.exp)
        self.codecs = self.exp.codecs
        self.link = None if connect is None else DownstreamLink(
            opts.link, connect, (stop or StopFlag()).check, ctx or zmq.Context.instance(), opts.downstream_security,
            backward_specs(self.stage, 1, self.codecs[GRADIENT]))
        singles = [self._forward_specs(1, index) for index in range(self.count)]
        # A middle stage without data cannot tell how many rows are held out: it takes up to MAX_EVAL_ROWS
        # and the stage below, which holds the labels, checks the count.
        row_bytes = 4 * int(np.prod(self.stage.input_shape[1:] or (1,)))
        passed_on = min(MAX_EVAL_ROWS, max(1, MAX_EVAL_BYTES // row_bytes))
        rows = len(self.data[0].test_rows) if self.data else passed_on if self.link is not None else 0
        self.eval_rows_max = passed_on
        self.eval_specs = [single.with_rows(rows) if rows else None for single in singles]    # per peer
        limits = [frame_limit(single.specs) for single in singles] + [frame_limit(specs.specs)
                                                                      for specs in self.eval_specs if specs]
        self.param_specs: TensorSpecs = {}        # what a SplitFed average carries: the first stage's parameters
        if self.exp.clients.mode == "splitfed":
            first_model, _, _ = build_stage_parts(self.exp, self.upstream, opts.seed, opts.init)
            self.param_specs = {name: (value.shape, value.dtype) for name, value in first_model.params.items()}
            limits.append(frame_limit(self.param_specs))
        # The largest message this stage accepts: a whole batch, the held-out rows, or SplitFed parameters.
        self.max_frame_bytes = max(limit[0] for limit in limits)
        self.max_tensor_bytes = max(limit[1] for limit in limits)
        self.peers = [Peer(c) for c in range(self.count)]
        self.now = time.monotonic()                        # the time of the latest message or tick
        self.evaluating = False                            # some peer's evaluation waits (``_advance``)
        self._new_run(start_round=1)
        self.finished: dict[str, Any] | None = None       # summary of the last completed run
        self.bye_replies: dict[str, Message] = {}          # by run: a repeated bye gets its reply again
        self.deferred: Callable[[], None] | None = None    # gradients (and update) of a micro-batch answered
        self.deferred_peers: list[Peer] = []               # whose micro-batch that is
        self.notices: list[Reply] = []                     # error replies to parties a rollback made stale
        if opts.resume and self.state.resume_latest():
            self._resumed(time.monotonic())
            self.state.open_trace(append=True)

    # -- the run
    @property
    def stage(self):
        return self.state.stage

    def _forward_specs(self, mbs: int, index: int) -> Expected:
        """What a forward of peer ``index`` carries with ``mbs`` micro-batches: its activation, coded."""
        return forward_specs(self.stage, self.target, mbs, self.input_shapes[index], self.codecs[ACTIVATION])

    def _stream(self, peer: Peer) -> str:
        """Whose error-feedback streams a reply to ``peer`` belongs to: "" for the one peer, else its index or
        its party name (each has its own residuals)."""
        if self.vertical:
            return self.parties[peer.index]
        return f"client{peer.index}" if self.shared else ""

    def _encode(self, direction: str, x: np.ndarray, stream: str, step: int) -> dict[str, np.ndarray]:
        """The message tensors of ``x`` sent on ``stream``; a value its codec cannot carry fails the step
        (``NonFiniteError``: it would cross as Inf), naming the codec, the tensor and the step."""
        try:
            return self.state.senders.message_tensors(direction, x, stream, step)
        except CodecRangeError as e:
            raise NonFiniteError(f"stage {self.opts.stage}: {e}; nothing of this step was applied") from e

    def _new_run(self, start_round: int, fresh: bool = True) -> None:
        """Wait for the peers of a run whose first round is ``start_round``; ``fresh``: a new run (not
        the same one going on after a rollback)."""
        self.phase = Phase.JOINING
        self.round = start_round - 1        # the round in progress (while joining: the last one done)
        self.order: list[int] = []          # the peers taking part in it, in turn order
        self.turn = 0                       # index into ``order``
        self.first_hello: float | None = None
        self.joined_at = self.now           # when this stage began waiting for its peers (vertical: all)
        self.lost_since: float | None = None
        self.owed: set[int] = set()         # peers whose evaluation ends the round (phase EVALUATING)
        self.closing = False                # its last bye was answered; ``finish_run`` completes it
        self.failure: NonFiniteError | None = None   # the one peer's run failed: it ends once told
        if fresh:
            self.started = time.perf_counter()
            self.loss: float | None = None
            self.active = False             # a run is open (possibly resumed from a checkpoint)
        self.state.extra_meta = self._checkpoint_meta

    @property
    def rounds_done(self) -> int:
        """Rounds (steps of the run) this stage has completed."""
        return self.round if self.phase in (Phase.JOINING, Phase.EVALUATING) else self.round - 1

    def _checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the stage: every peer's run and step (several peers)."""
        if not self.shared:
            return {}
        return {"peers": [{"run": p.run, "owner": p.owner, "step": p.step, "loss": p.loss} for p in self.peers]}

    def _resumed(self, now: float) -> None:
        """After ``resume_latest``: the run continues after the checkpoint's round."""
        ckpt_step = self.stage.step if not self.shared else self._resumed_round()
        self._new_run(start_round=ckpt_step + 1)
        self.active = True
        self.now = now
        if not self.shared:
            peer = self.peers[0]
            peer.run, peer.owner, peer.step = self.state.run_id, self.state.owner, ckpt_step
            peer.status, peer.last_seen = PeerStatus.ACTIVE, now     # a full liveness window to come back
            peer.specs = self._forward_specs(peer.mbs, peer.index)   # until its hello says otherwise
            self._start_round()

    def _resumed_round(self) -> int:
        saved = self.state.resumed_meta.get("peers", [])
        for peer, entry in zip(self.peers, saved):
            peer.run, peer.owner, peer.loss = entry.get("run", ""), entry.get("owner", ""), entry.get("loss")
        return self.state.resumed_step

    def live(self, now: float) -> bool:
        return self.active and any(p.live(now, self.opts.liveness_s) for p in self.peers)

    # -- messages
    def handle(self, envelope: Envelope, msg: Message, now: float, peer_key: str = "") -> list[Reply]:
        """The replies to ``msg`` (from ``envelope``, authenticated as ``peer_key``, "" in plaintext).

        With CURVE, a peer's run belongs to the key that opened it: other keys
        may not drive, rewind or end it.
        """
        self.now = now
        earlier = self.settle()
        if msg.type == wire.PING:
            return earlier + [(envelope, self._pong(msg, now))]
        if msg.type == wire.HELLO:
            welcome = self._hello(envelope, msg, now, peer_key)
            notices, self.notices = self.notices, []
            return earlier + notices + [(envelope, welcome)] + self._advance(now)
        if msg.type == wire.BYE and msg.run in self.bye_replies:
            return earlier + [(envelope, self.bye_replies[msg.run])]    # a repeated bye of a completed run
        peer = self._peer_of(msg)
        if peer.owner and peer_key != peer.owner:
            raise ProtocolError(ErrorCode.RUN, "this run belongs to another client key")
        if peer.status is PeerStatus.STALE and msg.type != wire.BYE:
            raise ProtocolError(ErrorCode.RUN, f"the run went back to step {self.round}: {self._name(peer)} must "
                                               f"say hello again")
        if peer.failure is not None:
            failure, peer.failure = peer.failure, None
            self._failed(peer, failure)
            raise ProtocolError(ErrorCode.NONFINITE_STEP, str(failure))
        if msg.type == wire.FORWARD:
            replies = self._forward(peer, envelope, msg)
        elif msg.type == wire.AVERAGE:
            replies = self._average(peer, envelope, msg)
        elif msg.type == wire.EVALUATE:
            replies = self._evaluate(peer, envelope, msg)
        elif msg.type == wire.BYE:
            replies = self._bye(peer, envelope, msg)
        else:
            raise ProtocolError(ErrorCode.TYPE, f"a serving stage does not accept {msg.type!r} messages")
        if peer.status is not PeerStatus.DROPPED or not self.shared:
            self._seen(peer, now)
        peer.envelope = envelope
        return earlier + replies + self._advance(now)

    def _pong(self, msg: Message, now: float) -> Message:
        run = self.peers[0].run if self.active and not self.shared else ""
        return Message(wire.PONG, msg.run, msg.step, body={
            "stage": self.opts.stage, "experiment": self.exp.name, "run": run,
            "step": self.stage.step if not self.shared else min(self.rounds_done, self.steps or 0),
            "client_live": self.live(now), "phase": self.phase.value,
            "clients_active": sum(p.taking_part() for p in self.peers),
            **({"waiting_for": [self.parties[p.index] for p in self.missing_parties(now)]} if self.vertical else {})})

    def _peer_of(self, msg: Message) -> Peer:
        """The peer whose run ``msg`` belongs to; ``ProtocolError`` (``RUN``) when none said hello for it."""
        for peer in self.peers:
            if peer.run == msg.run and self.active and peer.status is not PeerStatus.ABSENT:
                return peer
        expected = f"run {self.peers[0].run}" if self.active and not self.shared else "a hello first"
        raise ProtocolError(ErrorCode.RUN, f"{msg.type} for run {msg.run!r}, expected {expected}")

    def _seen(self, peer: Peer, now: float) -> None:
        if self.lost_since is not None and not self.shared:
            self.log.info("client of run %s is back", peer.run)
            self.lost_since = None
        peer.last_seen = now

    def _hello(self, envelope: Envelope, msg: Message, now: float, peer_key: str) -> Message:
        body = msg.body
        if self.vertical:
            role = body.get("role")
            if role not in self.parties:
                raise ProtocolError(ErrorCode.MISMATCH, f"hello from stage {wire.show(role)}; this stage serves the "
                                                        f"feature parties {self.parties}")
            index = self.parties.index(role)
            mbs = check_hello(body, role, self.exp, self.opts.seed, self.input_shapes[index], self.opts.stage)
        else:
            mbs = check_hello(body, self.upstream, self.exp, self.opts.seed, self.stage.input_shape,
                              self.opts.stage)
        if "purpose" in body:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has purpose={wire.show(body['purpose'])}; this stage "
                                                    f"trains (start 'distgrad predict' on this side to predict)")
        eval_every = body.get("eval_every", 0)
        if not isinstance(eval_every, int) or isinstance(eval_every, bool) or eval_every < 0:
            raise ProtocolError(ErrorCode.MALFORMED, f"hello has eval_every={wire.show(eval_every)}; expected an "
                                                     f"integer >= 0")
        staleness = body.get("staleness", 0)
        if not isinstance(staleness, int) or isinstance(staleness, bool) or not 0 <= staleness <= MAX_STALENESS:
            raise ProtocolError(ErrorCode.MALFORMED, f"hello has staleness={wire.show(staleness)}; expected an "
                                                     f"integer from 0 to {MAX_STALENESS}")
        if staleness and self.shared:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has staleness={staleness}; a stage serving several "
                                                    f"clients or parties takes lockstep steps only")
        if not self.vertical:
            index = body.get("client", 0 if not self.shared else None)
        elif "client" in body:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(body['client'])}; the feature "
                                                    f"parties of {self.exp.name!r} are told apart by their stage")
        if self.shared and (not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.count):
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(index)}; this stage serves "
                                                    f"clients 0 to {self.count - 1} (give --client)")
        if not self.shared and index != 0:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(index)}; experiment "
                                                    f"{self.exp.name!r} has no [clients]")
        peer = self.peers[index]
        if peer.owner and peer_key != peer.owner and (self.shared or peer.run == msg.run):
            raise ProtocolError(ErrorCode.RUN, f"{self._name(peer)} said hello with another client key before"
                                if self.shared else "this run belongs to another client key")
        if self.vertical:
            next_step = self._hello_party(peer, msg, mbs, eval_every, peer_key, now)
        elif self.shared:
            next_step = self._hello_shared(peer, msg, mbs, now, peer_key)
        else:
            next_step = self._hello_single(peer, msg, mbs, now, peer_key)
        peer.mbs, peer.specs = mbs, self._forward_specs(mbs, peer.index)
        peer.eval_every, peer.staleness = eval_every, staleness
        peer.waiting, peer.average, peer.evaluate, peer.failure = {}, None, None, None
        if not self.vertical:
            self.owed.discard(peer.index)       # it starts again after the step it would have evaluated
        self._seen(peer, now)
        peer.envelope = envelope
        if self.first_hello is None:
            self.first_hello = now
        self.log.info("%s said hello (run %s, %d micro-batches): next step %d", self._name(peer), msg.run, mbs,
                      next_step)
        return Message(wire.WELCOME, msg.run, msg.step, body={"stage": self.opts.stage, "next_step": next_step})

    def _hello_single(self, peer: Peer, msg: Message, mbs: int, now: float, peer_key: str) -> int:
        """One peer: its run again (both roll back to the newest step all hold), or a new run."""
        same_run = self.active and msg.run == peer.run
        if same_run:
            common = self._agree(msg, self.state.held(), msg.body.get("held"), mbs)
            before = self.stage.step
            self.state.rollback(common)
            peer.cached = {} if common != before else {k: v for k, v in peer.cached.items() if k[0] <= common}
        elif self.live(now):
            raise ProtocolError(ErrorCode.RUN, f"busy with run {peer.run} (its client is live); "
                                               f"cannot start run {msg.run!r}")
        else:
            self._agree(msg, [0], msg.body.get("held"), mbs)
            if self.active:
                self.log.warning("run %s replaces run %s, whose client is gone", msg.run, peer.run)
            self.state.begin(msg.run, owner=peer_key)
            self.finished, peer.cached, peer.evaluation, peer.evaluated, peer.loss = None, {}, None, None, None
            self.bye_replies = {}
            peer.run, peer.owner = msg.run, peer_key
            self.log.info("run %s started by %s", msg.run, msg.body.get("role"))
        common = self.stage.step
        self._new_run(start_round=common + 1, fresh=not same_run)
        self.active = True
        peer.status, peer.step = PeerStatus.ACTIVE, common
        self.engine.reset()                     # a step in progress starts again from its first micro-batch
        return common + 1

    def _hello_shared(self, peer: Peer, msg: Message, mbs: int, now: float, peer_key: str) -> int:
        """One of several peers: it joins the run, or rejoins it from the next round."""
        if self.phase is Phase.DONE:
            raise ProtocolError(ErrorCode.RUN, f"every step of this run is done; client {peer.index} cannot "
                                               f"join now")
        if peer.live(now, self.opts.liveness_s) and peer.run != msg.run:
            raise ProtocolError(ErrorCode.RUN, f"busy: client {peer.index} is live in run {peer.run}; "
                                               f"cannot start run {msg.run!r}")
        common_step([0], msg.body.get("held"))         # validates the list
        if not self.active:
            self.active = True
            if not self.state.run_id:
                self.state.begin(uuid.uuid4().hex)     # this stage's name for the run; each peer has its own
        same_run = peer.run == msg.run
        peer.run, peer.owner = msg.run, peer.owner if same_run else peer_key
        if self.phase is Phase.JOINING:
            start = self.round              # the round before the first (0, or the resumed checkpoint's)
            if start not in msg.body["held"]:
                self.log.warning("client %d does not hold step %d, where this stage resumes; it goes on from "
                                 "there with the parameters it has", peer.index, start)
            peer.status, peer.step, peer.cached = PeerStatus.ACTIVE, start, {}
            return start + 1
        if same_run and peer.status is PeerStatus.ACTIVE:
            # Still taking part: it continues where this stage has it; a turn of its in progress
            # starts again from its first micro-batch.
            if self._current() is peer:
                self.engine.reset()
            peer.cached = {k: v for k, v in peer.cached.items() if k[0] <= peer.step}
            return peer.step + 1
        peer.status, peer.cached = PeerStatus.REJOINING, {}
        peer.step = self.round                  # it takes part from the next round that starts
        self.log.warning("client %d rejoins (run %s); it takes part again from step %d", peer.index, msg.run,
                         self.round + 1)
        return self.round + 1

    def _hello_party(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> int:
        """One feature party of a vertical experiment (re)joins: it goes on from the newest step it and this
        stage both hold, no later than where this stage stands. When that is earlier, this stage rolls back
        to it and every other party must say hello again (``STALE``), so all of them go on from one step.
        After the last step only a party of the run holding it may come back (for its evaluation and bye)."""
        held = msg.body.get("held")
        common_step([0], held)                          # validates the list
        steps = msg.body.get("steps")
        if not same_exactly(steps, self.steps):
            # This stage counts the run's steps itself: a party that would stop elsewhere would stall the rest.
            raise ProtocolError(ErrorCode.MISMATCH, f"{self._name(peer)} runs {wire.show(steps)} steps, this stage "
                                                    f"{self.steps} (give every stage the same --steps)")
        for other in self.peers:
            if peer_key and other is not peer and other.owner == peer_key:
                # With CURVE a key is one party: the key of party a cannot also take party b's place.
                raise ProtocolError(ErrorCode.RUN, f"this client key said hello as {self._name(other)}; it cannot "
                                                   f"also be {self._name(peer)} (each party has its own key)")
        if peer.run and peer.run != msg.run and peer.live(now, self.opts.liveness_s):
            # Another process naming the same party (or one restarted without --resume too soon): it would
            # take the live party's place and send every party back to its step.
            raise ProtocolError(ErrorCode.RUN, f"busy: {self._name(peer)} is live in run {peer.run}; cannot "
                                               f"start run {msg.run!r}")
        for other in self.peers:
            if other is peer or other.status is not PeerStatus.ACTIVE:
                continue
            if other.mbs != mbs or other.eval_every != eval_every:
                raise ProtocolError(ErrorCode.MISMATCH, f"{self._name(peer)} asks for {mbs} micro-batches and an "
                                                        f"evaluation every {eval_every} steps, {self._name(other)} "
                                                        f"for {other.mbs} and {other.eval_every}")
        if self.phase is Phase.DONE and not (peer.run == msg.run and peer.status is not PeerStatus.FINISHED
                                             and self.stage.step in held):
            raise ProtocolError(ErrorCode.RUN, f"every step of this run is done; {self._name(peer)} cannot "
                                               f"join now")
        if not self.active:
            self.active = True
            if not self.state.run_id:
                self.state.begin(uuid.uuid4().hex)     # this stage's name for the run; each party has its own
        live = self.stage.step
        both = set(self.state.held()) & set(held)
        common = max([s for s in both if s <= live] or [0])
        if peer.run and peer.run != msg.run:
            self.log.warning("%s starts a new run (%s, holding steps %s) in place of run %s", self._name(peer),
                             msg.run, held[-8:], peer.run)
        if common < live:
            self._roll_back_parties(common, peer)
        else:
            # The round in progress goes on; the party's replies of it stay, so a micro-batch it sends
            # again (it computes the same values) gets the same reply.
            peer.cached = {k: v for k, v in peer.cached.items() if k[0] == common + 1}
        if peer.run != msg.run:
            peer.owner = peer_key
        peer.run, peer.status, peer.step = msg.run, PeerStatus.ACTIVE, common
        return common + 1

    def _roll_back_parties(self, step: int, cause: Peer) -> None:
        """Go back to ``step`` (a step this stage holds) because ``cause`` holds nothing later; every other
        party taking part is told (its waiting forwards get an error reply) and must say hello again."""
        self.log.warning("%s goes on from step %d: this stage and every other party go back to it",
                         self._name(cause), step)
        self.state.rollback(step)
        self.engine.reset()
        self._new_run(start_round=step + 1, fresh=False)
        for other in self.peers:
            other.cached = {}
            if other is cause or other.status is not PeerStatus.ACTIVE:
                continue
            text = (f"{self._name(cause)} went back to step {step}; the run goes on from there: "
                    f"say hello again")
            self.notices += [(other.envelope, wire.error_message(m.run, m.step, ErrorCode.RUN, text, m.mb, m.mbs))
                             for m in other.waiting.values()]
            if other.evaluate is not None:
                m = other.evaluate
                self.notices.append((other.envelope, wire.error_message(m.run, m.step, ErrorCode.RUN, text)))
            other.status, other.waiting, other.evaluate = PeerStatus.STALE, {}, None

    def _agree(self, msg: Message, ours: list[int], theirs: Any, mbs: int) -> int:
        """The step this stage and every stage above and below it hold (``ours``: this stage's).

        A middle stage asks the stage below with the steps both sides above
        hold; nothing changes here until it has agreed.
        """
        common = common_step(ours, theirs)           # also validates ``theirs``
        if self.link is None:
            return common
        both = sorted(set(ours) & set(theirs)) or [0]
        steps = msg.body.get("steps")
        self.link.set_reply_specs(backward_specs(self.stage, mbs, self.codecs[GRADIENT]))
        try:
            return self.link.handshake(hello(self.exp, self.opts.stage, self.opts.seed, self.stage.output_shape,
                                             msg.run, both, steps if isinstance(steps, int)
                                             and not isinstance(steps, bool) else 0, mbs,
                                             relayed=msg.body.get("parts"),
                                             staleness=msg.body.get("staleness", 0)))
        except PeerRejected as e:
            raise self._refused_below(e, msg) from e

    def _refused_below(self, e: PeerRejected, msg: Message) -> ProtocolError:
        """A refusal from the stage below, passed up with its code (so the driver can shake hands again)."""
        below = self.exp.stage_names[self.exp.stage_index(self.opts.stage) + 1]
        return ProtocolError(e.code, f"stage {below} refused {msg.type} step {msg.step}: {e.peer_message}")

    def _forward(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        key = (msg.step, msg.mb)
        cached = peer.cached.get(key)
        if cached is not None:
            return [(envelope, cached)]                 # a repeated request: same reply, no second update
        if peer.status is PeerStatus.DROPPED:
            raise ProtocolError(ErrorCode.RUN, f"client {peer.index} was dropped (silent for more than "
                                               f"{self.opts.liveness_s:g} s when its turn came); say hello again")
        if key in peer.waiting:
            peer.specs.receive(msg, self.exp.allow_nonfinite)
            peer.waiting[key] = msg                     # resent while waiting for its turn: still waiting
            return []
        in_turn = peer in self._turn_peers()
        expected = (self.engine.done if in_turn else 0) + len(peer.waiting)
        if msg.step != peer.step + 1 or msg.mbs != peer.mbs or msg.mb != expected:
            raise ProtocolError(ErrorCode.STEP, f"forward for step {msg.step} micro-batch {msg.mb}/{msg.mbs}; "
                                                f"expected step {peer.step + 1} micro-batch {expected}/{peer.mbs}")
        peer.specs.receive(msg, self.exp.allow_nonfinite)     # checked, and decoded: nothing else sees parts
        peer.waiting[key] = msg                         # answered in its turn (``_advance``)
        return []

    def _average(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        if peer.averaged is not None and peer.averaged.step == msg.step:
            return [(envelope, peer.averaged)]
        if peer.status is not PeerStatus.ACTIVE:
            raise ProtocolError(ErrorCode.RUN, f"client {peer.index} does not take part in this average "
                                               f"(it was dropped or is rejoining); say hello again")
        every = self.exp.clients.average_every
        if self.exp.clients.mode != "splitfed" or msg.step != peer.step or msg.step % every:
            raise ProtocolError(ErrorCode.STEP, f"average at step {msg.step}: client {peer.index} is at step "
                                                f"{peer.step}; this run averages every {every or 'never'} steps")
        wire.expect_tensors(msg, self.param_specs, self.exp.allow_nonfinite)
        peer.average = msg
        return []

    def _evaluate(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        specs = self.eval_specs[peer.index]
        if not self.data and self.link is not None:
            single = self._forward_specs(1, peer.index)
            # The rows are the first axis of the coded activation's first part (the values, codes or bits).
            activation = msg.tensors.get(next(iter(single.coded.specs)))
            rows = len(activation) if activation is not None and activation.ndim else 0
            if not 1 <= rows <= self.eval_rows_max:
                raise ProtocolError(ErrorCode.TENSOR, f"an evaluation carries 1 to {self.eval_rows_max} rows, got "
                                                      f"{rows}")
            specs = single.with_rows(rows)
        elif specs is None or not self.data or not len(self.data[peer.index].test_rows):
            raise ProtocolError(ErrorCode.TYPE, f"experiment {self.exp.name!r} holds out no rows to evaluate")
        specs.receive(msg, self.exp.allow_nonfinite)
        if self.shared and peer.evaluated is not None and (peer.evaluated.run, peer.evaluated.step) == (
                msg.run, msg.step):
            return [(envelope, peer.evaluated)]           # resent: the same scores
        # Several peers: answered at the end of its round when its hello's eval_every says it is due then
        # (``_round_done``), else once every round is done.
        peer.evaluate = msg
        self.evaluating = True
        return []

    def _due(self, peer: Peer, step: int) -> bool:
        """``peer`` (taking part) evaluates after step ``step``, before the next round (its ``eval_every``);
        after the last step it evaluates once every round is done (phase DONE)."""
        return (peer.status is PeerStatus.ACTIVE and step == peer.step and peer.eval_every > 0
                and step % peer.eval_every == 0 and (self.steps is None or step < self.steps))

    def _bye(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        steps = msg.body.get("steps")
        if not same_exactly(steps, peer.step):
            raise ProtocolError(ErrorCode.STEP, f"bye after {wire.show(steps)} steps, but {self._name(peer)} "
                                                f"has {peer.step} here")
        if self.link is not None:
            try:
                self.link.exchange(Message(wire.BYE, msg.run, msg.step, body={"steps": peer.step}))
            except PeerRejected as e:
                raise self._refused_below(e, msg) from e
        if peer.status is not PeerStatus.FINISHED:
            self.log.info("%s finished after %d steps", self._name(peer), peer.step)
        peer.status = PeerStatus.FINISHED
        reply = Message(wire.BYE, msg.run, msg.step, body={"steps": peer.step})
        self.bye_replies[msg.run] = reply
        # The checkpoint and the summary (slow for a big model) are written by ``finish_run``
        # after this reply has left, so the driver never waits for them.
        self.closing = self.complete()
        return [(envelope, reply)]

    # -- the turn order
    def _name(self, peer: Peer) -> str:
        if self.vertical:
            return f"party {self.parties[peer.index]}"
        return f"client {peer.index}" if self.shared else f"client of run {peer.run}"

    def _current(self) -> Peer | None:
        """The one peer whose turn it is (none between rounds, nor in a vertical round: all take part)."""
        turn = self._turn_peers()
        return turn[0] if len(turn) == 1 and not self.vertical else None

    def _turn_peers(self) -> list[Peer]:
        """The peers whose micro-batches this stage takes now: one peer's turn, or every feature party of a
        vertical round (whose embeddings combine)."""
        if self.phase is not Phase.ROUND or self.turn >= (1 if self.vertical else len(self.order)):
            return []
        return [self.peers[i] for i in self.order] if self.vertical else [self.peers[self.order[self.turn]]]

    def _start_round(self) -> None:
        """The next round, or the end of the run after the last."""
        self.round += 1
        if self.steps is not None and self.round > self.steps:
            self.phase = Phase.DONE
            self.log.info("every step is done; answering evaluations and byes")
            return
        if self.vertical:
            self.order = list(range(self.count))      # every party, every round
        elif self.shared:
            for peer in self.peers:
                if peer.status is PeerStatus.REJOINING:
                    peer.status = PeerStatus.ACTIVE
            self.order = [p.index for p in self.peers if p.status is PeerStatus.ACTIVE]
        else:
            self.order = [0] if self.peers[0].status is PeerStatus.ACTIVE else []
        self.turn, self.phase = 0, Phase.ROUND

    def _advance(self, now: float) -> list[Reply]:
        """Do every piece of work whose inputs have arrived, in the fixed order; return the replies."""
        replies: list[Reply] = []
        while self.deferred is None:        # a reply's gradients and update come before any later work
            if self.phase is Phase.ROUND and self.vertical:
                if self.turn == 0:
                    group = self._turn_peers()
                    key = (self.round, self.engine.done)
                    if any(p.status is not PeerStatus.ACTIVE or key not in p.waiting for p in group):
                        break               # a step needs every party's embedding
                    replies += self._compute_parties(group, [p.waiting.pop(key) for p in group], now)
                    continue
                self._end_round()
            elif self.phase is Phase.ROUND:       # the hot path first
                if self.turn < len(self.order):
                    peer = self.peers[self.order[self.turn]]
                    if peer.status is not PeerStatus.ACTIVE:
                        self.turn += 1
                        continue
                    msg = peer.waiting.pop((self.round, self.engine.done), None)
                    if msg is None:
                        break
                    replies.append(self._compute(peer, msg, now))
                    continue
                if not any(p.taking_part() for p in self.peers):
                    break                   # nobody takes part (any more): wait for a hello or the bye's end
                self._end_round()
            elif self.phase is Phase.JOINING and self.vertical:
                if any(p.status is not PeerStatus.ACTIVE or p.step != self.round for p in self.peers):
                    break                   # a step needs every party: no round starts without one
                # Going on after a step whose evaluation is due (a resume or a rollback to it): every party
                # evaluates it again after its hello (``driver._owes_evaluation``) before the next step.
                self.order = list(range(self.count))
                if self.round > 0:
                    self._round_done()
                else:
                    self._start_round()
            elif self.phase is Phase.JOINING:
                present = [p for p in self.peers if p.status is PeerStatus.ACTIVE]
                waited = self.first_hello is not None and now - self.first_hello > self.opts.peer_deadline_s
                if len(present) < self.count and not (present and waited):
                    break
                if len(present) < self.count:
                    self.log.warning("starting with clients %s: the others did not say hello within %g s",
                                     [p.index for p in present], self.opts.peer_deadline_s)
                self._start_round()
            elif self.phase is Phase.AVERAGING:
                taking_part = [self.peers[i] for i in self.order if self.peers[i].status is PeerStatus.ACTIVE]
                if any(p.average is None for p in taking_part):
                    break
                if taking_part:
                    mean = average_parameters([p.average.tensors for p in taking_part])
                    for p in taking_part:
                        p.averaged = Message(wire.AVERAGE, p.run, self.round, tensors=mean)
                        p.average, p.last_seen = None, now
                        replies.append((p.envelope, p.averaged))
                self._round_done()
            elif self.phase is Phase.EVALUATING and self.vertical:
                group = [self.peers[i] for i in sorted(self.owed)]
                if any(p.evaluate is None or p.evaluate.step != self.round + 1 for p in group):
                    break                   # every party's held-out embeddings combine
                replies += self._evaluation_parties(group)
                self.owed = set()
                self._start_round()
            elif self.phase is Phase.EVALUATING:
                # In peer order; nothing changes this stage until every peer due has been answered.
                for index in sorted(self.owed):
                    peer = self.peers[index]
                    if peer.evaluate is not None and peer.evaluate.step == self.round + 1:
                        replies.append((peer.envelope, self._evaluation(peer)))
                        self.owed.discard(index)
                if self.owed:
                    break
                self._start_round()
            else:
                break
        if self.evaluating and self.vertical:
            # After the last round: once every party has sent its held-out embeddings of the last step.
            if self.phase is Phase.DONE and all(p.evaluate is not None and p.evaluate.step == self.round
                                                for p in self.peers):
                replies += self._evaluation_parties(self.peers)
            self.evaluating = any(peer.evaluate is not None for peer in self.peers)
        elif self.evaluating:
            for peer in self.peers:
                if peer.evaluate is not None and self._settled_for(peer):
                    replies.append((peer.envelope, self._evaluation(peer)))
            self.evaluating = any(peer.evaluate is not None for peer in self.peers)
        return replies

    def _settled_for(self, peer: Peer) -> bool:
        """No other peer can still change this stage's parameters: ``peer``'s evaluation is final."""
        return self.phase is Phase.DONE or not self.shared

    def _end_round(self) -> None:
        """Every peer of the round had its turn: checkpoint, then average (SplitFed) or start the next."""
        self.state.after_step(self.round)
        every = self.exp.clients.average_every
        if self.exp.clients.mode == "splitfed" and self.round % every == 0:
            self.phase = Phase.AVERAGING
        else:
            self._round_done()

    def _round_done(self) -> None:
        """After a round (and its average): the peers due to evaluate after it are answered (phase
        EVALUATING) before the next round starts."""
        if self.shared:
            self.owed = {i for i in self.order if self._due(self.peers[i], self.round)}
            if self.owed:
                self.phase = Phase.EVALUATING
                return
        self._start_round()

    def _compute(self, peer: Peer, msg: Message, now: float) -> Reply:
        """One micro-batch of ``peer``'s turn: its reply now, its gradients (and the update after the
        last) deferred until the reply has left."""
        stage = self.stage
        started = time.perf_counter()
        x = msg.tensors["activation"]
        try:
            if self.link is None:
                target = msg.tensors.get("target")
                if target is None:
                    target = micro_batch(self.data[peer.index].targets(msg.step), msg.mb, msg.mbs)
                mb_loss, dx, grads_later = stage.loss_micro_batch_deferred(x, target, msg.mb)
                stage.check_finite("loss", mb_loss, msg.step)
            else:
                mb_loss, dx, grads_later = self._through(msg, x)
            stage.check_finite("activation_grad", dx, msg.step)
            tensors = self._encode(GRADIENT, dx, stream_name(GRADIENT, msg.mb, msg.mbs, self._stream(peer)), msg.step)
        except NonFiniteError as e:
            self.log.error("%s", e)
            self._failed(peer, e)
            if not self.shared:
                raise ProtocolError(ErrorCode.NONFINITE_STEP, str(e)) from e
            return peer.envelope, wire.error_message(msg.run, msg.step, ErrorCode.NONFINITE_STEP, str(e),
                                                     msg.mb, msg.mbs)
        except StageError as e:
            if not self.shared:
                raise ProtocolError(ErrorCode.STAGE, str(e)) from e
            self.log.warning("client %d dropped: %s", peer.index, e)
            self._drop(peer)
            return peer.envelope, wire.error_message(msg.run, msg.step, ErrorCode.STAGE, str(e), msg.mb, msg.mbs)
        except ProtocolError:
            peer.waiting.clear()            # refused from below: the peer sends again after its handshake
            raise
        if msg.mb == 0:
            # The peer holds every reply of its earlier steps but those still in flight (staleness).
            peer.cached = {k: v for k, v in peer.cached.items() if k[0] >= msg.step - peer.staleness}
        body = {"loss": float(mb_loss)}
        reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body=body, tensors=tensors)
        peer.cached[(msg.step, msg.mb)] = reply
        body["compute_s"] = time.perf_counter() - started     # for the driver's metrics: this stage and below
        peer.last_seen = now
        self.deferred = lambda: self._accumulate([peer], msg.step, msg.mb, msg.mbs, grads_later, mb_loss, dx)
        self.deferred_peers = [peer]
        return peer.envelope, reply

    def _compute_parties(self, group: list[Peer], msgs: list[Message], now: float) -> list[Reply]:
        """One micro-batch of a vertical round: the parties' embeddings combined (``aggregate``), the loss,
        and each party's reply with the gradient of its own embedding; the gradients and the update are
        deferred until the replies have left. A non-finite loss or gradient fails the run, applying nothing."""
        stage, first = self.stage, msgs[0]
        step, mb, mbs = first.step, first.mb, first.mbs
        started = time.perf_counter()
        try:
            z = aggregate.combine(self.exp.aggregate, [m.tensors["activation"] for m in msgs])
            target = micro_batch(self.data[0].targets(step), mb, mbs)
            mb_loss, dz, grads_later = stage.loss_micro_batch_deferred(z, target, mb)
            stage.check_finite("loss", mb_loss, step)
            stage.check_finite("activation_grad", dz, step)
            parts = aggregate.split(self.exp.aggregate, dz, [shape[-1] for shape in self.input_shapes])
            sent = [self._encode(GRADIENT, dy, stream_name(GRADIENT, mb, mbs, self._stream(peer)), step)
                    for peer, dy in zip(group, parts)]
        except (NonFiniteError, StageError) as e:
            code = ErrorCode.NONFINITE_STEP if isinstance(e, NonFiniteError) else ErrorCode.STAGE
            self.log.error("%s", e)
            self.engine.reset()
            if isinstance(e, NonFiniteError):
                self.failure = e
            return [(p.envelope, wire.error_message(m.run, step, code, str(e), mb, mbs)) for p, m in zip(group, msgs)]
        replies = []
        body = {"loss": float(mb_loss), "compute_s": time.perf_counter() - started}
        for peer, msg, tensors in zip(group, msgs, sent):
            if mb == 0:
                peer.cached = {}            # the party holds every reply of its previous step
            reply = Message(wire.BACKWARD, msg.run, step, mb, mbs, body=dict(body), tensors=tensors)
            peer.cached[(step, mb)] = reply
            peer.last_seen = now
            replies.append((peer.envelope, reply))
        self.deferred = lambda: self._accumulate(group, step, mb, mbs, grads_later, mb_loss, dz)
        self.deferred_peers = group
        return replies

    def _evaluation_parties(self, group: list[Peer]) -> list[Reply]:
        """Every party's held-out embeddings combined and scored; the same scores go to each. Changes no
        state but the parties' last evaluation."""
        msgs = [p.evaluate for p in group]
        try:
            z = aggregate.combine(self.exp.aggregate, [m.tensors["activation"] for m in msgs])
            result = self.stage.evaluate_last(z, self.data[0].test_targets())
        except StageError as e:
            result = None
            error = str(e)
        replies = []
        for peer, msg in zip(group, msgs):
            peer.evaluate = None
            if result is None:
                replies.append((peer.envelope, wire.error_message(msg.run, msg.step, ErrorCode.STAGE, error)))
                continue
            peer.evaluation = result
            peer.evaluated = Message(wire.EVALUATION, msg.run, msg.step, body=result)
            replies.append((peer.envelope, peer.evaluated))
        return replies

    def _through(self, msg: Message, x: np.ndarray
                 ) -> tuple[np.float32, np.ndarray, Callable[[], dict[str, np.ndarray]]]:
        """A middle stage's micro-batch: forward, the stage below's reply, the backward's activation
        gradient, and a function computing its parameter gradients (no update)."""
        assert self.link is not None
        y, cache = self.stage.forward(x, msg.mb)
        tensors = self._encode(ACTIVATION, y, stream_name(ACTIVATION, msg.mb, msg.mbs), msg.step)
        if "target" in msg.tensors:
            tensors["target"] = msg.tensors["target"]
        down = Message(wire.FORWARD, msg.run, msg.step, msg.mb, msg.mbs, tensors=tensors)
        key = (msg.step, msg.mb)
        self.link.send(down)
        try:
            reply = self.link.await_reply({key: down}, key)
        except PeerRejected as e:
            if e.code == ErrorCode.NONFINITE_STEP:
                raise NonFiniteError(e.peer_message) from e
            raise self._refused_below(e, msg) from e
        below = self.exp.stage_names[self.exp.stage_index(self.opts.stage) + 1]
        loss, dy = check_reply(reply, msg.step, self.link.reply_specs, self.exp.allow_nonfinite, below)
        dx, grads_later = self.stage.backward_deferred(cache, dy)
        return loss, dx, grads_later

    def _accumulate(self, peers: list[Peer], step: int, mb: int, mbs: int,
                    grads_later: Callable[[], dict[str, np.ndarray]], loss: np.float32, dx: np.ndarray) -> None:
        """A micro-batch's parameter gradients, added in micro-batch order; after the last, the update
        (``peers``: whose turn it is, every party of a vertical round)."""
        self.engine.add(mb, mbs, grads_later(), loss, dx)
        if mb < mbs - 1:
            return
        client = peers[0].index if self.shared and not self.vertical else None
        self.loss = self.engine.update(step, mbs, client=client)
        for peer in peers:
            peer.loss, peer.step = self.loss, step
        self.turn += 1

    def settle(self) -> list[Reply]:
        """Run what ``handle`` deferred until its reply had been sent (gradients, update), if anything,
        and return the replies of the work that then became possible (send them, then settle again).

        A non-finite gradient there applies nothing; the peer hears of it in
        reply to its next message (with several peers, it is dropped)."""
        work, self.deferred = self.deferred, None
        if work is None:
            return []
        try:
            work()
        except NonFiniteError as e:
            self.log.error("%s", e)
            for peer in self.deferred_peers:   # whose micro-batch it was: its turn did not end
                peer.failure = e
                if self.shared and not self.vertical:
                    self._drop(peer)
            if not self.shared or self.vertical:
                self.engine.reset()
        return self._advance(self.now)

    def _failed(self, peer: Peer, error: NonFiniteError) -> None:
        """``peer``'s step gave a non-finite loss or gradient: nothing of it applied. One peer, or the parties
        of a vertical run: the run fails (``failure``); several clients: that one is dropped, the others go on."""
        peer.waiting.clear()
        if self.shared and not self.vertical:
            self._drop(peer)                # resets the engine only if it was this peer's turn
        else:
            self.engine.reset()
            self.failure = error

    def _drop(self, peer: Peer) -> None:
        if self._current() is peer:
            self.engine.reset()
            self.turn += 1
        peer.status, peer.waiting = PeerStatus.DROPPED, {}
        self.owed.discard(peer.index)

    def _evaluation(self, peer: Peer) -> Message:
        """Forward only on the held-out rows; changes no state."""
        msg = peer.evaluate
        assert msg is not None
        peer.evaluate = None
        target = msg.tensors.get("target")
        try:
            if self.link is None:
                data = self.data[peer.index]
                result = self.stage.evaluate_last(msg.tensors["activation"],
                                                  data.test_targets() if target is None else target)
            else:
                y, _ = self.stage.forward(msg.tensors["activation"], training=False)
                tensors = {**self.state.senders.evaluation_tensors(y, msg.step),
                           **({"target": target} if target is not None else {})}
                try:
                    result = check_evaluation(self.link.exchange(
                        Message(wire.EVALUATE, msg.run, msg.step, tensors=tensors)))
                except PeerRejected as e:
                    return wire.error_message(msg.run, msg.step, e.code, str(self._refused_below(e, msg)))
        except (StageError, CodecRangeError) as e:
            return wire.error_message(msg.run, msg.step, ErrorCode.STAGE, str(e))
        peer.evaluation = result
        peer.evaluated = Message(wire.EVALUATION, msg.run, msg.step, body=result)
        return peer.evaluated

    # -- liveness and the end of the run
    def tick(self, now: float) -> list[Reply]:
        """Report (one peer) or drop (several) a peer this stage waits for that has been silent for
        ``liveness_s``; return the replies that unblocks."""
        self.now = now
        if not self.active:
            return []
        if self.vertical:
            self._watch_parties(now)
            return []
        if self.phase is Phase.JOINING:
            return self._advance(now)         # the first round may start without a late peer
        waiting_for = []
        current = self._current()
        if current is not None and current.status is PeerStatus.ACTIVE:
            waiting_for.append(current)
        if self.phase is Phase.AVERAGING:
            waiting_for += [self.peers[i] for i in self.order
                            if self.peers[i].status is PeerStatus.ACTIVE and self.peers[i].average is None]
        if self.phase is Phase.EVALUATING:
            waiting_for += [self.peers[i] for i in sorted(self.owed) if self.peers[i].status is PeerStatus.ACTIVE]
        if self.phase is Phase.DONE or not self.shared:
            waiting_for += [p for p in self.peers if p.status is PeerStatus.ACTIVE and p not in waiting_for]
        dropped = False
        for peer in waiting_for:
            if now - peer.last_seen <= self.opts.liveness_s:
                continue
            if not self.shared:
                if self.lost_since is None:
                    self.lost_since = now
                    self.log.warning("client of run %s silent for more than %g s; keeping its state at step %d "
                                     "and waiting for it (or a new run)", peer.run, self.opts.liveness_s,
                                     self.stage.step)
                continue
            if self.phase is Phase.DONE:
                self.log.warning("client %d silent for more than %g s after the last step, without a bye; "
                                 "dropped (the run ends without it)", peer.index, self.opts.liveness_s)
            else:
                self.log.warning("client %d silent for more than %g s at step %d; dropped (the others go on; "
                                 "it may say hello again)", peer.index, self.opts.liveness_s, self.round)
            self._drop(peer)
            dropped = True
        if self.shared:
            self.lost_since = (self.lost_since or now) if self.lost() else None
        if dropped:
            self.closing = self.complete()
            return self._advance(now)
        return []

    def missing_parties(self, now: float) -> list[Peer]:
        """The feature parties a vertical run waits for that have been silent for ``liveness_s``: not
        (back) in the run, or without their part of the micro-batch or evaluation in progress."""
        since = lambda p: max(p.last_seen, self.joined_at)     # noqa: E731
        if self.phase is Phase.DONE:
            # Every step is done: a party that has not said bye still owes its evaluation and bye.
            awaited = [p for p in self.peers if p.status is not PeerStatus.FINISHED]
            return [p for p in awaited if now - since(p) > self.opts.liveness_s]
        if self.phase is Phase.ROUND:
            key = (self.round, self.engine.done)
            awaited = [p for p in self.peers if p.status is not PeerStatus.ACTIVE or key not in p.waiting]
        elif self.phase is Phase.EVALUATING:
            awaited = [self.peers[i] for i in sorted(self.owed) if self.peers[i].evaluate is None]
        else:
            awaited = [p for p in self.peers if p.status is not PeerStatus.ACTIVE or p.step != self.round]
        return [p for p in awaited if now - since(p) > self.opts.liveness_s]

    def _watch_parties(self, now: float) -> None:
        """Vertical: log which silent party the run waits for (the others wait, nothing is dropped), and
        when it is back; ``lost_since`` tells ``serve`` how long the run has been stuck."""
        missing = self.missing_parties(now)
        if missing and self.lost_since is None:
            self.lost_since = now
            self.log.warning("waiting for %s: silent for more than %g s at step %d; a step needs every party, "
                             "the others wait (restart it with --resume to go on)",
                             ", ".join(self._name(p) for p in missing), self.opts.liveness_s, self.round)
        elif not missing and self.lost_since is not None:
            self.lost_since = None
            self.log.info("every party is back at step %d", self.round)

    def lost_message(self) -> str:
        """Why ``serve`` gives up on a run whose peers stayed lost for ``peer_deadline_s``."""
        deadline = self.opts.peer_deadline_s
        if self.vertical:
            names = ", ".join(self._name(p) for p in self.missing_parties(self.now)) or "a party"
            return (f"{names} silent for more than {self.opts.liveness_s + deadline:g} s at step {self.round}; "
                    f"giving up (a step needs every feature party)")
        if self.shared:
            when = "after the last step, none having said bye" if self.phase is Phase.DONE else f"at step {self.round}"
            return f"every client lost for more than {deadline:g} s {when}; giving up"
        return (f"client of run {self.state.run_id} lost for more than {self.opts.liveness_s + deadline:g} s at step "
                f"{self.stage.step}; giving up")

    def lost(self) -> bool:
        """Every peer is lost: none takes part, or after the last round none said bye and none is left."""
        if self.vertical:
            return self.active and self.lost_since is not None
        if not self.active or self.phase is Phase.JOINING:
            return False
        if not self.shared:
            return self.lost_since is not None
        if self.phase is Phase.DONE:
            return not any(p.status in (PeerStatus.FINISHED, PeerStatus.ACTIVE) for p in self.peers)
        return not any(p.taking_part() for p in self.peers)

    def complete(self) -> bool:
        """The run is over: its rounds are done (several peers) and every peer still taking part has said
        bye, one at least."""
        if self.shared and self.phase is not Phase.DONE:
            return False
        return (all(p.status is not PeerStatus.ACTIVE for p in self.peers)
                and any(p.status is PeerStatus.FINISHED for p in self.peers))

    def finish_run(self) -> dict[str, Any] | None:
        """Complete the run whose last bye was answered: final checkpoint and summary (returned)."""
        self.settle()
        if not self.closing:
            return None
        self.closing = False
        last = self.rounds_done if self.shared else self.stage.step
        self.state.save(last, final_loss=self.loss, finished=True)   # a rerun with --resume has nothing to do
        self.state.save_parameters()
        self.finished = self.close_run("completed")
        return self.finished

    def end_failed_run(self) -> NonFiniteError | None:
        """Once the one peer whose step failed has been told: close its run ("failed", no checkpoint
        written) and return the failure; None while there is none."""
        failure, self.failure = self.failure, None
        if failure is not None and self.active:
            self.close_run("failed")
        return failure

    def at_round_boundary(self) -> bool:
        """Between rounds: the live state is a whole step of the run (what a checkpoint may hold)."""
        return not self.shared or (self.phase in (Phase.JOINING, Phase.EVALUATING, Phase.DONE) or (
            self.phase is Phase.ROUND and self.turn == 0 and self.engine.done == 0))

    def close_run(self, status: str) -> dict[str, Any]:
        self.settle()
        extra: dict[str, Any] = {}
        if self.vertical:
            extra = {"parties": [{"party": self.parties[p.index], "run_id": p.run, "steps": p.step,
                                  "status": "completed" if p.status is PeerStatus.FINISHED else p.status.value}
                                 for p in self.peers],
                     "rounds": min(self.rounds_done, self.steps or 0), **evaluation_fields(self.peers[0].evaluation)}
        elif self.shared:
            extra = {"clients": [{"client": p.index, "run_id": p.run, "steps": p.step, "final_loss": p.loss,
                                  "status": "completed" if p.status is PeerStatus.FINISHED else "dropped",
                                  **evaluation_fields(p.evaluation)} for p in self.peers],
                     "rounds": min(self.rounds_done, self.steps or 0)}
        else:
            extra = evaluation_fields(self.peers[0].evaluation)
        summary = self.state.summary(status, self.started, self.loss, **extra)
        self.state.close()
        self.active = False
        for peer in self.peers:
            peer.cached = {}
            if peer.taking_part():
                peer.status = PeerStatus.ABSENT     # the run is over: nobody takes part in it any more
        return summary


def announce(server: Server, opts: StageOptions, ready_file: Path | None,
             on_ready: Callable[[str], None] | None) -> None:
    """Log the bound endpoint, write it to ``ready_file`` (atomically) and pass it to ``on_ready``."""
    server_log = logging.getLogger(f"distgrad.{opts.stage}")
    server_log.info("stage %s of %s serving on %s (%s)", opts.stage, opts.experiment.name, server.endpoint,
                    "CURVE: the link is encrypted, and only allowed client keys are accepted" if server.authenticated
                    else "plaintext: not encrypted, any client accepted")
    if ready_file is not None:
        tmp = ready_file.with_name(ready_file.name + ".tmp")
        tmp.write_text(server.endpoint)
        tmp.replace(ready_file)
    if on_ready is not None:
        on_ready(server.endpoint)


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
            log.warning("refused %s: %.*s", msg.describe() if msg else "an undecodable message",
                        wire.ERROR_TEXT_MAX, e)
        return msg, refusal(msg, e), True


def refusal(msg: Message | None, error: ProtocolError) -> Message:
    """The error reply to a refused message, echoing its ids when it could be decoded."""
    if msg is None:
        return wire.error_message("", 0, error.code, str(error.args[0]))
    return wire.error_message(msg.run, msg.step, error.code, str(error.args[0]), msg.mb, msg.mbs)


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


def _send_and_settle(server: Server, logic: ServingStage, replies: list[Reply]) -> None:
    """Send ``replies``, then run the work they deferred, and send what that work answered, until none."""
    while replies:                      # each reply leaves before the work it defers is done
        for envelope, reply in replies:
            server.reply(envelope, reply)
        replies = logic.settle()


def _serve(opts: StageOptions, bind: str, stop: StopFlag, connect: str | None, keep_serving: bool,
           ready_file: Path | None, ctx: zmq.Context, on_ready: Callable[[str], None] | None) -> dict[str, Any] | None:
    logic = ServingStage(opts, connect, stop, ctx)
    log = logic.log
    server = Server(ctx, bind, logic.max_frame_bytes, opts.liveness_s, opts.security, opts.spin_s)
    status = "interrupted"
    try:
        announce(server, opts, ready_file, on_ready)
        while True:
            stop.check()
            request = server.receive(POLL_TICK_S)
            now = time.monotonic()
            replies = logic.tick(now)
            if logic.lost_since is not None and now - logic.lost_since > opts.peer_deadline_s and not keep_serving:
                if logic.shared:
                    status = "lost"
                raise PeerTimeout(logic.lost_message())
            _send_and_settle(server, logic, replies)       # what a dropped peer unblocked leaves first
            if request is not None:
                envelope, frames, peer_key = request
                msg, answer, refused = decode_and_handle(frames, logic.max_tensor_bytes,
                                                         lambda m: logic.handle(envelope, m, now, peer_key), log)
                _send_and_settle(server, logic, [(envelope, answer)] if refused else answer)
            failure = logic.end_failed_run()
            if failure is not None:
                status = "failed"
                if not keep_serving:
                    raise failure
                log.error("the run failed; waiting for the next run")
                status = "interrupted"
                continue
            finished = logic.finish_run()
            if finished is not None:
                status = "completed"
                if logic.vertical:
                    log.info("run completed: %d steps with parties %s", finished.get("rounds", 0), logic.parties)
                elif logic.shared:
                    first = opts.experiment.stage_names[0]
                    log.info("run completed: %d steps, clients %s said bye, clients %s were dropped",
                             finished.get("rounds", 0),
                             [client_stage_name(first, p.index) for p in logic.peers if p.status is PeerStatus.FINISHED],
                             [client_stage_name(first, p.index) for p in logic.peers
                              if p.status is not PeerStatus.FINISHED])
                else:
                    log.info("run %s completed: %d steps, final loss %s", finished["run_id"], finished["steps"],
                             finished["final_loss"])
                if not keep_serving:
                    return finished
    finally:
        try:
            logic.settle()
            if logic.active and logic.failure is None:
                if logic.at_round_boundary():
                    logic.state.save(logic.rounds_done if logic.shared else None)   # skipped once a save failed
                else:
                    log.warning("stopped mid-round: no checkpoint of it (the last one saved is kept)")
                logic.close_run(status)
            elif logic.active:
                logic.close_run("failed")   # no checkpoint: the last one saved stays the newest
        finally:
            server.close()
            if logic.link is not None:
                logic.link.close(linger_ms=0)
