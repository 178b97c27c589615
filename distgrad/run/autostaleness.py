"""``--staleness auto``: the driving stage chooses its staleness S from its first step over the link.

The rule (``choose_staleness``): S is the smallest whole number with

    (S + 1) * step time at the compute bound >= round trip + transfer time

capped at ``MAX_STALENESS``, where, measured over step 1 (``LinkProbe``):

- *round trip + transfer time* is how long the driving stage waited for step
  1's replies, less the compute the stage below reports in them: the link's
  delay both ways and the time its bytes per step (also recorded) take to
  cross;
- *step time at the compute bound* is the busier stage's compute per step,
  ``max(c_f, c_g)``: the driving stage's time in step 1 outside that wait,
  and the stage below's reported compute.

With S + 1 steps in flight, the link's latency is covered by the compute of
the steps sent meanwhile, so the link carries a step's bytes as fast as the
stages can produce them. On loopback (a round trip far below a step's
compute) the rule gives 0: lockstep.

Deterministic given S: step 1 is the same computation for every S (its
forward, as the forwards of steps 2..S+1, uses the initial parameters), so the
driving stage runs it in lockstep, chooses S, says hello again with it (the
stage below keeps the replies of S + 1 steps) and goes on with S steps in
flight. Timing decides S and nothing else: the run equals ``--staleness S``
with the S its summary records (``staleness``, and the figures under
``staleness_auto``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from distgrad.config.experiment import MAX_STALENESS


@dataclass(frozen=True)
class LinkProbe:
    """What step 1 measured, in seconds and bytes: the round trip with the transfer, each stage's compute,
    and the bytes of the step down and up."""

    round_trip_s: float
    f_compute_s: float
    g_compute_s: float
    bytes_down: int
    bytes_up: int

    @property
    def compute_s(self) -> float:
        """The step time at the compute bound: the busier stage's compute."""
        return max(self.f_compute_s, self.g_compute_s)

    def fields(self, staleness: int) -> dict[str, Any]:
        """The summary's ``staleness_auto``: these figures and the S chosen from them."""
        return {**asdict(self), "compute_s": self.compute_s, "chosen": staleness, "cap": MAX_STALENESS}


def choose_staleness(round_trip_s: float, compute_s: float, cap: int = MAX_STALENESS) -> int:
    """The smallest S from 0 to ``cap`` with ``(S + 1) * compute_s >= round_trip_s`` (``cap`` when none is).

    ``round_trip_s`` is the round trip with the transfer of a step's bytes, ``compute_s`` the step time at
    the compute bound (module docstring); negative figures count as 0.
    """
    round_trip_s, compute_s = max(round_trip_s, 0.0), max(compute_s, 0.0)
    return next((s for s in range(cap + 1) if (s + 1) * compute_s >= round_trip_s), cap)
