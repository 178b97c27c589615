"""What a topology decides and its serving stage applies: small typed values, returned, never fields written.

A ``topology.Topology`` reads where the run stands (``peers.RunState``) and
returns one of these; ``serving.ServingStage`` applies each kind in one
place (``ServingStage.apply_join``, ``apply_failure``, ...). A topology
therefore cannot leave the serving stage half-updated, and each decision can
be checked alone.

- ``Transition``: how the phase moves on (wait, next turn, start or end a
  round, the evaluations after the round before the first);
- ``Take``: compute these peers' parts of a micro-batch now; the topology's
  ``compute`` then returns ``Computed`` (the replies, their ``Gradients`` to
  add once the replies have left, or a ``Failure``);
- ``Join``: where a peer that said hello goes on from (and what this stage
  rolls back to, begins or restarts for it); ``Resume``: the peers of a
  resumed checkpoint;
- ``Evaluate``: whose held-out outputs to score now (``Scores``, one result
  per group: a peer, or every feature party); ``ScoreAgain``: a resent
  evaluation of a restarted stage's last round;
- ``Average``: the SplitFed mean every peer of the round gets back;
- ``Liveness``: the silent peers dropped and since when the run is lost;
  ``Hearing``: what a message from a peer says about the run's liveness.
"""

from __future__ import annotations

import enum
from typing import Any, Callable, NamedTuple

import numpy as np

from distgrad.errors import DistgradError, ProtocolError
from distgrad.run.peers import Peer, PeerStatus
from distgrad.wire.messages import Message


class Transition(enum.Enum):
    """How a serving stage's phase moves on."""

    WAIT = "wait"                   # nothing to do until a message (or a tick) comes
    NEXT_TURN = "next turn"         # the peer in turn no longer takes part: the next one's turn
    START_ROUND = "start round"     # the next round (or the end of the run after the last)
    END_ROUND = "end round"         # every peer of the round had its turn: average, checkpoint, evaluations
    ROUND_DONE = "round done"       # going on after a round done before (resumed, rolled back): its evaluations


class Take(NamedTuple):
    """Compute micro-batch ``key`` (step, micro-batch) of ``peers`` now (their waiting forwards): the peer in
    turn, or every feature party (whose embeddings combine)."""

    peers: tuple[Peer, ...]
    key: tuple[int, int]


class Failure(NamedTuple):
    """``peers``' step failed (``error``): what that does to them and to the run."""

    peers: tuple[Peer, ...]
    error: DistgradError
    ends_run: bool = False          # the run fails once told (one peer, feature parties)
    drop: bool = False              # the peers no longer take part (clients); the others go on
    reset_engine: bool = False      # the step in progress starts again from its first micro-batch
    clear_waiting: bool = False     # their forwards waiting for their turn are forgotten
    told_later: bool = False        # each hears of it in reply to its next message


class Gradients(NamedTuple):
    """A computed micro-batch's parameter gradients, added once its replies have left (after the last
    micro-batch: the step's update, recorded for ``client``, then ``prefetch`` of the targets of ``data``)."""

    peers: tuple[Peer, ...]
    step: int
    mb: int
    mbs: int
    later: Callable[[], dict[str, np.ndarray]]
    loss: np.float32 | None         # None: the stage below withheld it (this stage passes none up)
    dx: np.ndarray
    client: int | None              # whose step the update is (metrics), None for a run's one source of steps
    data: int                       # whose targets this stage looks up (``Topology.prefetch``)


class Computed(NamedTuple):
    """What computing a micro-batch gave: a reply for each peer (cached, and the peer seen, when the step went
    through: ``gradients``), a ``failure`` to apply, and a ``refusal`` to raise after it."""

    answers: list[tuple[Peer, Message]]
    gradients: Gradients | None = None
    failure: Failure | None = None
    refusal: ProtocolError | None = None


class Join(NamedTuple):
    """Where a peer that said hello goes on from, and what this stage does for it first (in this order:
    ``open_run``, ``rollback`` or ``begin``, ``restart``, ``stale``, the peer's record, ``reset_engine``)."""

    next_step: int                  # the welcome's
    status: PeerStatus              # the peer's from now
    step: int                       # its steps done here
    run: str
    owner: str                      # the CURVE key its run belongs to ("" in plaintext)
    since: float                    # when its run started here (seconds since the epoch)
    kept: tuple[int, int] | None    # its cached replies kept: those of steps first..last; None: none
    open_run: bool = False          # several peers: a run is open from the first hello (named here if new)
    rollback: int | None = None     # this stage goes back to the state after that step
    begin: bool = False             # one peer's new run: a fresh stage, nothing of the last run kept
    restart: bool = False           # the run goes on with round ``step + 1`` (fresh when ``begin``)
    stale: str = ""                 # every other party taking part must say hello again, told this ("": none)
    reset_engine: bool = False      # a step in progress starts again from its first micro-batch
    still_owes: bool = False        # an evaluation owed after the round stays owed (every party evaluates)


class SavedPeer(NamedTuple):
    """Peer ``peer``'s run as a resumed checkpoint has it (``step``, ``status``: set when it takes part at
    once)."""

    peer: int
    run: str
    owner: str
    loss: float | None
    step: int | None = None
    status: PeerStatus | None = None


class Resume(NamedTuple):
    """The run of a resumed checkpoint goes on with round ``round``; ``begin_round``: at once (one peer),
    not after the peers' hellos. ``kept``: each client's replies of the checkpoint's round (``kept_replies``)."""

    round: int
    peers: tuple[SavedPeer, ...]
    begin_round: bool = False
    kept: dict[int, tuple[dict[tuple[int, int], Message], Message | None]] = {}


class Evaluate(NamedTuple):
    """Score these evaluations now: each group's held-out outputs together (one peer, or every feature
    party); ``then_start``: every evaluation owed after the round is then answered and the next round
    starts."""

    groups: tuple[tuple[Peer, ...], ...]
    then_start: bool = False


class ScoreAgain(NamedTuple):
    """A restarted stage's client sends the evaluation of the checkpoint's round again: score ``request``."""

    peer: Peer
    request: Message


class Scores(NamedTuple):
    """The scores of the evaluation after ``step`` (before the verdicts, which the serving stage gives),
    or the ``error`` every peer of the group is answered with; ``last``: the run's last step, if known;
    ``final``: the final evaluation (the kept model on the test rows: recorded, never judged)."""

    step: int
    result: dict[str, Any] | None
    error: tuple[str, str] | None   # (``ErrorCode``, text)
    last: int | None
    final: bool = False


class Average(NamedTuple):
    """SplitFed: every peer of the round (``peers``) gets back ``mean``, the mean of their parameters."""

    peers: tuple[Peer, ...]
    mean: dict[str, np.ndarray]


class Liveness(NamedTuple):
    """After a tick: the silent peers dropped (the others go on), since when every peer the run needs is lost
    (None: it is not), and whether the phase may move on (a round may start without a late peer)."""

    drop: tuple[Peer, ...]
    lost_since: float | None
    advance: bool = False


class Hearing(enum.Enum):
    """What a message from a peer says about the run's liveness."""

    IGNORED = "ignored"             # no sign of life (a dropped client)
    ALIVE = "alive"                 # it is alive
    BACK = "back"                   # it is alive, and the run it was lost from is no longer lost
