"""Who takes part in a serving stage's steps and how their messages combine: one class per topology.

``serving.ServingStage`` is the one state machine: the phases (joining,
round, averaging, evaluating, done), the reply cache, liveness and
checkpoints. What differs between topologies it asks of its ``Topology``:

- ``OnePeer``: one driver (a two-stage run, a chain); its hello of the same
  run rolls both sides back to the newest step they hold, and a failed step
  ends the run.
- ``Clients``: several data owners, each round in turn (with SplitFed, their
  first stages averaged every ``average_every`` rounds); a silent or failing
  client is dropped and the others go on.
- ``parties.Parties``: the feature parties of a vertical experiment, whose
  embeddings of a micro-batch combine (``aggregate``) into one step.

A topology keeps no state of its own: it reads and changes the serving stage
it was built for (``serving``), so every rule of a phase stays in one place.
It keeps only lookup hints, each checked before it is used (the peer of a
run id, ``Topology.runs``; how far ``Parties`` has found the parties' parts
of a micro-batch), so a message costs the same whatever the number of peers.
Adding a topology means adding one subclass and choosing it in
``serving.topology_for``.
"""

from __future__ import annotations

import abc

import time
from typing import Any, Callable

import numpy as np

from distgrad.wire import messages as wire
from distgrad.errors import CodecRangeError, DistgradError, NonFiniteError, PeerAborted, PeerRejected, ProtocolError, StageError
from distgrad.config.experiment import client_stage_name
from distgrad.run import kept_replies
from distgrad.run.handshake import check_hello, common_step, hello
from distgrad.wire.link import check_evaluation, check_reply, evaluation_reply
from distgrad.run.peers import Envelope, Peer, PeerStatus, Phase, Reply
from distgrad.run.protocol import (abort_reason, check_owner, is_abort_notice, prune_replies, resent_evaluation,
                                   unknown_run)
from distgrad.stage.records import evaluation_fields
from distgrad.stage.stage import average_parameters, backward_specs, micro_batch
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, stream_name


class Topology(abc.ABC):
    """What one topology decides for a serving stage (``serving``: the ``ServingStage`` it belongs to).

    The defaults are those of a stage serving several peers that counts the
    run's steps itself (``Clients`` and ``Parties``); ``OnePeer`` overrides them.
    Every topology decides its abstract methods: how a peer joins, the order
    of a round, whose turn it is, how a round, the joining and the evaluations
    after a round advance, what a silent peer means, and how the end of a run
    (completed or lost) is told.
    """

    def __init__(self, serving: Any, count: int) -> None:
        self.serving = serving
        self.count = count          # the peers it serves
        self.runs: dict[str, Peer] = {}     # run id -> the peer ``peer_of`` found for it (cleared at a hello)
        self.held_targets: dict[int, tuple[int, np.ndarray]] = {}   # data index -> (step, its targets)

    # -- what the stage is built with
    def steps(self) -> int | None:
        """The run's steps when this stage counts them (several peers); None: its one peer says (bye)."""
        return self.serving.opts.total_steps

    def build_data(self, seed: int, stage: str) -> list[Any]:
        """Each peer's data at this stage (its targets and held-out rows): a shard per data owner."""
        exp = self.serving.exp
        return [exp.build_data(seed, client=c, stage=stage) for c in range(self.count)]

    def targets(self, index: int, step: int) -> np.ndarray:
        """The targets of step ``step`` (the whole batch) in this stage's data of peer ``index``, looked up
        once a step: each micro-batch slices them, and after a step's update ``prefetch`` looks up the
        next step's, off the path of a reply. (A step's targets depend on nothing but the step.)"""
        held = self.held_targets.get(index)
        if held is None or held[0] != step:
            held = self.held_targets[index] = (step, self.serving.data[index].targets(step))
        return held[1]

    def micro_targets(self, index: int, step: int, mb: int, mbs: int, rows: np.ndarray | None = None) -> np.ndarray:
        """The targets of micro-batch ``mb`` of ``mbs`` of step ``step`` in this stage's data of peer
        ``index``: with ``send_rows``, those of the ``rows`` the peer sent (checked when received); else
        the micro-batch's slice of the step's (``targets``)."""
        if rows is not None:
            return self.serving.data[index].targets_at(rows)
        return micro_batch(self.targets(index, step), mb, mbs)

    def prefetch(self, index: int, step: int) -> None:
        """Look up step ``step``'s targets (``targets``) now, if this stage looks up peer ``index``'s at all
        (not when they come with its forwards, or from the stage below)."""
        if index in self.held_targets:
            self.targets(index, step)

    def input_shape(self, index: int) -> tuple[int, ...]:
        """What peer ``index``'s forwards carry, before coding: this stage's input."""
        return self.serving.stage.input_shape

    def name(self, peer: Peer) -> str:
        """How the log and error messages name ``peer``."""
        return f"client {peer.index}"

    def stream(self, peer: Peer) -> str:
        """Whose error-feedback streams a reply to ``peer`` belongs to (each has its own residuals)."""
        return f"client{peer.index}"

    # -- hello
    def check_hello(self, body: dict[str, Any]) -> int:
        """The micro-batches a hello asks for, after checking it agrees with this stage (``ProtocolError``)."""
        s = self.serving
        return check_hello(body, s.upstream, s.exp, s.opts.seed, s.stage.input_shape, s.opts.stage)

    def peer_index(self, body: dict[str, Any]) -> int:
        """Which peer a hello comes from (``ProtocolError`` when it names none this stage serves)."""
        index = body.get("client")
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.count:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(index)}; this stage serves "
                                                    f"clients 0 to {self.count - 1} (give --client)")
        return index

    def check_staleness(self, staleness: int) -> None:
        """Several peers take lockstep steps only: a hello asking for steps in flight is refused."""
        if staleness:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has staleness={staleness}; a stage serving several "
                                                    f"clients or parties takes lockstep steps only")

    def check_owner(self, peer: Peer, msg: Message, peer_key: str) -> None:
        """With CURVE a peer is the key it first said hello with."""
        if peer.owner and peer_key != peer.owner:
            raise ProtocolError(ErrorCode.RUN, f"{self.name(peer)} said hello with another client key before")

    @abc.abstractmethod
    def join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> int:
        """``peer`` (re)joins after a valid hello; returns the next step it computes."""

    def after_join(self, peer: Peer) -> None:
        """A peer that said hello starts again after the step it would have evaluated."""
        self.serving.owed.discard(peer.index)

    # -- the rounds
    @abc.abstractmethod
    def round_order(self) -> list[int]:
        """The peers taking part in the round that starts, in turn order."""

    def turn_peers(self) -> list[Peer]:
        """The peers whose micro-batches this stage takes now (none between rounds)."""
        s = self.serving
        if s.phase is not Phase.ROUND or s.turn >= len(s.order):
            return []
        return [s.peers[s.order[s.turn]]]

    def peer_of(self, msg: Message) -> Peer:
        """The peer whose run ``msg`` belongs to: the first taking part in the open run with its run id;
        ``ProtocolError`` (``RUN``) when none said hello for it. The peer found for a run id is looked at
        first (``runs``, cleared at every hello: only a hello changes whose run is whose), so a message does
        not cost a scan of every peer."""
        s = self.serving
        peer = self.runs.get(msg.run)
        if peer is not None and peer.run == msg.run and s.active and peer.status is not PeerStatus.ABSENT:
            return peer
        for peer in s.peers:
            if peer.run == msg.run and s.active and peer.status is not PeerStatus.ABSENT:
                self.runs[msg.run] = peer
                return peer
        raise unknown_run(msg, self.expected_run())

    @abc.abstractmethod
    def in_turn(self, peer: Peer) -> bool:
        """``peer`` is one of ``turn_peers``: its micro-batches are taken now (asked of every forward)."""

    def current(self) -> Peer | None:
        """The one peer whose turn it is (none between rounds)."""
        turn = self.turn_peers()
        return turn[0] if len(turn) == 1 else None

    @abc.abstractmethod
    def advance_round(self, now: float, replies: list[Reply]) -> bool:
        """Do the next piece of a round's work, adding its replies; False while it waits for a message."""

    @abc.abstractmethod
    def advance_joining(self, now: float) -> bool:
        """Start the first round once its peers are there; False while it waits."""

    @abc.abstractmethod
    def advance_evaluating(self, replies: list[Reply]) -> bool:
        """Answer the evaluations due after a round (adding the replies), then start the next round; False
        while one is missing."""

    @abc.abstractmethod
    def answer_evaluations(self) -> list[Reply]:
        """The evaluations outside a round's end (one peer; every peer's after the last step) that can be
        answered now."""

    def average(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        """A SplitFed peer's parameters for the average after its round (answered once every peer's are
        in: ``advance_averaging``); a resent request gets the same reply."""
        s = self.serving
        if peer.averaged is not None and peer.averaged.step == msg.step:
            return [(envelope, peer.averaged)]
        if peer.status is not PeerStatus.ACTIVE:
            raise ProtocolError(ErrorCode.RUN, f"client {peer.index} does not take part in this average "
                                               f"(it was dropped or is rejoining); say hello again")
        every = s.exp.clients.average_every
        if s.exp.clients.mode != "splitfed" or msg.step != peer.step or msg.step % every:
            raise ProtocolError(ErrorCode.STEP, f"average at step {msg.step}: client {peer.index} is at step "
                                                f"{peer.step}; this run averages every {every or 'never'} steps")
        wire.expect_tensors(msg, s.accepts.params, s.exp.allow_nonfinite)
        peer.average = msg
        return []

    def advance_averaging(self, now: float, replies: list[Reply]) -> bool:
        """SplitFed: once every peer of the round sent its parameters, each gets back their mean (added to
        ``replies``); False while one is missing."""
        s = self.serving
        taking_part = [s.peers[i] for i in s.order if s.peers[i].status is PeerStatus.ACTIVE]
        if any(p.average is None for p in taking_part):
            return False
        if taking_part:
            mean = average_parameters([p.average.tensors for p in taking_part])
            for p in taking_part:
                p.averaged = Message(wire.AVERAGE, p.run, s.round, tensors=mean)
                p.average, p.last_seen = None, now
                replies.append((p.envelope, p.averaged))
        # The round's checkpoint, taken before these replies leave, holds them: a client whose reply the
        # stage's kill lost gets it from the restarted stage (``Clients.resent_reply``).
        s.state.after_step(s.round)
        s.round_done()
        return True

    def judged(self, step: int, result: dict[str, Any], steps: int | None) -> dict[str, Any]:
        """``result`` of the evaluation after ``step`` with its verdicts (``StageState.judged``); early stopping
        ends the rounds after ``step`` when the serving stage counts them (``steps``: clients, parties)."""
        s = self.serving
        result = s.state.judged(step, result, step == steps, gives=s.link is None)
        if result.get("stop") and s.steps is not None:
            s.steps = step
        return result

    def due(self, peer: Peer, step: int) -> bool:
        """``peer`` (taking part) evaluates after step ``step``, before the next round (its ``eval_every``);
        after the last step it evaluates once every round is done (phase DONE)."""
        steps = self.serving.steps
        return (peer.status is PeerStatus.ACTIVE and step == peer.step and peer.eval_every > 0
                and step % peer.eval_every == 0 and (steps is None or step < steps))

    def owed_after_round(self) -> set[int]:
        """The peers due to evaluate after the round just done (answered before the next round starts)."""
        s = self.serving
        return {i for i in s.order if self.due(s.peers[i], s.round)}

    def client_of(self, peers: list[Peer]) -> int | None:
        """The client a step's update is recorded for (the metrics), None for a run's one source of steps."""
        return None

    # -- failures
    def failed(self, peer: Peer, error: DistgradError) -> None:
        """``peer``'s step gave a non-finite loss or gradient: nothing of it applied; the run fails."""
        peer.waiting.clear()
        self.serving.engine.reset()
        self.serving.failure = error

    def notice(self, peer: Peer, envelope: Envelope, msg: Message) -> list[Reply]:
        """An ``aborted`` notice (``wire.abort_notice``) from the peer whose run it is (the owner check is the
        serving stage's): it stopped before the end and says why (``aborted``). No reply: a notice is not a
        request. Any other error message is refused."""
        if not is_abort_notice(msg):
            raise ProtocolError(ErrorCode.TYPE, "a serving stage takes no error messages but an aborted notice")
        reason = abort_reason(msg)
        self.serving.log.error("%s stopped before the end of its run: %s", self.name(peer), reason)
        self.aborted(peer, PeerAborted(reason))
        return []

    def aborted(self, peer: Peer, error: PeerAborted) -> None:
        """``peer`` stopped before the end and said why (an aborted notice): as a failed step (nothing of a
        step in progress applied); the run fails, or for a client only that client is dropped."""
        self.failed(peer, error)

    def deferred_failed(self, peers: list[Peer], error: NonFiniteError) -> None:
        """The deferred gradients of ``peers``' micro-batch were not finite: each hears of it on its next
        message; the step starts again."""
        for peer in peers:
            peer.failure = error
        self.serving.engine.reset()

    # -- liveness and the end of the run
    @abc.abstractmethod
    def tick(self, now: float) -> list[Reply]:
        """React to the peers this stage waits for that stayed silent for ``liveness_s``; the replies that
        unblocks."""

    def hears_from(self, peer: Peer) -> bool:
        """A message from ``peer`` counts as a sign of life."""
        return True

    def seen(self, peer: Peer) -> None:
        """``peer`` sent a message (or said hello); nothing to do by default (``OnePeer`` notes a lost peer back)."""
        return None

    def missing(self, now: float) -> list[Peer]:
        """The peers a run waits for that have been silent for ``liveness_s`` (only ``Parties`` reports
        them by name; none by default)."""
        return []

    @abc.abstractmethod
    def lost_message(self) -> str:
        """Why ``serve`` gives up on a run whose peers stayed lost for ``peer_deadline_s``."""

    def lost_status(self) -> str:
        """The summary's status of a run given up as lost."""
        return "lost"

    @abc.abstractmethod
    def completed_message(self, finished: dict[str, Any]) -> str:
        """The log line of a completed run."""

    def expected_run(self) -> str:
        """What a message of an unknown run should have been (for its error)."""
        return "a hello first"

    def pong_run(self) -> str:
        """The run a pong names: "" when several peers each have their own."""
        return ""

    def pong_fields(self, now: float) -> dict[str, Any]:
        """What a pong adds for this topology."""
        return {}

    def reported_step(self) -> int:
        """The steps done, as a pong reports them."""
        s = self.serving
        return min(s.rounds_done, s.steps or 0)

    # -- checkpoints and summary
    def checkpoint_step(self) -> int | None:
        """The step a checkpoint is taken as (None: the stage's own step count)."""
        return self.serving.rounds_done

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the stage: every peer's run and step."""
        return {"peers": [{"run": p.run, "owner": p.owner, "step": p.step, "loss": p.loss}
                          for p in self.serving.peers]}

    def checkpoint_arrays(self, step: int) -> dict[str, np.ndarray]:
        """What the checkpoint of step ``step`` keeps besides the stage, as arrays (none by default)."""
        return {}

    def resent_reply(self, msg: Message, peer_key: str) -> Message | None:
        """The reply to ``msg`` (from ``peer_key``) when it repeats a request answered before that no peer's
        state answers now: a bye of a completed run. None: ``msg`` is handled as any message."""
        return self.serving.bye_replies.get(msg.run) if msg.type == wire.BYE else None

    def resumed(self, now: float) -> None:
        """After ``resume_latest``: the peers' runs as saved; the run continues after the checkpoint's round."""
        s = self.serving
        for peer, entry in zip(s.peers, s.state.resumed_meta.get("peers", [])):
            peer.run, peer.owner, peer.loss = entry.get("run", ""), entry.get("owner", ""), entry.get("loss")
        s.new_run(start_round=s.state.resumed_step + 1)
        s.active, s.now = True, now

    def at_round_boundary(self) -> bool:
        """Between rounds: the live state is a whole step of the run (what a checkpoint may hold)."""
        s = self.serving
        return s.phase in (Phase.JOINING, Phase.EVALUATING, Phase.DONE) or (
            s.phase is Phase.ROUND and s.turn == 0 and s.engine.done == 0)

    def summary_fields(self) -> dict[str, Any]:
        """What the run's summary adds for this topology."""


class Turns(Topology):
    """Peers that take their steps one at a time (``OnePeer``, ``Clients``): a peer's micro-batches go
    through this stage (and the stages below) and each gets its reply."""

    def advance_round(self, now: float, replies: list[Reply]) -> bool:
        s = self.serving
        if s.turn < len(s.order):
            peer = s.peers[s.order[s.turn]]
            if peer.status is not PeerStatus.ACTIVE:
                s.turn += 1
                return True
            msg = peer.waiting.pop((s.round, s.engine.done), None)
            if msg is None:
                return False
            replies.append(self.compute(peer, msg, now))
            return True
        if not any(p.taking_part() for p in s.peers):
            return False                # nobody takes part (any more): wait for a hello or the bye's end
        s.end_round()
        return True

    def advance_joining(self, now: float) -> bool:
        s = self.serving
        present = [p for p in s.peers if p.status is PeerStatus.ACTIVE]
        waited = s.first_hello is not None and now - s.first_hello > s.opts.peer_deadline_s
        if len(present) < self.count and not (present and waited):
            return False
        if len(present) < self.count:
            s.log.warning("starting with clients %s: the others did not say hello within %g s",
                          [p.index for p in present], s.opts.peer_deadline_s)
        s.start_round()
        return True

    def advance_evaluating(self, replies: list[Reply]) -> bool:
        s = self.serving
        # In peer order; nothing changes this stage until every peer due has been answered.
        for index in sorted(s.owed):
            peer = s.peers[index]
            if peer.evaluate is not None and peer.evaluate.step == s.round + 1:
                replies.append((peer.envelope, self.evaluation(peer)))
                s.owed.discard(index)
        if s.owed:
            return False
        s.start_round()
        return True

    def answer_evaluations(self) -> list[Reply]:
        s = self.serving
        return [(peer.envelope, self.evaluation(peer)) for peer in s.peers
                if peer.evaluate is not None and self.settled_for(peer)]

    def settled_for(self, peer: Peer) -> bool:
        """No other peer can still change this stage's parameters: ``peer``'s evaluation is final."""
        return self.serving.phase is Phase.DONE

    def awaited(self) -> list[Peer]:
        """The peers taking part that this stage waits for now."""
        s = self.serving
        waiting_for = []
        current = self.current()
        if current is not None and current.status is PeerStatus.ACTIVE:
            waiting_for.append(current)
        if s.phase is Phase.AVERAGING:
            waiting_for += [s.peers[i] for i in s.order
                            if s.peers[i].status is PeerStatus.ACTIVE and s.peers[i].average is None]
        if s.phase is Phase.EVALUATING:
            waiting_for += [s.peers[i] for i in sorted(s.owed) if s.peers[i].status is PeerStatus.ACTIVE]
        if s.phase is Phase.DONE:
            waiting_for += [p for p in s.peers if p.status is PeerStatus.ACTIVE and p not in waiting_for]
        return waiting_for

    def tick(self, now: float) -> list[Reply]:
        s = self.serving
        if s.phase is Phase.JOINING:
            return s.advance(now)         # the first round may start without a late peer
        dropped = False
        for peer in self.awaited():
            if now - peer.last_seen > s.opts.liveness_s:
                dropped = self.silent(peer, now) or dropped
        self.after_tick(now)
        if dropped:
            s.closing = s.complete()
            return s.advance(now)
        return []

    def silent(self, peer: Peer, now: float) -> bool:
        """``peer``, awaited, has been silent for ``liveness_s``; True when it is dropped."""

    def after_tick(self, now: float) -> None:
        """After the silent peers were handled: note when every peer became lost."""

    # -- one micro-batch of a turn
    def in_turn(self, peer: Peer) -> bool:
        s = self.serving
        return s.phase is Phase.ROUND and s.turn < len(s.order) and s.order[s.turn] == peer.index

    def compute(self, peer: Peer, msg: Message, now: float) -> Reply:
        """One micro-batch of ``peer``'s turn: its reply now; its gradients (and the update after the
        last), and the reply cache's pruning, deferred until the reply has left."""
        s = self.serving
        started = time.perf_counter()
        try:
            mb_loss, dx, grads_later = self._loss_and_gradient(peer, msg)
            s.stage.check_finite("activation_grad", dx, msg.step)
            tensors = s.encode(GRADIENT, dx, peer.streams[msg.mb], msg.step, msg.tensors.get("rows"))
        except NonFiniteError as e:
            s.log.error("%s", e)
            self.failed(peer, e)
            return self.step_failed(peer, msg, ErrorCode.NONFINITE_STEP, e)
        except StageError as e:
            return self.step_failed(peer, msg, ErrorCode.STAGE, e)
        except ProtocolError:
            peer.waiting.clear()            # refused from below: the peer sends again after its handshake
            raise
        body = {"loss": float(mb_loss)}
        reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body=body, tensors=tensors)
        peer.cached[(msg.step, msg.mb)] = reply
        body["compute_s"] = time.perf_counter() - started     # for the driver's metrics: this stage and below
        peer.last_seen = now
        s.defer([peer], lambda: self.after_reply(peer, msg, grads_later, mb_loss, dx))
        return peer.envelope, reply

    def after_reply(self, peer: Peer, msg: Message, grads_later: Callable[[], dict[str, np.ndarray]],
                    mb_loss: np.float32, dx: np.ndarray) -> None:
        """What ``compute`` deferred: after a step's first micro-batch the peer holds every reply of its
        earlier steps but those still in flight (staleness), so the cache keeps only these; then the
        micro-batch's gradients (and the update, after which the next step's targets are looked up)."""
        if msg.mb == 0:
            low = msg.step - peer.staleness
            peer.cached = prune_replies(peer.cached, low)
        self.serving.accumulate([peer], msg.step, msg.mb, msg.mbs, grads_later, mb_loss, dx)
        if msg.mb == msg.mbs - 1:
            self.prefetch(peer.index, msg.step + 1)

    def _loss_and_gradient(self, peer: Peer, msg: Message
                           ) -> tuple[np.float32, np.ndarray, Callable[[], dict[str, np.ndarray]]]:
        """The micro-batch's loss (here or below), its activation gradient and its parameter gradients
        to compute later."""
        s = self.serving
        x = msg.tensors["activation"]
        if s.link is not None:
            return self._through(msg, x)
        target, rows = msg.tensors.get("target"), msg.tensors.get("rows")
        if rows is not None or target is None:      # else the peer sent them (the first stage holds labels)
            target = self.micro_targets(peer.index, msg.step, msg.mb, msg.mbs, rows)
        mb_loss, dx, grads_later = s.stage.loss_micro_batch_deferred(x, target, msg.mb)
        s.stage.check_finite("loss", mb_loss, msg.step)
        return mb_loss, dx, grads_later

    def step_failed(self, peer: Peer, msg: Message, code: ErrorCode, error: Exception) -> Reply:
        """``peer``'s micro-batch failed (``code``): the reply it gets, or ``ProtocolError`` to refuse it."""

    def _through(self, msg: Message, x: np.ndarray
                 ) -> tuple[np.float32, np.ndarray, Callable[[], dict[str, np.ndarray]]]:
        """A middle stage's micro-batch: forward, the stage below's reply, the backward's activation
        gradient, and a function computing its parameter gradients (no update)."""
        s = self.serving
        y, cache = s.stage.forward(x, msg.mb)
        tensors = s.encode(ACTIVATION, y, stream_name(ACTIVATION, msg.mb, msg.mbs), msg.step)
        for passed in ("target", "rows"):       # in frame order, as they came
            if passed in msg.tensors:
                tensors[passed] = msg.tensors[passed]
        down = Message(wire.FORWARD, msg.run, msg.step, msg.mb, msg.mbs, tensors=tensors)
        key = (msg.step, msg.mb)
        s.link.send(down)
        try:
            reply = s.link.await_reply({key: down}, key)
        except PeerRejected as e:
            if e.code == ErrorCode.NONFINITE_STEP:
                raise NonFiniteError(e.peer_message) from e
            raise s.refused_below(e, msg) from e
        below = s.exp.stage_names[s.exp.stage_index(s.opts.stage) + 1]
        loss, dy = check_reply(reply, msg.step, s.link.reply_specs, s.exp.allow_nonfinite, below)
        dx, grads_later = s.stage.backward_deferred(cache, dy)
        return loss, dx, grads_later

    def evaluation(self, peer: Peer) -> Message:
        """``peer``'s evaluation: forward only on the held-out rows (here, or passed on below); changes no
        state but the peer's last evaluation."""
        s = self.serving
        msg = peer.evaluate
        assert msg is not None
        peer.evaluate = None
        target = msg.tensors.get("target")
        try:
            if s.link is None:
                data = s.data[peer.index]
                result = s.stage.evaluate_last(msg.tensors["activation"],
                                               data.test_targets() if target is None else target, s.metrics)
            else:
                y, _ = s.stage.forward(msg.tensors["activation"], training=False)
                tensors = {**s.state.senders.evaluation_tensors(y, msg.step),
                           **({"target": target} if target is not None else {})}
                try:
                    result = check_evaluation(s.link.exchange(
                        Message(wire.EVALUATE, msg.run, msg.step, tensors=tensors)))
                except PeerRejected as e:
                    return wire.error_message(msg.run, msg.step, e.code, str(s.refused_below(e, msg)))
        except (StageError, CodecRangeError) as e:
            return wire.error_message(msg.run, msg.step, ErrorCode.STAGE, str(e))
        peer.evaluation = result = self.judged(msg.step - 1, result, s.steps or peer.steps)
        peer.evaluated = evaluation_reply(msg.run, msg.step, result)
        return peer.evaluated


class Clients(Turns):
    """Several data owners, each round in turn in client order; SplitFed averages their first stages
    (``ServingStage`` runs the averaging phase). A silent or failing client is dropped, the others go on;
    it may say hello again and takes part from the next round. A round's checkpoint keeps its replies,
    which a restarted stage gives again to a client that sends their requests again."""

    def __init__(self, serving: Any, count: int) -> None:
        super().__init__(serving, count)
        # Run id -> the client whose replies a resumed checkpoint kept (a hint: it must still be absent).
        self.resuming: dict[str, Peer] = {}

    def join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> int:
        s = self.serving
        if s.phase is Phase.DONE:
            raise ProtocolError(ErrorCode.RUN, f"every step of this run is done; client {peer.index} cannot "
                                               f"join now")
        if peer.live(now, s.opts.liveness_s) and peer.run != msg.run:
            busy = wire.busy_text("run", peer.run, peer.since, f"client {peer.index}", now - peer.last_seen,
                             s.opts.liveness_s)
            raise ProtocolError(ErrorCode.RUN, f"{busy}; cannot start run {msg.run!r}")
        common_step([0], msg.body.get("held"))         # validates the list
        s.open_run()
        same_run = peer.run == msg.run
        peer.run, peer.owner = msg.run, peer.owner if same_run else peer_key
        peer.since = peer.since if same_run else time.time()
        if s.phase is Phase.JOINING:
            start = s.round              # the round before the first (0, or the resumed checkpoint's)
            if start not in msg.body["held"]:
                s.log.warning("client %d does not hold step %d, where this stage resumes; it goes on from "
                              "there with the parameters it has", peer.index, start)
            peer.status, peer.step, peer.cached = PeerStatus.ACTIVE, start, {}
            return start + 1
        if same_run and peer.status is PeerStatus.ACTIVE:
            # Still taking part: it continues where this stage has it; a turn of its in progress
            # starts again from its first micro-batch.
            if self.current() is peer:
                s.engine.reset()
            peer.cached = {k: v for k, v in peer.cached.items() if k[0] <= peer.step}
            return peer.step + 1
        peer.status, peer.cached = PeerStatus.REJOINING, {}
        peer.step = s.round                  # it takes part from the next round that starts
        s.log.warning("client %d rejoins (run %s); it takes part again from step %d", peer.index, msg.run,
                      s.round + 1)
        return s.round + 1

    def checkpoint_arrays(self, step: int) -> dict[str, np.ndarray]:
        """The replies of round ``step`` (``kept_replies``)."""
        return kept_replies.kept_arrays(self.serving.peers, step)

    def resumed(self, now: float) -> None:
        """As ``Topology.resumed``; the replies of the checkpoint's round are back in the clients' caches, and
        a client not yet back that sends one of its requests again gets its reply (``resent_reply``)."""
        super().resumed(now)
        s = self.serving
        for peer in kept_replies.restore(s.peers, s.state.resumed_extra, s.state.resumed_step):
            self.resuming[peer.run] = peer

    def resent_reply(self, msg: Message, peer_key: str) -> Message | None:
        """As ``Topology.resent_reply``; also, from a client of the resumed run (its owner key) that has not
        said hello since, the requests of the checkpoint's round whose replies the restart lost: a forward or
        an average gets its reply again, and the evaluation after that round is scored, while every client is
        still away and this stage holds exactly that round's parameters. (Any other message of such a client
        is refused: it says hello and goes on after that round.)"""
        s = self.serving
        peer = self.resuming.get(msg.run)
        if (peer is None or peer.run != msg.run or peer.status is not PeerStatus.ABSENT or not s.active
                or (peer.owner and peer_key != peer.owner)):
            return super().resent_reply(msg, peer_key)
        if msg.type == wire.AVERAGE:
            return peer.averaged if peer.averaged is not None and peer.averaged.step == msg.step else None
        if msg.type == wire.EVALUATE and s.phase is Phase.JOINING and msg.step == s.round + 1:
            if (again := resent_evaluation(peer.evaluated, msg)) is not None:
                return again
            s.accepts.evaluation(peer.index, msg).receive(msg, s.exp.allow_nonfinite)
            peer.evaluate = msg
            return self.evaluation(peer)
        return peer.cached.get((msg.step, msg.mb)) if msg.type == wire.FORWARD else super().resent_reply(msg, peer_key)

    def round_order(self) -> list[int]:
        for peer in self.serving.peers:
            if peer.status is PeerStatus.REJOINING:
                peer.status = PeerStatus.ACTIVE
        return [p.index for p in self.serving.peers if p.status is PeerStatus.ACTIVE]

    def client_of(self, peers: list[Peer]) -> int | None:
        return peers[0].index

    def failed(self, peer: Peer, error: DistgradError) -> None:
        """That client is dropped (the engine resets only if it was its turn), the others go on."""
        peer.waiting.clear()
        self.serving.drop(peer)

    def deferred_failed(self, peers: list[Peer], error: NonFiniteError) -> None:
        for peer in peers:
            peer.failure = error
            self.serving.drop(peer)

    def step_failed(self, peer: Peer, msg: Message, code: ErrorCode, error: Exception) -> Reply:
        s = self.serving
        if code is ErrorCode.STAGE:
            s.log.warning("client %d dropped: %s", peer.index, error)
            s.drop(peer)
        return peer.envelope, wire.error_message(msg.run, msg.step, code, str(error), msg.mb, msg.mbs)

    def silent(self, peer: Peer, now: float) -> bool:
        s = self.serving
        if s.phase is Phase.DONE:
            s.log.warning("client %d silent for more than %g s after the last step, without a bye; "
                          "dropped (the run ends without it)", peer.index, s.opts.liveness_s)
        else:
            s.log.warning("client %d silent for more than %g s at step %d; dropped (the others go on; "
                          "it may say hello again)", peer.index, s.opts.liveness_s, s.round)
        s.drop(peer)
        return True

    def after_tick(self, now: float) -> None:
        s = self.serving
        s.lost_since = (s.lost_since or now) if self.lost() else None

    def hears_from(self, peer: Peer) -> bool:
        return peer.status is not PeerStatus.DROPPED

    def lost(self) -> bool:
        """No client takes part any more, or after the last round none said bye and none is left."""
        s = self.serving
        if not s.active or s.phase is Phase.JOINING:
            return False
        if s.phase is Phase.DONE:
            return not any(p.status in (PeerStatus.FINISHED, PeerStatus.ACTIVE) for p in s.peers)
        return not any(p.taking_part() for p in s.peers)

    def lost_message(self) -> str:
        s = self.serving
        when = "after the last step, none having said bye" if s.phase is Phase.DONE else f"at step {s.round}"
        return f"every client lost for more than {s.opts.peer_deadline_s:g} s {when}; giving up"

    def completed_message(self, finished: dict[str, Any]) -> str:
        s = self.serving
        first = s.exp.stage_names[0]
        said_bye = [client_stage_name(first, p.index) for p in s.peers if p.status is PeerStatus.FINISHED]
        dropped = [client_stage_name(first, p.index) for p in s.peers if p.status is not PeerStatus.FINISHED]
        return (f"run completed: {finished.get('rounds', 0)} steps, clients {said_bye} said bye, clients {dropped} "
                f"were dropped")

    def summary_fields(self) -> dict[str, Any]:
        s = self.serving
        return {"clients": [{"client": p.index, "run_id": p.run, "steps": p.step, "final_loss": p.loss,
                             "status": "completed" if p.status is PeerStatus.FINISHED else "dropped",
                             **evaluation_fields(p.evaluation)} for p in s.peers],
                "rounds": min(s.rounds_done, s.steps or 0)}


class OnePeer(Turns):
    """One driving peer (a two-stage run, a chain). It says when its run ends (bye); its hello of the same
    run rolls both sides back to the newest step they both hold, a hello of a new run replaces a run whose
    peer is gone. A failed step ends the run; a silent peer is waited for (its state kept)."""

    def steps(self) -> int | None:
        return None

    def build_data(self, seed: int, stage: str) -> list[Any]:
        return [self.serving.exp.build_data(seed, client=None, stage=stage)]

    def name(self, peer: Peer) -> str:
        return f"client of run {peer.run}"

    def stream(self, peer: Peer) -> str:
        return ""

    def peer_index(self, body: dict[str, Any]) -> int:
        index = body.get("client", 0)
        if index != 0:
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has client={wire.show(index)}; experiment "
                                                    f"{self.serving.exp.name!r} has no [clients]")
        return index

    def check_staleness(self, staleness: int) -> None:
        """One peer may keep steps in flight."""

    def check_owner(self, peer: Peer, msg: Message, peer_key: str) -> None:
        """With CURVE a run is the key that opened it; another key may start a new run."""
        if peer.run == msg.run:
            check_owner(peer.owner, peer_key)

    def join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> int:
        """Its run again (both sides roll back to the newest step all hold), or a new run."""
        s = self.serving
        same_run = s.active and msg.run == peer.run
        if same_run:
            common = self._agree(msg, s.state.held(), msg.body.get("held"), mbs)
            before = s.stage.step
            s.state.rollback(common)
            peer.cached = {} if common != before else {k: v for k, v in peer.cached.items() if k[0] <= common}
        elif s.live(now):
            busy = wire.busy_text("run", peer.run, peer.since, "its client", now - peer.last_seen, s.opts.liveness_s)
            raise ProtocolError(ErrorCode.RUN, f"{busy}; cannot start run {msg.run!r}")
        else:
            self._agree(msg, [0], msg.body.get("held"), mbs)
            if s.active:
                s.log.warning("run %s replaces run %s, whose client is gone", msg.run, peer.run)
            s.state.begin(msg.run, owner=peer_key)
            s.finished, peer.cached, peer.evaluation, peer.evaluated, peer.loss = None, {}, None, None, None
            s.bye_replies = {}
            peer.run, peer.owner, peer.since = msg.run, peer_key, time.time()
            s.log.info("run %s started by %s", msg.run, msg.body.get("role"))
        common = s.stage.step
        s.new_run(start_round=common + 1, fresh=not same_run)
        s.active = True
        peer.status, peer.step = PeerStatus.ACTIVE, common
        s.engine.reset()                     # a step in progress starts again from its first micro-batch
        return common + 1

    def _agree(self, msg: Message, ours: list[int], theirs: Any, mbs: int) -> int:
        """The step this stage and every stage above and below it hold (``ours``: this stage's).

        A middle stage asks the stage below with the steps both sides above
        hold; nothing changes here until it has agreed.
        """
        s = self.serving
        common = common_step(ours, theirs)           # also validates ``theirs``
        if s.link is None:
            return common
        both = sorted(set(ours) & set(theirs)) or [0]
        steps = msg.body.get("steps")
        s.link.set_reply_specs(backward_specs(s.stage, mbs, s.codecs[GRADIENT]))
        try:
            return s.link.handshake(hello(s.exp, s.opts.stage, s.opts.seed, s.stage.output_shape,
                                          msg.run, both, steps if isinstance(steps, int)
                                          and not isinstance(steps, bool) else 0, mbs,
                                          relayed=msg.body.get("parts"),
                                          staleness=msg.body.get("staleness", 0)))
        except PeerRejected as e:
            raise s.refused_below(e, msg) from e

    def round_order(self) -> list[int]:
        return [0] if self.serving.peers[0].status is PeerStatus.ACTIVE else []

    def owed_after_round(self) -> set[int]:
        """Its evaluations are answered when they arrive (``answer_evaluations``)."""
        return set()

    def settled_for(self, peer: Peer) -> bool:
        return True

    def step_failed(self, peer: Peer, msg: Message, code: ErrorCode, error: Exception) -> Reply:
        raise ProtocolError(code, str(error)) from error

    def awaited(self) -> list[Peer]:
        return [p for p in self.serving.peers if p.status is PeerStatus.ACTIVE]

    def silent(self, peer: Peer, now: float) -> bool:
        s = self.serving
        if s.lost_since is None:
            s.lost_since = now
            s.log.warning("client of run %s silent for more than %g s; keeping its state at step %d "
                          "and waiting for it (or a new run)", peer.run, s.opts.liveness_s, s.stage.step)
        return False

    def seen(self, peer: Peer) -> None:
        s = self.serving
        if s.lost_since is not None:
            s.log.info("client of run %s is back", peer.run)
            s.lost_since = None

    def lost_message(self) -> str:
        s = self.serving
        return (f"client of run {s.state.run_id} lost for more than {s.opts.liveness_s + s.opts.peer_deadline_s:g} s "
                f"at step {s.stage.step}; giving up")

    def lost_status(self) -> str:
        return "interrupted"

    def completed_message(self, finished: dict[str, Any]) -> str:
        return f"run {finished['run_id']} completed: {finished['steps']} steps, final loss {finished['final_loss']}"

    def expected_run(self) -> str:
        s = self.serving
        return f"run {s.peers[0].run}" if s.active else "a hello first"

    def pong_run(self) -> str:
        s = self.serving
        return s.peers[0].run if s.active else ""

    def reported_step(self) -> int:
        return self.serving.stage.step

    def checkpoint_step(self) -> int | None:
        return None

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def resumed(self, now: float) -> None:
        """The peer of the checkpoint's run gets a full liveness window to come back."""
        s = self.serving
        ckpt_step = s.stage.step
        s.new_run(start_round=ckpt_step + 1)
        s.active, s.now = True, now
        peer = s.peers[0]
        peer.run, peer.owner, peer.step = s.state.run_id, s.state.owner, ckpt_step
        peer.status, peer.last_seen = PeerStatus.ACTIVE, now
        s.expect(peer, peer.mbs)             # until its hello says otherwise
        s.start_round()

    def at_round_boundary(self) -> bool:
        return True

    def summary_fields(self) -> dict[str, Any]:
        return evaluation_fields(self.serving.peers[0].evaluation)
