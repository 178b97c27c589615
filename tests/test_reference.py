"""The stage-file format reference is generated from the parser's tables and checked against it (issue 14.6)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from distgrad import reference, schema
from distgrad.errors import ConfigError
from distgrad.experiment import load_experiment, parse_experiment
from distgrad.split import stage_files

DOC = Path(__file__).resolve().parents[1] / "docs" / "stage-files.md"

_ABSENT = object()


def test_the_reference_in_docs_is_what_the_parser_generates():
    assert DOC.read_text(encoding="utf-8") == reference.render(), \
        "docs/stage-files.md is stale: run `python -m distgrad.reference > docs/stage-files.md`"


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

    from distgrad import data, nn, optim
    data_options = {name for cls in data._KINDS.values() for name in inspect.signature(cls.__init__).parameters
                    if name not in data._INTERNAL}
    assert data_options <= set(schema.DATA_OPTIONS), sorted(data_options - set(schema.DATA_OPTIONS))
    layer_keys = {key for keys in nn._LAYER_KEYS.values() for key in keys if key != "type"}
    assert layer_keys <= set(schema.LAYER_KEYS), sorted(layer_keys - set(schema.LAYER_KEYS))
    optimizer_options = {name for cls in optim.OPTIMIZERS.values()
                         for name in inspect.signature(cls.__init__).parameters if name != "self"}
    assert optimizer_options <= set(schema.OPTIMIZER_OPTIONS)
