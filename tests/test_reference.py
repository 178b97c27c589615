"""The stage-file format reference is generated from the parser's tables and checked against it."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from distgrad.config import reference

from distgrad.config import schema
from distgrad.config.keys import ABSENT, REQUIRED
from distgrad.errors import ConfigError
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.config.split import split_experiment

DOC = Path(__file__).resolve().parents[1] / "docs" / "stage-files.md"

_ABSENT = object()


def test_the_reference_in_docs_is_what_the_parser_generates():
    assert DOC.read_text(encoding="utf-8") == reference.render(), \
        "docs/stage-files.md is stale: run `python -m distgrad.config.reference > docs/stage-files.md`"


@pytest.mark.parametrize("table,keys", [("interface", schema.INTERFACE_KEYS), ("stage", schema.STAGE_KEYS),
                                        ("", schema.STAGE_FILE_KEYS)])
def test_every_documented_key_is_one_the_parser_knows_and_no_other(table, keys):
    raw = {"interface": {"name": "x", "stages": ["f", "g"], "activation": {"shape": [1]}}, "stage": {"name": "f"}}
    for key in keys:
        where = raw if table == "" else raw[table]
        before = where.get(key, _ABSENT)
        where[key] = object()            # a value no key accepts: the error is about the value, not the key
        try:
            parse_experiment(raw, "x.toml")
        except (ConfigError, TypeError, AttributeError) as e:
            assert "unknown" not in str(e) or key not in str(e).split("allowed")[0], (key, e)
        if before is _ABSENT:
            where.pop(key)
        else:
            where[key] = before
    where = raw if table == "" else raw[table]
    where["no_such_key"] = 1
    with pytest.raises(ConfigError, match="unknown"):
        parse_experiment(raw, "x.toml")


def test_every_combined_key_is_one_the_parser_knows():
    exp = load_experiment("digits")
    for key in schema.TOP_KEYS:
        raw = copy.deepcopy(exp.raw)
        raw.setdefault(key, raw.get(key))
        try:
            parse_experiment({**raw, key: raw[key]} if raw[key] is not None else raw, exp.source)
        except ConfigError as e:
            assert "unknown top-level" not in str(e), (key, e)
    for key in schema.COMBINED_STAGE_KEYS:
        raw = copy.deepcopy(exp.raw)
        raw["stages"][0][key] = object()
        try:
            parse_experiment(raw, exp.source)
        except (ConfigError, TypeError) as e:
            assert "unknown keys" not in str(e), (key, e)


def test_every_option_of_the_registries_has_a_meaning():
    import inspect

    from distgrad.config import data

    from distgrad.model import nn

    from distgrad.model import optim
    data_options = {name for cls in data._KINDS.values() for name in inspect.signature(cls.__init__).parameters
                    if name not in data._INTERNAL}
    assert data_options <= set(schema.DATA_OPTIONS), sorted(data_options - set(schema.DATA_OPTIONS))
    layer_keys = {key for keys in nn._LAYER_KEYS.values() for key in keys if key != "type"}
    assert layer_keys <= set(schema.LAYER_KEYS), sorted(layer_keys - set(schema.LAYER_KEYS))
    optimizer_options = {name for cls in optim.OPTIMIZERS.values()
                         for name in inspect.signature(cls.__init__).parameters if name != "self"}
    assert optimizer_options <= set(schema.OPTIMIZER_OPTIONS)


# ---------------------------------------------------------------- every accepted key is read

def _combined(name: str) -> tuple[dict, str]:
    exp = load_experiment(name)
    return copy.deepcopy(exp.raw), exp.source


def _vertical_sum() -> tuple[dict, str]:
    """vertical-classify with aggregate = "sum" (g then takes one embedding's 8 columns)."""
    raw, source = _combined("vertical-classify")
    raw["aggregate"] = "sum"
    raw["stages"][-1]["model"][0]["in"] = 8
    return raw, source


def _vertical_sum_stage_file(tmp_path: Path, stage: str) -> tuple[dict, str]:
    """``stage``'s file of ``_vertical_sum``."""
    from distgrad.config.tomlfile import read_toml
    folder = tmp_path / "vertical-sum-parts"
    if not folder.is_dir():
        raw, source = _vertical_sum()
        split_experiment(parse_experiment(raw, source), folder)
    path = folder / stage / f"{stage}.toml"
    return read_toml(path), str(path)


def _stage_file(tmp_path: Path, name: str, stage: str) -> tuple[dict, str]:
    from distgrad.config.tomlfile import read_toml
    folder = tmp_path / f"{name}-parts"
    if not folder.is_dir():
        split_experiment(load_experiment(name), folder)
    path = folder / stage / f"{stage}.toml"
    return read_toml(path), str(path)


def _set(path: str, value: Any, drop: str | None = None) -> Callable[[dict], None]:
    """A change of a raw file: set the key at ``path`` ("a.b", "stages.0.k") to ``value`` (and remove the
    sibling key ``drop``)."""
    def change(raw: dict) -> None:
        *parents, key = path.split(".")
        where: Any = raw
        for part in parents:
            where = where[int(part)] if isinstance(where, list) else where[part]
        where[key] = value
        if drop is not None:
            where.pop(drop)
    return change


# For each shared key (a combined experiment's top level, a stage file's [interface]): a valid value other
# than the one in the base file and the default.
_SHARED_VALUES: dict[str, tuple[Any, str | None]] = {
    "steps": (7, None), "epochs": (2, "steps"), "seed": (5, None), "reduction": ("sum", None),
    "micro_batches": (2, None), "staleness": (1, None), "eval_every": (5, None), "allow_nonfinite": (True, None),
    "send_rows": (True, None),
    "activation_codec": ("float16", None), "gradient_codec": ("float16", None), "clients": ({"count": 2}, None),
}
_LAYERS = [{"type": "dense", "name": "f1", "in": 64, "out": 64, "init": "zeros"}, {"type": "relu"}]
_STAGE_VALUES: dict[str, tuple[str, Any]] = {   # [[stages]] / [stage] keys: (built-in to change, new value)
    "model": ("digits", _LAYERS), "optimizer": ("digits", {"type": "adam", "lr": 0.01}),
    "module": ("digits-cnn-torch", "digits_cnn_torch:make_other"), "module_args": ("digits-cnn-torch", {"channels": 8}),
    "framework": ("digits", "torch"), "device": ("digits-cnn-torch", "cuda"),
    "output": ("digits-cnn-torch", [128]), "columns": ("vertical-classify", [3, 2, 1, 0]),
    "scheduler": ("digits-cnn-torch", {"type": "StepLR", "step_size": 10, "gamma": 0.5}),
    "privacy_meter": ("digits", True),
}

_DEFENSE_VALUES: dict[str, Any] = {"clip_noise": {"max_norm": 1.0, "sigma": 0.5}, "max_norm": True,
                                   "label_dp": {"epsilon": 2.0}, "nopeek": {"weight": 0.1}, "marvell": {"bound": 1.0},
                                   "dp_sgd": {"max_norm": 1.0}}


def _changes(tmp_path: Path) -> dict[tuple[str, str], tuple[tuple[dict, str], Callable[[dict], None]]]:
    """For every (table, key) the parser accepts: a base file and a change of that key alone."""
    digits, file_f, file_g = _combined("digits"), _stage_file(tmp_path, "digits", "f"), _stage_file(tmp_path, "digits", "g")
    changes: dict = {}
    for key, (value, drop) in _SHARED_VALUES.items():
        changes[("top", key)] = (digits, _set(key, value, drop))
        changes[("interface", key)] = (file_f, _set(f"interface.{key}", value, drop and f"{drop}"))
    changes[("top", "labels")] = (digits, _set("labels", "first"))
    changes[("top", "aggregate")] = (_vertical_sum(), _set("aggregate", "mean"))
    changes[("top", "name")] = (digits, _set("name", "other"))
    changes[("top", "description")] = (digits, _set("description", "other"))
    changes[("top", "data")] = (digits, _set("data.test_fraction", 0.25))
    changes[("top", "stages")] = (digits, _set("stages.0.name", "e"))
    middle = _stage_file(tmp_path, "chain4-classify", "m1")          # labels = "first": the targets travel
    changes[("interface", "labels")] = (middle, _set("interface.labels", "last", "target"))
    changes[("interface", "target")] = (middle, _set("interface.target", {"shape": [1], "dtype": "float32"}))
    changes[("interface", "batch")] = (middle, _set("interface.batch", 16))
    changes[("interface", "name")] = (file_f, _set("interface.name", "other"))
    changes[("interface", "activation")] = (file_f, _set("interface.activation", {"shape": [32], "dtype": "float32"}))
    changes[("interface", "stages")] = (file_f, _set("interface.stages", ["f", "h"]))
    changes[("interface", "aggregate")] = (_stage_file(tmp_path, "vertical-classify", "a"),
                                           _set("interface.aggregate", "sum"))
    changes[("top", "secure_aggregation")] = (_vertical_sum(), _set("secure_aggregation", True))
    changes[("interface", "secure_aggregation")] = (_vertical_sum_stage_file(tmp_path, "a"),
                                                    _set("interface.secure_aggregation", True))
    for key, (name, value) in _STAGE_VALUES.items():
        changes[("stages", key)] = (_combined(name), _set(f"stages.0.{key}", value))
    changes[("stages", "name")] = (digits, _set("stages.0.name", "e"))
    changes[("stages", "loss")] = (_combined("tanh-regression"), _set("stages.1.loss", "sum_squared_error"))
    for key in ("model", "optimizer", "framework", "module", "module_args", "device", "columns", "scheduler",
                "privacy_meter"):
        name = _STAGE_VALUES[key][0]
        changes[("stage", key)] = (_stage_file(tmp_path, name, "a" if name == "vertical-classify" else "f"),
                                   _set(f"stage.{key}", _STAGE_VALUES[key][1]))
    bottom = [{"type": "dense", "name": "own1", "in": 12, "out": 8}]     # the label owner's, over all 12 columns
    changes[("stages", "bottom")] = (_vertical_sum(), _set("stages.3.bottom", bottom))
    changes[("stage", "bottom")] = (_stage_file(tmp_path, "vertical-classify", "g"), _set("stage.bottom", bottom))
    changes[("stage", "name")] = (_stage_file(tmp_path, "vertical-classify", "a"), _set("stage.name", "b"))
    changes[("stage", "loss")] = (_stage_file(tmp_path, "tanh-regression", "g"), _set("stage.loss", "sum_squared_error"))
    changes[("stage", "seed")] = (file_f, _set("stage.seed", 3))
    for key, value in (("metrics", ["auc"]), ("keep_best", "test_loss"),        # the label owner's only
                       ("early_stopping", {"metric": "test_loss", "patience": 2})):
        changes[("stages", key)] = (digits, _set(f"stages.1.{key}", value))
        changes[("stage", key)] = (file_g, _set(f"stage.{key}", value))
    for key, value in _DEFENSE_VALUES.items():      # clip_noise, nopeek: the data owner's; the rest the label owner's
        stage = 0 if key in ("clip_noise", "nopeek") else 1
        changes[("stages", key)] = (digits, _set(f"stages.{stage}.{key}", value))
        changes[("stage", key)] = ((file_f, file_g)[stage], _set(f"stage.{key}", value))
    changes[("stages", "input_guard")] = (digits, _set("stages.0.input_guard", {"max_r2": 0.9}))   # data owner's
    changes[("stage", "input_guard")] = (file_f, _set("stage.input_guard", {"max_r2": 0.9}))
    changes[("file", "description")] = (file_f, _set("description", "other"))
    changes[("file", "data")] = (file_f, _set("data.test_fraction", 0.25))
    changes[("file", "interface")] = (file_f, _set("interface.steps", 9))
    changes[("file", "stage")] = (file_f, _set("stage.optimizer", {"type": "sgd", "lr": 0.1}))
    return changes


# Keys whose every other valid value contradicts another key of the base file: the parser must read them to
# refuse the change, naming what it checked.
_CHECKED_AGAINST_OTHERS = {("interface", "activation"): "the interface says the activation it sends is",
                           ("stage", "loss"): "'reduction' is 'mean' but this stage's loss reduces rows by sum",
                           ("stages", "output"): "dense layer 'g1' takes (batch, 256), got (32, 128)",
                           ("stage", "bottom"): "dense layer 'g1' takes (batch, 24), got (32, 32)",   # concat: +8
                           ("stage", "marvell"): "'marvell' is defined for a two-class task",     # digits: 10
                           ("stages", "marvell"): "'marvell' is defined for a two-class task",
                           ("stage", "dp_sgd"): "shares clip_noise's sigma and budget",   # g has none
                           ("stages", "dp_sgd"): "shares clip_noise's sigma and budget",
                           ("top", "reduction"): "'reduction' is 'sum' but the loss reduces rows by mean"}

_TABLES = {"top": schema.TOP_KEYS, "stages": schema.COMBINED_STAGE_KEYS, "file": schema.STAGE_FILE_KEYS,
           "interface": schema.INTERFACE_KEYS, "stage": schema.STAGE_KEYS}


def _observable(exp: Any) -> dict:
    """What the parser made of a file, but the raw file itself and what is computed from it alone."""
    import dataclasses

    def fields(obj: Any, skip: set[str]) -> dict:
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in skip}
    out = fields(exp, {"raw", "fingerprint", "source", "_derived", "stages"})
    out["stages"] = [fields(spec, {"source", "base_dir"}) for spec in exp.stages]
    return out


def test_every_key_the_parser_accepts_changes_what_it_makes(tmp_path: Path):
    """A key in the schema tables that no code reads must fail a test. For each key the parser
    accepts (every entry of the schema's tables), a valid file and the same file with that key alone
    changed must parse to experiments that differ beyond the raw text. A key added to a table needs an
    entry in ``_changes`` that shows what it does."""
    changes = _changes(tmp_path)
    accepted = {(table, key) for table, keys in _TABLES.items() for key in keys}
    assert accepted == set(changes), f"give each new key a change in _changes: {sorted(accepted ^ set(changes))}"
    for (table, key), ((base, source), change) in sorted(changes.items()):
        changed = copy.deepcopy(base)
        change(changed)
        if (table, key) in _CHECKED_AGAINST_OTHERS:
            with pytest.raises(ConfigError, match=re.escape(_CHECKED_AGAINST_OTHERS[table, key])):
                parse_experiment(changed, source)
            continue
        assert _observable(parse_experiment(changed, source)) != _observable(parse_experiment(base, source)), \
            f"{table} key {key!r} is accepted but changing it changes nothing the parser makes"


# ---------------------------------------------------------------- one declaration per key drives the parser

def _declared_bases(tmp_path: Path) -> dict[str, tuple[dict, str, Callable[[dict], dict]]]:
    """For each declared table: a valid base file and where in it the table's keys go."""
    digits, file_f, file_g = _combined("digits"), _stage_file(tmp_path, "digits", "f"), _stage_file(tmp_path, "digits", "g")
    return {"top": (*digits, lambda raw: raw), "stages": (*digits, lambda raw: raw["stages"][1]),
            "file": (*file_f, lambda raw: raw), "interface": (*file_f, lambda raw: raw["interface"]),
            "stage": (*file_g, lambda raw: raw["stage"]),
            "clients": (*digits, lambda raw: raw.setdefault("clients", {})),
            "activation": (*file_f, lambda raw: raw["interface"]["activation"]),
            "target": (*_stage_file(tmp_path, "chain4-classify", "m1"), lambda raw: raw["interface"]["target"])}


_DECLARED = {**_TABLES, "clients": schema.CLIENT_KEYS, "activation": schema.ACTIVATION_KEYS,
             "target": schema.TARGET_KEYS}
_REFUSED_BY_EVERY_CHECK = [object(), True, -1, "", [], {}, 1.5, "no such value"]


def test_every_checked_key_is_refused_by_its_declaration_naming_key_expectation_and_value(tmp_path: Path):
    """A value a key's declared check refuses fails the parse with the declaration's words: the key, what it
    must be (``Check.expect``) and the value given; a bool is never taken for an integer."""
    bases = _declared_bases(tmp_path)
    checked = 0
    for table, keys in _DECLARED.items():
        base, source, where = bases[table]
        for name, key in keys.items():
            if key.check is None or key.check.convert is not None:
                continue
            for value in _REFUSED_BY_EVERY_CHECK:
                if key.check.accepts(value):
                    continue
                raw = copy.deepcopy(base)
                where(raw)[name] = value
                if name == "epochs":
                    where(raw).pop("steps")          # 'steps' and 'epochs' exclude each other
                with pytest.raises(ConfigError) as e:
                    parse_experiment(raw, source)
                assert f"'{name}' must be {key.check.expect}, got {value!r}" in str(e.value), (table, name, e.value)
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("value", [True, False])
def test_no_integer_key_takes_a_bool(value):
    integer_checks = [key.check for keys in _DECLARED.values() for key in keys.values()
                      if key.check is not None and key.check.kind.startswith("integer")]
    assert len(integer_checks) >= 8
    assert not any(check.accepts(value) for check in integer_checks)


def test_an_absent_key_means_its_declared_default(tmp_path: Path):
    """Giving a key its declared default parses to what leaving it out does."""
    bases = _declared_bases(tmp_path)
    compared = 0
    for table, keys in _DECLARED.items():
        base, source, where = bases[table]
        for name, key in keys.items():
            if key.check is None or key.default in (ABSENT, REQUIRED):
                continue
            absent, given = copy.deepcopy(base), copy.deepcopy(base)
            where(absent).pop(name, None)
            where(given)[name] = copy.deepcopy(key.default)
            if name == "steps" or name == "module_args":
                continue    # the files give steps (absent means 100, as declared); only a module takes module_args
            assert _observable(parse_experiment(given, source)) == _observable(parse_experiment(absent, source)), \
                (table, name)
            compared += 1
    assert compared >= 20


def test_a_key_only_the_last_stage_may_set_is_refused_on_another_naming_why():
    raw, source = _combined("digits")
    last_only = {name: key for name, key in schema.COMBINED_STAGE_KEYS.items() if key.who == schema.LAST}
    assert {"metrics", "keep_best", "early_stopping", "bottom"} <= set(last_only)
    values = {"metrics": ["auc"], "keep_best": "test_loss", "early_stopping": {"metric": "test_loss", "patience": 2},
              "bottom": [{"type": "relu"}]}
    for name, key in last_only.items():
        changed = copy.deepcopy(raw)
        changed["stages"][0][name] = values[name]
        with pytest.raises(ConfigError, match=re.escape(f"[{name!r}] belong to the last stage ({key.why})")):
            parse_experiment(changed, source)


def test_the_reference_shows_each_declared_key_with_its_type_default_and_who_sets_it():
    text = reference.render()
    for _title, keys, _what, who in schema.TABLES:
        for name, key in keys.items():
            cells = (key.type_text, key.default_text, key.who or who)
            row = f"| `{name}` | " + " | ".join(reference._cell(cell) for cell in cells) + " |"
            assert row in text, row


def test_an_unknown_key_is_named_once_with_the_valid_ones_in_every_table(tmp_path: Path):
    bases = _declared_bases(tmp_path)
    leads = {"top": "unknown top-level keys", "stages": "stage 1 has unknown keys", "file": "unknown top-level keys",
             "interface": "[interface] has unknown keys", "stage": "[stage] has unknown keys",
             "clients": "[clients] has unknown keys", "activation": "[interface] activation has unknown keys",
             "target": "[interface] target has unknown keys"}
    for table, keys in _DECLARED.items():
        base, source, where = bases[table]
        raw = copy.deepcopy(base)
        where(raw)["no_such_key"] = 1
        with pytest.raises(ConfigError) as e:
            parse_experiment(raw, source)
        assert f"{leads[table]} ['no_such_key']; allowed: {sorted(keys)}" in str(e.value), (table, e.value)
        assert str(e.value).split(source)[-1].count("unknown") == 1, e.value
