"""Data preparation per party ([data]'s missing, standardize, categorical, class_names): statistics from the
party's own training rows only, kept by that party beside its parameters and in its checkpoints, applied
alike over processes and in process (bitwise), by ``distgrad predict`` (class names out), and refused with
the reason where they cannot apply."""

from __future__ import annotations

import csv
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from distgrad.config.data import build_data
from distgrad.config.parse import load_experiment
from distgrad.config.prepare import Preparation, read_preparation
from distgrad.errors import ConfigError
from distgrad.stage.stage import Stage

from conftest import StageProcess, read_json, run_cli, run_launcher, run_main, wait_for_file

SPECIES = ["Gentoo", "Adelie", "Chinstrap"]
ISLANDS = ["Torgersen", "Biscoe", "Dream"]
FEATURES = ["island", "bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g", "sex"]
ROWS = 150
WIDTH = 3 + 4 + 2           # island one-hot, four numbers, sex one-hot


def write_penguins(folder: Path, name: str = "penguins.csv", rows: int = ROWS) -> Path:
    """A penguins-like table: string species (the label), two categorical columns (island, sex; sex has
    NA cells), number columns on very different scales with NA and empty cells, an ID column."""
    rng = np.random.default_rng(5)
    lines = [["id", "species", *FEATURES]]
    for i in range(rows):
        k = int(rng.integers(0, 3))
        bill = 38.0 + 6.0 * k + rng.normal()
        depth = 18.0 - 2.0 * (k == 0) + 0.5 * rng.normal()
        flipper = 190.0 + 12.0 * (k == 0) + 3.0 * rng.normal()
        mass = 3700.0 + 1300.0 * (k == 0) + 200.0 * rng.normal()
        island = ISLANDS[k] if rng.random() < 0.8 else ISLANDS[int(rng.integers(0, 3))]
        sex = ["male", "female"][int(rng.integers(0, 2))]
        cells = [f"P{i:03d}", SPECIES[k], island, f"{bill:.1f}", f"{depth:.1f}", f"{flipper:.0f}", f"{mass:.0f}", sex]
        if i % 17 == 3:
            cells[3] = "NA"
        if i % 23 == 5:
            cells[6] = ""
        if i % 19 == 7:
            cells[7] = "NA"
        lines.append(cells)
    path = folder / name
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(lines)
    return path


DATA = '''kind = "csv"
path = "penguins.csv"
header = true
id_column = "id"
batch = 16
test_fraction = 0.2
'''
PREP = '''missing = "{missing}"
standardize = true
'''
F_DATA = DATA + '''features = ["island", "bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g", "sex"]
categorical = ["island", "sex"]
''' + PREP
G_DATA = DATA + '''labels = "species"
class_names = true
'''

F_STAGE = '''name = "f"
model = [{{ type = "dense", name = "f1", in = {width}, out = 8 }}, {{ type = "tanh" }}]
optimizer = {{ type = "adam", lr = 0.02 }}
{extra}'''
G_STAGE = '''name = "g"
model = [{{ type = "dense", name = "g1", in = 8, out = 3 }}]
optimizer = {{ type = "adam", lr = 0.02 }}
loss = "softmax_cross_entropy"
'''

COMBINED = '''name = "penguins"
steps = {steps}
seed = 3
eval_every = 10

[data]
''' + DATA + '''features = ["island", "bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g", "sex"]
labels = "species"
categorical = ["island", "sex"]
class_names = true
''' + PREP + '''
[[stages]]
''' + F_STAGE + '''
[[stages]]
''' + G_STAGE

INTERFACE = '''[interface]
name = "penguins"
stages = ["f", "g"]
batch = 16
activation = {{ shape = [8] }}
steps = {steps}
seed = 3
eval_every = 10
'''


def write_combined(folder: Path, missing: str = "mean", steps: int = 30, extra: str = "") -> Path:
    write_penguins(folder)
    path = folder / "penguins.toml"
    path.write_text(COMBINED.format(steps=steps, missing=missing, width=WIDTH, extra=extra))
    return path


def write_parties(folder: Path, missing: str = "mean", steps: int = 30, extra: str = "") -> tuple[Path, Path]:
    """Stage files f.toml and g.toml, each party's [data] its own part of its own copy of the table."""
    paths = []
    for name, stage, data in (("f", F_STAGE.format(width=WIDTH, extra=extra), F_DATA.format(missing=missing)),
                              ("g", G_STAGE.format(), G_DATA)):
        party = folder / name
        party.mkdir(parents=True, exist_ok=True)
        write_penguins(party)
        path = party / f"{name}.toml"
        path.write_text(INTERFACE.format(steps=steps) + f"\n[stage]\n{stage}\n[data]\n{data}")
        paths.append(path)
    return paths[0], paths[1]


# --- the statistics ------------------------------------------------------------------------------------------

def _source(folder: Path, **options):
    write_penguins(folder)
    table = {"kind": "csv", "path": "penguins.csv", "header": True, "id_column": "id", "batch": 16,
             "features": FEATURES, "labels": "species", **options}
    return build_data(table, 3, folder)


def _column(folder: Path, name: str) -> list[str]:
    with open(folder / "penguins.csv", newline="", encoding="utf-8") as f:
        return [row[name] for row in csv.DictReader(f)]


@pytest.mark.parametrize("missing", ["mean", "median"])
def test_statistics_come_from_the_training_rows_only(tmp_path: Path, missing: str):
    """Each number column is filled with its training rows' mean / median and standardised by their mean and
    standard deviation: none of the held-out rows' values counts, so changing them changes nothing."""
    data = _source(tmp_path, missing=missing, standardize=True, categorical=["island", "sex"], class_names=True)
    prep = data.preparation()
    bill = np.array([float(v) if v != "NA" else np.nan for v in _column(tmp_path, "bill_length_mm")])
    train = bill[data.train_rows]
    present = train[~np.isnan(train)]
    column = prep.columns[1]
    assert column.name == "bill_length_mm"
    assert column.mean == float(np.mean(present)) and column.std == float(np.std(present))
    assert column.fill == float(np.mean(present) if missing == "mean" else np.median(present))
    assert prep.columns[0].categories == sorted(ISLANDS) and prep.columns[5].categories == ["female", "male"]
    assert prep.classes == sorted(SPECIES)
    x = data.features_at(data.train_rows)
    assert x.shape == (len(data.train_rows), WIDTH)
    np.testing.assert_allclose(x[:, 3:7].mean(axis=0), 0, atol=0.05)        # standardised on its own rows
    # the held-out rows' values changed: the statistics are the same
    text = (tmp_path / "penguins.csv").read_text().splitlines()
    for row in data.test_rows:
        cells = text[row + 1].split(",")
        cells[3] = "999.0"
        text[row + 1] = ",".join(cells)
    (tmp_path / "penguins.csv").write_text("\n".join(text) + "\n")
    again = build_data({"kind": "csv", "path": "penguins.csv", "header": True, "id_column": "id", "batch": 16,
                        "features": FEATURES, "labels": "species", "missing": missing, "standardize": True,
                        "categorical": ["island", "sex"], "class_names": True}, 3, tmp_path)
    assert again.preparation() == prep


def test_class_names_are_sorted_and_labels_become_their_ids(tmp_path: Path):
    data = _source(tmp_path, class_names=True, missing="mean", categorical=["island", "sex"])
    species = _column(tmp_path, "species")
    assert data.classes() == ["Adelie", "Chinstrap", "Gentoo"]
    assert data.all_targets().tolist() == [sorted(SPECIES).index(s) for s in species]
    assert data.target_dtype == np.int64


def test_drop_rows_leaves_out_every_row_with_a_missing_cell_and_its_id(tmp_path: Path):
    data = _source(tmp_path, missing="drop_rows", categorical=["island", "sex"], class_names=True)
    with open(tmp_path / "penguins.csv", newline="", encoding="utf-8") as f:
        complete = [row["id"] for row in csv.DictReader(f) if all(row[c] not in ("", "NA") for c in FEATURES)]
    assert data.row_ids() == complete and data.rows == len(complete) < ROWS
    assert np.isfinite(data.features_at(np.arange(data.rows))).all()


def test_a_held_out_rows_unseen_category_is_all_zeros(tmp_path: Path):
    data = _source(tmp_path, missing="mean", categorical=["island", "sex"])
    text = (tmp_path / "penguins.csv").read_text().splitlines()
    row = int(data.test_rows[0])
    cells = text[row + 1].split(",")
    cells[2] = "Atlantis"
    text[row + 1] = ",".join(cells)
    (tmp_path / "penguins.csv").write_text("\n".join(text) + "\n")
    again = build_data({"kind": "csv", "path": "penguins.csv", "header": True, "batch": 16, "features": FEATURES,
                        "labels": "species", "missing": "mean", "categorical": ["island", "sex"]}, 3, tmp_path)
    assert again.features_at(np.array([row]))[0, :3].tolist() == [0.0, 0.0, 0.0]


def test_cells_are_read_as_one_cell_at_a_time_reads_them():
    """read_cells parses a column at once where it can: the values, the missing cells (NaN) and the refusals
    are those of the rule for one cell (csvfile.number, prepare.is_missing), for every mix of cells."""
    from distgrad.config.csvfile import number
    from distgrad.config.prepare import is_missing, read_cells

    kinds = [" 1.5 ", "-2e-3", "3", "1e308", "+4.", " .5", "1e-320", "", "NA", " nan ", "?", "-", "inf", "x",
             "1_0", "\u0661", "1e400", "  "]
    rng = np.random.default_rng(5)
    for _ in range(400):
        cells = [kinds[i] for i in rng.integers(0, len(kinds), int(rng.integers(0, 6)))]
        for allow in (False, True):
            one = [number(c) if number(c) is not None else np.nan if allow and is_missing(c) else None
                   for c in cells]
            if None in one:
                with pytest.raises(ConfigError):
                    read_cells(cells, lambda i: f"row {i}", allow)
            else:
                got = read_cells(cells, lambda i: f"row {i}", allow)
                assert got.dtype == np.float64 and np.array_equal(got, np.array(one, np.float64), equal_nan=True)


def test_the_statistics_survive_json_exactly(tmp_path: Path):
    prep = _source(tmp_path, missing="median", standardize=True, categorical=["island", "sex"],
                   class_names=True).preparation()
    assert Preparation.from_json(json.loads(json.dumps(prep.to_json())), "here") == prep


@pytest.mark.parametrize("options, needle", [
    ({"missing": "zero"}, "missing must be one of"),
    ({"categorical": ["species"]}, "not among the features"),
    ({"class_names": True, "label_dtype": "float32"}, "class_names maps"),
    ({"standardize": "yes"}, "'standardize' must be a"),
])
def test_bad_preparation_settings_are_refused_naming_the_key(tmp_path: Path, options: dict, needle: str):
    with pytest.raises(ConfigError, match=needle):
        _source(tmp_path, **options)


def test_without_missing_a_missing_cell_is_refused_naming_its_line(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"line 5, column 4 'bill_length_mm' \(data row 4\): 'NA' is not a "
                                          r"number \(set missing = \"mean\""):
        _source(tmp_path, standardize=True, categorical=["island", "sex"]).features(1)


def test_categorical_columns_of_npz_data_are_refused_with_the_reason(tmp_path: Path):
    np.savez(tmp_path / "d.npz", x=np.zeros((20, 3), np.float32), y=np.zeros(20, np.int64))
    with pytest.raises(ConfigError, match="npz data holds numbers only"):
        build_data({"kind": "npz", "path": "d.npz", "features": "x", "labels": "y", "batch": 4,
                    "categorical": [0]}, 0, tmp_path)


def test_npz_nan_cells_are_filled_and_standardised(tmp_path: Path):
    x = np.arange(40, dtype=np.float64).reshape(20, 2) * [1.0, 1000.0]
    x[3, 1] = np.nan
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(20) % 2)
    data = build_data({"kind": "npz", "path": "d.npz", "features": "x", "labels": "y", "batch": 4,
                       "missing": "mean", "standardize": True}, 0, tmp_path)
    values = data.features_at(np.arange(20))
    assert np.isfinite(values).all()
    np.testing.assert_allclose(values[data.train_rows].mean(axis=0), 0, atol=0.2)


@pytest.mark.parametrize("options", [{"missing": "mean"}, {"standardize": True},
                                     {"missing": "drop_rows", "standardize": True}])
def test_an_infinite_npz_value_is_refused_as_such_when_the_rows_are_prepared(tmp_path: Path, options: dict):
    """An inf among npz features is no missing value (NaN is): with a preparation it is refused naming its row
    and column as not finite, as without one (before: statistics of inf, then "beyond float32's range")."""
    x = np.random.default_rng(0).normal(size=(30, 3))
    x[5, 1], x[7, 2] = -np.inf, np.nan
    np.savez(tmp_path / "d.npz", x=x, y=np.arange(30) % 2)
    with pytest.raises(ConfigError, match=r"d.npz: data row 6, feature column 2: -inf is not a finite number"):
        build_data({"kind": "npz", "path": "d.npz", "features": "x", "labels": "y", "batch": 4, **options}, 0,
                   tmp_path).check_readable()


def test_drop_rows_is_refused_where_the_parties_rows_could_not_stay_aligned(tmp_path: Path):
    f, g = write_parties(tmp_path, missing="drop_rows")
    result = run_main(["run", f, g])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "drop_rows" in result.stderr and "cannot know which ones this party drops" in result.stderr, result.stderr


def test_split_refuses_what_an_npz_cannot_carry(tmp_path: Path):
    result = run_main(["split", write_combined(tmp_path), tmp_path / "parties"])
    assert result.returncode == 2 and "cannot carry" in result.stderr, result.stderr


# --- runs ----------------------------------------------------------------------------------------------------

def _runs_agree(tmp_path: Path, files: list[Path], save: str) -> dict:
    """``distgrad run FILES`` over processes and in process: the same parameters and held-out figures; the
    processes' run saves to ``save``. Returns its summary."""
    args = ["run", *files, "--summary"]
    assert run_main([*args, tmp_path / "ref.json", "--in-process", "--save", tmp_path / "ref"]).returncode == 0
    result = run_launcher([*args, tmp_path / "run.json", "--save", tmp_path / save])
    assert result.returncode == 0, result.stdout + result.stderr
    reference, summary = read_json(tmp_path / "ref.json"), read_json(tmp_path / "run.json")
    assert summary["params"] == reference["params"]
    assert summary.get("test_loss") == reference.get("test_loss")
    assert summary.get("test_accuracy") == reference.get("test_accuracy")
    written = sorted(p.name for p in (tmp_path / "ref").glob("*.prep.json"))
    assert written and written == sorted(p.name for p in (tmp_path / save).glob("*.prep.json"))
    for name in written:
        assert (tmp_path / save / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    return summary


@pytest.mark.parametrize("missing", ["mean", "median", "drop_rows"])
def test_a_combined_experiment_trains_bitwise_over_processes_and_in_process(tmp_path: Path, missing: str):
    summary = _runs_agree(tmp_path, [write_combined(tmp_path, missing)], "saved")
    assert summary["test_accuracy"] > 0.8
    f, g = read_preparation(tmp_path / "saved" / "f.npz"), read_preparation(tmp_path / "saved" / "g.npz")
    assert [c.name for c in f.columns] == FEATURES and f.classes is None      # each party keeps its own
    assert g.columns == [] and g.classes == sorted(SPECIES)


def test_stage_files_of_two_parties_train_bitwise_and_keep_each_partys_statistics(tmp_path: Path):
    f, g = write_parties(tmp_path)
    _runs_agree(tmp_path, [f, g], "saved")
    saved = json.loads((tmp_path / "saved" / "f.prep.json").read_text())
    assert "classes" not in saved and [c["name"] for c in saved["columns"]] == FEATURES
    assert json.loads((tmp_path / "saved" / "g.prep.json").read_text())["classes"] == sorted(SPECIES)


@pytest.mark.slow      # about 30 s loaded; test_validation_split's torch plateau run covers torch on prepared rows
def test_torch_stages_train_bitwise_on_prepared_rows(tmp_path: Path):
    pytest.importorskip("torch")
    f, g = write_parties(tmp_path, extra='framework = "torch"\n')
    g.write_text(g.read_text().replace('loss = "softmax_cross_entropy"', 'loss = "softmax_cross_entropy"\n'
                                                                        'framework = "torch"'))
    _runs_agree(tmp_path, [f, g], "saved")


# --- predict -------------------------------------------------------------------------------------------------

NEW_ROWS = [["id", *FEATURES],
            ["new1", "Biscoe", "50.1", "15.0", "220", "5600", "male"],
            ["new2", "Torgersen", "NA", "18.3", "190", "", "female"],
            ["new3", "Dream", "45.5", "17.9", "195", "3800", "NA"]]


def _write_rows(path: Path, rows: list[list[str]]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)
    return path


def _predict(f: Path, g: Path, saved: Path, tmp_path: Path, *f_extra: object, scores: bool = True
             ) -> tuple[int, list[list[str]], str]:
    """``distgrad predict`` of the two parties (f's extra flags ``f_extra``): f's exit code, the label owner's
    CSV read back (empty when f failed) and f's error output."""
    ready, output = tmp_path / "g.ready", tmp_path / "out.csv"
    output.unlink(missing_ok=True)
    ready.unlink(missing_ok=True)
    with StageProcess(["predict", g, "--load", saved / "g.npz", "--output", output, *(["--output-scores"] if scores
                       else []), "--bind", "tcp://127.0.0.1:*", "--ready-file", ready, "--peer-deadline", "20"],
                      tmp_path / "g.log", distgrad=True) as server:
        endpoint = wait_for_file(ready, server)
        result = run_cli(["predict", f, "--load", saved / "f.npz", "--connect", endpoint, *f_extra])
        if result.returncode != 0:
            return result.returncode, [], result.stderr
        assert server.wait() == 0, server.output
    with open(output, newline="", encoding="utf-8") as file:
        return 0, list(csv.reader(file)), result.stderr


def _expected(f: Path, g: Path, saved: Path, x: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The class names and scores computed in this process from the saved parameters for prepared rows ``x``."""
    f_exp, g_exp = load_experiment(f), load_experiment(g)
    f_stage, g_stage = Stage.from_experiment(f_exp, "f"), Stage.from_experiment(g_exp, "g")
    f_stage.load_parameters(saved / "f.npz")
    g_stage.load_parameters(saved / "g.npz")
    y = g_stage.forward(f_stage.forward(x.astype(np.float32), training=False)[0], training=False)[0]
    classes = read_preparation(saved / "g.npz").classes
    return [classes[k] for k in g_exp.final_loss.predict(y).tolist()], g_exp.final_loss.scores(y)


@pytest.fixture(scope="module")
def trained_parties(tmp_path_factory) -> tuple[Path, Path, Path]:
    """Two parties' stage files trained in process, their parameters and statistics saved."""
    root = tmp_path_factory.mktemp("penguin-parties")
    f, g = write_parties(root)
    assert run_main(["run", f, g, "--in-process", "--save", root / "saved"]).returncode == 0
    return f, g, root / "saved"


def test_predict_prepares_new_rows_with_the_saved_statistics_and_writes_class_names(trained_parties, tmp_path):
    """A CSV of new rows with string categories, NA and empty cells: the predictions come back as class names
    with the rows' IDs, and the scores' columns are headed by the class names; both equal a computation in
    this process from the saved parameters and statistics."""
    f, g, saved = trained_parties
    rows = _write_rows(tmp_path / "new.csv", NEW_ROWS)
    code, table, err = _predict(f, g, saved, tmp_path, "--input", rows)
    assert code == 0, err
    prep = read_preparation(saved / "f.npz")
    assert table[0] == ["id", "prediction", "score_Adelie", "score_Chinstrap", "score_Gentoo"]
    assert [line[0] for line in table[1:]] == ["new1", "new2", "new3"]
    # the same rows prepared by hand from the saved statistics
    cols = prep.columns
    x = np.array([[*(1.0 * (row[1] == k) for k in cols[0].categories),
                   *(((c.fill if v in ("", "NA") else float(v)) - c.mean) / c.std for v, c in zip(row[2:6], cols[1:5])),
                   *(1.0 * (row[6] == k) for k in cols[5].categories)] for row in NEW_ROWS[1:]])
    names, scores = _expected(f, g, saved, x)
    assert [line[1] for line in table[1:]] == names
    assert set(names) <= set(SPECIES)
    np.testing.assert_allclose([[float(v) for v in line[2:]] for line in table[1:]], scores, rtol=1e-6)


def test_predict_of_the_held_out_rows_gives_class_names(trained_parties, tmp_path):
    f, g, saved = trained_parties
    code, table, err = _predict(f, g, saved, tmp_path, scores=False)
    assert code == 0, err
    data = load_experiment(f).build_data(stage="f")
    ids = data.row_ids()
    assert [line[0] for line in table[1:]] == [ids[i] for i in data.test_rows]
    names, _ = _expected(f, g, saved, data.test_features())
    assert [line[1] for line in table[1:]] == names


def test_predict_refuses_a_category_never_seen_in_training(trained_parties, tmp_path):
    f, g, saved = trained_parties
    rows = _write_rows(tmp_path / "new.csv", [NEW_ROWS[0], ["x", "Atlantis", "40", "18", "190", "3700", "male"]])
    code, _, err = _predict(f, g, saved, tmp_path, "--input", rows)
    assert code == 2, err
    assert "line 2, column 2 'island'" in err and "category 'Atlantis'" in err and "never seen" in err, err


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "{not json", "\udcff"],
                         ids=["nested-100000-deep", "not-json", "not-utf8"])
def test_damaged_saved_statistics_are_a_config_error_naming_the_file(tmp_path: Path, text: str):
    """The statistics beside a --load file are a file a user copies between hosts: whatever is wrong with
    it is a ConfigError naming it (exit 2), never a RecursionError traceback."""
    (tmp_path / "f.prep.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    with pytest.raises(ConfigError, match="cannot read the saved data preparation: .*f.prep.json"):
        read_preparation(tmp_path / "f.npz")


def test_predict_without_the_saved_statistics_is_refused_with_the_reason(trained_parties, tmp_path):
    f, g, saved = trained_parties
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "f.npz").write_bytes((saved / "f.npz").read_bytes())
    (copy / "g.npz").write_bytes((saved / "g.npz").read_bytes())
    (copy / "g.prep.json").write_bytes((saved / "g.prep.json").read_bytes())
    rows = _write_rows(tmp_path / "new.csv", NEW_ROWS)
    code, _, err = _predict(f, g, copy, tmp_path, "--input", rows)
    assert code == 2 and "f.prep.json is missing" in err, err


# --- predict with the labels at the data owner (labels = "first") ----------------------------------------------

LABELS_FIRST = 'labels = "first"\ntarget = { shape = [], dtype = "int64" }\n'


def write_labels_first_parties(folder: Path) -> tuple[Path, Path]:
    """Stage files f.toml (features and the species names: it holds the labels and sends them, labels =
    "first") and g.toml (the model's top, no [data])."""
    (folder / "f").mkdir(parents=True, exist_ok=True)
    (folder / "g").mkdir(parents=True, exist_ok=True)
    write_penguins(folder / "f")
    interface = INTERFACE.format(steps=30) + LABELS_FIRST
    f, g = folder / "f" / "f.toml", folder / "g" / "g.toml"
    f.write_text(interface + f"\n[stage]\n{F_STAGE.format(width=WIDTH, extra='')}\n[data]\n"
                 f"{F_DATA.format(missing='mean')}labels = \"species\"\nclass_names = true\n")
    g.write_text(interface + f"\n[stage]\n{G_STAGE.format()}")
    return f, g


def test_predict_with_the_labels_at_the_data_owner_writes_its_class_names(tmp_path: Path):
    """labels = "first": the data owner holds the labels and their names, saved beside its parameters; the last
    stage computes the predictions. Its CSV still gives class names, and the score columns are headed by them,
    both as computed in this process from the saved parameters and the data owner's names."""
    f, g = write_labels_first_parties(tmp_path)
    saved = tmp_path / "saved"
    assert run_main(["run", f, g, "--in-process", "--save", saved]).returncode == 0
    assert read_preparation(saved / "f.npz").classes == sorted(SPECIES) and not (saved / "g.prep.json").exists()
    code, table, err = _predict(f, g, saved, tmp_path)
    assert code == 0, err
    assert table[0] == ["id", "prediction", "score_Adelie", "score_Chinstrap", "score_Gentoo"]
    data = load_experiment(f).build_data(stage="f")
    f_stage, g_stage = Stage.from_experiment(load_experiment(f), "f"), Stage.from_experiment(load_experiment(g), "g")
    f_stage.load_parameters(saved / "f.npz")
    g_stage.load_parameters(saved / "g.npz")
    y = g_stage.forward(f_stage.forward(data.test_features(), training=False)[0], training=False)[0]
    loss = load_experiment(g).final_loss
    assert [line[1] for line in table[1:]] == [sorted(SPECIES)[k] for k in loss.predict(y).tolist()]
    np.testing.assert_allclose([[float(v) for v in line[2:]] for line in table[1:]], loss.scores(y), rtol=1e-6)


M_STAGE = '''name = "m"
model = [{ type = "dense", name = "m1", in = 8, out = 8 }, { type = "tanh" }]
optimizer = { type = "adam", lr = 0.02 }
'''


def write_labels_first_combined(folder: Path, framework: str = "numpy", topology: str = "chain") -> Path:
    """The combined penguins experiment with labels = "first" and a middle stage m (``topology = "chain"``) or
    two data owners (``"clients"``), its stages computed by ``framework``; 8 steps (predictions are checked,
    not training)."""
    torch = '\nframework = "torch"\n' if framework == "torch" else "\n"
    experiment = write_combined(folder, steps=8)
    text = experiment.read_text().replace("seed = 3\n", "seed = 3\nlabels = \"first\"\n", 1)
    head, f_part, g_part = text.split("[[stages]]\n")
    g_part = g_part.replace("\nloss", f"{torch}loss")
    middle = f"[[stages]]\n{M_STAGE.rstrip()}{torch}\n" if topology == "chain" else "[clients]\ncount = 2\n\n"
    experiment.write_text(f"{head}[[stages]]\n{f_part.rstrip()}{torch}\n{middle}[[stages]]\n{g_part}")
    return experiment


def _serve_in_a_thread(opts: Any, output: Path | None, connect: str | None, ready: Path, ctx: Any,
                       failures: list[BaseException], scores: bool = False) -> threading.Thread:
    """``serve_predictions`` of ``opts``'s stage in a thread of this process, on a real socket (its endpoint
    written to ``ready``); an exception it raises is appended to ``failures``."""
    from distgrad.run.options import StopFlag
    from distgrad.run.predict import serve_predictions

    def serve() -> None:
        try:
            serve_predictions(opts, "tcp://127.0.0.1:*", output, StopFlag(), connect, ready, ctx, scores)
        except BaseException as e:      # noqa: BLE001  (reported by the test)
            failures.append(e)

    ready.unlink(missing_ok=True)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not ready.exists() and not failures and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ready.exists(), failures
    return thread


@pytest.mark.parametrize("framework, topology", [("numpy", "chain"), ("torch", "chain"), ("numpy", "clients")])
def test_labels_at_the_data_owner_name_the_classes_it_predicts_in_every_topology(tmp_path: Path, framework: str,
                                                                                  topology: str):
    """labels = "first" in a combined experiment: three stages (data owner, middle, last; numpy and torch), or
    [clients] (the second data owner predicts). The data owner's class names pass any middle stage on to the
    last, whose .npy predictions are the names and whose scores come from the same outputs; the last stage
    keeps no statistics, and needs none."""
    import zmq
    from distgrad.run.options import StageOptions, StopFlag
    from distgrad.run.predict import NewRows, held_out_rows, send_predictions

    if framework == "torch":
        pytest.importorskip("torch")
    experiment = write_labels_first_combined(tmp_path, framework, topology)
    saved = tmp_path / "saved"
    assert run_main(["run", experiment, "--in-process", "--save", saved]).returncode == 0
    f_file = "f@1" if topology == "clients" else "f"
    assert sorted(p.name for p in saved.glob("*.prep.json")) == sorted(
        ["f@0.prep.json", "f@1.prep.json"] if topology == "clients" else ["f.prep.json"])
    exp = load_experiment(experiment)
    suffix = ".pt" if framework == "torch" else ".npz"
    options = {name: StageOptions(exp, name, exp.seed, load_path=saved / f"{f_file if name == 'f' else name}{suffix}",
                                  timeout_s=15, peer_deadline_s=15, client=1 if topology == "clients" and name == "f"
                                  else None) for name in exp.stage_names}
    output, failures, ctx = tmp_path / "out.npy", [], zmq.Context()
    try:
        threads = [_serve_in_a_thread(options["g"], output, None, tmp_path / "g.ready", ctx, failures, scores=True)]
        endpoint = (tmp_path / "g.ready").read_text().strip()
        if topology == "chain":
            threads.append(_serve_in_a_thread(options["m"], None, endpoint, tmp_path / "m.ready", ctx, failures))
            endpoint = (tmp_path / "m.ready").read_text().strip()
        rows = NewRows(held_out_rows(exp, "f", exp.seed, options["f"].load_path).features)     # no IDs: .npy output
        sent = send_predictions(options["f"], endpoint, rows, StopFlag(), ctx)
        for thread in threads:
            thread.join(20)
            assert not thread.is_alive()
    finally:
        ctx.term()
    assert not failures, failures
    x = rows.features
    for name in exp.stage_names:
        stage = Stage.from_experiment(exp, name)
        stage.load_parameters(options[name].load_path)
        x = stage.forward(x, training=False)[0]
    names = np.load(output)
    assert sent == len(names) and names.dtype.kind == "U"
    assert names.tolist() == [sorted(SPECIES)[k] for k in exp.final_loss.predict(x).tolist()]
    np.testing.assert_allclose(np.load(tmp_path / "out.scores.npy"), exp.final_loss.scores(x), rtol=1e-6)


def test_a_prediction_hellos_class_names_are_checked_and_a_refused_one_changes_nothing(tmp_path: Path,
                                                                                          monkeypatch):
    """The class names a data owner's hello carries (labels = "first") are refused unless they are one distinct,
    non-empty string per output of the last stage, and always where the labels stay at the last stage (its
    own [data] names its classes); a refused hello opens no prediction. Accepted, they name the predictions
    and the score columns. The data owner refuses to send names too long for a hello's header."""
    from distgrad.run import handshake
    from distgrad.run import predict
    from distgrad.run.options import StageOptions
    from distgrad.run.predict import PredictionServer, travelling_class_names
    from distgrad.errors import ProtocolError
    from distgrad.wire import messages as wire
    from distgrad.wire.messages import ErrorCode, Message

    experiment = write_combined(tmp_path)
    last = load_experiment(experiment)
    experiment.write_text(experiment.read_text().replace("seed = 3\n", "seed = 3\nlabels = \"first\"\n", 1))
    first = load_experiment(experiment)

    def hello(exp: Any, names: Any) -> Message:
        message = handshake.hello(exp, "f", exp.seed, exp.cuts[0], "run1", [0], 0, 1)
        message.body.update(purpose="predict", rows=2, class_names=names)
        return message

    server = PredictionServer(StageOptions(first, "g", first.seed), tmp_path / "out.csv", None, output_scores=True)
    for names, code in ((["a", "b"], ErrorCode.MISMATCH), (["a", "a", "b"], ErrorCode.MALFORMED),
                        ("abc", ErrorCode.MALFORMED), (["a", 3, "c"], ErrorCode.MALFORMED),
                        (["a", "", "c"], ErrorCode.MALFORMED), ([], ErrorCode.MALFORMED)):
        with pytest.raises(ProtocolError) as info:
            server.handle(hello(first, names), 0.0)
        assert info.value.code == code and server.sessions == {}, names
    assert server.handle(hello(first, ["x", "=y", "z"]), 0.0).type == wire.WELCOME
    chunk = np.array([[1.0] * 8, [-1.0] * 8], np.float32)
    server.handle(Message(wire.PREDICT, "run1", 1, tensors={"activation": chunk}), 0.1)
    server.handle(Message(wire.BYE, "run1", 2, body={"chunks": 1, "rows": 2}), 0.2)
    with open(tmp_path / "out.csv", newline="", encoding="utf-8") as file:
        table = list(csv.reader(file))
    assert table[0] == ["row", "prediction", "score_x", "score_'=y", "score_z"]
    assert all(line[1] in ("x", "'=y", "z") for line in table[1:]) and len(table) == 3

    with pytest.raises(ProtocolError, match="labels stay at the last stage") as info:
        PredictionServer(StageOptions(last, "g", last.seed), tmp_path / "out.csv", None).handle(
            hello(last, ["x", "y", "z"]), 0.0)
    assert info.value.code == ErrorCode.MISMATCH

    assert travelling_class_names(first, "f", first.seed, None) == sorted(SPECIES)
    assert travelling_class_names(last, "f", last.seed, None) is None
    monkeypatch.setattr(predict, "CLASS_NAMES_MAX_BYTES", 20)
    with pytest.raises(ConfigError, match="travel to the last stage in the prediction's hello"):
        travelling_class_names(first, "f", first.seed, None)


def test_a_middle_stage_refuses_a_prediction_the_stage_below_refused_saying_why(tmp_path: Path):
    """A middle stage passes a prediction's hello on (the class names too); when the stage below refuses it
    (names for another count of outputs, IDs for an .npy output, ...), the middle stage refuses the data owner's
    hello with that reason and opens no prediction, instead of failing and leaving the data owner waiting."""
    from distgrad.errors import PeerRejected, ProtocolError
    from distgrad.run import handshake
    from distgrad.run.options import StageOptions
    from distgrad.run.predict import PredictionServer

    exp = load_experiment(write_labels_first_combined(tmp_path))

    class Below:
        """The link to a last stage that refuses every hello, keeping the ones it was sent."""
        sent: list = []

        def handshake(self, hello: Any) -> int:
            self.sent.append(hello)
            raise PeerRejected("mismatch", "the data owner's labels name 2 classes ['a', 'b'], and ...")

    server = PredictionServer(StageOptions(exp, "m", exp.seed), None, Below())   # type: ignore[arg-type]
    hello = handshake.hello(exp, "f", exp.seed, exp.cuts[0], "run1", [0], 0, 1)
    hello.body.update(purpose="predict", rows=2, class_names=["a", "b"])
    with pytest.raises(ProtocolError, match="the stage below refused this prediction: the data owner's labels") \
            as info:
        server.handle(hello, 0.0)
    assert info.value.code == "mismatch" and server.sessions == {}
    assert Below.sent[0].body["class_names"] == ["a", "b"] and Below.sent[0].body["role"] == "m"


# --- kill -9 -------------------------------------------------------------------------------------------------

def test_kill_9_and_resume_keep_the_statistics_bitwise(tmp_path: Path, stage_group):
    """Both stages killed with SIGKILL mid-run and restarted with --resume: the parameters equal the in-process
    run's bit for bit, and every checkpoint holds the party's statistics."""
    from distgrad.stage.checkpoint import load
    from test_faults import run_killing_each_stage

    experiment = write_combined(tmp_path, "median", steps=120)
    steps = "120"
    reference = read_json_in_process(tmp_path, experiment, steps)
    f_summary, g_summary, _ = run_killing_each_stage(stage_group, tmp_path, experiment, int(steps))
    assert f_summary["params"]["f"] == reference["f"] and g_summary["params"]["g"] == reference["g"]
    exp = load_experiment(experiment)
    for name in ("f", "g"):
        metas = [load(p).meta for p in sorted((tmp_path / "ckpt").glob(f"{name}-*.ckpt"))]
        assert metas and all(m["preparation"] == exp.preparation(stage=name).to_json() for m in metas)


def read_json_in_process(tmp_path: Path, experiment: Path, steps: str) -> dict:
    assert run_main(["run", experiment, "--in-process", "--steps", steps, "--summary", tmp_path / "ref.json"]
                    ).returncode == 0
    return read_json(tmp_path / "ref.json")["params"]


# --- vertical parties and clients ----------------------------------------------------------------------------

VERTICAL_INTERFACE = '''[interface]
name = "penguins-vertical"
stages = ["p", "q", "g"]
batch = 16
aggregate = "concat"
activation = [{ shape = [4] }, { shape = [4] }]
steps = 30
seed = 3
eval_every = 10
'''
PARTIES = {"p": (["island", "bill_length_mm", "body_mass_g"], ["island"], 3 + 2),
           "q": (["bill_depth_mm", "flipper_length_mm", "sex"], ["sex"], 2 + 2)}


def test_vertical_parties_each_prepare_their_own_columns_bitwise(tmp_path: Path):
    """Three parties' stage files: two feature parties, each with its own categorical column, NA cells and
    unscaled columns, and the label owner with the species names: over processes as in process, each
    party's statistics of its own columns only."""
    files = []
    for name, (features, categorical, width) in PARTIES.items():
        (tmp_path / name).mkdir()
        write_penguins(tmp_path / name)
        (tmp_path / name / f"{name}.toml").write_text(VERTICAL_INTERFACE + f"""
[stage]
name = "{name}"
model = [{{ type = "dense", name = "{name}1", in = {width}, out = 4 }}, {{ type = "tanh" }}]
optimizer = {{ type = "adam", lr = 0.02 }}

[data]
{DATA}features = {json.dumps(features)}
categorical = {json.dumps(categorical)}
missing = "mean"
standardize = true
""")
        files.append(tmp_path / name / f"{name}.toml")
    (tmp_path / "g").mkdir()
    write_penguins(tmp_path / "g")
    (tmp_path / "g" / "g.toml").write_text(VERTICAL_INTERFACE + f"""
[stage]
name = "g"
model = [{{ type = "dense", name = "g1", in = 8, out = 3 }}]
optimizer = {{ type = "adam", lr = 0.02 }}
loss = "softmax_cross_entropy"

[data]
{G_DATA}""")
    files.append(tmp_path / "g" / "g.toml")
    args = ["run", *files, "--summary"]
    assert run_main([*args, tmp_path / "ref.json", "--in-process", "--save", tmp_path / "ref"]).returncode == 0
    result = run_launcher([*args, tmp_path / "run.json", "--save", tmp_path / "saved"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert read_json(tmp_path / "run.json")["params"] == read_json(tmp_path / "ref.json")["params"]
    for name, (features, _, _) in PARTIES.items():
        prep = read_preparation(tmp_path / "saved" / f"{name}.npz")
        assert [c.name for c in prep.columns] == features and prep.classes is None
        assert prep == read_preparation(tmp_path / "ref" / f"{name}.npz")
    assert read_preparation(tmp_path / "saved" / "g.npz").classes == sorted(SPECIES)


def test_clients_train_bitwise_on_prepared_rows(tmp_path: Path):
    experiment = write_combined(tmp_path)
    experiment.write_text(experiment.read_text().replace("[[stages]]", "[clients]\ncount = 2\n\n[[stages]]", 1))
    _runs_agree(tmp_path, [experiment], "saved")
    assert (tmp_path / "saved" / "f@0.prep.json").read_bytes() == (tmp_path / "saved" / "f@1.prep.json").read_bytes()


# --- a setting is used or refused, never accepted and left unused --------------------------------------------

@pytest.mark.parametrize("party, key, value, needle", [
    ("g", "standardize", "true", "standardize scales feature columns, but this \\[data\\] holds none"),
    ("g", "missing", '"mean"', "missing = \"mean\" fills feature cells, but this \\[data\\] holds none"),
    ("g", "missing", '"median"', "missing = \"median\" fills feature cells, but this \\[data\\] holds none"),
    ("f", "class_names", "true", "class_names names the label column's values, but this \\[data\\] holds no labels"),
    ("g", "feature_scale", "2.0", "feature_scale = 2 scales feature columns, but this \\[data\\] holds none"),
])
def test_a_partys_preparation_key_that_has_nothing_to_prepare_is_refused(tmp_path: Path, party: str, key: str,
                                                                          value: str, needle: str):
    """In a party's own stage file, a label owner's [data] holds no features to scale or fill (labels are never
    filled in) and a data owner's no labels to name: the key would do nothing, so the run is refused (exit 2)
    naming it, as in the in-process reference."""
    f, g = write_parties(tmp_path)
    path = f if party == "f" else g
    text = path.read_text()
    key_line = f"{key} = {value}\n"
    path.write_text(text.replace(f"\n{key} = ", f"\n# {key} = ") + key_line)
    for args in (["run", f, g, "--in-process"], ["run", f, g]):
        result = run_main(args)
        assert result.returncode == 2, result.stdout + result.stderr
        assert re.search(needle, result.stderr), result.stderr


def test_a_huge_value_is_standardised_and_filled_with_finite_statistics(tmp_path: Path):
    """Values near float64's limit (+-1.7e308) have a mean, median and standard deviation that fit in float64:
    the statistics stay finite (so they can be saved as JSON) and the column is prepared as the same column
    on an ordinary scale is (standardising does not depend on the scale)."""
    small = np.linspace(-1.0, 1.0, 40).reshape(20, 2)
    small[5, 0] = np.nan
    np.savez(tmp_path / "small.npz", x=small, y=np.arange(20) % 2)
    np.savez(tmp_path / "huge.npz", x=small * [1.7e308, 1.0], y=np.arange(20) % 2)
    for missing in ("mean", "median"):
        prepared = []
        for name in ("small", "huge"):
            data = build_data({"kind": "npz", "path": f"{name}.npz", "features": "x", "labels": "y", "batch": 4,
                               "missing": missing, "standardize": True}, 0, tmp_path)
            json.dumps(data.preparation().to_json(), allow_nan=False)       # finite, savable statistics
            prepared.append(data.features_at(np.arange(20)))
        assert np.isfinite(prepared[1]).all()
        np.testing.assert_allclose(prepared[1], prepared[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("end", ["first", "last"])
@pytest.mark.parametrize("option", ['standardize = true', 'missing = "median"', 'class_names = true',
                                    'categorical = ["colour"]', 'feature_scale = 0.5'])
def test_the_cut_library_refuses_data_preparation_with_the_reason(tmp_path: Path, end: str, option: str):
    """A loop of one's own reads its own features and labels (the cut library takes only the sample order from
    [data]), so a preparation key there would be left unused: refused at either end, naming the key. So is a
    feature_scale other than 1 (which is what the daemons do without it)."""
    from distgrad.run.cut_interface import FIRST, LAST, cut_side

    rows = [["id", "colour", "size", "kind"]] + [[f"r{i}", str(i % 3), str(i), str(i % 2)] for i in range(40)]
    (tmp_path / "t.csv").write_text("".join(",".join(row) + "\n" for row in rows))
    data = {"kind": "csv", "path": str(tmp_path / "t.csv"), "header": True, "id_column": "id", "batch": 16,
            "test_fraction": 0.2, **({"features": ["colour", "size"]} if end == "first" else {"labels": "kind"})}
    if end == "first":
        data["labels"] = None
    key, value = (part.strip() for part in option.split("="))
    if key == "categorical" and end == "last":
        option, key, value = 'missing = "mean"', "missing", '"mean"'
    fields = {"name": "penguins", "stages": ["f", "g"], "batch": 16, "activation": {"shape": [8]}, "steps": 4}
    side = FIRST if end == "first" else LAST
    assert cut_side(side, None, {**fields, "data": data}).data is not None
    bad = {**data, key: json.loads(value)}
    # (a [data] without the features or labels a key prepares refuses it for that reason already)
    with pytest.raises(ConfigError, match=f"{key}.*(the cut library.*your loop reads|holds no)"):
        cut_side(side, None, {**fields, "data": bad})
    if key == "feature_scale":
        assert cut_side(side, None, {**fields, "data": {**data, key: 1.0}}).data is not None


def test_class_names_of_an_npz_take_text_labels_and_refuse_python_objects_with_the_reason(tmp_path: Path):
    """Class labels of any type: an npz's text array gives class names; an array of Python objects (what numpy
    saves for a pandas column of text) cannot be read without unpickling, so it is refused with what to do."""
    x = np.random.default_rng(0).normal(size=(30, 3))
    table = {"kind": "npz", "path": "d.npz", "features": "x", "labels": "y", "batch": 4, "class_names": True}
    np.savez(tmp_path / "d.npz", x=x, y=np.array(["emu", "cat", "dog"] * 10))
    data = build_data(table, 0, tmp_path)
    assert data.preparation().classes == ["cat", "dog", "emu"]
    assert data.targets_at(np.arange(3)).tolist() == [2, 0, 1]
    np.savez(tmp_path / "d.npz", x=x, y=np.array(["emu", "cat", "dog"] * 10, dtype=object))
    with pytest.raises(ConfigError, match=r"d.npz member 'y' cannot be read: .*never unpickles.*astype\(str\)"):
        build_data(table, 0, tmp_path).targets_at(np.arange(3))


@pytest.mark.parametrize("kind", ["npz", "npy"])
def test_class_names_of_bytes_labels_are_their_text(tmp_path: Path, kind: str):
    """Labels saved as bytes (dtype S, as numpy keeps a bytes array) name their classes by their text, not by
    Python's "b'...'" spelling; bytes that are no UTF-8 are refused with what to do."""
    x = np.random.default_rng(0).normal(size=(30, 3))
    table = {"kind": kind, "features": "x" if kind == "npz" else "x.npy", "labels": "y" if kind == "npz" else "y.npy",
             "batch": 4, "class_names": True, **({"path": "d.npz"} if kind == "npz" else {})}

    def save(y: np.ndarray) -> None:
        if kind == "npz":
            np.savez(tmp_path / "d.npz", x=x, y=y)
        else:
            np.save(tmp_path / "x.npy", x)
            np.save(tmp_path / "y.npy", y)

    save(np.array([b"emu", b"cat", "dog".encode()] * 10))
    data = build_data(table, 0, tmp_path)
    assert data.preparation().classes == ["cat", "dog", "emu"]
    assert data.targets_at(np.arange(3)).tolist() == [2, 0, 1]
    save(np.array([b"\xff", b"cat"] * 15))
    with pytest.raises(ConfigError, match=r"the labels are bytes that are not UTF-8 text .*astype\(str\)"):
        build_data(table, 0, tmp_path).targets_at(np.arange(3))


@pytest.mark.parametrize("kind", ["csv", "npz"])
def test_text_labels_without_class_names_are_refused_pointing_to_class_names(tmp_path: Path, kind: str):
    """Labels of text need class_names = true: a [data] without it is refused with that advice (a ConfigError,
    never a traceback), for a csv column as for an npz array of text."""
    if kind == "csv":
        table = {"kind": "csv", "path": "penguins.csv", "header": True, "id_column": "id", "batch": 16,
                 "features": ["bill_depth_mm"], "labels": "species"}
        write_penguins(tmp_path)
    else:
        table = {"kind": "npz", "path": "d.npz", "features": "x", "labels": "y", "batch": 4}
        np.savez(tmp_path / "d.npz", x=np.zeros((30, 3)), y=np.array(["emu", "cat", "dog"] * 10))
    with pytest.raises(ConfigError, match="set class_names = true"):
        build_data(table, 0, tmp_path).targets_at(np.arange(3))


@pytest.mark.parametrize("stages", [["f"], ["a", "b"]])
def test_split_of_a_standardized_experiment_trains_as_the_experiment(tmp_path: Path, stages: list[str]):
    """distgrad split copies standardize to each party holding features (one data owner, or vertical parties)
    and not to the label owner, whose [data] holds none: the parties' files train bitwise as the experiment
    (in process)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 4)) * [1.0, 10.0, 100.0, 1000.0]
    np.savez(tmp_path / "d.npz", x=x, y=(x[:, 0] + x[:, 3] / 1000 > 0).astype(np.int64))
    width = 4 // len(stages)
    parties = "".join(f'[[stages]]\nname = "{name}"\n' + (f"columns = {list(range(i * width, (i + 1) * width))}\n"
                                                          if len(stages) > 1 else "")
                      + f'model = [{{ type = "dense", name = "{name}1", in = {width}, out = 4 }}, {{ type = "tanh" }}]\n'
                      f'optimizer = {{ type = "adam", lr = 0.02 }}\n' for i, name in enumerate(stages))
    path = tmp_path / "e.toml"
    vertical = 'aggregate = "concat"' if len(stages) > 1 else ""
    path.write_text(f'name = "e"\nsteps = 12\nseed = 0\n{vertical}\n'
                    f'[data]\nkind = "npz"\npath = "d.npz"\nfeatures = "x"\nlabels = "y"\nbatch = 8\n'
                    f'standardize = true\n\n{parties}[[stages]]\nname = "g"\n'
                    f'model = [{{ type = "dense", name = "g1", in = {4 * len(stages)}, out = 2 }}]\n'
                    f'optimizer = {{ type = "adam", lr = 0.02 }}\nloss = "softmax_cross_entropy"\n')
    assert run_main(["split", path, tmp_path / "parties"]).returncode == 0
    files = [tmp_path / "parties" / name / f"{name}.toml" for name in [*stages, "g"]]
    assert all(("standardize = true" in f.read_text()) == (f.stem != "g") for f in files)
    assert run_main(["run", path, "--in-process", "--summary", tmp_path / "e.json"]).returncode == 0
    result = run_main(["run", *files, "--in-process", "--summary", tmp_path / "p.json"])
    assert result.returncode == 0, result.stderr
    assert read_json(tmp_path / "p.json")["params"] == read_json(tmp_path / "e.json")["params"]
