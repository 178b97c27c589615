"""Data from files: each stage reads only its own part; the digits built-in learns."""

from __future__ import annotations

import csv
import fnmatch
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from distgrad.errors import ConfigError
from distgrad.config.data import build_data
from distgrad.config.parse import load_experiment

from conftest import read_json, run_cli, run_launcher, run_main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent

FILE_EXPERIMENT = """
name = "from-files"
steps = 60
seed = 1
[data]
{data}
batch = 16
test_fraction = 0.25
[[stages]]
name = "f"
model = [{{ type = "dense", name = "a", in = 5, out = 8 }}, {{ type = "tanh" }}]
optimizer = {{ type = "adam", lr = 0.01 }}
[[stages]]
name = "g"
model = [{{ type = "dense", name = "b", in = 8, out = 3 }}]
optimizer = {{ type = "adam", lr = 0.01 }}
loss = "softmax_cross_entropy"
"""


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(120, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    np.savez(tmp_path / "d.npz", feats=x, labs=y)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    header = "p,q,r,s,t,label"
    np.savetxt(tmp_path / "d.csv", np.column_stack([x, y]), delimiter=",", header=header, comments="", fmt="%.9g")
    return tmp_path


DATA_SPECS = {
    "npz": 'kind = "npz"\npath = "d.npz"\nfeatures = "feats"\nlabels = "labs"',
    "npy": 'kind = "npy"\nfeatures = "x.npy"\nlabels = "y.npy"',
    "csv": 'kind = "csv"\npath = "d.csv"\nheader = true\nfeatures = ["p", "q", "r", "s", "t"]\nlabels = "label"',
}


@pytest.mark.parametrize("kind", sorted(DATA_SPECS))
def test_file_sources_train_bitwise_equal_over_two_processes(files, kind):
    exp = files / f"{kind}.toml"
    exp.write_text(FILE_EXPERIMENT.format(data=DATA_SPECS[kind]))
    results = {}
    for mode, extra, run in (("inproc", ["--in-process"], run_main), ("two", [], run_cli)):
        path = files / f"{kind}-{mode}.json"
        result = run(["run", exp, "--summary", path, *extra])
        assert result.returncode == 0, result.stdout + result.stderr
        results[mode] = read_json(path)
    assert results["two"]["params"] == results["inproc"]["params"]
    assert results["two"]["test_accuracy"] == results["inproc"]["test_accuracy"]
    assert results["two"]["test_count"] == 30


def test_all_three_formats_hold_the_same_rows(files):
    batches = []
    for kind in sorted(DATA_SPECS):
        exp_path = files / f"{kind}.toml"
        exp_path.write_text(FILE_EXPERIMENT.format(data=DATA_SPECS[kind]))
        data = load_experiment(exp_path).build_data()
        batches.append((data.features(3), data.targets(3), data.test_targets()))
    for other in batches[1:]:
        for a, b in zip(batches[0], other):
            np.testing.assert_array_equal(a, b)


def test_each_stage_reads_only_its_own_part():
    exp = load_experiment("digits")
    at_f, at_g = exp.build_data(), exp.build_data()
    at_f.features(1), at_f.test_features()
    at_g.targets(1), at_g.test_targets()
    assert at_f._labels is None          # the data owner never read a label
    assert at_g._features is None        # the label owner never read a pixel


def test_bad_file_settings_are_refused(files):
    for data, needle in [('kind = "npz"\npath = "missing.npz"\nfeatures = "a"\nlabels = "b"', "not found"),
                         ('kind = "csv"\npath = "d.csv"\nfeatures = ["nope"]\nlabels = "label"\nheader = true',
                          "column not found")]:
        exp = files / "bad.toml"
        exp.write_text(FILE_EXPERIMENT.format(data=data))
        with pytest.raises(ConfigError, match=needle):
            load_experiment(exp)


def test_digits_reaches_95_percent_with_labels_only_at_g(tmp_path):
    summary, reference = tmp_path / "s.json", tmp_path / "r.json"
    result = run_launcher(["run", "digits", "--summary", summary])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "test accuracy" in result.stdout
    two = read_json(summary)
    assert two["test_accuracy"] >= 0.95, two["test_accuracy"]
    assert run_main(["run", "digits", "--in-process", "--summary", reference]).returncode == 0
    assert two["params"] == read_json(reference)["params"]
    assert two["test_accuracy"] == read_json(reference)["test_accuracy"]


def test_the_breast_cancer_file_has_569_rows_of_30_features_and_a_binary_diagnosis():
    with open(ROOT / "distgrad" / "datasets" / "breast_cancer.csv", newline="", encoding="utf-8") as f:
        header, *rows = csv.reader(f)
    assert len(header) == len(set(header)) == 32 and header[0] == "id" and header[-1] == "diagnosis"
    assert len(rows) == 569 and {len(row) for row in rows} == {32}
    assert len({row[0] for row in rows}) == 569
    assert np.isfinite(np.array([row[1:-1] for row in rows], dtype=np.float64)).all()
    diagnosis = [row[-1] for row in rows]
    assert set(diagnosis) == {"0", "1"} and diagnosis.count("0") == 212     # 0 malignant, 1 benign
    shipped = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["distgrad"]
    assert any(fnmatch.fnmatch("datasets/breast_cancer.csv", pattern) for pattern in shipped)


def _npy_experiment(tmp_path: Path, x, y) -> Path:
    """An experiment over ``x.npy`` and ``y.npy`` in ``tmp_path`` (5 features, 3 classes), written there."""
    np.save(tmp_path / "x.npy", x, allow_pickle=x.dtype.hasobject)
    np.save(tmp_path / "y.npy", y)
    exp = tmp_path / "npy.toml"
    exp.write_text(FILE_EXPERIMENT.format(data=DATA_SPECS["npy"]))
    return exp


@pytest.mark.parametrize("bad, needle", [
    (np.nan, r"x.npy: data row 7, feature column 3: nan is not a finite number \(for missing values set missing"),
    (np.inf, r"x.npy: data row 7, feature column 3: inf is not a finite number"),
    (1e300, r"x.npy: data row 7, feature column 3: 1e\+300 is beyond float32's range"),
])
def test_npy_and_npz_features_that_are_no_finite_float32_are_refused_before_any_stage_starts(tmp_path, bad, needle):
    """A NaN, an Inf or a value float32 cannot hold in an npy or npz file's features exits 2 naming the file, the
    row and the column before any stage starts, as a csv field does, never a failed run once training began."""
    x = np.random.default_rng(0).normal(size=(40, 5))
    x[6, 2] = bad
    y = np.arange(40) % 3
    result = run_main(["run", _npy_experiment(tmp_path, x, y)])
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(needle, result.stderr), result.stderr
    np.savez(tmp_path / "d.npz", feats=x, labs=y)
    with pytest.raises(ConfigError, match=r"d.npz: data row 7, feature column 3: "):
        build_data({"kind": "npz", "path": "d.npz", "features": "feats", "labels": "labs", "batch": 4}, 0,
                   tmp_path).check_readable()


@pytest.mark.parametrize("features, needle", [
    (np.ones((40, 5), complex), r"x.npy are complex128, not numbers"),
    (np.full((40, 5), "1.5"), r"x.npy are <U3, not numbers"),
    (np.ones((40, 5), object), r"x.npy cannot be read: it holds Python objects .*never unpickles"),
])
def test_npy_features_that_are_no_real_numbers_are_refused(tmp_path, features, needle):
    """Complex values (whose imaginary part a cast would drop), text and Python objects are no features."""
    result = run_main(["run", _npy_experiment(tmp_path, features, np.arange(40) % 3)])
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(needle, result.stderr), result.stderr


@pytest.mark.parametrize("content, needle", [
    (b"hello, not an array", r"x.npy is not a .npy file as numpy.save writes it"),
    (b"", r"x.npy is not a .npy file"),
    ("cut", r"x.npy cannot be read: the file is damaged or not what numpy.save writes"),
])
def test_an_npy_file_that_numpy_cannot_read_is_a_config_error_naming_it(tmp_path, content, needle):
    """A foreign, empty or cut-short ``.npy`` exits 2 naming the file (never numpy's traceback, nor its advice
    to unpickle the file)."""
    exp = _npy_experiment(tmp_path, np.ones((40, 5)), np.arange(40) % 3)
    whole = (tmp_path / "x.npy").read_bytes()
    (tmp_path / "x.npy").write_bytes(whole[:len(whole) // 2] if content == "cut" else content)
    result = run_main(["run", exp])
    assert result.returncode == 2, result.stdout + result.stderr
    assert re.search(needle, result.stderr), result.stderr
    assert "Traceback" not in result.stderr and "allow_pickle" not in result.stderr


def test_an_npz_file_that_is_no_archive_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "d.npz").write_bytes(b"PK\x03\x04 but no zip after all")
    with pytest.raises(ConfigError, match=r"d.npz is not a readable .npz archive"):
        build_data({"kind": "npz", "path": "d.npz", "features": "feats", "labels": "labs", "batch": 4}, 0, tmp_path)
    (tmp_path / "d.npz").write_bytes(b"x,y\n1,2\n")
    with pytest.raises(ConfigError, match=r"d.npz is not a .npz file as numpy.savez writes it"):
        build_data({"kind": "npz", "path": "d.npz", "features": "feats", "labels": "labs", "batch": 4}, 0, tmp_path)


@pytest.mark.parametrize("labels, label_dtype, needle", [
    (np.zeros((40, 2), np.int64), "int64", r"y.npy: the labels must be one value per row, shape \(rows,\), got "
                                           r"shape \(40, 2\)"),
    (np.where(np.arange(40) == 5, 1e30, 0.0), "int64", r"y.npy: data row 6: label 1e\+30 is not a class id: it is "
                                                        r"beyond int64's range"),
    (np.where(np.arange(40) == 5, 2 ** 63, 0).astype(np.uint64), "int64",
     r"y.npy: data row 6: label 9223372036854775808 is not a class id: it is beyond int64's range"),
])
def test_npy_labels_of_another_shape_or_beyond_int64_are_refused(tmp_path, labels, label_dtype, needle):
    """Labels are one value per row; a class id a cast to int64 would wrap around is named as it is."""
    np.save(tmp_path / "x.npy", np.ones((40, 5)))
    np.save(tmp_path / "y.npy", labels)
    table = {"kind": "npy", "features": "x.npy", "labels": "y.npy", "batch": 4, "label_dtype": label_dtype}
    with pytest.raises(ConfigError, match=needle):
        build_data(table, 0, tmp_path).check_readable()


@pytest.mark.parametrize("table", [
    {"kind": "csv", "path": "d.csv", "header": True, "features": ["p", "q", "label"], "labels": "label"},
    {"kind": "csv", "path": "d.csv", "header": True, "features": [0, 1, 5], "labels": "label"},
    {"kind": "npz", "path": "d.npz", "features": "labs", "labels": "labs"},
    {"kind": "npy", "features": "y.npy", "labels": "./y.npy"},
])
def test_labels_among_the_features_are_refused(files, table):
    """Features stay with the data owner and labels with the label owner: a [data] whose features include the
    label column (member, file) would hand the labels to the data owner, and is refused saying so."""
    with pytest.raises(ConfigError, match=r"are also among the features .*only the label owner may read"):
        build_data({**table, "batch": 4}, 0, files)


@pytest.mark.parametrize("kind", ["csv", "npy"])
def test_a_float_label_beyond_float32_is_refused_naming_its_row(tmp_path, kind):
    """A finite label that float32 cannot hold (1e39) would become Inf and fail the run at its step: it is refused
    when the data is read, naming the row (a NaN label in an array file is kept: see test_nonfinite.py)."""
    y = np.linspace(-1, 1, 40)
    y[5] = 1e39
    np.save(tmp_path / "x.npy", np.ones((40, 2)))
    np.save(tmp_path / "y.npy", y)
    np.savetxt(tmp_path / "d.csv", np.column_stack([np.ones((40, 2)), y]), delimiter=",", fmt="%.9g")
    table = ({"kind": "csv", "path": "d.csv", "features": [0, 1], "labels": 2} if kind == "csv"
             else {"kind": "npy", "features": "x.npy", "labels": "y.npy"})
    where = "d.csv line 6, column 3" if kind == "csv" else "y.npy: data row 6"
    with pytest.raises(ConfigError, match=rf"{where}: label 1e\+39 is beyond float32's range"):
        build_data({**table, "batch": 4, "label_dtype": "float32"}, 0, tmp_path).check_readable()


@pytest.mark.parametrize("label, label_dtype, needle", [("1e30", "int64", r"label 1e\+30 is not a class id: it is beyond "
                                                                          r"int64's range"),
                                                        ("1e39", "float32", r"label 1e\+39 is beyond float32's range")])
def test_prepared_csv_labels_that_a_cast_would_change_are_refused(tmp_path, label, label_dtype, needle):
    """With data preparation (``standardize``), labels are read cell by cell; a value the cast to ``label_dtype``
    would wrap around or make infinite is refused there too, naming the line."""
    rows = [f"{k},{k % 2}" for k in range(20)]
    rows[4] = f"4,{label}"
    (tmp_path / "d.csv").write_text("a,y\n" + "\n".join(rows) + "\n")
    table = {"kind": "csv", "path": "d.csv", "header": True, "features": ["a"], "labels": "y", "batch": 4,
             "standardize": True, "label_dtype": label_dtype}
    with pytest.raises(ConfigError, match=rf"d.csv line 6, column 2 'y': {needle}"):
        build_data(table, 0, tmp_path).check_readable()


@pytest.mark.parametrize("header", [True, False])
def test_a_csv_line_with_more_fields_than_the_first_is_refused_naming_it(tmp_path, header):
    """An unquoted comma inside a field shifts every field after it: the line has more fields than the header (or
    the first line), and is refused naming it, never read with its columns shifted. Quoted commas, CRLF line ends,
    a byte-order mark and trailing blank lines are fine."""
    lines = [f'{k},"{k % 3}",{k % 2}' for k in range(20)]
    head = "a,note,y\r\n" if header else ""
    (tmp_path / "ok.csv").write_bytes(("\ufeff" + head + "\r\n".join(lines) + '\r\n21,"1,5",1\r\n\r\n\r\n')
                                      .encode())
    table = {"kind": "csv", "header": header, "features": [0], "labels": 2, "batch": 4}
    data = build_data({**table, "path": "ok.csv"}, 0, tmp_path)
    data.check_readable()
    assert data.rows == 21
    lines[6] = "6,1,5,0"
    (tmp_path / "bad.csv").write_text(head + "\n".join(lines) + "\n")
    line = 8 if header else 7
    with pytest.raises(ConfigError, match=rf"bad.csv line {line}: 4 fields, but line 1 has 3: is a comma inside a "
                                          rf"field that is not quoted\?"):
        build_data({**table, "path": "bad.csv"}, 0, tmp_path).check_readable()


def test_a_files_split_order_statistics_and_ids_are_the_ones_every_release_has_drawn(tmp_path):
    """The held-out split, the per-epoch orders, the learnt statistics, the prepared features, the IDs' digest
    and a shard of one small csv file, as distgrad has always computed them: a party of an older release and
    one of this release hold the same rows and the same statistics, bit for bit."""
    lines = ["id,size,colour,weight,label"] + [
        f"r{i},{'' if i == 4 else 0.5 * i + 1},{'red blue green'.split()[i % 3]},{(i * 7) % 5 - 1.25},"
        f"{'ab'[i % 2] if i != 9 else 'c'}" for i in range(16)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    data = build_data({"kind": "csv", "path": "t.csv", "header": True, "features": ["size", "colour", "weight"],
                       "labels": "label", "id_column": "id", "missing": "mean", "standardize": True,
                       "categorical": ["colour"], "class_names": True, "test_fraction": 0.25,
                       "validation_fraction": 0.125, "batch": 3}, 5, tmp_path)
    assert data.test_rows.tolist() == [7, 9, 0, 1, 3, 11] and data.validation_count == 2
    assert data.train_rows.tolist() == [13, 12, 10, 8, 6, 2, 5, 4, 15, 14]
    assert data.epoch_order(0).tolist() == [2, 10, 5, 15, 8, 12, 13, 14, 6, 4]
    assert data.epoch_order(1).tolist() == [14, 15, 13, 12, 2, 6, 10, 8, 5, 4]
    assert data.step_rows(5).tolist() == [12, 2, 6]
    assert data.preparation().to_json() == {
        "format": 1, "missing": "mean", "standardize": True, "classes": ["a", "b", "c"],
        "columns": [{"name": "size", "fill": 5.722222222222222, "mean": 5.722222222222222, "std": 2.1096486162275028},
                    {"name": "colour", "categories": ["blue", "green", "red"]},
                    {"name": "weight", "fill": 0.55, "mean": 0.55, "std": 1.5362291495737217}]}
    np.testing.assert_array_equal(data.features(2), np.array(
        [[1.3167016506195068, 0.0, 0.0, 1.0, -1.1717002391815186],
         [-0.34234243631362915, 0.0, 1.0, 0.0, -0.5207556486129761],
         [0.6056827306747437, 0.0, 0.0, 1.0, 1.4320780038833618]], np.float32))
    assert data.targets(2).tolist() == [1, 0, 0] and data.targets(2).dtype == np.int64
    assert data.row_ids()[:3] == ["r0", "r1", "r2"] and data.row_id_digest() == "cf3517c024fbb884"
    data.shard(1, 2)
    assert data.train_rows.tolist() == [12, 8, 2, 4, 14] and data.step_rows(2).tolist() == [12, 8, 2]
