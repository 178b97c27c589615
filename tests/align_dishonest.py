"""A dishonest party or coordinator of ``distgrad align``, for tests/test_align.py.

Run it as its own process in place of ``distgrad align``. A party that
connects::

    python tests/align_dishonest.py VARIANT INPUT --id-column ID --out OUT --connect ENDPOINT ...

speaks the protocol exactly as an honest party does (the arguments are
``distgrad align``'s), except for one answer, chosen by ``VARIANT``:

* ``reorder``: the list it encrypts in round 1 goes back encrypted honestly
  but reversed. Started as the party of index 2 of 3 (the second to join),
  that list is party 1's, so party 1 would map the coordinator's positions
  to other rows than the common IDs.
* ``unshuffle``: its answer to the coordinator's "undo your shuffle" holds
  other valid-looking positions (each one step further, modulo the list's
  length: distinct and in range), so the coordinator would map them to
  other rows than its common IDs.

Either way the honest parties must exit non-zero and write no file.

A coordinator::

    python tests/align_dishonest.py VARIANT RECORD.json INPUT --id-column ID --out OUT --bind ENDPOINT ...

runs the rounds of encryption honestly, then attacks party 1 (the first to
join, "the victim") as ``VARIANT`` says, treating any other party honestly
where it can. It writes every message the parties sent it (but heartbeats),
the run id and what it did to ``RECORD.json`` when it ends:

* ``echo``: names all of the victim's rows as common (most of them are not;
  it asks every party to undo its shuffle of as many positions, so the counts
  agree), offers the only commitment it can make, its digest of its own
  common IDs, and sends back as the coordinator's and every other party's
  digest whatever digest the victim answers with (the attack that worked
  when a party sent its digest first).
* ``reflect``: honest positions and commitments, then relays to the victim
  its own digest (and, with party keys, its own tag for party 2) as party
  2's.
* ``relay``: lets party 2 answer first, then sends the victim party 2's
  digest as its own commitment.
* ``forge``: never lets party 2 answer; relays to the victim a digest of the
  victim's rows that it computed as party 2's, tagged with the coordinator's
  own secret key for the victim and party 2's public key.
* ``guess``: asks the victim for 99 common rows and one that is not common,
  committing to the 99 IDs it holds plus a guess of the hundredth.
* ``one_row``: asks every party to undo its shuffle of one common position
  and to write that one row, with a correct commitment.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from distgrad import align as al
from distgrad import cli
from distgrad.wire import messages as wire


def _reorder() -> None:
    honest = al._values_message

    def values_message(run: str, step: int, values: Any, **body: Any) -> wire.Message:
        return honest(run, step, values[::-1] if step == 1 else values, **body)

    al._values_message = values_message


def _unshuffle() -> None:
    honest_positions, honest_shuffle = al._positions_message, al.shuffle_order
    length = [0]                    # the length of the list it shuffled last: the coordinator's

    def shuffle_order(count: int) -> np.ndarray:
        length[0] = count
        return honest_shuffle(count)

    def positions_message(run: str, step: int, positions: np.ndarray, **body: Any) -> wire.Message:
        if "final" not in body:     # this party's answer to "undo your shuffle"
            positions = (np.asarray(positions) + 1) % length[0]
        return honest_positions(run, step, positions, **body)

    al.shuffle_order, al._positions_message = shuffle_order, positions_message


VARIANTS = {"reorder": _reorder, "unshuffle": _unshuffle}

# ---------------------------------------------------------------- the dishonest coordinator

COORDINATOR_VARIANTS = ("echo", "reflect", "relay", "forge", "guess", "one_row")
GUESS = "a guess the victim does not hold"
RECORD: dict[str, Any] = {"run": "", "messages": [], "did": []}


def _record_messages() -> None:
    honest = al._Coordinator.handle

    def handle(self: al._Coordinator, party: al._Party, msg: wire.Message) -> None:
        if msg.type != wire.PING:
            RECORD["run"] = self.run
            RECORD["messages"].append({"party": party.index, "type": msg.type, "step": msg.step, "body": msg.body,
                                       "positions": msg.tensors["positions"].tolist()
                                       if "positions" in msg.tensors else None})
        honest(self, party, msg)

    al._Coordinator.handle = handle


def _own_secret(argv: list[str]) -> bytes | None:
    """The coordinator's raw CURVE secret key, if it was started with one (all a forger holds)."""
    from distgrad.wire.keys import load_secret

    if "--curve-secret" not in argv:
        return None
    return al._raw_key(load_secret(Path(argv[argv.index("--curve-secret") + 1]))[1], "secret")


def _final(coord: al._Coordinator, party: al._Party, positions: Any, ids: list[str]) -> None:
    """Send ``party`` its final positions with the coordinator's commitment to ``ids`` (any order)."""
    n = coord.parties_wanted
    commitment = al.aligned_digest(coord.run, 0, sorted(ids))
    RECORD["did"].append({"to": party.index, "positions": len(positions), "commitment": commitment})
    coord.order(party, al._positions_message(coord.run, n, np.asarray(positions, dtype=np.int64), final=True,
                                             digest=commitment), wire.ALIGN_DIGEST)


def _relay(coord: al._Coordinator, party: al._Party, others: list[dict[str, Any]]) -> None:
    RECORD["did"].append({"to": party.index, "others": others})
    coord.order(party, wire.Message(wire.ALIGN_DIGEST, coord.run, coord.parties_wanted + 1,
                                    body={"others": others}), wire.BYE)


def _unshuffle(coord: al._Coordinator, ring: list, positions: np.ndarray, count: int, rows: int) -> np.ndarray:
    """The honest chain of "undo your shuffle" requests, for ``count`` positions of the coordinator's
    shuffled list: the common ones first, then (if ``count`` is larger) others, so that every party's final
    count can match the count it was asked to map back."""
    chain = list(positions[:count])
    chain += sorted(set(range(rows)) - set(chain))[:count - len(chain)]
    return al._unshuffle(coord, ring, np.array(chain, dtype=np.int64), rows)


def _dishonest_coordinate(variant: str, own_secret: bytes | None):
    def coordinate(coord: al._Coordinator, table: al.Table, out: Path, min_common: int) -> al.AlignResult:
        n = coord.parties_wanted
        ring, own_order, lists = al._exchange(coord, table)
        positions = al.common_positions(lists)
        victim, others = ring[0], ring[1:]
        mine = positions[victim.index]
        count = {"one_row": 1, "echo": victim.rows}.get(variant, len(positions[0]))
        mapped = _unshuffle(coord, ring, positions[0], count, len(table.rows))
        common = [table.ids[own_order[i]] for i in mapped[:len(positions[0])]]   # as positions[p]: same order
        if variant == "one_row":
            for party in ring:
                _final(coord, party, positions[party.index][:1], common[:1])
        elif variant == "echo":          # every row of the victim, most of them not common
            _final(coord, victim, np.arange(victim.rows), common)
        elif variant == "guess":         # 99 common rows and one it does not know, a guess in its place
            unknown = min(set(range(victim.rows)) - set(mine.tolist()))
            _final(coord, victim, [*mine[:-1], unknown], [*common[:-1], GUESS])
        elif variant == "relay":         # party 2's digest, once it has it, as its own commitment to the victim
            _final(coord, others[0], positions[others[0].index], common)
            coord.wait_all()
            relayed = al._answer_of(others[0].reply, "party 2")["digest"]
            RECORD["did"].append({"to": victim.index, "commitment": relayed})
            coord.order(victim, al._positions_message(coord.run, n, mine, final=True, digest=relayed),
                        wire.ALIGN_DIGEST)
        else:                            # reflect, forge: honest positions and commitments
            for party in ring if variant == "reflect" else [victim]:
                _final(coord, party, positions[party.index], common)
        coord.wait_all()
        if variant in ("one_row", "echo", "guess", "relay"):
            if victim.reply.type == wire.ALIGN_DIGEST:       # the echo: its own digest as everyone's
                digest = al._answer_of(victim.reply, "victim")["digest"]
                RECORD["did"].append({"to": victim.index, "echo": digest})
                coord.order(victim, wire.Message(wire.ALIGN_DIGEST, coord.run, n + 1, body={
                    "digest": digest, "others": [{"index": j, "digest": digest} for j in range(2, n)]}), wire.BYE)
                coord.wait_all()
            return al.AlignResult(len(common), len(table.rows), n, out)
        answer = al._answer_of(victim.reply, "victim")
        if variant == "reflect":         # the victim's own digest (and its own tag for party 2) as party 2's
            for party in others:
                _relay(coord, party, [al._relayed(answer, victim.index, al._answer_of(party.reply, "2").get("key"))])
            reflected = {"index": 2, "digest": answer["digest"]}
            if "key" in answer:
                peer, tag = next(iter(answer["tags"].items()))
                reflected.update(key=peer, tag=tag)
            _relay(coord, victim, [reflected])
        else:                            # forge: party 2's digest computed here, tagged with its own secret
            forged = {"index": 2, "digest": al.aligned_digest(coord.run, 2, sorted(common))}
            if "key" in answer and own_secret is not None:
                peer = next(iter(answer["tags"]))            # party 2's public key, as the victim names it
                victim_key = al._raw_key(answer["key"].encode(), "victim")
                forged.update(key=peer, tag=al.digest_tag(own_secret, victim_key, al._raw_key(peer.encode(), "p2"),
                                                          victim_key, forged["digest"]))
            _relay(coord, victim, [forged])
        coord.wait_all()
        coord.abort(RuntimeError("the dishonest coordinator is done"))      # party 2 was never asked
        return al.AlignResult(len(common), len(table.rows), n, out)

    return coordinate


def _run_coordinator(variant: str, record: Path, argv: list[str]) -> int:
    _record_messages()
    al._coordinate = _dishonest_coordinate(variant, _own_secret(argv))
    try:
        return cli.main(["align", *argv])
    finally:
        record.write_text(json.dumps(RECORD, default=repr))


if __name__ == "__main__":
    if sys.argv[1] in COORDINATOR_VARIANTS:
        sys.exit(_run_coordinator(sys.argv[1], Path(sys.argv[2]), sys.argv[3:]))
    VARIANTS[sys.argv[1]]()
    sys.exit(cli.main(["align", *sys.argv[2:]]))
