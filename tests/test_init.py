"""``distgrad init``: from a raw CSV (text labels, text categories, missing cells, unscaled columns) to stage
files that train on the first try, predict with class names and row IDs, for two parties and vertical
parties (columns shared out, or one CSV per party); refused with the reason (nothing written) for a missing
label column, an empty table, an out folder that holds files."""

from __future__ import annotations

import csv
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.data import held_out_split
from distgrad.config.parse import load_experiment
from distgrad.stage.stage import parameters_file

from conftest import StageProcess, read_json, run_launcher, run_main, wait_for_file

SPECIES = ["Adelie", "Chinstrap", "Gentoo"]
ISLANDS = ["Biscoe", "Dream", "Torgersen"]
HEADER = ["species", "island", "bill_length_mm", "bill_depth_mm", "flipper_length_mm", "body_mass_g", "sex"]


def write_penguins(path: Path, rows: int = 300, seed: int = 7) -> Path:
    """A penguins-like table with no ID column: string species (the label, one cell missing), two text
    categorical columns (island; sex, with NA cells), number columns on scales from 15 to 5000 with NA and
    empty cells. The species is learnable (from the numbers and the island) but not from one column alone."""
    rng = np.random.default_rng(seed)
    lines = [HEADER]
    for i in range(rows):
        k = int(rng.integers(0, 3))
        bill = 39.0 + 7.0 * (k != 0) + 2.5 * rng.normal()
        depth = 18.5 - 3.0 * (k == 2) + 1.0 * rng.normal()
        flipper = 190.0 + 4.0 * (k == 1) + 25.0 * (k == 2) + 7.0 * rng.normal()
        mass = 3700.0 + 1300.0 * (k == 2) + 400.0 * rng.normal()
        island = ISLANDS[k] if rng.random() < 0.6 else ISLANDS[int(rng.integers(0, 3))]
        sex = ["male", "female"][int(rng.integers(0, 2))]
        cells = [SPECIES[k], island, f"{bill:.1f}", f"{depth:.1f}", f"{flipper:.0f}", f"{mass:.0f}", sex]
        if i % 13 == 3:
            cells[2] = "NA"
        if i % 29 == 5:
            cells[5] = ""
        if i % 17 == 7:
            cells[6] = "NA"
        if i == 11:
            cells[0] = "NA"             # a row without a label: init leaves it out
        lines.append(cells)
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(lines)
    return path


def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.reader(f))


def _toml(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _predict(stage_files: list[Path], saved: Path, tmp_path: Path) -> list[list[str]]:
    """``distgrad predict`` of the held-out rows: the label owner (last file) serves, every other party sends."""
    *senders, owner = stage_files
    ready, output = tmp_path / "ready", tmp_path / "predictions.csv"
    with StageProcess(["predict", owner, "--load", saved / f"{owner.stem}.npz", "--output", output, "--bind",
                       "tcp://127.0.0.1:*", "--ready-file", ready, "--peer-deadline", "30"], tmp_path / "owner.log",
                      distgrad=True) as server:
        endpoint = wait_for_file(ready, server)
        procs = [StageProcess(["predict", f, "--load", saved / f"{f.stem}.npz", "--connect", endpoint],
                              tmp_path / f"{f.stem}.predict.log", distgrad=True) for f in senders]
        try:
            for proc in procs:
                assert proc.wait() == 0, proc.output
        finally:
            for proc in procs:
                proc.stop()
        assert server.wait() == 0, server.output
    return _read_csv(output)


# --- over processes: init, run, predict ------------------------------------------------------------------------

def test_init_then_run_trains_a_raw_table_and_predict_names_the_classes(tmp_path: Path):
    """`distgrad init penguins.csv --label species --out parties` then `distgrad run parties/f/f.toml
    parties/g/g.toml` trains with its own defaults, no preprocessing by hand, well above the majority class;
    `distgrad predict` writes class names by row ID."""
    table = write_penguins(tmp_path / "penguins.csv")
    out = tmp_path / "parties"
    init = run_main(["init", table, "--label", "species", "--out", out])
    assert init.returncode == 0, init.stderr
    f, g = out / "f" / "f.toml", out / "g" / "g.toml"
    assert f"wrote {f}" in init.stdout and f"distgrad run {f} {g}" in init.stdout, init.stdout
    assert "distgrad predict" in init.stdout
    saved, summary = tmp_path / "saved", tmp_path / "summary.json"
    run = run_launcher(["run", f, g, "--save", saved, "--summary", summary])
    assert run.returncode == 0, run.stderr[-3000:]
    result = read_json(summary)
    labels = [row[0] for row in _read_csv(table)[1:] if row[0] != "NA"]
    majority = Counter(labels).most_common(1)[0][1] / len(labels)
    assert result["test_accuracy"] >= max(0.8, majority + 0.3), (result["test_accuracy"], majority)
    assert (saved / "f.prep.json").exists() and (saved / "g.prep.json").exists()

    predictions = _predict([f, g], saved, tmp_path)
    assert predictions[0] == ["row_id", "prediction"]
    data = load_experiment(f).build_data(stage="f")
    ids = data.row_ids()
    assert [row[0] for row in predictions[1:]] == [ids[i] for i in data.test_rows]
    assert {row[1] for row in predictions[1:]} <= set(SPECIES)
    truth = {row[0]: row[1] for row in _read_csv(out / "g" / "g.csv")[1:]}
    right = sum(truth[row[0]] == row[1] for row in predictions[1:])
    assert right / (len(predictions) - 1) >= 0.8


def test_init_vertical_parties_of_one_table_train_over_processes(tmp_path: Path):
    """--parties 'a:...' 'b:...': two feature parties and the label owner g, each with only its own columns
    (one with text categories and missing cells), train together over processes."""
    table = write_penguins(tmp_path / "penguins.csv")
    out = tmp_path / "v"
    init = run_main(["init", table, "--label", "species", "--out", out, "--parties",
                     "a:island,bill_length_mm,sex", "b:bill_depth_mm,flipper_length_mm,body_mass_g"])
    assert init.returncode == 0, init.stderr
    paths = [out / name / f"{name}.toml" for name in ("a", "b", "g")]
    assert _read_csv(out / "a" / "a.csv")[0] == ["row_id", "island", "bill_length_mm", "sex"]
    assert _read_csv(out / "g" / "g.csv")[0] == ["row_id", "species"]
    summary = tmp_path / "summary.json"
    run = run_launcher(["run", *paths, "--summary", summary, "--steps", "250"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert read_json(summary)["test_accuracy"] >= 0.75


# --- what the files say ----------------------------------------------------------------------------------------

def test_init_chooses_the_preparation_from_the_table_and_says_why(tmp_path: Path):
    table = write_penguins(tmp_path / "penguins.csv")
    out = tmp_path / "parties"
    result = run_main(["init", table, "--label", "species", "--out", out])
    assert result.returncode == 0, result.stderr
    f_text = (out / "f" / "f.toml").read_text()
    f_file, g_file = _toml(out / "f" / "f.toml"), _toml(out / "g" / "g.toml")
    assert f_file["interface"] == g_file["interface"]
    data = f_file["data"]
    assert data["kind"] == "csv" and data["path"] == "f.csv" and data["id_column"] == "row_id"
    assert data["split_seed"] == g_file["data"]["split_seed"] == 0     # the width holds under another --seed
    assert data["features"] == HEADER[1:]
    assert data["categorical"] == ["island", "sex"]
    assert data["missing"] == "median" and data["standardize"] is True
    missing_line = next(line for line in f_text.splitlines() if line.startswith("missing = "))
    assert "#" in missing_line and "median" in missing_line.split("#", 1)[1]     # said in a comment
    assert "labels" not in data and "species" not in _read_csv(out / "f" / "f.csv")[0]
    # the input width after one-hot: 3 islands + 4 numbers + 2 sexes
    assert f_file["stage"]["model"][0]["in"] == 9
    assert g_file["data"]["labels"] == "species" and g_file["data"]["class_names"] is True
    assert "features" not in g_file["data"]
    assert g_file["stage"]["loss"] == "softmax_cross_entropy" and g_file["stage"]["model"][-1]["out"] == 3
    # the row without a label is left out of both parties' files, in the same order
    f_rows, g_rows = _read_csv(out / "f" / "f.csv"), _read_csv(out / "g" / "g.csv")
    assert len(f_rows) == len(g_rows) == 300 and [r[0] for r in f_rows] == [r[0] for r in g_rows]
    assert "12" not in {r[0] for r in g_rows}
    exp = load_experiment([out / "f" / "f.toml", out / "g" / "g.toml"])
    assert exp.stage_names == ["f", "g"]
    assert "median" in result.stdout and "classification" in result.stdout


def test_init_leaves_out_a_column_whose_values_are_all_in_held_out_rows(tmp_path: Path):
    """A sparse column (a number column and a text column, each with one value) whose only value lies in a
    held-out row has no training-row statistics: init leaves it out and says why, instead of writing stage
    files that do not load."""
    rows = 40
    held_out = int(held_out_split(rows, 0, 0.2)[0][0])        # a test row of the split the files will use
    rng = np.random.default_rng(3)
    lines = [["x", "rare_number", "rare_text", "y"]] + [
        [f"{rng.normal():.3f}", "5.0" if i == held_out else "", "z" if i == held_out else "NA", "ab"[i % 2]]
        for i in range(rows)]
    with open(tmp_path / "t.csv", "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(lines)
    out = tmp_path / "parties"
    result = run_main(["init", tmp_path / "t.csv", "--label", "y", "--out", out])
    assert result.returncode == 0, result.stderr
    assert _toml(out / "f" / "f.toml")["data"]["features"] == ["x"]
    for name in ("rare_number", "rare_text"):
        assert f"left out column {name!r}: every cell of the training rows is missing" in result.stdout
    assert run_main(["run", out / "f" / "f.toml", out / "g" / "g.toml", "--in-process", "--steps", "3"]
                    ).returncode == 0


def test_init_sizes_the_output_to_the_classes_of_labels_with_stray_spaces(tmp_path: Path):
    """Label cells with spaces around them ("Gentoo " beside "Gentoo") are one class, as the label owner's data
    reads them: the model has one output per class, so predict can name every score's class."""
    table = write_penguins(tmp_path / "penguins.csv", rows=60)
    lines = _read_csv(table)
    for i, row in enumerate(lines[1:]):
        row[0] = row[0] + " " if i % 3 == 0 and row[0] != "NA" else row[0]
    with open(table, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows(lines)
    out = tmp_path / "parties"
    result = run_main(["init", table, "--label", "species", "--out", out])
    assert result.returncode == 0, result.stderr
    assert "classification of 3 classes" in result.stdout
    g = out / "g" / "g.toml"
    assert _toml(g)["stage"]["model"][-1]["out"] == 3
    assert load_experiment(g).build_data(stage="g").preparation().classes == SPECIES


def test_init_regression_for_a_label_of_many_numbers(tmp_path: Path):
    rng = np.random.default_rng(1)
    rows = [["id", "x1", "color", "y"]] + [[f"r{i}", f"{rng.normal() * 1000:.2f}", ["red", "blue"][i % 2],
                                             f"{rng.normal():.4f}"] for i in range(80)]
    path = tmp_path / "t.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = tmp_path / "out"
    result = run_main(["init", path, "--label", "y", "--out", out])
    assert result.returncode == 0, result.stderr
    g = _toml(out / "g" / "g.toml")
    assert g["stage"]["loss"] == "mean_squared_error" and g["stage"]["model"][-1]["out"] == 1
    assert g["data"]["label_dtype"] == "float32" and "class_names" not in g["data"]
    f = _toml(out / "f" / "f.toml")
    assert f["data"]["id_column"] == "id" and "missing" not in f["data"]      # the table's own IDs; no gap
    assert f["data"]["categorical"] == ["color"] and f["stage"]["model"][0]["in"] == 3
    assert run_main(["run", out / "f" / "f.toml", out / "g" / "g.toml", "--in-process", "--steps", "5"]).returncode == 0


def test_init_one_csv_per_party_joins_them_on_the_common_id(tmp_path: Path):
    """Three files with different rows: the parties' files hold the IDs every file holds, in ascending ID
    text (distgrad align's order); the label owner's other columns are its own features ('bottom'); the align commands are
    printed."""
    source = _read_csv(write_penguins(tmp_path / "penguins.csv"))
    header, body = source[0], source[1:]

    def part(name: str, columns: list[str], skip: int) -> Path:
        path = tmp_path / f"{name}.csv"
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["pid", *columns])
            for k, row in enumerate(body):
                if k % 10 != skip:
                    writer.writerow([f"P{k}", *(row[header.index(c) if c in header else 0] for c in columns)])
        return path

    left = part("left", ["island", "bill_length_mm"], 1)
    right = part("right", ["bill_depth_mm", "flipper_length_mm"], 2)
    owner = part("owner", ["species", "body_mass_g"], 3)
    out = tmp_path / "m"
    result = run_main(["init", left, right, owner, "--label", "species", "--out", out])
    assert result.returncode == 0, result.stderr
    ids = [[r[0] for r in _read_csv(out / name / f"{name}.csv")[1:]] for name in ("left", "right", "owner")]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 300 - 90      # the unlabelled row is one of left's gaps
    exp = load_experiment([out / n / f"{n}.toml" for n in ("left", "right", "owner")])
    assert exp.stage_names == ["left", "right", "owner"] and exp.aggregate == "concat"
    assert _toml(out / "owner" / "owner.toml")["stage"]["bottom"][0]["in"] == 1
    assert "distgrad align" in result.stdout and "--parties 3" in result.stdout
    assert run_main(["run", *[out / n / f"{n}.toml" for n in ("left", "right", "owner")], "--in-process",
                     "--steps", "5"]).returncode == 0


def test_the_printed_align_commands_give_the_rows_init_wrote_and_its_model_fits_them(tmp_path: Path):
    """Where each party aligns its own CSV (the printed `distgrad align` commands) instead of init's join, every
    party gets the rows init wrote, in the same order: so the same training rows, the same categories and the
    input width init sized the model to (in the label owner's order, a rare category moved between training
    and held-out rows and the run refused the aligned files: `takes (batch, 5), got (24, 4)`). The label
    owner's rows whose label is missing, which init leaves out, are named before the commands."""
    import random
    from distgrad.align import read_table, write_aligned
    rng = random.Random(3)
    ids = [str(i) for i in range(1, 121)]
    rng.shuffle(ids)
    with open(tmp_path / "bank.csv", "w", newline="") as f:
        csv.writer(f).writerows([["person", "city", "income"],
                                 *([i, "rare" if k == 0 else rng.choice("xyz"), rng.random()] for k, i in enumerate(ids))])
    labelled = [[i, rng.randint(0, 1)] for i in ids]
    with open(tmp_path / "labels.csv", "w", newline="") as f:
        csv.writer(f).writerows([["person", "bought"], *labelled, ["121", ""], ["122", ""]])   # two unlabelled
    with open(tmp_path / "bank.csv", "a", newline="") as f:
        csv.writer(f).writerows([["121", "x", 0.5], ["122", "y", 0.25]])
    out = tmp_path / "p"
    result = run_main(["init", tmp_path / "bank.csv", tmp_path / "labels.csv", "--label", "bought", "--out", out])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    first_align = next(k for k, line in enumerate(lines) if line.startswith("distgrad align"))
    assert lines[first_align - 1] == (f"# first remove from {tmp_path / 'labels.csv'} its 2 rows whose label "
                                      f"'bought' is missing (init left them out; a run refuses a missing label)")
    with open(tmp_path / "labels.csv", "w", newline="") as f:        # as the line says
        csv.writer(f).writerows([["person", "bought"], *labelled])
    tables = {name: read_table(tmp_path / f"{name}.csv", "person") for name in ("bank", "labels")}
    common = set(tables["bank"].ids) & set(tables["labels"].ids)
    aligned = {name: tmp_path / f"{name}.aligned.csv" for name in tables}
    for name, table in tables.items():          # what each party's distgrad align writes
        write_aligned(table, [k for k, key in enumerate(table.ids) if key in common], aligned[name])
        assert [r[0] for r in _read_csv(aligned[name])[1:]] == [r[0] for r in _read_csv(out / name / f"{name}.csv")[1:]]
        (out / name / f"{name}.csv").write_bytes(aligned[name].read_bytes())
    run = run_main(["run", out / "bank" / "bank.toml", out / "labels" / "labels.toml", "--in-process", "--steps", "3"])
    assert run.returncode == 0, run.stderr


def test_ids_written_otherwise_in_another_file_are_named_where_the_join_leaves_them_out(tmp_path: Path):
    """The join compares IDs as exact text ('7' is not '0007', nor ' 7', nor an accent written as a separate
    mark): where IDs match another file's only once spaces, Unicode form or a number's form are set aside,
    the refusal (too few common IDs) or the note of rows left out says how many and shows the first pair."""
    def write(name: str, rows: list[list[str]]) -> Path:
        with open(tmp_path / name, "w", newline="", encoding="utf-8") as f:
            csv.writer(f).writerows(rows)
        return tmp_path / name

    bank = write("bank.csv", [["person", "income"], *([str(i), str(i * 3 % 7)] for i in range(1, 41))])
    owner = write("labels.csv", [["person", "bought"], *([f"{i:04d}", str(i % 2)] for i in range(1, 41))])
    result = run_main(["init", bank, owner, "--label", "bought", "--out", tmp_path / "a"])
    assert result.returncode == 2 and "only 0 common IDs" in result.stderr, result.stderr
    assert f"40 IDs of {bank} match one of {owner} only when spaces, Unicode form or a number's form are set " \
           f"aside (the first '1' and '0001')" in result.stderr, result.stderr
    owner = write("labels.csv", [["person", "bought"], *([str(i), str(i % 2)] for i in range(1, 39)),
                                 [" 39", "1"], ["Jose\u0301", "0"]])
    write("bank.csv", [["person", "income"], *([str(i), str(i * 3 % 7)] for i in range(1, 40)), ["Jos\u00e9", "2"]])
    result = run_main(["init", bank, owner, "--label", "bought", "--out", tmp_path / "b"])
    assert result.returncode == 0, result.stderr
    assert f"2 IDs of {bank} match one of {owner} only when" in result.stdout, result.stdout
    assert "'39' and ' 39'" in result.stdout or "'Jos\u00e9' and 'Jose\u0301'" in result.stdout, result.stdout


@pytest.mark.slow
def test_init_torch_stages_train_in_process_as_over_processes(tmp_path: Path):
    """--framework torch: every stage file builds its layers in PyTorch; the prepared rows train alike in one
    process and over processes (bitwise)."""
    pytest.importorskip("torch")
    table = write_penguins(tmp_path / "penguins.csv", rows=120)
    out = tmp_path / "parties"
    assert run_main(["init", table, "--label", "species", "--out", out, "--framework", "torch"]).returncode == 0
    paths = [out / "f" / "f.toml", out / "g" / "g.toml"]
    assert all(_toml(p)["stage"]["framework"] == "torch" for p in paths)
    summaries = [tmp_path / "inprocess.json", tmp_path / "processes.json"]
    assert run_main(["run", *paths, "--in-process", "--steps", "20", "--summary", summaries[0]]).returncode == 0
    run = run_launcher(["run", *paths, "--steps", "20", "--summary", summaries[1]])
    assert run.returncode == 0, run.stderr[-3000:]
    first, second = (read_json(s) for s in summaries)
    assert first["params"] == second["params"] and first["final_loss"] == second["final_loss"]


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_init_commands_load_the_parameter_files_training_saves(tmp_path: Path, framework: str):
    """Every parameters file the printed commands save or load is named as `distgrad run --save` names it for
    the stage's framework (NAME.pt for torch, NAME.npz for numpy), so the predict commands load what training
    wrote (a torch run's NAME.npz does not exist, and a torch state_dict saved under .npz is no npz)."""
    pytest.importorskip(framework)
    table = write_penguins(tmp_path / "penguins.csv", rows=60)
    out = tmp_path / "parties"
    init = run_main(["init", table, "--label", "species", "--out", out, "--framework", framework, "--parties",
                     "a:island,bill_length_mm", "b:bill_depth_mm,sex"])
    assert init.returncode == 0, init.stderr
    exp = load_experiment([out / n / f"{n}.toml" for n in ("a", "b", "g")])
    expected = {str(parameters_file(out / "trained", n, exp, n)) for n in ("a", "b", "g")}
    named = {word for line in init.stdout.splitlines() if line.startswith(("distgrad predict", "distgrad-stage"))
             for flag, word in zip(line.split(), line.split()[1:]) if flag in ("--save", "--load")}
    assert named == expected, init.stdout
    assert f"distgrad run {out / 'a' / 'a.toml'} {out / 'b' / 'b.toml'} {out / 'g' / 'g.toml'} --save " \
           f"{out / 'trained'}" in init.stdout


def test_init_refuses_the_label_as_the_id_column(tmp_path: Path):
    table = write_penguins(tmp_path / "penguins.csv")
    result = run_main(["init", table, "--label", "species", "--id-column", "species", "--out", tmp_path / "o"])
    assert result.returncode == 2 and "is the label column" in result.stderr


def test_init_takes_an_unnamed_first_column_of_distinct_values_as_the_ids(tmp_path: Path):
    """A table saved with its index (a first column with no name): that column is the rows' ID."""
    rows = [["", "x", "kind", "y"]] + [[str(i), f"{i % 7}", ["a", "b"][i % 2], ["no", "yes"][i % 3 == 0]]
                                       for i in range(40)]
    path = tmp_path / "indexed.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = tmp_path / "out"
    result = run_main(["init", path, "--label", "y", "--out", out])
    assert result.returncode == 0, result.stderr
    f_data = _toml(out / "f" / "f.toml")["data"]
    assert f_data["id_column"] == "column_1" and f_data["features"] == ["x", "kind"]
    assert [r[0] for r in _read_csv(out / "g" / "g.csv")[1:4]] == ["0", "1", "2"]


# --- refusals: nothing written ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case, expected", [
    ("no label", "the label column 'weight' is not in"),
    ("empty", "is empty"),
    ("header only", "no data row"),
    ("overlap", "given to both 'a' and 'b'"),
    ("unknown column", "does not hold"),
    ("bad spec", "NAME:COLUMN,COLUMN"),
    ("one class", "one value only"),
    ("infinite number", "column 'bill_length_mm' holds numbers, but '1e400' is not a finite number"),
    ("infinity", "column 'bill_length_mm' holds numbers, but '-inf' is not a finite number"),
    ("damaged number", "penguins.csv line 10: column 'bill_length_mm' holds numbers, but '0x13' is not a number"),
    ("number with a NUL", "line 10: column 'bill_length_mm' holds numbers, but '4\\x002' is not a number"),
])
def test_init_refuses_with_the_reason_and_writes_nothing(tmp_path: Path, case: str, expected: str):
    table = write_penguins(tmp_path / "penguins.csv")
    args = [table, "--label", "species"]
    if case == "no label":
        args = [table, "--label", "weight"]
    elif case == "empty":
        (tmp_path / "empty.csv").write_text("")
        args = [tmp_path / "empty.csv", "--label", "species"]
    elif case == "header only":
        (tmp_path / "h.csv").write_text(",".join(HEADER) + "\n")
        args = [tmp_path / "h.csv", "--label", "species"]
    elif case == "overlap":
        args += ["--parties", "a:island,sex", "b:sex"]
    elif case == "unknown column":
        args += ["--parties", "a:island,wingspan"]
    elif case == "bad spec":
        args += ["--parties", "island,sex"]
    elif case == "one class":
        rows = [["x", "y"]] + [[str(i), "same"] for i in range(20)]
        with open(tmp_path / "one.csv", "w", newline="") as f:
            csv.writer(f).writerows(rows)
        args = [tmp_path / "one.csv", "--label", "y"]
    elif case in ("infinite number", "infinity", "damaged number", "number with a NUL"):
        rows = _read_csv(table)         # a number column, not 300 categories of text, nor left out as text
        rows[9][2] = {"infinite number": "1e400", "infinity": "-inf", "damaged number": "0x13",
                      "number with a NUL": "4\x002"}[case]
        with open(table, "w", newline="") as f:
            csv.writer(f).writerows(rows)
    out = tmp_path / "out"
    result = run_main(["init", *args, "--out", out])
    assert result.returncode == 2 and expected in result.stderr, result.stderr
    assert not out.exists()


def test_init_never_writes_into_a_folder_that_holds_files_unless_forced(tmp_path: Path):
    table = write_penguins(tmp_path / "penguins.csv")
    out = tmp_path / "parties"
    (out / "f").mkdir(parents=True)
    (out / "f" / "f.toml").write_text("# another run's file\n")
    result = run_main(["init", table, "--label", "species", "--out", out])
    assert result.returncode == 2 and "exists and is not empty" in result.stderr and "--force" in result.stderr
    assert (out / "f" / "f.toml").read_text() == "# another run's file\n"
    assert run_main(["init", table, "--label", "species", "--out", out, "--force"]).returncode == 0
    assert "[interface]" in (out / "f" / "f.toml").read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_main(["init", table, "--label", "species", "--out", empty]).returncode == 0
