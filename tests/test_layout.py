"""The code's layout: modules a reader can hold (no class over about 400 lines, no function over about 50)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distgrad"
CLASS_LINES_MAX = 400           # a class, from its first line to its last, docstring included
FUNCTION_LINES_MAX = 50         # a function or method, counted the same way

# Modules held to the limits, by their path under distgrad/ without ".py".
HELD = [
    # the serving stage: its state machine in three classes, and its topology classes
    "run/serving", "run/serving_run", "run/serving_rounds", "run/topology", "run/parties", "run/peers",
    "run/accepts", "run/decisions", "run/protocol",
    # data sources: the registry, the row walk, generated data, file data and its parts, views over a source
    "config/data", "config/batches", "config/generated", "config/arrayfile", "config/fileparts",
    "config/rowids", "config/preparedtable", "config/labelvalues", "config/views",
]


def oversized(module: str) -> list[str]:
    """The classes and functions of ``distgrad/{module}.py`` over the limits, with their sizes."""
    found = []
    for node in ast.walk(ast.parse((PACKAGE / f"{module}.py").read_text())):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            size = node.end_lineno - node.lineno + 1
            if size > (CLASS_LINES_MAX if isinstance(node, ast.ClassDef) else FUNCTION_LINES_MAX):
                found.append(f"{module}.{node.name}: {size} lines")
    return found


def test_the_held_modules_are_in_parts_a_reader_can_hold():
    """The serving state machine and its topology classes, and the data sources: no class over about 400
    lines, no function over about 50 (counted from its first line to its last, docstring included)."""
    too_big = [entry for module in HELD for entry in oversized(module)]
    assert not too_big, too_big
