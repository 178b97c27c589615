"""The cut as a library, on numpy arrays: ``Cut`` (the data owner's end) and ``CutServer`` (the label owner's).

Each party keeps its own model, optimiser, data and loop; one call crosses
the cut, speaking the daemons' protocol, so either end may face a
``distgrad-stage`` daemon. ``distgrad.torch`` is the same for PyTorch tensors.
docs/cut.md is the contract (steps, checkpoints and resume, micro-batches,
errors) with a runnable example.

    cut = Cut.connect("tcp://label-owner:5555", interface="f.toml")
    loss, dh = cut.step(h)                 # h: float32 (batch, ...), dh: d(loss)/dh

    with CutServer.bind("tcp://0.0.0.0:5555", interface="g.toml") as server:
        for batch in server:               # batch.h, batch.rows, batch.step
            batch.reply(loss, dh)          # dh: d(loss)/d(batch.h)

An interface with ``aggregate`` (vertical feature parties: ``Cut.connect(..., party=i)``, ``batch.h`` their
embeddings combined, ``batch.parts`` each one's) or ``[clients]`` (several data owners in turn:
``Cut.connect(..., client=c)``, ``batch.client``) is served by a ``GroupServer``, which ``CutServer.bind``
builds for it.
"""

from __future__ import annotations

from distgrad.run.cut_client import Cut
from distgrad.run.cut_group import GroupServer
from distgrad.run.cut_server import Batch, CutServer

__all__ = ["Batch", "Cut", "CutServer", "GroupServer"]
