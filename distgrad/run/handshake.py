"""The handshake: the hello a stage sends the stage below it, and the checks that stage makes.

A hello names the run, the interface the stages agree on (its fingerprint
and its fields, ``Experiment.interface_parts``, so a mismatch can name the
field that differs and both values), the seed, the activation shape,
where the labels live, the micro-batch count and the steps the sender can
return to (``held``). The stage below answers with the newest step both hold
(``common_step``). See docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

from distgrad.wire import messages as wire
from distgrad.errors import ProtocolError
from distgrad.config.experiment import (DATA_PARTS, MAX_PARTS, ORIGIN_MAX, PART_VALUE_MAX, Experiment,
                                        idle_row_defense, interface_differences, interface_digest)
from distgrad.wire.messages import ErrorCode, Message


def hello(exp: Experiment, role: str, seed: int, output_shape: tuple[int, ...], run_id: str, held: list[int],
          steps: int, micro_batches: int, client: int | None = None, eval_every: int = 0,
          relayed: dict[str, Any] | None = None, staleness: int = 0) -> Message:
    """The hello stage ``role`` sends for ``run_id``; ``held`` are the steps it (and every stage above it)
    can return to; ``client`` is which data owner it is, for a stage serving several; ``eval_every`` K > 0:
    it evaluates the held-out rows after every K-th step (a stage serving several waits for it then).
    ``relayed``: the ``parts`` of the hello a middle stage accepted from above; the data fields it cannot
    tell itself (``DATA_PARTS``, it holds no data) pass on from them, so the data owner's sample order
    still meets the label owner's. ``staleness`` S > 0: the first stage keeps S steps in flight, so the
    stages below keep their replies of the last S + 1 steps (a resent forward gets its reply again)."""
    parts = exp.interface_parts()
    for key in DATA_PARTS:
        if key not in parts and relayed is not None and key in relayed:
            parts[key] = relayed[key]
    return Message(wire.HELLO, run_id, 0, body={
        "role": role, "experiment": exp.name, "fingerprint": interface_digest(parts), "parts": parts,
        "origins": exp.interface_origins(),
        "seed": seed, "activation": {"shape": list(output_shape), "dtype": "float32"},
        "labels_travel": exp.labels_travel, "steps": steps, "step": max(held), "held": held,
        "micro_batches": micro_batches, **({"client": client} if client is not None else {}),
        **({"eval_every": eval_every} if eval_every else {}),
        **({"staleness": staleness} if staleness else {})})


def check_hello(body: dict[str, Any], upstream: str, exp: Experiment, seed: int,
                input_shape: tuple[int, ...], here: str = "this stage") -> int:
    """Check that a hello comes from stage ``upstream`` of the same interface, seed and shapes;
    return the micro-batch count it asks for. Raises ``ProtocolError``: ``MISMATCH`` (for a
    fingerprint, naming the interface fields that differ with both values and where each side's
    came from, its ``origins``; ``here`` is this stage's name), or ``MALFORMED`` for ``parts`` or
    ``origins`` that are not a valid map, or ``parts`` that the hello's fingerprint is not the digest of."""
    expected = {
        "role": upstream,
        "experiment": exp.name,
        "fingerprint": exp.interface_fingerprint,
        "seed": seed,
        "activation": {"shape": list(input_shape), "dtype": "float32"},
        "labels_travel": exp.labels_travel,
    }
    for key, value in expected.items():
        if key == "fingerprint" and isinstance(body.get(key), str) and body[key] != value:
            if interface_differences(exp.interface_parts(), check_parts(body.get("parts"))) or \
                    body[key] != interface_digest(body["parts"]):
                raise ProtocolError(ErrorCode.MISMATCH, _parts_differ(
                    body.get("parts"), exp.interface_parts(), upstream, here,
                    (check_origins(body.get("origins", {})), exp.interface_origins())))
            continue                    # the same interface; one side cannot tell its rows (no data)
        if not same_exactly(body.get(key), value):
            raise ProtocolError(ErrorCode.MISMATCH, f"hello has {key}={wire.show(body.get(key))}, "
                                                    f"this stage expects {value!r}")
    parts = check_parts(body.get("parts"))
    if body.get("fingerprint") == expected["fingerprint"] and interface_digest(parts) != expected["fingerprint"]:
        # The fingerprint is the SHA-256 of the parts: parts it is not the digest of say another interface than
        # the fingerprint does, so the hello is refused rather than read by its fingerprint alone.
        names = interface_differences(exp.interface_parts(), parts) or ["(the values' types)"]
        raise ProtocolError(ErrorCode.MALFORMED, f"hello has parts that its fingerprint is not the digest of (they "
                                                 f"differ from the interface it names in: "
                                                 f"{wire.show(names[:PARTS_SHOWN])}); a sender sends the parts it "
                                                 f"took the fingerprint of")
    check_origins(body.get("origins", {}))
    mbs = body.get("micro_batches", 1)
    if not isinstance(mbs, int) or isinstance(mbs, bool) or mbs < 1 or (mbs > 1 and (
            len(input_shape) < 2 or input_shape[0] % mbs)):
        raise ProtocolError(ErrorCode.MISMATCH, f"hello asks for {wire.show(mbs)} micro-batches; batches of "
                                                f"shape {input_shape} do not split into that many equal parts")
    rows = input_shape[0] // mbs if len(input_shape) >= 2 else 1      # data without batches: one row a step
    idle = idle_row_defense(exp, here, rows)
    if idle is not None:        # the label owner's own setting, which the data owner's choice would make idle
        raise ProtocolError(ErrorCode.MISMATCH, f"hello asks for {mbs} micro-batches of {rows} row"
                                                f"{'s' if rows > 1 else ''}; stage {here}: {idle}")
    return mbs


PART_NAME_MAX = 200             # characters in the name of one interface field
PARTS_SHOWN = 8                 # differing parts named in one refusal; the rest are counted


def check_parts(parts: Any) -> dict[str, Any]:
    """``parts`` if it is a hello's valid ``parts`` map (see ``Experiment.interface_parts``), else raise
    ``ProtocolError`` (``MALFORMED``)."""
    if type(parts) is not dict or len(parts) > MAX_PARTS:
        raise ProtocolError(ErrorCode.MALFORMED, f"hello has parts={wire.show(parts)}; expected a map of at "
                                                 f"most {MAX_PARTS} interface fields")
    for name, value in parts.items():
        if (type(name) is not str or len(name) > PART_NAME_MAX or type(value) not in (bool, int, float, str)
                or (type(value) is str and len(value) > PART_VALUE_MAX)):
            raise ProtocolError(ErrorCode.MALFORMED, f"hello has parts entry {wire.show(name)}: "
                                                     f"{wire.show(value)}; expected a name of at most "
                                                     f"{PART_NAME_MAX} characters and a number, boolean or "
                                                     f"string of at most {PART_VALUE_MAX} characters")
    return parts


def check_origins(origins: Any) -> dict[str, str]:
    """``origins`` if it is a hello's valid ``origins`` map (``Experiment.interface_origins``: field name or
    ``"*"`` to where its value came from), else raise ``ProtocolError`` (``MALFORMED``)."""
    if type(origins) is not dict or len(origins) > MAX_PARTS + 1 or not all(
            type(name) is str and len(name) <= PART_NAME_MAX and type(origin) is str and len(origin) <= ORIGIN_MAX
            and origin.isprintable() for name, origin in origins.items()):
        raise ProtocolError(ErrorCode.MALFORMED, f"hello has origins={wire.show(origins)}; expected a map of at "
                                                 f"most {MAX_PARTS + 1} field names to printable strings of at "
                                                 f"most {ORIGIN_MAX} characters")
    return origins


def _parts_differ(theirs: Any, ours: dict[str, Any], they: str, we: str,
                  origins: tuple[dict[str, str], dict[str, str]]) -> str:
    """The refusal of a hello whose interface differs: each differing field with both values, a value a
    command-line flag set with the flag (``activation_codec: f has 'int8' (set by f's --activation-codec), g
    has nothing``), then where each side's other values come from (``origins``: theirs, ours)."""
    check_parts(theirs)
    (their_origins, our_origins), lines = origins, []

    def show(value: Any, side: str, side_origins: dict[str, str], name: str) -> str:
        flag = f" (set by {side}'s {side_origins[name]})" if name in side_origins else ""
        return ("nothing" if value is _ABSENT else wire.show(value)) + flag

    for name in interface_differences(ours, theirs) or ["fingerprint"]:
        lines.append(f"{name}: {they} has {show(theirs.get(name, _ABSENT), they, their_origins, name)}, "
                     f"{we} has {show(ours.get(name, _ABSENT), we, our_origins, name)}")
    shown = "; ".join(lines[:PARTS_SHOWN]) + (f"; and {len(lines) - PARTS_SHOWN} more" if len(lines) > PARTS_SHOWN
                                              else "")
    files = " and ".join(f"{side}'s {side_origins['*']}" for side, side_origins in
                         ((they, their_origins), (we, our_origins)) if "*" in side_origins)
    where = f": a value no flag set comes from {files}" if files else ""
    return (f"the interface of stage {they} differs from stage {we}'s: {shown or 'in nothing it names'} "
            f"(the parties must agree on the interface{where})")


_ABSENT = object()


def same_exactly(a: Any, b: Any) -> bool:
    """Equal in value and in type at every level (so ``False`` is not ``0`` and ``1.0`` is not ``1``)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_exactly(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_exactly(x, y) for x, y in zip(a, b))
    return a == b


def common_step(ours: list[int], theirs: Any) -> int:
    """The newest step both sides hold; raises ``ProtocolError`` for a malformed list."""
    if not isinstance(theirs, list) or not all(isinstance(s, int) and not isinstance(s, bool) for s in theirs):
        raise ProtocolError(ErrorCode.MALFORMED, f"hello 'held' must be a list of steps, got {wire.show(theirs)}")
    both = set(ours) & set(theirs)
    return max(both) if both else 0


