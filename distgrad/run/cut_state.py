"""What a label-owner end of the cut saves and resumes from: its replies, as plain values and numpy arrays.

A ``CutServer``'s ``state_dict`` holds its run, step, micro-batches, the
replies of its last steps and its codec residuals (``SERVER_STATE_KEYS``); a
``GroupServer``'s holds the step, whose turn it is, the micro-batches and one
entry per data owner (``GROUP_STATE_KEYS``, each ``PEER_STATE_KEYS``). Each
reply is saved by ``reply_state`` and read back by ``saved_reply``, checked as
the data owner will check it when it is sent again. The checks here raise
``ConfigError`` naming what is wrong and change nothing: the server applies
what they return.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np

from distgrad.config.experiment import Experiment, is_whole
from distgrad.errors import ConfigError, ProtocolError
from distgrad.run.cut_interface import STATE_KEYS, STATE_VERSION, CutSide, check_residuals, check_run, check_step
from distgrad.stage.stage import micro_shape
from distgrad.wire import messages as wire
from distgrad.wire.messages import Message
from distgrad.wire.wirecodec import GRADIENT, Expected, WireTensor

SERVER_STATE_KEYS = (*STATE_KEYS, "micro_batches", "replies")    # what a CutServer's state_dict holds
REPLY_KEYS = {"step", "mb", "mbs", "loss", "compute_s", "tensors"}   # each of its replies
GROUP_STATE_KEYS = ("version", "interface", "step", "turn", "micro_batches", "peers")   # a GroupServer's state
PEER_STATE_KEYS = {"run", "step", "finished", "replies", "residuals"}                  # each peer's in it

Replies = dict[tuple[int, int], Message]      # replies by (step, micro-batch)


def reply_state(m: Message) -> dict[str, Any]:
    """A cached reply as a saved state holds it (plain values and numpy arrays; ``saved_reply`` reads it)."""
    return {"step": m.step, "mb": m.mb, "mbs": m.mbs, "loss": m.body["loss"], "compute_s": m.body["compute_s"],
            "tensors": {n: np.array(t) for n, t in m.tensors.items()}}


def saved_reply(r: Any, run: str, step: int, mbs: int, shape: tuple[int, ...], exp: Any) -> Message:
    """One reply of a saved state's ``replies`` (of run ``run``, steps 1..``step``, micro-batches of ``mbs``,
    a gradient of ``shape`` under ``exp``'s interface) as the message it was, checked as the data owner will
    check it when it is sent again (``ConfigError`` naming what is wrong)."""
    if not isinstance(r, Mapping) or set(r) != REPLY_KEYS:
        raise ConfigError(f"a reply of the state must hold exactly {sorted(REPLY_KEYS)}, got {wire.show(r)}")
    numbers = [r["loss"], r["compute_s"]]
    if not (is_whole(r["step"]) and 1 <= r["step"] <= step and r["mbs"] == mbs and is_whole(r["mb"])
            and 0 <= r["mb"] < mbs and isinstance(r["tensors"], Mapping)
            and all(isinstance(v, (int, float, np.floating)) and not isinstance(v, bool) for v in numbers)):
        raise ConfigError(f"a reply of the state is not one of its steps 1..{step} (micro-batch of {mbs}) "
                          f"with a number loss and tensors: step {wire.show(r['step'])} mb "
                          f"{wire.show(r['mb'])}/{wire.show(r['mbs'])}")
    where = f"the state's reply to step {r['step']} micro-batch {r['mb']}"
    if not exp.allow_nonfinite and not np.isfinite(r["loss"]):
        raise ConfigError(f"{where} has loss {r['loss']!r}; this interface forbids NaN and Inf "
                          f"(allow_nonfinite), so it is not a reply this side saved")
    if not (np.isfinite(r["compute_s"]) and r["compute_s"] >= 0):
        raise ConfigError(f"{where} has compute_s {r['compute_s']!r}, not a number of seconds >= 0")
    reply = Message(wire.BACKWARD, run, r["step"], r["mb"], mbs,
                    body={"loss": float(r["loss"]), "compute_s": float(r["compute_s"])},
                    tensors={n: np.asarray(t) for n, t in r["tensors"].items()})
    grad = Expected(WireTensor(GRADIENT, shape, exp.codecs[GRADIENT]))
    try:       # decodes a copy, checked as the data owner checks the reply when it is sent again
        grad.receive(replace(reply, tensors=dict(reply.tensors)), allow_nonfinite=exp.allow_nonfinite)
    except (ProtocolError, ValueError, TypeError) as e:
        raise ConfigError(f"{where} is not a gradient of this interface: {e}") from e
    return reply


def saved_replies(replies: Sequence[Any], run: str, step: int, mbs: int, shape: tuple[int, ...],
                  exp: Any) -> Replies:
    """A state's ``replies`` (``saved_reply`` each, a gradient of ``shape`` for a whole batch) by step and
    micro-batch."""
    cache = {}
    for r in replies:
        reply = saved_reply(r, run, step, mbs, micro_shape(shape, mbs), exp)
        cache[(reply.step, reply.mb)] = reply
    return cache


def check_micro_batches(mbs: Any, exp: Experiment) -> int:
    """A state's ``micro_batches``: a count that divides ``exp``'s batch (``ConfigError`` otherwise)."""
    if not is_whole(mbs) or mbs < 1 or exp.batch % mbs:
        raise ConfigError(f"the state's micro_batches {wire.show(mbs)} is not a count that divides the "
                          f"batch ({exp.batch})")
    return int(mbs)


def check_group_state(state: Any, exp: Experiment, owners: int) -> tuple[int, int, int, Sequence[Any]]:
    """A ``GroupServer``'s ``state_dict`` for ``owners`` data owners, checked but for each owner's entry:
    its step, micro-batches, turn and the entries (``ConfigError`` naming what is wrong)."""
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        raise ConfigError(f"not a cut state of version {STATE_VERSION}: {wire.show(state)}")
    if set(state) != set(GROUP_STATE_KEYS):
        raise ConfigError(f"not the state_dict of a CutServer of several data owners: it holds "
                          f"{sorted(map(str, state))}, that one exactly {list(GROUP_STATE_KEYS)} (a Cut's and a "
                          f"CutServer's of one data owner differ)")
    if state["interface"] != exp.interface_fingerprint:
        raise ConfigError("this state is of another interface (its fingerprint differs): resume with the "
                          "interface it was saved under")
    step, turn = check_step(state["step"], exp.steps), state["turn"]
    mbs = check_micro_batches(state["micro_batches"], exp)
    entries = state["peers"]
    if not isinstance(entries, (list, tuple)) or len(entries) != owners:
        raise ConfigError(f"the state's peers must be a list of {owners} (one per data owner), got "
                          f"{wire.show(entries)}")
    if not is_whole(turn) or not 0 <= turn < owners or (exp.vertical and turn):
        raise ConfigError(f"the state's turn {wire.show(turn)} is not a data owner's index here")
    return step, mbs, turn, entries


def saved_peer(entry: Any, name: str, index: int, shape: tuple[int, ...], side: CutSide, step: int, turn: int,
               mbs: int) -> tuple[str, int, Replies]:
    """One data owner's entry of a ``GroupServer``'s state (``name``, at ``index``, its activation ``shape``
    for a whole batch), at the state's ``step``, ``turn`` and ``mbs``, checked: its run, step and replies."""
    exp, where = side.exp, f"the state's entry of {name}"
    if not isinstance(entry, Mapping) or set(entry) != PEER_STATE_KEYS:
        raise ConfigError(f"{where} must hold exactly {sorted(PEER_STATE_KEYS)}, got {wire.show(entry)}")
    run, peer_step, replies, residuals = entry["run"], entry["step"], entry["replies"], entry["residuals"]
    finished = entry["finished"]
    # Vertical: every party stands at the step; clients: those before the turn have done this round too
    # (one that said bye may have left earlier).
    expected = step if exp.vertical or index >= turn else step + 1
    if not isinstance(finished, bool) or (exp.vertical and finished and step < exp.steps):
        raise ConfigError(f"{where} has finished={wire.show(finished)}; expected a bool (a feature party "
                          f"finishes at the last step)")
    if not is_whole(peer_step) or not (peer_step == expected or finished and 0 <= peer_step <= expected):
        raise ConfigError(f"{where} has step {wire.show(peer_step)}; at step {step} (turn {turn}) it stands at "
                          f"{expected}")
    if run == "":
        if peer_step or replies:
            raise ConfigError(f"{where} has no run but steps or replies")
    else:
        check_run(run)
    if not isinstance(replies, (list, tuple)):
        raise ConfigError(f"{where}: its replies must be a list, got {type(replies).__name__}")
    if not isinstance(residuals, Mapping) or not all(isinstance(a, np.ndarray) and a.dtype == np.float32
                                                      for a in residuals.values()):
        raise ConfigError(f"{where}: its residuals must map names to float32 arrays, got {wire.show(residuals)}")
    check_residuals(residuals, side, GRADIENT, mbs, shape)
    return run, peer_step, saved_replies(replies, run, peer_step, mbs, shape, exp)
