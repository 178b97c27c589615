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

A topology decides; the serving stage acts. It reads where the run stands
(``peers.RunState``, ``run``) and what the stage is built with
(``ServingView``, ``serving``: read-only), and returns its decisions as small
typed values (``decisions``: ``Take``, ``Computed``, ``Join``, ``Failure``,
``Evaluate``, ``Liveness``, ...), which the serving stage applies, each kind
in one place. It writes no field of the serving stage, its run or its peers;
it keeps only lookup hints of its own, each checked before it is used (the
peer of a run id, ``Topology.runs``; the targets of the step in progress; how
far ``Parties`` has found the parties' parts of a micro-batch), so a message
costs the same whatever the number of peers. Adding a topology means adding
one subclass and choosing it in ``serving.topology_for``.
"""

from __future__ import annotations

import abc
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol, cast

import numpy as np

from distgrad.wire import messages as wire
from distgrad.errors import (CodecRangeError, DistgradError, NonFiniteError, PeerAborted, PeerRejected,
                             ProtocolError, StageError)
from distgrad.config.experiment import client_stage_name
from distgrad.run import kept_replies
from distgrad.run.decisions import (Average, Computed, Evaluate, Failure, Gradients, Hearing, Join, Liveness,
                                    Resume, SavedPeer, ScoreAgain, Scores, Take, Transition)
from distgrad.run.handshake import check_hello, common_step, hello
from distgrad.wire.link import check_evaluation, check_reply, final_body, is_final
from distgrad.run.peers import Peer, PeerStatus, Phase, RunState
from distgrad.run.protocol import (abort_reason, check_lockstep, check_owner, hello_peer, is_abort_notice,
                                   rejoin_step, resent_evaluation, unknown_run)
from distgrad.stage.records import evaluation_fields
from distgrad.stage.stage import average_parameters, backward_specs, evaluate_held_out, kept_model, micro_batch
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import ACTIVATION, EVALUATION, GRADIENT, TEST, stream_name

if TYPE_CHECKING:
    from distgrad.config.data import DataSource
    from distgrad.config.experiment import Experiment
    from distgrad.run.accepts import Accepts
    from distgrad.run.metering import Metering, NoMetering, PeerMeters
    from distgrad.run.options import StageOptions
    from distgrad.run.stage_state import StageState
    from distgrad.stage.engine import StepEngine
    from distgrad.stage.stage import Stage
    from distgrad.wire.link import DownstreamLink


class ServingView(Protocol):
    """What a topology reads of its serving stage (``serving.ServingStage``): read-only. The run's state is
    ``run``; the rest is what the stage is built with (and computes with: the stage, its link below)."""

    @property
    def run(self) -> RunState: ...
    @property
    def opts(self) -> StageOptions: ...
    @property
    def exp(self) -> Experiment: ...
    @property
    def parties(self) -> list[str]: ...
    @property
    def upstream(self) -> str: ...
    @property
    def state(self) -> StageState: ...
    @property
    def stage(self) -> Stage: ...
    @property
    def engine(self) -> StepEngine: ...
    @property
    def data(self) -> list[LabelSource]: ...
    @property
    def input_shapes(self) -> list[tuple[int, ...]]: ...
    @property
    def accepts(self) -> Accepts: ...
    @property
    def link(self) -> DownstreamLink | None: ...
    @property
    def metrics(self) -> tuple[str, ...]: ...
    @property
    def log(self) -> logging.Logger: ...
    @property
    def metering(self) -> Metering | PeerMeters | NoMetering: ...     # the privacy meters a computed input feeds

    def encode(self, direction: str, x: np.ndarray, stream: str, step: int,
               rows: np.ndarray | None = None) -> dict[str, np.ndarray]: ...

    def refused_below(self, e: PeerRejected, msg: Message) -> ProtocolError: ...


GradsLater = Callable[[], dict[str, np.ndarray]]    # a micro-batch's parameter gradients, computed when called


class LabelSource(Protocol):
    """What a serving stage reads of its data (``config.data``: a source of rows, possibly a view of one):
    the targets of a step or of rows, its own features (a label owner with a ``bottom``), the held-out rows
    (the first ``validation_count`` of them validation rows)."""

    validation_count: int

    def targets(self, step: int) -> np.ndarray: ...
    def true_targets(self, step: int) -> np.ndarray: ...
    def targets_at(self, rows: np.ndarray) -> np.ndarray: ...
    def features(self, step: int) -> np.ndarray: ...
    def features_at(self, rows: np.ndarray) -> np.ndarray: ...
    def test_targets(self) -> np.ndarray: ...
    def test_features(self) -> np.ndarray: ...


def label_sources(sources: list[DataSource]) -> list[LabelSource]:
    """``sources`` as what a serving stage reads of them. Which of these a source has depends on its kind
    (row-addressed sources have ``targets_at``, held-out rows have ``test_targets``...); the experiment's
    checks ensure a stage only asks for what its data has."""
    return cast("list[LabelSource]", sources)


class Topology(abc.ABC):
    """What one topology decides for a serving stage (``serving``, read through ``ServingView``; its run's
    state ``serving.run``).

    The defaults are those of a stage serving several peers that counts the
    run's steps itself (``Clients`` and ``Parties``); ``OnePeer`` overrides them.
    Every topology decides its abstract methods: how a peer joins, the order
    of a round, whose turn it is, how a round, the joining and the evaluations
    after a round advance, a micro-batch's computation, what a failed step and
    a silent peer mean, and how the end of a run (completed or lost) is told.
    """

    def __init__(self, serving: ServingView, count: int) -> None:
        self.serving = serving
        self.run: RunState = serving.run    # where the run stands: the serving stage's, read here, never written
        self.count = count          # the peers it serves
        self.runs: dict[str, Peer] = {}     # run id -> the peer ``peer_of`` found for it (cleared at a hello)
        self.held_targets: dict[int, tuple[int, np.ndarray]] = {}   # data index -> (step, its targets)

    # -- what the stage is built with
    def steps(self) -> int | None:
        """The run's steps when this stage counts them (several peers); None: its one peer says (bye)."""
        return self.serving.opts.total_steps

    def build_data(self, seed: int, stage: str) -> list[LabelSource]:
        """Each peer's data at this stage (its targets and held-out rows): a shard per data owner."""
        exp = self.serving.exp
        return label_sources([exp.build_data(seed, client=c, stage=stage) for c in range(self.count)])

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
        return self.targets(index, step) if mbs == 1 else micro_batch(self.targets(index, step), mb, mbs)

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
        return hello_peer(body, self.serving.exp.name, clients=self.count)

    def check_staleness(self, staleness: int) -> None:
        """Several peers take lockstep steps only: a hello asking for steps in flight is refused."""
        check_lockstep(staleness)

    def check_owner(self, peer: Peer, msg: Message, peer_key: str) -> None:
        """With CURVE a peer is the key it first said hello with; and a hello may not name the run id of
        another peer (another client or party) of this stage: messages find their peer by run id
        (``peer_of``), so that hello would take the other's turns, replies and scores. ``ProtocolError``
        (code ``run``), before anything changes."""
        if peer.owner and peer_key != peer.owner:
            raise ProtocolError(ErrorCode.RUN, f"{self.name(peer)} said hello with another client key before")
        other = next((p for p in self.run.peers if p is not peer and p.run == msg.run), None)
        if other is not None:
            raise ProtocolError(ErrorCode.RUN, f"run {msg.run!r} is {self.name(other)}'s; {self.name(peer)} needs "
                                               f"a run id of its own")

    @abc.abstractmethod
    def join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> Join:
        """Where ``peer`` goes on from after a valid hello (``ProtocolError`` when it may not join now)."""

    # -- the rounds
    @abc.abstractmethod
    def round_order(self) -> list[int]:
        """The peers taking part in the round that starts, in turn order (a peer rejoining takes part)."""

    def turn_peers(self) -> list[Peer]:
        """The peers whose micro-batches this stage takes now (none between rounds)."""
        run = self.run
        if run.phase is not Phase.ROUND or run.turn >= len(run.order):
            return []
        return [run.peers[run.order[run.turn]]]

    def peer_of(self, msg: Message) -> Peer:
        """The peer whose run ``msg`` belongs to: the first taking part in the open run with its run id;
        ``ProtocolError`` (``RUN``) when none said hello for it. The peer found for a run id is looked at
        first (``runs``, cleared at every hello: only a hello changes whose run is whose), so a message does
        not cost a scan of every peer."""
        run = self.run
        peer = self.runs.get(msg.run)
        if peer is not None and peer.run == msg.run and run.active and peer.status is not PeerStatus.ABSENT:
            return peer
        for peer in run.peers:
            if peer.run == msg.run and run.active and peer.status is not PeerStatus.ABSENT:
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
    def advance_round(self) -> Take | Transition:
        """The next piece of a round's work: the micro-batch to compute now, or how the phase moves on
        (``WAIT`` while it waits for a message)."""

    @abc.abstractmethod
    def compute(self, peers: tuple[Peer, ...], msgs: list[Message], now: float) -> Computed:
        """Compute ``peers``' micro-batch (``msgs``, taken from their waiting forwards: ``Take``): the replies
        now, the gradients to add once they have left, or the failure. Writes no serving state."""

    @abc.abstractmethod
    def advance_joining(self, now: float) -> Transition:
        """``START_ROUND`` (or ``ROUND_DONE``) once the first round's peers are there; ``WAIT`` until then."""

    @abc.abstractmethod
    def advance_evaluating(self) -> Evaluate | None:
        """The evaluations due after a round that can be answered now (``then_start``: the last of them,
        the next round starts); None while none can."""

    @abc.abstractmethod
    def answer_evaluations(self) -> Evaluate | None:
        """The evaluations outside a round's end (one peer; every peer's after the last step) that can be
        answered now; None when none can."""

    @abc.abstractmethod
    def score(self, group: tuple[Peer, ...], requests: list[Message]) -> Scores:
        """The held-out scores of ``group``'s evaluation ``requests`` (forward only: changes no state)."""

    def check_average(self, peer: Peer, msg: Message) -> Message | None:
        """A SplitFed peer's parameters for the average after its round: the reply to a resent request, or
        None once checked (answered once every peer's are in: ``advance_averaging``)."""
        s = self.serving
        if peer.averaged is not None and peer.averaged.step == msg.step:
            return peer.averaged
        if peer.status is not PeerStatus.ACTIVE:
            raise ProtocolError(ErrorCode.RUN, f"client {peer.index} does not take part in this average "
                                               f"(it was dropped or is rejoining); say hello again")
        every = s.exp.clients.average_every
        if s.exp.clients.mode != "splitfed":
            raise ProtocolError(ErrorCode.TYPE, f"an average is for SplitFed clients; experiment {s.exp.name!r} "
                                                f"averages nothing (its [clients] mode is not \"splitfed\")")
        if msg.step != peer.step or msg.step % every:
            raise ProtocolError(ErrorCode.STEP, f"average at step {msg.step}: client {peer.index} is at step "
                                                f"{peer.step}; this run averages every {every or 'never'} steps")
        self._check_parameters(peer, msg)
        return None

    def _check_parameters(self, peer: Peer, msg: Message) -> None:
        """An average's tensors (``Accepts.average_specs``): the first stage's parameters, or, where this
        stage's file does not define that stage, those every average of the run accepted so far carries (the
        other clients' first, then this client's own earlier ones: a client sending its average again with
        other shapes does not change the model the run averages). Raises ``ProtocolError``; nothing changes."""
        s = self.serving
        earlier = sorted(((p, m) for p in self.run.peers for m in (p.average, p.averaged)
                          if m is not None and m is not msg), key=lambda pm: pm[0] is peer)
        try:
            wire.expect_tensors(msg, s.accepts.average_specs(msg, [m for _, m in earlier]), s.exp.allow_nonfinite)
        except ProtocolError as e:
            if s.accepts.params is not None or not earlier or e.code != ErrorCode.TENSOR:
                raise
            model = ("the model it sent before in this run" if earlier[0][0] is peer
                     else f"the model client {earlier[0][0].index} averages")
            raise ProtocolError(ErrorCode.TENSOR, f"client {peer.index}'s parameters are not {model} (every "
                                                  f"client of a SplitFed run has the same first stage): "
                                                  f"{e.args[0]}") from e

    def advance_averaging(self) -> Average | None:
        """SplitFed: once every peer of the round sent its parameters, their mean, for each of them; None
        while one is missing."""
        run = self.run
        taking_part = [run.peers[i] for i in run.order if run.peers[i].status is PeerStatus.ACTIVE]
        averages = [p.average for p in taking_part]
        if any(average is None for average in averages):
            return None
        mean = average_parameters([a.tensors for a in averages if a is not None]) if taking_part else {}
        return Average(tuple(taking_part), mean)

    def due(self, peer: Peer, step: int) -> bool:
        """``peer`` (taking part) evaluates after step ``step``, before the next round (its ``eval_every``);
        after the last step it evaluates once every round is done (phase DONE)."""
        steps = self.run.steps
        return (peer.status is PeerStatus.ACTIVE and step == peer.step and peer.eval_every > 0
                and step % peer.eval_every == 0 and (steps is None or step < steps))

    def owed_after_round(self) -> set[int]:
        """The peers due to evaluate after the round just done (answered before the next round starts)."""
        run = self.run
        return {i for i in run.order if self.due(run.peers[i], run.round)}

    def client_of(self, peers: tuple[Peer, ...]) -> int | None:
        """The client a step's update is recorded for (the metrics), None for a run's one source of steps."""
        return None

    # -- failures
    def failed(self, peer: Peer, error: DistgradError) -> Failure:
        """``peer``'s step gave a non-finite loss or gradient (or it stopped, ``aborted``): nothing of it
        applied; the run fails."""
        return Failure((peer,), error, ends_run=True, reset_engine=True, clear_waiting=True)

    def notice(self, peer: Peer, msg: Message) -> Failure:
        """An ``aborted`` notice (``wire.abort_notice``) from the peer whose run it is (the owner check is the
        serving stage's): it stopped before the end and says why (``aborted``), as a failed step (nothing of
        a step in progress applied): the run fails, or for a client only that client is dropped. No reply:
        a notice is not a request. Any other error message is refused."""
        if not is_abort_notice(msg):
            raise ProtocolError(ErrorCode.TYPE, "a serving stage takes no error messages but an aborted notice")
        reason = abort_reason(msg)
        self.serving.log.error("%s stopped before the end of its run: %s", self.name(peer), reason)
        return self.failed(peer, PeerAborted(reason))

    def deferred_failed(self, peers: tuple[Peer, ...], error: NonFiniteError) -> Failure:
        """The deferred gradients of ``peers``' micro-batch were not finite: each hears of it on its next
        message; the step starts again."""
        return Failure(peers, error, reset_engine=True, told_later=True)

    # -- liveness and the end of the run
    @abc.abstractmethod
    def tick(self, now: float) -> Liveness:
        """What the peers this stage waits for that stayed silent for ``liveness_s`` mean: those dropped,
        and since when the run is lost."""

    def heard(self, peer: Peer) -> Hearing:
        """What a message from ``peer`` (or its hello) says about the run's liveness."""
        return Hearing.ALIVE

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

    def welcome_fields(self) -> dict[str, Any]:
        """What a welcome adds for this topology."""
        return {}

    def reported_step(self) -> int:
        """The steps done, as a pong reports them."""
        return min(self.run.rounds_done, self.run.steps or 0)

    # -- checkpoints and summary
    def checkpoint_step(self) -> int | None:
        """The step a checkpoint is taken as (None: the stage's own step count)."""
        return self.run.rounds_done

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the stage: every peer's run and step."""
        return {"peers": [{"run": p.run, "owner": p.owner, "step": p.step, "loss": p.loss}
                          for p in self.run.peers]}

    def checkpoint_arrays(self, step: int) -> dict[str, np.ndarray]:
        """What the checkpoint of step ``step`` keeps besides the stage, as arrays (none by default)."""
        return {}

    def resent_reply(self, msg: Message, peer_key: str) -> Message | ScoreAgain | None:
        """The reply to ``msg`` (from ``peer_key``) when it repeats a request answered before that no peer's
        state answers now: a bye of a completed run. None: ``msg`` is handled as any message."""
        return self.run.bye_replies.get(msg.run) if msg.type == wire.BYE else None

    def resumed(self, now: float) -> Resume:
        """After ``resume_latest``: the peers' runs as saved; the run continues after the checkpoint's round."""
        state = self.serving.state
        saved = tuple(SavedPeer(peer.index, entry.get("run", ""), entry.get("owner", ""), entry.get("loss"))
                      for peer, entry in zip(self.run.peers, state.resumed_meta.get("peers", [])))
        return Resume(state.resumed_step + 1, saved)

    def at_round_boundary(self) -> bool:
        """Between rounds: the live state is a whole step of the run (what a checkpoint may hold)."""
        run = self.run
        return run.phase in (Phase.JOINING, Phase.EVALUATING, Phase.DONE) or (
            run.phase is Phase.ROUND and run.turn == 0 and self.serving.engine.done == 0)

    @abc.abstractmethod
    def summary_fields(self) -> dict[str, Any]:
        """What the run's summary adds for this topology."""


class Turns(Topology):
    """Peers that take their steps one at a time (``OnePeer``, ``Clients``): a peer's micro-batches go
    through this stage (and the stages below) and each gets its reply."""

    def advance_round(self) -> Take | Transition:
        run = self.run
        if run.turn < len(run.order):
            peer = run.peers[run.order[run.turn]]
            if peer.status is not PeerStatus.ACTIVE:
                return Transition.NEXT_TURN
            key = (run.round, self.serving.engine.done)
            return Take((peer,), key) if key in peer.waiting else Transition.WAIT
        for p in run.peers:
            if p.taking_part():
                return Transition.END_ROUND
        return Transition.WAIT      # nobody takes part (any more): wait for a hello or the bye's end

    def advance_joining(self, now: float) -> Transition:
        s, run = self.serving, self.run
        present = [p for p in run.peers if p.status is PeerStatus.ACTIVE]
        waited = run.first_hello is not None and now - run.first_hello > s.opts.peer_deadline_s
        if len(present) < self.count and not (present and waited):
            return Transition.WAIT
        if len(present) < self.count:
            s.log.warning("starting with clients %s: the others did not say hello within %g s",
                          [p.index for p in present], s.opts.peer_deadline_s)
        return Transition.START_ROUND

    def advance_evaluating(self) -> Evaluate | None:
        run = self.run
        # In peer order; nothing changes this stage until every peer due has been answered.
        ready = [run.peers[i] for i in sorted(run.owed) if self._requested(run.peers[i], run.round + 1)]
        then_start = len(ready) == len(run.owed)
        return Evaluate(tuple((peer,) for peer in ready), then_start) if ready or then_start else None

    @staticmethod
    def _requested(peer: Peer, step: int) -> bool:
        return peer.evaluate is not None and peer.evaluate.step == step and not is_final(peer.evaluate)

    def answer_evaluations(self) -> Evaluate | None:
        ready = tuple((peer,) for peer in self.run.peers if peer.evaluate is not None and self.settled_for(peer))
        return Evaluate(ready) if ready else None

    def settled_for(self, peer: Peer) -> bool:
        """No other peer can still change this stage's parameters: ``peer``'s evaluation is final."""
        return self.run.phase is Phase.DONE

    def awaited(self) -> list[Peer]:
        """The peers taking part that this stage waits for now."""
        run = self.run
        waiting_for = []
        current = self.current()
        if current is not None and current.status is PeerStatus.ACTIVE:
            waiting_for.append(current)
        if run.phase is Phase.AVERAGING:
            waiting_for += [run.peers[i] for i in run.order
                            if run.peers[i].status is PeerStatus.ACTIVE and run.peers[i].average is None]
        if run.phase is Phase.EVALUATING:
            waiting_for += [run.peers[i] for i in sorted(run.owed) if run.peers[i].status is PeerStatus.ACTIVE]
        if run.phase is Phase.DONE:
            waiting_for += [p for p in run.peers if p.status is PeerStatus.ACTIVE and p not in waiting_for]
        return waiting_for

    def tick(self, now: float) -> Liveness:
        run = self.run
        if run.phase is Phase.JOINING:
            return Liveness((), run.lost_since, advance=True)     # the first round may start without a late peer
        silent = [peer for peer in self.awaited() if now - peer.last_seen > self.serving.opts.liveness_s]
        return self.silent(silent, now)

    @abc.abstractmethod
    def silent(self, peers: list[Peer], now: float) -> Liveness:
        """``peers``, awaited, have been silent for ``liveness_s``: which are dropped, since when the run is
        lost."""

    # -- one micro-batch of a turn
    def in_turn(self, peer: Peer) -> bool:
        run = self.run
        return run.phase is Phase.ROUND and run.turn < len(run.order) and run.order[run.turn] == peer.index

    def compute(self, peers: tuple[Peer, ...], msgs: list[Message], now: float) -> Computed:
        """One micro-batch of the peer in turn: its reply now; its gradients (and the update after the last)
        deferred until the reply has left."""
        s, (peer,), (msg,) = self.serving, peers, msgs
        started = time.perf_counter()
        try:
            with s.engine.stage.labels_drawn_if_sent():     # a label drawn for a reply refused is not released
                mb_loss, dx, grads_later = self._loss_and_gradient(peer, msg)
                s.engine.stage.check_finite("activation_grad", dx, msg.step)
                tensors = s.encode(GRADIENT, dx, peer.streams[msg.mb], msg.step, msg.tensors.get("rows"))
        except NonFiniteError as e:
            s.log.error("%s", e)
            return self.step_failed(peer, msg, ErrorCode.NONFINITE_STEP, e, self.failed(peer, e))
        except StageError as e:
            return self.step_failed(peer, msg, ErrorCode.STAGE, e, None)
        except ProtocolError as e:
            # Refused from below: the peer sends again after its handshake.
            return Computed([], failure=Failure((peer,), e, clear_waiting=True), refusal=e)
        body = s.engine.senders.reply_body(mb_loss)     # without the loss when this stage withholds it
        reply = Message(wire.BACKWARD, msg.run, msg.step, msg.mb, msg.mbs, body=body, tensors=tensors)
        body["compute_s"] = time.perf_counter() - started     # for the driver's metrics: this stage and below
        return Computed([(peer, reply)], Gradients(peers, msg.step, msg.mb, msg.mbs, grads_later, mb_loss, dx,
                                                   self.client_of(peers), peer.index))

    def _loss_and_gradient(self, peer: Peer, msg: Message) -> tuple[np.float32 | None, np.ndarray, GradsLater]:
        """The micro-batch's loss (here or below; None when the label owner below withheld it), its activation
        gradient and its parameter gradients to compute later."""
        s = self.serving
        x = msg.tensors["activation"]
        if s.link is not None:
            return self._through(s.link, msg, x)
        target, rows = msg.tensors.get("target"), msg.tensors.get("rows")
        if rows is not None or target is None:      # else the peer sent them (the first stage holds labels)
            target = self.micro_targets(peer.index, msg.step, msg.mb, msg.mbs, rows)
        stage = s.engine.stage          # ``s.stage``, without two properties on the way
        mb_loss, dx, grads_later = stage.loss_micro_batch_deferred(x, target, msg.mb)
        stage.check_finite("loss", mb_loss, msg.step)
        s.metering.received_activations(msg.step, msg.mb, msg.mbs, x, peer.index)     # model completion's input
        return mb_loss, dx, grads_later

    @abc.abstractmethod
    def step_failed(self, peer: Peer, msg: Message, code: str, error: DistgradError,
                    failure: Failure | None) -> Computed:
        """``peer``'s micro-batch failed (``code``; ``failure``: what that does, if decided already): the
        reply it gets, or the refusal to raise."""

    def _through(self, link: DownstreamLink, msg: Message, x: np.ndarray
                 ) -> tuple[np.float32 | None, np.ndarray, GradsLater]:
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
        link.send(down)
        try:
            reply = link.await_reply({key: down}, key)
        except PeerRejected as e:
            if e.code == ErrorCode.NONFINITE_STEP:
                raise NonFiniteError(e.peer_message) from e
            raise s.refused_below(e, msg) from e
        below = s.exp.stage_names[s.exp.stage_index(s.opts.stage) + 1]
        assert link.reply_specs is not None         # set at the handshake (``OnePeer._agree``)
        loss, dy = check_reply(reply, msg.step, link.reply_specs, s.exp.allow_nonfinite, below)
        dx, grads_later = s.stage.backward_deferred(cache, dy)
        return loss, dx, grads_later

    def score(self, group: tuple[Peer, ...], requests: list[Message]) -> Scores:
        """The peer's evaluation: forward only on the held-out rows (here, or passed on below); the final one
        (``link.is_final``) with the kept model (``StageState.kept_model``) on the test rows."""
        s, (peer,), (msg,) = self.serving, group, requests
        last = s.run.steps or peer.steps
        target = msg.tensors.get("target")
        final = is_final(msg)
        try:
            with kept_model(s.stage, s.state.kept_model() if final else None):
                if s.link is None:
                    data = s.data[peer.index]
                    result = evaluate_held_out(s.stage, msg.tensors["activation"],
                                               data.test_targets() if target is None else target, s.metrics,
                                               data.validation_count if target is None else 0, final)
                else:
                    y, _ = s.stage.forward(msg.tensors["activation"], training=False)
                    tensors = {**s.state.senders.evaluation_tensors(y, msg.step, TEST if final else EVALUATION),
                               **({"target": target} if target is not None else {})}
                    try:
                        result = check_evaluation(s.link.exchange(
                            Message(wire.EVALUATE, msg.run, msg.step, body=final_body(final), tensors=tensors)))
                    except PeerRejected as e:
                        return Scores(msg.step - 1, None, (e.code, str(s.refused_below(e, msg))), last, final)
        except (StageError, CodecRangeError) as e:
            return Scores(msg.step - 1, None, (ErrorCode.STAGE, str(e)), last, final)
        return Scores(msg.step - 1, result, None, last, final)


class Clients(Turns):
    """Several data owners, each round in turn in client order; SplitFed averages their first stages
    (``ServingStage`` runs the averaging phase). A silent or failing client is dropped, the others go on;
    it may say hello again and takes part from the next round. A round's checkpoint keeps its replies,
    which a restarted stage gives again to a client that sends their requests again."""

    def __init__(self, serving: ServingView, count: int) -> None:
        super().__init__(serving, count)
        # Run id -> the client whose replies a resumed checkpoint kept (a hint: it must still be absent).
        self.resuming: dict[str, Peer] = {}

    def join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> Join:
        s, run = self.serving, self.run
        if run.phase is Phase.DONE:
            raise ProtocolError(ErrorCode.RUN, f"every step of this run is done; client {peer.index} cannot "
                                               f"join now")
        if peer.live(now, s.opts.liveness_s) and peer.run != msg.run:
            busy = wire.busy_text("run", peer.run, peer.since, f"client {peer.index}", now - peer.last_seen,
                                  s.opts.liveness_s)
            raise ProtocolError(ErrorCode.RUN, f"{busy}; cannot start run {msg.run!r}")
        held = msg.body.get("held")
        common_step([0], held)         # validates the list
        assert isinstance(held, list)
        same_run = peer.run == msg.run
        owner = peer.owner if same_run else peer_key
        since = peer.since if same_run else time.time()
        if run.phase is Phase.JOINING:
            start = run.round            # the round before the first (0, or the resumed checkpoint's)
            if start not in held:
                s.log.warning("client %d does not hold step %d, where this stage resumes; it goes on from "
                              "there with the parameters it has", peer.index, start)
            return Join(start + 1, PeerStatus.ACTIVE, start, msg.run, owner, since, None, open_run=True)
        if same_run and peer.status is PeerStatus.ACTIVE:
            # Still taking part: it continues where this stage has it; a turn of its in progress
            # starts again from its first micro-batch. A client restarted without the update of its
            # last step here (killed after this stage's replies, before its own checkpoint of it) that
            # holds the step before sends that step again: it gets the kept replies and applies the
            # update once, instead of skipping it.
            next_step = self._rejoin_step(peer, held, mbs)
            return Join(next_step, PeerStatus.ACTIVE, peer.step, msg.run, owner, since, (0, peer.step),
                        open_run=True, reset_engine=self.current() is peer, still_owes=next_step <= peer.step)
        s.log.warning("client %d rejoins (run %s); it takes part again from step %d", peer.index, msg.run,
                      run.round + 1)
        # it takes part from the next round that starts
        return Join(run.round + 1, PeerStatus.REJOINING, run.round, msg.run, owner, since, None, open_run=True)

    @staticmethod
    def _rejoin_step(peer: Peer, held: list[int], mbs: int) -> int:
        """The step ``peer``, saying hello again in its run holding ``held`` steps with ``mbs`` micro-batches,
        goes on from: as for one data owner (``protocol.rejoin_step``), the newest step it holds from which
        every later step it took here is answered again from its kept replies, plus one; when there is none
        (or it asks for another micro-batch count than they were sent in), the step after its latest here,
        the steps in between skipped."""
        if mbs == peer.mbs:
            try:
                return rejoin_step(held, peer.step, peer.cached, mbs, f"client {peer.index}", peer.run)
            except ProtocolError:
                pass
        return peer.step + 1

    def checkpoint_arrays(self, step: int) -> dict[str, np.ndarray]:
        """The replies of round ``step`` (``kept_replies``)."""
        return kept_replies.kept_arrays(self.run.peers, step)

    def resumed(self, now: float) -> Resume:
        """As ``Topology.resumed``; the replies of the checkpoint's round go back in the clients' caches, and
        a client not yet back that sends one of its requests again gets its reply (``resent_reply``)."""
        resume = super().resumed(now)
        state = self.serving.state
        runs = {saved.peer: saved.run for saved in resume.peers}
        kept = kept_replies.kept(runs, state.resumed_extra, state.resumed_step)
        self.resuming = {runs.get(index, ""): self.run.peers[index] for index in kept}
        return resume._replace(kept=kept)

    def resent_reply(self, msg: Message, peer_key: str) -> Message | ScoreAgain | None:
        """As ``Topology.resent_reply``; also, from a client of the resumed run (its owner key) that has not
        said hello since, the requests of the checkpoint's round whose replies the restart lost: a forward or
        an average gets its reply again, and the evaluation after that round is scored, while every client is
        still away and this stage holds exactly that round's parameters. (Any other message of such a client
        is refused: it says hello and goes on after that round.)"""
        s, run = self.serving, self.run
        peer = self.resuming.get(msg.run)
        if (peer is None or peer.run != msg.run or peer.status is not PeerStatus.ABSENT or not run.active
                or (peer.owner and peer_key != peer.owner)):
            return super().resent_reply(msg, peer_key)
        if msg.type == wire.AVERAGE:
            return peer.averaged if peer.averaged is not None and peer.averaged.step == msg.step else None
        if msg.type == wire.EVALUATE and run.phase is Phase.JOINING and msg.step == run.round + 1:
            if (again := resent_evaluation(peer.evaluated, msg)) is not None:
                return again
            s.accepts.evaluation(peer.index, msg).receive(msg, s.exp.allow_nonfinite)
            return ScoreAgain(peer, msg)
        return peer.cached.get((msg.step, msg.mb)) if msg.type == wire.FORWARD else super().resent_reply(msg, peer_key)

    def round_order(self) -> list[int]:
        return [p.index for p in self.run.peers if p.status is PeerStatus.ACTIVE]

    def client_of(self, peers: tuple[Peer, ...]) -> int | None:
        return peers[0].index

    def failed(self, peer: Peer, error: DistgradError) -> Failure:
        """That client is dropped (the engine resets only if it was its turn), the others go on."""
        return Failure((peer,), error, drop=True, clear_waiting=True)

    def deferred_failed(self, peers: tuple[Peer, ...], error: NonFiniteError) -> Failure:
        return Failure(peers, error, drop=True, told_later=True)

    def step_failed(self, peer: Peer, msg: Message, code: str, error: DistgradError,
                    failure: Failure | None) -> Computed:
        if code is ErrorCode.STAGE:
            self.serving.log.warning("client %d dropped: %s", peer.index, error)
            failure = Failure((peer,), error, drop=True)
        return Computed([(peer, wire.error_message(msg.run, msg.step, code, str(error), msg.mb, msg.mbs))],
                        failure=failure)

    def silent(self, peers: list[Peer], now: float) -> Liveness:
        s, run = self.serving, self.run
        for peer in peers:
            if run.phase is Phase.DONE:
                s.log.warning("client %d silent for more than %g s after the last step, without a bye; "
                              "dropped (the run ends without it)", peer.index, s.opts.liveness_s)
            else:
                s.log.warning("client %d silent for more than %g s at step %d; dropped (the others go on; "
                              "it may say hello again)", peer.index, s.opts.liveness_s, run.round)
        lost = (run.lost_since or now) if self.lost(peers) else None
        return Liveness(tuple(peers), lost, advance=bool(peers))

    def heard(self, peer: Peer) -> Hearing:
        return Hearing.IGNORED if peer.status is PeerStatus.DROPPED else Hearing.ALIVE

    def lost(self, dropped: list[Peer]) -> bool:
        """No client takes part any more once ``dropped`` are, or after the last round none said bye and
        none is left."""
        run = self.run
        if not run.active or run.phase is Phase.JOINING:
            return False
        if run.phase is Phase.DONE:
            return not any(p.status in (PeerStatus.FINISHED, PeerStatus.ACTIVE) and p not in dropped
                           for p in run.peers)
        return not any(p.taking_part() and p not in dropped for p in run.peers)

    def lost_message(self) -> str:
        s, run = self.serving, self.run
        when = "after the last step, none having said bye" if run.phase is Phase.DONE else f"at step {run.round}"
        return f"every client lost for more than {s.opts.peer_deadline_s:g} s {when}; giving up"

    def completed_message(self, finished: dict[str, Any]) -> str:
        first = self.serving.exp.stage_names[0]
        peers = self.run.peers
        said_bye = [client_stage_name(first, p.index) for p in peers if p.status is PeerStatus.FINISHED]
        dropped = [client_stage_name(first, p.index) for p in peers if p.status is not PeerStatus.FINISHED]
        return (f"run completed: {finished.get('rounds', 0)} steps, clients {said_bye} said bye, clients {dropped} "
                f"were dropped")

    def summary_fields(self) -> dict[str, Any]:
        run = self.run
        return {"clients": [{"client": p.index, "run_id": p.run, "steps": p.step, "final_loss": p.loss,
                             "status": "completed" if p.status is PeerStatus.FINISHED else "dropped",
                             **evaluation_fields(p.evaluation)} for p in run.peers],
                "rounds": min(run.rounds_done, run.steps or 0)}


class OnePeer(Turns):
    """One driving peer (a two-stage run, a chain). It says when its run ends (bye); its hello of the same
    run rolls both sides back to the newest step they both hold, a hello of a new run replaces a run whose
    peer is gone. A failed step ends the run; a silent peer is waited for (its state kept)."""

    def steps(self) -> int | None:
        return None

    def build_data(self, seed: int, stage: str) -> list[LabelSource]:
        return label_sources([self.serving.exp.build_data(seed, client=None, stage=stage)])

    def name(self, peer: Peer) -> str:
        return f"client of run {peer.run}"

    def stream(self, peer: Peer) -> str:
        return ""

    def peer_index(self, body: dict[str, Any]) -> int:
        return hello_peer(body, self.serving.exp.name)

    def check_staleness(self, staleness: int) -> None:
        """One peer may keep steps in flight."""

    def check_owner(self, peer: Peer, msg: Message, peer_key: str) -> None:
        """With CURVE a run is the key that opened it; another key may start a new run."""
        if peer.run == msg.run:
            check_owner(peer.owner, peer_key)

    def join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> Join:
        """Its run again (both sides roll back to the newest step all hold), or a new run."""
        s, run = self.serving, self.run
        if run.active and msg.run == peer.run:
            common = self._agree(msg, s.state.held(), msg.body.get("held"), mbs)
            kept = None if common != s.stage.step else (0, common)
            return Join(common + 1, PeerStatus.ACTIVE, common, peer.run, peer.owner, peer.since, kept,
                        rollback=common, restart=True, reset_engine=True)
        if run.active and any(p.live(now, s.opts.liveness_s) for p in run.peers):
            busy = wire.busy_text("run", peer.run, peer.since, "its client", now - peer.last_seen, s.opts.liveness_s)
            raise ProtocolError(ErrorCode.RUN, f"{busy}; cannot start run {msg.run!r}")
        self._agree(msg, [0], msg.body.get("held"), mbs)
        if run.active:
            s.log.warning("run %s replaces run %s, whose client is gone", msg.run, peer.run)
        s.log.info("run %s started by %s", msg.run, msg.body.get("role"))
        # A new run begins at step 0 (a fresh stage), whatever the last one held.
        return Join(1, PeerStatus.ACTIVE, 0, msg.run, peer_key, time.time(), None, begin=True, restart=True,
                    reset_engine=True)

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
        s.link.set_reply_specs(backward_specs(s.stage, mbs, s.exp.codecs[GRADIENT]))
        try:
            return s.link.handshake(hello(s.exp, s.opts.stage, s.opts.seed, s.stage.output_shape,
                                          msg.run, both, steps if isinstance(steps, int)
                                          and not isinstance(steps, bool) else 0, mbs,
                                          eval_every=msg.body.get("eval_every", 0),   # checked: hello_fields
                                          relayed=msg.body.get("parts"),
                                          staleness=msg.body.get("staleness", 0)))
        except PeerRejected as e:
            raise s.refused_below(e, msg) from e

    def round_order(self) -> list[int]:
        return [0] if self.run.peers[0].status is PeerStatus.ACTIVE else []

    def owed_after_round(self) -> set[int]:
        """Its evaluations are answered when they arrive (``answer_evaluations``)."""
        return set()

    def settled_for(self, peer: Peer) -> bool:
        return True

    def step_failed(self, peer: Peer, msg: Message, code: str, error: DistgradError,
                    failure: Failure | None) -> Computed:
        refusal = ProtocolError(code, str(error))
        refusal.__cause__ = error
        return Computed([], failure=failure, refusal=refusal)

    def awaited(self) -> list[Peer]:
        return [p for p in self.run.peers if p.status is PeerStatus.ACTIVE]

    def silent(self, peers: list[Peer], now: float) -> Liveness:
        s, run = self.serving, self.run
        if peers and run.lost_since is None:
            s.log.warning("client of run %s silent for more than %g s; keeping its state at step %d "
                          "and waiting for it (or a new run)", peers[0].run, s.opts.liveness_s, s.stage.step)
            return Liveness((), now)
        return Liveness((), run.lost_since)

    def heard(self, peer: Peer) -> Hearing:
        if self.run.lost_since is not None:
            self.serving.log.info("client of run %s is back", peer.run)
            return Hearing.BACK
        return Hearing.ALIVE

    def lost_message(self) -> str:
        s = self.serving
        return (f"client of run {s.state.run_id} lost for more than {s.opts.liveness_s + s.opts.peer_deadline_s:g} s "
                f"at step {s.stage.step}; giving up")

    def lost_status(self) -> str:
        return "interrupted"

    def completed_message(self, finished: dict[str, Any]) -> str:
        loss = finished.get("training_loss", finished["final_loss"])    # a middle stage's withheld loss says so
        return f"run {finished['run_id']} completed: {finished['steps']} steps, final loss {loss}"

    def expected_run(self) -> str:
        return f"run {self.run.peers[0].run}" if self.run.active else "a hello first"

    def pong_run(self) -> str:
        return self.run.peers[0].run if self.run.active else ""

    def reported_step(self) -> int:
        return self.serving.stage.step

    def checkpoint_step(self) -> int | None:
        return None

    def checkpoint_meta(self) -> dict[str, Any]:
        return {}

    def resumed(self, now: float) -> Resume:
        """The peer of the checkpoint's run gets a full liveness window to come back: its round starts now."""
        state = self.serving.state
        step = state.stage.step
        return Resume(step + 1, (SavedPeer(0, state.run_id, state.owner, self.run.peers[0].loss, step,
                                           PeerStatus.ACTIVE),), begin_round=True)

    def at_round_boundary(self) -> bool:
        return True

    def summary_fields(self) -> dict[str, Any]:
        return evaluation_fields(self.run.peers[0].evaluation)
