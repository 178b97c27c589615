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
