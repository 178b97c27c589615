"""``distgrad split``: the per-party stage files of a combined experiment.

Each stage gets a file holding the interface every party shares, its own
``[stage]`` table, and only its own part of the data: the data owner the
features, the label owner the labels (paths rewritten relative to the output
folder), a middle stage none. Loading the written files back gives the same
interface as the experiment (checked before anything is written).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .experiment import FILE_KINDS, Experiment, load_experiment

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def toml_value(value: Any) -> str:
    """``value`` (a bool, int, float, str, list or table of these) as a TOML inline value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)     # JSON's escapes are TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value \
            else "{}"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key, ensure_ascii=False)


def toml_document(tables: Mapping[str, Mapping[str, Any]], top: Mapping[str, Any] | None = None) -> str:
    """A TOML document: ``top``'s keys, then one ``[name]`` table each; lists of tables one item a line."""
    lines = [f"{toml_key(k)} = {toml_value(v)}" for k, v in (top or {}).items()]
    for name, table in tables.items():
        lines += ["", f"[{toml_key(name)}]"]
        for key, value in table.items():
            if isinstance(value, list) and value and all(isinstance(v, Mapping) for v in value):
                lines.append(f"{toml_key(key)} = [")
                lines += [f"  {toml_value(v)}," for v in value]
                lines.append("]")
            else:
                lines.append(f"{toml_key(key)} = {toml_value(value)}")
    return "\n".join(lines).lstrip("\n") + "\n"


def interface_table(exp: Experiment) -> dict[str, Any]:
    """The ``[interface]`` table of ``exp``: what every party's stage file says alike."""
    raw = exp.raw
    table: dict[str, Any] = {"name": exp.name, "stages": list(exp.stage_names)}
    if exp.batch is not None:
        table["batch"] = exp.batch
    shapes = [list(cut[1:] if exp.batch is not None else cut) for cut in exp.cuts]
    activations = [{"shape": shape, "dtype": "float32"} for shape in shapes]
    table["activation"] = activations[0] if len(activations) == 1 else activations
    table.update({"epochs": exp.epochs} if exp.epochs is not None else {"steps": exp.steps})
    table.update(seed=exp.seed, labels=exp.labels, reduction=exp.reduction)
    if exp.target is not None:
        shape, dtype = exp.target
        table["target"] = {"shape": list(shape[1:] if exp.batch is not None else shape), "dtype": dtype}
    for key, default in (("micro_batches", 1), ("eval_every", 0), ("allow_nonfinite", False)):
        if raw.get(key, default) != default:
            table[key] = raw[key]
    if "clients" in raw:
        table["clients"] = dict(raw["clients"])
    if exp.aggregate is not None:
        table["aggregate"] = exp.aggregate
    for key in ("activation_codec", "gradient_codec"):
        if getattr(exp, key) != "none":
            table[key] = getattr(exp, key)
    return table


def _stage_table(exp: Experiment, name: str) -> dict[str, Any]:
    spec = exp.spec(name)
    table: dict[str, Any] = {"name": name}
    if spec.module is not None:
        table["module"] = spec.module
        if spec.module_args:
            table["module_args"] = dict(spec.module_args)
    else:
        table["model"] = list(spec.model or [])
        if spec.framework != "numpy":
            table["framework"] = spec.framework
    if spec.columns is not None:
        table["columns"] = list(spec.columns)
    if spec.device != "cpu":
        table["device"] = spec.device
    table["optimizer"] = dict(spec.optimizer)
    if spec.loss is not None:
        table["loss"] = spec.loss
    return table


def _data_table(exp: Experiment, name: str, out_dir: Path) -> dict[str, Any] | None:
    """Stage ``name``'s own part of the experiment's data, its paths relative to ``out_dir``; None for a
    stage that needs none."""
    first, owner = name in exp.data_owners, name == exp.label_owner
    if not (first or owner):
        return None
    data = dict(exp.data)
    base = exp.spec(name).base_dir

    def moved(path: str) -> str:
        return os.path.relpath((base / path).resolve(), out_dir.resolve())

    if data.get("kind") not in FILE_KINDS:
        return data                       # generated from the seed: each party regenerates its part
    if not first:
        for key in ("features", "feature_scale"):
            data.pop(key, None)
    if not owner:
        for key in ("labels", "label_dtype"):
            data.pop(key, None)
    if data.get("kind") == "npy":
        for key in ("features", "labels"):
            if key in data:
                data[key] = moved(str(data[key]))
    elif "path" in data:
        data["path"] = moved(str(data["path"]))
    if data.get("kind") in ("npz", "csv"):
        data.setdefault("features", "x") if first else None
        data.setdefault("labels", "y") if owner else None
    return data


def stage_files(exp: Experiment, out_dir: Path) -> dict[str, str]:
    """``{stage name: stage file text}`` for ``exp`` written into ``out_dir``.

    Raises ``ConfigError`` for an experiment that is already stage files, or
    (a bug) when the files would not load back to the same interface.
    """
    if not exp.data:
        raise ConfigError(f"{exp.source} is already a stage file")
    interface = interface_table(exp)
    top = {"description": exp.description} if exp.description else {}
    texts = {}
    for name in exp.stage_names:
        tables: dict[str, Any] = {"interface": interface, "stage": _stage_table(exp, name)}
        data = _data_table(exp, name, out_dir)
        if data is not None:
            tables["data"] = data
        texts[name] = toml_document(tables, top)
    return texts


def module_sources(exp: Experiment) -> dict[str, Path]:
    """The files (a ``NAME.py`` or a package folder) of the module stages' code that sits next to the
    experiment, by stage: a stage file written elsewhere needs them next to it (modules on ``sys.path`` are
    found wherever the file is)."""
    sources = {}
    for spec in exp.stages:
        if spec.module is None:
            continue
        top = spec.module.split(":")[0].split(".")[0]
        for candidate in (spec.base_dir / f"{top}.py", spec.base_dir / top):
            if candidate.exists():
                sources[spec.name] = candidate
                break
    return sources


def split_experiment(exp: Experiment, out_dir: Path, force: bool = False) -> list[Path]:
    """Write ``OUT_DIR/STAGE.toml`` for every stage of ``exp``, and copy the code of its module stages that
    sits next to the experiment (``module_sources``) into ``OUT_DIR``; return the stage files' paths.

    Existing files are left alone (``ConfigError`` naming them) unless
    ``force``. The written files are loaded back together and must give
    ``exp``'s interface; if they do not (a bug), they are removed and
    ``ConfigError`` says so.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = stage_files(exp, out_dir)
    paths = [out_dir / f"{name}.toml" for name in texts]
    code = {source: out_dir / source.name for source in module_sources(exp).values()
            if source.resolve() != (out_dir / source.name).resolve()}
    existing = [str(p) for p in [*paths, *code.values()] if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist(s); remove them or give --force")
    for source, target in code.items():
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    for path, text in zip(paths, texts.values()):
        path.write_text(text, encoding="utf-8")
    try:
        combined = load_experiment(paths)
        if combined.interface_parts() != exp.interface_parts():
            raise ConfigError(f"their interface {combined.interface_parts()} differs from the experiment's "
                              f"{exp.interface_parts()}")
    except ConfigError as e:
        for path in paths:
            path.unlink(missing_ok=True)
        raise ConfigError(f"internal error: the stage files of {exp.name!r} do not load back: {e}") from e
    return paths
