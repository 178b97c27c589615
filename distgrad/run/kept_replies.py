"""The replies of a round that a serving stage of several clients keeps in the round's checkpoint.

A client takes a step (or an average) as done when its reply arrives. If
the serving stage is killed after its checkpoint of round R and before a
reply of round R reached its client, that client sends the request again to
the restarted stage, which has not heard from it yet: it answers from these,
the very reply (``topology.Clients.resent_reply``), and the client's step R
is complete, as in the run that was not interrupted.

Arrays (under the checkpoint's ``extra/``; ``P`` a client, ``MB`` a
micro-batch, ``I`` a tensor's position in its message):

- ``reply/P/MB/ids``: int64 ``[mbs]``; ``reply/P/MB/body``: float64
  ``[loss, compute_s]``, or ``[compute_s]`` for a reply whose loss is withheld (``Senders.reply_body``);
  ``reply/P/MB/I/NAME``: the backward's tensors as sent;
- ``average/peers``: int64, the clients the average of round R was sent to;
  ``average/I/NAME``: the mean, once for all of them.
"""

from __future__ import annotations

import numpy as np

from distgrad.run.peers import Peer
from distgrad.wire import messages as wire
from distgrad.wire.messages import Message

REPLY = "reply/"
AVERAGE = "average/"


def kept_arrays(peers: list[Peer], step: int) -> dict[str, np.ndarray]:
    """The arrays of every reply of round ``step`` in ``peers``' reply caches (backward replies, averages)."""
    arrays: dict[str, np.ndarray] = {}
    for peer in peers:
        for (at, mb), reply in peer.cached.items():
            if at == step and reply.type == wire.BACKWARD:
                prefix = f"{REPLY}{peer.index}/{mb}/"
                arrays[prefix + "ids"] = np.array([reply.mbs], np.int64)
                arrays[prefix + "body"] = np.array([*([reply.body["loss"]] if "loss" in reply.body else []),
                                                    reply.body.get("compute_s", 0.0)], np.float64)
                arrays.update(_tensors(prefix, reply.tensors))
    averaged = [peer for peer in peers if peer.averaged is not None and peer.averaged.step == step]
    if averaged:
        arrays[AVERAGE + "peers"] = np.array([peer.index for peer in averaged], np.int64)
        mean = averaged[0].averaged
        assert mean is not None                  # the peers kept are those with an average of this step
        arrays.update(_tensors(AVERAGE, mean.tensors))
    return arrays


Kept = dict[int, tuple[dict[tuple[int, int], Message], Message | None]]


def kept(runs: dict[int, str], arrays: dict[str, np.ndarray], step: int) -> Kept:
    """The replies of round ``step`` that ``arrays`` (``kept_arrays``) hold, by client (``runs``: each
    client's run, as restored): its replies by (step, micro-batch) and its average's reply (None: none),
    for the clients that got any, in client order."""
    cached: dict[int, dict[tuple[int, int], Message]] = {}
    averaged: dict[int, Message] = {}
    for name in arrays:
        if name.startswith(REPLY) and name.endswith("/ids"):
            index, mb = (int(part) for part in name[len(REPLY):].split("/")[:2])
            prefix = f"{REPLY}{index}/{mb}/"
            *loss, compute_s = (float(value) for value in arrays[prefix + "body"])
            cached.setdefault(index, {})[(step, mb)] = Message(
                wire.BACKWARD, runs.get(index, ""), step, mb, int(arrays[name][0]),
                body={**({"loss": loss[0]} if loss else {wire.LOSS_WITHHELD_KEY: True}), "compute_s": compute_s},
                tensors=_untensors(prefix, arrays))
    if AVERAGE + "peers" in arrays:
        mean = _untensors(AVERAGE, arrays)
        for index in arrays[AVERAGE + "peers"].tolist():
            averaged[index] = Message(wire.AVERAGE, runs.get(index, ""), step, tensors=mean)
    return {index: (cached.get(index, {}), averaged.get(index)) for index in sorted({*cached, *averaged})}


def restore(peers: list[Peer], arrays: dict[str, np.ndarray], step: int) -> list[Peer]:
    """Put the replies of round ``step`` that ``arrays`` hold (``kept``) back in ``peers``' caches (each
    peer's ``run`` already restored); return the peers that got any."""
    found = kept({peer.index: peer.run for peer in peers}, arrays, step)
    for index, (replies, average) in found.items():
        peers[index].cached.update(replies)
        if average is not None:
            peers[index].averaged = average
    return [peers[index] for index in found]


def _tensors(prefix: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``tensors`` as arrays ``PREFIX I/NAME``, which keeps their order."""
    return {f"{prefix}{i}/{name}": np.asarray(value) for i, (name, value) in enumerate(tensors.items())}


def _untensors(prefix: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The tensors ``_tensors`` wrote under ``prefix``, in their order."""
    found = []
    for name, value in arrays.items():
        rest = name[len(prefix):] if name.startswith(prefix) else ""
        position, _, tensor = rest.partition("/")
        if position.isdigit() and tensor:
            found.append((int(position), tensor, value))
    return {tensor: value for _, tensor, value in sorted(found, key=lambda item: item[0])}
