"""The data owners a ``run.cut_group.GroupServer`` serves, and where each stands: ``Peer``, ``DataOwners``.

``Peer`` is one data owner's record (a feature party or a client: its run,
owner key, codec streams, forwards kept, replies, bye). ``DataOwners`` holds
them in order and answers what concerns them all: whose a message is, whether
a run or a key is another's, the rows the parties agree on, their held-out
embeddings once every party's are in, their part of a checkpoint. The server
changes the records as it answers each message; nothing here touches a
socket.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from distgrad.errors import ProtocolError
from distgrad.run.cut_interface import CutSide
from distgrad.run.cut_state import Replies, reply_state
from distgrad.run.protocol import hello_peer, unknown_run
from distgrad.stage.stage import micro_batch
from distgrad.wire import messages as wire
from distgrad.wire.codecs import Codec
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import Senders


@dataclass
class Peer:
    """One data owner of a ``GroupServer``: a feature party or a client, with its own run and replies."""

    index: int
    name: str                        # how messages name it: "party b", "client 1"
    role: str                        # the stage its hello names
    shape: tuple[int, ...]           # its activation (and gradient) for a whole batch
    data: Any | None                 # the rows it may send (``send_rows``) and, for a client, its shard's order
    senders: Senders
    run: str = ""                    # its run ("" before its first hello)
    since: float = 0.0               # when that run started here (seconds since the epoch)
    owner: str = ""                  # with CURVE: the key that opened the run
    joined: bool = False             # said hello to this server (a resumed run is taken up at a hello)
    step: int = 0                    # its steps replied to in full
    taken: int = 0                   # micro-batches of step + 1 the loop has taken
    cache: dict[tuple[int, int], Message] = field(default_factory=dict)    # its replies of its last step
    waiting: dict[tuple[int, int], tuple[np.ndarray, np.ndarray | None]] = field(default_factory=dict)
    step_rows: dict[int, np.ndarray] = field(default_factory=dict)         # send_rows: of step + 1, by mb
    envelope: list[bytes] | None = None    # where it was last heard from (its replies go there)
    heard: float = 0.0               # when it was last heard (time.monotonic; 0: never)
    bye: Message | None = None       # the reply to its bye
    evaluate: tuple[int, np.ndarray] | None = None   # its held-out embeddings sent for step (step, h)
    evaluated: Message | None = None                 # its last evaluation reply (a resent one gets it again)

    def take_up(self, run: str, key: str, envelope: list[bytes], now: float, codecs: Mapping[str, Codec]) -> None:
        """Its hello is welcome: stand in ``run`` (a new one with no replies and fresh codec streams of
        ``codecs``), opened by ``key``, heard at ``now`` (``time.monotonic``) from ``envelope``."""
        if run != self.run:
            self.cache, self.senders, self.since = {}, Senders(codecs), time.time()
        self.run, self.owner, self.bye, self.joined = run, key, None, True
        self.waiting, self.evaluate = {}, None     # what it sent before this hello, it sends again
        self.heard, self.envelope = now, envelope


class DataOwners:
    """The data owners of ``side``'s interface in order (``peers``): its feature parties (vertical; their
    embeddings' ``widths``) or its clients, each a ``Peer``."""

    def __init__(self, side: CutSide) -> None:
        exp = side.exp
        self.side, self.exp, self.vertical = side, exp, exp.vertical
        self.widths: list[int] = []
        if self.vertical:
            data = side.data
            self.peers = [Peer(i, f"party {name}", name, exp.cuts[exp.stage_index(name)], data, Senders(exp.codecs))
                          for i, name in enumerate(exp.data_owners)]
            self.widths = [p.shape[-1] for p in self.peers]
        else:
            first = exp.stage_names[0]
            self.peers = [Peer(c, f"client {c}", first, side.shape, side.data_of(c), Senders(exp.codecs))
                          for c in range(exp.clients.count)]

    def runs(self) -> str:
        """The runs served, one per data owner, comma-separated (each ``Cut`` has its own)."""
        return ",".join(p.run for p in self.peers)

    def of_run(self, msg: Message) -> Peer:
        """The data owner whose run ``msg`` is (``ProtocolError``, code ``run``, for none)."""
        for peer in self.peers:
            if peer.joined and peer.run == msg.run:
                return peer
        raise unknown_run(msg, "a hello first" if not any(p.run for p in self.peers)
                          else f"one of the runs {self.runs()}")

    def of_hello(self, body: Mapping[str, Any]) -> Peer:
        """The data owner a hello is from: a party by its stage (``role``), a client by its ``client``
        (``protocol.hello_peer``, the rule of every serving end)."""
        if self.vertical:
            return self.peers[hello_peer(body, self.exp.name, parties=[p.role for p in self.peers])]
        return self.peers[hello_peer(body, self.exp.name, clients=len(self.peers))]

    def check_own(self, peer: Peer, run: str, peer_key: str) -> None:
        """``ProtocolError`` (code ``run``) when ``peer``'s hello names another data owner's ``run``, or comes
        from the key that opened another's: each ``Cut`` has its own run id and key."""
        for other in self.peers:
            if other is peer:
                continue
            if other.run == run:
                raise ProtocolError(ErrorCode.RUN, f"run {run!r} is {other.name}'s; {peer.name} needs a run of "
                                                   f"its own (each Cut has its own run id)")
            if peer_key and other.owner == peer_key:
                raise ProtocolError(ErrorCode.RUN, f"this client key said hello as {other.name}; it cannot also be "
                                                   f"{peer.name} (each data owner has its own key)")

    def take_all(self, k: int, mb: int) -> list[tuple[np.ndarray, np.ndarray | None]] | None:
        """Every party's forward of step ``k`` micro-batch ``mb``, taken for the loop (each one's activation
        and the rows it sent), once all are in; else None and nothing is taken."""
        if not all((k, mb) in p.waiting for p in self.peers):
            return None
        taken = [p.waiting.pop((k, mb)) for p in self.peers]
        for p in self.peers:
            p.taken = mb + 1
        return taken

    def give_back(self, mb: int) -> None:
        """Micro-batch ``mb`` of the step, taken by ``take_all``, was refused: every party sends it again."""
        for p in self.peers:
            p.taken = mb
            p.step_rows.pop(mb, None)

    def take_turn(self, turn: int, k: int, mb: int, mbs: int) -> tuple[np.ndarray, np.ndarray | None] | None:
        """Client ``turn``'s forward of step ``k`` micro-batch ``mb`` of ``mbs``, taken for the loop once it is
        in: its activation and rows (those it sent, else its shard's order; None without ``[data]``)."""
        peer = self.peers[turn]
        if (k, mb) not in peer.waiting:
            return None
        h, sent = peer.waiting.pop((k, mb))
        peer.taken = mb + 1
        rows = sent if sent is not None else (
            None if peer.data is None else micro_batch(np.asarray(peer.data.step_rows(k), np.int64), mb, mbs))
        return h, rows

    def common_rows(self, k: int, mb: int, mbs: int, sent: list[np.ndarray | None]) -> np.ndarray | str | None:
        """The rows of a vertical micro-batch ``mb`` of ``mbs`` of step ``k``: those every party sent
        (``send_rows``; the refusal's text when two differ), else the shared order's (None without
        ``[data]``)."""
        if not self.exp.send_rows:
            data = self.side.data
            return None if data is None else micro_batch(np.asarray(data.step_rows(k), np.int64), mb, mbs)
        rows = sent[0]
        assert rows is not None        # send_rows: every forward carries its rows
        for peer, other in zip(self.peers[1:], sent[1:]):
            assert other is not None
            if not np.array_equal(other, rows):
                at = int(np.argmax(other != rows))
                return (f"the feature parties sent different rows for step {k} micro-batch {mb}: "
                        f"{self.peers[0].name} row {int(rows[at])}, {peer.name} row {int(other[at])} at position "
                        f"{at}; every party must send the same rows (nothing was applied)")
        return rows

    def held_out(self, step: int) -> list[np.ndarray] | None:
        """Every party's held-out embeddings for ``step``, once each has sent its own for that step; else
        None."""
        sent = [p.evaluate for p in self.peers]
        if not all(sent) or {e[0] for e in sent if e is not None} != {step}:
            return None
        return [e[1] for e in sent if e is not None]

    def all_said_bye(self) -> bool:
        return all(p.bye is not None for p in self.peers)

    def state(self) -> list[dict[str, Any]]:
        """Each data owner's part of a checkpoint: its run, step, whether it said bye, its codec residuals and
        the replies of its last step."""
        return [{"run": p.run, "step": p.step, "finished": p.bye is not None, "residuals": p.senders.state_arrays(),
                 "replies": [reply_state(m) for m in p.cache.values()]}
                for p in self.peers]

    def load(self, loaded: Sequence[tuple[str, int, Replies]], entries: Sequence[Any]) -> None:
        """Stand where a checkpoint's ``entries`` say, checked (``cut_state.saved_peer``) as ``loaded``."""
        for peer, (run, peer_step, cache), entry in zip(self.peers, loaded, entries):
            peer.run, peer.step, peer.cache = run, peer_step, cache
            if entry["finished"]:    # a bye it sends again is answered
                peer.bye = Message(wire.BYE, run, peer_step + 1, body={"steps": peer_step})
        for peer, entry in zip(self.peers, entries):
            peer.senders.load_state_arrays(entry["residuals"])
