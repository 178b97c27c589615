"""The output files of a run with several clients: one metrics file, one trace, one summary.

Each client's driver and the serving stage write their own files; ``distgrad
run`` merges them into the paths the user gave, one line per (step, client),
and a summary whose top level holds only what is true of the whole run.
The merges are checked on real runs and, for the two trace shapes, on lines
written by hand to the agreed format.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import read_json, read_lines, run_launcher, run_main
from distgrad.errors import DistgradError
from distgrad.stage import records

STEPS = 10
CLIENTS = 3
# Top-level fields of a several-clients summary: each is true of the whole run, none of one client.
RUN_FIELDS = {"experiment", "steps", "seed", "mode", "transport", "micro_batches", "elapsed_s", "cpu_s", "params",
              "status", "clients"}
CLIENT_FIELDS = {"client", "run_id", "steps", "final_loss", "status", "test_loss", "test_accuracy", "test_count",
                 "evaluations"}
def _write_lines(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def clients_run(tmp_path_factory):
    """One ``distgrad run digits-clients`` writing both a metrics file and a summary, for the tests of each:
    (its result, the metrics path, the summary path)."""
    directory = tmp_path_factory.mktemp("clients-run")
    metrics, summary = directory / "m.jsonl", directory / "s.json"
    result = run_launcher(["run", "digits-clients", "--steps", STEPS, "--metrics", metrics, "--summary", summary])
    assert result.returncode == 0, result.stdout + result.stderr
    return result, metrics, summary


# --- metrics -----------------------------------------------------------------------------------

def test_clients_metrics_are_one_valid_file_with_one_line_per_step_and_client(clients_run):
    _, metrics, _ = clients_run
    lines = read_lines(metrics)         # every line parses: one writer, not three at once
    assert [(line["step"], line["client"]) for line in lines] == [
        (step, client) for step in range(1, STEPS + 1) for client in range(CLIENTS)]
    for line in lines:
        assert line["bytes_sent"] > 0 and line["wall_s"] > 0 and isinstance(line["loss"], float)
    # each client's wall clock runs on its own: per client, it only grows
    for client in range(CLIENTS):
        walls = [line["wall_s"] for line in lines if line["client"] == client]
        assert walls == sorted(walls)


def test_merge_metrics_tags_each_line_with_its_client_and_sorts_by_step_then_client(tmp_path):
    paths = [_write_lines(tmp_path / f"{c}.jsonl", [{"step": s, "loss": 10.0 * c + s, "wall_s": s}
                                                      for s in (1, 2)]) for c in range(2)]
    out = tmp_path / "merged.jsonl"
    records.merge_metrics(paths, out, clients=[0, 1])
    assert read_lines(out) == [{"step": 1, "loss": 1.0, "wall_s": 1, "client": 0},
                               {"step": 1, "loss": 11.0, "wall_s": 1, "client": 1},
                               {"step": 2, "loss": 2.0, "wall_s": 2, "client": 0},
                               {"step": 2, "loss": 12.0, "wall_s": 2, "client": 1}]


def test_plot_draws_one_loss_line_per_client(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from distgrad.plot import draw_metrics, read_metrics

    metrics = _write_lines(tmp_path / "m.jsonl", [
        {"step": s, "client": c, "loss": 1.0 / (s + c), "wall_s": 0.01 * s + 0.001 * c}
        for s in range(1, 31) for c in range(CLIENTS)])
    fig = draw_metrics(read_metrics(metrics), "m.jsonl")
    plt.close(fig)
    ax_loss, ax_rate = fig.axes
    assert [line.get_label() for line in ax_loss.get_lines()] == [f"client {c}" for c in range(CLIENTS)]
    assert [len(line.get_xdata()) for line in ax_loss.get_lines()] == [30] * CLIENTS
    assert len(ax_rate.get_lines()) == CLIENTS
    png = tmp_path / "loss.png"
    result = run_main(["plot", metrics, "--out", png])        # a process draws it in test_watch.py
    assert result.returncode == 0, result.stderr
    assert png.read_bytes().startswith(b"\x89PNG")


def test_plot_of_a_two_stage_metrics_file_has_one_unlabelled_line(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from distgrad.plot import draw_metrics, read_metrics

    metrics = _write_lines(tmp_path / "m.jsonl", [{"step": s, "loss": 1.0 / s, "wall_s": 0.01 * s}
                                                  for s in range(1, 31)])
    fig = draw_metrics(read_metrics(metrics), "m.jsonl")
    plt.close(fig)
    ax_loss, ax_rate = fig.axes
    assert len(ax_loss.get_lines()) == 1 and len(ax_rate.get_lines()) == 1
    assert ax_loss.get_legend() is None


# --- trace -------------------------------------------------------------------------------------

def test_splitfed_trace_is_one_line_per_step_and_client_with_both_stages_values(tmp_path):
    trace, summary = tmp_path / "t.jsonl", tmp_path / "s.json"
    result = run_launcher(["run", "digits-splitfed", "--steps", STEPS, "--trace", trace, "--summary", summary])
    assert result.returncode == 0, result.stdout + result.stderr
    lines, params = read_lines(trace), read_json(summary)["params"]
    assert [(line["step"], line["client"]) for line in lines] == [
        (step, client) for step in range(1, STEPS + 1) for client in range(CLIENTS)]
    for line in lines:
        assert set(line["grads"]) == {*params["f@0"], *params["g"], "activation_grad",
                                      "sent_activation", "sent_activation_grad"}    # what crossed, as in two stages
        assert set(line["params"]) == {*params["f@0"], *params["g"]}
        assert isinstance(line["loss"], float)
    for client in range(CLIENTS):
        last = lines[-CLIENTS + client]
        assert {k: v for k, v in last["params"].items() if k in params["f@0"]} == params[f"f@{client}"]
    assert {k: v for k, v in lines[-1]["params"].items() if k in params["g"]} == params["g"]


def test_merge_traces_joins_client_and_serving_lines_on_step_and_client(tmp_path):
    """The several-clients shape: clients' files say no client (the file does), g's lines do."""
    def client_line(step: int, c: int) -> dict:
        return {"step": step, "loss": 1.0 + c, "grads": {"w": [c]}, "params": {"w": [10 + c]}}

    def g_line(step: int, c: int) -> dict:
        return {"step": step, "client": c, "loss": 1.0 + c, "grads": {"v": [step], "activation_grad": [[c]]},
                "params": {"v": [100 * step + c]}}

    clients = [_write_lines(tmp_path / f"f@{c}.jsonl", [client_line(s, c) for s in (2, 1)]) for c in range(2)]
    g = _write_lines(tmp_path / "g.jsonl", [g_line(s, c) for s in (1, 2) for c in range(2)])
    out = tmp_path / "t.jsonl"
    records.merge_traces([*clients, g], out, clients=[0, 1, None])
    assert read_lines(out) == [
        {"step": s, "client": c, "loss": 1.0 + c, "grads": {"w": [c], "v": [s], "activation_grad": [[c]]},
         "params": {"w": [10 + c], "v": [100 * s + c]}} for s in (1, 2) for c in range(2)]


def test_merge_traces_of_two_stages_is_one_line_per_step_without_client(tmp_path):
    f = _write_lines(tmp_path / "f.jsonl", [{"step": s, "loss": 0.5, "grads": {"w": [s]}, "params": {"w": [s]}}
                                            for s in (1, 2)])
    g = _write_lines(tmp_path / "g.jsonl", [{"step": s, "loss": 0.5, "grads": {"v": [s]}, "params": {"v": [s]}}
                                            for s in (1, 2)])
    out = tmp_path / "t.jsonl"
    records.merge_traces([f, g], out)
    assert read_lines(out) == [{"step": s, "grads": {"w": [s], "v": [s]}, "params": {"w": [s], "v": [s]}, "loss": 0.5}
                               for s in (1, 2)]


def test_merge_traces_refuses_a_missing_file_and_a_line_of_another_client(tmp_path):
    present = _write_lines(tmp_path / "f@0.jsonl", [{"step": 1, "client": 1, "grads": {}, "params": {}}])
    with pytest.raises(DistgradError, match="g.jsonl"):
        records.merge_traces([tmp_path / "g.jsonl"], tmp_path / "t.jsonl")
    with pytest.raises(DistgradError, match="client 1 .* client 0"):
        records.merge_traces([present], tmp_path / "t.jsonl", clients=[0])


# --- summary -----------------------------------------------------------------------------------

def test_clients_summary_has_a_section_per_client_and_no_top_level_field_of_one_client(clients_run, tmp_path):
    result, _, path = clients_run
    summary = read_json(path)
    assert set(summary) == RUN_FIELDS
    assert summary["steps"] == STEPS and summary["status"] == "completed" and summary["transport"] == "tcp"
    assert sorted(summary["cpu_s"]) == sorted(summary["params"]) == ["f@0", "f@1", "f@2", "g"]
    assert [entry["client"] for entry in summary["clients"]] == list(range(CLIENTS))
    run_ids = set()
    for entry in summary["clients"]:
        assert set(entry) == CLIENT_FIELDS
        assert entry["steps"] == STEPS and entry["status"] == "completed"
        run_ids.add(entry["run_id"])
    assert len(run_ids) == CLIENTS          # each client's own run id
    # one line per client on stdout, and no headline loss that would be one client's
    for entry in summary["clients"]:
        assert (f"client {entry['client']}: final loss {entry['final_loss']:.6g}, "
                f"test accuracy {entry['test_accuracy']:.4f}") in result.stdout
    assert "), final loss" not in result.stdout and "\ntest accuracy" not in result.stdout

    reference_path = tmp_path / "reference.json"
    reference = run_main(["run", "digits-clients", "--steps", STEPS, "--in-process", "--summary", reference_path])
    assert reference.returncode == 0, reference.stderr
    in_process = read_json(reference_path)
    assert set(in_process) == RUN_FIELDS and in_process["transport"] is None
    for ours, theirs in zip(summary["clients"], in_process["clients"]):
        assert set(theirs) == CLIENT_FIELDS and theirs["run_id"] is None
        assert {k: v for k, v in ours.items() if k != "run_id"} == {k: v for k, v in theirs.items() if k != "run_id"}
    assert summary["params"] == in_process["params"]


def test_merge_client_summaries_takes_the_serving_stages_view_of_status_and_rounds():
    def client(k: int, steps: int) -> dict:
        return {"experiment": "x", "stage": f"f@{k}", "run_id": f"r{k}", "status": "completed", "steps": steps,
                "seed": 3, "final_loss": 0.5 + k, "elapsed_s": 1.0 + k, "cpu_s": 0.1, "micro_batches": 2,
                "endpoint": "tcp://127.0.0.1:1", "schedule": "1f1b", "params": {f"f@{k}": {"w": [k]}}}

    serving = {"experiment": "x", "stage": "g", "run_id": "g-run", "status": "completed", "steps": 19, "rounds": 10,
               "final_loss": 9.0, "elapsed_s": 2.5, "cpu_s": 0.3, "params": {"g": {"v": [1]}},
               "clients": [{"client": 0, "status": "completed"}, {"client": 1, "status": "dropped"}]}
    merged = records.merge_client_summaries([client(0, 10), client(1, 9)], serving, mode="3-process", transport="ipc")
    assert set(merged) == RUN_FIELDS
    assert (merged["steps"], merged["elapsed_s"], merged["status"], merged["micro_batches"]) == (10, 2.5, "completed", 2)
    assert merged["cpu_s"] == {"f@0": 0.1, "f@1": 0.1, "g": 0.3} and sorted(merged["params"]) == ["f@0", "f@1", "g"]
    assert merged["clients"] == [
        {"client": 0, "run_id": "r0", "steps": 10, "final_loss": 0.5, "status": "completed"},
        {"client": 1, "run_id": "r1", "steps": 9, "final_loss": 1.5, "status": "dropped"}]
    earlier = records.merge_client_summaries([client(0, 10), client(1, 10)], None, mode="finished earlier")
    assert earlier["steps"] == 10 and earlier["status"] == "completed" and "transport" not in earlier


# SplitFed's trace holds the clients' steps as digits-clients' does, and its averages besides: clients is slow.
@pytest.mark.parametrize("experiment", [pytest.param("digits-clients", marks=pytest.mark.slow), "digits-splitfed"])
def test_clients_trace_over_the_wire_equals_the_in_process_trace(tmp_path, experiment):
    """The serving stage writes a line per client turn; merged with the clients' lines, the trace is the
    in-process reference's, bit for bit (SplitFed: each client's parameters after the average)."""
    wire_trace, local_trace = tmp_path / "wire.jsonl", tmp_path / "local.jsonl"
    flags = ["--steps", STEPS, "--micro-batches", "2"]
    result = run_launcher(["run", experiment, *flags, "--trace", wire_trace])
    assert result.returncode == 0, result.stdout + result.stderr
    result = run_main(["run", experiment, *flags, "--trace", local_trace, "--in-process"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_lines(wire_trace) == read_lines(local_trace)
