"""CSV data in and out: no row is ever dropped or guessed, a bad field is refused naming its line and
column, a party's features are matched to a CSV header by name, a file's errors stop ``distgrad run``
before any stage starts, and IDs reach the predictions' CSV as inert text."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.parse import load_experiment
from distgrad.stage.stage import Stage

from conftest import StageProcess, free_tcp_endpoint, run_cli, run_main, wait_for_file

FEATURES = ["a", "b", "c"]
ROWS = 40

EXPERIMENT = '''name = "csv-io"
steps = 3
seed = 1
{top}
[data]
kind = "csv"
path = "train.csv"
header = true
features = ["a", "b", "c"]
labels = "label"
id_column = "person"
batch = 4
{clients}
{stages}'''

TWO_STAGES = '''[[stages]]
name = "f"
model = [{ type = "dense", name = "f1", in = 3, out = 4 }, { type = "tanh" }]
optimizer = { type = "sgd", lr = 0.1 }

[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 4, out = 3 }]
optimizer = { type = "sgd", lr = 0.1 }
loss = "softmax_cross_entropy"
'''

CHAIN = TWO_STAGES.replace('[[stages]]\nname = "g"', '''[[stages]]
name = "m"
model = [{ type = "dense", name = "m1", in = 4, out = 4 }, { type = "tanh" }]
optimizer = { type = "sgd", lr = 0.1 }

[[stages]]
name = "g"''')

VERTICAL = '''[[stages]]
name = "p"
columns = [0, 1]
model = [{ type = "dense", name = "p1", in = 2, out = 2 }, { type = "tanh" }]
optimizer = { type = "sgd", lr = 0.1 }

[[stages]]
name = "q"
columns = [2]
model = [{ type = "dense", name = "q1", in = 1, out = 2 }, { type = "tanh" }]
optimizer = { type = "sgd", lr = 0.1 }

[[stages]]
name = "g"
model = [{ type = "dense", name = "g1", in = 4, out = 3 }]
optimizer = { type = "sgd", lr = 0.1 }
loss = "softmax_cross_entropy"
'''

TOPOLOGIES = {
    "two-stages": ("", "", TWO_STAGES),
    "chain": ("", "", CHAIN),
    "clients": ("", '[clients]\ncount = 2\nmode = "separate"\n', TWO_STAGES),
    "vertical": ('labels = "last"\naggregate = "concat"', "", VERTICAL),
    "labels-first": ('labels = "first"', "", TWO_STAGES),
}


def write_train(folder: Path, label: str | None = None, line: int = 7, bom: bool = False) -> Path:
    """``train.csv``: a header (person, a, b, c, label), then ``ROWS`` rows; the label of file line ``line``
    replaced by ``label`` when given."""
    rng = np.random.default_rng(0)
    rows = [[f"p{n}", *(f"{v:.4f}" for v in rng.normal(size=3)), str(n % 3)] for n in range(ROWS)]
    if label is not None:
        rows[line - 2][-1] = label
    text = "person,a,b,c,label\n" + "".join(",".join(row) + "\n" for row in rows)
    path = folder / "train.csv"
    path.write_text(("\ufeff" if bom else "") + text, encoding="utf-8")
    return path


def write_experiment(folder: Path, topology: str = "two-stages") -> Path:
    top, clients, stages = TOPOLOGIES[topology]
    path = folder / "e.toml"
    path.write_text(EXPERIMENT.format(top=top, clients=clients, stages=stages))
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The two-stage csv experiment trained in one process (halves saved) and split into parties."""
    root = tmp_path_factory.mktemp("csv-io")
    write_train(root)
    experiment = write_experiment(root)
    assert run_main(["run", experiment, "--in-process", "--save", root / "halves"]).returncode == 0
    assert run_main(["split", experiment, root / "parties"]).returncode == 0
    return root


def _expected(root: Path, rows: np.ndarray) -> list[int]:
    """The classes predicted in one process from the saved halves for float32 ``rows`` (a, b, c)."""
    exp = load_experiment(root / "e.toml")
    f, g = Stage.from_experiment(exp, "f"), Stage.from_experiment(exp, "g")
    f.load_parameters(root / "halves" / "f.npz")
    g.load_parameters(root / "halves" / "g.npz")
    return exp.final_loss.predict(g.forward(f.forward(rows.astype(np.float32))[0])[0]).tolist()


def _predict(root: Path, tmp_path: Path, rows: Path, *f_extra) -> list[list[str]]:
    """``distgrad predict`` of the split parties on ``rows``: both exit 0; the label owner's CSV, read back."""
    ready, output = tmp_path / "g.ready", tmp_path / "out.csv"
    parties = root / "parties"
    with StageProcess(["predict", parties / "g" / "g.toml", "--load", root / "halves" / "g.npz", "--output", output,
                       "--bind", "tcp://127.0.0.1:*", "--ready-file", ready], tmp_path / "g.log", distgrad=True) as g:
        endpoint = wait_for_file(ready, g)
        f = run_cli(["predict", parties / "f" / "f.toml", "--load", root / "halves" / "f.npz", "--input", rows,
                     "--connect", endpoint, *f_extra])
        assert f.returncode == 0, f.stderr
        assert g.wait() == 0, g.output
    with open(output, newline="", encoding="utf-8") as file:
        return list(csv.reader(file))


def _refused(root: Path, rows: Path, *f_extra) -> str:
    """``distgrad predict`` of the data owner on ``rows`` must exit 2 before it sends anything (the endpoint
    serves nothing; the old reading went on to wait for it). Returns its error output."""
    f = run_cli(["predict", root / "parties" / "f" / "f.toml", "--load", root / "halves" / "f.npz", "--input", rows,
                 "--connect", free_tcp_endpoint(), "--peer-deadline", "5", *f_extra])
    assert f.returncode == 2, f.stdout + f.stderr
    return f.stderr


VALUES = np.array([[0.5, -1.0, 2.0], [1.5, 0.25, -0.5], [-2.0, 1.0, 0.0], [0.0, 0.0, 1.0], [3.0, -3.0, 0.5]])


def _lines(values: np.ndarray) -> list[str]:
    return [",".join(f"{v:g}" for v in row) for row in values]


def test_a_byte_order_mark_on_a_csv_without_header_drops_no_row(trained: Path, tmp_path: Path):
    """What spreadsheet programs save as "CSV UTF-8" starts with a byte-order mark: 5 rows in, 5 predictions
    out, numbered 0 to 4 in the input's order."""
    rows = tmp_path / "rows.csv"
    rows.write_text("\ufeff" + "\n".join(_lines(VALUES)) + "\n", encoding="utf-8")
    table = _predict(trained, tmp_path, rows)
    assert table[0] == ["row", "prediction"]
    assert [line[0] for line in table[1:]] == ["0", "1", "2", "3", "4"]
    assert [int(line[1]) for line in table[1:]] == _expected(trained, VALUES)


@pytest.mark.parametrize("bad", ["0x13", "nan3", "1\x002", "1e400", "nan", "", "inf", "1_000"],
                         ids=["hex", "nan3", "nul", "1e400", "nan", "empty", "inf", "underscore"])
@pytest.mark.parametrize("line", [1, 3])
def test_a_bad_field_is_refused_naming_its_line_and_column_on_any_line(trained: Path, tmp_path: Path, bad: str,
                                                                        line: int):
    """One bad field among numbers, on the first line as on any other, is refused (exit 2) naming the file's
    line and the column: never taken for a header that drops the row, never sent for the label owner to
    refuse (1e400 is no float64)."""
    cells = [_lines(VALUES)[i].split(",") for i in range(5)]
    cells[line - 1][1] = bad
    rows = tmp_path / "rows.csv"
    rows.write_text("".join(",".join(row) + "\n" for row in cells), encoding="utf-8")
    stderr = _refused(trained, rows)
    assert f"line {line}, column 2 (data row {line})" in stderr, stderr
    assert repr(bad) in stderr or (bad == "" and "empty" in stderr), stderr


def test_a_bad_field_after_a_header_names_the_line_counting_the_header_and_the_columns_name(trained: Path,
                                                                                         tmp_path: Path):
    rows = tmp_path / "rows.csv"
    lines = _lines(VALUES)
    lines[2] = "1,oops,2"
    rows.write_text("a,b,c\n" + "\n\n".join(lines) + "\n", encoding="utf-8")      # blank lines count too
    stderr = _refused(trained, rows)
    assert "line 6, column 2 'b' (data row 3): 'oops' is not a number" in stderr, stderr


def test_a_split_partys_features_are_matched_to_a_csv_header_by_name(trained: Path, tmp_path: Path):
    """The split party's data is an npz; its feature names travel in its stage file, so a header with the
    same columns in another order (and a column it does not use) gives the combined experiment's
    predictions, and a header that does not name them is refused."""
    assert load_experiment(trained / "parties" / "f" / "f.toml").spec("f").data["feature_names"] == FEATURES
    rows = tmp_path / "rows.csv"
    order = [2, 0, 1]
    rows.write_text("c,a,extra,b\n" + "".join(
        f"{row[2]:g},{row[0]:g},7,{row[1]:g}\n" for row in VALUES), encoding="utf-8")
    table = _predict(trained, tmp_path, rows)
    assert [int(line[1]) for line in table[1:]] == _expected(trained, VALUES)
    assert order                                               # (the file's column order differs from a, b, c)
    renamed = tmp_path / "renamed.csv"
    renamed.write_text("a,b,x\n" + "\n".join(_lines(VALUES)) + "\n", encoding="utf-8")
    stderr = _refused(trained, renamed)
    assert "does not name the feature column(s) ['c']" in stderr, stderr


def test_a_combined_csv_experiment_reads_a_header_with_a_byte_order_mark_by_name(trained: Path, tmp_path: Path):
    """A CSV UTF-8 file with a header: its first name is ``person``, not ``\\ufeffperson``."""
    rows = tmp_path / "rows.csv"
    rows.write_text("\ufeffperson,c,b,a\n" + "".join(
        f"x{n},{row[2]:g},{row[1]:g},{row[0]:g}\n" for n, row in enumerate(VALUES)), encoding="utf-8")
    ready, output = tmp_path / "g.ready", tmp_path / "out.csv"
    with StageProcess(["predict", trained / "e.toml", "--stage", "g", "--load", trained / "halves" / "g.npz",
                       "--output", output, "--bind", "tcp://127.0.0.1:*", "--ready-file", ready], tmp_path / "g.log",
                      distgrad=True) as g:
        endpoint = wait_for_file(ready, g)
        f = run_cli(["predict", trained / "e.toml", "--stage", "f", "--load", trained / "halves" / "f.npz",
                     "--input", rows, "--connect", endpoint])
        assert f.returncode == 0, f.stderr
        assert g.wait() == 0, g.output
    assert output.read_text().splitlines() == ["person,prediction", *(
        f"x{n},{p}" for n, p in enumerate(_expected(trained, VALUES)))]


HOSTILE_IDS = ['=HYPERLINK("http://evil.example","click")', "+1+2", "-3", "@SUM(A1)", "\tTAB", "\rCR",
               "\x1b[31mred\x1b[0m", "line\nbreak", "plain", "\u202eevil"]


def test_ids_reach_the_output_csv_as_inert_text(trained: Path, tmp_path: Path):
    """An ID that a spreadsheet would evaluate starts with a single quote; control characters are written
    as escapes, so the output holds none and a terminal showing it obeys nothing."""
    rows = tmp_path / "rows.csv"
    values = np.resize(VALUES, (len(HOSTILE_IDS), 3))
    with open(rows, "w", newline="", encoding="utf-8") as file:
        writer = csv.writer(file)
        writer.writerow(["=id", *FEATURES])
        writer.writerows([key, *row] for key, row in zip(HOSTILE_IDS, values.tolist()))
    table = _predict(trained, tmp_path, rows, "--id-column", "=id")
    assert table[0] == ["'=id", "prediction"]
    assert [line[0] for line in table[1:]] == [
        '\'=HYPERLINK("http://evil.example","click")', "'+1+2", "'-3", "'@SUM(A1)", "'\\tTAB", "'\\rCR",
        "\\x1b[31mred\\x1b[0m", "line\\nbreak", "plain", "\\u202eevil"]
    assert [int(line[1]) for line in table[1:]] == _expected(trained, values)
    text = (tmp_path / "out.csv").read_text(encoding="utf-8")
    assert all(c.isprintable() or c == "\n" for c in text)


def test_text_cell_keeps_ordinary_ids_as_they_are():
    from distgrad.run.predict import text_cell

    assert [text_cell(key) for key in ["p1", "a b", "x=1", "2024-01-01", "é"]] == ["p1", "a b", "x=1", "2024-01-01",
                                                                                  "é"]
    assert text_cell("  =1") == "'  =1" and text_cell("\x00") == "\\x00"


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_a_word_among_the_labels_stops_distgrad_run_before_any_stage_starts(tmp_path: Path, topology: str):
    """The label column holds a species name on line 7: exit 2 naming the file's line and column, in every
    topology, before a stage process starts (run_main: starting one would fail this test)."""
    write_train(tmp_path, "setosa")
    result = run_main(["run", write_experiment(tmp_path, topology)])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "line 7, column 5 'label' (data row 6): 'setosa' is not a number" in result.stderr, result.stderr


def test_a_bad_label_in_a_partys_stage_file_stops_distgrad_run_before_any_stage_starts(tmp_path: Path):
    """Stage files as ``distgrad split`` writes them, the label owner's npz holding a label that is no class
    id: exit 2 before any stage starts."""
    write_train(tmp_path)
    assert run_main(["split", write_experiment(tmp_path), tmp_path / "parties"]).returncode == 0
    g_npz = tmp_path / "parties" / "g" / "g.npz"
    with np.load(g_npz) as npz:
        parts = dict(npz)
    parts["labels"] = parts["labels"].astype(np.float64)
    parts["labels"][5] = 1.5
    np.savez(g_npz, **parts)
    result = run_main(["run", tmp_path / "parties" / "f" / "f.toml", tmp_path / "parties" / "g" / "g.toml"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "data row 6" in result.stderr and "is not a class id" in result.stderr, result.stderr


@pytest.mark.parametrize("bad, needle", [
    ("0x13", "line 4, column 3 'b' (data row 3): '0x13' is not a number"),
    ("1e400", "line 4, column 3 'b' (data row 3): '1e400' is not a finite number")])
def test_a_bad_feature_in_training_data_names_its_line_and_column(tmp_path: Path, bad: str, needle: str):
    path = write_train(tmp_path)
    lines = path.read_text().splitlines()
    cells = lines[3].split(",")
    cells[2] = bad
    lines[3] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    result = run_main(["run", write_experiment(tmp_path), "--in-process"])
    assert result.returncode == 2 and needle in result.stderr, result.stderr


def test_training_data_saved_as_csv_utf8_reads_its_header(tmp_path: Path):
    """A byte-order mark before the header: the ID column is still ``person``, the run trains."""
    write_train(tmp_path, bom=True)
    result = run_main(["run", write_experiment(tmp_path), "--in-process"])
    assert result.returncode == 0, result.stderr


def test_align_reads_a_header_saved_as_csv_utf8(tmp_path: Path):
    from distgrad.align import read_table

    path = tmp_path / "bank.csv"
    path.write_text("\ufeffperson,x\np1,1\np2,2\n", encoding="utf-8")
    table = read_table(path, "person")
    assert table.header == ["person", "x"] and table.ids == ["p1", "p2"]


def test_header_flags_declare_the_first_line(trained: Path, tmp_path: Path):
    """--no-header: a first line of names is data, refused naming it; --header: a first line of numbers is
    a header, here one that does not name the party's features."""
    named = tmp_path / "named.csv"
    named.write_text("a,b,c\n" + "\n".join(_lines(VALUES)) + "\n", encoding="utf-8")
    assert "line 1, column 1 (data row 1): 'a' is not a number" in _refused(trained, named, "--no-header")
    numbered = tmp_path / "numbered.csv"
    numbered.write_text("\n".join(_lines(VALUES)) + "\n", encoding="utf-8")
    assert "does not name the feature column(s) ['a', 'b', 'c']" in _refused(trained, numbered, "--header")


def test_a_training_csv_value_beyond_float32_is_refused_naming_its_line(tmp_path: Path):
    """1e39 is a finite float64 and no float32: refused when the file is read, not trained on as inf."""
    path = write_train(tmp_path)
    lines = path.read_text().splitlines()
    cells = lines[5].split(",")
    cells[1] = "1e39"
    lines[5] = ",".join(cells)
    path.write_text("\n".join(lines) + "\n")
    result = run_main(["run", write_experiment(tmp_path), "--in-process"])
    assert result.returncode == 2 and "line 6, column 2 'a': 1e+39 is beyond float32's range" in result.stderr, \
        result.stderr


@pytest.mark.parametrize("text, needle", [
    ("person,c,a,b\nx1,2,0.5,-1\nx2,1,2,1e39\n", "line 3, column 4 'b' (data row 2): 1e+39 is not a finite number"),
    ("0.5,-1,2\n1,-1e39,3\n", "line 2, column 2 (data row 2): -1e+39 is not a finite number")],
    ids=["header-in-another-order", "no-header"])
def test_a_predict_input_value_beyond_float32_names_the_files_line_and_column(trained: Path, tmp_path: Path,
                                                                              text: str, needle: str):
    """A value beyond float32 in a CSV --input is named as every other bad field is: the file's line and its
    column in the file (with the header's name), not the position among the features read."""
    rows = tmp_path / "rows.csv"
    rows.write_text(text, encoding="utf-8")
    extra = ["--id-column", "person"] if text.startswith("person") else []
    assert needle in _refused(trained, rows, *extra)


def test_a_predict_input_that_is_a_device_is_refused_unread(trained: Path):
    """/dev/zero as --input was read without bound (20 GB within seconds): only a regular file is read."""
    assert "/dev/zero is not a regular file" in _refused(trained, Path("/dev/zero"))


@pytest.mark.parametrize("kind", ["fifo", "folder", "device"])
def test_every_csv_reader_refuses_what_is_not_a_regular_file(tmp_path: Path, kind: str):
    """The [data] and --input reader, distgrad init's and distgrad align's: a pipe (which would block or be
    read without end), a folder or a device is refused with the reason, before anything is read."""
    import os

    from distgrad.align import read_table
    from distgrad.config.csvfile import CsvColumns
    from distgrad.config.scaffold import read_table as init_table
    from distgrad.errors import ConfigError

    path = tmp_path / "rows.csv"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path = Path("/dev/zero")
    for read in (lambda: CsvColumns(path, False).records(), lambda: CsvColumns(path, True).first_row(),
                 lambda: init_table(path), lambda: read_table(path, "id")):
        with pytest.raises(ConfigError, match="is not a regular file"):
            read()


def test_a_header_with_an_unnamed_index_column_is_a_header(trained: Path, tmp_path: Path):
    """pandas writes its index under an empty name: the line is still a header, matched by name."""
    rows = tmp_path / "rows.csv"
    rows.write_text(",b,c,a\n" + "".join(f"{n},{row[1]:g},{row[2]:g},{row[0]:g}\n" for n, row in enumerate(VALUES)),
                    encoding="utf-8")
    table = _predict(trained, tmp_path, rows)
    assert [int(line[1]) for line in table[1:]] == _expected(trained, VALUES)


def test_a_non_finite_value_in_an_npy_input_is_refused_when_read(trained: Path, tmp_path: Path):
    rows = np.array(VALUES)
    rows[2, 1] = np.inf
    np.save(tmp_path / "rows.npy", rows)
    assert "data row 3, column 2: inf is not a finite number" in _refused(trained, tmp_path / "rows.npy")


def test_a_declared_header_of_numbers_only_is_refused_not_dropped(tmp_path: Path):
    """header = true with columns by index, and a file without its header line: the first row of data would
    be lost as a header, so the file is refused."""
    path = write_train(tmp_path)
    path.write_text("".join(line.replace("p", "", 1) + "\n" for line in path.read_text().splitlines()[1:]))
    experiment = write_experiment(tmp_path)
    experiment.write_text(experiment.read_text().replace('features = ["a", "b", "c"]', "features = [1, 2, 3]")
                          .replace('labels = "label"', "labels = 4").replace('id_column = "person"', "id_column = 0"))
    result = run_main(["run", experiment, "--in-process"])
    assert result.returncode == 2 and "header = true, but line 1 holds only numbers" in result.stderr, result.stderr


def test_a_stage_started_alone_reads_its_data_before_it_binds(tmp_path: Path):
    """``distgrad stage g`` on a file whose labels hold a word: exit 2 before it serves (run_main: opening its
    socket would fail this test), not when the data owner has connected."""
    write_train(tmp_path, "setosa")
    result = run_main(["stage", "g", "--experiment", write_experiment(tmp_path), "--bind", "tcp://127.0.0.1:*"])
    assert result.returncode == 2 and "'setosa' is not a number" in result.stderr, result.stderr
