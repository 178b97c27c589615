"""Valid handshake messages, for the tests and benchmarks/per_message.py (no pytest here).

One place knows what a driving stage's hello carries, so a field the
handshake comes to need (``parts``, protocol 2) is added once.
"""

from __future__ import annotations

from typing import Any

from distgrad import wire
from distgrad.experiment import Experiment, fingerprint_parts
from distgrad.stage import Stage


def hello_message(exp: Experiment, run: str, **changes: Any) -> wire.Message:
    """A valid hello from a fresh driving stage of ``exp``; ``changes`` replace body fields."""
    first = Stage.from_experiment(exp, exp.stage_names[0])
    body = {"role": first.name, "experiment": exp.name, "fingerprint": exp.fingerprint,
            "parts": fingerprint_parts(exp), "seed": exp.seed,
            "activation": {"shape": list(first.output_shape), "dtype": "float32"},
            "labels_travel": exp.labels_travel, "steps": exp.steps, "step": 0, "held": [0]}
    body.update(changes)
    return wire.Message(wire.HELLO, run, 0, body=body)
