"""benchmarks/wan.py's bound, against closed forms derived by hand for the link model (unit tests: no
process, no socket).

With ``s`` one micro-batch's serialisation (the same both ways) and ``RTT``
twice the one-way delay, a micro-batch's reply arrives ``RTT + s`` after it
leaves the down serialiser. A window of W keeps the link busy when the link
is the bottleneck, else it waits a round trip every W micro-batches.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))          # wan.py imports wan_link beside it
_spec = importlib.util.spec_from_file_location("wan", BENCHMARKS / "wan.py")
wan = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("wan", wan)               # dataclasses look their module up there
_spec.loader.exec_module(wan)

DELAY_S, RATE_BPS = 0.010, 1e6                  # 1 MB/s: s = bytes / 1e6 seconds
TOL = 1e-12


def _window_limited(m: int, w: int, s: float, rtt: float) -> float:
    """The last reply when W micro-batches cannot cover a round trip: the last one leaves the down
    serialiser after ``(M-1) mod W + 1`` back-to-back sends and ``floor((M-1)/W)`` round trips of ``RTT + 2s``."""
    last_leaves = ((m - 1) % w + 1) * s + ((m - 1) // w) * (rtt + 2 * s)
    return last_leaves + rtt + s


def test_lockstep_is_a_round_trip_plus_both_transfers():
    assert wan.link_time(1, 1, 3000, 5000, DELAY_S, RATE_BPS) == pytest.approx(2 * DELAY_S + 0.003 + 0.005, abs=TOL)


@pytest.mark.parametrize("m", [2, 4, 8])
def test_all_in_flight_pays_the_batch_once_and_one_micro_batch_back(m):
    # gpipe: the down link never idles; the last micro-batch's gradient follows it.
    assert wan.link_time(m, m, 8000, 8000, DELAY_S, RATE_BPS) == pytest.approx(2 * DELAY_S + 0.008 + 0.008 / m,
                                                                                abs=TOL)


@pytest.mark.parametrize("m, w", [(4, 2), (8, 2), (8, 4), (8, 3), (4, 1)])
def test_a_window_short_of_the_round_trip_waits_for_it(m, w):
    s = 0.001                                     # 1000 bytes per micro-batch at 1 MB/s
    assert w * s < 2 * DELAY_S                    # the window does not cover the delay
    expected = _window_limited(m, w, s, 2 * DELAY_S)
    assert wan.link_time(m, w, s * m * 1e6, s * m * 1e6, DELAY_S, RATE_BPS) == pytest.approx(expected, abs=TOL)


def test_a_window_that_covers_the_round_trip_is_as_good_as_all():
    # s = 10 ms per micro-batch, RTT 20 ms: micro-batch W may leave when the first reply is back, at
    # RTT + 2s = 40 ms, so W s >= 40 ms (W = 4) keeps the down link busy; W = 3 waits.
    everything = wan.link_time(8, 8, 0.08e6, 0.08e6, DELAY_S, RATE_BPS)
    assert wan.link_time(8, 4, 0.08e6, 0.08e6, DELAY_S, RATE_BPS) == pytest.approx(everything, abs=TOL)
    assert wan.link_time(8, 3, 0.08e6, 0.08e6, DELAY_S, RATE_BPS) == pytest.approx(
        _window_limited(8, 3, 0.010, 2 * DELAY_S), abs=TOL)
    assert _window_limited(8, 3, 0.010, 2 * DELAY_S) > everything


def test_bound_adds_one_micro_batch_of_compute_and_shares_it_over_stale_steps():
    link = wan.Link("t", DELAY_S, RATE_BPS * 8)                 # rate_Bps = 1e6
    gpipe = wan.Schedule("gpipe M=4", 4, "gpipe")
    sync = wan.bound_s(wan.Config(gpipe), link, 4000, 4000, 0.004, 0.002)
    assert sync["bound_s"] == pytest.approx(2 * DELAY_S + 0.004 + 0.001 + 0.006 / 4, abs=TOL)
    stale = wan.bound_s(wan.Config(gpipe, staleness=2), link, 4000, 4000, 0.004, 0.002)
    assert stale["bound_s"] == pytest.approx(max(sync["bound_s"] / 3, 0.004), abs=TOL)
    # A busy stage or a busy direction bounds a step whatever the staleness.
    assert wan.bound_s(wan.Config(gpipe, staleness=2), link, 40_000, 400, 0.001, 0.001)["bound_s"] == \
        pytest.approx(0.040, abs=TOL)
    assert wan.bound_s(wan.Config(gpipe, staleness=2), link, 400, 400, 0.050, 0.001)["bound_s"] == \
        pytest.approx(0.050, abs=TOL)


def test_codec_and_staleness_rows_name_the_flags_they_need():
    row = wan.Config(wan.LOCKSTEP, "int8", 1)
    assert row.shared_flags() == ["--activation-codec", "int8", "--gradient-codec", "int8"]   # both stages
    assert row.driver_flags() == ["--staleness", "1"]                                          # the driver only
    assert row.missing({"--staleness"}) == ["--activation-codec", "--gradient-codec"]
    assert wan.Config(wan.Schedule("1f1b M=8 N=4", 8, in_flight=4)).missing({"--micro-batches", "--schedule"}) == \
        ["--in-flight"]
    deep = len(wan.CODECS) * len(wan.DEEP_STALENESS) * len(wan.DEEP_SCHEDULES)
    auto = 2 * len(wan.DEEP_SCHEDULES)                                   # uncoded and int8
    assert math.prod(len(x) for x in (wan.CODECS, wan.STALENESS)) * len(wan.SCHEDULES) + deep + auto == \
        len(wan.grid(full=True))
    assert wan.Config(wan.LOCKSTEP, "int8", wan.AUTO).driver_flags() == ["--staleness", "auto"]
    # Steps in flight send all M micro-batches at once: the row's window is not given (distgrad refuses it).
    assert wan.Config(wan.Schedule("1f1b M=8 N=4", 8, in_flight=4), "int8", 1).driver_flags() == \
        ["--micro-batches", "8", "--schedule", "1f1b", "--staleness", "1"]
    assert wan.Config(wan.LOCKSTEP, "int8", wan.AUTO).chosen(7) == wan.Config(wan.LOCKSTEP, "int8", 7)


def test_the_link_and_compute_bounds_are_what_no_staleness_beats():
    link = wan.Link("t", DELAY_S, RATE_BPS * 8)                 # rate_Bps = 1e6
    deep = wan.bound_s(wan.Config(wan.LOCKSTEP, "int8", 16), link, 5000, 4000, 0.003, 0.001)
    assert deep["rate_s"] == pytest.approx(0.005, abs=TOL) and deep["compute_s"] == pytest.approx(0.003, abs=TOL)
    assert deep["bound_s"] == pytest.approx(0.005, abs=TOL)    # 16 steps in flight cover the round trip
