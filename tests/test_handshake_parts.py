"""A hello whose experiment differs is refused naming the parts that differ (issue 12.10).

The hello carries ``parts`` (``experiment.fingerprint_parts``): top-level
values and per-stage digests. The receiver names every differing part, with
both values where the part is a value, and validates ``parts`` like every
wire field.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from distgrad import wire
from distgrad.options import StageOptions
from distgrad.errors import ProtocolError
from distgrad.experiment import MAX_PARTS, fingerprint_parts, load_experiment, parse_experiment
from distgrad.handshake import check_hello
from distgrad.serving import ServingStage
from distgrad.stage import Stage
from distgrad.wire import ErrorCode

from conftest import hello_message, run_cli


def _variant(name: str, change) -> tuple:
    """The built-in ``name`` and a copy of it changed by ``change(raw)``."""
    exp = load_experiment(name)
    raw = copy.deepcopy(exp.raw)
    change(raw)
    return exp, parse_experiment(raw, exp.source)


def _steps_and_f_model(raw: dict) -> None:
    raw["steps"] = 200
    raw["stages"][0]["model"][0]["init"]["stddev"] = 0.02


def _refusal(ours, theirs, **changes) -> ProtocolError:
    first = Stage.from_experiment(ours, ours.stage_names[-2])
    body = hello_message(ours, "r", fingerprint=theirs.fingerprint, parts=fingerprint_parts(theirs),
                         role=first.name, activation={"shape": list(first.output_shape), "dtype": "float32"},
                         **changes).body
    with pytest.raises(ProtocolError) as info:
        check_hello(body, ours.stage_names[-2], ours, ours.seed, first.output_shape, ours.stage_names[-1])
    return info.value


def test_a_differing_experiment_is_refused_naming_each_part_and_both_values():
    g_exp, f_exp = _variant("seed-reverse", _steps_and_f_model)
    error = _refusal(g_exp, f_exp)
    assert error.code == ErrorCode.MISMATCH
    assert "the experiment of stage f differs from stage g's in: steps (f has 200, g has 900); stage f model" \
        in str(error)
    assert "stage g" not in str(error).split("in:")[1].replace("stage g's", "")     # g's own stage is the same


@pytest.mark.parametrize("change,needle", [
    (lambda raw: raw.update(seed=5), "seed (f has 5, g has 0)"),
    (lambda raw: raw.update(labels="first"), "labels (f has 'first', g has 'last')"),
    (lambda raw: raw["data"].update(delta=-0.2), "in: data ("),
    (lambda raw: raw["stages"][1].update(loss="mean_squared_error"), "in: stage g loss ("),
    (lambda raw: raw["stages"][1]["optimizer"].update(lr=0.2), "in: stage g optimizer ("),
    (lambda raw: raw.update(description="another"), "in: description ("),
])
def test_each_kind_of_part_is_named(change, needle):
    g_exp, f_exp = _variant("seed-reverse", change)
    assert needle in str(_refusal(g_exp, f_exp))


def test_a_middle_stage_and_a_stage_of_several_clients_name_the_parts_too():
    g_exp, m_exp = _variant("chain4-classify", lambda raw: raw["stages"][2]["optimizer"].update(lr=0.5))
    server = ServingStage(StageOptions(g_exp, "g", g_exp.seed))
    first = Stage.from_experiment(g_exp, "m2")
    hello = hello_message(g_exp, "r", role="m2", fingerprint=m_exp.fingerprint, parts=fingerprint_parts(m_exp),
                          activation={"shape": list(first.output_shape), "dtype": "float32"})
    with pytest.raises(ProtocolError, match="stage m2 differs from stage g's in: stage m2 optimizer"):
        server.handle([b"peer"], hello, 0.0)

    g_exp, f_exp = _variant("digits-clients", lambda raw: raw.update(steps=7))
    clients = ServingStage(StageOptions(g_exp, "g", g_exp.seed))
    hello = hello_message(g_exp, "r", client=0, fingerprint=f_exp.fingerprint, parts=fingerprint_parts(f_exp))
    with pytest.raises(ProtocolError, match=r"in: steps \(f has 7, g has 300\)"):
        clients.handle([b"peer"], hello, 0.0)


@pytest.mark.parametrize("parts", [
    None, [], "x", {1: 2}, {"steps": [1]}, {"steps": None}, {"x" * 201: 1}, {"name": "y" * 65},
    {f"p{i}": i for i in range(MAX_PARTS + 1)},
])
def test_parts_are_validated_whether_or_not_the_fingerprint_matches(parts):
    exp = load_experiment("seed-reverse")
    shape = Stage.from_experiment(exp, "f").output_shape
    with pytest.raises(ProtocolError) as info:
        check_hello(hello_message(exp, "r", parts=parts).body, "f", exp, exp.seed, shape, "g")
    assert info.value.code == ErrorCode.MALFORMED
    other = parse_experiment({**exp.raw, "steps": 3})
    with pytest.raises(ProtocolError) as info:
        check_hello(hello_message(exp, "r", parts=parts, fingerprint=other.fingerprint).body, "f", exp, exp.seed,
                    shape, "g")
    assert info.value.code == ErrorCode.MALFORMED and len(str(info.value)) <= wire.ERROR_TEXT_MAX


def test_many_differing_parts_are_counted_not_all_listed():
    g_exp, f_exp = _variant("chain4-classify", lambda raw: [s.update(framework="numpy") or s["optimizer"].update(lr=0.9)
                                                        for s in raw["stages"]]
                            + [raw.update(steps=1, seed=1, description="d")])
    text = str(_refusal(g_exp, f_exp))
    assert "stage f framework (only m2 has it)" in text and "stage g framework" not in text
    assert text.count(";") == 8 and "and 3 more" in text, text


def test_stages_with_different_experiment_files_say_which_fields_differ(tmp_path: Path, start_server):
    source = (Path(load_experiment("seed-reverse").source)).read_text()
    mine = tmp_path / "f.toml"
    mine.write_text(source.replace("steps = 900", "steps = 300").replace("stddev = 0.01 } }]\noptimizer",
                                                                         "stddev = 0.02 } }]\noptimizer", 1))
    g, endpoint = start_server(str(Path(load_experiment("seed-reverse").source)))
    result = run_cli(["stage", "f", "--experiment", mine, "--connect", endpoint, "--peer-deadline", "10"])
    assert result.returncode == 4, result.stderr
    assert "differs from stage g's in: steps (f has 300, g has 900); stage f model" in result.stderr
    assert "differs from stage g's in: steps (f has 300, g has 900); stage f model" in g.output
