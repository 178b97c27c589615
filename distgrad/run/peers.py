"""What a serving stage knows of its peers, and where its run stands: ``Peer``, ``PeerStatus``, ``Phase``,
``RunState``.

Plain records: ``serving.ServingStage`` changes them; its ``topology`` reads them and returns what to do
(``decisions``).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from distgrad.errors import DistgradError
from distgrad.wire.messages import Message
from distgrad.wire.wirecodec import Expected

Envelope = list[bytes]
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
    steps: int = 0                    # the steps of its run (its hello says; 0: not said)
    eval_every: int = 0               # it evaluates after every K-th step (its hello says; 0: at the end only)
    staleness: int = 0                # steps it keeps in flight (its hello says): replies of as many are kept
    specs: Expected | None = None     # what its forwards carry (its micro-batch count, the activation codec)
    streams: list[str] = field(default_factory=list)   # by micro-batch: the stream of its reply's gradient
    last_seen: float = -math.inf      # its last message, or the last reply to it
    since: float = 0.0                # when its run started here (seconds since the epoch; 0: none yet)
    envelope: Envelope = field(default_factory=list)
    waiting: dict[tuple[int, int], Message] = field(default_factory=dict)   # forwards before their turn
    cached: dict[tuple[int, int], Message] = field(default_factory=dict)    # replies of its step in progress
    # With a defense drawing noise: the digest of each forward's tensor frames, by (step, micro-batch), so
    # that a resend answered from ``cached`` must carry what the first one did.
    received: dict[tuple[int, int], str] = field(default_factory=dict)
    average: Message | None = None    # its parameters for the averaging in progress
    averaged: Message | None = None   # the reply to its last averaging
    evaluate: Message | None = None   # its evaluation request, answered once no other peer can change us
    evaluated: Message | None = None  # the reply to its last evaluation (a resent request gets it again)
    tested: Message | None = None     # the reply to its final evaluation (the kept model's test rows): sent again
    loss: float | None = None
    evaluation: dict[str, Any] | None = None
    failure: DistgradError | None = None    # its step failed after the reply: told on its next message

    def taking_part(self) -> bool:
        return self.status in (PeerStatus.ACTIVE, PeerStatus.REJOINING)

    def live(self, now: float, liveness_s: float) -> bool:
        return self.taking_part() and now - self.last_seen <= liveness_s



@dataclass
class RunState:
    """Where a serving stage's run stands: what its topology reads to decide, and only the serving stage
    changes (applying the topology's decisions)."""

    peers: list[Peer]
    steps: int | None                 # the run's steps when this stage counts them (several peers), else None
    phase: Phase = Phase.JOINING
    round: int = 0                    # the round in progress (while joining: the last one done)
    order: list[int] = field(default_factory=list)   # the peers taking part in it, in turn order
    turn: int = 0                     # index into ``order``
    owed: set[int] = field(default_factory=set)      # peers whose evaluation ends the round (phase EVALUATING)
    first_hello: float | None = None  # the first hello of the run's joining
    joined_at: float = 0.0            # when this stage began waiting for its peers (vertical: all)
    lost_since: float | None = None   # since when every peer the run needs is lost (None: it is not)
    active: bool = False              # a run is open (possibly resumed from a checkpoint)
    now: float = 0.0                  # the time of the latest message or tick
    bye_replies: dict[str, Message] = field(default_factory=dict)   # by run: a repeated bye gets its reply

    @property
    def rounds_done(self) -> int:
        """Rounds (steps of the run) completed."""
        return self.round if self.phase in (Phase.JOINING, Phase.EVALUATING) else self.round - 1
