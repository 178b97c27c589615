"""``--staleness auto``: the driving stage measures its link over step 1 and chooses S by the rule of
``distgrad.run.autostaleness``; the run then equals ``--in-process --staleness S`` bit for bit.

Two real processes over tcp: on loopback, and through ``benchmarks/wan_link.py``'s emulated link with a
forced delay (the emulator relays in the test process, on loopback).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import StageProcess, read_json, run_launcher, run_main, start_server  # noqa: F401, F811 (fixture)
from distgrad.config.experiment import MAX_STALENESS
from distgrad.run.autostaleness import LinkProbe, choose_staleness

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "wan_link.py"
_spec = importlib.util.spec_from_file_location("wan_link", PATH)
wan_link = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("wan_link", wan_link)        # dataclasses look their module up there
_spec.loader.exec_module(wan_link)

LINK_DELAY_S = 0.050      # one way: a round trip of 100 ms against a few ms of compute per step
FLAGS = ["--steps", "24", "--activation-codec", "int8", "--gradient-codec", "int8"]


def test_the_step_at_the_bound_is_the_slower_of_compute_and_the_busier_directions_transfer():
    probe = LinkProbe(round_trip_s=0.066, ping_s=0.024, f_compute_s=0.002, g_compute_s=0.002, bytes_down=3000,
                      bytes_up=1000)
    assert probe.link_s == pytest.approx(0.040 * 3 / 4) and probe.step_s == probe.link_s   # a slow link
    assert probe.choose() == 2                                 # 3 x 30 ms >= 66 ms > 2 x 30 ms
    fast = LinkProbe(round_trip_s=0.031, ping_s=0.020, f_compute_s=0.004, g_compute_s=0.001, bytes_down=1000,
                     bytes_up=1000)
    assert fast.link_s == pytest.approx(0.005) and fast.step_s == fast.link_s
    assert fast.choose() == 6                                  # 7 x 5 ms >= 31 ms > 6 x 5 ms
    compute = LinkProbe(round_trip_s=0.030, ping_s=0.020, f_compute_s=0.004, g_compute_s=0.008, bytes_down=1000,
                        bytes_up=1000)
    assert compute.link_s == pytest.approx(0.001)
    assert compute.step_s == 0.008 and compute.choose() == 3   # the busier stage bounds the step
    assert LinkProbe(0.001, 0.002, 0.001, 0.001, 1, 1).link_s == 0.0    # a ping slower than the step: no transfer
    assert set(probe.fields(2)) >= {"round_trip_s", "ping_s", "compute_s", "link_s", "step_s", "chosen", "cap"}


def test_the_rule_is_the_smallest_depth_whose_steps_cover_the_round_trip():
    assert choose_staleness(0.0, 0.004) == 0                  # nothing to cover: lockstep
    assert choose_staleness(0.004, 0.004) == 0                # one step's compute covers it exactly
    assert choose_staleness(0.0041, 0.004) == 1
    assert choose_staleness(0.030, 0.004) == 7                # 8 x 4 ms >= 30 ms > 7 x 4 ms
    assert choose_staleness(0.032, 0.004) == 7                # the boundary belongs to the smaller S
    assert choose_staleness(0.020, 0.0025) == 7
    assert choose_staleness(1.0, 0.001) == MAX_STALENESS      # capped
    assert choose_staleness(1.0, 0.001, cap=8) == 8
    assert choose_staleness(0.010, 0.0) == MAX_STALENESS      # no compute measured: as deep as allowed
    assert choose_staleness(-0.001, 0.002) == 0               # a negative figure counts as 0


def test_auto_is_refused_where_it_cannot_act(tmp_path):
    result = run_main(["run", "mlp-classify", "--in-process", "--staleness", "auto"])
    assert result.returncode == 2 and "a run in one process" in result.stderr
    result = run_main(["run", "digits-clients", "--staleness", "auto"])
    assert result.returncode == 2 and "staleness auto: asynchronous pipelining is for two stages and chains" \
        in result.stderr
    result = run_main(["run", "digits", "--staleness", "auto", "--gradient-codec", "topk:4+ef"])
    assert result.returncode == 2 and "error feedback" in result.stderr
    result = run_main(["stage", "f", "--experiment", "mlp-classify", "--connect", "tcp://127.0.0.1:1",
                       "--staleness", "auto", "--checkpoint-dir", tmp_path, "--resume"])
    assert result.returncode == 2 and "give --staleness S" in result.stderr
    result = run_main(["stage", "g", "--experiment", "mlp-classify", "--bind", "tcp://127.0.0.1:*",
                       "--staleness", "auto"])
    assert result.returncode == 2 and "driving stage" in result.stderr
    result = run_main(["run", "mlp-classify", "--staleness", "soon"])
    assert result.returncode == 2 and "expected an integer S >= 0 or 'auto'" in result.stderr
    text = (Path(__file__).resolve().parent.parent / "distgrad" / "experiments" / "tanh-regression.toml").read_text()
    path = tmp_path / "auto.toml"
    path.write_text(text.replace('seed = ', 'staleness = "auto"\nseed = ', 1))
    result = run_main(["run", path, "--in-process"])
    assert result.returncode == 2 and "'auto' is the driving stage's flag" in result.stderr


def _reference(tmp_path: Path, staleness: int) -> dict:
    path = tmp_path / "reference.json"
    result = run_main(["run", "mlp-classify", "--in-process", "--staleness", str(staleness), "--summary", path,
                       *FLAGS])
    assert result.returncode == 0, result.stderr
    return read_json(path)


def _check_choice(summary: dict) -> int:
    """The S a summary records, and that it is the rule's choice from the figures it records."""
    chosen, figures = summary["staleness"], summary["staleness_auto"]
    assert figures["chosen"] == chosen
    assert chosen == choose_staleness(figures["round_trip_s"], figures["step_s"])
    assert figures["compute_s"] == max(figures["f_compute_s"], figures["g_compute_s"]) > 0
    assert figures["step_s"] == max(figures["compute_s"], figures["link_s"])
    assert 0 < figures["ping_s"]
    assert figures["bytes_down"] > 8192 and figures["bytes_up"] > 8192     # 32 x 256 int8 each way, and headers
    return chosen


@pytest.mark.slow       # about 6 s; the delayed link's run below checks the same by default
def test_on_loopback_auto_records_its_choice_and_equals_the_in_process_run_with_it(tmp_path):
    """On loopback the wait is the stack's own latency per message (ZeroMQ, Python, the stage below's work
    before it answers), about a step's compute for this small model: S is small (0 to 2 on an idle machine,
    more if step 1 met a stall); whichever, the S recorded is the rule's and repeats the run."""
    path = tmp_path / "run.json"
    result = run_launcher(["run", "mlp-classify", "--staleness", "auto", "--summary", path, *FLAGS])
    assert result.returncode == 0, result.stdout + result.stderr
    summary = read_json(path)
    chosen = _check_choice(summary)
    if summary["staleness_auto"]["round_trip_s"] <= summary["staleness_auto"]["compute_s"]:
        assert chosen == 0
    reference = _reference(tmp_path, chosen)
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]


def test_through_a_delayed_link_auto_keeps_steps_in_flight_and_equals_the_in_process_run(tmp_path, start_server):  # noqa: F811
    """A 50 ms one-way link: step 1 waits at least 100 ms, so S >= 1 is chosen (a step's compute is a few ms),
    sent in the second hello (the serving stage keeps S + 1 replies), and the parameters of both stages
    equal ``--in-process --staleness S``."""
    g, endpoint = start_server("mlp-classify", "--summary", tmp_path / "g.json", *FLAGS)
    port = int(endpoint.rsplit(":", 1)[1])
    with wan_link.LinkEmulator(0, port, delay_s=LINK_DELAY_S) as link:
        with StageProcess(["f", "--experiment", "mlp-classify", "--connect", f"tcp://127.0.0.1:{link.port}",
                           "--staleness", "auto", "--summary", tmp_path / "f.json", "--log-level", "INFO", *FLAGS],
                          tmp_path / "f.log") as f:
            assert f.wait() == 0, f.output
            assert "staleness auto: S = " in f.output
    assert g.wait() == 0, g.output
    summary = read_json(tmp_path / "f.json")
    chosen = _check_choice(summary)
    figures = summary["staleness_auto"]
    # No bound on round_trip_s: it is the wait less the compute the stages report, each timed in its own
    # process, so on a loaded machine it can come out a little under the link's 100 ms (it did: 97 ms).
    assert figures["round_trip_s"] > 0
    # S >= 1 unless step 1's measured compute outlasted the 100 ms round trip (a stall on a busy machine):
    # then the rule rightly keeps lockstep, and the run below must still equal the in-process one.
    assert chosen >= 1 or figures["step_s"] >= figures["round_trip_s"], figures
    reference = _reference(tmp_path, chosen)
    assert summary["params"]["f"] == reference["params"]["f"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == reference["params"]["g"]
    assert summary["final_loss"] == reference["final_loss"]


def test_the_evaluation_after_the_measured_step_scores_what_staleness_s_scores(tmp_path, start_server, monkeypatch):  # noqa: F811
    """Step 1 runs in lockstep to measure the link; with S chosen, the forwards of steps 2..S+1 go down
    before step 1's evaluation does, so the stage below scores it after its step min(1+S, steps), as with
    ``--staleness S``. The driving stage runs here, its choice pinned to S = 2 (timing is not the point)."""
    monkeypatch.setattr(LinkProbe, "choose", lambda self: 2)
    flags = ["--steps", "4", "--eval-every", "1"]
    g, endpoint = start_server("digits", "--summary", tmp_path / "g.json", "--steps", "4")
    result = run_main(["stage", "f", "--experiment", "digits", "--connect", endpoint, "--staleness", "auto",
                       "--summary", tmp_path / "f.json", *flags])
    assert result.returncode == 0, result.stderr
    assert g.wait() == 0, g.output
    summary = read_json(tmp_path / "f.json")
    assert summary["staleness"] == 2
    reference = tmp_path / "reference.json"
    assert run_main(["run", "digits", "--in-process", "--staleness", "2", "--summary", reference,
                     *flags]).returncode == 0
    expected = read_json(reference)
    assert [e["step"] for e in summary["evaluations"]] == [1, 2, 3, 4]
    assert summary["evaluations"] == expected["evaluations"]
    assert summary["params"]["f"] == expected["params"]["f"]
    assert read_json(tmp_path / "g.json")["params"]["g"] == expected["params"]["g"]
