"""``distgrad init``: ready stage files from a CSV table (or one CSV per party).

The table is inspected, not trusted to be clean: a column whose every present cell is a number is a number
column, any other is categorical (one-hot); missing cells (``MISSING_CELLS``) are filled with the column's
median; number columns are standardised; a text label makes a classification with class names, and so does
a label of few distinct whole numbers, else the run is a regression. Each party gets the folder ``distgrad
split`` writes, ``OUT/NAME/NAME.toml``, with its own columns of the rows beside it (``OUT/NAME/NAME.csv``),
the interface every party shares, its ``[data]`` with those preparation keys (each choice said in a comment)
and a default model sized to its input width after one-hot encoding (read back through the data source the
run uses, so the two always agree).

Two parties (``f`` the features, ``g`` the labels) by default; vertical parties (``aggregate = "concat"``)
when the columns are shared out (``'a:c1,c2' 'b:c3'``) or when each party gives its own CSV (joined on a
common ID column: the rows of the IDs every file holds, in ascending ID text, the order ``distgrad align``
writes them in, so that the printed align commands give every party the same rows in the same order).
"""

from __future__ import annotations

import csv
import math
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from distgrad.config.csvfile import cell_problem, is_name, number, open_csv
from distgrad.config.data import build_data, held_out_split
from distgrad.config.parse import load_experiment
from distgrad.config.prepare import finite_numbers, is_missing
from distgrad.config.split import toml_document, toml_value
from distgrad.errors import ConfigError

FEATURE_OWNER, LABEL_OWNER = "f", "g"         # the two parties' names of a two-party run
TEST_FRACTION = 0.2
BATCH_MAX = 32                  # rows a step, fewer for a small table (a quarter of its training rows)
TARGET_STEPS = 600              # about this many training steps, in whole epochs ...
EPOCHS_MIN, EPOCHS_MAX = 10, 200        # ... within these bounds
HIDDEN = 16                     # the width of the cut (two parties) and of the label owner's hidden layer
EMBEDDING = 8                   # each vertical party's embedding width
LEARNING_RATE = 0.01
CLASSES_MAX = 20                # a label of at most this many distinct whole numbers is a class id
CATEGORIES_MAX = 50             # a text column with more distinct values is left out (an identifier or free text)
COMMON_ROWS_MIN = 10            # fewer rows than this (common rows, for one CSV per party) is refused
ID_NAMES = ("id", "row_id", "rowid", "key")     # a column so named (any case) with distinct values is the rows' ID
ADDED_ID = "row_id"             # the ID column init adds (the table's line numbers) when the table has none
UNNAMED = "column_{}"           # the name of a column the header line leaves unnamed (1 for the first)
_PARTY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass
class Table:
    """A CSV file read whole: its ``header`` and data ``rows`` (each as long as the header)."""

    path: Path
    header: list[str]
    rows: list[list[str]]

    def column(self, name: str) -> list[str]:
        index = self.header.index(name)
        return [row[index] for row in self.rows]


@dataclass
class Party:
    """One party's share: its ``name``, its feature ``columns`` (of ``table``) and whether it holds the labels."""

    name: str
    table: Table
    columns: list[str]
    labels: bool = False


@dataclass
class InitResult:
    """What ``init_parties`` wrote: each party's stage file (label owner last), the choices it made in words
    (``notes``) and the commands to train, predict and (with one CSV per party) align."""

    paths: list[Path]
    notes: list[str] = field(default_factory=list)
    commands: list[str] = field(default_factory=list)


def read_table(path: Path) -> Table:
    """``path`` as a ``Table``; ``ConfigError`` for a file that cannot be read, has no header line or no data
    row, names a column twice or has a line of another length than its header."""
    try:
        with open_csv(path) as f:
            lines = [line for line in csv.reader(f) if any(cell.strip() for cell in line)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    if not lines:
        raise ConfigError(f"{path} is empty: distgrad init needs a header line naming the columns, then the rows")
    header = [cell.strip() for cell in lines[0]]
    if not lines[1:]:
        raise ConfigError(f"{path} has a header line but no data row")
    for i, name in enumerate(header):       # an unnamed column (a table's saved index, say): named by position
        if not name:
            header[i] = UNNAMED.format(i + 1)
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise ConfigError(f"{path}: the header line names {twice} more than once")
    for number_, row in enumerate(lines[1:], start=2):
        if len(row) != len(header):
            raise ConfigError(f"{path}: data line {number_} has {len(row)} fields, the header {len(header)}")
    return Table(path, header, [list(row) for row in lines[1:]])


def _is_numbers(cells: Sequence[str]) -> bool:
    present = [c for c in cells if not is_missing(c)]
    return bool(present) and (finite_numbers(present) is not None or all(number(c) is not None for c in present))


def _whole_numbers(cells: Sequence[str]) -> bool:
    values = [number(c) for c in cells]
    return all(v is not None and math.isfinite(v) and v == int(v) for v in values)


def _unique(cells: Sequence[str]) -> bool:
    return not any(is_missing(c) for c in cells) and len(set(cells)) == len(cells)


def _find_id_column(tables: Sequence[Table], given: str | None, label: str) -> str | None:
    """The ID column: ``given`` (in every table, distinct values), else the one column every table holds
    when there are several tables, else a column named like an ID (``ID_NAMES``) with distinct values; None
    when one table has none."""
    if given is not None:
        if given == label:
            raise ConfigError(f"--id-column {given!r} is the label column: the rows' IDs are no label")
        for table in tables:
            if given not in table.header:
                raise ConfigError(f"--id-column {given!r} is not a column of {table.path} (columns: {table.header})")
            if not _unique(table.column(given)):
                raise ConfigError(f"--id-column {given!r} of {table.path} has missing or repeated values: the "
                                  f"rows' IDs must be distinct")
        return given
    if len(tables) > 1:
        common = [name for name in tables[0].header if all(name in t.header for t in tables[1:]) and name != label]
        if len(common) != 1:
            raise ConfigError(f"one CSV per party: the files must share exactly one column, their rows' ID, to be "
                              f"joined on (they share {common}); give --id-column NAME")
        return _find_id_column(tables, common[0], label)
    for name in tables[0].header:
        named_like_an_id = name.lower() in ID_NAMES or name == UNNAMED.format(1)     # or a saved index
        if named_like_an_id and name != label and _unique(tables[0].column(name)):
            return name
    return None


def _label_table(tables: Sequence[Table], label: str) -> Table:
    holding = [t for t in tables if label in t.header]
    if not holding:
        where = " or ".join(str(t.path) for t in tables)
        columns = tables[0].header if len(tables) == 1 else "see their header lines"
        raise ConfigError(f"the label column {label!r} is not in {where} (columns: {columns}); give --label NAME "
                          f"of the column to predict")
    if len(holding) > 1:
        raise ConfigError(f"the label column {label!r} is in {[str(t.path) for t in holding]}: only the label "
                          f"owner's CSV may hold it")
    return holding[0]


def _aligned(tables: Sequence[Table], label_table: Table, id_column: str, notes: list[str]) -> dict[int, dict[str, list[str]]]:
    """For each table (by position), its rows by ID, restricted to the IDs every table holds; the IDs in
    ascending text order (Python's string order) are the keys' order of every map: the agreed order of
    ``distgrad align`` (``align.write_aligned``), so that where the parties align their own files instead
    (the printed commands), each gets these rows in this order, the same training rows and so the same
    categories and input width the model was sized to."""
    present = {row[label_table.header.index(id_column)] for row in label_table.rows}
    for table in tables:
        present &= set(table.column(id_column))
    order = sorted(present)
    if len(order) < COMMON_ROWS_MIN:
        raise ConfigError(f"the files hold only {len(order)} common IDs in column {id_column!r}: at least "
                          f"{COMMON_ROWS_MIN} are needed to train{_near_misses(tables, id_column, present)}")
    dropped = {str(t.path): len(t.rows) - len(order) for t in tables if len(t.rows) != len(order)}
    if dropped:
        notes.append(f"joined on {id_column!r}: {len(order)} IDs are in every file; left out {dropped} rows "
                     f"(rows whose ID another file lacks){_near_misses(tables, id_column, present)}")
    out = {}
    for k, table in enumerate(tables):
        by_id = {row[table.header.index(id_column)]: row for row in table.rows}
        out[k] = {i: by_id[i] for i in order}
    return out


def _loose_id(key: str) -> str:
    """``key`` with what another file may write otherwise set aside: spaces around it, its Unicode form, and
    for a number its form (``'007'``, ``'7.0'`` and ``'7'`` alike)."""
    key = unicodedata.normalize("NFC", key.strip())
    value = number(key)
    return key if value is None else repr(value)


def _near_misses(tables: Sequence[Table], id_column: str, present: set[str]) -> str:
    """A hint for IDs that are in no other file exactly but are there once spaces, Unicode form and a
    number's form are set aside (``_loose_id``; e.g. ``'007'`` here, ``'7'`` there), else "": the join, as
    ``distgrad align``, compares IDs as exact text."""
    columns = [[key for key in t.column(id_column) if key not in present] for t in tables]
    loose = [{_loose_id(key): key for key in keys} for keys in columns]
    for k, mine in enumerate(loose):
        for j, theirs in enumerate(loose[k + 1:], start=k + 1):
            near = [(mine[key], theirs[key]) for key in mine if key in theirs]
            if near:
                return (f"; {len(near)} ID{'s' if len(near) > 1 else ''} of {tables[k].path} match one of "
                        f"{tables[j].path} only when spaces, Unicode form or a number's form are set aside (the "
                        f"first {near[0][0]!r} and {near[0][1]!r}): IDs are compared as exact text, so write them "
                        f"alike in every file")
    return ""


def _drop_missing_labels(table: Table, label: str, notes: list[str]) -> Table:
    index = table.header.index(label)
    kept = [row for row in table.rows if not is_missing(row[index])]
    if len(kept) < len(table.rows):
        notes.append(f"left out {len(table.rows) - len(kept)} rows of {table.path} whose label {label!r} is "
                     f"missing (nothing to learn from them)")
    if not kept:
        raise ConfigError(f"{table.path}: every row's label {label!r} is missing")
    return Table(table.path, table.header, kept)


def _check_finite(table: Table, name: str, present: Sequence[str]) -> None:
    """``ConfigError`` for a column of numbers with a damaged number in it: a cell that reads as a number but
    no finite one (``inf``, ``1e400``), where every other cell is a number, or a cell that is neither a number
    nor a name (``0x13``, ``1_000``, a NUL byte: ``csvfile.is_name``) in a column mostly of numbers. The run
    refuses such a cell, and taking the column as text would one-hot every value (or leave the column out).
    The message names the file's line and the column."""
    damaged = [c for c in present if number(c) is None]
    numbers = len(present) - len(damaged)
    if not damaged or not numbers:
        return
    bad: str | None = damaged[0]
    if not all(_reads_as_number(c) for c in damaged):
        bad = next((c for c in damaged if _reads_as_number(c) or not is_name(c)), None)
        if bad is None or numbers * 2 <= len(present):       # text with a few numbers among it: categories
            return
    assert bad is not None
    raise ConfigError(f"{table.path}{_line_of(table, name, bad)}: column {name!r} holds numbers, but "
                      f"{cell_problem(bad)}: give that cell a finite number, or leave it empty (a missing cell, "
                      f"filled in training)")


def _line_of(table: Table, name: str, cell: str) -> str:
    """`` line N`` of ``table``'s file where column ``name`` first holds ``cell`` (as an editor counts lines),
    or "" when the file does not say (a column init made)."""
    try:
        with open(table.path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next((row for row in reader if any(c.strip() for c in row)), [])
            names = [c.strip() or UNNAMED.format(i + 1) for i, c in enumerate(header)]
            if name in names:
                index = names.index(name)
                for row in reader:
                    if index < len(row) and row[index] == cell:
                        return f" line {reader.line_num}"
    except (OSError, UnicodeDecodeError, csv.Error):
        pass
    return ""


def _reads_as_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _usable_columns(table: Table, names: Sequence[str], notes: list[str], party: str, train: Sequence[int]
                    ) -> list[str]:
    """``names`` less the columns no model can use: every cell missing, every cell of the training rows
    ``train`` (row indices of ``table``) missing (the statistics come from them alone: a column whose values
    are all held out has nothing to fill with, scale by or one-hot), or text with more than ``CATEGORIES_MAX``
    distinct values (an identifier or free text); each one left out is noted."""
    kept = []
    for name in names:
        cells = table.column(name)
        present = [c for c in cells if not is_missing(c)]
        _check_finite(table, name, present)
        if not present:
            notes.append(f"{party}: left out column {name!r}: every cell is missing")
        elif all(is_missing(cells[i]) for i in train):
            notes.append(f"{party}: left out column {name!r}: every cell of the training rows is missing (its "
                         f"{len(present)} values are all in held-out rows, and the statistics come from the "
                         f"training rows alone)")
        elif not _is_numbers(cells) and len(set(present)) > CATEGORIES_MAX:
            notes.append(f"{party}: left out column {name!r}: text with {len(set(present))} distinct values "
                         f"(more than {CATEGORIES_MAX}: an identifier or free text, not categories)")
        else:
            kept.append(name)
    return kept


def _parse_party_spec(spec: str, header: Sequence[str], reserved: Sequence[str]) -> tuple[str, list[str]]:
    """``'NAME:COL1,COL2'`` as (name, columns); ``ConfigError`` naming what is wrong."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    columns = [c.strip() for c in rest.split(",") if c.strip()]
    if not sep or not _PARTY_NAME.fullmatch(name) or not columns:
        raise ConfigError(f"--parties takes NAME:COLUMN,COLUMN,... per party (NAME letters, digits, _ or -), got "
                          f"{spec!r}")
    unknown = [c for c in columns if c not in header]
    if unknown:
        raise ConfigError(f"party {name!r} names columns {unknown} that the CSV does not hold (columns: "
                          f"{list(header)})")
    taken = [c for c in columns if c in reserved]
    if taken:
        raise ConfigError(f"party {name!r} names {taken}: the label and the ID column are no party's features")
    return name, columns


def _plan_parties(tables: list[Table], label: str, specs: Sequence[str], label_owner: str, id_column: str | None,
                  notes: list[str]) -> list[Party]:
    """The parties and their columns (the label owner last)."""
    label_table = _label_table(tables, label)
    reserved = [label, *([id_column] if id_column else [])]
    if len(tables) > 1:
        if specs:
            raise ConfigError("give either one CSV per party or --parties with one CSV, not both")
        parties = []
        for table in tables:
            name = re.sub(r"[^A-Za-z0-9_-]", "_", table.path.stem)
            if not _PARTY_NAME.fullmatch(name):
                name = f"p_{name}"
            columns = [c for c in table.header if c not in reserved]
            parties.append(Party(name, table, columns, labels=table is label_table))
        names = [p.name for p in parties]
        if len(set(names)) != len(names):
            raise ConfigError(f"one CSV per party: each party is named by its file's name, and {names} repeat one")
        return sorted(parties, key=lambda p: p.labels)          # the label owner last, the others in order given
    table = tables[0]
    if not specs:
        columns = [c for c in table.header if c not in reserved]
        if not columns:
            raise ConfigError(f"{table.path} holds no column besides the label {label!r}"
                              f"{' and the ID' if id_column else ''}: nothing to learn from")
        return [Party(FEATURE_OWNER, table, columns), Party(LABEL_OWNER, table, [], labels=True)]
    planned: list[Party] = []
    seen: dict[str, str] = {}
    for spec in specs:
        name, columns = _parse_party_spec(spec, table.header, reserved)
        if name in {p.name for p in planned}:
            raise ConfigError(f"--parties names party {name!r} twice")
        twice = [c for c in columns if c in seen]
        if twice:
            raise ConfigError(f"columns {twice} are given to both {seen[twice[0]]!r} and {name!r}: each column "
                              f"belongs to one party")
        seen.update({c: name for c in columns})
        planned.append(Party(name, table, columns, labels=name == label_owner))
    unused = [c for c in table.header if c not in seen and c not in reserved]
    if unused:
        notes.append(f"columns no party holds, left out: {unused}")
    if not any(p.labels for p in planned):
        planned.append(Party(label_owner, table, [], labels=True))
    if sum(not p.labels for p in planned) < 1:
        raise ConfigError(f"--parties gives every column to the label owner {label_owner!r}: name at least one "
                          f"other party")
    return sorted(planned, key=lambda p: p.labels)


def _task(cells: Sequence[str], label: str, task: str, notes: list[str]) -> tuple[bool, list[str]]:
    """``(classification, class names in order)`` of the label cells: text, or at most ``CLASSES_MAX``
    distinct whole numbers, make a classification (unless ``task`` says which)."""
    distinct = sorted({c.strip() for c in cells})      # the classes as the data source reads them
    numbers = _is_numbers(cells)
    if task == "auto":
        classify = not numbers or (_whole_numbers(distinct) and len(distinct) <= CLASSES_MAX)
        why = ("its values are text" if not numbers else f"it holds {len(distinct)} distinct whole numbers"
               if classify else "its values are numbers with more than a few distinct values")
        notes.append(f"label {label!r}: {'classification' if classify else 'regression'} ({why}; "
                     f"--task {'regression' if classify else 'classification'} to choose otherwise)")
    else:
        classify = task == "classification"
        if not classify and not numbers:
            raise ConfigError(f"--task regression needs a label of numbers; {label!r} holds text")
    if classify and len(distinct) < 2:
        raise ConfigError(f"the label {label!r} holds one value only ({distinct[0]!r}): nothing to classify")
    if classify and len(distinct) > 1000:
        raise ConfigError(f"the label {label!r} holds {len(distinct)} distinct values: too many classes; "
                          f"--task regression for a numeric target")
    return classify, distinct


def _batch(rows: int) -> int:
    train = max(1, int(rows * (1 - TEST_FRACTION)))
    return max(1, min(BATCH_MAX, train // 4))


def _epochs(rows: int, batch: int) -> int:
    per_epoch = max(1, int(rows * (1 - TEST_FRACTION)) // batch)
    return max(EPOCHS_MIN, min(EPOCHS_MAX, math.ceil(TARGET_STEPS / per_epoch)))


def _party_data(party: Party, id_name: str, label: str, batch: int, classify: bool, seed: int,
                comments: dict[str, str]) -> dict[str, Any]:
    """The party's ``[data]`` table over its own CSV (``NAME.csv`` beside its stage file). Its held-out split
    is fixed (``split_seed``): the categories of the training rows, so the input width the model is sized to,
    stay the same under another ``--seed``."""
    table: dict[str, Any] = {"kind": "csv", "path": f"{party.name}.csv", "header": True, "id_column": id_name,
                             "batch": batch, "test_fraction": TEST_FRACTION, "split_seed": seed}
    if party.columns:
        cells = {c: party.table.column(c) for c in party.columns}
        categorical = [c for c in party.columns if not _is_numbers(cells[c])]
        holes = [c for c in party.columns if any(is_missing(x) for x in cells[c])]
        table["features"] = list(party.columns)
        if categorical:
            table["categorical"] = categorical
            comments["categorical"] = "text columns: one-hot, one column per category of the training rows"
        if holes:
            table["missing"] = "median"
            comments["missing"] = (f"{holes} have missing cells: a number cell gets its column's median over the "
                                   f"training rows, a category cell all zeros")
        if len(categorical) < len(party.columns):
            table["standardize"] = True
            comments["standardize"] = "number columns: (x - mean) / std of the training rows"
    if party.labels:
        table["labels"] = label
        if classify:
            table["class_names"] = True
            comments["class_names"] = "the label's distinct values, sorted, are the classes; predictions name them"
        else:
            table["label_dtype"] = "float32"
            comments["label_dtype"] = "a regression target"
    return table


def _write_rows(path: Path, header: list[str], rows: list[list[str]]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f, lineterminator="\n").writerows([header, *rows])


def _commented(text: str, comments: dict[str, dict[str, str]]) -> str:
    """``text`` (a TOML document) with ``comments[table][key]`` after the line of ``key`` in ``[table]``."""
    lines, table = [], ""
    for line in text.splitlines():
        if line.startswith("["):
            table = line.strip("[]")
        key = line.split(" = ", 1)[0]
        note = comments.get(table, {}).get(key) if " = " in line else None
        lines.append(f"{line}    # {note}" if note else line)
    return "\n".join(lines) + "\n"


def _check_out_dir(out_dir: Path, force: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"--out {out_dir} exists and is not empty (another run's files?): choose a new folder, "
                          f"or give --force to write over the files init writes there")


def init_parties(csvs: Sequence[Path], label: str, out_dir: Path, *, parties: Sequence[str] = (),
                 id_column: str | None = None, task: str = "auto", seed: int = 0, framework: str = "numpy",
                 force: bool = False) -> InitResult:
    """Write each party's folder ``OUT_DIR/NAME/`` (its stage file ``NAME.toml`` and its own columns of the
    rows, ``NAME.csv``) from the CSV ``csvs[0]`` (two parties ``f`` and ``g``, or the parties of ``parties``,
    ``'NAME:COL,COL'`` each, vertically), or from one CSV per party joined on ``id_column``.

    ``task`` is ``"auto"``, ``"classification"`` or ``"regression"``; ``framework`` ``"numpy"`` or ``"torch"``
    (the same layers built in PyTorch). ``ConfigError`` (nothing written) for
    a missing label column, an empty table, an ``out_dir`` that holds files (unless ``force``) and any bad
    argument; the files written are loaded back as one run before returning (removed if they do not load).
    """
    if task not in ("auto", "classification", "regression"):
        raise ConfigError(f"--task must be auto, classification or regression, got {task!r}")
    if framework not in ("numpy", "torch"):
        raise ConfigError(f"--framework must be numpy or torch, got {framework!r}")
    if not csvs:
        raise ConfigError("distgrad init needs a CSV file (or one per party)")
    _check_out_dir(out_dir, force)
    notes: list[str] = []
    tables, label_table, plan, ids, id_name = _planned_rows(csvs, label, parties, id_column, seed, notes)
    classify, classes = _task([row[label_table.header.index(label)] for row in plan[-1].table.rows], label, task,
                              notes)
    batch = _batch(len(ids))
    epochs = _epochs(len(ids), batch)
    vertical = len(plan) > 2 or bool(parties) or len(tables) > 1
    chosen = _Chosen(label, id_name, ids, batch, epochs, seed, classify, len(classes) if classify else 1, vertical,
                     framework, label_table.path.stem, ", ".join(str(Path(p).name) for p in csvs))
    paths, widths = _write_parties(out_dir, plan, chosen, notes)
    notes.insert(0, f"{len(ids)} rows; {'classification of ' + str(len(classes)) + ' classes' if classify else 'regression'}"
                    f"; parties {[p.name for p in plan]} (label owner {plan[-1].name}); input width after one-hot "
                    f"{ {p.name: widths[p.name] for p in plan if p.columns} }; batch {batch}, {epochs} epochs")
    # rows of the label owner's file whose label is missing: its own align input must leave them out
    unlabelled = len(read_table(label_table.path).rows) - len(label_table.rows) if len(csvs) > 1 else 0
    return InitResult(paths, notes, _commands(paths, plan, len(csvs) > 1, id_name, framework, (label, unlabelled)))


def _planned_rows(csvs: Sequence[Path], label: str, parties: Sequence[str], id_column: str | None, seed: int,
                  notes: list[str]) -> tuple[list[Table], Table, list[Party], list[str], str]:
    """The tables read, the one holding the label, each party's plan with its rows in one order (a join on the
    IDs for several files), the rows' IDs and the ID column's name; what was chosen is added to ``notes``.
    ``seed`` is the ``split_seed`` of the files written: it says which rows are training rows.
    ``ConfigError`` for a file named twice, a missing label, too few rows or a party with no usable column."""
    tables = [read_table(Path(p)) for p in csvs]
    if len({t.path.resolve() for t in tables}) != len(tables):
        raise ConfigError(f"{[str(p) for p in csvs]} name one file twice: give one CSV per party")
    _label_table(tables, label)                 # refused early: the label column must be there
    id_name = _find_id_column(tables, id_column, label)
    if id_name is None:                         # one table without IDs: its data rows' numbers are theirs
        id_name = ADDED_ID if ADDED_ID not in tables[0].header else f"{ADDED_ID}_"
        tables = [Table(tables[0].path, [*tables[0].header, id_name],
                        [[*row, str(k)] for k, row in enumerate(tables[0].rows, start=1)])]
        notes.append(f"the table has no ID column: init numbers its data rows in {id_name!r} (1 for the first); "
                     f"--id-column NAME to use a column of yours")
    elif id_column is None:
        notes.append(f"the rows' IDs: column {id_name!r} (--id-column NAME to choose another)")
    label_table = _label_table(tables, label)
    tables = [_drop_missing_labels(t, label, notes) if t is label_table else t for t in tables]
    label_table = _label_table(tables, label)
    plan = _plan_parties(tables, label, parties, LABEL_OWNER, id_name, notes)
    # every party's rows in one order: a join on the IDs (several files), else the table's own rows
    rows_by_table = _aligned(tables, label_table, id_name, notes) if len(tables) > 1 else \
        {0: {row[tables[0].header.index(id_name)]: row for row in tables[0].rows}}
    ids = list(rows_by_table[0])
    for party in plan:
        k = next(k for k, t in enumerate(tables) if t is party.table)
        party.table = Table(party.table.path, party.table.header, list(rows_by_table[k].values()))
    if len(ids) < COMMON_ROWS_MIN:
        raise ConfigError(f"{len(ids)} rows with a label are too few to train (at least {COMMON_ROWS_MIN})")
    _, train, _ = held_out_split(len(ids), seed, TEST_FRACTION)       # as the written [data] splits the rows
    for party in plan:
        party.columns = _usable_columns(party.table, party.columns, notes, party.name, train.tolist())
        if not party.columns and not party.labels:
            raise ConfigError(f"party {party.name!r} holds no usable column")
    if len(plan) == 2 and not plan[0].columns:
        raise ConfigError("no usable feature column: nothing to learn from")
    return tables, label_table, plan, ids, id_name


@dataclass(frozen=True)
class _Chosen:
    """What init chose for every party's files: the label and ID columns, the rows' IDs, the batch and epochs,
    the seed, the task (``classify``, ``outputs``), whether the run is vertical, the framework, the run's name
    and the source files named in each stage file's header."""
    label: str
    id_name: str
    ids: list[str]
    batch: int
    epochs: int
    seed: int
    classify: bool
    outputs: int
    vertical: bool
    framework: str
    name: str
    sources: str


def _write_parties(out_dir: Path, plan: list[Party], chosen: _Chosen, notes: list[str]
                   ) -> tuple[list[Path], dict[str, int]]:
    """Each party's rows (``NAME.csv``) and stage file (``NAME.toml``) in ``out_dir/NAME/``, loaded back as one
    run; the stage files' paths and each party's input width. On any failure the files and folders written
    here are removed again and the error raised (a ``ConfigError`` when they do not load)."""
    written: list[Path] = []
    made = [folder for folder in [out_dir, *(out_dir / p.name for p in plan)] if not folder.exists()]
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        data_tables: dict[str, dict[str, Any]] = {}
        widths: dict[str, int] = {}
        comments: dict[str, dict[str, str]] = {}
        for party in plan:
            folder = out_dir / party.name
            folder.mkdir(exist_ok=True)
            names = [*party.columns, *([chosen.label] if party.labels else [])]
            indices = [party.table.header.index(n) for n in names]
            _write_rows(folder / f"{party.name}.csv", [chosen.id_name, *names],
                        [[i, *(row[c] for c in indices)] for i, row in zip(chosen.ids, party.table.rows)])
            written.append(folder / f"{party.name}.csv")
            comments[party.name] = {}
            data_tables[party.name] = _party_data(party, chosen.id_name, chosen.label, chosen.batch, chosen.classify,
                                                  chosen.seed, comments[party.name])
            notes.extend(f"{party.name} [data]: {key} = {toml_value(data_tables[party.name][key])}: {why}"
                         for key, why in comments[party.name].items())
            widths[party.name] = _width(data_tables[party.name], chosen.seed, folder) if party.columns else 0
        stage_tables = _models(plan, widths, chosen.vertical, chosen.outputs, chosen.classify, chosen.framework)
        interface = _interface(plan, stage_tables, chosen.vertical, chosen.batch, chosen.epochs, chosen.seed,
                               chosen.name)
        paths = []
        for party in plan:
            text = toml_document({"interface": interface, "stage": stage_tables[party.name],
                                  "data": data_tables[party.name]})
            header = (f"# {party.name}'s own stage file, written by distgrad init from {chosen.sources}: its data "
                      f"is {party.name}.csv beside it.\n"
                      f"# Edit freely (docs/stage-files.md lists every key); every party's [interface] must stay "
                      f"alike.\n")
            path = out_dir / party.name / f"{party.name}.toml"
            path.write_text(header + _commented(text, {"data": comments[party.name]}), encoding="utf-8")
            written.append(path)
            paths.append(path)
        load_experiment(paths)
    except (ConfigError, OSError) as e:
        for path in written:
            path.unlink(missing_ok=True)
        for folder in reversed(made):           # the folders init made, now empty again
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        if isinstance(e, ConfigError):
            raise ConfigError(f"internal error: the stage files distgrad init wrote do not load: {e}") from e
        raise
    return paths, widths


def _width(data: dict[str, Any], seed: int, folder: Path) -> int:
    """The input width of a party's rows as its run will read them (after one-hot encoding)."""
    source = build_data({"features": None, "labels": None, **data}, seed, folder)   # a part not named: not held
    shape = getattr(source, "feature_shape", None)
    if not shape:
        raise ConfigError(f"{folder}: its data holds no features")
    return int(math.prod(shape[1:]))


def _models(plan: Sequence[Party], widths: dict[str, int], vertical: bool, outputs: int,
            classify: bool, framework: str) -> dict[str, dict[str, Any]]:
    """Each party's ``[stage]`` table: a dense layer and tanh per data owner (``HIDDEN`` wide for two
    parties, ``EMBEDDING`` per vertical party), and the label owner's two-layer head with the loss."""
    optimizer = {"type": "adam", "lr": LEARNING_RATE}
    tables: dict[str, dict[str, Any]] = {}
    cut = EMBEDDING if vertical else HIDDEN
    owner = plan[-1]
    for party in plan[:-1]:
        tables[party.name] = {"name": party.name, "model": [
            {"type": "dense", "name": f"{party.name}1", "in": widths[party.name], "out": cut}, {"type": "tanh"}],
            "optimizer": dict(optimizer)}
    joined = cut * (len(plan) - 1 + bool(owner.columns))
    head: dict[str, Any] = {"name": owner.name, "model": [
        {"type": "dense", "name": f"{owner.name}1", "in": joined, "out": HIDDEN}, {"type": "tanh"},
        {"type": "dense", "name": f"{owner.name}2", "in": HIDDEN, "out": outputs}], "optimizer": dict(optimizer),
        "loss": "softmax_cross_entropy" if classify else "mean_squared_error"}
    if owner.columns:
        head["bottom"] = [{"type": "dense", "name": f"{owner.name}0", "in": widths[owner.name], "out": cut},
                          {"type": "tanh"}]
    tables[owner.name] = head
    if framework != "numpy":
        for table in tables.values():
            table["framework"] = framework
    return tables


def _interface(plan: Sequence[Party], stages: dict[str, dict[str, Any]], vertical: bool, batch: int, epochs: int,
               seed: int, name: str) -> dict[str, Any]:
    """The ``[interface]`` every party's file shares."""
    cuts = [{"shape": [stages[p.name]["model"][0]["out"]], "dtype": "float32"} for p in plan[:-1]]
    table: dict[str, Any] = {"name": re.sub(r"[^A-Za-z0-9_.-]", "-", name).strip("-") or "init",
                             "stages": [p.name for p in plan], "batch": batch,
                             "activation": cuts if vertical else cuts[0], "epochs": epochs, "seed": seed}
    if vertical:
        table["aggregate"] = "concat"
    return table


def _commands(paths: Sequence[Path], plan: Sequence[Party], raw: bool, id_name: str, framework: str,
              unlabelled: tuple[str, int] = ("", 0)) -> list[str]:
    """The commands to train (one machine, then one host per party), predict and, with one CSV per party
    (``raw``), align the rows privately where each party keeps its file on its host. Each party's parameters
    file is named as ``distgrad run --save`` names it (``stage.parameters_file``): ``NAME.npz`` for numpy
    stages, ``NAME.pt`` (a torch ``state_dict``) for torch ones, so the predict commands load what training
    wrote."""
    files = " ".join(str(p) for p in paths)
    saved = paths[0].parent.parent / "trained"
    suffix = ".pt" if framework == "torch" else ".npz"
    owner, feature_parties = plan[-1], plan[:-1]
    lines = ["# train: every party a process of its own on this machine; the trained halves go to "
             f"{saved}/NAME{suffix}",
             f"distgrad run {files} --save {saved}",
             "# or one party per host (the label owner serves, the others connect; across hosts add CURVE keys)",
             f"distgrad-stage {owner.name} --experiment {paths[-1]} --bind tcp://0.0.0.0:5555 "
             f"--save {saved / owner.name}{suffix}"]
    for party, path in zip(feature_parties, paths):
        lines.append(f"distgrad-stage {party.name} --experiment {path} --connect tcp://LABEL_OWNER_HOST:5555 "
                     f"--save {saved / party.name}{suffix}")
    lines += ["# predict the held-out rows (or new ones: --input NEW.csv with the data owners' columns and the "
              f"rows' IDs in column {id_name!r}): the label owner writes predictions.csv, by row ID",
              f"distgrad predict {paths[-1]} --load {saved / owner.name}{suffix} --bind tcp://127.0.0.1:5556 "
              f"--output predictions.csv &"]
    for party, path in zip(feature_parties, paths):
        lines.append(f"distgrad predict {path} --load {saved / party.name}{suffix} --connect tcp://127.0.0.1:5556")
    if raw:
        lines += ["# init joined the files on this machine; where each party keeps its CSV on its own host, each "
                  "aligns it with the others' by ID instead, privately, into the file its stage file reads (the "
                  "label owner coordinates; with CURVE keys, each other party adds --party-keys DIR)"]
        label, count = unlabelled
        if count:
            lines.append(f"# first remove from {owner.table.path} its {count} row{'s' if count > 1 else ''} whose "
                         f"label {label!r} is missing (init left them out; a run refuses a missing label)")
        lines += [f"distgrad align {owner.table.path} --id-column {id_name} --out "
                  f"{paths[-1].with_suffix('.csv')} --bind tcp://0.0.0.0:5557 --parties {len(plan)}"]
        for party, path in zip(feature_parties, paths):
            lines.append(f"distgrad align {party.table.path} --id-column {id_name} "
                         f"--out {path.with_suffix('.csv')} --connect tcp://LABEL_OWNER_HOST:5557 "
                         f"--parties {len(plan)}")
    return lines
