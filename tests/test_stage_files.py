"""Each party its own stage file: only the interface in common.

The data owner's host holds the features and its own model; the label
owner's host holds the labels and its own model; they agree only on the
``[interface]``. Trained by hand over tcp they end bitwise equal to the same
stage files run in one process, and every mismatch of the interface is
named with both values.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.config.split import split_experiment, toml_document

from conftest import StageProcess, read_json, run_cli, run_launcher, run_main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROWS, FEATURES, CLASSES, BATCH = 240, 12, 3, 16


def _interface(**changes) -> dict:
    table = {"name": "two-parties", "stages": ["f", "g"], "batch": BATCH,
             "activation": {"shape": [6], "dtype": "float32"}, "steps": 120, "seed": 3, "labels": "last",
             "reduction": "mean"}
    table.update(changes)
    return table


def _hosts(tmp_path: Path, f_interface: dict | None = None, g_interface: dict | None = None) -> tuple[Path, Path]:
    """Two folders, as on two hosts: f's with features (npy) and f.toml, g's with labels (csv) and g.toml.
    The models, optimisers, data kinds and initial seeds differ; only the interface is shared."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    f_host, g_host = tmp_path / "data-owner", tmp_path / "label-owner"
    f_host.mkdir(parents=True)
    g_host.mkdir()
    np.save(f_host / "pixels.npy", x)
    (g_host / "labels.csv").write_text("id,label\n" + "".join(f"{i},{v}\n" for i, v in enumerate(y)))
    f_doc = {"interface": f_interface or _interface(),
             "stage": {"name": "f", "seed": 11,
                       "model": [{"type": "dense", "name": "enc1", "in": FEATURES, "out": 10}, {"type": "tanh"},
                                 {"type": "dense", "name": "enc2", "in": 10, "out": 6}],
                       "optimizer": {"type": "sgd", "lr": 0.05}},
             "data": {"kind": "npy", "features": "pixels.npy", "batch": BATCH, "test_fraction": 0.25}}
    g_doc = {"interface": g_interface or _interface(),
             "stage": {"name": "g",
                       "model": [{"type": "relu"}, {"type": "dense", "name": "head", "in": 6, "out": CLASSES}],
                       "optimizer": {"type": "adam", "lr": 0.02}, "loss": "softmax_cross_entropy"},
             "data": {"kind": "csv", "path": "labels.csv", "header": True, "labels": "label", "batch": BATCH,
                      "test_fraction": 0.25}}
    (f_host / "f.toml").write_text(toml_document(f_doc))
    (g_host / "g.toml").write_text(toml_document(g_doc))
    return f_host / "f.toml", g_host / "g.toml"


def test_two_parties_with_nothing_but_the_interface_in_common_train_by_hand_bitwise(tmp_path: Path):
    f_file, g_file = _hosts(tmp_path)
    assert not list(f_file.parent.glob("*.csv")) and not list(g_file.parent.glob("*.npy"))
    f_exp, g_exp = load_experiment(f_file), load_experiment(g_file)
    assert [s.name for s in f_exp.stages] == ["f"] and [s.name for s in g_exp.stages] == ["g"]
    with pytest.raises(ConfigError, match="another party's"):
        f_exp.spec("g")
    ready = tmp_path / "g.ready"
    with StageProcess(["g", "--experiment", g_file, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready,
                       "--summary", tmp_path / "g.json"], tmp_path / "g.log") as g:
        from conftest import wait_for_file
        endpoint = wait_for_file(ready, g)
        # Each party runs in its own folder, as on its own host.
        f = run_cli(["stage", "f", "--experiment", f_file, "--connect", endpoint, "--summary", tmp_path / "f.json"],
                    cwd=f_file.parent)
        assert f.returncode == 0, f.stderr
        assert g.wait() == 0, g.output
    reference = train_in_process(load_experiment([f_file, g_file]))
    f_summary, g_summary = read_json(tmp_path / "f.json"), read_json(tmp_path / "g.json")
    assert f_summary["params"]["f"] == reference["params"]["f"]
    assert g_summary["params"]["g"] == reference["params"]["g"]
    assert f_summary["test_accuracy"] == reference["test_accuracy"] > 0.6
    # The launcher takes the parties' files as they are, each stage process reading only its own.
    launched = run_launcher(["run", f_file, g_file, "--summary", tmp_path / "run.json"])
    assert launched.returncode == 0, launched.stderr
    assert read_json(tmp_path / "run.json")["params"] == reference["params"]


@pytest.mark.parametrize("field,f_value,g_value,needle", [
    ("batch", 16, 8, "batch: f has 16, g has 8"),
    ("steps", 120, 121, "steps: f has 120, g has 121"),
    ("seed", 3, 4, "seed: f has 3, g has 4"),
    ("reduction", "sum", "mean", "reduction: f has 'sum', g has 'mean'"),
])
def test_an_interface_mismatch_exits_4_naming_the_field_and_both_values(tmp_path: Path, field, f_value, g_value,
                                                                        needle, start_server):
    f_file, g_file = _hosts(tmp_path, _interface(**{field: f_value}), _interface(**{field: g_value}))
    for path, value in ((f_file, f_value), (g_file, g_value)):
        if field == "batch":            # a party's data batches as its interface says
            path.write_text(path.read_text().replace(f"batch = {BATCH}", f"batch = {value}"))
    if field == "reduction":
        # the label owner's loss decides it: a 'sum' there would be refused when g's file loads
        assert "reduction" in needle
    g, endpoint = start_server(str(g_file))
    f = run_cli(["stage", "f", "--experiment", f_file, "--connect", endpoint, "--peer-deadline", "5"])
    assert f.returncode == 4, f.stderr
    assert needle in f.stderr and needle in g.output


def test_combining_stage_files_that_disagree_names_the_field(tmp_path: Path):
    f_file, g_file = _hosts(tmp_path, _interface(steps=40), _interface(steps=50))
    with pytest.raises(ConfigError, match="disagree on the interface: steps: .* has 40, .* has 50"):
        load_experiment([f_file, g_file])
    result = run_main(["run", f_file, g_file, "--in-process"])
    assert result.returncode == 2 and "steps" in result.stderr


def test_a_party_without_its_part_of_the_data_is_told_at_load(tmp_path: Path):
    f_file, g_file = _hosts(tmp_path)
    raw = tomllib.loads(g_file.read_text())
    raw["data"].pop("labels")
    with pytest.raises(ConfigError, match="needs labels|no labels|needs 'features', 'labels'"):
        parse_experiment(raw, str(g_file))
    raw = tomllib.loads(f_file.read_text())
    raw["stage"]["model"][-1]["out"] = 7
    with pytest.raises(ConfigError, match=r"outputs shape \(16, 7\), but the interface says .* \(16, 6\)"):
        parse_experiment(raw, str(f_file))
    raw = tomllib.loads(f_file.read_text())
    raw["stage"]["loss"] = "softmax_cross_entropy"
    with pytest.raises(ConfigError, match="exactly the last stage"):
        parse_experiment(raw, str(f_file))


def test_epochs_count_the_batches_of_the_training_rows_on_every_side(tmp_path: Path):
    interface = _interface(epochs=3)
    interface.pop("steps")
    f_file, g_file = _hosts(tmp_path, interface, interface)
    f_exp, g_exp = load_experiment(f_file), load_experiment(g_file)
    train_rows = ROWS - ROWS // 4
    assert f_exp.steps == g_exp.steps == 3 * (train_rows // BATCH)
    data = f_exp.build_data()
    epochs = [data.epoch_order(e) for e in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs) and not np.array_equal(epochs[0], epochs[1])
    assert np.array_equal(g_exp.build_data().epoch_order(1), epochs[1])      # the same shuffle on each side


def test_split_writes_files_that_train_bitwise_like_the_combined_experiment(tmp_path: Path):
    # In this process (the README's blocks run `distgrad split` as a command): a unit test.
    result = run_main(["split", "digits", tmp_path / "parties"])
    assert result.returncode == 0, result.stderr
    f_file, g_file = tmp_path / "parties" / "f" / "f.toml", tmp_path / "parties" / "g" / "g.toml"
    f_raw, g_raw = tomllib.loads(f_file.read_text()), tomllib.loads(g_file.read_text())
    assert f_raw["interface"] == g_raw["interface"]
    assert "labels" not in f_raw["data"] and "features" not in g_raw["data"]
    assert "loss" not in f_raw["stage"] and g_raw["stage"]["model"] != f_raw["stage"]["model"]
    again = run_main(["split", "digits", tmp_path / "parties"])
    assert again.returncode == 2 and "already exist" in again.stderr
    combined = train_in_process(load_experiment("digits"), steps=30)
    parties = train_in_process(load_experiment([f_file, g_file]), steps=30)
    assert parties["params"] == combined["params"] and parties["test_accuracy"] == combined["test_accuracy"]


def _csv_experiment(tmp_path: Path) -> Path:
    """A combined experiment over one CSV file (a header, features by name, the labels one column)."""
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(ROWS, 4)).round(3), rng.integers(0, CLASSES, ROWS)
    lines = ["a,b,c,d,label", *(",".join([*map(str, row), str(label)]) for row, label in zip(x, y))]
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "rows.csv").write_text("\n".join(lines) + "\n")
    path = tmp_path / "source" / "csv-parties.toml"
    path.write_text(toml_document({"data": {"kind": "csv", "path": "rows.csv", "header": True,
                                            "features": ["d", "b", "a"], "labels": "label", "batch": BATCH,
                                            "feature_scale": 0.5, "test_fraction": 0.25}},
                                  {"name": "csv-parties", "steps": 20, "seed": 4}) + """
[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 3, out = 6 }, { type = "tanh" }]
optimizer = { type = "adam", lr = 0.01 }

[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 6, out = 3 }]
optimizer = { type = "adam", lr = 0.01 }
loss = "softmax_cross_entropy"
""")
    return path


@pytest.mark.parametrize("source", ["digits-halves", "csv"])
def test_split_gives_each_party_a_folder_of_its_own_data_that_runs_wherever_it_is_copied(tmp_path: Path,
                                                                                         source: str):
    """Each party's folder holds its stage file and its own data only (a feature party only its columns, the
    label owner only the labels), its paths relative to the file: moved elsewhere, the folders train bitwise
    as the combined experiment."""
    experiment = load_experiment(_csv_experiment(tmp_path) if source == "csv" else source)
    paths = split_experiment(experiment, tmp_path / "parties")
    names = experiment.stage_names
    assert paths == [tmp_path / "parties" / name / f"{name}.toml" for name in names]
    for name in names:
        assert sorted(p.name for p in (tmp_path / "parties" / name).iterdir()) == [f"{name}.npz", f"{name}.toml"]
        table = tomllib.loads(paths[names.index(name)].read_text())
        assert table["data"]["path"] == f"{name}.npz" and "columns" not in table["stage"]
        with np.load(tmp_path / "parties" / name / f"{name}.npz") as npz:
            arrays = {key: npz[key] for key in npz.files}
        if name == names[-1]:
            assert list(arrays) == ["labels"] and arrays["labels"].shape == (experiment.build_data(
                stage=name).rows,)
        else:
            width = len(experiment.spec(name).columns or [0, 0, 0])
            assert list(arrays) == ["features"] and arrays["features"].shape[1] == width
    moved = []
    for name, path in zip(names, paths):                 # each party's folder copied to its own "host"
        (tmp_path / f"host-{name}").mkdir()
        moved.append(Path(shutil.move(path.parent, tmp_path / f"host-{name}" / name)) / path.name)
    combined = train_in_process(experiment, steps=20)
    parties = train_in_process(load_experiment(moved), steps=20)
    assert parties["params"] == combined["params"] and parties["test_accuracy"] == combined["test_accuracy"]


@pytest.mark.parametrize("name", ["seed-reverse", "chain-regression", "digits-clients", "mlp-classify"])
def test_every_builtin_splits_into_files_with_its_interface(tmp_path: Path, name: str):
    paths = split_experiment(load_experiment(name), tmp_path)
    exp = load_experiment(name)
    assert [p.stem for p in paths] == exp.stage_names
    assert load_experiment(paths).interface_parts() == exp.interface_parts()


def test_split_carries_staleness_and_codecs_into_every_partys_interface(tmp_path: Path):
    """An experiment's ``staleness`` (steps in flight) and codecs are interface fields: every party's stage
    file says them (the split once failed with an internal error for staleness), and the files train
    bitwise as the combined experiment does."""
    digits = load_experiment("digits")
    raw = {**digits.raw, "staleness": 2, "activation_codec": "int8", "gradient_codec": "topk:8"}
    raw["data"] = {**raw["data"], "path": str(Path(digits.source).parent / raw["data"]["path"])}
    experiment = parse_experiment(raw, str(tmp_path / "stale-digits.toml"))
    paths = split_experiment(experiment, tmp_path / "parties")
    for path in paths:
        interface = tomllib.loads(path.read_text())["interface"]
        assert (interface["staleness"], interface["activation_codec"], interface["gradient_codec"]) == \
            (2, "int8", "topk:8")
    parties = load_experiment(paths)
    assert parties.interface_parts() == experiment.interface_parts() and parties.staleness == 2
    combined = train_in_process(experiment, steps=12, micro_batches=2)
    assert train_in_process(parties, steps=12, micro_batches=2)["params"] == combined["params"]


def test_a_chain_of_stage_files_evaluates_through_a_middle_stage_without_data(tmp_path: Path):
    digits = load_experiment("digits")
    raw = {"name": "digits-chain", "steps": 30, "seed": 1, "data": dict(digits.data),
           "stages": [{"name": "f", "model": [{"type": "dense", "name": "f1", "in": 64, "out": 32}, {"type": "tanh"}],
                       "optimizer": {"type": "adam", "lr": 0.01}},
                      {"name": "m", "model": [{"type": "dense", "name": "m1", "in": 32, "out": 16}, {"type": "relu"}],
                       "optimizer": {"type": "adam", "lr": 0.01}},
                      {"name": "g", "model": [{"type": "dense", "name": "g1", "in": 16, "out": 10}],
                       "optimizer": {"type": "adam", "lr": 0.01}, "loss": "softmax_cross_entropy"}]}
    raw["data"]["path"] = str(Path(digits.source).parent / raw["data"]["path"])
    paths = split_experiment(parse_experiment(raw, str(tmp_path / "chain.toml")), tmp_path / "parties")
    assert "data" not in tomllib.loads(paths[1].read_text())          # the middle party holds nothing
    result = run_launcher(["run", *paths, "--summary", tmp_path / "run.json"])
    assert result.returncode == 0, result.stderr
    reference = train_in_process(load_experiment(paths))
    summary = read_json(tmp_path / "run.json")
    assert summary["params"] == reference["params"]
    assert summary["test_accuracy"] == reference["test_accuracy"] and summary["test_count"] == 359


def test_a_middle_stage_without_data_passes_the_sample_order_on(tmp_path: Path):
    """f -> m -> g with a dataless m: g still compares its sample order with f's (relayed by m's hello)."""
    digits = load_experiment("digits")
    raw = {"name": "digits-chain", "steps": 5, "seed": 1, "data": dict(digits.data),
           "stages": [{"name": "f", "model": [{"type": "dense", "name": "f1", "in": 64, "out": 16}],
                       "optimizer": {"type": "sgd", "lr": 0.01}},
                      {"name": "m", "model": [{"type": "relu"}], "optimizer": {"type": "sgd", "lr": 0.01}},
                      {"name": "g", "model": [{"type": "dense", "name": "g1", "in": 16, "out": 10}],
                       "optimizer": {"type": "sgd", "lr": 0.01}, "loss": "softmax_cross_entropy"}]}
    raw["data"]["path"] = str(Path(digits.source).parent / raw["data"]["path"])
    paths = split_experiment(parse_experiment(raw, str(tmp_path / "chain.toml")), tmp_path / "parties")
    paths[2].write_text(paths[2].read_text().replace("test_fraction = 0.2", "test_fraction = 0.2\nsplit_seed = 7"))
    with pytest.raises(ConfigError, match="sample order"):        # the launcher compares the files first
        load_experiment(paths)
    from conftest import wait_for_file
    with StageProcess(["g", "--experiment", paths[2], "--bind", "tcp://127.0.0.1:*", "--ready-file",
                       tmp_path / "g.ready"], tmp_path / "g.log") as g:
        below = wait_for_file(tmp_path / "g.ready", g)
        with StageProcess(["m", "--experiment", paths[1], "--bind", "tcp://127.0.0.1:*", "--connect", below,
                           "--ready-file", tmp_path / "m.ready", "--peer-deadline", "3"], tmp_path / "m.log") as m:
            top = wait_for_file(tmp_path / "m.ready", m)
            f = run_cli(["stage", "f", "--experiment", paths[0], "--connect", top, "--peer-deadline", "3"])
    assert f.returncode == 4, f.stderr
    assert "sample order: m has 'c277" in f.stderr and "sample order: m has" in g.output


def test_split_copies_a_module_stage_s_code_next_to_its_file(tmp_path: Path):
    pytest.importorskip("torch", reason="a module stage is computed by torch (pip install 'distgrad[torch]')")
    from distgrad.stage.stage import Stage
    paths = split_experiment(load_experiment("digits-cnn-torch"), tmp_path)
    assert (tmp_path / "f" / "digits_cnn_torch.py").is_file() and not (tmp_path / "g" / "digits_cnn_torch.py").exists()
    stage = Stage.from_experiment(load_experiment(paths[0]), "f")
    assert stage.output_shape == (32, 256)
    with pytest.raises(ConfigError, match="already exist"):
        split_experiment(load_experiment("digits-cnn-torch"), tmp_path)


SHARED_MODULES = """
from torch import nn


def first():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU())


def middle():
    return nn.Sequential(nn.Linear(8, 8), nn.Tanh())
"""


def test_split_copies_a_module_file_that_two_stages_share_to_both_parties(tmp_path: Path):
    """Two stages whose modules come from one file: each party's folder gets its own copy (the second
    stage's copy used to replace the first's, leaving the data owner without its code)."""
    pytest.importorskip("torch", reason="a module stage is computed by torch (pip install 'distgrad[torch]')")
    from distgrad.stage.stage import Stage
    (tmp_path / "mods.py").write_text(SHARED_MODULES)
    (tmp_path / "chain.toml").write_text("""
name = "shared-module"
steps = 4
[data]
kind = "synthetic_regression"
seed = 5
samples = 64
features = 4
batch = 16
[[stages]]
name = "f"
module = "mods:first"
output = [8]
[[stages]]
name = "m"
module = "mods:middle"
output = [8]
[[stages]]
name = "g"
model = [{ type = "dense", name = "d", in = 8, out = 1 }]
loss = "mean_squared_error"
""")
    paths = split_experiment(load_experiment(tmp_path / "chain.toml"), tmp_path / "parties")
    assert [(path.parent / "mods.py").is_file() for path in paths] == [True, True, False]
    for path, name in zip(paths, ["f", "m", "g"]):
        assert Stage.from_experiment(load_experiment(path), name).output_shape[1:] == ((1,) if name == "g" else (8,))


@pytest.mark.parametrize("party,part,needle", [
    ("f", {"labels": "nowhere.npy"}, "stage 'f' names 'labels' in its [data], which it never reads: 'g' holds the "
                                     "labels (labels = 'last'); drop 'labels'"),
    ("g", {"features": "id"}, "stage 'g' names 'features' in its [data], which it never reads: the data owner(s) "
                              "['f'] hold the features; drop 'features'"),
], ids=["labels-at-the-data-owner", "features-at-the-label-owner"])
def test_a_party_naming_a_part_of_the_rows_it_never_reads_is_refused(tmp_path: Path, party: str, part: dict,
                                                                     needle: str):
    """Each party names only its own part: the other's part in its [data] was accepted and never read (a
    labels file that did not even exist)."""
    paths = dict(zip("fg", _hosts(tmp_path)))
    doc = tomllib.loads(paths[party].read_text())
    doc["data"].update(part)
    paths[party].write_text(toml_document(doc))
    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_experiment(paths[party])


def test_stage_files_that_differ_in_their_micro_batches_or_eval_every_are_refused(tmp_path: Path):
    """Whichever file comes first must not decide: the default micro-batches and evaluations are interface."""
    for field, value in (("micro_batches", 4), ("eval_every", 5)):
        f_file, g_file = _hosts(tmp_path / field, _interface(), _interface(**{field: value}))
        for files in ([f_file, g_file], [g_file, f_file]):
            with pytest.raises(ConfigError, match=f"disagree on the interface: {field}"):
                load_experiment(files)


def test_epochs_with_several_data_owners_is_refused():
    import copy
    exp = load_experiment("digits-clients")
    raw = copy.deepcopy(exp.raw)
    raw.pop("steps")
    raw["epochs"] = 2
    with pytest.raises(ConfigError, match="with several data owners"):
        parse_experiment(raw, exp.source)


def test_split_keeps_every_key_of_a_stage_table(tmp_path):
    """Every stage key a combined experiment and a stage file both take reaches the party's own file
    (``scheduler`` and ``privacy_meter`` were dropped: the split party trained without them)."""
    import tomllib
    from distgrad.config import schema
    from distgrad.config.parse import BUILTIN_DIR
    raw = tomllib.loads((BUILTIN_DIR / "digits-cnn-torch.toml").read_text())
    raw["data"]["path"] = str(BUILTIN_DIR / raw["data"]["path"])
    f, g = raw["stages"]
    f.update(scheduler={"type": "StepLR", "step_size": 10, "gamma": 0.5}, privacy_meter=True,
             clip_noise={"max_norm": 1.0, "sigma": 0.1}, input_guard={"max_r2": 0.9, "after": 10})
    g.update(privacy_meter=True, metrics=["f1"], keep_best="test_f1", max_norm=True,
             early_stopping={"metric": "test_loss", "patience": 3})
    set_keys = set(f) | set(g)
    shared = set(schema.COMBINED_STAGE_KEYS) & set(schema.STAGE_KEYS)
    # marvell needs a two-class task (digits has ten): test_defenses reads back what split writes of it
    # bottom needs a vertical experiment: test_active_party runs what split writes of it
    # dp_sgd needs the label owner's clip_noise too: test_budget splits it
    untried = shared - set_keys - {"framework", "model", "columns", "device", "label_dp", "nopeek", "marvell",
                                   "bottom", "dp_sgd"}
    assert not untried, f"give these keys a value here: {sorted(untried)}"
    combined = parse_experiment(raw, str(tmp_path / "combined.toml"))
    split_experiment(combined, tmp_path / "parties")
    parts = load_experiment([tmp_path / "parties" / "f" / "f.toml", tmp_path / "parties" / "g" / "g.toml"])
    for name in ("f", "g"):
        ours, theirs = combined.spec(name), parts.spec(name)
        for key in sorted(shared - {"name"}):
            field = {"clip_noise": "defenses", "max_norm": "defenses", "label_dp": "defenses",
                     "nopeek": "defenses", "marvell": "defenses", "dp_sgd": "defenses"}.get(key, key)
            assert getattr(theirs, field) == getattr(ours, field), (name, key)
