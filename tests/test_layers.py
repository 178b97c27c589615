"""The package reads like the path a step takes: imports point one way, with no cycles.

Each module of ``distgrad`` sits in one layer; a module may import modules of
its own layer or below, never above, and no two modules may import each other
through any chain.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distgrad"

LAYERS = [
    ("foundations", {"errors", "threads", "schema", "npzfile", "tomlfile"}),
    ("model math", {"nn", "losses", "schedules", "optim", "aggregate", "codecs"}),
    ("experiments and data", {"data", "experiment", "parse", "split", "reference"}),
    ("wire, transport and files", {"wire", "wirecodec", "transport", "keys", "handshake", "link", "records",
                                   "checkpoint", "progress"}),
    ("stage and step engine", {"stage", "engine", "torch_stage", "inprocess"}),
    ("stage processes", {"options", "stage_state", "accepts", "peers", "topology", "parties", "serving",
                         "driver", "predict", "align"}),
    ("front ends", {"launcher", "api", "cli", "plot", "vertical_example", "__init__"}),
]
LAYER = {module: index for index, (_, modules) in enumerate(LAYERS) for module in modules}


def _imports() -> dict[str, set[str]]:
    """Every distgrad module and the distgrad modules it imports (at any depth of its code)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level == 1 or (node.module or "").startswith("distgrad")):
                base = (node.module or "").removeprefix("distgrad").lstrip(".")
                names.update([base] if base else [alias.name for alias in node.names])
            elif isinstance(node, ast.Import):
                names.update(a.name.split(".")[1] for a in node.names if a.name.startswith("distgrad."))
        found[path.stem] = {name.split(".")[0] for name in names} - {path.stem}
    return found


def test_every_module_has_a_layer():
    assert set(_imports()) == set(LAYER), "give a new module its place in LAYERS (tests/test_layers.py)"


def test_no_module_imports_one_above_it():
    upward = [f"{module} ({LAYERS[LAYER[module]][0]}) imports {other} ({LAYERS[LAYER[other]][0]})"
              for module, others in _imports().items() for other in others if LAYER[other] > LAYER[module]]
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    graph = _imports()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for other in graph[todo.pop()]:
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        return seen

    cycles = sorted(module for module in graph if module in reach(module))
    assert not cycles, f"modules on an import cycle: {cycles}"
