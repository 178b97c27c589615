"""Modules a reader can hold: in each module listed here, no class over 400 lines and no function over 50
(counted from its first line to its last, docstring included).

A module joins the list once it is split along its responsibilities; the list grows, it does not shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "distgrad"
MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 50

# Paths below distgrad/, one a line, grouped by the part of the package they make up.
HELD_MODULES = [
    # the serving stage's state machine and its topology classes
    "run/serving.py",
    "run/serving_run.py",
    "run/serving_rounds.py",
    "run/topology.py",
    "run/parties.py",
    "run/peers.py",
    "run/accepts.py",
    "run/decisions.py",
    "run/protocol.py",
    # the driving stage's loop (``drive_first_stage``)
    "run/driver.py",
    "run/driver_state.py",
    "run/driver_records.py",
    "run/driver_steps.py",
    # the cut library's label-owner end: one data owner, several, what they share, their data owners, their state
    "run/cut_server.py",
    "run/cut_group.py",
    "run/cut_loop.py",
    "run/cut_owners.py",
    "run/cut_state.py",
    # the cut library's data-owner end: the connection, and the checks of what its loop hands it
    "run/cut_client.py",
    "run/cut_inputs.py",
    # data sources: the registry, the row walk, generated data, file data and its parts, views over a source
    "config/data.py",
    "config/batches.py",
    "config/generated.py",
    "config/arrayfile.py",
    "config/fileparts.py",
    "config/rowids.py",
    "config/preparedtable.py",
    "config/labelvalues.py",
    "config/views.py",
    # a stage's run state (``StageState``): checkpoints and rollback, the privacy records of its runs, the
    # verdicts on its evaluations with the kept model and the final test, the parameter history of steps in flight
    "run/stage_state.py",
    "run/release_records.py",
    "run/run_verdicts.py",
    "stage/history.py",
    # the wire's messages: encoding, and decoding with its limits
    "wire/messages.py",
    # the in-process reference and the local launcher
    "run/inprocess.py",
    "run/launcher.py",
    # the tools users call
    "plot.py",
    # ``distgrad predict``: both ends and the serving loop, the rows a prediction takes, the label owner's files
    "run/predict.py",
    "run/predict_rows.py",
    "run/predict_output.py",
    # the torch stage: the stage and its builder, what it holds and checkpoints, tensors and devices at its boundary,
    # distgrad's layers and losses in torch, its optimizer and scheduler, your own module, DP-SGD's per-example
    # gradients
    "stage/torch_stage.py",
    "stage/torch_state.py",
    "stage/torch_tensors.py",
    "stage/torch_layers.py",
    "stage/torch_optim.py",
    "stage/torch_module.py",
    "stage/torch_per_example.py",
]


def _too_big(source: str) -> list[str]:
    """The classes and functions of the module ``source`` over their limits, with their sizes."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES):
                found.append(f"{node.name}: {size} lines")
    return found


@pytest.mark.parametrize("module", HELD_MODULES)
def test_a_module_is_in_parts_a_reader_can_hold(module):
    too_big = _too_big((PACKAGE / module).read_text())
    assert not too_big, f"distgrad/{module}: {too_big}"


def test_the_size_check_counts_from_the_first_line_to_the_last():
    """The check itself: a function one line over the limit is found, one at the limit is not; a class is
    held to its own limit."""
    body = ["    x = 0"] * (MAX_FUNCTION_LINES - 1)
    assert _too_big("\n".join(["def at():", *body])) == []
    assert _too_big("\n".join(["def over():", *body, "    x = 1"])) == [f"over: {MAX_FUNCTION_LINES + 1} lines"]
    methods = [f"    def m{i}(self):\n        pass\n" for i in range(MAX_CLASS_LINES // 3 + 1)]
    assert _too_big("class Big:\n" + "\n".join(methods)) == [f"Big: {3 * len(methods)} lines"]
