"""The label owner's clip_noise budget counts every release of every row, and its target form holds.

Each row's releases are counted as they happen (every step it is in, whoever chose the rows), the worst
row's composition is the run's epsilon, the target form ``clip_noise = { max_norm = C, epsilon = E }``
chooses sigma for the run's planned releases and stops the run before a row would pass it, and an epsilon
of 10 or more is printed as no meaningful guarantee.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.defended import budget_text, privacy_budget
from distgrad.config.parse import load_experiment
from distgrad.cut import Cut
from distgrad.errors import ConfigError, PeerRejected
from distgrad.privacy.budget import gaussian_label_dp, sigma_for_target
from distgrad.privacy.defenses import parse_defenses
from distgrad.run.inprocess import train_in_process
from distgrad.stage.checkpoint import steps_on_disk

from conftest import read_json, run_main
from test_defenses import _digits, _equal_over_processes

pytest.importorskip("dp_accounting")

TARGET = "clip_noise = { max_norm = 0.05, epsilon = 8.0 }"
BOUNDS = dict(timeout_s=2.0, peer_deadline_s=30.0)


def _rows_parties(tmp_path: Path, g_extra: str, steps: int = 4) -> tuple[Path, Path]:
    """The digits experiment of ``steps`` steps with send_rows and the label owner's ``g_extra``, split: the
    data owner's stage file for its own loop (``Cut``), the label owner's."""
    path = _digits(tmp_path, "", g_extra)
    path.write_text(path.read_text().replace("steps = 800\n", f"steps = {steps}\nsend_rows = true\n", 1))
    assert run_main(["split", path, tmp_path / "parts"]).returncode == 0
    f_file = tmp_path / "parts" / "f" / "f.toml"
    head, rest = f_file.read_text().split("[stage]\n")
    own_loop = f_file.with_name("f-lib.toml")
    # The loop reads its own features (the cut library refuses feature_scale, which it could not apply).
    data = re.sub(r"\nfeature_scale = [^\n]*", "", rest.split("[data]", 1)[1])
    own_loop.write_text(head + '[stage]\nname = "f"\n\n[data]' + data)
    return own_loop, tmp_path / "parts" / "g" / "g.toml"


def _privacy_benchmark():
    """benchmarks/privacy.py as a module (its attack helpers)."""
    import importlib.util
    import sys
    name = "privacy_benchmark"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "benchmarks"
                                                      / "privacy.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module          # its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


def _with_row(rows: np.ndarray, row: int) -> np.ndarray:
    """``rows`` with ``row`` first (a determined data owner puts one row in every step)."""
    others = [r for r in rows.tolist() if r != row]
    return np.array([row, *others[:len(rows) - 1]], np.int64)


# --- the math ---------------------------------------------------------------------------------------------

def test_the_target_form_chooses_the_least_sigma_that_meets_it():
    for epsilon, releases in ((8.0, 30), (1.0, 5), (3.0, 1)):
        sigma = sigma_for_target(epsilon, releases, 1e-5)
        assert epsilon - 0.01 <= gaussian_label_dp(sigma, releases, 1e-5) <= epsilon
        assert gaussian_label_dp(sigma * 0.99, releases, 1e-5) > epsilon - 0.01
    assert sigma_for_target(8.0, 60, 1e-5) > sigma_for_target(8.0, 30, 1e-5)


def test_the_target_form_is_parsed_and_its_mistakes_are_refused():
    clip = parse_defenses({"clip_noise": {"max_norm": 0.05, "epsilon": 8, "delta": 1e-6}}, "g").clip_noise
    assert clip is not None and (clip.sigma, clip.epsilon, clip.delta) == (None, 8.0, 1e-6)
    assert parse_defenses({"clip_noise": {"max_norm": 0.05, "epsilon": 8}}, "g").as_table() == \
        {"clip_noise": {"max_norm": 0.05, "epsilon": 8.0}}
    for bad, message in (({"max_norm": 1.0, "sigma": 1.0, "epsilon": 2.0}, "target form"),
                         ({"max_norm": 1.0}, "target form"), ({"max_norm": 1.0, "epsilon": 0}, "epsilon must be")):
        with pytest.raises(ConfigError, match=message):
            parse_defenses({"clip_noise": bad}, "g")


def test_an_epsilon_of_10_or_more_is_printed_as_no_meaningful_guarantee(tmp_path):
    loose = privacy_budget(load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 0.5 }",
                                                   "loose.toml")), ["g"], 880, 0)["privacy"]
    assert loose["g"]["clip_noise"]["epsilon"] >= 10
    assert "NO meaningful guarantee" in budget_text(loose) and "no meaningful" in loose["g"]["clip_noise"]["guarantee"]
    tight = privacy_budget(load_experiment(_digits(tmp_path, "", TARGET, "tight.toml")), ["g"], 880, 0)["privacy"]
    assert tight["g"]["clip_noise"]["epsilon"] <= 8 and "meaningful" not in budget_text(tight)
    assert "on the cut gradients only" in budget_text(tight)


def test_a_label_dp_or_lifetime_epsilon_of_10_or_more_is_no_meaningful_guarantee_in_the_summary_too(tmp_path):
    """The summary's JSON says what the printed line says: a label_dp epsilon of 10 or more, and a row's
    epsilon over every run the label owner served (``lifetime_epsilon``) of 10 or more, bound nothing."""
    loose = privacy_budget(load_experiment(_digits(tmp_path, "", "label_dp = { epsilon = 12 }", "rr.toml")),
                           ["g"], 10, 0)["privacy"]
    assert "no meaningful" in loose["g"]["label_dp"]["guarantee"] and "NO meaningful" in budget_text(loose)
    tight = privacy_budget(load_experiment(_digits(tmp_path, "", "label_dp = { epsilon = 2 }", "rr2.toml")),
                           ["g"], 10, 0)["privacy"]
    assert "guarantee" not in tight["g"]["label_dp"]
    exp = load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 8 }", "life.toml"))
    one_run = privacy_budget(exp, ["g"], 44, 0, released={"g": 1}, lifetime={"g": 2})["privacy"]["g"]["clip_noise"]
    assert one_run["lifetime_epsilon"] < 10 and "no meaningful" not in one_run["guarantee"]
    many = privacy_budget(exp, ["g"], 44, 0, released={"g": 1}, lifetime={"g": 400})["privacy"]
    clip = many["g"]["clip_noise"]
    assert clip["epsilon"] < 10 <= clip["lifetime_epsilon"]
    assert "no meaningful" in clip["guarantee"] and "NO meaningful" in budget_text(many)


# --- runs -------------------------------------------------------------------------------------------------

def test_the_target_form_in_process_reports_the_planned_budget_and_the_worst_rows_releases(tmp_path):
    """Two epochs (88 steps of 44 batches): every row is released twice, the sigma chosen for 2 releases
    gives an epsilon at most the target."""
    summary = train_in_process(load_experiment(_digits(tmp_path, "", TARGET)), steps=88)
    clip = summary["privacy"]["g"]["clip_noise"]
    assert clip["planned_releases"] == clip["releases"] == 2 and clip["target_epsilon"] == 8.0
    assert 7.99 - 0.01 <= clip["epsilon"] <= 8.0 and clip["sigma"] == sigma_for_target(8.0, 2, 1e-5)
    assert "on the cut gradients only" in clip["scope"] == clip["guarantee"]


def _ramp(tmp_path: Path, g_extra: str) -> Path:
    """The seed's two-stage ramp (data without numbered rows: one example a step) with the label owner's
    ``g_extra``."""
    from test_defenses import _defended
    return _defended(tmp_path, "seed-reverse", {1: g_extra}, "ramp.toml")


def test_data_without_numbered_rows_counts_every_release_and_never_prints_epsilon_0(tmp_path):
    """The ramp numbers no rows. Each step still sends a noised gradient: the budget counts each as one more
    release of one example (what its plan assumes), so 5 steps compose 5 releases, never "epsilon 0 over 0
    releases" (a guarantee nothing was released). The target form chooses sigma for those 5 and refuses a
    6th release, in a stage process's state as in process."""
    summary = train_in_process(load_experiment(_ramp(tmp_path, "clip_noise = { max_norm = 1.0, sigma = 1.0 }")),
                               steps=5)
    clip = summary["privacy"]["g"]["clip_noise"]
    assert clip["releases"] == 5 and clip["epsilon"] == gaussian_label_dp(1.0, 5, 1e-5) > 10
    assert "NO meaningful guarantee" in budget_text(summary["privacy"])
    target = load_experiment(_ramp(tmp_path, "clip_noise = { max_norm = 1.0, epsilon = 8.0 }"))
    clip = train_in_process(target, steps=5)["privacy"]["g"]["clip_noise"]
    assert clip["releases"] == clip["planned_releases"] == 5 and 7.98 <= clip["epsilon"] <= 8.0
    from distgrad.errors import BudgetExhausted
    from distgrad.run.options import StageOptions
    from distgrad.run.stage_state import StageState
    from distgrad.wire.wirecodec import GRADIENT
    state = StageState(StageOptions(target, "g", target.seed, steps=5))
    state.begin("ramp")
    for step in range(1, 6):
        state.senders.roundtrip(GRADIENT, np.full((1,), step, np.float32), "g/mb0of1", step)
    with pytest.raises(BudgetExhausted, match=r"step 6: row 0 would be released 6 times, more than the 5"):
        state.senders.roundtrip(GRADIENT, np.full((1,), 6, np.float32), "g/mb0of1", 6)
    assert state.ledger.worst == 5


def test_every_party_a_label_owner_answers_releases_each_row_again(tmp_path):
    """Vertical parties: the label owner sends each party the gradient of its own embedding, each a release
    of the row's label."""
    from test_defenses import _defended
    path = _defended(tmp_path, "vertical-classify", {3: "clip_noise = { max_norm = 0.1, sigma = 2.0 }"}, "v.toml")
    exp = load_experiment(path)
    summary = train_in_process(exp, steps=1)
    assert summary["privacy"]["g"]["clip_noise"]["releases"] == len(exp.data_owners)


def test_each_clients_rows_are_released_once_per_epoch_of_its_own_shard(tmp_path):
    """[clients]: the label owner answers each client on that client's own rows, so a row is released once per
    epoch its client's steps reach (not once per client); the target form plans exactly that."""
    from test_defenses import _defended
    path = _defended(tmp_path, "digits-clients", {1: "clip_noise = { max_norm = 0.1, epsilon = 8 }"}, "c.toml")
    exp = load_experiment(path)
    epochs = [exp.build_data(0, client=c, stage="g").batches_per_epoch for c in range(exp.clients.count)]
    steps = min(epochs) + 1                 # the shortest shard's clients start their second epoch
    clip = train_in_process(exp, steps=steps)["privacy"]["g"]["clip_noise"]
    assert clip["releases"] == clip["planned_releases"] == 2


@pytest.mark.integration
def test_a_row_the_data_owner_puts_in_every_step_is_counted_every_time(tmp_path, start_server):
    """send_rows: the data owner chooses each step's rows; one row in all 4 steps is released 4 times, and the
    label owner's summary says so (not once per epoch)."""
    f_file, g_file = _rows_parties(tmp_path, "clip_noise = { max_norm = 0.05, sigma = 1.0 }")
    g, endpoint = start_server(str(g_file), "--summary", tmp_path / "g.json")
    with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
        row = int(cut.rows(1)[0])
        for step in range(1, 5):
            cut.step(np.zeros((32, 64), np.float32), _with_row(cut.rows(step), row))
    assert g.wait(20) == 0, g.output
    clip = read_json(tmp_path / "g.json")["privacy"]["g"]["clip_noise"]
    assert clip["releases"] == 4
    assert clip["epsilon"] == gaussian_label_dp(1.0, 4, 1e-5)


@pytest.mark.integration
def test_the_target_form_stops_before_a_row_would_pass_its_budget_and_keeps_the_checkpoints(tmp_path,
                                                                                           start_server):
    """4 steps plan one release per row; a data owner sending a row a second time is refused (the label
    owner keeps serving, its checkpoints stay those of the steps it answered)."""
    f_file, g_file = _rows_parties(tmp_path, TARGET)
    ckpt = tmp_path / "ckpt"
    g, endpoint = start_server(str(g_file), "--checkpoint-dir", ckpt, "--checkpoint-every", "1")
    with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
        row = int(cut.rows(1)[0])
        cut.step(np.zeros((32, 64), np.float32), cut.rows(1))
        with pytest.raises(PeerRejected, match="privacy budget allows"):
            cut.step(np.zeros((32, 64), np.float32), _with_row(cut.rows(2), row))
        cut.closed = True
        cut.link.close(linger_ms=0)
    assert g.proc.poll() is None
    assert max(steps_on_disk(ckpt, "g")) == 1
    assert not math.isnan(sigma_for_target(8.0, 1, 1e-5))


@pytest.mark.slow       # 30 epochs of digits with a trace of every received gradient: about 20 s
@pytest.mark.usefixtures("fixed_noise_secret")
def test_the_budget_chosen_setting_holds_against_the_per_row_averaging_attack():
    """digits, 30 epochs, the label owner's clip_noise = { max_norm = 0.05, epsilon = 8 }: the printed epsilon
    is at most 8, held-out accuracy at least 0.90, and a data owner averaging each row's received gradients
    over the run, then clustering them from 1 or 10 known rows per class, recovers at most 0.20 of the labels
    (the documented sigma 0.5 lets it recover over 0.38: benchmarks/privacy.py)."""
    bench = _privacy_benchmark()
    result = bench.averaging_run({"max_norm": 0.05, "epsilon": 8.0}, epochs=30)
    assert result["privacy"]["epsilon"] <= 8.0 and result["privacy"]["releases"] == 30
    assert result["test_accuracy"] >= 0.90
    recoveries = {k: v for k, v in result.items() if k.startswith("recovery")}
    assert len(recoveries) == 4 and max(recoveries.values()) <= 0.20, recoveries


@pytest.mark.slow       # 3 x 30 epochs with a trace; the target form's sigma and counts: the in-process test above
@pytest.mark.timeout(600)       # each run traces 1,320 steps of 32 x 256 gradients: a minute or two on busy cores
@pytest.mark.usefixtures("fixed_noise_secret")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_recommended_experiment_meets_the_budget_target_on_every_split_seed(seed):
    """The built-in digits-budget (docs/privacy.md, "Recommended settings: chosen by a budget"): on split seeds
    0, 1 and 2 the printed epsilon is at most 8 over its 30 releases per row, held-out accuracy is at least
    0.90, and the per-row averaging attack recovers at most 0.20 of the labels from 1 or 10 known rows a class."""
    bench = _privacy_benchmark()
    result = bench.averaging_run(None, epochs=30, seed=seed, experiment="digits-budget")
    assert result["privacy"]["epsilon"] <= 8.0 and result["privacy"]["releases"] == 30
    assert result["privacy"]["target_epsilon"] == 8.0 and result["privacy"]["planned_releases"] == 30
    assert result["test_accuracy"] >= 0.90, result["test_accuracy"]
    recoveries = {k: v for k, v in result.items() if k.startswith("recovery")}
    assert len(recoveries) == 4 and max(recoveries.values()) <= 0.20, recoveries


def test_the_averaging_attack_recovers_labels_from_noiseless_gradients_and_not_from_noise():
    """The attack itself: rows whose gradients point one way per class (plus noise that averages out over
    the epochs) are recovered; pure noise gives chance."""
    bench = _privacy_benchmark()
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, 320)
    directions = rng.standard_normal((10, 16))
    steps = np.stack([rng.permutation(320).reshape(10, 32) for _ in range(20)]).reshape(200, 32)
    signal = directions[labels[steps]]
    noisy = signal + 2.0 * rng.standard_normal(signal.shape)
    assert bench.averaging_attack(steps, noisy, labels, 1) > 0.9
    assert bench.averaging_attack(steps, noisy, labels, 1, weighted=True) > 0.9
    assert bench.averaging_attack(steps, rng.standard_normal(signal.shape), labels, 10) < 0.25


# --- the label owner's own update by DP-SGD ---------------------------------------------------------------

DP_SGD = "clip_noise = { max_norm = 0.05, sigma = 1.0 }\ndp_sgd = { max_norm = 1.0 }"


def test_dp_sgd_without_noise_or_clipping_is_the_exact_batch_gradient_and_clips_each_example():
    """The per-example gradients sum to the batch gradient (the oracle: the stage's own backward); with a
    bound no example reaches and sigma 0, DP-SGD's gradient is it; with a small bound each example's own
    gradient is scaled to it."""
    from distgrad.privacy.defenses import dp_sgd_gradients
    from distgrad.stage.stage import Stage
    exp = load_experiment("digits")
    stage = Stage.from_experiment(exp, "g", 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    target = rng.integers(0, 10, 8)
    y, cache = stage.forward(x)
    _, dy = stage.loss_backward(y, target)
    exact = stage.backward(cache, dy, need_dx=False)[1]
    per_example = stage.per_example_grads(x, dy, 0)
    for name, value in exact.items():
        np.testing.assert_allclose(sum(g[name] for g in per_example), value, rtol=1e-5, atol=1e-7)
    private = dp_sgd_gradients(per_example, 1e9, 0.0, 8.0, np.random.default_rng(1))
    for name, value in exact.items():
        np.testing.assert_allclose(private[name], value, rtol=1e-5, atol=1e-7)
    clipped = dp_sgd_gradients(per_example[:1], 1e-3, 0.0, 8.0, np.random.default_rng(1))
    norm = math.sqrt(sum(float(np.sum(np.square(g.astype(np.float64) * 8.0))) for g in clipped.values()))
    assert norm == pytest.approx(1e-3, rel=1e-4)


def test_dp_sgd_counts_the_update_in_the_budget_and_says_the_guarantee_is_end_to_end(tmp_path):
    plain = train_in_process(load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 1.0 }",
                                                     "plain.toml")), steps=10, noise_secret=3)
    private = train_in_process(load_experiment(_digits(tmp_path, "", DP_SGD)), steps=10, noise_secret=3)
    assert private["params"]["g"] != plain["params"]["g"]
    clip = private["privacy"]["g"]["clip_noise"]
    assert clip["releases"] == 2 and clip["scope"].startswith("end to end")
    assert plain["privacy"]["g"]["clip_noise"]["scope"].startswith("per release, on the cut gradients only")
    target = train_in_process(load_experiment(_digits(
        tmp_path, "", "clip_noise = { max_norm = 0.05, epsilon = 8.0 }\ndp_sgd = { max_norm = 1.0 }", "t.toml")),
        steps=88, noise_secret=3)["privacy"]["g"]["clip_noise"]
    assert target["planned_releases"] == target["releases"] == 4 and target["epsilon"] <= 8.0


def test_split_writes_dp_sgd_into_the_label_owners_own_file(tmp_path):
    from distgrad.config.split import split_experiment
    combined = load_experiment(_digits(tmp_path, "", DP_SGD))
    split_experiment(combined, tmp_path / "parties")
    g_file = tmp_path / "parties" / "g" / "g.toml"
    assert "dp_sgd" in g_file.read_text() and "dp_sgd" not in (tmp_path / "parties" / "f" / "f.toml").read_text()
    parts = load_experiment([tmp_path / "parties" / "f" / "f.toml", g_file])
    assert parts.spec("g").defenses == combined.spec("g").defenses


@pytest.mark.parametrize("g_extra, message", [
    ("dp_sgd = { max_norm = 1.0 }", "give the stage clip_noise too"),
    ("dp_sgd = { max_norm = 0 }", "'dp_sgd' max_norm must be a number > 0")])
def test_dp_sgd_settings_it_cannot_honour_are_refused_naming_the_reason(tmp_path, g_extra, message):
    with pytest.raises(ConfigError, match=message):
        load_experiment(_digits(tmp_path, "", g_extra))


@pytest.mark.integration
@pytest.mark.usefixtures("fixed_noise_secret")
def test_dp_sgd_over_processes_is_bitwise_the_in_process_run(tmp_path):
    """Bitwise the in-process run, and end to end: the data owner receives no training loss (its metrics hold
    null at every step, the summary says it was withheld, as the in-process reference's does), while the label
    owner's own metrics and the merged trace keep its loss."""
    metrics = tmp_path / "metrics.jsonl"
    summary = _equal_over_processes(tmp_path, _digits(tmp_path, "", DP_SGD), "--micro-batches", "2",
                                    processes=("--metrics", metrics, "--trace", tmp_path / "trace.jsonl",
                                               "--trace-params", "g1.b"))
    assert summary["privacy"]["g"]["clip_noise"]["scope"].startswith("end to end")
    assert "withheld by the label owner" in summary["privacy"]["g"]["clip_noise"]["scope"]
    for run in (summary, read_json(tmp_path / "ref.json")):
        assert run["final_loss"] is None and run["training_loss"] == "withheld by the label owner", run
    f_lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    g_lines = [json.loads(line) for line in metrics.with_name("metrics.g.jsonl").read_text().splitlines()]
    assert [line["step"] for line in f_lines] == list(range(1, 21)) and all(line["loss"] is None for line in f_lines)
    assert len(g_lines) == 20 and all(isinstance(line["loss"], float) for line in g_lines)
    trace = [json.loads(line) for line in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert [line["loss"] for line in trace] == [line["loss"] for line in g_lines]     # the label owner's own


def _served_replies(exp, micro_batches: int = 1, staleness: int = 0) -> tuple[list, object]:
    """The label owner of ``exp`` as its daemon serves it (its serving stage, in this process) answering step 1
    of each data owner (the first stage, or every feature party) in ``micro_batches`` micro-batches: each
    backward reply as its data owner decodes it from the wire, and the serving stage."""
    from distgrad.run.handshake import hello
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage
    from distgrad.stage.stage import Stage, micro_batch
    from distgrad.wire import messages as wire
    server = ServingStage(StageOptions(exp, exp.stage_names[-1], exp.seed, steps=4))
    owners = exp.data_owners
    for name in owners:
        said = hello(exp, name, exp.seed, exp.cuts[exp.stage_index(name)], f"run-{name}", [0], 4, micro_batches,
                     staleness=staleness)
        assert [m.type for _, m in server.handle([name.encode()], said, 0.0)] == [wire.WELCOME]
    replies = []
    for mb in range(micro_batches):
        for name in owners:
            x = Stage.from_experiment(exp, name).forward(exp.build_data(stage=name).features(1))[0]
            forward = wire.Message(wire.FORWARD, f"run-{name}", 1, mb, micro_batches,
                                   tensors={"activation": micro_batch(x, mb, micro_batches)})
            answered = server.handle([name.encode()], forward, 0.0) + server.settle()
            replies += [wire.decode(wire.encode(reply)) for _, reply in answered if reply.type == wire.BACKWARD]
    assert len(replies) == micro_batches * len(owners) and server.stage.step == 1
    return replies, server


@pytest.mark.parametrize("builtin, label_owner, micro_batches, staleness", [
    ("digits", 1, 1, 0), ("digits", 1, 2, 1), ("digits-halves", 2, 2, 0)])
def test_with_dp_sgd_the_label_owners_replies_carry_no_training_loss_on_every_serving_path(
        tmp_path, builtin, label_owner, micro_batches, staleness):
    """The daemon's replies to a data owner (one driver, micro-batches, steps in flight) and to every feature
    party of a vertical run: with dp_sgd and clip_noise none carries the loss (computed from the true labels,
    no mechanism covers it), on the wire too, so the data owner reads None; the label owner keeps its own
    loss. Without dp_sgd the same replies carry it in the binary header."""
    from distgrad.stage.stage import Stage, backward_specs
    from distgrad.wire.link import check_reply
    from test_defenses import _defended
    private = load_experiment(_defended(tmp_path, builtin, {label_owner: DP_SGD}, "private.toml"))
    replies, server = _served_replies(private, micro_batches, staleness)
    assert all("loss" not in reply.body and reply.body["loss_withheld"] is True and reply.body["compute_s"] >= 0
               for reply in replies)
    first = Stage.from_experiment(private, private.data_owners[0])
    loss, dy = check_reply(replies[0], 1, backward_specs(first, micro_batches), False, "g")
    assert loss is None and np.isfinite(dy).all()
    assert isinstance(server.loss, float) and math.isfinite(server.loss)      # the label owner's own
    plain = load_experiment(_defended(tmp_path, builtin, {label_owner: "clip_noise = { max_norm = 0.05, sigma = 1.0 "
                                                                       "}"}, "plain.toml"))
    replies, server = _served_replies(plain, micro_batches, staleness)
    assert all(isinstance(reply.body["loss"], float) and "loss_withheld" not in reply.body for reply in replies)
    assert check_reply(replies[0], 1, backward_specs(first, micro_batches), False, "g")[0] is not None


def test_a_withheld_loss_crosses_as_said_and_a_reply_that_garbles_it_is_refused():
    """A withheld loss is said explicitly (``loss_withheld: true``, no ``loss``) and survives the wire and a
    checkpoint of kept replies as such; a reply that says it with another value, or with a loss as well, is
    malformed (a reply saying neither still is)."""
    from distgrad.errors import ProtocolError
    from distgrad.run.kept_replies import kept, kept_arrays
    from distgrad.run.peers import Peer
    from distgrad.stage.stage import Stage, backward_specs
    from distgrad.wire import messages as wire
    from distgrad.wire.link import check_reply
    stage = Stage.from_experiment(load_experiment("digits"), "f")
    grad = np.full(stage.output_shape, 0.5, np.float32)

    def reply(**body) -> wire.Message:
        return wire.Message(wire.BACKWARD, "run", 3, 0, 1, body={**body, "compute_s": 0.5},
                            tensors={"activation_grad": grad})
    withheld = reply(loss_withheld=True)
    through = wire.decode(wire.encode(withheld))
    assert through.body == {"loss_withheld": True, "compute_s": 0.5}
    assert check_reply(through, 3, backward_specs(stage, 1), False, "g")[0] is None
    peer = Peer(0, run="run", cached={(3, 0): withheld})
    assert kept({0: "run"}, kept_arrays([peer], 3), 3)[0][0][(3, 0)].body == withheld.body
    for body in ({"loss_withheld": 1}, {"loss_withheld": True, "loss": 0.5}, {"loss_withheld": False}, {}):
        with pytest.raises(ProtocolError) as told:
            check_reply(reply(**body), 3, backward_specs(stage, 1), False, "g")
        assert told.value.code == "malformed", body


def test_the_in_process_reference_withholds_the_loss_as_the_label_owner_does(tmp_path):
    """The in-process run decides as the label owner's replies do: with dp_sgd (a two-stage run, a chain
    whose middle stage passes the loss up, vertical parties) the data owner's summary has no final loss and
    says why, and the trace keeps the label owner's own loss at every step; without dp_sgd the loss is there."""
    from test_defenses import _defended
    for builtin, label_owner in (("digits", 1), ("chain-regression", 2), ("digits-halves", 2)):
        path = _defended(tmp_path, builtin, {label_owner: DP_SGD}, f"{builtin}.toml")
        summary = train_in_process(load_experiment(path), steps=3, noise_secret=3, trace_path=tmp_path / "t.jsonl")
        assert summary["final_loss"] is None and summary["training_loss"] == "withheld by the label owner"
        trace = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
        assert len(trace) == 3 and all(isinstance(line["loss"], float) for line in trace), builtin
    plain = train_in_process(load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 1.0 }",
                                                     "plain.toml")), steps=3, noise_secret=3)
    assert isinstance(plain["final_loss"], float) and "training_loss" not in plain


def test_a_withheld_loss_is_said_so_where_a_human_reads_it_and_null_in_json(tmp_path, capsys):
    """The data owner's bar, log line, run headline and plot of a run whose label owner withheld the loss say
    "withheld by the label owner"; its metrics and progress lines hold null (valid JSON, no NaN)."""
    import io
    from distgrad.cli import _print_headline
    from distgrad.run.progress import Progress, render_bar
    from distgrad.stage.records import loss_text
    assert "loss withheld by the label owner test 0.25" in render_bar(2, 10, None, None, {"test_loss": 0.25})
    assert loss_text(None) == "withheld by the label owner" and loss_text(0.5) == "0.5"
    stream = io.StringIO()
    Progress("lines", 10, stream).update(1, None, force=True)
    assert json.loads(stream.getvalue().removeprefix("progress "))["loss"] is None
    _print_headline({"experiment": "e", "steps": 3, "elapsed_s": 1.0, "final_loss": None,
                     "training_loss": "withheld by the label owner"})
    assert "final loss withheld by the label owner" in capsys.readouterr().out
    pytest.importorskip("matplotlib")
    from distgrad.plot import draw_metrics
    fig = draw_metrics([{"step": s, "loss": None, "wall_s": 0.01 * s} for s in range(1, 5)], "t")
    assert "training loss withheld by the label owner" in [text.get_text() for text in fig.axes[0].texts]


# Slow (a daemon process for a library loop): by default test_dp_sgd_over_processes_is_bitwise_the_in_process_run
# covers the daemon withholding the loss over the wire, and the tests above the data owner's reading of it
# (``check_reply``, which the cut library calls too).
@pytest.mark.slow
@pytest.mark.integration
def test_the_cut_library_gets_no_loss_from_a_dp_sgd_label_owner(tmp_path, start_server):
    """``Cut.step`` (and ``step_micro_batches``) against a label owner daemon with dp_sgd: the gradient, and
    None for the loss, which the label owner withholds; its own summary keeps its loss."""
    f_file, g_file = _rows_parties(tmp_path, DP_SGD, steps=2)
    g, endpoint = start_server(str(g_file), "--summary", tmp_path / "g.json")
    with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
        loss, dh = cut.step(np.zeros((32, 64), np.float32), cut.rows(1))
        assert loss is None and dh.shape == (32, 64) and np.isfinite(dh).all()
        loss, grads = cut.step_micro_batches([np.zeros((32, 64), np.float32)], cut.rows(2))
        assert loss is None and len(grads) == 1
    assert g.wait(20) == 0, g.output
    assert isinstance(read_json(tmp_path / "g.json")["final_loss"], float)


def test_a_data_owners_clip_noise_with_a_target_epsilon_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="target epsilon is the label owner's"):
        load_experiment(_digits(tmp_path, "clip_noise = { max_norm = 4.0, epsilon = 8.0 }", ""))


@pytest.mark.parametrize("builtin,owner", [("digits", 0), ("vertical-classify", 1), ("digits-clients", 0)])
def test_a_data_owners_clip_noise_delta_is_refused_rather_than_ignored(tmp_path, builtin, owner):
    """delta is the label owner's label-DP budget's; a data owner's clip_noise states no guarantee, so a delta
    there would be accepted and do nothing."""
    from test_defenses import _defended
    with pytest.raises(ConfigError, match="'clip_noise' delta .* would change nothing"):
        load_experiment(_defended(tmp_path, builtin, {owner: "clip_noise = { max_norm = 4.0, sigma = 0.1, "
                                                             "delta = 1e-6 }"}))
    load_experiment(_digits(tmp_path, "", "clip_noise = { max_norm = 0.05, sigma = 1.0, delta = 1e-6 }"))


def test_a_target_form_run_resumed_with_more_planned_releases_is_refused(tmp_path):
    """The target form's sigma is chosen for the run's planned steps; a resume with --steps that plan more
    releases would noise the rest with another sigma while the budget counts every release at one. It is
    refused naming the steps the run began with; --steps that plan the same releases resume it."""
    from distgrad.run.options import StageOptions
    from distgrad.run.stage_state import StageState
    exp = load_experiment(_digits(tmp_path, "", TARGET))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    def state(steps: int) -> StageState:
        return StageState(StageOptions(exp, "g", exp.seed, steps=steps, checkpoint_dir=ckpt, checkpoint_every=1,
                                       resume=True))
    first = state(44)                       # one epoch: one release per row planned
    first.begin("run-a")
    first.ledger.release(1, "grad", "d1", np.arange(32))
    first.save(1)
    with pytest.raises(ConfigError, match=r"chosen for the releases of its 44 planned steps.*--steps 44"):
        state(176).resume_latest()          # four epochs: another sigma
    again = state(40)                       # still one epoch: the same sigma
    assert again.resume_latest() and again.run_id == "run-a" and again.ledger.worst == 1


def test_with_label_dp_the_clip_noise_scope_says_the_update_trains_on_the_randomized_labels(tmp_path):
    """With label_dp the label owner's update trains on its randomized labels, not the true ones: the scope
    says so, and that the run is then label_dp's epsilon end to end (not only per release)."""
    both = privacy_budget(load_experiment(_digits(tmp_path, "", "label_dp = { epsilon = 2 }\nclip_noise = { "
                                                  "max_norm = 0.05, sigma = 2.0 }", "both.toml")), ["g"], 44, 0)
    clip = both["privacy"]["g"]["clip_noise"]
    assert clip["scope"].startswith("per release, on the cut gradients only") and "true labels" not in clip["scope"]
    assert "randomized labels" in clip["scope"] and "end to end" in clip["scope"] == clip["guarantee"]
    assert "randomized labels" in budget_text(both["privacy"])


@pytest.mark.parametrize("g_extra", ["max_norm = true", "marvell = { bound = 0.5 }"])
def test_a_row_defense_that_needs_the_other_rows_of_its_micro_batch_refuses_micro_batches_of_one_row(tmp_path,
                                                                                                   g_extra):
    """max_norm noises each row up to the largest norm among the rows sent with it, Marvell by the two classes
    among them: a micro-batch of one row would cross as computed. Refused, naming why: in the run's settings
    (every path), and in the label owner's hello, since the data owner chooses the micro-batches (a determined
    one would ask for 32 micro-batches of 1 row to switch the defense off). Micro-batches of 2 rows are served."""
    from test_defenses import _zero_vs_rest
    from distgrad.run.handshake import check_hello, hello
    from distgrad.stage.stage import Stage
    from distgrad.errors import ProtocolError
    from distgrad.wire.messages import ErrorCode
    exp = load_experiment(_zero_vs_rest(tmp_path, "", g_extra))
    with pytest.raises(ConfigError, match=r"a micro-batch of 1 row .*: it would add no noise|holds one class"):
        train_in_process(exp, steps=1, micro_batches=32)
    f = Stage.from_experiment(exp, "f")
    for micro_batches in (32, 16):
        body = hello(exp, "f", exp.seed, f.output_shape, "r", [0], 1, micro_batches).body
        if micro_batches == 32:
            with pytest.raises(ProtocolError, match=r"32 micro-batches of 1 row; stage g: '(max_norm|marvell)'") as refused:
                check_hello(body, "f", exp, exp.seed, f.output_shape, "g")
            assert refused.value.code == ErrorCode.MISMATCH
        else:
            assert check_hello(body, "f", exp, exp.seed, f.output_shape, "g") == 16
    ramp = load_experiment(_ramp(tmp_path, "max_norm = true"))
    with pytest.raises(ConfigError, match=r"'max_norm' .* a micro-batch of 1 row has no other"):
        train_in_process(ramp, steps=1)
