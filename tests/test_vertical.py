"""Vertical split learning: feature parties holding other columns of the same rows, one label owner.

The label owner combines the parties' embeddings (concat, sum, mean) and sends
each party the gradient of its own. Runs over real processes and sockets end
bitwise equal to the in-process reference, also through kill -9 and restart
of a feature party and of the label owner; a party that stays away ends the
run everywhere with exit 3, naming it.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import StageGroup, free_tcp_endpoint, read_json, read_lines, run_launcher, run_main
from distgrad.api import drive_stage, serve_stage
from distgrad.model import aggregate
from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.config.tomlfile import read_toml
from distgrad.run.auditing import run_audit
from distgrad.run.inprocess import train_in_process
from distgrad.run.serving import ServingStage
from distgrad.wire.transport import POLL_TICK_S

PARTIES = ["a", "b", "c"]
BUILTIN = Path(__file__).parent.parent / "distgrad" / "experiments" / "vertical-classify.toml"


def _experiment(tmp_path: Path, aggregate_kind: str = "concat") -> Path:
    """vertical-classify with another aggregation (sum and mean need equal widths: g takes 8 columns;
    "secure-sum": sum with secure_aggregation)."""
    text = BUILTIN.read_text()
    if aggregate_kind == "secure-sum":
        text = text.replace('aggregate = "concat"', 'aggregate = "concat"\nsecure_aggregation = true')
        aggregate_kind = "sum"
    if aggregate_kind != "concat":
        text = text.replace('aggregate = "concat"', f'aggregate = "{aggregate_kind}"').replace("in = 24", "in = 8")
    path = tmp_path / f"vertical-{aggregate_kind}.toml"
    path.write_text(text)
    return path


def _reference(tmp_path: Path, experiment: Path | str, *flags: str | Path) -> dict:
    path = tmp_path / "reference.json"
    result = run_main(["run", str(experiment), *flags, "--in-process", "--summary", path])
    assert result.returncode == 0, result.stderr
    return read_json(path)


# -- the math

def test_aggregations_combine_and_split_as_documented():
    rng = np.random.default_rng(0)
    parts = [rng.normal(size=(4, w)).astype(np.float32) for w in (2, 3, 1)]
    joined = aggregate.combine("concat", parts)
    assert joined.dtype == np.float32 and np.array_equal(joined, np.hstack(parts))
    grad = rng.normal(size=(4, 6)).astype(np.float32)
    pieces = aggregate.split("concat", grad, [2, 3, 1])
    assert [p.shape for p in pieces] == [(4, 2), (4, 3), (4, 1)] and all(p.flags.c_contiguous for p in pieces)
    assert np.array_equal(np.hstack(pieces), grad)
    same = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(3)]
    assert np.array_equal(aggregate.combine("sum", same), (same[0] + same[1]) + same[2])
    assert np.array_equal(aggregate.combine("mean", same), ((same[0] + same[1]) + same[2]) / np.float32(3))
    g = rng.normal(size=(4, 3)).astype(np.float32)
    assert all(np.array_equal(p, g) for p in aggregate.split("sum", g, [3, 3, 3]))
    assert all(np.array_equal(p, g / np.float32(3)) for p in aggregate.split("mean", g, [3, 3, 3]))
    assert aggregate.combined_shape("concat", [(32, 2), (32, 5)]) == (32, 7)
    with pytest.raises(ConfigError, match="must be equal"):
        aggregate.combined_shape("sum", [(32, 2), (32, 5)])


def test_a_concat_gradient_of_equal_widths_is_split_by_one_copy():
    """The label owner's gradient of K parties of one width is cut by one numpy copy into one
    block, each party's part a contiguous row of it (was K copies, and a cumsum of the widths per step);
    the parts are the gradient's columns exactly and own their memory apart from the gradient."""
    rng = np.random.default_rng(1)
    for lead in [(32,), (2, 5), ()]:
        grad = rng.normal(size=(*lead, 8 * 4)).astype(np.float32)
        kept = grad.copy()
        parts = aggregate.split("concat", grad, [4] * 8)
        assert [p.shape for p in parts] == [(*lead, 4)] * 8 and all(p.flags.c_contiguous for p in parts)
        assert all(p.dtype == np.float32 and np.array_equal(p, grad[..., 4 * k:4 * k + 4])
                   for k, p in enumerate(parts))
        block = parts[0].base
        assert block is not None and all(p.base is block for p in parts) and not np.shares_memory(block, grad)
        for p in parts:
            p[...] = 0
        assert np.array_equal(grad, kept)
    # Unequal widths, and a label owner's own columns after the parties': each part copied on its own.
    grad = rng.normal(size=(3, 2 + 5 + 1 + 4)).astype(np.float32)
    parts = aggregate.split_input(grad, True, "concat", [2, 5, 1])
    assert [p.shape for p in parts] == [(3, 2), (3, 5), (3, 1)] and np.array_equal(np.hstack(parts), grad[:, :8])


def test_one_party_is_the_two_stage_split():
    """A vertical experiment with one feature party is the plain f/g split, bit for bit."""
    raw = {"name": "x", "steps": 30, "data": {"kind": "synthetic_classification", "samples": 256, "features": 6,
                                              "classes": 3, "batch": 16},
           "stages": [{"name": "f", "model": [{"type": "dense", "name": "f1", "in": 6, "out": 5}, {"type": "relu"}],
                       "optimizer": {"type": "adam", "lr": 0.01}},
                      {"name": "g", "model": [{"type": "dense", "name": "g1", "in": 5, "out": 3}],
                       "optimizer": {"type": "adam", "lr": 0.01}, "loss": "softmax_cross_entropy"}]}
    split = train_in_process(parse_experiment(raw), micro_batches=2)
    for kind in aggregate.AGGREGATES:
        vertical = train_in_process(parse_experiment({**raw, "aggregate": kind}), micro_batches=2)
        assert vertical["params"] == split["params"], kind


def test_every_party_gets_the_gradient_of_its_own_columns():
    """Each party's weight gradient equals that of one model whose first layer is block-diagonal (the
    parties' layers side by side), computed in float64 by finite differences of the loss, for every party."""
    exp = load_experiment(BUILTIN)
    assert exp.vertical and exp.data_owners == PARTIES and exp.input_shape("g") == (32, 24)
    from distgrad.stage.stage import Stage
    stages = [Stage.from_experiment(exp, name) for name in exp.stage_names]
    data = [exp.build_data(stage=name) for name in PARTIES]
    x = [d.features(1) for d in data]
    y = exp.build_data(stage="g").targets(1)
    outs = [s.forward(xi) for s, xi in zip(stages[:3], x)]
    z = aggregate.combine("concat", [o for o, _ in outs])
    _, dz, _ = stages[3].loss_micro_batch(z, y)
    grads = [s.backward(cache, dy, need_dx=False)[1] for s, (_, cache), dy in
             zip(stages[:3], outs, aggregate.split("concat", dz, [8, 8, 8]))]

    def loss_of(party: int, weights: np.ndarray) -> float:
        h = [np.tanh(xi.astype(np.float64) @ s.params[f"{n}1.W"].astype(np.float64) + s.params[f"{n}1.b"])
             for xi, s, n in zip(x, stages, PARTIES)]
        name = PARTIES[party]
        h[party] = np.tanh(x[party].astype(np.float64) @ weights + stages[party].params[f"{name}1.b"])
        logits = np.hstack(h) @ stages[3].params["g1.W"].astype(np.float64) + stages[3].params["g1.b"]
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(len(y)), y].mean())

    for party, name in enumerate(PARTIES):
        w = stages[party].params[f"{name}1.W"].astype(np.float64)
        eps, numeric = 1e-6, np.zeros_like(w)
        for index in np.ndindex(w.shape):
            up, down = w.copy(), w.copy()
            up[index] += eps
            down[index] -= eps
            numeric[index] = (loss_of(party, up) - loss_of(party, down)) / (2 * eps)
        np.testing.assert_allclose(grads[party][f"{name}1.W"], numeric, rtol=2e-3, atol=2e-6, err_msg=name)


@pytest.mark.parametrize("raw_change,message", [
    ({"labels": "first"}, "keeps the labels at its last stage"),
    ({"clients": {"count": 2}}, "clients"),
    ({"aggregate": "max"}, "'aggregate' must be one of"),
])
def test_a_bad_vertical_experiment_is_refused(raw_change, message):

    raw = read_toml(BUILTIN)
    with pytest.raises(ConfigError, match=message):
        parse_experiment({**raw, **raw_change})


def test_bad_columns_are_refused():

    raw = read_toml(BUILTIN)
    for columns, message in (([3, 12], "from 0 to 11"), ([1, 1], "distinct"), ([], "distinct")):
        stages = [dict(raw["stages"][0], columns=columns), *raw["stages"][1:]]
        with pytest.raises(ConfigError, match=message):
            parse_experiment({**raw, "stages": stages})
    stages = [*raw["stages"][:3], dict(raw["stages"][3], columns=[0])]
    with pytest.raises(ConfigError, match="receives activations"):
        parse_experiment({**raw, "stages": stages})
    with pytest.raises(ConfigError, match="must be equal"):       # sum needs equal embeddings
        wide = [dict(raw["stages"][0], model=[{"type": "dense", "name": "a1", "in": 4, "out": 9}]),
                *raw["stages"][1:]]
        parse_experiment({**raw, "aggregate": "sum", "stages": wide})


# -- over the wire

GUARD = "input_guard = { max_r2 = 1.0, after = 0 }"     # judges every step, never stops (R^2 <= 1)


@pytest.mark.parametrize("kind,transport,micro_batches,extra", [
    ("concat", "tcp", 1, ["--secure"]), ("concat", "ipc", 2, []), ("sum", "tcp", 2, ["--privacy-meter"]),
    ("mean", "ipc", 1, ["--save", "saved", "--metrics", "metrics.jsonl"]),
    # Slow: four processes more. By default test_secure_aggregation covers the same path without processes:
    # the parties' masked forwards (their codecs as sent_codecs builds them from --party-keys) at the label
    # owner, bitwise with the reference, and the masks cancelling exactly.
    pytest.param("secure-sum", "ipc", 2, [], marks=pytest.mark.slow)])
def test_three_parties_equal_the_in_process_reference(tmp_path, kind, transport, micro_batches, extra):
    """Also with CURVE (a key pair per party), and the output files: each stage's saved parameters and one
    metrics line per step, in each process's own file (the first party's at PATH, every other's at
    PATH.STAGE: each with its own learning rate). With secure aggregation (always CURVE: each party masks
    with its key pair and the others' public keys, --party-keys) the label owner adds masked fixed point,
    the reference unmasked fixed point: bitwise equal. Metered (``_check_party_meters``), as in one process."""
    experiment = _experiment(tmp_path, kind)
    plain = None
    if "--privacy-meter" in extra:          # and parties a and c guarded
        plain, experiment = experiment, tmp_path / "guarded.toml"
        experiment.write_text(plain.read_text().replace('name = "a"\n', f'name = "a"\n{GUARD}\n').replace(
            'name = "c"\n', f'name = "c"\n{GUARD}\n'))
    flags = ["--micro-batches", str(micro_batches), *(["--privacy-meter"] if plain else [])]
    extra = [e for e in extra if e != "--privacy-meter"]
    path, trace = tmp_path / "run.json", tmp_path / "trace.jsonl"
    extra = [str(tmp_path / e) if e in ("saved", "metrics.jsonl") else e for e in extra]
    result = run_launcher(["run", experiment, "--transport", transport, "--summary", path, "--trace", trace, *flags,
                           *extra])
    assert result.returncode == 0, result.stdout + result.stderr
    summary, reference = read_json(path), _reference(tmp_path, experiment, *flags)
    if "--save" in extra:
        for name in [*PARTIES, "g"]:
            saved = np.load(tmp_path / "saved" / f"{name}.npz")
            assert {k: saved[k].tolist() for k in saved.files} == reference["params"][name]
        assert [line["step"] for line in read_lines(tmp_path / "metrics.jsonl")] == list(range(1, 61))
        for name in [*PARTIES[1:], "g"]:
            lines = read_lines(tmp_path / f"metrics.{name}.jsonl")
            assert [line["step"] for line in lines] == list(range(1, 61)) and lines[-1]["lr"] > 0, name
    assert sorted(summary["params"]) == [*PARTIES, "g"]
    assert summary["params"] == reference["params"]
    assert summary["final_loss"] == reference["final_loss"]
    assert [p["status"] for p in summary["parties"]] == ["completed"] * 3
    lines = [line for line in map(__import__("json").loads, trace.read_text().splitlines())]
    assert [line["step"] for line in lines] == list(range(1, 61))
    assert {"a1.W", "b1.W", "c1.W", "g1.W"} <= set(lines[-1]["params"])
    if plain is not None:
        _check_party_meters(summary, reference, _reference(tmp_path, plain, "--micro-batches", str(micro_batches)),
                            guarded=["a", "c"])
        # The trace names each party's views; the audit of each reproduces its meter's first window.
        assert {f"sent_activation/{p}" for p in PARTIES} | {f"sent_activation_grad/{p}" for p in PARTIES} <= set(
            lines[0]["grads"])
        report = run_audit(str(experiment), trace, first=1, last=50, micro_batches=micro_batches, run_steps=60,
                           window=50)
        for party in PARTIES:
            labels, inputs = (summary[key][party][field][0] for key, field in (
                ("label_meters", "label_leaks"), ("input_meters", "input_leaks")))
            assert labels["step"] == inputs["step"] == 50
            for name in ("label_recovery", "cosine_auc"):
                assert report[f"labels/{party}"][name] == labels[name], (party, name)
            for name in ("distance_correlation", "distance_correlation_chance"):
                assert report[f"inputs/{party}"][name] == inputs[name], (party, name)


def _check_party_meters(summary: dict, reference: dict, unmetered: dict, guarded: list[str]) -> None:
    """Each party's own input meter (and guard), and the label owner's meter of each party, named by the
    party: the same figures over processes as in one, and a metered, guarded run trains bitwise the plain."""
    assert summary["params"] == unmetered["params"]
    assert "input_leaks" not in summary and "label_leaks" not in summary     # by party, not one of them
    for key, kinds in (("input_meters", ("input_leaks", "input_attacks", "input_leak_extremes")),
                       ("label_meters", ("label_leaks", "label_attacks", "label_leak_extremes"))):
        assert sorted(summary[key]) == PARTIES, key
        for party in PARTIES:
            for field in kinds:
                assert summary[key][party][field] == reference[key][party][field], (key, party, field)
            assert summary[key][party][kinds[0]], (key, party)
    for party in PARTIES:
        assert ("input_guard" in summary["input_meters"][party]) == (party in guarded), party
        if party in guarded:
            guard = summary["input_meters"][party]["input_guard"]
            assert guard == reference["input_meters"][party]["input_guard"] and 0 < guard["peak_r2"] <= 1
    # Each party's gradient rows leak the labels, and each its own columns: the figures differ by party.
    assert summary["label_meters"]["a"]["label_attacks"] != summary["label_meters"]["b"]["label_attacks"]
    assert summary["input_meters"]["a"]["input_leaks"] != summary["input_meters"]["b"]["input_leaks"]


def test_with_secure_aggregation_the_label_owner_meters_each_party_but_no_embedding_is_traced(tmp_path):
    """Masked, a party's embedding reaches no one alone: the label owner meters the gradient rows it sends
    each party (no model completion: it holds no party's embedding), and no party's sends are traced."""
    exp = load_experiment(_experiment(tmp_path, "secure-sum"))
    trace = tmp_path / "trace.jsonl"
    summary = train_in_process(exp, steps=12, privacy_meter=True, trace_path=trace)
    assert "input_meters" not in summary and sorted(summary["label_meters"]) == PARTIES
    for party in PARTIES:
        attacks = summary["label_meters"][party]["label_attacks"][-1]
        assert "averaged_recovery_1" in attacks and "model_completion" not in attacks, party
    names = set(read_lines(trace)[0]["grads"])
    assert {f"sent_activation_grad/{p}" for p in PARTIES} <= names
    assert not [name for name in names if name.startswith("sent_activation/")]


# A torch feature party and label owner (four processes, two of them torch): slow. The numpy parties' meters and
# guards over processes are test_three_parties_equal_the_in_process_reference's sum case, in the default suite.
@pytest.mark.slow
def test_a_torch_partys_meter_and_guard_over_processes_equal_in_process(tmp_path):
    pytest.importorskip("torch")
    torch = 'framework = "torch"\n'
    experiment = tmp_path / "torch.toml"
    experiment.write_text(BUILTIN.read_text().replace('name = "a"\n', f'name = "a"\n{torch}{GUARD}\n').replace(
        'loss = "softmax', f'{torch}loss = "softmax'))
    plain = tmp_path / "plain.toml"
    plain.write_text(experiment.read_text().replace(GUARD, ""))
    flags = ["--steps", "20", "--micro-batches", "2"]
    path = tmp_path / "run.json"
    result = run_launcher(["run", experiment, "--summary", path, *flags, "--privacy-meter"])
    assert result.returncode == 0, result.stdout + result.stderr
    _check_party_meters(read_json(path), _reference(tmp_path, experiment, *flags, "--privacy-meter"),
                        _reference(tmp_path, plain, *flags), guarded=["a"])
    assert "privacy meter, label owner's labels (a)" in result.stdout


def test_digits_halves_reaches_95_percent_held_out():
    """The left and right halves of every image, two parties: >= 95% held-out accuracy (0.9833 at seed 0)."""
    summary = train_in_process(load_experiment("digits-halves"))
    assert summary["test_accuracy"] >= 0.95


def test_digits_halves_over_the_wire_with_evaluations(tmp_path):
    """Two parties holding the left and right halves of each image: the held-out scores of every
    evaluation equal the in-process ones (each party is told the same)."""
    path = tmp_path / "run.json"
    flags = ["--steps", "200", "--eval-every", "100"]
    result = run_launcher(["run", "digits-halves", "--summary", path, *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    summary, reference = read_json(path), _reference(tmp_path, "digits-halves", *flags)
    assert summary["params"] == reference["params"]
    assert summary["evaluations"] == reference["evaluations"] and len(summary["evaluations"]) == 2
    assert summary["test_accuracy"] == reference["test_accuracy"] > 0.8


def test_the_parties_stage_files_train_bitwise(tmp_path):
    """`distgrad split` gives each party a file of its own; run from them, the result is the same."""
    assert run_main(["split", "vertical-classify", tmp_path / "files"]).returncode == 0
    files = [tmp_path / "files" / name / f"{name}.toml" for name in [*PARTIES, "g"]]
    text = files[1].read_text()
    assert 'aggregate = "concat"' in text and "columns = [4, 5, 6, 7]" in text and "labels" not in text.split(
        "[data]")[1]
    path = tmp_path / "run.json"
    result = run_launcher(["run", *files, "--summary", path, "--steps", "30"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_json(path)["params"] == _reference(tmp_path, BUILTIN, "--steps", "30")["params"]


def _unequal_widths(tmp_path: Path, aggregate_kind: str) -> Path:
    """vertical-classify with 13 columns held 5, 4 and 4 by the three parties (each embedding still 8 wide)."""
    text = BUILTIN.read_text().replace("features = 12", "features = 13")
    for party, (old, new) in zip(PARTIES, [("0, 1, 2, 3", "0, 1, 2, 3, 4"), ("4, 5, 6, 7", "5, 6, 7, 8"),
                                           ("8, 9, 10, 11", "9, 10, 11, 12")]):
        text = text.replace(f"columns = [{old}]", f"columns = [{new}]")
        text = text.replace(f'name = "{party}1", in = 4', f'name = "{party}1", in = {len(new.split(","))}')
    text = text.replace('aggregate = "concat"', f'aggregate = "{aggregate_kind}"').replace("in = 24", "in = 8")
    path = tmp_path / f"unequal-{aggregate_kind}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("kind", ["sum", "mean"])
def test_parties_of_unequal_widths_run_in_process_bitwise_as_over_processes(tmp_path, kind):
    """Parties of 5, 4 and 4 columns, from the combined experiment and from each party's stage file: the
    in-process run builds each party from its own columns (the feature shape is each party's own)."""
    experiment = _unequal_widths(tmp_path, kind)
    assert run_main(["split", experiment, tmp_path / "files"]).returncode == 0
    files = [tmp_path / "files" / name / f"{name}.toml" for name in [*PARTIES, "g"]]
    flags = ["--steps", "20"]
    combined, from_files = _reference(tmp_path, experiment, *flags), _reference(tmp_path, files[0], *files[1:],
                                                                                  *flags)
    assert [len(combined["params"][p][f"{p}1.W"]) for p in PARTIES] == [5, 4, 4]
    path = tmp_path / "run.json"
    result = run_launcher(["run", *files, "--summary", path, *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_json(path)["params"] == from_files["params"] == combined["params"]


class Parties(StageGroup):
    """The label owner and three feature parties of one run (of ``experiment``, default vertical-classify), each
    a process with its own log."""

    def __init__(self, tmp_path: Path, steps: int, endpoint: str, *flags: str, experiment: Path = BUILTIN,
                 secure: bool = False) -> None:
        """``secure``: with CURVE, a key pair per process, and each party's --party-keys (secure_aggregation)."""
        super().__init__(tmp_path)
        common = ["--experiment", str(experiment), "--steps", str(steps), "--checkpoint-dir", tmp_path / "ckpt",
                  "--checkpoint-every", "1", "--resume", *flags]
        keys = {name: [] for name in ["g", *PARTIES]}
        if secure:
            from distgrad.wire.keys import keygen
            keygen(tmp_path / "server", "g")
            keys["g"] = ["--curve-secret", tmp_path / "server" / "g.key_secret", "--allow", tmp_path / "parties"]
            for name in PARTIES:
                keygen(tmp_path / "parties", name)
                keys[name] = ["--curve-secret", tmp_path / "parties" / f"{name}.key_secret", "--server-key",
                              tmp_path / "server" / "g.key", "--party-keys", tmp_path / "parties"]
        self.args = {"g": ["g", "--bind", endpoint, "--summary", tmp_path / "g.json", *common, *keys["g"]]}
        for name in PARTIES:
            self.args[name] = [name, "--connect", endpoint, "--summary", tmp_path / f"{name}.json",
                               "--trace", tmp_path / f"{name}.jsonl", "--trace-params", f"{name}1.b", *common,
                               *keys[name]]

    def start_all_then_kill(self, name: str, at_step: int) -> None:
        for who in ["g", *PARTIES]:
            self.start(who)
        self.wait_until(lambda: self.lines("a.jsonl") >= at_step, f"party a to reach step {at_step}")
        self.procs[name].signal(signal.SIGKILL)
        assert self.procs[name].wait(10) == -signal.SIGKILL, f"{name} ended before the kill"


@pytest.mark.parametrize("killed,transport,secure", [
    ("b", "tcp", False), ("g", "ipc", False),
    # Slow: four processes more. By default test_secure_aggregation's test_a_resumed_run_draws_the_same_masks
    # covers a resumed party and label owner binding the same masks (without processes), and the cases above
    # the kill and the resume.
    pytest.param("b", "ipc", True, marks=pytest.mark.slow)])
def test_kill_9_and_restart_of_a_party_changes_nothing(tmp_path, stage_group, killed, transport, secure):
    """kill -9 of feature party b (or of the label owner g) mid-run; the others wait for it (g names the
    party it waits for); restarted with the same command line (--resume) the run goes on, and every
    stage ends bitwise equal to the uninterrupted in-process run. With secure aggregation the restarted
    party binds its masks to the same runs as before the kill (its own run id from its checkpoint)."""
    steps = 300
    endpoint = f"ipc://{tmp_path}/g.sock" if transport == "ipc" else free_tcp_endpoint()
    experiment = _experiment(tmp_path, "secure-sum") if secure else BUILTIN
    run = stage_group(Parties, tmp_path, steps, endpoint, "--timeout", "0.5", "--liveness", "0.5",
                      "--peer-deadline", "30", experiment=experiment, secure=secure)
    run.start_all_then_kill(killed, at_step=40)
    if killed == "b":
        run.wait_until(lambda: "waiting for party b" in run.logs(), "g to name party b", all_running=False)
    run.start(killed)                                       # the same command line
    run.wait_all()
    assert "resumed run" in run.logs()
    if secure:
        bound = [re.findall(r"masks bound to the feature parties' runs (\[.*\])", (tmp_path / f"b.{n}.log").read_text())
                 for n in (1, 2)]
        assert bound[0] and bound[1] and set(bound[0]) == set(bound[1]), bound
    reference = _reference(tmp_path, experiment, "--steps", str(steps))["params"]
    for name in [*PARTIES, "g"]:
        assert read_json(tmp_path / f"{name}.json")["params"][name] == reference[name], name


def test_a_party_that_stays_away_ends_the_run_everywhere_naming_it(tmp_path, stage_group):
    """c is killed and not restarted: after --peer-deadline every other stage exits 3 naming c."""
    run = stage_group(Parties, tmp_path, 100000, f"ipc://{tmp_path}/g.sock", "--timeout", "0.3",
                      "--liveness", "0.5", "--peer-deadline", "1.5")
    run.start_all_then_kill("c", at_step=20)
    for name in ["g", "a", "b"]:
        assert run.procs[name].wait(20) == 3, f"{name}:\n{run.logs()}"
    logs = {name: (tmp_path / f"{name}.1.log").read_text() for name in ["g", "a", "b"]}
    assert "party c silent for more than" in logs["g"], logs["g"]
    for name in ["a", "b"]:
        assert "waiting for c" in logs[name], logs[name]




# Four processes: slow. By default test_a_party_that_stops_ends_the_run_and_every_other_party_is_told_why covers the
# label owner telling the other parties (without sockets), and test_strong_meters's
# test_a_guard_stop_over_processes_exits_5_and_writes_no_newer_checkpoint a guard's stop over processes.
@pytest.mark.slow
def test_a_partys_input_guard_stops_it_and_every_other_stage_is_told_why_at_once(tmp_path, stage_group):
    """Party a's input_guard stops it before it sends step 6 (exit 5; its newest checkpoint is step 5's): the
    label owner and the parties b and c exit at once (4, naming a's guard), none waiting out its deadline."""
    experiment = tmp_path / "guarded.toml"
    experiment.write_text(BUILTIN.read_text().replace('name = "a"\n',
                                                      'name = "a"\ninput_guard = { max_r2 = 0.2, after = 5 }\n'))
    run = stage_group(Parties, tmp_path, 40, f"ipc://{tmp_path}/g.sock", "--peer-deadline", "120",
                      experiment=experiment)
    for who in ["g", *PARTIES]:
        run.start(who)
    assert run.procs["a"].wait(60) == 5, run.logs()
    stopped = int(re.search(r"input_guard stopped the run before sending step (\d+)", run.logs()).group(1))
    assert stopped > 5
    for name in ["g", "b", "c"]:
        assert run.procs[name].wait(30) == 4, f"{name}:\n{run.logs()}"      # long before the 120 s deadline
        assert "input_guard stopped the run before sending step" in run.procs[name].output, name
    saved = sorted(int(m.group(1)) for p in (tmp_path / "ckpt").glob("a-*.ckpt")
                   if (m := re.search(r"-(\d+)\.ckpt$", p.name)))
    assert saved and max(saved) == stopped - 1        # the last checkpoint before the breach, nothing newer


# -- the label owner's message handling, without sockets

class _Party:
    """A feature party of digits-halves as the label owner sees it: its hello, forwards and evaluations."""

    def __init__(self, exp, name: str) -> None:
        from distgrad.stage.stage import Stage
        self.exp, self.name, self.run, self.envelope = exp, name, f"run-{name}", [name.encode()]
        self.stage, self.data = Stage.from_experiment(exp, name), exp.build_data(stage=name)

    def hello(self, held: list[int], steps: int, eval_every: int = 0, run: str | None = None):
        from distgrad.run import handshake
        return handshake.hello(self.exp, self.name, self.exp.seed, self.stage.output_shape, run or self.run, held,
                               steps, 1, None, eval_every)

    def forward(self, step: int):
        from distgrad.wire import messages as wire
        return wire.Message(wire.FORWARD, self.run, step, tensors={"activation": self.stage.forward(
            self.data.features(step))[0]})

    def evaluate(self, step: int):
        from distgrad.wire import messages as wire
        y = self.stage.forward(self.data.test_features(), training=False)[0]
        return wire.Message(wire.EVALUATE, self.run, step + 1, tensors={"activation": y})


def _label_owner(tmp_path: Path, steps: int):
    """digits-halves' label owner g (checkpoints every step) and its two parties, at time ``now``."""
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage
    exp = load_experiment("digits-halves")
    g = ServingStage(StageOptions(exp, "g", exp.seed, steps=steps, checkpoint_dir=tmp_path / "g",
                                  checkpoint_every=1, liveness_s=1.0, peer_deadline_s=2.0))
    return g, [_Party(exp, name) for name in ("left", "right")], time.monotonic()


def _replies(g, party: _Party, msg, now: float) -> list:
    return [(envelope[0].decode(), reply.type, reply.step) for envelope, reply in g.handle(party.envelope, msg, now)]


def test_a_rollback_to_a_step_due_for_evaluation_evaluates_it_again_before_going_on(tmp_path):
    """Right comes back holding step 2 (evaluated every 2 steps) while g stands at step 4: g and left go
    back to step 2, both parties evaluate it again after their hello, and the run goes on."""
    g, (left, right), now = _label_owner(tmp_path, steps=10)
    for party in (left, right):
        _replies(g, party, party.hello([0], 10, eval_every=2), now)
    for step in range(1, 5):
        for party in (left, right):
            _replies(g, party, party.forward(step), now)
        g.settle()
        if step % 2 == 0:
            for party in (left, right):
                _replies(g, party, party.evaluate(step), now)
    assert g.stage.step == 4 and 2 in g.state.held()
    _replies(g, right, right.hello([0, 1, 2], 10, eval_every=2), now)
    _replies(g, left, left.hello([0, 1, 2, 3, 4], 10, eval_every=2), now)
    assert g.stage.step == 2
    assert _replies(g, left, left.evaluate(2), now) == []
    assert _replies(g, right, right.evaluate(2), now) == [("left", "evaluation", 3), ("right", "evaluation", 3)]
    assert _replies(g, left, left.forward(3), now) == []
    assert _replies(g, right, right.forward(3), now) == [("left", "backward", 3), ("right", "backward", 3)]


@pytest.mark.parametrize("waiting", [True, False])
def test_a_party_that_stops_ends_the_run_and_every_other_party_is_told_why(tmp_path, waiting):
    """Right stops (its input_guard, or any failure of its own: an aborted notice): the run fails at g, and left
    is told why in reply to its forward waiting there, or else to its next request (``answer_untold``), never
    left to wait out its deadline for a step that cannot come."""
    from distgrad.wire import messages as wire
    g, (left, right), now = _label_owner(tmp_path, steps=10)
    for party in (left, right):
        _replies(g, party, party.hello([0], 10), now)
    if waiting:
        assert _replies(g, left, left.forward(1), now) == []        # waits for right's part
    why = "it failed: stage 'right': input_guard stopped the run before sending step 1"
    replies = g.handle(right.envelope, wire.abort_notice(right.run, "right", why), now)
    assert g.end_failed_run() is not None                           # the run fails at g
    if not waiting:
        assert replies == [] and left.run in g.untold
        replies = [(left.envelope, reply) for reply in g.answer_untold(left.forward(1))]
    [(envelope, reply)] = replies
    assert envelope == left.envelope and reply.type == wire.ERROR and reply.step == 1
    assert reply.body["code"] == wire.ErrorCode.ABORTED and "input_guard stopped the run" in reply.body["message"]
    assert "party right stopped" in reply.body["message"] and not g.untold


def test_a_party_back_after_the_last_step_gets_its_evaluation_and_says_bye(tmp_path):
    """Right is killed after the last step, its evaluation answered, before its bye: restarted with
    --resume it is welcomed after the last step, gets the same scores again and says bye; had it stayed
    away, g would have named it after the liveness bound (so --peer-deadline ends the run) instead of
    waiting for ever."""
    from distgrad.wire import messages as wire
    g, (left, right), now = _label_owner(tmp_path, steps=2)
    for party in (left, right):
        _replies(g, party, party.hello([0], 2), now)
    for step in (1, 2):
        for party in (left, right):
            _replies(g, party, party.forward(step), now)
        g.settle()
    _replies(g, left, left.evaluate(2), now)
    scores = g.handle(right.envelope, right.evaluate(2), now)[-1][1]
    _replies(g, left, wire.Message(wire.BYE, left.run, 3, body={"steps": 2}), now)
    g.tick(now + 5.0)
    assert [p.index for p in g.missing_parties(now + 5.0)] == [1] and "party right silent" in g.lost_message()
    assert _replies(g, right, right.hello([0, 1, 2], 2), now + 5.0) == [("right", "welcome", 0)]
    again = g.handle(right.envelope, right.evaluate(2), now + 5.0)
    assert again[-1][1].body == scores.body
    assert _replies(g, right, wire.Message(wire.BYE, right.run, 3, body={"steps": 2}), now + 5.0) == [
        ("right", "bye", 3)]
    assert g.finish_run()["parties"][1]["status"] == "completed"


def test_another_process_naming_a_live_party_is_refused_as_busy(tmp_path):
    """A second process calling itself left (a fresh run) while left is live would send the whole run
    back to step 0: it is refused as busy (and stops), as a second driver of a two-stage run is."""
    from distgrad.errors import ProtocolError
    g, (left, right), now = _label_owner(tmp_path, steps=10)
    for party in (left, right):
        _replies(g, party, party.hello([0], 10), now)
    for step in (1, 2):
        for party in (left, right):
            _replies(g, party, party.forward(step), now)
        g.settle()
    with pytest.raises(ProtocolError, match=r"busy with run .* since .*\(party left: heard 0.50 s ago"):
        g.handle([b"other"], left.hello([0], 10, run="another-run"), now + 0.5)
    assert g.stage.step == 2 and g.peers[0].run == left.run


def test_a_party_running_other_steps_is_refused_at_hello(tmp_path):
    """The label owner counts the run's steps itself: a party given another --steps would stall the others
    at its end, so its hello is refused, naming both counts."""
    from distgrad.errors import ProtocolError
    g, (left, _), now = _label_owner(tmp_path, steps=10)
    with pytest.raises(ProtocolError, match="party left runs 12 steps, this stage 10"):
        g.handle(left.envelope, left.hello([0], 12), now)


def test_with_curve_one_key_is_one_party(tmp_path):
    """The key that said hello as left cannot also take right's place (a party cannot stand in for another
    with its own key); right's own key can."""
    from distgrad.errors import ProtocolError
    g, (left, right), now = _label_owner(tmp_path, steps=10)
    g.handle(left.envelope, left.hello([0], 10), now, peer_key="key-of-left")
    with pytest.raises(ProtocolError, match="said hello as party left; it cannot also be party right"):
        g.handle(right.envelope, right.hello([0], 10), now, peer_key="key-of-left")
    g.handle(right.envelope, right.hello([0], 10), now, peer_key="key-of-right")
    assert [p.owner for p in g.peers] == ["key-of-left", "key-of-right"]


def test_predictions_of_two_feature_parties_are_written_by_the_label_owner(tmp_path):
    """`distgrad predict` with vertical parties: each party sends its embedding of the same held-out rows,
    the label owner combines them and writes the predictions; they equal the in-process forward of the
    saved stages, and each party's bye is answered once every party's rows are in; with --output-scores
    the class probabilities go beside them (predictions.scores.npy)."""
    from conftest import StageProcess, wait_for_file
    from distgrad.stage.stage import Stage
    saved = tmp_path / "saved"
    result = run_main(["run", "digits-halves", "--in-process", "--steps", "60", "--save", saved])
    assert result.returncode == 0, result.stderr
    ready, output = tmp_path / "g.ready", tmp_path / "predictions.npy"
    with StageProcess(["predict", "digits-halves", "--stage", "g", "--bind", "tcp://127.0.0.1:*", "--ready-file",
                       ready, "--load", saved / "g.npz", "--output", output, "--output-scores"], tmp_path / "g.log",
                      distgrad=True) as g:
        endpoint = wait_for_file(ready, g)
        parties = [StageProcess(["predict", "digits-halves", "--stage", name, "--connect", endpoint, "--load",
                                 saved / f"{name}.npz"], tmp_path / f"{name}.log", distgrad=True)
                   for name in ("left", "right")]
        for party in parties:
            assert party.wait(30) == 0, party.output
            party.stop()
        assert g.wait(30) == 0, g.output
    exp = load_experiment("digits-halves")
    stages = {name: Stage.from_experiment(exp, name) for name in exp.stage_names}
    for name, stage in stages.items():
        stage.load_parameters(saved / f"{name}.npz")
    z = aggregate.combine("concat", [stages[name].forward(exp.build_data(stage=name).test_features(),
                                                          training=False)[0] for name in ("left", "right")])
    logits = stages["g"].forward(z, training=False)[0]
    expected = exp.final_loss.predict(logits)
    assert np.array_equal(np.load(output), expected) and len(expected) == 359
    assert np.array_equal(np.load(tmp_path / "predictions.scores.npy"), exp.final_loss.scores(logits))


def test_the_label_owner_looks_at_its_parties_liveness_every_tick_not_every_message(monkeypatch):
    """The label owner's loop checks which party is silent (a look at every party) once
    per ``POLL_TICK_S``, not after each message, which made that O(parties) per message and O(parties^2) per
    step. The three parties and the label owner run in threads of this process, over tcp."""
    ticks, handled = [], []
    tick, handle = ServingStage.tick, ServingStage.handle
    monkeypatch.setattr(ServingStage, "tick", lambda self, now: ticks.append(now) or tick(self, now))
    monkeypatch.setattr(ServingStage, "handle", lambda self, *a, **k: handled.append(a[1].type) or handle(self, *a, **k))
    summaries: dict[str, dict] = {}
    with serve_stage(BUILTIN, steps=40) as g:
        parties = [threading.Thread(target=lambda name=name: summaries.update(
            {name: drive_stage(BUILTIN, g.endpoint, stage=name, steps=40)})) for name in PARTIES]
        for party in parties:
            party.start()
        for party in parties:
            party.join(60)
        assert g.wait(60)["status"] == "completed"
    assert sorted(summaries) == sorted(PARTIES) and all(s["steps"] == 40 for s in summaries.values())
    assert handled.count("forward") >= 3 * 40
    # Consecutive ticks (the ``now`` each was given) are a tick apart or more, however busy the machine
    # (a busy one only spreads them); 10% below POLL_TICK_S allows for a receive timeout's milliseconds.
    # A tick per message would put them ~1 ms apart.
    gaps = [later - earlier for earlier, later in zip(ticks, ticks[1:])]
    assert all(gap >= 0.9 * POLL_TICK_S for gap in gaps), (sorted(gaps)[:5], len(ticks), len(handled))
