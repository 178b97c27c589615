"""The real vertical example: breast-cancer columns split between three parties, aligned, trained.

Runs ``python -m distgrad.vertical_example``'s steps as its documented command
does (real ``distgrad align`` and stage processes) and checks what the example
promises: every party's aligned file holds the same patients in the same order,
only patients all four hold, and the vertical model's held-out accuracy is
within one point of the same rows with every column in one process.
"""

from __future__ import annotations

import csv

from distgrad import vertical_example as example


def _ids(path) -> list[str]:
    with open(path, newline="") as f:
        return [row[0] for row in list(csv.reader(f))[1:]]


def test_the_breast_cancer_parties_align_and_train_within_a_point_of_one_process(tmp_path, capsys):
    assert example.main(["--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    files = {party: tmp_path / party / f"{party}.csv" for party in [*example.GROUPS, example.LABEL_OWNER]}
    held = [set(_ids(path)) for path in files.values()]
    assert all(len(ids) < 569 for ids in held) and len(set(map(frozenset, held))) == 4   # partly overlapping
    common = set.intersection(*held)
    aligned = [_ids(path.with_name(f"{path.stem}.aligned.csv")) for path in files.values()]
    assert all(ids == aligned[0] for ids in aligned) and set(aligned[0]) == common
    vertical = float(out.split("over the wire: ")[1].split()[0])
    central = float(out.split("one process:")[1].split()[0])
    assert abs(vertical - central) <= 0.01 and vertical >= 0.95, out


def test_the_label_owner_holding_the_worst_columns_trains_as_an_active_party(tmp_path, capsys):
    """``--active``: the label owner holds the ten 'worst' columns and the diagnosis, under its own bottom;
    two feature parties (mean, se) and it align and train (three processes)."""
    assert example.main(["--active", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    owner = tmp_path / example.LABEL_OWNER
    header = (owner / f"{example.LABEL_OWNER}.csv").read_text().splitlines()[0].split(",")
    assert header[1].startswith("worst") and len(header) == 12 and header[-1] == example.LABEL_OWNER
    assert not (tmp_path / "worst").exists()
    stage_file = (owner / f"{example.LABEL_OWNER}.toml").read_text()
    assert "bottom = [" in stage_file and 'stages = ["mean", "se", "diagnosis"]' in stage_file
    assert float(out.split("over the wire: ")[1].split()[0]) >= 0.95, out
