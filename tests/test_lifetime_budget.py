"""A label owner's privacy budget is spent over every run it serves, not per run.

Each run draws fresh noise, but a data owner that opens many runs against the same label owner (``--keep-serving``,
or a restart with the same stage file and checkpoint directory) gets every run's releases of a row, and they
compose. The label owner counts each row's releases over all its runs (``privacy.releases.Lifetime``: in memory,
and in ``DIR/.INSTANCE.lifetime.json``), refuses a release that would pass a target budget even when earlier runs
spent it, and reports the lifetime epsilon beside the run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.defended import budget_text
from distgrad.privacy.budget import NO_MEANINGFUL_GUARANTEE
from distgrad.config.parse import load_experiment
from distgrad.cut import Cut
from distgrad.errors import BudgetExhausted, ConfigError, NoiseReuseError, PeerRejected
from distgrad.privacy.releases import LABEL_RUNS_SUFFIX, LIFETIME_SUFFIX, Lifetime, NoiseLedger
from distgrad.run.options import StageOptions
from distgrad.run.stage_state import StageState
from distgrad.wire.wirecodec import GRADIENT

from conftest import wait_for_file
from test_defenses import _digits

pytest.importorskip("dp_accounting")

BOUNDS = dict(timeout_s=2.0, peer_deadline_s=30.0)
ROWS = np.arange(32)


# --- the ledger and the lifetime counts ----------------------------------------------------------------------

def test_the_limit_counts_the_releases_of_earlier_runs_and_says_how_to_reset():
    lifetime = Lifetime()
    first = NoiseLedger(secret=1, limit=2)
    first.on_count = lambda counts: lifetime.record("a", 1.0, counts)
    first.release(1, "s", "aa", ROWS)
    assert lifetime.runs["a"][1].tolist() == [1] * 32
    second = NoiseLedger(secret=2, limit=2)
    second.earlier, second.earlier_source = lifetime.earlier("b", 1.0), "DIR/.g.lifetime.json"
    second.release(1, "s", "bb", ROWS)
    assert second.worst == 1 and second.lifetime_worst == 2
    with pytest.raises(BudgetExhausted, match=r"spent by earlier runs.*DIR/\.g\.lifetime\.json.*delete"):
        second.release(2, "s", "cc", ROWS[:1])
    assert second.worst == 1                       # refused: not counted
    second.earlier_source = lifetime.source         # no checkpoint directory: kept in memory
    with pytest.raises(BudgetExhausted, match=r"spent by earlier runs.*restart the label owner.*knowingly"):
        second.release(2, "s", "cc", ROWS[:1])
    assert lifetime.earlier("a", 1.0).tolist() == []          # its own run is not earlier than itself


def test_releases_at_another_noise_count_as_their_renyi_cost_at_this_runs():
    """k releases at sigma s' compose as k (s / s')^2 releases at sigma s (a Gaussian's Renyi divergence is
    proportional to 1 / sigma^2): a run with half the noise spends four times the budget of a release."""
    lifetime = Lifetime()
    lifetime.record("a", 0.5, np.array([1, 0, 2]))
    lifetime.record("b", 1.0, np.array([1]))
    assert lifetime.earlier("c", 1.0).tolist() == [5.0, 0.0, 8.0]
    assert lifetime.earlier("a", 1.0).tolist() == [1.0]


def test_a_release_without_noise_in_an_earlier_run_leaves_no_lifetime_bound(tmp_path):
    """sigma 0 releases a row as it is: every later run's lifetime epsilon is infinite (and valid JSON)."""
    from distgrad.config.defended import _add_lifetime
    from distgrad.privacy.releases import UNBOUNDED_RELEASES
    lifetime = Lifetime()
    lifetime.record("a", 0.0, np.array([1, 0]))
    ledger = NoiseLedger(secret=1)
    ledger.earlier = lifetime.earlier("b", 1.0)
    assert ledger.earlier.tolist() == [float("inf"), 0.0]           # the row never released costs nothing
    assert ledger.lifetime_worst == UNBOUNDED_RELEASES
    entry = {"epsilon": 1.0, "sigma": 1.0, "delta": 1e-5}
    _add_lifetime(entry, ledger.lifetime_worst)
    assert entry["lifetime_epsilon"] == float("inf")
    assert "NO meaningful guarantee" in budget_text({"g": {"clip_noise": {**entry, "releases": 1}}})


def test_a_damaged_lifetime_file_is_refused_with_what_to_do(tmp_path):
    path = tmp_path / f".g{LIFETIME_SUFFIX}"
    for damaged in ("{not json", '{"runs": {"a": {"sigma": 1.0}}}', '{"runs": {"a": {"sigma": 1.0, "counts": [-1]}}}'):
        path.write_text(damaged)
        with pytest.raises(ConfigError, match="delete it knowingly"):
            Lifetime(path)


# --- a stage's lifetime across processes, kill -9 and resume --------------------------------------------------

def _state(exp, ckpt: Path, resume: bool = False) -> StageState:
    return StageState(StageOptions(exp, "g", exp.seed, steps=4, checkpoint_dir=ckpt, checkpoint_every=1,
                                   resume=resume))


def test_the_lifetime_file_outlives_the_process_and_a_resume_does_not_count_twice(tmp_path):
    """Run a releases rows 0-31 at step 1 (checkpointed) and at step 2 (not: the process is killed -9 before its
    checkpoint); the file already counts both. A new process resumes run a from step 1: the run's rows count 2,
    not 3 or 4. A later run b counts run a's releases as earlier ones, in a new process too."""
    exp = load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 1.0 }"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first = _state(exp, ckpt)
    assert first.ledger is not None
    first.begin("run-a")
    first.ledger.release(1, "grad", "d1", ROWS)
    first.save(1)
    first.ledger.release(2, "grad", "d2", ROWS)          # sent; the process dies before checkpointing step 2
    saved = json.loads((ckpt / f".g{LIFETIME_SUFFIX}").read_text())
    assert saved["runs"]["run-a"]["counts"][:32] == [2] * 32 and saved["runs"]["run-a"]["sigma"] == 1.0
    del first

    resumed = _state(exp, ckpt, resume=True)
    assert resumed.resume_latest() and resumed.run_id == "run-a" and resumed.resumed_step == 1
    assert resumed.ledger.worst == 2 and resumed.ledger.lifetime_worst == 2
    resumed.ledger.release(2, "grad", "d2", ROWS)        # step 2 again on the same values: nothing new
    assert resumed.ledger.worst == 2
    resumed.begin("run-b")
    resumed.ledger.release(1, "grad", "d3", ROWS[:8])
    assert resumed.ledger.worst == 1 and resumed.ledger.lifetime_worst == 3
    privacy = resumed.summary("finished", 0.0, None)["privacy"]["g"]["clip_noise"]
    assert privacy["releases"] == 1 and privacy["lifetime_releases"] == 3
    assert privacy["lifetime_epsilon"] > privacy["epsilon"]
    assert "over 3 releases of the worst row in every run" in budget_text({"g": {"clip_noise": privacy}})

    restarted = _state(exp, ckpt)                        # a new process: run c starts from both runs' counts
    restarted.begin("run-c")
    assert restarted.ledger.lifetime_worst == 3 and restarted.ledger.worst == 0


def test_the_in_process_reference_is_its_one_run(tmp_path):
    """Without other runs the summary has no lifetime fields: the run is the lifetime."""
    exp = load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 1.0 }"))
    state = StageState(StageOptions(exp, "g", exp.seed, steps=4))
    state.begin("only")
    state.ledger.release(1, "grad", "d1", ROWS)
    clip = state.summary("finished", 0.0, None)["privacy"]["g"]["clip_noise"]
    assert clip["releases"] == 1 and "lifetime_releases" not in clip


# --- over processes: a keep-serving label owner ---------------------------------------------------------------

def _parties(tmp_path: Path, g_extra: str, steps: int) -> tuple[Path, Path]:
    from test_budget import _rows_parties
    return _rows_parties(tmp_path, g_extra, steps)


@pytest.mark.integration
def test_a_keep_serving_label_owner_counts_every_run_and_refuses_the_run_past_the_budget(tmp_path, start_server):
    """A target epsilon planned for 2 epochs allows each row 2 releases. Two one-step runs on the same rows: the
    second's summary says 1 release in the run, 2 over the label owner's runs; the third is refused, naming
    the earlier runs and the file to delete."""
    f_file, g_file = _parties(tmp_path, "clip_noise = { max_norm = 0.05, epsilon = 8.0 }", 50)    # 2 epochs
    summary = tmp_path / "g.json"
    g, endpoint = start_server(str(g_file), "--keep-serving", "--summary", summary,
                               "--checkpoint-dir", tmp_path / "ckpt")
    h = np.zeros((32, 64), np.float32)
    for run in range(2):
        with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
            cut.step(h, cut.rows(1))
        text = wait_for_file(summary, g)          # the run's summary, written when the label owner ends it
        summary.unlink()
    clip = json.loads(text)["privacy"]["g"]["clip_noise"]
    assert clip["planned_releases"] == 2 and clip["releases"] == 1 and clip["lifetime_releases"] == 2
    assert clip["lifetime_epsilon"] <= 8.0 and clip["epsilon"] < clip["lifetime_epsilon"]
    with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
        with pytest.raises(PeerRejected, match=r"spent by earlier runs.*\.g\.lifetime\.json"):
            cut.step(h, cut.rows(1))
        cut.closed = True
        cut.link.close(linger_ms=0)
    assert g.proc.poll() is None


def test_rr_with_prior_alone_keeps_its_releases_digests_but_no_lifetime_count(tmp_path):
    """A label owner with label_dp in stages and no noise records what each step sent (a step computed again
    on other activations is refused) but counts no noised release across runs: a later run of the same
    label owner with clip_noise is not charged for gradients that carried no Gaussian noise of its own."""
    exp = load_experiment(_digits(tmp_path, "", "label_dp = { epsilon = 2.0, stages = 2 }"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    state = _state(exp, ckpt)
    assert state.ledger is not None and state.lifetime is None
    state.begin("run-a")
    state.ledger.release(1, "grad", "d1", ROWS)
    with pytest.raises(NoiseReuseError, match="computed again on other input"):
        state.ledger.release(1, "grad", "d2", ROWS)
    assert (ckpt / ".g.released").exists() and not (ckpt / f".g{LIFETIME_SUFFIX}").exists()


# --- label_dp: each run is another randomized response of every label ------------------------------------------

def _send_gradient(state: StageState, step: int) -> None:
    """The label owner sends step ``step``'s gradient rows (what its randomized labels reach the data owner by)."""
    state.senders.roundtrip(GRADIENT, np.ones((32, 64), np.float32), "g/mb0of1", step)


def test_every_run_that_released_randomized_labels_adds_its_epsilon_and_a_resume_does_not_count_twice(tmp_path):
    """Each run draws its own randomized response of every label (a fresh secret), so k runs against one label owner
    release each label k times: label_dp's epsilon e becomes k*e. The label owner counts the runs that sent a gradient
    (in its checkpoint directory, across processes), reports ``lifetime_releases``/``lifetime_epsilon`` and says
    "NO meaningful guarantee" once that reaches 10. A resumed run is the same run; a run that sent nothing is none."""
    exp = load_experiment(_digits(tmp_path, "", "label_dp = { epsilon = 4.0 }"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    first = _state(exp, ckpt)
    first.begin("run-a")
    _send_gradient(first, 1)
    label_dp = first.summary("finished", 0.0, None)["privacy"]["g"]["label_dp"]
    assert label_dp == {"epsilon": 4.0}                   # its one run is its lifetime
    first.save(1)
    first.begin("run-b")
    assert first.summary("finished", 0.0, None)["privacy"]["g"]["label_dp"]["lifetime_releases"] == 1  # sent nothing
    _send_gradient(first, 1)
    first.save(1)
    label_dp = first.summary("finished", 0.0, None)["privacy"]["g"]["label_dp"]
    assert label_dp["lifetime_releases"] == 2 and label_dp["lifetime_epsilon"] == 8.0 and "guarantee" not in label_dp
    assert "label-DP epsilon 8 over the 2 runs" in budget_text({"g": {"label_dp": label_dp}})
    del first

    resumed = _state(exp, ckpt, resume=True)              # a new process resumes run b: still two runs
    assert resumed.resume_latest() and resumed.run_id == "run-b"
    _send_gradient(resumed, 2)
    assert resumed.summary("finished", 0.0, None)["privacy"]["g"]["label_dp"]["lifetime_releases"] == 2
    resumed.begin("run-c")
    _send_gradient(resumed, 1)
    label_dp = resumed.summary("finished", 0.0, None)["privacy"]["g"]["label_dp"]
    assert label_dp["lifetime_releases"] == 3 and label_dp["lifetime_epsilon"] == 12.0
    assert label_dp["guarantee"] == NO_MEANINGFUL_GUARANTEE
    assert "NO meaningful guarantee" in budget_text({"g": {"label_dp": label_dp}})

    (ckpt / f".g{LABEL_RUNS_SUFFIX}").write_text("{not json")
    with pytest.raises(ConfigError, match=r"label_dp_runs\.json.*cannot be read.*delete it knowingly"):
        _state(exp, ckpt)


def test_the_in_process_reference_counts_its_one_run_of_randomized_labels(tmp_path):
    """Without a checkpoint directory the runs are counted in the process's memory; one run has no lifetime."""
    exp = load_experiment(_digits(tmp_path, "", "label_dp = { epsilon = 2.0, stages = 2 }"))
    state = StageState(StageOptions(exp, "g", exp.seed, steps=4))
    state.begin("only")
    _send_gradient(state, 1)
    assert state.summary("finished", 0.0, None)["privacy"]["g"]["label_dp"] == {"epsilon": 2.0, "stages": 2}
    state.begin("second")
    _send_gradient(state, 1)
    assert state.summary("finished", 0.0, None)["privacy"]["g"]["label_dp"]["lifetime_epsilon"] == 4.0


def test_a_new_run_under_the_id_of_an_earlier_one_counts_that_run_as_earlier_at_its_own_noise(tmp_path):
    """A data owner names its run: one that opens a new run under the id of a run the label owner served before
    (after a restart with other settings, another sigma) must not take over that run's entry, which would count its
    releases at the new sigma (and, for label_dp, not count the new run's fresh labels at all). The earlier run
    stays an earlier run, at its own sigma; the new one starts from no release."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    loud = load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 0.5 }\n"
                                                 "label_dp = { epsilon = 1.0 }"))
    first = _state(loud, ckpt)
    first.begin("same-id")
    _send_gradient(first, 1)                    # releases the rows of step 1's batch once, with noise 0.5
    del first
    quiet = load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 1.0 }\n"
                                                  "label_dp = { epsilon = 1.0 }", name="quiet.toml"))
    second = _state(quiet, ckpt)                # the label owner restarted with four times less noise per release
    second.begin("same-id")
    assert second.ledger.worst == 0 and second.ledger.lifetime_worst == 4     # 1 release at 0.5 = 4 at 1.0
    _send_gradient(second, 1)
    privacy = second.summary("finished", 0.0, None)["privacy"]["g"]
    assert privacy["clip_noise"]["releases"] == 1 and privacy["clip_noise"]["lifetime_releases"] == 5
    assert privacy["label_dp"]["lifetime_releases"] == 2 and privacy["label_dp"]["lifetime_epsilon"] == 2.0
    saved = json.loads((ckpt / f".g{LIFETIME_SUFFIX}").read_text())["runs"]
    assert saved["same-id/earlier-1"]["sigma"] == 0.5 and saved["same-id"]["sigma"] == 1.0
