"""``--staleness auto``: the driving stage chooses its staleness S from its first step over the link.

The rule (``choose_staleness``): S is the smallest whole number with

    (S + 1) * step time at the bound >= round trip + transfer time

capped at ``MAX_STALENESS``, where, measured around step 1 (``LinkProbe``):

- *round trip + transfer time* is how long the driving stage waited for step
  1's replies: the link's delay both ways, the time the step's bytes (also
  recorded) take to cross, and the stage below's work before it answers
  (not subtracted: the stage below reports its whole compute, part of which
  it does after answering, so subtracting it would undercount the link);
- *step time at the bound* is the larger of the compute bound and the link's
  rate bound, the shortest a step can take once enough are in flight:
  - the compute bound is the busier stage's compute per step, ``max(c_f,
    c_g)``: c_f the driving stage's forward and backward of step 1's batch,
    the fastest of ``COMPUTE_REPEATS`` passes just before step 1 that change
    nothing (``time_compute``; a single timed step would count its first
    calls and the machine's hiccups), and c_g the compute the stage below
    reports for step 1;
  - the link's rate bound is the busier direction's share of the transfer:
    the transfer is the wait less the fastest of ``PINGS`` pings (a round
    trip with no bytes) and less c_g (here subtracting all of it errs
    towards a deeper S), split between the directions by the bytes each
    carried.

With S + 1 steps in flight the round trip is covered by the steps sent
meanwhile, so the link carries a step's bytes as fast as the stages produce
them, or the stages compute as fast as the link carries them. Without the
link's rate bound (the compute bound alone) a link slower than the compute
would get far more steps in flight than fill it, each costing accuracy
(uncoded mlp-classify at batch 256 on 10 ms / 100 Mbit/s: 34 instead of 2).
For a chain the pings reach the next stage only, so the stages further down
count as transfer: an S on the small side.

Deterministic given S: step 1 is the same computation for every S (its
forward, as the forwards of steps 2..S+1, uses the initial parameters), so the
driving stage runs it in lockstep, chooses S, says hello again with it (the
stage below keeps the replies of S + 1 steps) and goes on with S steps in
flight. Timing decides S and nothing else: the run equals ``--staleness S``
with the S its summary records (``staleness``, and the figures under
``staleness_auto``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from distgrad.config.experiment import MAX_STALENESS
from distgrad.stage.stage import Stage, micro_batch

COMPUTE_REPEATS = 3       # passes of the driving stage's compute timed before step 1; the fastest counts
PINGS = 3                 # pings to the stage below before step 1; the fastest is the round trip without bytes


@dataclass(frozen=True)
class LinkProbe:
    """What the probe measured, in seconds and bytes: step 1's round trip with the transfer (its wait), the
    fastest ping, each stage's compute (``time_compute``'s for the driving stage), and the bytes of step 1
    down and up."""

    round_trip_s: float
    ping_s: float
    f_compute_s: float
    g_compute_s: float
    bytes_down: int
    bytes_up: int

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"staleness auto: {name} must be finite and >= 0, got {value!r}")

    @property
    def compute_s(self) -> float:
        """The step time at the compute bound: the busier stage's compute."""
        return max(self.f_compute_s, self.g_compute_s)

    @property
    def link_s(self) -> float:
        """The step time at the link's rate bound: the busier direction's share of the transfer (the wait
        less the fastest ping and the stage below's compute)."""
        total = self.bytes_down + self.bytes_up
        transfer = max(self.round_trip_s - self.ping_s - self.g_compute_s, 0.0)
        return transfer * max(self.bytes_down, self.bytes_up) / total if total else 0.0

    @property
    def step_s(self) -> float:
        """The step time at the bound: the larger of the compute bound and the link's rate bound."""
        return max(self.compute_s, self.link_s)

    def fields(self, staleness: int) -> dict[str, Any]:
        """The summary's ``staleness_auto``: these figures and the S chosen from them."""
        return {**asdict(self), "compute_s": self.compute_s, "link_s": self.link_s, "step_s": self.step_s,
                "chosen": staleness, "cap": MAX_STALENESS}

    def choose(self) -> int:
        """``choose_staleness`` of these figures."""
        return choose_staleness(self.round_trip_s, self.step_s)


def choose_staleness(round_trip_s: float, step_s: float, cap: int = MAX_STALENESS) -> int:
    """The smallest S from 0 to ``cap`` with ``(S + 1) * step_s >= round_trip_s`` (``cap`` when none is).

    ``round_trip_s`` is the round trip with the transfer of a step's bytes, ``step_s`` the step time at the
    bound (module docstring); negative figures count as 0, non-finite ones raise ``ValueError``.
    """
    if not (math.isfinite(round_trip_s) and math.isfinite(step_s)):
        raise ValueError(f"staleness auto: the round trip and step time must be finite, got {round_trip_s!r} "
                         f"and {step_s!r}")
    round_trip_s, step_s = max(round_trip_s, 0.0), max(step_s, 0.0)
    return next((s for s in range(cap + 1) if (s + 1) * step_s >= round_trip_s), cap)


def time_compute(stage: Stage, features: np.ndarray, micro_batches: int, repeats: int = COMPUTE_REPEATS) -> float:
    """Seconds of the fastest of ``repeats`` passes of ``stage``'s training forward and backward over
    ``features`` (the next step's batch, in ``micro_batches``), changing nothing: the parameters are only
    read, the gradients dropped, and what a forward changes besides its output (``Stage.forward_state``) is
    put back, as when steps in flight are sent again."""
    state = stage.forward_state()
    fastest = float("inf")
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            for i in range(micro_batches):
                y, cache = stage.forward(micro_batch(features, i, micro_batches), i)
                stage.backward(cache, np.zeros_like(y), need_dx=False)
            fastest = min(fastest, time.perf_counter() - started)
    finally:
        stage.restore_forward_state(state)
    return fastest
