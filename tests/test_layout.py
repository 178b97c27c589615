"""The code is in parts a reader can hold: no class over about 400 lines, no function over about 50 (counted
from its first line to its last, docstring included), in the modules split along their responsibilities.

Add a module to ``HELD`` once it is split; the limits are the same for every one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "distgrad"
CLASS_LINES, FUNCTION_LINES = 400, 50

HELD = (
    # the serving stage and its topology classes
    "run/serving.py", "run/serving_run.py", "run/serving_rounds.py", "run/topology.py", "run/parties.py",
    "run/peers.py", "run/accepts.py", "run/decisions.py", "run/protocol.py",
    # the cut library's label-owner end: one data owner, several, what they share, their data owners, their state
    "run/cut_server.py", "run/cut_group.py", "run/cut_loop.py", "run/cut_owners.py", "run/cut_state.py",
)


def too_big(path: Path) -> list[str]:
    """The classes and functions of the module at ``path`` over the limits, as ``name: N lines``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > (CLASS_LINES if isinstance(node, ast.ClassDef) else FUNCTION_LINES):
                found.append(f"{path.relative_to(PACKAGE)}:{node.name}: {size} lines")
    return found


@pytest.mark.parametrize("module", HELD)
def test_the_module_is_in_parts_a_reader_can_hold(module):
    found = too_big(PACKAGE / module)
    assert not found, found
