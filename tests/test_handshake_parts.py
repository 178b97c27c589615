"""A hello whose interface differs is refused naming each field that differs with both values
(each party its own stage file); what is private to a party (its model, optimiser, data) is not compared.

The hello carries ``parts`` (``Experiment.interface_parts``). The receiver
names every differing field as ``batch: f has 32, g has 64`` and validates
``parts`` like every wire field.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from distgrad.wire import messages as wire
from distgrad.run.options import StageOptions
from distgrad.errors import ProtocolError
from distgrad.config.experiment import MAX_PARTS
from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.run.handshake import check_hello
from distgrad.run.serving import ServingStage
from distgrad.stage.stage import Stage
from distgrad.wire.messages import ErrorCode

from conftest import hello_message, run_cli
from handshake import only_reply


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
    body = hello_message(ours, "r", fingerprint=theirs.interface_fingerprint, parts=theirs.interface_parts(),
                         role=first.name, activation={"shape": list(first.output_shape), "dtype": "float32"},
                         **changes).body
    with pytest.raises(ProtocolError) as info:
        check_hello(body, ours.stage_names[-2], ours, ours.seed, first.output_shape, ours.stage_names[-1])
    return info.value


def test_a_differing_interface_is_refused_naming_each_field_and_both_values():
    g_exp, f_exp = _variant("seed-reverse", _steps_and_f_model)
    error = _refusal(g_exp, f_exp)
    assert error.code == ErrorCode.MISMATCH
    assert "the interface of stage f differs from stage g's: steps: f has 200, g has 900 (" in str(error)
    assert "model" not in str(error)            # f's model is f's own business


@pytest.mark.parametrize("change,needle", [
    (lambda raw: raw.update(seed=5), "seed: f has 5, g has 0"),
    (lambda raw: raw.update(labels="first"), "labels: f has 'first', g has 'last'"),
    (lambda raw: raw["stages"][1].update(loss="mean_squared_error"), "reduction: f has 'mean', g has 'sum'"),
    (lambda raw: raw["data"].update(batch=64), "batch: f has 64, g has 32"),
    (lambda raw: raw["data"].update(test_fraction=0.25), "held-out rows: f has 449, g has 359"),
    (lambda raw: raw["stages"][0]["model"][0].update(out=32) or raw["stages"][1]["model"][0].update(**{"in": 32}),
     "activation 1: f has '32x32 float32', g has '32x64 float32'"),
])
def test_each_interface_field_is_named_with_both_values(change, needle):
    name = "seed-reverse" if "batch" not in needle and "rows" not in needle and "activation" not in needle \
        else "digits"
    g_exp, f_exp = _variant(name, change)
    if "activation" in needle:
        ours = g_exp
        body = hello_message(ours, "r", fingerprint=f_exp.interface_fingerprint, parts=f_exp.interface_parts()).body
        with pytest.raises(ProtocolError) as info:
            check_hello(body, "f", ours, ours.seed, ours.cuts[0], "g")
        assert needle in str(info.value)
        return
    assert needle in str(_refusal(g_exp, f_exp))


@pytest.mark.parametrize("change", [
    lambda raw: raw["data"].update(delta=-0.2),
    lambda raw: raw["stages"][0]["optimizer"].update(lr=0.2),
    lambda raw: raw["stages"][1]["optimizer"].update(lr=0.2),
    lambda raw: raw["stages"][0]["model"][0]["init"].update(stddev=0.5),
    lambda raw: raw.update(description="another"),
])
def test_what_is_private_to_a_party_is_not_compared(change):
    g_exp, f_exp = _variant("seed-reverse", change)
    assert f_exp.interface_parts() == g_exp.interface_parts()
    first = Stage.from_experiment(g_exp, "f")
    body = hello_message(g_exp, "r", fingerprint=f_exp.interface_fingerprint, parts=f_exp.interface_parts()).body
    assert check_hello(body, "f", g_exp, g_exp.seed, first.output_shape, "g") == 1


def test_a_middle_stage_and_a_stage_of_several_clients_name_the_fields_too():
    g_exp, m_exp = _variant("chain4-classify", lambda raw: raw.update(steps=9))
    server = ServingStage(StageOptions(g_exp, "g", g_exp.seed))
    first = Stage.from_experiment(g_exp, "m2")
    hello = hello_message(g_exp, "r", role="m2", fingerprint=m_exp.interface_fingerprint,
                          parts=m_exp.interface_parts(),
                          activation={"shape": list(first.output_shape), "dtype": "float32"})
    with pytest.raises(ProtocolError, match="stage m2 differs from stage g's: steps: m2 has 9, g has 150"):
        server.handle([b"peer"], hello, 0.0)

    g_exp, f_exp = _variant("digits-clients", lambda raw: raw.update(steps=7))
    clients = ServingStage(StageOptions(g_exp, "g", g_exp.seed))
    hello = hello_message(g_exp, "r", client=0, fingerprint=f_exp.interface_fingerprint,
                          parts=f_exp.interface_parts())
    with pytest.raises(ProtocolError, match=r"steps: f has 7, g has 300"):
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
        check_hello(hello_message(exp, "r", parts=parts, fingerprint=other.interface_fingerprint).body, "f", exp,
                    exp.seed,
                    shape, "g")
    assert info.value.code == ErrorCode.MALFORMED and len(str(info.value)) <= wire.ERROR_TEXT_MAX


def test_many_differing_fields_are_counted_not_all_listed():
    g_exp, f_exp = _variant("digits", lambda raw: raw.update(steps=1, seed=1, labels="first", allow_nonfinite=True,
                                                             clients={"count": 2, "mode": "splitfed",
                                                                      "average_every": 3}, name="other")
                            or raw["data"].update(batch=16, test_fraction=0.5))
    text = str(_refusal(g_exp, f_exp))
    assert "name: f has 'other', g has 'digits'" in text
    assert text.count(";") == 8 and "more" in text, text


def test_stages_with_different_experiment_files_say_which_fields_differ(tmp_path: Path, start_server):
    source = (Path(load_experiment("seed-reverse").source)).read_text()
    mine = tmp_path / "f.toml"
    mine.write_text(source.replace("steps = 900", "steps = 300").replace("stddev = 0.01 } }]\noptimizer",
                                                                         "stddev = 0.02 } }]\noptimizer", 1))
    g, endpoint = start_server(str(Path(load_experiment("seed-reverse").source)))
    result = run_cli(["stage", "f", "--experiment", mine, "--connect", endpoint, "--peer-deadline", "10"])
    assert result.returncode == 4, result.stderr
    assert "differs from stage g's: steps: f has 300, g has 900 (" in result.stderr
    assert "differs from stage g's: steps: f has 300, g has 900 (" in g.output


def test_a_refusal_says_where_each_side_s_value_came_from(tmp_path: Path):
    """A value a command-line flag set is named with the flag; the others with the side's file (a stage file's
    path as given, a built-in's name)."""
    from distgrad.config.split import split_experiment
    g_exp = load_experiment("tanh-regression").with_codecs("float16", None)
    f_file = split_experiment(load_experiment("tanh-regression"), tmp_path / "parties")[0]
    f_exp = load_experiment(f_file).with_codecs("int8", "bfloat16")
    server = ServingStage(StageOptions(g_exp, "g", g_exp.seed))
    with pytest.raises(ProtocolError) as info:
        server.handle([b"peer"], hello_message(f_exp, "r"), 0.0)
    text = str(info.value)
    assert ("activation_codec: f has 'int8' (set by f's --activation-codec), g has 'float16' (set by g's "
            "--activation-codec); gradient_codec: f has 'bfloat16' (set by f's --gradient-codec), g has nothing "
            "(the parties must agree on the interface: a value no flag set comes from f's stage file "
            f"{f_file.name} and g's built-in experiment 'tanh-regression')") in text
    assert str(f_file.parent) not in text           # a party's folders stay its own


@pytest.mark.parametrize("origins", [[], {"steps": 3}, {"*": "x" * 201}, {"*": "a\nb"}, {1: "x"}])
def test_origins_are_validated(origins):
    exp = load_experiment("seed-reverse")
    shape = Stage.from_experiment(exp, "f").output_shape
    with pytest.raises(ProtocolError) as info:
        check_hello(hello_message(exp, "r", origins=origins).body, "f", exp, exp.seed, shape, "g")
    assert info.value.code == ErrorCode.MALFORMED and "origins" in str(info.value)


def test_stages_given_other_codecs_by_flag_say_so_on_both_sides(start_server):
    g, endpoint = start_server("tanh-regression", "--activation-codec", "int8")
    result = run_cli(["stage", "f", "--experiment", "tanh-regression", "--connect", endpoint, "--peer-deadline", "10"])
    assert result.returncode == 4, result.stderr
    needle = ("activation_codec: f has nothing, g has 'int8' (set by g's --activation-codec) (the parties must agree "
              "on the interface: a value no flag set comes from f's built-in experiment 'tanh-regression' and g's "
              "built-in experiment 'tanh-regression')")
    assert needle in result.stderr and needle in g.output


def test_a_hello_naming_another_partys_run_id_is_refused_and_changes_nothing():
    # The vertical twin of test_clients.py::test_a_client_index_out_of_range_in_a_hello_is_refused's run id
    # check: a party's messages are found by run id, so a second party may not take the first's.
    exp = load_experiment("vertical-classify")
    last = exp.stage_names[-1]
    server = ServingStage(StageOptions(exp, last, exp.seed))
    first, second = exp.stage_names[:2]

    def hello(role: str, run: str) -> wire.Message:
        shape = Stage.from_experiment(exp, role).output_shape
        return hello_message(exp, run, role=role, activation={"shape": list(shape), "dtype": "float32"})

    assert only_reply(server.handle([b"a"], hello(first, "r1"), 0.0)).type == wire.WELCOME
    with pytest.raises(ProtocolError, match=f"run 'r1' is party {first}'s; party {second} needs a run id") as info:
        server.handle([b"b"], hello(second, "r1"), 0.0)
    assert info.value.code == ErrorCode.RUN
    assert [p.run for p in server.run.peers][:2] == ["r1", ""]
    assert only_reply(server.handle([b"b"], hello(second, "r2"), 0.0)).type == wire.WELCOME
