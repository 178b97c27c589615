"""``distgrad split``: the per-party stage files of a combined experiment.

Each stage gets a folder of its own holding a file with the interface every
party shares and its own ``[stage]`` table, and only its own part of the
data, copied next to it: the data owner the features, the label owner the
labels, a middle stage none. Loading the written files back gives the same
interface as the experiment (checked once they are written; on a failure
they are removed).
"""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from distgrad.config.data import build_data
from distgrad.jsontext import json_text
from distgrad.errors import ConfigError
from distgrad.config.npzfile import write_npz
from distgrad.config.experiment import FILE_KINDS, Experiment
from distgrad.config.parse import load_experiment

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
        return json_text(value, ensure_ascii=False)     # JSON's escapes are TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items()) + " }" if value \
            else "{}"
    raise ConfigError(f"cannot write {value!r} ({type(value).__name__}) to TOML")


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else json_text(key, ensure_ascii=False)


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
    for key, default in (("micro_batches", 1), ("eval_every", 0), ("allow_nonfinite", False), ("send_rows", False),
                         ("staleness", 0)):
        if raw.get(key, default) != default:
            table[key] = raw[key]
    if "clients" in raw:
        table["clients"] = dict(raw["clients"])
    if exp.aggregate is not None:
        table["aggregate"] = exp.aggregate
    if exp.secure_aggregation:
        table["secure_aggregation"] = True
    for key in ("activation_codec", "gradient_codec"):
        if getattr(exp, key) != "none":
            table[key] = getattr(exp, key)
    return table


def _stage_table(exp: Experiment, name: str, columns_copied: bool) -> dict[str, Any]:
    """Stage ``name``'s ``[stage]`` table; without ``columns`` when its data file holds only those columns."""
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
        if spec.bottom is not None:
            table["bottom"] = list(spec.bottom)
    if spec.columns is not None and not columns_copied:
        table["columns"] = list(spec.columns)
    if spec.device != "cpu":
        table["device"] = spec.device
    table["optimizer"] = dict(spec.optimizer)
    if spec.scheduler is not None:
        table["scheduler"] = dict(spec.scheduler)
    if spec.privacy_meter:
        table["privacy_meter"] = True
    if spec.input_guard is not None:
        table["input_guard"] = {"max_r2": spec.input_guard[0], "after": spec.input_guard[1]}
    if spec.loss is not None:
        table["loss"] = spec.loss
    if spec.metrics:
        table["metrics"] = list(spec.metrics)
    if spec.keep_best is not None:
        table["keep_best"] = spec.keep_best
    if spec.early_stopping is not None:
        table["early_stopping"] = dict(spec.early_stopping)
    table.update(spec.defenses.as_table())         # this party's own defenses stay its own
    return table


def party_data(exp: Experiment, name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
    """Stage ``name``'s own ``[data]`` table and the arrays of its own data file (``NAME.npz``, written next to
    its stage file); None for a stage that needs no data.

    Data generated from the seed keeps the experiment's table and needs no
    file: each party regenerates its part. Data read from files becomes an
    npz of this party's parts of every row, as the experiment's file stores
    them), the label owner's labels (and, with its own ``bottom``, its
    features as a data owner's), nothing else; ``feature_scale``,
    ``label_dtype`` and the row split's settings stay, so every party
    reads the same rows as before; with an ``id_column`` the rows' IDs go
    along (member ``ids``), so the handshake still compares them; the names of
    the features (a csv header's) go along as ``feature_names``, so that
    ``distgrad predict`` matches a CSV ``--input``'s header to them by name. With
    ``[clients]`` the data owners share one stage file, so its data holds
    every owner's rows (each takes its share at run time).
    """
    owner = name == exp.label_owner
    first = name in exp.data_owners or (owner and exp.own_bottom)     # features: a label owner's own too
    if not (first or owner):
        return None
    data = dict(exp.data)
    if data.get("kind") not in FILE_KINDS:
        return data, {}
    carried = [key for key in ("missing", "categorical", "class_names") if data.get(key) not in (None, False, "error")]
    if carried:
        raise ConfigError(f"distgrad split copies each party's columns as numbers into an npz file, which cannot "
                          f"carry [data]'s {carried} (text cells, missing cells): give each party a stage file "
                          f"whose [data] reads its own CSV with these keys instead")
    held = {"features": first, "labels": owner}
    features_only = {} if first else {"standardize": False, "feature_scale": 1.0}   # the features' own, where held
    source = build_data({**data, **features_only, **{part: None for part, mine in held.items() if not mine}},
                        exp.seed, exp.spec(name).base_dir)
    parts = source.own_parts()          # type: ignore[attr-defined]   # a file kind is an ArrayFile
    names = source.feature_names() if "features" in parts else None     # type: ignore[attr-defined]
    columns = exp.spec(name).columns
    if columns is not None and "features" in parts:
        parts["features"] = parts["features"].reshape(len(parts["features"]), -1)[:, columns]
        names = None if names is None else [names[c] for c in columns]
    if names is not None and len(set(names)) != len(names):
        names = None            # a header naming two columns alike names neither: the party reads by position
    kept = ["batch", "test_fraction", "validation_fraction", "split_seed", *(["feature_scale", "standardize"] if first else []),
            *(["label_dtype"] if owner else [])]
    table = {"kind": "npz", "path": f"{name}.npz",
             **{"id_column" if part == "ids" else part: part for part in parts},
             **{key: data[key] for key in kept if key in data},
             **({"feature_names": names} if names is not None else {})}
    return table, parts


def stage_files(exp: Experiment) -> dict[str, tuple[str, dict[str, np.ndarray]]]:
    """``{stage name: (its stage file's text, the arrays of its data file, empty for none)}`` for ``exp``
    (see ``party_data``); each file's paths are relative to the party's own folder.

    Raises ``ConfigError`` for an experiment that is already stage files.
    """
    if not exp.data:
        raise ConfigError(f"{exp.source} is already a stage file")
    interface = interface_table(exp)
    top = {"description": exp.description} if exp.description else {}
    files = {}
    for name in exp.stage_names:
        own = party_data(exp, name)
        table, arrays = own if own is not None else (None, {})
        tables: dict[str, Any] = {"interface": interface, "stage": _stage_table(exp, name, "features" in arrays)}
        if table is not None:
            tables["data"] = table
        files[name] = (toml_document(tables, top), arrays)
    return files


def module_sources(exp: Experiment) -> dict[str, Path]:
    """The files (a ``NAME.py`` or a package folder) of the module stages' code that sits next to the
    experiment, by stage: a stage file written elsewhere needs them next to it (modules on ``sys.path`` are
    found wherever the file is). Stages whose modules share a file each name it."""
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
    """Give every stage of ``exp`` its own folder ``OUT_DIR/STAGE/``: its stage file ``STAGE.toml``, its own
    data (``STAGE.npz``, see ``party_data``) and a copy of its module's code that sits next to the
    experiment (``module_sources``); return the stage files' paths. A party's folder is all it needs:
    copied to another host, it runs there.

    Existing files are left alone (``ConfigError`` naming them) unless
    ``force``. The written files are loaded back together and must give
    ``exp``'s interface; if they do not (a bug), they are removed and
    ``ConfigError`` says so.
    """
    files = stage_files(exp)
    folders = {name: out_dir / name for name in files}
    paths = [folders[name] / f"{name}.toml" for name in files]
    data_files = {folders[name] / f"{name}.npz": arrays for name, (_, arrays) in files.items() if arrays}
    # (source, target) pairs, not a mapping by source: stages sharing one module file each get a copy
    code = [(source, folders[name] / source.name) for name, source in module_sources(exp).items()
            if source.resolve() != (folders[name] / source.name).resolve()]
    existing = [str(p) for p in [*paths, *data_files, *(target for _, target in code)] if p.exists()]
    if existing and not force:
        raise ConfigError(f"{', '.join(existing)} already exist(s); remove them or give --force")
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    for source, target in code:
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target)
    for data_path, arrays in data_files.items():
        write_npz(data_path, arrays)
    for path, (text, _) in zip(paths, files.values()):
        path.write_text(text, encoding="utf-8")
    try:
        combined = load_experiment(paths)
        if combined.interface_parts() != exp.interface_parts():
            raise ConfigError(f"their interface {combined.interface_parts()} differs from the experiment's "
                              f"{exp.interface_parts()}")
    except ConfigError as e:
        for path in [*paths, *data_files]:
            path.unlink(missing_ok=True)
        raise ConfigError(f"internal error: the stage files of {exp.name!r} do not load back: {e}") from e
    return paths
