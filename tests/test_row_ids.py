"""``[data] id_column``: the parties' rows must be the same IDs in the same order, or they never train.

Each party's CSV (as ``distgrad align`` writes it) keeps its ID column; the
hello carries a digest of the IDs in file order (``row ids``), so files
whose rows are other IDs, or the same IDs in another order, are refused by
the launcher and in-process (exit 2) and at the handshake between processes
(exit 4), naming the field and both values.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.data import build_data
from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.config.split import split_experiment

from conftest import StageProcess, run_cli, run_main, wait_for_file

ROWS, FEATURES = 64, 3


def write_rows(path: Path, ids: list[str], seed: int = 0) -> None:
    """A CSV as align writes it: header, an ID column, three feature columns and a class label."""
    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["person", "a", "b", "c", "label"])
        for key in ids:
            writer.writerow([key, *(f"{v:.6f}" for v in rng.normal(size=FEATURES)), int(rng.integers(0, 2))])


def two_parties(tmp_path: Path, folder: str = "parties") -> list[Path]:
    ids = [f"p{n:03d}" for n in range(ROWS)]
    write_rows(tmp_path / "rows.csv", ids)
    raw = {"name": "ids", "steps": 4, "seed": 1,
           "data": {"kind": "csv", "path": str(tmp_path / "rows.csv"), "header": True, "features": ["a", "b", "c"],
                    "labels": "label", "id_column": "person", "batch": 8},
           "stages": [{"name": "f", "model": [{"type": "dense", "name": "f1", "in": FEATURES, "out": 4}],
                       "optimizer": {"type": "sgd", "lr": 0.1}},
                      {"name": "g", "model": [{"type": "dense", "name": "g1", "in": 4, "out": 2}],
                       "optimizer": {"type": "sgd", "lr": 0.1}, "loss": "softmax_cross_entropy"}]}
    return split_experiment(parse_experiment(raw, str(tmp_path / "ids.toml")), tmp_path / folder)


def test_the_id_column_is_checked_and_digested(tmp_path):
    ids = [f"p{n:03d}" for n in range(ROWS)]
    write_rows(tmp_path / "d.csv", ids)
    spec = {"kind": "csv", "path": "d.csv", "header": True, "features": ["a", "b", "c"], "labels": "label",
            "batch": 8}
    same = build_data({**spec, "id_column": "person"}, 0, tmp_path).row_id_digest()
    assert same == build_data({**spec, "id_column": 0}, 0, tmp_path).row_id_digest()
    assert build_data(spec, 0, tmp_path).row_id_digest() is None
    write_rows(tmp_path / "d.csv", ids[::-1])                          # the same IDs in another order
    assert build_data({**spec, "id_column": "person"}, 0, tmp_path).row_id_digest() != same
    cases = [({"id_column": "a"}, "id_column 'a' is also one of the features"),
             ({"id_column": "label"}, "id_column 'label' is also one of the labels"),
             ({"id_column": "nope"}, "csv column not found"),
             ({"id_column": True}, "must be a whole number or string")]
    for change, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_data({**spec, **change}, 0, tmp_path)
    with pytest.raises(ConfigError, match="npy data has no ID column"):
        build_data({"kind": "npy", "features": "x.npy", "labels": "y.npy", "id_column": "person"}, 0, tmp_path)
    with pytest.raises(ConfigError, match="names the member of the rows' IDs, not features or labels"):
        build_data({"kind": "npz", "path": "x.npz", "features": "x", "id_column": "x"}, 0, tmp_path)
    write_rows(tmp_path / "d.csv", ids[:-1] + [ids[0]])
    with pytest.raises(ConfigError, match="ID 'p000' is in lines 2 and 65"):
        build_data({**spec, "id_column": "person"}, 0, tmp_path).row_id_digest()


def misaligned(tmp_path: Path) -> list[Path]:
    """f's and g's stage files (as distgrad split writes them: the IDs in each party's npz), g's rows the
    same but their IDs in another order."""
    paths = two_parties(tmp_path, "misaligned")
    data = paths[1].parent / "g.npz"
    with np.load(data) as npz:
        parts = dict(npz)
    parts["ids"] = np.roll(parts["ids"], 1)
    np.savez(data, **parts)
    return paths


def test_files_of_other_ids_are_refused_before_any_stage_starts(tmp_path):
    paths = two_parties(tmp_path)
    assert "row ids" in load_experiment(paths).interface_parts()
    assert run_main(["run", *paths, "--in-process"]).returncode == 0      # the same IDs: it trains
    paths = misaligned(tmp_path)
    with pytest.raises(ConfigError, match="row ids"):
        load_experiment(paths)
    for extra in ([], ["--in-process"]):
        result = run_main(["run", *paths, *extra])
        assert result.returncode == 2, result
        assert "row ids" in result.stderr, result.stderr
        out = result.stdout + result.stderr
        assert "[f]" not in out and "[g]" not in out, f"a stage was started:\n{out}"   # the launcher's prefixes


def test_an_id_column_named_by_one_party_only_is_refused(tmp_path):
    """A party that names no ID column cannot be checked, so the other's check is not silently skipped."""
    paths = two_parties(tmp_path)
    paths[1].write_text(paths[1].read_text().replace('id_column = "ids"\n', ""))
    assert 'id_column' not in paths[1].read_text()
    with pytest.raises(ConfigError, match="row ids: "):
        load_experiment(paths)


def test_files_of_other_ids_are_refused_at_the_handshake(tmp_path):
    paths = misaligned(tmp_path)
    with StageProcess(["g", "--experiment", paths[1], "--bind", "tcp://127.0.0.1:*", "--ready-file",
                       tmp_path / "g.ready"], tmp_path / "g.log") as g:
        endpoint = wait_for_file(tmp_path / "g.ready", g)
        f = run_cli(["stage", "f", "--experiment", paths[0], "--connect", endpoint, "--peer-deadline", "3"])
    assert f.returncode == 4, f.stderr
    assert "row ids: f has" in f.stderr and "g has" in f.stderr, f.stderr
