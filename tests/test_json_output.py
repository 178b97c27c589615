"""Every JSON file and line distgrad writes is JSON: no ``NaN`` or ``Infinity``, one writer
(``distgrad.jsontext``), and a peer's non-finite or negative compute time is refused at the wire."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from distgrad.errors import ProtocolError
from distgrad.jsontext import json_text
from distgrad.privacy.budget import label_budget
from distgrad.privacy.defenses import ClipNoise
from distgrad.run.autostaleness import LinkProbe, choose_staleness
from distgrad.stage.records import write_json
from distgrad.wire import messages as wire

PACKAGE = Path(__file__).resolve().parent.parent / "distgrad"


def strict_loads(text: str):
    """``json.loads`` that refuses the non-JSON constants NaN, Infinity and -Infinity."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_floats_are_written_as_text_and_read_back_with_float():
    obj = {"inf": math.inf, "minus": [-math.inf], "nan": float("nan"), "np": np.float64("inf"),
           "f32": np.float32("nan"), "finite": 0.5, "none": None, "nested": {"t": (1.0, math.inf)}}
    back = strict_loads(json_text(obj))
    assert back == {"inf": "inf", "minus": ["-inf"], "nan": "nan", "np": "inf", "f32": "nan", "finite": 0.5,
                    "none": None, "nested": {"t": [1.0, "inf"]}}
    assert float(back["inf"]) == math.inf and math.isnan(float(back["nan"]))
    with pytest.raises(ValueError):
        json_text({"x": math.inf}, strict=True)


def test_a_clip_noise_budget_without_noise_writes_valid_json(tmp_path):
    """sigma = 0 has an infinite epsilon: the summary says "inf", not the non-JSON Infinity."""
    budget = label_budget(None, ClipNoise(max_norm=1.0, sigma=0.0, delta=1e-5), releases=10)
    write_json(tmp_path / "summary.json", {"privacy": {"g": budget}, "loss": float("nan")})
    text = (tmp_path / "summary.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    summary = strict_loads(text)
    assert summary["privacy"]["g"]["clip_noise"]["epsilon"] == "inf" and summary["loss"] == "nan"


def test_every_json_text_in_the_package_goes_through_the_one_writer():
    offenders = [f"{path.relative_to(PACKAGE)}:{number}" for path in PACKAGE.rglob("*.py")
                 if path.name != "jsontext.py"
                 for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                 if re.search(r"\bjson\.dumps?\(", line)]
    assert not offenders, f"write JSON through distgrad.jsontext.json_text: {offenders}"


@pytest.mark.parametrize("compute_s", [float("nan"), math.inf, -math.inf, -1.0])
def test_a_backward_reporting_a_non_finite_or_negative_compute_time_is_refused(compute_s):
    reply = wire.Message(wire.BACKWARD, "run-1", 1, 0, 1, body={"loss": 0.25, "compute_s": compute_s},
                         tensors={"activation_grad": np.zeros((2, 3), np.float32)})
    with pytest.raises(ProtocolError, match="compute_s") as refused:
        wire.decode(wire.encode(reply))
    assert refused.value.code == wire.ErrorCode.MALFORMED


def test_a_backward_with_a_plausible_compute_time_is_accepted():
    reply = wire.Message(wire.BACKWARD, "run-1", 1, 0, 1, body={"loss": float("nan"), "compute_s": 0.003},
                         tensors={"activation_grad": np.zeros((2, 3), np.float32)})
    decoded = wire.decode(wire.encode(reply))
    assert decoded.body["compute_s"] == 0.003 and math.isnan(decoded.body["loss"])   # a loss may diverge


def test_the_staleness_rule_refuses_figures_that_are_not_finite():
    with pytest.raises(ValueError, match="g_compute_s"):
        LinkProbe(round_trip_s=0.01, ping_s=0.001, f_compute_s=0.002, g_compute_s=float("nan"),
                  bytes_down=10, bytes_up=10)
    with pytest.raises(ValueError, match="finite"):
        choose_staleness(0.01, float("nan"))


# --- what a summary says of the defenses -------------------------------------------------------------------

def _digits_with(tmp_path: Path, f_extra: str, g_extra: str = "") -> Path:
    """The built-in digits experiment with extra lines in its stages' tables."""
    from distgrad.config.parse import BUILTIN_DIR
    text = (BUILTIN_DIR / "digits.toml").read_text().replace('"../datasets/', f'"{BUILTIN_DIR.parent / "datasets"}/')
    head, f, g = text.split("[[stages]]")
    path = tmp_path / "defended.toml"
    path.write_text("[[stages]]".join([head, f"{f.rstrip()}\n{f_extra}\n\n", f"{g.rstrip()}\n{g_extra}\n\n"]))
    return path


@pytest.mark.parametrize("f_extra", ["nopeek = { weight = 0.5 }", "clip_noise = { max_norm = 4.0, sigma = 0 }"])
def test_defenses_that_draw_nothing_are_not_said_to_draw_noise(tmp_path, f_extra):
    from distgrad.config.defended import budget_text, privacy_budget
    from distgrad.config.parse import load_experiment
    privacy = privacy_budget(load_experiment(_digits_with(tmp_path, f_extra)), ["f", "g"], 10, 0)
    assert "noise_seed" not in privacy["privacy"]["f"] and "drawn_by" not in privacy["privacy"]["f"]
    assert "seed" not in budget_text(privacy["privacy"]) and "drawing" not in budget_text(privacy["privacy"])


def test_no_defense_is_said_to_draw_from_the_seed(tmp_path):
    """Randomized labels and the noise of clip_noise and max_norm all follow the run's secret, never the seed
    the other party may know: no defense is said to draw from the seed."""
    from distgrad.config.defended import budget_text, privacy_budget
    from distgrad.config.parse import load_experiment
    exp = load_experiment(_digits_with(tmp_path, "nopeek = { weight = 0.5 }\nclip_noise = { max_norm = 4.0, sigma = 0.1 }",
                                       "max_norm = true\nlabel_dp = { epsilon = 2.0 }"))
    privacy = privacy_budget(exp, ["f", "g"], 10, 0)["privacy"]
    assert not {"drawn_by", "noise_seed"} & (set(privacy["f"]) | set(privacy["g"]))
    text = budget_text(privacy)
    assert "f: clip_noise: " in text and "g: label_dp: label-DP epsilon 2" in text
    assert "seed" not in text and "drawing" not in text


@pytest.mark.parametrize("body, needle", [({"loss": 0.5, "correct": 3, "count": 0}, "count=0"),
                                          ({"loss": 0.5, "correct": 3, "count": -4}, "count=-4"),
                                          ({"loss": 0.5, "correct": -1, "count": 4}, "correct=-1"),
                                          ({"loss": 0.5, "correct": 5, "count": 4}, "correct=5")])
def test_an_evaluation_reply_with_meaningless_counts_is_refused(body, needle):
    """An accuracy is correct / count: a peer's count below 1, or correct outside 0..count, is refused."""
    from distgrad.wire.link import check_evaluation
    reply = wire.Message(wire.EVALUATION, "run-1", 3, body=body)
    with pytest.raises(ProtocolError, match=re.escape(needle)):
        check_evaluation(reply)
    assert check_evaluation(wire.Message(wire.EVALUATION, "run-1", 3, body={"loss": math.inf, "correct": 4,
                                                                             "count": 4}))["count"] == 4


def test_a_summary_to_a_device_or_fifo_is_written_into_it_never_replaced(tmp_path):
    """``--summary /dev/null`` (or a FIFO) is written into: the atomic rename of a regular file would put a file
    where the device was (as root, a /dev/null that is a regular file). Shown with a FIFO, which a test may
    make: after each write it is still a FIFO and its reader got the whole text."""
    import os
    import select
    import stat

    from distgrad.stage.records import write_atomic

    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)      # a reader, so that opening it to write does not wait
    try:
        for write in (lambda: write_json(fifo, {"loss": 0.5}), lambda: write_atomic(fifo, lambda f: f.write(b"[1]\n"))):
            write()
            assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a file"
            assert select.select([reader], [], [], 5.0)[0], "nothing was written into the FIFO"
            json.loads(os.read(reader, 1 << 16).decode())
    finally:
        os.close(reader)
    from distgrad.run.launcher import stage_metrics_path
    assert stage_metrics_path(fifo, "g") == fifo            # no m.g.jsonl made beside a device


def test_a_merged_trace_or_metrics_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """``distgrad run`` writes the merged --trace / --metrics under a temporary name and renames it into
    place: a failure (or a kill) mid-write leaves the file that was there, never a half-written one; and the
    files of a run that ended on an error (``cut_short``) are merged without a last line a kill cut short."""
    from distgrad.stage import records

    part = tmp_path / "f.trace.jsonl"
    part.write_text('{"step":1,"grads":{},"params":{"w":[1.0]}}\n{"step":2,"grads":{},"params":{"w":[2.0]}}\n')
    out = tmp_path / "t.jsonl"
    out.write_text("the file of another run\n")
    real, calls = records.json_text, []

    def failing(obj, **options):
        calls.append(obj)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(obj, **options)

    monkeypatch.setattr(records, "json_text", failing)
    with pytest.raises(records.OutputWriteError, match="No space left on device"):
        records.merge_traces([part], out)
    monkeypatch.undo()
    assert out.read_text() == "the file of another run\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "f.trace.jsonl", "t.jsonl"]
    with part.open("a") as f:
        f.write('{"step":3,"gra')                      # a process killed mid-line
    with pytest.raises(records.StageError, match="is not JSON lines"):
        records.merge_traces([part], out)
    records.merge_traces([part], out, cut_short=True)
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()] == [1, 2]
    records.merge_metrics([part], out, [0], cut_short=True)
    assert [json.loads(line)["client"] for line in out.read_text().splitlines()] == [0, 0]


def test_the_summary_of_a_run_of_several_clients_that_failed_keeps_each_client_s_figures_in_clients():
    """As a completed run's (``merge_client_summaries``): no client's loss at the top level, each client's
    own in ``clients``, ``steps`` the rounds, and the run's ``status`` and ``error`` over the stages' own."""
    from distgrad.errors import Interrupted
    from distgrad.stage.records import ended_summary

    clients = {k: {"experiment": "e", "stage": f"f@{k}", "run_id": f"r{k}", "steps": 3 + k, "final_loss": 0.5 + k,
                   "status": "failed", "cpu_s": 0.1, "params": {f"f@{k}": {"w": [k]}}} for k in (0, 2)}
    serving = {"experiment": "e", "stage": "g", "steps": 9, "rounds": 3, "status": "completed", "cpu_s": 0.2,
               "final_loss": 0.25, "params": {"g": {"v": [1.0]}}}
    summary = ended_summary([*clients.values(), serving], "e", Interrupted(15), clients,
                            mode="4-process")
    assert summary["status"] == "stopped" and summary["error"] == "stopped by signal 15"
    assert "final_loss" not in summary and "run_id" not in summary and summary["steps"] == 3
    assert [(c["client"], c["final_loss"], c["steps"]) for c in summary["clients"]] == [(0, 0.5, 3), (2, 2.5, 5)]
    assert summary["cpu_s"] == {"f@0": 0.1, "f@2": 0.1, "g": 0.2} and sorted(summary["params"]) == ["f@0", "f@2", "g"]
    json.loads(json_text(summary))
