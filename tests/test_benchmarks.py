"""Every script in benchmarks/ runs, at its smallest settings, against today's distgrad.

Smoke tests, not measurements: each runs the script as a process (exit 0,
the output keys it promises), so a refactor that breaks a benchmark fails
here rather than on the day someone needs the figures. The helper scripts
run through bench.py (``_peers.py``, ``_raw_split.py``) or directly
(``_torch_split.py``, only when torch is installed). All integration tests
(conftest.INTEGRATION_MODULES).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from distgrad.run.launcher import pinned_env

from conftest import free_tcp_port, run_main

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT_DEADLINE_S = 60.0          # each script's smallest run takes seconds; this only bounds a hang
# bench.py --smoke runs every section: about 25 s alone on 2 cores, over a minute beside the rest of the slow
# set under pytest -n 2 (CI's make test-slow).
BENCH_SMOKE_DEADLINE_S = 180.0


def run_script(name: str, *args: object, timeout: float = SCRIPT_DEADLINE_S,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, str(BENCHMARKS / name), *map(str, args)], capture_output=True,
                            text=True, timeout=timeout, env=env or pinned_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"{name} exited {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


# Each script in benchmarks/ and the test that runs it; a new script must be added here.
SMOKE_TESTS = {
    "attackers.py": "test_attackers",
    "bench.py": "test_bench_smoke_runs_every_section",
    "copies.py": "test_copies_per_step_stay_within_the_path_s_own_arrays",
    "_peers.py": "test_bench_smoke_runs_every_section",          # every role, through bench.py
    "_raw_split.py": "test_bench_smoke_runs_every_section",      # the "bare" variant of section B
    "_bare_identity.py": "test_bench_smoke_runs_every_section",  # the "bare" variant of section A (and scaling's)
    "_parts_identity.py": "test_bench_smoke_runs_every_section",  # the "parts" variant of section A
    "_torch_split.py": "test_torch_split",
    "held_out_reconstruction.py": "test_held_out_reconstruction",
    "per_message.py": "test_per_message",
    "privacy.py": "test_privacy_tradeoff",
    "label_dp.py": "test_label_dp_curve",
    "privacy_meter_cost.py": "test_privacy_meter_cost",
    "profile_step.py": "test_profile_step",
    "scaling.py": "test_scaling",
    "soak.py": "test_soak",
    "step_cpu.py": "test_step_cpu",
    "timeline.py": "test_timeline",
    "wake_cost.py": "test_wake_cost",
    "wan.py": "test_wan",
    "wan_link.py": "test_wan_link",
    "zero_copy_threshold.py": "test_zero_copy_threshold",
}


def test_every_script_has_a_smoke_test():
    assert sorted(p.name for p in BENCHMARKS.glob("*.py")) == sorted(SMOKE_TESTS)
    assert all(name in globals() for name in SMOKE_TESTS.values())


# A benchmark run (the brief keeps those out of the default suite): `make test-slow` (CI) or `-m slow` runs it.
@pytest.mark.slow
@pytest.mark.timeout(BENCH_SMOKE_DEADLINE_S + 30)
def test_bench_smoke_runs_every_section(tmp_path):
    """bench.py --smoke: A, B (with _peers.py and _raw_split.py) and C once at tiny sizes; then --report."""
    out = tmp_path / "bench.json"
    result = run_script("bench.py", "--smoke", "--torch-python", "none", "--json", out, "--workdir", tmp_path / "w",
                        timeout=BENCH_SMOKE_DEADLINE_S)
    assert "smoke run took" in result.stdout and "0 failed measurement(s)" in result.stdout
    figures = json.loads(out.read_text())
    assert figures["failures"] == [] and figures["meta"]["smoke"] is True
    assert "error" not in figures["meta"]["machine"]["children"]            # _peers.py info
    tcp = figures["message_path"]["4"]["tcp"]
    for key in ("raw_rt_s", "wire_rt_s", "distgrad_step_s", "spin_step_s",       # _peers.py raw/wire peers
                "bare_step_s", "parts_step_s"):                  # _bare_identity.py, _parts_identity.py
        assert tcp[key] > 0, key
    assert figures["message_path"]["4"]["inprocess_step_s"] > 0                  # _peers.py inprocess
    model = figures["model"]["32"]["steps_per_s"]
    for key in ("unpipelined", "unpipelined_spin", "inprocess", "bare", "1f1b_m2"):   # bare: _raw_split.py
        assert model[key] > 0, key
    balanced = figures["balanced"]
    assert set(balanced["stage_compute"]) == {"1", "2"}                          # _peers.py stage-compute
    assert all(balanced["steps_per_s"][k] > 0 for k in ("unpipelined", "inprocess", "1f1b_m2"))
    assert set(figures["memory"]["wide"]["runs"]) == {"1f1b", "gpipe"}
    assert figures["targets"]

    report = run_script("bench.py", "--report", out, "--markdown")
    assert "A. Message path" in report.stdout and "Targets" in report.stdout


@pytest.mark.slow
def test_held_out_reconstruction():
    """A few steps: a row per setting (accuracy, R^2 of the evaluation activations received, R^2 of the clean
    ones); the undefended row's two R^2 are one figure."""
    result = run_script("held_out_reconstruction.py", "--steps", "30")
    rows = [line.split("|")[1:-1] for line in result.stdout.splitlines() if line.startswith("|")]
    assert [row[0].strip() for row in rows][0] == "undefended" and len(rows) == 4
    assert rows[0][2] == rows[0][3]


@pytest.mark.slow       # a benchmark run: the slow set (CI's make test-slow)
def test_per_message(tmp_path):
    out = tmp_path / "per_message.json"
    run_script("per_message.py", "--repeats", "1", "--json", out)
    figures = json.loads(out.read_text())
    for key in ("encode forward 4 B", "decode backward 32768 B", "expect_tensors 4194304 B",
                "g handles a forward (seed-reverse)", "g handles a forward (mlp-classify)",
                "a step of f and g, no sockets (seed-reverse)", "a step of f and g, no sockets (mlp-classify)",
                "a step of f and g, no sockets (seed-reverse), after other work",
                "transport round trip inproc 4 B", "Adam step, 784x256 + 256"):
        assert figures[key] > 0, key


def test_profile_step_summary_counts_own_and_total_time_of_the_main_thread():
    spec = importlib.util.spec_from_file_location("profile_step", BENCHMARKS / "profile_step.py")
    profile_step = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_step)
    raw = ("thread (1): MainThread;main (a.py);wait (b.py) 6\n"
           "thread (1): MainThread;main (a.py);step (a.py);wait (b.py) 2\n"
           "thread (1): MainThread;main (a.py);step (a.py) 2\n"
           "thread (2): distgrad-handshakes;poll (c.py) 90\n")
    text = profile_step.summarise(raw, 10)
    own, total = text.split("total time:")
    assert "10 samples of the main thread" in text and "poll (c.py)" not in text
    assert "80.0%  wait (b.py)" in own and "20.0%  step (a.py)" in own
    assert "100.0%  main (a.py)" in total and "40.0%  step (a.py)" in total


@pytest.mark.slow
@pytest.mark.skipif(not (Path(sys.executable).parent / "py-spy").exists(),
                    reason="py-spy is not installed beside this interpreter: profile_step.py not run "
                           "(pip install py-spy)")
def test_profile_step():
    result = run_script("profile_step.py", "tiny", "--seconds", "1", "--top", "5")
    assert "driver (f), tiny:" in result.stdout and "serving stage (g), tiny:" in result.stdout
    assert "poll_frames" in result.stdout          # both stages wait in their one blocking receive


@pytest.mark.slow
def test_step_cpu():
    """step_cpu.py: a short run of the 4-byte split, both stages pinned to one CPU, then unpinned."""
    for g, f in (("0", "0"), ("any", "any")):
        result = run_script("step_cpu.py", "tiny", "--steps", "200", "--pin", f"{g},{f}")
        line = result.stdout.strip().splitlines()[-1]
        assert line.startswith(f"tiny g@{g} f@{f}: ") and "CPU per step: f " in line, line
    result = run_script("step_cpu.py", "tiny", "--steps", "200", "--f-flags", "--spin-us 300")
    lines = result.stdout.strip().splitlines()[-2:]
    assert lines[0].startswith("tiny g@any f@any: ") and lines[1].startswith("tiny g@any f@any f --spin-us 300: "), lines


@pytest.mark.slow
def test_wake_cost(tmp_path):
    """wake_cost.py: a short ping-pong in every mode; each row has the step and both sides' work and penalty."""
    out = tmp_path / "wake.json"
    result = run_script("wake_cost.py", "--work-us", "5", "--round-trips", "200", "--repeats", "1", "--json", out)
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["block", "spin", "spin-yield"], result.stdout
    for row in rows:
        assert row["step_us"] > 0 and len(row["work_after_wake_us"]) == len(row["work_hot_us"]) == 2
        assert all(p is None or p > 0 for p in row["penalty"])


@pytest.mark.slow
def test_scaling_runs_only_the_groups_asked_for(tmp_path):
    """--groups vertical: the vertical group alone, and the target from it."""
    out = tmp_path / "scaling.json"
    run_script("scaling.py", "--smoke", "--groups", "vertical", "--json", out, "--workdir", tmp_path / "w",
               timeout=120)
    figures = json.loads(out.read_text())
    assert figures["vertical"] and not {"logic", "clients", "size"} & set(figures)
    assert figures["target"]["figure"] is None or figures["target"]["figure"] > 0


@pytest.mark.slow
def test_scaling(tmp_path):
    """scaling.py --smoke: one tiny run each of the vertical, logic, clients and activation-size groups (the
    last beside _peers.py's raw round trip), then its tables and plot again from the JSON."""
    out, png = tmp_path / "scaling.json", tmp_path / "scaling.png"
    result = run_script("scaling.py", "--smoke", "--json", out, "--plot", png, "--workdir", tmp_path / "w",
                        timeout=120)
    assert "0 failed measurement(s)" in result.stdout
    figures = json.loads(out.read_text())
    for group in ("vertical", "clients", "size"):
        assert figures[group] and all(row["steps_per_s"] > 0 for row in figures[group].values()), group
    assert figures["size"]["4"]["bound_steps_per_s"] > 0 and png.stat().st_size > 0
    assert figures["size"]["4"]["bare_step_s"] > 0                           # _bare_identity.py, the floor
    assert figures["logic"]["2"]["cpu_per_step_s"] > 0                        # the label owner's logic alone
    report = run_script("scaling.py", "--report", out, "--plot", tmp_path / "again.png")
    assert "| parties K |" in report.stdout and "| data owners N |" in report.stdout


@pytest.mark.slow
def test_soak(tmp_path):
    out = tmp_path / "soak.json"
    run_script("soak.py", "--steps", "200", "--interval-s", "0.05", "--deadline-s", "50",
               "--max-growth-pct", "1000", "--json", out, "--workdir", tmp_path / "w")
    result = json.loads(out.read_text())
    assert set(result["stages"]) == {"f", "g"}, result.keys()
    assert result["samples"]


@pytest.mark.slow       # a benchmark run: the slow set (CI's make test-slow)
def test_wan_link(tmp_path):
    """--self-test: a round trip and a bulk transfer through the emulated link, measured and reported (how near
    the model they come is a measurement, not asserted; tests/test_wan_link.py checks the link is never faster
    than its model; here, that the script runs and reports figures that hold on a busy machine too)."""
    out = tmp_path / "wan.json"
    run_script("wan_link.py", "--self-test", "--delay-ms", "2", "--rate-mbps", "80", "--bulk-kib", "256",
               "--json", out)
    figures = json.loads(out.read_text())
    assert figures["rtt_s_min"] >= 0.004 and 0 < figures["bulk_bps"] <= 80e6
    assert figures["stats"]["connections"] == 1


@pytest.mark.slow
def test_wan(tmp_path):
    """--smoke: two tiny configurations through an emulated 1 ms link, each with steps/s, bytes per step and
    a share of its bound; a codec row runs, or is skipped with its reason when distgrad-stage lacks the flag."""
    out = tmp_path / "wan.json"
    result = run_script("wan.py", "--smoke", "--json", out)
    rows = json.loads(out.read_text())["links"]["smoke"]["rows"]
    assert [row["label"] for row in rows] == ["lockstep", "1f1b M=2 N=1", "lockstep, int8"]
    for row in rows[:2]:
        r = row["result"]
        assert r["steps_per_s"] > 0 and r["bytes_down"] > 32 * 1024 and r["bytes_up"] > 32 * 1024
        assert 0 < r["share"] and r["bound_steps_per_s"] > 0
    assert "result" in rows[2] or rows[2]["skipped"].startswith("skipped: distgrad-stage has no --activation-codec")
    assert "0 failed run(s)" in result.stdout


# Full-size arrays a step of the identity split may allocate at once beyond what it held, per byte moved
# (the median over the steps: a frame whose release by ZeroMQ's threads is late shifts one step's figure):
# f makes its batch (the data source's array); g's new gradient replaces the one it sent. A received
# tensor copied into a new array, a mask of a tensor's size, or an output copied before it is sent adds 1
# (a mask of float32s 0.25).
COPIES_F_MAX, COPIES_G_MAX = 1.2, 0.2


def test_copies_per_step_stay_within_the_path_s_own_arrays(tmp_path):
    """benchmarks/copies.py at a 4 MiB activation: a count of bytes (tracemalloc), not a timing."""
    out = tmp_path / "copies.json"
    run_script("copies.py", "--sizes", str(4 << 20), "--steps", "8", "--json", out)
    (result,) = json.loads(out.read_text())["sizes"]
    assert result["f"]["steps_counted"] == result["g"]["steps_counted"] >= 5
    assert result["f"]["peak_per_byte"] <= COPIES_F_MAX, result
    assert result["g"]["peak_per_byte"] <= COPIES_G_MAX, result
    assert abs(result["f"]["kept_per_byte"]) < 0.01 and abs(result["g"]["kept_per_byte"]) < 0.01, result
    # Each side copies what it receives once (libzmq hands large frames out misaligned) and checks it once;
    # g also checks the gradient it sends back.
    for side, checked in (("f", 1.0), ("g", 2.0)):
        assert result[side]["copied_per_byte"] == 1.0, result
        assert result[side]["checked_per_byte"] == checked, result


@pytest.mark.slow       # a benchmark run: the slow set (CI's make test-slow)
@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_zero_copy_threshold(tmp_path, transport):
    out = tmp_path / "zc.json"
    run_script("zero_copy_threshold.py", "--transport", transport, "--rounds", "5", "--repeats", "1",
               "--sizes", "4096,65536", "--json", out)
    sizes = json.loads(out.read_text())["sizes"]
    assert set(sizes) == {"4096", "65536"}
    assert all(v["copy_us"] > 0 and v["zero_copy_us"] > 0 for v in sizes.values())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="torch is not installed: _torch_split.py (bench.py's gloo split) not run "
                           "(pip install 'distgrad[torch]')")
def test_torch_split(tmp_path):
    """Both ranks of _torch_split.py over gloo on 127.0.0.1, a few steps; rank 0 prints the timing."""
    port = free_tcp_port()
    env = dict(pinned_env(), GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               PYTHONPATH=str(BENCHMARKS))
    argv = [sys.executable, str(BENCHMARKS / "_torch_split.py")]
    g = subprocess.Popen([*argv, "1", str(port), "8", "16", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env, stdin=subprocess.DEVNULL)
    try:
        f = run_script("_torch_split.py", 0, port, 8, 16, 4, env=env)
        assert g.wait(SCRIPT_DEADLINE_S) == 0, g.stderr.read()
    finally:
        if g.poll() is None:
            g.kill()
            g.wait(10)
    line = json.loads(f.stdout.strip().splitlines()[-1])
    assert line["steps"] > 0 and line["elapsed_s"] > 0


@pytest.mark.slow
def test_attackers(tmp_path):
    """The independent attackers on a short traced, metered run print each figure beside the meter's."""
    trace, summary = tmp_path / "run.jsonl", tmp_path / "run.json"
    result = run_main(["run", "digits", "--steps", "20", "--privacy-meter", "--in-process", "--trace", trace,
                       "--trace-params", "sent_activation_grad,sent_activation", "--summary", summary])
    assert result.returncode == 0, result.stderr
    result = run_script("attackers.py", "digits", trace, "--summary", summary, "--seeds", "2")
    figures = json.loads(result.stdout.splitlines()[-1])
    assert set(figures["independent"]) == set(figures["meter"]) == {
        "averaged_recovery_1", "averaged_recovery_10", "model_completion", "ridge_r2_run"}


@pytest.mark.slow       # a benchmark run: the slow set (CI's make test-slow)
def test_privacy_meter_cost(tmp_path):
    out = tmp_path / "meter.json"
    run_script("privacy_meter_cost.py", "--steps", "60", "--repeats", "1", "--json", out)
    result = json.loads(out.read_text())
    for where in ("processes", "in_process"):
        assert result[f"{where}_plain_step_ms"] > 0 and result[f"{where}_metered_step_ms"] > 0
        assert f"{where}_overhead" in result


@pytest.mark.slow       # a benchmark run: the slow set (CI's make test-slow)
def test_label_dp_curve(tmp_path):
    """--smoke: plain randomized response (plain and corrected loss) and RR-with-prior at epsilon 2 on digits,
    the recommended digits-label-dp model and breast cancer, one seed, 60 steps; each has a held-out accuracy
    and the table prints."""
    out = tmp_path / "label_dp.json"
    result = run_script("label_dp.py", "--smoke", "--json", out)
    figures = json.loads(out.read_text())
    assert figures["smoke"] is True and set(figures["results"]) == {"digits", "digits-label-dp", "breast-cancer"}
    for task, rows in figures["results"].items():
        assert list(rows) == ["undefended", "plain RR, plain loss", "plain RR, corrected loss",
                              "RR-with-prior, 2 stages"], task
        for method, cells in list(rows.items())[1:]:
            assert list(cells) == ["2.0"] and 0 < cells["2.0"]["mean"] <= 1, (task, method)
    assert "| RR-with-prior, 2 stages |" in result.stdout


@pytest.mark.slow
def test_privacy_tradeoff(tmp_path):
    """--smoke: the undefended run and one label-owner clip_noise on each of the three tasks, one seed, metered;
    each row has held-out accuracy and the leak figures its task can score, and the table and targets print."""
    out, png = tmp_path / "privacy.json", tmp_path / "privacy.png"
    result = run_script("privacy.py", "--smoke", "--json", out, "--plot", png)
    figures = json.loads(out.read_text())
    assert figures["smoke"] is True and figures["seeds"] == 1
    assert set(figures["results"]) == {"digits", "digits-0-vs-rest", "breast-cancer"}
    for task, rows in figures["results"].items():
        assert list(rows) == ["undefended", "g clip_noise C=0.05 sigma=0.5"], task
        expected = {"label_recovery", "cosine_auc", "distance_correlation"}
        if task != "digits":
            expected |= {"norm_auc", "direction_auc"}
        for label, row in rows.items():
            assert 0 < row["test_accuracy"] <= 1 and expected <= set(row["figures"]), (task, label)
        assert rows["undefended"]["budget"] == "none"
        assert rows["g clip_noise C=0.05 sigma=0.5"]["budget"] != "none"
        # the defense takes the label owner's rows to near chance; undefended they give the labels away
        assert rows["undefended"]["figures"]["cosine_auc"] > 0.9
        assert rows["g clip_noise C=0.05 sigma=0.5"]["figures"]["cosine_auc"] < 0.7
    assert "| undefended |" in result.stdout and "Digits, anchor recovery" in result.stdout
    assert png.stat().st_size > 0


@pytest.mark.slow       # stage processes and several short runs: 30 s to 80 s on the two shared cores
@pytest.mark.timeout(BENCH_SMOKE_DEADLINE_S + 30)
def test_privacy_table(tmp_path):
    """--table --smoke: a row of each kind (a metered in-process run attacked on its trace, two classes,
    RR-with-prior, the data owner's defenses, the one-step runs and send_rows over stage processes, hijacking,
    held-out rows, model completion) measured at the tiny configuration; each has its figures and the table
    prints a line for each."""
    out = tmp_path / "table.json"
    rows = ["0", "3a", "5b", "6", "7", "8", "9", "10", "11"]
    result = run_script("privacy.py", "--table", "--smoke", "--rows", ",".join(rows), "--json", out,
                        timeout=BENCH_SMOKE_DEADLINE_S)
    figures = json.loads(out.read_text())
    assert figures["smoke"] is True and sorted(figures["rows"]) == sorted(rows)
    assert [batch["rows"] for batch in figures["batches"]] == [rows]       # when and where each row was measured
    for number in ("0", "3a", "5b", "9"):
        row = figures["rows"][number]
        assert 0 < row["test_accuracy"] <= 1
        assert {"averaged_recovery_1", "averaged_recovery_10", "model_completion", "ridge_r2_run"} <= set(
            row["independent"]), number
        assert {"averaged_recovery_1", "model_completion", "ridge_r2"} <= set(row["meters"]), number
    assert figures["rows"]["5b"]["epsilon"] == "label_dp 2 (exact)"
    assert 0 <= figures["rows"]["3a"]["independent"]["averaged_direction_auc_10"] <= 1      # two classes only
    two = figures["rows"]["6"]
    assert two["replies_equal"] is False and 0 <= two["label_equality_auc_now"] <= 1
    assert two["label_equality_auc_repeated_noise"] > 0.9        # noise that repeats cancels: equality shows
    sent = figures["rows"]["7"]
    assert sent["sigma"]["privacy"]["g"]["clip_noise"]["releases"] == sent["sigma"]["steps_answered"] == 3
    assert "privacy budget allows" in sent["target"]["refused"] and sent["target"]["steps_answered"] == 1
    assert set(figures["rows"]["10"]) >= {"guarded", "unguarded"}
    assert figures["rows"]["11"]["defended"]["r2"] < figures["rows"]["11"]["undefended"]["r2"]
    for number in rows:
        assert f"\n| {number} |" in result.stdout, number


@pytest.mark.slow       # a benchmark run: the slow set (CI's make test-slow)
@pytest.mark.parametrize("model", ["tiny", "mlp"])
def test_timeline(tmp_path, model):
    """benchmarks/timeline.py: every step splits into six intervals whose sum is the step (both processes read
    one monotonic clock)."""
    out = tmp_path / "timeline.json"
    run_script("timeline.py", "--model", model, "--steps", 80, "--json", out)
    result = json.loads(out.read_text())
    parts = ("f work", "f send", "down", "g work", "g send", "up")
    assert result["steps_counted"] >= 50 and result["raw_rt_s"] > 0, result
    median = result["median_s"]
    assert all(median[k] > 0 for k in ("f work", "g work", "step")), result
    assert abs(sum(median[k] for k in parts) - median["step"]) < 0.5 * median["step"], result
    # A thread's CPU time over an interval is at most its wall time (clock resolution aside).
    assert all(0 < median[f"{side} work CPU"] <= median[f"{side} work"] + 1e-3 for side in "fg"), result
