"""Experiment files: what each stage runs, on what data, from what seed.

An experiment is a TOML file that every stage reads (see the built-ins in
``distgrad/experiments/``). Top-level keys: ``name``, ``description``,
``steps``, ``seed``, ``labels`` (``"last"``: the label owner is the last
stage, the default; ``"first"``: the targets travel downstream with the
activations), ``allow_nonfinite`` (default false: NaN/Inf tensors are refused on
the wire and a stage's own non-finite loss or gradient ends the run, exit 1,
before anything of that step is applied; true: both are accepted and trained
through), ``[clients]`` (several data owners, see
``Clients``), a ``[data]`` table and one
``[[stages]]`` table per stage in order, each with ``name``, ``model`` (a list
of layer tables), ``optimizer``, on the last stage only, ``loss``, and
optionally ``framework`` (``"numpy"``, the default, or ``"torch"``: the same
layers, initial values and optimizer settings computed by PyTorch, see
``distgrad.torch_stage``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from .data import DataSource, build_data
from .errors import ConfigError
from .losses import Loss, build_loss
from .nn import Sequential, Shape, build_model
from .optim import Optimizer, build_optimizer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

BUILTIN_DIR = Path(__file__).parent / "experiments"
_TOP_KEYS = {"name", "description", "steps", "seed", "labels", "allow_nonfinite", "data", "stages", "clients"}
CLIENT_MODES = ("separate", "splitfed")
_STAGE_KEYS = {"name", "model", "optimizer", "loss", "framework"}
FRAMEWORKS = ("numpy", "torch")   # what a stage computes with; torch needs the distgrad[torch] extra


def builtin_names() -> list[str]:
    """Names of the experiments shipped with distgrad."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


@dataclass(frozen=True)
class StageSpec:
    name: str
    model: list[dict[str, Any]]
    optimizer: dict[str, Any]
    loss: Any = None
    framework: str = "numpy"


@dataclass(frozen=True)
class Clients:
    """Several data owners, each running the first stage on its own shard (``[clients]``).

    ``mode`` "separate": each keeps its own first-stage parameters (vanilla
    split learning); "splitfed": their parameters are averaged every
    ``average_every`` steps. The serving stage takes one update per client
    per step, in client order (docs/topologies.md).
    """

    count: int = 1
    mode: str = "separate"
    average_every: int = 0


@dataclass(frozen=True)
class Experiment:
    """A validated experiment. ``raw`` is the parsed file; ``fingerprint`` its hash."""

    name: str
    steps: int
    seed: int
    labels: str
    allow_nonfinite: bool
    data: dict[str, Any]
    stages: list[StageSpec]
    raw: dict[str, Any] = field(repr=False)
    fingerprint: str = ""
    source: str = ""
    clients: Clients = Clients()
    # Values derived from the fields above, computed once (see ``input_shapes``, ``final_loss``).
    _derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def federated(self) -> bool:
        """True when several data owners share the serving stage."""
        return self.clients.count > 1

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    @property
    def labels_travel(self) -> bool:
        """True when the targets cross the wire with the activations."""
        return self.labels == "first" and len(self.stages) > 1

    def stage_index(self, name: str) -> int:
        for i, spec in enumerate(self.stages):
            if spec.name == name:
                return i
        raise ConfigError(f"experiment {self.name!r} has no stage {name!r}; its stages are {self.stage_names}")

    def build_data(self, seed: int | None = None, client: int | None = None) -> DataSource:
        """The data source; with ``client``, only that data owner's shard of the training rows."""
        base = Path(self.source).parent if self.source and Path(self.source).is_file() else Path.cwd()
        data = build_data(self.data, self.seed if seed is None else seed, base)
        if client is not None and self.federated:
            data.shard(client, self.clients.count)
        return data

    def input_shapes(self, seed: int | None = None) -> list[Shape]:
        """The input shape of every stage, in order, with the output shape of the last appended.

        Computed once per seed (it builds the data source and every model) and then remembered.
        """
        seed = self.seed if seed is None else seed
        shapes = self._derived.get(("shapes", seed))
        if shapes is None:
            shapes = [self.build_data(seed).feature_shape]
            for spec in self.stages:
                shapes.append(build_model(spec.model, seed).output_shape(shapes[-1]))
            self._derived[("shapes", seed)] = shapes
        return list(shapes)

    @property
    def final_loss(self) -> Loss:
        """The last stage's loss (it also says how micro-batch gradients combine: ``micro_batch_scale``)."""
        loss = self._derived.get("final_loss")
        if loss is None:
            loss = self._derived["final_loss"] = build_loss(self.stages[-1].loss)
        return loss

    def role(self, stage: str) -> str:
        """``"driving"`` (the first stage), ``"serving"`` (the last) or ``"middle"``; raises
        ``ConfigError`` for a name the experiment does not have."""
        index = self.stage_index(stage)
        return "driving" if index == 0 else "serving" if index == len(self.stages) - 1 else "middle"

    def check_role(self, stage: str, binds: bool, connects: bool) -> str:
        """The one check that a stage is run with the endpoints its place needs; returns its role.

        The first stage drives (``--connect``), the last serves (``--bind``), a
        middle stage does both. Raises ``ConfigError`` naming what to give.
        """
        role = self.role(stage)
        if len(self.stages) < 2:
            raise ConfigError(f"experiment {self.name!r} has one stage: run it with 'distgrad run "
                              f"{self.name} --in-process'")
        needs = {"driving": (False, True), "serving": (True, False), "middle": (True, True)}[role]
        if (binds, connects) != needs:
            usage = {"driving": "--connect ENDPOINT (it drives the stage below)",
                     "serving": "--bind ENDPOINT (it serves the stage above)",
                     "middle": "--bind ENDPOINT and --connect ENDPOINT (it serves the stage above and "
                               "connects to the stage below)"}[role]
            raise ConfigError(f"stage {stage!r} is the {role} stage of {self.name!r} (stages "
                              f"{self.stage_names}): give {usage}")
        return role

    def all_param_names(self, seed: int | None = None) -> set[str]:
        names: set[str] = set()
        for spec in self.stages:
            names.update(build_model(spec.model, self.seed if seed is None else seed).params)
        return names


def client_stage_name(stage: str, client: int | None) -> str:
    """How one data owner's copy of ``stage`` is named in summaries, logs and checkpoints (``f@2``)."""
    return stage if client is None else f"{stage}@{client}"


def _fail(source: str, message: str) -> ConfigError:
    return ConfigError(f"experiment {source}: {message}")


def parse_experiment(raw: Mapping[str, Any], source: str = "<dict>") -> Experiment:
    """Validate a parsed experiment table and return an ``Experiment``."""
    raw = dict(raw)
    unknown = set(raw) - _TOP_KEYS
    if unknown:
        raise _fail(source, f"unknown top-level keys {sorted(unknown)}; allowed: {sorted(_TOP_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(source, "'name' must be a non-empty string")
    if not isinstance(raw.get("description", ""), str):
        raise _fail(source, f"'description' must be a string, got {raw['description']!r}")
    steps, seed = raw.get("steps", 100), raw.get("seed", 0)
    if not _whole(steps) or steps < 1:
        raise _fail(source, f"'steps' must be a positive integer, got {steps!r}")
    if not _whole(seed) or seed < 0:
        raise _fail(source, f"'seed' must be a non-negative integer, got {seed!r}")
    allow_nonfinite = raw.get("allow_nonfinite", False)
    if not isinstance(allow_nonfinite, bool):
        raise _fail(source, f"'allow_nonfinite' must be true or false, got {allow_nonfinite!r}")
    labels = raw.get("labels", "last")
    if labels not in ("last", "first"):
        raise _fail(source, f"'labels' must be 'last' or 'first', got {labels!r}")
    data = raw.get("data")
    if not isinstance(data, dict):
        raise _fail(source, "needs a [data] table")
    stage_tables = raw.get("stages")
    if not isinstance(stage_tables, list) or not stage_tables:
        raise _fail(source, "needs at least one [[stages]] table")
    stages = []
    for i, table in enumerate(stage_tables):
        if not isinstance(table, dict):
            raise _fail(source, f"stage {i} is not a table")
        unknown = set(table) - _STAGE_KEYS
        if unknown:
            raise _fail(source, f"stage {i} has unknown keys {sorted(unknown)}; allowed: {sorted(_STAGE_KEYS)}")
        last = i == len(stage_tables) - 1
        if not isinstance(table.get("name"), str) or not table["name"]:
            raise _fail(source, f"stage {i} needs a 'name'")
        if not isinstance(table.get("model"), list):
            raise _fail(source, f"stage {table['name']!r} needs a 'model' list of layers")
        if not isinstance(table.get("optimizer", {}), dict):
            raise _fail(source, f"stage {table['name']!r}: 'optimizer' must be a table such as "
                                f"{{ type = \"adam\", lr = 0.01 }}, got {table['optimizer']!r}")
        if last != ("loss" in table):
            raise _fail(source, f"stage {table['name']!r}: exactly the last stage has a 'loss'")
        framework = table.get("framework", "numpy")
        if framework not in FRAMEWORKS:
            raise _fail(source, f"stage {table['name']!r}: 'framework' must be one of {list(FRAMEWORKS)}, "
                                f"got {framework!r}")
        stages.append(StageSpec(table["name"], list(table["model"]), dict(table.get("optimizer", {})),
                                table.get("loss"), framework))
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise _fail(source, f"stage names must be unique, got {names}")
    clients = _parse_clients(source, raw.get("clients", {}), len(stages))
    canonical = json.dumps(raw, sort_keys=True, separators=(",", ":"))
    exp = Experiment(name, steps, seed, labels, allow_nonfinite, data, stages,
                     raw, hashlib.sha256(canonical.encode()).hexdigest(), source, clients)
    # Build everything once so a bad file fails here, naming itself, not mid-run.
    try:
        data_source = exp.build_data()
        shapes = exp.input_shapes()
        for client in range(clients.count if exp.federated else 0):
            exp.build_data(client=client)
        check_targets(exp, data_source, shapes[-1])
        for spec in stages:
            build_optimizer(spec.optimizer)
        Sequential([layer for spec in stages for layer in build_model(spec.model, seed).layers])
    except ConfigError as e:
        raise _fail(source, str(e)) from e
    return exp


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_targets(exp: Experiment, data: DataSource, output_shape: Shape) -> None:
    """Raise ``ConfigError`` unless the data's targets fit the loss of the last stage's output.

    A prediction of 2 columns against 1 target column would broadcast in the
    loss and train silently; the shapes and dtypes must match exactly.
    """
    loss = exp.final_loss
    expected = tuple(loss.target_shape(tuple(output_shape)))
    loss_name = exp.stages[-1].loss if isinstance(exp.stages[-1].loss, str) else exp.stages[-1].loss.get("type")
    last = exp.stages[-1].name
    if np.dtype(data.target_dtype) != loss.target_dtype:
        raise ConfigError(f"{loss_name} needs {loss.target_dtype} targets, but the data gives "
                          f"{np.dtype(data.target_dtype)} targets"
                          + (" (set label_dtype in [data])" if "label_dtype" in exp.data else ""))
    if tuple(data.target_shape) != expected:
        raise ConfigError(f"the last stage {last!r} outputs shape {tuple(output_shape)}, so {loss_name} needs "
                          f"targets of shape {expected}, but the data gives targets of shape "
                          f"{tuple(data.target_shape)}")


def check_run_settings(exp: Experiment, *, steps: Any = None, seed: Any = None, micro_batches: Any = 1,
                       init: Mapping[str, float] | None = None, checkpoint_dir: Any = None,
                       checkpoint_every: Any = None, resume: bool = False, in_process: bool = False) -> None:
    """The settings of one run, checked once before any process or step starts (every path calls it:
    ``distgrad run``, ``--in-process``, ``distgrad-stage``, the Python API).

    ``None`` means the experiment's value or the default. Raises ``ConfigError``
    naming the bad value: ``steps`` below 1, a negative ``seed``,
    ``micro_batches`` that do not divide the batch, unknown ``init`` names,
    ``checkpoint_every`` or ``resume`` without ``checkpoint_dir``, and with
    ``in_process`` (which keeps no checkpoints) any checkpoint setting.
    """
    if steps is not None and (not _whole(steps) or steps < 1):
        raise ConfigError(f"--steps must be an integer >= 1, got {steps!r}")
    if seed is not None and (not _whole(seed) or seed < 0):
        raise ConfigError(f"--seed must be an integer >= 0, got {seed!r}")
    if not _whole(micro_batches) or micro_batches < 1:
        raise ConfigError(f"--micro-batches must be an integer >= 1, got {micro_batches!r}")
    if micro_batches > 1:
        batch_shape = exp.build_data(exp.seed if seed is None else seed).feature_shape
        if len(batch_shape) < 2 or batch_shape[0] % micro_batches:
            raise ConfigError(f"experiment {exp.name!r} has batches of shape {batch_shape}: "
                              f"they do not split into {micro_batches} equal micro-batches")
    check_init_overrides(exp, init or {})
    if checkpoint_every is not None and (not _whole(checkpoint_every) or checkpoint_every < 0):
        raise ConfigError(f"--checkpoint-every must be an integer >= 0, got {checkpoint_every!r}")
    if checkpoint_every and checkpoint_dir is None:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir (where to save the checkpoints)")
    if resume and checkpoint_dir is None:
        raise ConfigError("--resume needs --checkpoint-dir")
    if in_process and (checkpoint_dir is not None or checkpoint_every or resume):
        raise ConfigError("--in-process keeps no checkpoints: drop --checkpoint-dir, --checkpoint-every "
                          "and --resume (or run the stages as processes)")


def _parse_clients(source: str, table: Any, stage_count: int) -> Clients:
    if not isinstance(table, dict):
        raise _fail(source, "'clients' must be a table")
    unknown = set(table) - {"count", "mode", "average_every"}
    if unknown:
        raise _fail(source, f"[clients] has unknown keys {sorted(unknown)}; allowed: average_every, count, mode")
    count, mode = table.get("count", 1), table.get("mode", "separate")
    every = table.get("average_every", 0)
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= 64:
        raise _fail(source, f"[clients] count must be an integer from 1 to 64, got {count!r}")
    if mode not in CLIENT_MODES:
        raise _fail(source, f"[clients] mode must be one of {list(CLIENT_MODES)}, got {mode!r}")
    if not isinstance(every, int) or isinstance(every, bool) or every < 0 or (mode == "splitfed") != (every > 0):
        raise _fail(source, f"[clients] average_every must be a positive integer with mode = 'splitfed' "
                            f"(and absent otherwise), got {every!r}")
    if count > 1 and stage_count != 2:
        raise _fail(source, f"several clients share one serving stage: the experiment needs exactly two "
                            f"stages, it has {stage_count}")
    return Clients(count, mode, every)


def load_experiment(name_or_path: str | Path) -> Experiment:
    """Load a built-in experiment by name, or an experiment file by path.

    Raises ``ConfigError`` naming the file and the problem.
    """
    path = Path(name_or_path)
    if not path.is_file():
        builtin = BUILTIN_DIR / f"{name_or_path}.toml"
        if not builtin.is_file():
            raise ConfigError(f"no experiment file {str(name_or_path)!r} and no built-in of that name; "
                              f"built-ins: {', '.join(builtin_names())}")
        path = builtin
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read experiment {path}: {e}") from e
    return parse_experiment(raw, str(path))


def parse_init_overrides(text: str | None) -> dict[str, float]:
    """Parse ``NAME=VALUE[,NAME=VALUE]`` into ``{name: value}``."""
    overrides: dict[str, float] = {}
    if not text:
        return overrides
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"invalid --init item {item!r}: expected NAME=VALUE")
        try:
            overrides[name] = float(value)
        except ValueError as e:
            raise ConfigError(f"invalid --init value for {name!r}: {value!r} is not a number") from e
        with np.errstate(over="ignore"):
            finite = bool(np.isfinite(np.float32(overrides[name])))     # 1e40 is inf in float32
        if not finite:
            raise ConfigError(f"invalid --init value for {name!r}: {value!r} is not finite")
    return overrides


def check_init_overrides(exp: Experiment, overrides: Mapping[str, float]) -> None:
    """Raise ``ConfigError`` if an override names no parameter of the experiment."""
    known = exp.all_param_names()
    unknown = set(overrides) - known
    if unknown:
        raise ConfigError(f"--init names unknown parameters {sorted(unknown)}; "
                          f"experiment {exp.name!r} has {sorted(known)}")


def build_stage_parts(exp: Experiment, stage_name: str, seed: int,
                      overrides: Mapping[str, float]) -> tuple[Sequential, Optimizer, Loss | None]:
    """Model, optimizer and (last stage only) loss for one stage, with ``--init`` applied.

    An override fills every element of the named parameter.
    """
    check_init_overrides(exp, overrides)
    index = exp.stage_index(stage_name)
    spec = exp.stages[index]
    model = build_model(spec.model, seed)
    for name, value in overrides.items():
        if name in model.params:
            model.params[name][...] = value
    loss = build_loss(spec.loss) if index == len(exp.stages) - 1 else None
    return model, build_optimizer(spec.optimizer), loss


PART_VALUE_MAX = 64       # a top-level string longer than this is described by its digest
PART_DIGEST_HEX = 16      # hex digits of SHA-256 kept per part: enough to tell two files apart
MAX_PARTS = 128           # parts a hello may name (msgpack maps are limited to 256 entries)


def fingerprint_parts(exp: Experiment) -> dict[str, Any]:
    """The experiment file in named parts, so two stages can say where their files differ.

    Top-level scalars (``steps``, ``seed``, ``labels``, ...) by value, tables
    (``data``, ``clients``) and the ``description`` by a digest, and each stage's ``model``,
    ``optimizer``, ``loss``, ``framework`` by a digest under ``"stage NAME
    KEY"``; an experiment of more stages than fit in ``MAX_PARTS`` names its
    stages as one part, ``"stages"``. Equal fingerprints give equal parts.
    """
    def digest(value: Any) -> str:
        canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:PART_DIGEST_HEX]

    raw = exp.raw
    parts: dict[str, Any] = {}
    for key in sorted(k for k in raw if k != "stages"):
        value = raw[key]
        small = isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= PART_VALUE_MAX
                                                          and key != "description")
        parts[key] = value if small else digest(value)
    per_stage = [(f"stage {table['name']} {key}", digest(table[key]))
                 for table in raw["stages"] for key in sorted(table) if key != "name"]
    if len(parts) + len(per_stage) <= MAX_PARTS:
        parts.update(per_stage)
    else:
        parts["stages"] = digest(raw["stages"])
    return parts
