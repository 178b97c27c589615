"""A dishonest party of ``distgrad align``, for tests/test_align.py.

Run it as its own process in place of ``distgrad align`` for a party that
connects::

    python tests/align_dishonest.py VARIANT INPUT --id-column ID --out OUT --connect ENDPOINT ...

It speaks the protocol exactly as an honest party does (the arguments are
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
"""

from __future__ import annotations

import sys
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

if __name__ == "__main__":
    VARIANTS[sys.argv[1]]()
    sys.exit(cli.main(["align", *sys.argv[2:]]))
