"""The run a serving stage serves (``ServedRun``): the state every part of the serving stage reads, and the
changes a join, a failure or a drop makes to it.

``serving.ServingStage`` is the one state machine of every topology; it is written in three classes, each a
base of the next, so that each part reads only what is below it: ``ServedRun`` (here: the run, its peers, the
decisions that place and drop them), ``serving_rounds.RoundMachine`` (the phases of the rounds, evaluations,
a micro-batch's deferred work) and ``serving.ServingStage`` (messages, liveness, the end of a run).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

import numpy as np

from distgrad.wire import messages as wire
from distgrad.run.accepts import Accepts
from distgrad.errors import CodecRangeError, DistgradError, NonFiniteError, PeerRejected, ProtocolError
from distgrad.run.metering import Metering, NoMetering, PeerMeters
from distgrad.wire.link import DownstreamLink
from distgrad.run.options import StageOptions
from distgrad.run.decisions import Failure, Gradients, Hearing, Join
from distgrad.run.peers import Peer, PeerStatus, Phase, Reply, RunState
from distgrad.config.experiment import Experiment, check_evaluation_horizon, check_step_horizons
from distgrad.stage.engine import StepEngine
from distgrad.model.nn import Shape
from distgrad.wire.codecs import Codec
from distgrad.stage.stage import Stage
from distgrad.run.stage_state import StageState
from distgrad.run.topology import Topology
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import GRADIENT, stream_name


class ServedRun:
    """The state of the run a serving stage serves and the changes every part of it makes.

    ``ServingStage.__init__`` sets every attribute declared here; only the
    serving stage's classes change them. ``run`` is the run's state (a
    ``peers.RunState``, read by the ``topology``), ``state`` the stage's
    (parameters, checkpoints, trace), ``engine`` its step engine.
    """

    opts: StageOptions
    exp: Experiment
    run: RunState
    topology: Topology
    count: int                          # peers (one driver, the clients or the feature parties)
    parties: list[str]                  # the stages above (a vertical experiment's parties)
    upstream: str
    state: StageState
    log: logging.Logger
    engine: StepEngine
    data: list[Any]                     # the targets' sources (a shard per data owner); [] for a middle stage
    metering: Metering | PeerMeters | NoMetering
    input_shapes: list[Shape]
    codecs: dict[str, Codec]
    link: DownstreamLink | None         # a middle stage's link to the stage below
    accepts: Accepts
    max_frame_bytes: int
    max_tensor_bytes: int
    metrics: tuple[str, ...]            # the last stage's held-out scores beyond the loss
    evaluating: bool                    # some peer's evaluation waits (``advance``)
    finished: dict[str, Any] | None     # summary of the last completed run
    deferred: Gradients | None          # gradients (and update) of a micro-batch answered
    notices: list[Reply]                # error replies to parties a rollback made stale
    untold: dict[str, str]              # a failed run's parties not yet told why (by run id)
    told_below: bool                    # a middle stage passed an aborted notice down
    closing: bool                       # its last bye was answered; ``finish_run`` completes it
    failure: DistgradError | None       # the one peer's run failed: it ends once told
    started: float                      # ``time.perf_counter()`` when the run began
    loss: float | None                  # the last update's loss
    loss_withheld: bool                 # a middle stage: the stage below passed up no training loss
    horizon_said: tuple[str, int, int] | None   # the run, eval_every and steps ``say_horizons`` said

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
            self.loss_withheld = False
            run.active = False
        self.state.extra_meta, self.state.extra_arrays = self._checkpoint_meta, self.topology.checkpoint_arrays

    def loss_fields(self) -> dict[str, Any]:
        """``training_loss``: ``wire.LOSS_WITHHELD`` once the stage below passed up no training loss (a middle
        stage whose label owner withholds it: its ``final_loss`` is then null, as the data owner's is), else
        nothing. Checkpointed, so a resumed run (or one with nothing left to do) says it too."""
        return {"training_loss": wire.LOSS_WITHHELD} if self.loss_withheld else {}

    def _checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the stage: the topology's, and whether the loss was withheld."""
        return {**self.topology.checkpoint_meta(), **self.loss_fields()}

    def open_run(self) -> None:
        """A run is open from the first hello of several peers; this stage names it (each peer has its own)."""
        if not self.run.active:
            self.run.active = True
            if not self.state.run_id:
                self.state.begin(uuid.uuid4().hex)

    def say_horizons(self, peer: Peer) -> None:
        """At ``peer``'s hello, log at WARNING what of this stage's settings the run it asks for cannot let act
        before its last step: the evaluations its ``eval_every`` and ``steps`` ask for, naming the driving
        stage as where to change them (``config.experiment.check_evaluation_horizon``), and, for a stage that
        runs the steps its driving stage's hello says (``StageOptions.follows_steps``), its schedules and
        ``checkpoint_every`` (``check_step_horizons``). Its start could not tell: these are the driving stage's
        to say. Said once per run of this stage (a peer's hello again for the same run says nothing more), and
        again for other evaluations or steps."""
        said = (self.state.run_id, peer.eval_every, peer.steps)
        if said == self.horizon_said or peer.steps < 1:
            return
        self.horizon_said = said
        if self.opts.follows_steps and self.opts.trains:
            check_step_horizons(self.exp, peer.steps, "the driving stage's hello", self.opts.checkpoint_every)
        drivers = self.parties if self.exp.vertical else self.exp.stage_names[:1]
        check_evaluation_horizon(self.exp, peer.steps, peer.eval_every, drivers=drivers)

    def live(self, now: float) -> bool:
        return self.run.active and any(p.live(now, self.opts.liveness_s) for p in self.run.peers)

    def _seen(self, peer: Peer, now: float) -> None:
        """A message from ``peer``: a sign of life, unless its topology says otherwise (``Hearing``)."""
        hearing = self.topology.heard(peer)
        if hearing is Hearing.IGNORED:
            return
        if hearing is Hearing.BACK:
            self.run.lost_since = None
        peer.last_seen = now

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

    def expect(self, peer: Peer, mbs: int) -> None:
        """``peer`` sends ``mbs`` micro-batches a step: what its forwards carry and the stream of each reply's
        gradient (``topology.stream``), found once per hello rather than per message."""
        peer.mbs, peer.specs = mbs, self.accepts.forward(mbs, peer.index)
        peer.streams = [stream_name(GRADIENT, mb, mbs, self.topology.stream(peer)) for mb in range(mbs)]

    def refused_below(self, e: PeerRejected, msg: Message) -> ProtocolError:
        """A refusal from the stage below, passed up with its code (so the driver can shake hands again); a
        stage below that stopped (``aborted``) is no refusal: its reason (``stage M stopped: ...``, naming the
        stage that went silent under it) goes up as it said it."""
        if e.code == ErrorCode.ABORTED:
            return ProtocolError(e.code, e.peer_message)
        below = self.exp.stage_names[self.exp.stage_index(self.opts.stage) + 1]
        return ProtocolError(e.code, f"stage {below} refused {msg.type} step {msg.step}: {e.peer_message}")

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

    def complete(self) -> bool:
        """The run is over: its rounds are done (several peers) and every peer still taking part has said
        bye, one at least."""
        if self.run.steps is not None and self.run.phase is not Phase.DONE:
            return False
        return (all(p.status is not PeerStatus.ACTIVE for p in self.run.peers)
                and any(p.status is PeerStatus.FINISHED for p in self.run.peers))
