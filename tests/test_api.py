"""The Python API example (docs/experiments.md) runs as written, and the in-thread stage cleans up."""

from __future__ import annotations

import re
from pathlib import Path

import distgrad

PAGE = Path(__file__).resolve().parent.parent / "docs" / "experiments.md"


def test_the_python_api_example_runs(capsys):
    text = PAGE.read_text()
    section = text[text.index("## Python API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/experiments.md", "exec"), {})
    assert "['fW']" in capsys.readouterr().out


def test_serve_stage_stops_when_the_block_ends():
    with distgrad.serve_stage("seed-reverse", keep_serving=True) as g:
        assert g.endpoint.startswith("tcp://127.0.0.1:")
        first = distgrad.drive_stage("seed-reverse", g.endpoint, steps=20)
        second = distgrad.drive_stage("seed-reverse", g.endpoint, steps=20)
    assert first["params"] == second["params"]
    assert not g._thread.is_alive()


def test_a_serving_or_middle_stage_given_the_driving_stages_pipeline_settings_refuses_them():
    """A stage that follows the driving stage's hello (the serving one, a middle one) would accept staleness,
    a window, a schedule, evaluations or micro-batches and never apply them: each is refused, named, before
    anything is served, as ``distgrad-stage`` refuses the flags."""
    import pytest

    from distgrad.errors import ConfigError
    from distgrad.run.options import StageOptions

    exp, chain = distgrad.load_experiment("tanh-regression"), distgrad.load_experiment("chain-regression")
    middle = chain.stage_names[1]
    for settings, named in ((dict(staleness=1), "staleness"), (dict(in_flight=1), "in_flight"),
                            (dict(schedule="gpipe"), "schedule"), (dict(eval_every=5), "eval_every"),
                            (dict(micro_batches=4), "micro_batches")):
        with pytest.raises(ConfigError, match=f"^{named}.*follows the driving stage's hello"):
            distgrad.serve_stage(exp, **settings)
        with pytest.raises(ConfigError, match=f"{named}: stage '{middle}' is the middle stage"):
            StageOptions(chain, middle, 0, **settings)
    assert StageOptions(exp, "g", 0, micro_batches=exp.micro_batches).micro_batches == exp.micro_batches
    assert StageOptions(exp, "f", 0, staleness=1, micro_batches=4, eval_every=5).steps_in_flight == 1
