"""A real vertical example, end to end: the Wisconsin breast-cancer data split by columns between parties.

``python -m distgrad.vertical_example [--workdir DIR]`` plays four parties on
this host, each in its own folder of ``DIR`` (``--prepare-only`` writes only
each party's own CSV there, ``DIR/PARTY/PARTY.csv``, and stops: deploy/
starts from those):

* three feature parties hold ten of the thirty columns each of the same
  patients (``mean``: the mean of each cell measurement, ``se``: its standard
  error, ``worst``: its largest value), each under its own, partly
  overlapping set of patient IDs and in its own row order;
* the label owner (``diagnosis``) holds the diagnosis of its own set of IDs.

With ``--active`` the label owner is an active party: it also holds the
``worst`` columns of its own patients, under its own bottom model (Dense
10->8 + Tanh, ``bottom``), whose embedding joins the two feature parties'
(``mean``, ``se``) after theirs; three processes run.

Then it runs what the parties would run: ``distgrad align`` (every party ends
with its rows of the IDs all four hold, in one agreed order, and learns no
other ID), a stage file per party, and ``distgrad run`` on them (four stage
processes; the label owner joins the parties' embeddings, ``aggregate =
"concat"``). Last, for comparison, the same rows with all thirty columns in
one table train the same kind of model (one Dense + Tanh over every column,
then the same classifier) in one process. It prints both held-out
accuracies; the vertical one is meant to be within one point of the other
(exit 1 when it is more than one point below it).

Each party standardises its own columns (mean 0, standard deviation 1 over
its own rows) before anything else: a choice of this example's, made alike
for the one-process model. The data: distgrad/datasets/breast_cancer.csv
(CC BY 4.0; see distgrad/datasets/README.md).
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from distgrad.errors import ConfigError, StageError
from distgrad.config.parse import parse_experiment
from distgrad.run.inprocess import train_in_process
from distgrad.run.launcher import run_local
from distgrad.stage.records import read_json
from distgrad.config.split import toml_document

DATA = Path(__file__).parent / "datasets" / "breast_cancer.csv"
GROUPS = {"mean": "mean ", "se": " error", "worst": "worst "}   # party -> how its column names read
LABEL_OWNER = "diagnosis"
ACTIVE_GROUP = "worst"   # with --active: the group of columns the label owner holds itself
KEEP = 0.95            # share of the patients each party holds (its own random subset)
TEST_FRACTION = 0.25    # held-out share of the common rows: about 115 patients, so one patient is < 1 point
EMBEDDING = 8          # each feature party's embedding width
SETTINGS = {"batch": 16, "epochs": 40, "seed": 0}
ALIGN_DEADLINE_S = 60


def _read(path: Path) -> tuple[list[str], list[list[str]]]:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))
    return rows[0], rows[1:]


def _write(path: Path, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def party_columns(header: Sequence[str]) -> dict[str, list[str]]:
    """Each feature party's column names, in the data file's order."""
    features = [name for name in header if name not in ("id", LABEL_OWNER)]
    return {party: [n for n in features if (n.startswith(key) if key.endswith(" ") else n.endswith(key))]
            for party, key in GROUPS.items()}


def prepare_parties(workdir: Path, seed: int = 0, active: bool = False) -> dict[str, Path]:
    """Write each party's own file (``workdir/PARTY/PARTY.csv``): its columns, standardised over its own
    rows, of its own random share of the patients, in its own random order (``active``: the label owner's
    holds the ``ACTIVE_GROUP`` columns before the diagnosis). Returns the files by party."""
    header, rows = _read(DATA)
    columns = party_columns(header)
    own = columns.pop(ACTIVE_GROUP) if active else []
    rng = np.random.default_rng([seed, 2024])
    files = {}
    for party in [*columns, LABEL_OWNER]:
        names = columns.get(party, [*own, LABEL_OWNER])
        index = [header.index(n) for n in names]
        kept = sorted(rng.choice(len(rows), size=int(KEEP * len(rows)), replace=False))
        order = rng.permutation(kept)
        values = np.array([[float(rows[r][i]) for i in index] for r in order])
        width = len(names) - (party == LABEL_OWNER)           # the feature columns, standardised
        features = values[:, :width]
        features = (features - features.mean(axis=0)) / features.std(axis=0) if width else features
        cells = [[*(f"{v:.7g}" for v in line[:width]), *(str(int(v)) for v in line[width:])]
                 for line in np.hstack([features, values[:, width:]])]
        folder = workdir / party
        folder.mkdir(parents=True, exist_ok=True)
        files[party] = folder / f"{party}.csv"
        _write(files[party], ["id", *names], [[rows[r][0], *line] for r, line in zip(order, cells)])
    return files


def _distgrad(*args: Any) -> list[str]:
    return [sys.executable, "-m", "distgrad.cli", *map(str, args)]


def align_parties(files: dict[str, Path]) -> dict[str, Path]:
    """``distgrad align`` for every party (the label owner coordinates); returns the aligned files."""
    out = {party: path.with_name(f"{party}.aligned.csv") for party, path in files.items()}
    ready = files[LABEL_OWNER].with_name("align.ready")
    ready.unlink(missing_ok=True)
    quiet = ["--peer-deadline", ALIGN_DEADLINE_S, "--log-level", "WARNING"]
    procs = [subprocess.Popen(_distgrad("align", files[LABEL_OWNER], "--id-column", "id", "--out", out[LABEL_OWNER],
                                        "--bind", "tcp://127.0.0.1:*", "--parties", len(files), "--name", LABEL_OWNER,
                                        "--ready-file", ready, *quiet))]
    try:
        deadline = time.monotonic() + ALIGN_DEADLINE_S
        while not ready.exists():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise StageError(f"distgrad align of {LABEL_OWNER} did not start (exit {procs[0].poll()})")
            time.sleep(0.02)
        endpoint = ready.read_text().strip()
        for party, path in files.items():
            if party != LABEL_OWNER:
                procs.append(subprocess.Popen(_distgrad("align", path, "--id-column", "id", "--out", out[party],
                                                        "--connect", endpoint, "--name", party, *quiet)))
        for proc in procs:
            if proc.wait(ALIGN_DEADLINE_S * 2) != 0:
                raise StageError(f"distgrad align exited {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return out


def _interface(widths: dict[str, int]) -> dict[str, Any]:
    return {"name": "breast-cancer-vertical", "stages": [*widths, LABEL_OWNER], "aggregate": "concat",
            "activation": [{"shape": [EMBEDDING], "dtype": "float32"} for _ in widths],
            "labels": "last", **SETTINGS}


def _data(path: Path, features: list[str] | None = None, labels: str | None = None) -> dict[str, Any]:
    table: dict[str, Any] = {"kind": "csv", "path": path.name, "header": True, "batch": SETTINGS["batch"],
                             "test_fraction": TEST_FRACTION, "id_column": "id"}     # rows checked by their IDs
    if features is not None:
        table["features"] = features
    if labels is not None:
        table.update(labels=labels, label_dtype="int64")
    return table


def write_stage_files(aligned: dict[str, Path]) -> list[Path]:
    """Each party's stage file next to its aligned data: the shared interface, its own model and data."""
    columns = {party: _read(path)[0][1:] for party, path in aligned.items() if party != LABEL_OWNER}
    own = _read(aligned[LABEL_OWNER])[0][1:-1]          # the label owner's own feature columns (--active)
    interface = _interface({party: len(names) for party, names in columns.items()})
    files = []
    for party, names in columns.items():
        stage = {"name": party, "model": [{"type": "dense", "name": f"{party}1", "in": len(names), "out": EMBEDDING},
                                          {"type": "tanh"}], "optimizer": {"type": "adam", "lr": 0.01}}
        files.append(aligned[party].with_name(f"{party}.toml"))
        files[-1].write_text(toml_document({"interface": interface, "stage": stage,
                                            "data": _data(aligned[party], features=names)}))
    width = EMBEDDING * (len(columns) + bool(own))
    head = {"name": LABEL_OWNER, "model": [{"type": "dense", "name": "head", "in": width, "out": 2}],
            "optimizer": {"type": "adam", "lr": 0.01}, "loss": "softmax_cross_entropy"}
    if own:
        head["bottom"] = [{"type": "dense", "name": "own1", "in": len(own), "out": EMBEDDING}, {"type": "tanh"}]
    files.append(aligned[LABEL_OWNER].with_name(f"{LABEL_OWNER}.toml"))
    files[-1].write_text(toml_document({"interface": interface, "stage": head,
                                        "data": _data(aligned[LABEL_OWNER], features=own or None,
                                                      labels=LABEL_OWNER)}))
    return files


def one_process_model(aligned: dict[str, Path], workdir: Path) -> dict[str, Any]:
    """The comparison: the aligned rows with every column in one table, Dense (all columns -> 8 per party)
    + Tanh, then the same classifier, trained in one process; returns its summary."""
    tables = {party: _read(path) for party, path in aligned.items()}
    ids = [row[0] for row in tables[LABEL_OWNER][1]]
    header, rows = ["id"], [[i] for i in ids]
    for party, (names, body) in tables.items():
        if [row[0] for row in body] != ids:
            raise StageError(f"the aligned files disagree on the rows ({party})")
        header += names[1:]
        for row, line in zip(rows, body):
            row += line[1:]
    path = workdir / "all-columns.csv"
    _write(path, header, rows)
    features = [n for n in header[1:] if n != LABEL_OWNER]
    width = EMBEDDING * len(GROUPS)
    raw = {"name": "breast-cancer-all-columns", "labels": "last", "steps": None, **SETTINGS,
           "data": {**_data(path, features=features, labels=LABEL_OWNER), "path": str(path)},
           "stages": [{"name": "f", "model": [{"type": "dense", "name": "f1", "in": len(features), "out": width},
                                              {"type": "tanh"}], "optimizer": {"type": "adam", "lr": 0.01}},
                      {"name": "g", "model": [{"type": "dense", "name": "head", "in": width, "out": 2}],
                       "optimizer": {"type": "adam", "lr": 0.01}, "loss": "softmax_cross_entropy"}]}
    raw = {k: v for k, v in raw.items() if v is not None}
    raw.pop("batch", None)
    return train_in_process(parse_experiment(raw, str(path)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distgrad.vertical_example", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, help="where the parties' folders go (default: a temporary one)")
    parser.add_argument("--prepare-only", action="store_true",
                        help="only write each party's own CSV, WORKDIR/PARTY/PARTY.csv (the inputs of distgrad align, "
                             "as deploy/ uses them), and stop; needs --workdir")
    parser.add_argument("--active", action="store_true",
                        help=f"the label owner also holds the {ACTIVE_GROUP!r} columns, under its own bottom model")
    args = parser.parse_args(argv)
    if args.prepare_only:
        if args.workdir is None:
            parser.error("--prepare-only needs --workdir: where the parties' folders go")
        for party, path in prepare_parties(args.workdir, active=args.active).items():
            print(f"{party}: wrote {path}")
        return 0
    with tempfile.TemporaryDirectory(prefix="distgrad-vertical-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        files = prepare_parties(workdir, active=args.active)
        for party, path in files.items():
            print(f"{party}: {sum(1 for _ in open(path)) - 1} patients, columns {_read(path)[0][1:4]}...")
        aligned = align_parties(files)
        common = sum(1 for _ in open(aligned[LABEL_OWNER])) - 1
        print(f"distgrad align: {common} patients common to all {len(files)} parties")
        stage_files = write_stage_files(aligned)
        summary_path = workdir / "vertical.json"
        run_local([str(p) for p in stage_files], summary_path=summary_path, log_level="WARNING")
        vertical = read_json(summary_path)
        central = one_process_model(aligned, workdir)
        who = "two feature parties and the label owner" if args.active else "three feature parties"
        print(f"held-out accuracy, {who} over the wire: {vertical['test_accuracy']:.4f} "
              f"({vertical['test_count']} patients)")
        print(f"held-out accuracy, all columns in one process:        {central['test_accuracy']:.4f}")
        gap = 100 * (central["test_accuracy"] - vertical["test_accuracy"])
        print(f"difference: {gap:+.2f} points")
        return 0 if gap <= 1.0 else 1          # exit 1: the vertical model is more than one point worse


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ConfigError, StageError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
