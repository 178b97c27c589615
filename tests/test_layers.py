"""The package's folders are its layers, and imports point one way: down the path a step takes.

``distgrad/`` holds one folder per layer (``model``, ``wire``, ``config``, ``stage``, ``run``), with the
foundations (``errors``, ``threads``, ``jsontext``) and the front ends (``cli``, ``api``, ``align``, ``plot``,
``vertical_example``) at the top. A module may import modules of its own layer or of a layer below,
never above, and no two modules may import each other through any chain. docs/architecture.md draws it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distgrad"

# Lowest first. A folder name stands for every module in it; top-level modules are named one by one.
LAYERS = [
    ("foundations", {"errors", "threads", "jsontext"}),
    ("model math", {"model", "privacy"}),
    ("wire", {"wire"}),
    ("configuration and data", {"config"}),
    ("stage and step engine", {"stage"}),
    ("stage processes and runners", {"run"}),
    ("front ends", {"cli", "api", "align", "plot", "vertical_example", "cut", "torch", "__init__"}),
]
DATA_FOLDERS = {"experiments", "datasets"}   # shipped stage files, their example modules and data sets: not the package's code
LAYER = {unit: index for index, (_, units) in enumerate(LAYERS) for unit in units}


def _module_name(path: Path) -> str:
    """``distgrad/run/serving.py`` -> ``run.serving``; ``distgrad/cli.py`` -> ``cli``; a folder's
    ``__init__.py`` -> the folder's name."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str:
    """The name LAYERS knows a module by: its folder, or itself at the top level."""
    return module.split(".")[0]


def _imports() -> dict[str, set[str]]:
    """Every distgrad module (dotted, below ``distgrad``) and the distgrad modules it imports, at any depth."""
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")
               if path.parent == PACKAGE or path.relative_to(PACKAGE).parts[0] not in DATA_FOLDERS}
    found: dict[str, set[str]] = {}
    for module, path in modules.items():
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distgrad"):
                assert node.level == 0, f"{module}: use absolute imports (from distgrad.<folder>.<module> import ...)"
                base = (node.module or "").removeprefix("distgrad").lstrip(".")
                for alias in node.names:     # `from distgrad.run import serving` imports the module run.serving
                    joined = f"{base}.{alias.name}" if base else alias.name
                    names.add(joined if joined in modules else base)
            elif isinstance(node, ast.ImportFrom) and node.level:
                raise AssertionError(f"{module}: use absolute imports, not a relative one")
            elif isinstance(node, ast.Import):
                names.update(a.name.removeprefix("distgrad.") for a in node.names if a.name.startswith("distgrad."))
        found[module] = {name for name in names if name} - {module}
    return found


def test_every_module_has_a_layer():
    missing = sorted(m for m in _imports() if _unit(m) not in LAYER)
    assert not missing, f"give these a layer in LAYERS (tests/test_layers.py), or move them into a folder: {missing}"


def test_no_module_imports_one_above_it():
    upward = [f"{module} ({LAYERS[LAYER[_unit(module)]][0]}) imports {other} ({LAYERS[LAYER[_unit(other)]][0]})"
              for module, others in _imports().items() for other in others
              if LAYER[_unit(other)] > LAYER[_unit(module)]]
    assert not upward, "\n".join(upward)


def _on_cycles(graph: dict[str, set[str]]) -> list[str]:
    """The modules of ``graph`` (module -> the modules it imports) that reach themselves through imports."""

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for other in graph.get(todo.pop(), ()):
                if other not in seen:
                    seen.add(other)
                    todo.append(other)
        return seen

    return sorted(module for module in graph if module in reach(module))


def test_no_import_cycles():
    cycles = _on_cycles(_imports())
    assert not cycles, f"modules on an import cycle: {cycles}"


def test_every_folder_says_what_it_holds():
    for folder in (p for p in PACKAGE.iterdir() if p.is_dir() and p.name in LAYER):
        init = folder / "__init__.py"
        assert init.is_file(), f"distgrad/{folder.name} has no __init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.split()) >= 10, f"distgrad/{folder.name}/__init__.py: say in its docstring what the layer holds"


def test_the_architecture_page_names_every_folder():
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    for folder in (p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name in LAYER):
        assert f"distgrad/{folder}" in page, f"docs/architecture.md does not describe distgrad/{folder}"


def test_what_leaves_a_stage_passes_one_pipeline():
    """One outgoing pipeline: every runner (the in-process reference, the driver, the serving stage, a middle stage,
    vertical parties, predictions) sends a tensor across the cut through ``wirecodec.Senders``: outside
    ``distgrad/wire`` nothing encodes, decodes or round-trips a tensor with a codec directly, so a new
    transformation of what is sent is added in one place."""
    direct = []
    for path in PACKAGE.rglob("*.py"):
        if path.relative_to(PACKAGE).parts[0] in {"wire", *DATA_FOLDERS}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in {"encode", "decode", "roundtrip", "evaluation_roundtrip"}
                    and "codec" in ast.unparse(node.func.value).lower()):
                direct.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not direct, "send through Senders (distgrad/wire/wirecodec.py), not a codec:\n" + "\n".join(direct)


BENCHMARKS = PACKAGE.parent / "benchmarks"


def _benchmark_imports() -> dict[str, set[str]]:
    """Every module under ``benchmarks/`` (dotted, e.g. ``bench_sections.procs``) and the modules of that folder it
    imports, relative or absolute, at any depth (``if TYPE_CHECKING:`` imports too: a cycle there is still one)."""
    modules = {".".join(p.relative_to(BENCHMARKS).with_suffix("").parts).removesuffix(".__init__"): p
               for p in BENCHMARKS.rglob("*.py")}
    found: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".") if package else []
                base = base[:len(base) - (node.level - 1)] if node.level else []
                stem = ".".join([*base, *(node.module.split(".") if node.module else [])])
                for alias in node.names:
                    joined = f"{stem}.{alias.name}" if stem else alias.name
                    names.add(joined if joined in modules else stem)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        found[module] = {name for name in names if name in modules} - {module}
    return found


def test_no_import_cycles_in_the_benchmarks():
    graph = _benchmark_imports()
    assert "bench_sections.runner" in graph.get("bench_sections.memory", set()), "the import graph misses relative imports"
    cycles = _on_cycles(graph)
    assert not cycles, f"benchmark modules on an import cycle: {cycles}"
