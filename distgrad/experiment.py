"""Experiment and stage files: what each stage runs, on what data, and what the stages agree on.

Two forms, one ``Experiment``:

* a **combined experiment** (the built-ins in ``distgrad/experiments/``):
  one TOML file every stage reads, with top-level keys, a ``[data]`` table
  and one ``[[stages]]`` table per stage in order;
* a **stage file** per party: an ``[interface]`` table (what the parties
  agree on: the stages' names in order, the activation shape and dtype at
  each cut, the batch, the steps or epochs, the seed of the sample order,
  where the labels are), a ``[stage]`` table (this party's model, optimiser
  and, on the label owner, loss) and this party's own ``[data]``. No party
  needs another's model, optimiser or data file; ``distgrad split`` writes
  the stage files of a combined experiment.

Either way the stages compare only the interface (``interface_parts``) in
their handshake; each stage's checkpoints are tied to its own file
(``fingerprint``). Every key, its type, default and meaning is in
``distgrad.schema``, from which docs/stage-files.md is generated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Mapping, Sequence

import numpy as np

from . import schema
from .aggregate import AGGREGATES, combined_shape
from .codecs import Codec, parse_codec
from .data import ColumnView, DataSource, build_data
from .errors import ConfigError
from .losses import Loss, build_loss, build_module_loss
from .nn import DTYPE, Sequential, Shape, build_model
from .optim import Optimizer, build_optimizer
from .tomlfile import read_toml

BUILTIN_DIR = Path(__file__).parent / "experiments"
CLIENT_MODES = ("separate", "splitfed")
# A module stage's parameter names are its module's: ``function(exp, name, seed)`` builds it to tell them.
# Looked up by name only when asked (``Experiment.all_param_names``): this module imports no torch.
MODULE_PARAM_NAMES = "distgrad.torch_stage:module_param_names"
FRAMEWORKS = ("numpy", "torch")   # what a stage computes with; torch needs the distgrad[torch] extra
REDUCTIONS = ("mean", "sum")      # how the loss reduces a batch's rows: how micro-batch gradients combine
WIRE_DTYPES = ("float32",)        # what an activation may be on the wire
FILE_KINDS = ("npz", "npy", "csv")  # data kinds read from files: a party names only the parts it holds


def builtin_names() -> list[str]:
    """Names of the experiments shipped with distgrad."""
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))


@dataclass(frozen=True)
class StageSpec:
    """One stage's own part: what it computes, how it learns, and (stage files) its own data.

    ``model`` is a list of layer tables (numpy layers, or the same computed by
    torch with ``framework = "torch"``); ``module`` instead names a factory
    ``"package.module:function"`` returning a ``torch.nn.Module`` (called with
    ``module_args`` as keyword arguments; the import path is resolved in
    ``base_dir``, the folder of the file that declared it, first), with
    ``optimizer`` and ``loss`` given by torch names. ``device`` is where a
    torch stage computes (``"cpu"``, ``"cuda"``, ``"cuda:N"``). ``output`` is
    the per-row output shape a module stage of a combined experiment declares.
    ``data`` is the stage file's ``[data]`` table (None: the experiment's);
    ``seed`` the seed of this stage's initial values (None: the run's);
    ``columns`` the feature columns it takes from its data (None: all);
    ``scheduler`` a torch stage's ``torch.optim.lr_scheduler`` table (None: none).
    """

    name: str
    model: list[dict[str, Any]] | None
    optimizer: dict[str, Any]
    loss: Any = None
    framework: str = "numpy"
    module: str | None = None
    module_args: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    output: tuple[int, ...] | None = None
    data: dict[str, Any] | None = None
    seed: int | None = None
    base_dir: Path = field(default_factory=Path.cwd, compare=False)
    source: str = ""
    columns: list[int] | None = None
    scheduler: dict[str, Any] | None = None

    def init_seed(self, run_seed: int) -> int:
        """The seed this stage's initial values are drawn from."""
        return run_seed if self.seed is None else self.seed


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
    """A validated experiment or (one or several parties') stage files.

    ``stages`` are the stages this process knows (all of a combined
    experiment; a stage file's one); ``stage_names`` are all of the run's, in
    order. ``cuts[i]`` is the shape of the float32 activation stage ``i``
    sends stage ``i+1`` for a whole batch. ``fingerprint`` identifies the
    file(s) (checkpoints are tied to it); ``interface_fingerprint`` what the
    stages must agree on (the handshake compares it).
    """

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
    stage_names: list[str] = field(default_factory=list)
    cuts: tuple[Shape, ...] = ()
    batch: int | None = None
    reduction: str = "mean"
    micro_batches: int = 1
    eval_every: int = 0
    epochs: int | None = None
    description: str = ""
    target: tuple[Shape, str] | None = None    # a whole batch's targets (shape, dtype) when they travel
    aggregate: str | None = None               # vertical: how the last stage combines the parties' embeddings
    staleness: int = 0                         # the first stage's steps in flight (asynchronous pipelining)
    activation_codec: str = "none"             # how activations cross the wire (``distgrad.codecs``, canonical)
    gradient_codec: str = "none"               # how activation gradients cross it
    flag_origins: tuple[tuple[str, str], ...] = ()   # interface fields a command-line flag set, and the flag
    # Values derived from the fields above, computed once (see ``final_loss``, ``interface_parts``).
    _derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def vertical(self) -> bool:
        """True when every stage but the last is a feature party feeding the last (``aggregate``)."""
        return self.aggregate is not None

    @property
    def codecs(self) -> dict[str, Codec]:
        """The wire codec of each direction: ``{"activation": ..., "activation_grad": ...}``
        (``distgrad.wirecodec``)."""
        return {"activation": parse_codec(self.activation_codec), "activation_grad": parse_codec(self.gradient_codec)}

    def with_codecs(self, activation: str | None = None, gradient: str | None = None) -> "Experiment":
        """This experiment with the codecs ``--activation-codec`` / ``--gradient-codec`` give (None: the
        file's). The codecs are part of the interface, so a stage given other codecs than its peer is
        refused at the handshake, naming the field; checkpoints of other codecs are not resumed (the
        fingerprint changes). Raises ``ConfigError`` for a bad name or a cut the codec cannot carry."""
        names = [self.activation_codec if activation is None else _codec_name(activation, "--activation-codec"),
                 self.gradient_codec if gradient is None else _codec_name(gradient, "--gradient-codec")]
        if names == [self.activation_codec, self.gradient_codec]:
            return self
        flags = [(field, flag) for field, flag, given in (("activation_codec", "--activation-codec", activation),
                                                          ("gradient_codec", "--gradient-codec", gradient))
                 if given is not None]
        exp = dataclasses.replace(self, activation_codec=names[0], gradient_codec=names[1],
                                  fingerprint=_digest({"file": self.fingerprint, "codecs": names}, 64), _derived={},
                                  flag_origins=(*self.flag_origins, *flags))
        check_codecs(exp)
        return exp

    @property
    def data_owners(self) -> list[str]:
        """The stages that hold features and drive: the feature parties (vertical), else the first stage."""
        return list(self.stage_names[:-1]) if self.vertical else [self.stage_names[0]]

    def downstream(self, name: str) -> str:
        """The stage ``name`` sends its activations to (the last one for a feature party)."""
        index = self.stage_index(name)
        return self.stage_names[-1] if self.vertical else self.stage_names[index + 1]

    def upstream(self, name: str) -> list[str]:
        """The stages that send ``name`` their activations: every feature party for the last stage of a
        vertical experiment, else the one stage above (none for a data owner)."""
        index = self.stage_index(name)
        if name in self.data_owners:
            return []
        return self.data_owners if self.vertical else [self.stage_names[index - 1]]

    @property
    def federated(self) -> bool:
        """True when several data owners share the serving stage."""
        return self.clients.count > 1

    @property
    def labels_travel(self) -> bool:
        """True when the targets cross the wire with the activations."""
        return self.labels == "first" and len(self.stage_names) > 1

    @property
    def label_owner(self) -> str:
        """The stage holding the labels: the first when they travel, else the last."""
        return self.stage_names[0] if self.labels_travel else self.stage_names[-1]

    def stage_index(self, name: str) -> int:
        if name in self.stage_names:
            return self.stage_names.index(name)
        raise ConfigError(f"experiment {self.name!r} has no stage {name!r}; its stages are {list(self.stage_names)}")

    def spec(self, name: str) -> StageSpec:
        """The stage's own part; ``ConfigError`` when this experiment's files do not define it."""
        self.stage_index(name)
        for spec in self.stages:
            if spec.name == name:
                return spec
        files = ", ".join(sorted({s.source for s in self.stages})) or self.source
        raise ConfigError(f"stage {name!r} of {self.name!r} is another party's: {files} defines only "
                          f"{[s.name for s in self.stages]}; run stage {name!r} with its own stage file")

    def has_stage(self, name: str) -> bool:
        return any(spec.name == name for spec in self.stages)

    def build_data(self, seed: int | None = None, client: int | None = None, stage: str | None = None
                   ) -> DataSource:
        """The data source of ``stage`` (default: the first stage this experiment defines); with ``client``,
        only that data owner's shard of the training rows. Raises ``ConfigError`` for a stage without data."""
        spec = self.spec(stage) if stage is not None else self.stages[0]
        table = self.data if spec.data is None else spec.data
        if not table:
            raise ConfigError(f"stage {spec.name!r} of {self.name!r} has no [data]")
        data = build_data(table, self.seed if seed is None else seed, spec.base_dir)
        if client is not None and self.federated:
            data.shard(client, self.clients.count)
        return data if spec.columns is None else ColumnView(data, spec.columns)

    def input_shape(self, name: str, seed: int | None = None) -> Shape:
        """The per-step shape of what stage ``name`` receives: its data's features (a data owner), the
        parties' embeddings combined (the last stage of a vertical experiment), else the activation at the
        cut above it."""
        index = self.stage_index(name)
        if self.vertical and index == len(self.stage_names) - 1:
            return combined_shape(self.aggregate, self.cuts)    # type: ignore[arg-type]
        if name not in self.data_owners:
            return self.cuts[index - 1]
        key = ("features", name, self.seed if seed is None else seed)     # each data owner its own columns
        if key not in self._derived:
            shape = self.build_data(seed, stage=name).feature_shape
            if shape is None:
                raise ConfigError(f"the data owner {name!r} needs features in its [data]")
            self._derived[key] = tuple(shape)
        return self._derived[key]

    def output_shape(self, name: str, seed: int | None = None) -> Shape:
        """The per-step shape stage ``name`` produces: the cut below it, or the last stage's prediction
        (from its model; ``ConfigError`` for a module stage, whose shape only building it tells)."""
        index = self.stage_index(name)
        if index < len(self.stage_names) - 1:
            return self.cuts[index]
        spec = self.spec(name)
        if spec.model is None:
            raise ConfigError(f"stage {name!r} is a torch module: build it to learn its output shape")
        key = ("output", self.seed if seed is None else seed)
        if key not in self._derived:
            self._derived[key] = build_model(spec.model, spec.init_seed(self.seed if seed is None else seed)
                                             ).output_shape(self.input_shape(name, seed))
        return self._derived[key]

    @property
    def final_loss(self) -> Loss:
        """The last stage's loss (its file must define the last stage)."""
        loss = self._derived.get("final_loss")
        if loss is None:
            loss = self._derived["final_loss"] = stage_loss(self.spec(self.stage_names[-1]))
        return loss

    def micro_batch_scale(self, count: int) -> np.float32:
        """The float32 factor on the sum of ``count`` micro-batch gradients (and losses): 1 for a loss that
        sums over rows, 1/count for one that averages them (``Loss.micro_batch_scale``)."""
        return DTYPE(1) if self.reduction == "sum" else DTYPE(1) / DTYPE(count)

    def role(self, stage: str) -> str:
        """``"driving"`` (the first stage), ``"serving"`` (the last) or ``"middle"``; raises
        ``ConfigError`` for a name the experiment does not have."""
        index = self.stage_index(stage)
        if stage in self.data_owners:
            return "driving"
        return "serving" if index == len(self.stage_names) - 1 else "middle"

    def check_role(self, stage: str, binds: bool, connects: bool) -> str:
        """The one check that a stage is run with the endpoints its place needs; returns its role.

        The first stage drives (``--connect``), the last serves (``--bind``), a
        middle stage does both. Raises ``ConfigError`` naming what to give.
        """
        role = self.role(stage)
        self.spec(stage)
        if len(self.stage_names) < 2:
            raise ConfigError(f"experiment {self.name!r} has one stage: run it with 'distgrad run "
                              f"{self.name} --in-process'")
        needs = {"driving": (False, True), "serving": (True, False), "middle": (True, True)}[role]
        if (binds, connects) != needs:
            usage = {"driving": "--connect ENDPOINT (it drives the stage below)",
                     "serving": "--bind ENDPOINT (it serves the stage above)",
                     "middle": "--bind ENDPOINT and --connect ENDPOINT (it serves the stage above and "
                               "connects to the stage below)"}[role]
            raise ConfigError(f"stage {stage!r} is the {role} stage of {self.name!r} (stages "
                              f"{list(self.stage_names)}): give {usage}")
        return role

    def all_param_names(self, seed: int | None = None, modules: bool = False) -> set[str]:
        """The parameter names of the layer-list stages this experiment defines; with ``modules``, also
        those of its module stages (each module's ``named_parameters``, which only building it tells:
        that imports torch and calls the factory)."""
        seed = self.seed if seed is None else seed
        names: set[str] = set()
        for spec in self.stages:
            if spec.model is not None:
                names.update(build_model(spec.model, spec.init_seed(seed)).params)
            elif modules:
                module, function = MODULE_PARAM_NAMES.split(":")
                names.update(getattr(importlib.import_module(module), function)(self, spec.name, seed))
        return names

    def known_param_names(self, wanted: AbstractSet[str] | None, seed: int | None = None) -> set[str]:
        """``all_param_names``, building the module stages only when ``wanted`` names one the layer-list
        stages do not have (so checking ``--init`` or ``--trace-params`` imports torch only for them)."""
        names = self.all_param_names(seed)
        if wanted and set(wanted) - names and any(spec.module is not None for spec in self.stages):
            names = self.all_param_names(seed, modules=True)
        return names

    def interface_parts(self) -> dict[str, Any]:
        """What the stages must agree on, by name: numbers, booleans and short strings (see
        ``handshake.check_parts``); equal interfaces give equal parts. Built once."""
        parts = self._derived.get("parts")
        if parts is None:
            parts = {"name": self.name, "stages": ",".join(self.stage_names),
                     "batch": 0 if self.batch is None else self.batch,
                     **{f"activation {i + 1}": "x".join(map(str, shape)) + " float32"
                        for i, shape in enumerate(self.cuts)},
                     **({"target": "x".join(map(str, self.target[0])) + " " + self.target[1]}
                        if self.target is not None else {}),
                     "steps": self.steps, "seed": self.seed, "labels": self.labels, "reduction": self.reduction,
                     "micro_batches": self.micro_batches, "eval_every": self.eval_every,
                     "allow_nonfinite": self.allow_nonfinite, "clients": self.clients.count,
                     "clients mode": self.clients.mode, "clients average_every": self.clients.average_every,
                     **({"aggregate": self.aggregate} if self.vertical else {}),
                     **({"staleness": self.staleness} if self.staleness else {}),

                     # Only when set, so that experiments without codecs keep their fingerprints.
                     **({"activation_codec": self.activation_codec} if self.activation_codec != "none" else {}),
                     **({"gradient_codec": self.gradient_codec} if self.gradient_codec != "none" else {})}
            parts.update(self._order_parts())
            self._derived["parts"] = parts
        return dict(parts)

    def _order_parts(self) -> dict[str, Any]:
        """The sample order as this party computes it: row counts and a digest of the rows of the first
        epoch and of the held-out rows, so two parties that would walk their rows differently are told
        before any step."""
        for spec in self.stages:
            table = self.data if spec.data is None else spec.data
            if table:
                data = self.build_data(stage=spec.name)
                rows = getattr(data, "train_rows", None)
                if rows is None:
                    return {}
                digest = hashlib.sha256(np.asarray(data.test_rows, np.int64).tobytes())
                digest.update(np.asarray(data.epoch_order(0) if hasattr(data, "epoch_order") else rows,
                                         np.int64).tobytes())
                ids = data.row_id_digest() if hasattr(data, "row_id_digest") else None
                return {"rows": int(len(rows) + len(data.test_rows)), "held-out rows": int(len(data.test_rows)),
                        "sample order": digest.hexdigest()[:PART_DIGEST_HEX], **({"row ids": ids} if ids else {})}
        return {}

    def interface_origins(self) -> dict[str, str]:
        """Where this party's interface fields come from, for a refusal to name (the hello carries it):
        ``"*"`` for every field its file sets (a built-in experiment's name, else the file's path as given,
        a long one's tail), and each field a command-line flag set, the flag (``--gradient-codec``)."""
        path = self.source if len(self.source) <= ORIGIN_MAX // 2 else "..." + self.source[3 - ORIGIN_MAX // 2:]
        origin = (f"built-in experiment {Path(self.source).stem!r}" if Path(self.source).parent == BUILTIN_DIR
                  else f"{'experiment' if self.data else 'stage'} file {path}")
        return {"*": origin[:ORIGIN_MAX], **dict(self.flag_origins)}

    @property
    def interface_fingerprint(self) -> str:
        """A digest of ``interface_parts`` (``interface_digest``)."""
        return interface_digest(self.interface_parts())


DATA_PARTS = ("rows", "held-out rows", "sample order", "row ids")   # what only a party holding data can tell


def interface_differences(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> list[str]:
    """The interface fields two parties disagree on, in order; a field of ``DATA_PARTS`` counts only when
    both have it (a party without data cannot tell its rows), except ``row ids``, which counts when both
    hold data (both name their ID column, or neither)."""
    keys = [*ours, *(k for k in theirs if k not in ours)]
    both = {k for k in DATA_PARTS if k in ours and k in theirs}
    if "sample order" in both:
        both.add("row ids")
    return [k for k in keys if not (k in DATA_PARTS and k not in both)
            and (k not in ours or k not in theirs or type(ours[k]) is not type(theirs[k]) or ours[k] != theirs[k])]


def client_stage_name(stage: str, client: int | None) -> str:
    """How one data owner's copy of ``stage`` is named in summaries, logs and checkpoints (``f@2``)."""
    return stage if client is None else f"{stage}@{client}"


def _fail(source: str, message: str) -> ConfigError:
    return ConfigError(f"experiment {source}: {message}")


def interface_digest(parts: Mapping[str, Any]) -> str:
    """The fingerprint of an interface's fields: equal fields, equal fingerprint."""
    return _digest(dict(parts), 64)


def _digest(value: Any, hex_digits: int) -> str:
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:hex_digits]


def _base_dir(source: str) -> Path:
    return Path(source).parent if source and Path(source).is_file() else Path.cwd()


def _parse_stage(source: str, table: Any, index: int, last: bool, party: bool) -> StageSpec:
    """One ``[[stages]]`` (combined) or ``[stage]`` (stage file) table."""
    where = "[stage]" if party else f"stage {index}"
    if not isinstance(table, dict):
        raise _fail(source, f"{where} is not a table")
    allowed = schema.STAGE_KEYS if party else schema.COMBINED_STAGE_KEYS
    unknown = set(table) - set(allowed)
    if unknown:
        raise _fail(source, f"{where} has unknown keys {sorted(unknown)}; allowed: {sorted(allowed)}")
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(source, f"{where} needs a 'name'")
    has_model, module = "model" in table, table.get("module")
    if has_model == (module is not None):
        raise _fail(source, f"stage {name!r} needs either 'model' (a list of layers) or 'module' "
                            f"(\"package.module:factory\" returning a torch.nn.Module), not both")
    if has_model and not isinstance(table["model"], list):
        raise _fail(source, f"stage {name!r} needs a 'model' list of layers")
    if module is not None and (not isinstance(module, str) or module.count(":") != 1
                               or not all(module.split(":"))):
        raise _fail(source, f"stage {name!r}: 'module' must be \"package.module:factory\", got {module!r}")
    if not isinstance(table.get("module_args", {}), dict) or ("module_args" in table and module is None):
        raise _fail(source, f"stage {name!r}: 'module_args' is a table of keyword arguments for 'module'")
    if not isinstance(table.get("optimizer", {}), dict):
        raise _fail(source, f"stage {name!r}: 'optimizer' must be a table such as "
                            f"{{ type = \"adam\", lr = 0.01 }}, got {table['optimizer']!r}")
    if not party and last != ("loss" in table):
        raise _fail(source, f"stage {name!r}: exactly the last stage has a 'loss'")
    framework = table.get("framework", "torch" if module is not None else "numpy")
    if framework not in FRAMEWORKS or (module is not None and framework != "torch"):
        raise _fail(source, f"stage {name!r}: 'framework' must be one of {list(FRAMEWORKS)} (a 'module' is "
                            f"torch), got {framework!r}")
    scheduler = table.get("scheduler")
    if scheduler is not None:
        if not isinstance(scheduler, dict) or not isinstance(scheduler.get("type"), str):
            raise _fail(source, f"stage {name!r}: 'scheduler' must be a table naming a torch.optim.lr_scheduler "
                                f"class, such as {{ type = \"StepLR\", step_size = 10, gamma = 0.5 }}, "
                                f"got {scheduler!r}")
        if framework != "torch":
            raise _fail(source, f"stage {name!r}: 'scheduler' is a torch.optim.lr_scheduler class, for a torch "
                                f"stage; a numpy stage's learning rate follows its optimizer's 'schedule' table "
                                f"(see Learning-rate schedules)")
        if "schedule" in table.get("optimizer", {}):
            raise _fail(source, f"stage {name!r}: give the optimizer's 'schedule' (distgrad's float32 schedules) "
                                f"or 'scheduler' (torch's), not both")
    device = table.get("device", "cpu")
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or (
            device.startswith("cuda:") and device[5:].isdigit())):
        raise _fail(source, f"stage {name!r}: 'device' must be \"cpu\", \"cuda\" or \"cuda:N\", got {device!r}")
    if device != "cpu" and framework != "torch":
        raise _fail(source, f"stage {name!r}: 'device' {device!r} needs framework = \"torch\"")
    output = table.get("output")
    if output is not None and (module is None or not _shape_list(output)):
        raise _fail(source, f"stage {name!r}: 'output' is the per-row output shape of a 'module' stage, a list "
                            f"of positive whole numbers, got {output!r}")
    seed = table.get("seed")
    if seed is not None and (not _whole(seed) or seed < 0):
        raise _fail(source, f"stage {name!r}: 'seed' must be a non-negative integer, got {seed!r}")
    columns = table.get("columns")
    if columns is not None and (not isinstance(columns, list) or not columns
                                or not all(_whole(c) and c >= 0 for c in columns)
                                or len(set(columns)) != len(columns)):
        raise _fail(source, f"stage {name!r}: 'columns' must list distinct feature column indices (0, 1, ...), "
                            f"got {columns!r}")
    return StageSpec(name, list(table["model"]) if has_model else None, dict(table.get("optimizer", {})),
                     table.get("loss"), framework, module, dict(table.get("module_args", {})), device,
                     tuple(output) if output is not None else None, None, seed, _base_dir(source), source,
                     list(columns) if columns is not None else None,
                     dict(scheduler) if scheduler is not None else None)


def _shape_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(_whole(v) and v > 0 for v in value)


def _scalars(source: str, raw: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The settings shared by both forms, validated: steps/epochs, seed, labels, reduction, micro_batches,
    eval_every, allow_nonfinite, codecs."""
    out: dict[str, Any] = {}
    if "steps" in raw and "epochs" in raw:
        raise _fail(source, f"{where}give 'steps' or 'epochs', not both")
    for key, low in (("steps", 1), ("epochs", 1), ("seed", 0), ("micro_batches", 1), ("eval_every", 0),
                     ("staleness", 0)):
        if key in raw and (not _whole(raw[key]) or raw[key] < low):
            kind = "a positive integer" if low else "a non-negative integer"
            raise _fail(source, f"{where}'{key}' must be {kind}, got {raw[key]!r}")
    out.update(steps=raw.get("steps"), epochs=raw.get("epochs"), seed=raw.get("seed", 0),
               micro_batches=raw.get("micro_batches", 1), eval_every=raw.get("eval_every", 0),
               staleness=raw.get("staleness", 0))
    out["allow_nonfinite"] = raw.get("allow_nonfinite", False)
    if not isinstance(out["allow_nonfinite"], bool):
        raise _fail(source, f"{where}'allow_nonfinite' must be true or false, got {out['allow_nonfinite']!r}")
    out["labels"] = raw.get("labels", "last")
    if out["labels"] not in ("last", "first"):
        raise _fail(source, f"{where}'labels' must be 'last' or 'first', got {out['labels']!r}")
    if "reduction" in raw and raw["reduction"] not in REDUCTIONS:
        raise _fail(source, f"{where}'reduction' must be one of {list(REDUCTIONS)}, got {raw['reduction']!r}")
    out["reduction"] = raw.get("reduction")
    try:
        for key in ("activation_codec", "gradient_codec"):
            out[key] = _codec_name(raw.get(key, "none"), f"{where}'{key}'")
    except ConfigError as e:
        raise _fail(source, str(e)) from e
    return out


def _description(source: str, raw: Mapping[str, Any]) -> str:
    """The file's top-level ``description`` ("" when absent); ``ConfigError`` unless it is a string."""
    text = raw.get("description", "")
    if not isinstance(text, str):
        raise _fail(source, f"'description' must be a string, got {text!r}")
    return text


def _codec_name(text: Any, where: str) -> str:
    """The canonical name of the codec ``text`` names (``parse_codec``); ``ConfigError`` naming ``where``."""
    try:
        return parse_codec(text).name
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def check_codecs(exp: "Experiment") -> None:
    """Raise ``ConfigError`` unless each direction's codec can carry the tensors of every cut (``int8`` and
    ``topk:K`` need an axis; ``K`` at most the entries of a row)."""
    for direction, codec in exp.codecs.items():
        key = "activation_codec" if direction == "activation" else "gradient_codec"
        for i, cut in enumerate(exp.cuts):
            try:
                codec.check_shape(tuple(cut))
            except ConfigError as e:
                raise ConfigError(f"{key} {codec.name!r} cannot carry activation {i + 1} of shape {tuple(cut)}: "
                                  f"{e}") from e


def _parse_aggregate(source: str, raw: Mapping[str, Any], where: str, names: Sequence[str], labels: str,
                     clients: Clients) -> str | None:
    """``aggregate``: absent (a chain), or how the last stage combines its feature parties' embeddings."""
    kind = raw.get("aggregate")
    if kind is None:
        return None
    if kind not in AGGREGATES:
        raise _fail(source, f"{where}'aggregate' must be one of {list(AGGREGATES)}, got {kind!r}")
    if len(names) < 2:
        raise _fail(source, f"{where}'aggregate' needs feature parties and a last stage: at least two stages")
    if labels != "last":
        raise _fail(source, f"{where}a vertical experiment ('aggregate') keeps the labels at its last stage: "
                            f"labels = \"first\" is not supported")
    if clients.count > 1:
        raise _fail(source, f"{where}'aggregate' (feature parties) and [clients] (data owners of other rows) "
                            f"cannot be combined")
    return kind


def stage_loss(spec: StageSpec) -> Loss:
    """The last stage's loss as distgrad knows it: a distgrad loss, or for a module stage also a torch.nn loss
    class (``losses.TorchLoss``: its targets, reduction and accuracy; torch computes it)."""
    try:
        return build_module_loss(spec.loss) if spec.module is not None else build_loss(spec.loss)
    except ConfigError as e:
        raise ConfigError(f"stage {spec.name!r}: {e}") from e


def _loss_reduction(spec: StageSpec) -> str:
    """How the last stage's loss reduces rows: a distgrad loss's own, or a torch loss's ``reduction``."""
    return stage_loss(spec).reduction


def parse_experiment(raw: Mapping[str, Any], source: str = "<dict>") -> Experiment:
    """Validate a parsed experiment or stage-file table and return an ``Experiment``.

    Everything that can be built is built once here, so a bad file fails
    now, naming itself and the problem (``ConfigError``), not mid-run.
    """
    raw = dict(raw)
    if "interface" in raw or "stage" in raw:
        return _parse_stage_file(raw, source)
    unknown = set(raw) - set(schema.TOP_KEYS)
    if unknown:
        raise _fail(source, f"unknown top-level keys {sorted(unknown)}; allowed: {sorted(schema.TOP_KEYS)} "
                            f"(a stage file has [interface], [stage] and [data] instead)")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(source, "'name' must be a non-empty string")
    settings = _scalars(source, raw, "")
    data = raw.get("data")
    if not isinstance(data, dict):
        raise _fail(source, "needs a [data] table")
    stage_tables = raw.get("stages")
    if not isinstance(stage_tables, list) or not stage_tables:
        raise _fail(source, "needs at least one [[stages]] table")
    stages = [_parse_stage(source, table, i, i == len(stage_tables) - 1, party=False)
              for i, table in enumerate(stage_tables)]
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise _fail(source, f"stage names must be unique, got {names}")
    clients = _parse_clients(source, raw.get("clients", {}), len(stages))
    if settings["epochs"] is not None and clients.count > 1:
        raise _fail(source, "'epochs' counts passes over one data owner's rows; with several data owners "
                            "([clients]) give 'steps'")
    aggregate = _parse_aggregate(source, raw, "", names, settings["labels"], clients)
    try:
        reduction = _loss_reduction(stages[-1])
        if settings["reduction"] not in (None, reduction):
            raise ConfigError(f"'reduction' is {settings['reduction']!r} but the loss reduces rows by {reduction}")
        seed = settings["seed"]
        source_data = build_data(data, seed, _base_dir(source))
        batch = getattr(source_data, "batch", None)
        cuts, shape = [], tuple(source_data.feature_shape)
        for spec in stages[:-1]:
            if aggregate is not None:        # each feature party starts from its own columns
                shape = tuple(source_data.feature_shape)
            if spec.columns is not None:
                shape = tuple(ColumnView(source_data, spec.columns).feature_shape)
            if spec.model is not None:
                shape = build_model(spec.model, seed).output_shape(shape)
            elif spec.output is not None:
                shape = (batch, *spec.output) if batch is not None else spec.output
            else:
                raise ConfigError(f"stage {spec.name!r} is a torch module before the last stage: give its "
                                  f"per-row output shape, e.g. output = [64]")
            cuts.append(tuple(shape))
        steps = _steps(settings, source_data)
    except ConfigError as e:
        raise _fail(source, str(e)) from e
    target = ((tuple(source_data.target_shape), np.dtype(source_data.target_dtype).name)
              if settings["labels"] == "first" and len(stages) > 1 else None)
    exp = Experiment(name, steps, settings["seed"], settings["labels"], settings["allow_nonfinite"], data, stages,
                     raw, _digest(raw, 64), source, clients, list(names), tuple(cuts), batch, reduction,
                     settings["micro_batches"], settings["eval_every"], settings["epochs"],
                     _description(source, raw), target, aggregate=aggregate,
                     activation_codec=settings["activation_codec"], gradient_codec=settings["gradient_codec"],
                     staleness=settings["staleness"])
    _check_built(exp, source)
    return exp


def _steps(settings: Mapping[str, Any], data: DataSource | None) -> int:
    """``steps``, or ``epochs`` times the batches in one epoch of the data's training rows."""
    if settings["epochs"] is None:
        return 100 if settings["steps"] is None else settings["steps"]
    per_epoch = getattr(data, "batches_per_epoch", None)
    if per_epoch is None:
        raise ConfigError(f"'epochs' needs data with rows to walk (npz, npy, csv or synthetic); "
                          f"give 'steps'")
    return settings["epochs"] * per_epoch


def _parse_stage_file(raw: dict[str, Any], source: str) -> Experiment:
    """One party's stage file: ``[interface]``, ``[stage]``, its own ``[data]``."""
    unknown = set(raw) - set(schema.STAGE_FILE_KEYS)
    if unknown:
        raise _fail(source, f"unknown top-level keys {sorted(unknown)}; a stage file has "
                            f"{sorted(schema.STAGE_FILE_KEYS)}")
    iface = raw.get("interface")
    if not isinstance(iface, dict):
        raise _fail(source, "a stage file needs an [interface] table (what the parties agree on)")
    unknown = set(iface) - set(schema.INTERFACE_KEYS)
    if unknown:
        raise _fail(source, f"[interface] has unknown keys {sorted(unknown)}; allowed: "
                            f"{sorted(schema.INTERFACE_KEYS)}")
    name = iface.get("name")
    if not isinstance(name, str) or not name:
        raise _fail(source, "[interface] 'name' must be a non-empty string")
    names = iface.get("stages")
    if (not isinstance(names, list) or len(names) < 2 or not all(isinstance(n, str) and n for n in names)
            or len(set(names)) != len(names)):
        raise _fail(source, f"[interface] 'stages' must list the stages' unique names in order, at least two, "
                            f"got {names!r}")
    settings = _scalars(source, iface, "[interface] ")
    batch = iface.get("batch")
    if batch is not None and (not _whole(batch) or batch < 1):
        raise _fail(source, f"[interface] 'batch' must be an integer >= 1, got {batch!r}")
    cuts = _parse_cuts(source, iface.get("activation"), len(names), batch)
    target = _parse_target(source, iface.get("target"), settings["labels"], batch)
    clients = _parse_clients(source, iface.get("clients", {}), len(names))
    if settings["epochs"] is not None and clients.count > 1:
        raise _fail(source, "'epochs' counts passes over one data owner's rows; with several data owners "
                            "([clients]) give 'steps'")
    aggregate = _parse_aggregate(source, iface, "[interface] ", names, settings["labels"], clients)
    table = raw.get("stage")
    last = isinstance(table, dict) and table.get("name") == names[-1]
    spec = _parse_stage(source, table, 0, last, party=True) if "stage" in raw else None
    if spec is None:
        raise _fail(source, "a stage file needs a [stage] table (this party's model)")
    if spec.name not in names:
        raise _fail(source, f"[stage] is {spec.name!r}, which is not one of the interface's stages {names}")
    last = spec.name == names[-1]
    if last != (spec.loss is not None):
        raise _fail(source, f"stage {spec.name!r}: exactly the last stage ({names[-1]!r}) has a 'loss'")
    data = raw.get("data")
    if data is not None and not isinstance(data, dict):
        raise _fail(source, "[data] must be a table")
    if data and data.get("kind") in FILE_KINDS:
        data = {"features": None, "labels": None, **data}     # a party holds only the parts it names
    spec = StageSpec(**{**spec.__dict__, "data": data or {}})
    try:
        if last:
            reduction = _loss_reduction(spec)
            if settings["reduction"] not in (None, reduction):
                raise ConfigError(f"[interface] 'reduction' is {settings['reduction']!r} but this stage's loss "
                                  f"reduces rows by {reduction}")
        else:
            reduction = settings["reduction"] or "mean"
        source_data = build_data(data, settings["seed"], _base_dir(source)) if data else None
        if source_data is not None and getattr(source_data, "batch", None) != batch:
            raise ConfigError(f"[data] gives batches of {getattr(source_data, 'batch', None)} rows, the "
                              f"interface 'batch' is {batch}")
        if source_data is None and settings["epochs"] is not None:
            raise ConfigError("[interface] 'epochs' needs this party's [data] to count the batches of an "
                              "epoch; give 'steps'")
        steps = _steps(settings, source_data)
    except ConfigError as e:
        raise _fail(source, str(e)) from e
    exp = Experiment(name, steps, settings["seed"], settings["labels"], settings["allow_nonfinite"], {}, [spec],
                     raw, _digest(raw, 64), source, clients, list(names), cuts, batch, reduction,
                     settings["micro_batches"], settings["eval_every"], settings["epochs"],
                     _description(source, raw), target, aggregate=aggregate,
                     activation_codec=settings["activation_codec"], gradient_codec=settings["gradient_codec"],
                     staleness=settings["staleness"])
    _check_built(exp, source)
    return exp


def _parse_cuts(source: str, value: Any, stage_count: int, batch: int | None) -> tuple[Shape, ...]:
    """``activation``: one table (two stages) or a list of one per cut, each ``{ shape = [...], dtype =
    "float32" }`` with the per-row shape; the whole batch's is ``(batch, *shape)`` (``shape`` alone when
    the interface has no batch)."""
    tables = value if isinstance(value, list) else [value]
    if len(tables) != stage_count - 1 or not all(isinstance(t, dict) for t in tables):
        raise _fail(source, f"[interface] 'activation' must be {stage_count - 1} table(s) "
                            f"{{ shape = [...], dtype = \"float32\" }}, one per cut between the stages, got "
                            f"{value!r}")
    cuts = []
    for table in tables:
        unknown = set(table) - {"shape", "dtype"}
        if unknown or not _shape_list(table.get("shape")):
            raise _fail(source, f"[interface] activation {table!r}: needs 'shape', a list of positive whole "
                                f"numbers (per row), and optionally 'dtype'")
        if table.get("dtype", "float32") not in WIRE_DTYPES:
            raise _fail(source, f"[interface] activation dtype must be one of {list(WIRE_DTYPES)}, got "
                                f"{table['dtype']!r}")
        cuts.append(tuple(table["shape"]) if batch is None else (batch, *table["shape"]))
    return tuple(cuts)


TARGET_DTYPES = ("int64", "float32")


def _parse_target(source: str, value: Any, labels: str, batch: int | None) -> tuple[Shape, str] | None:
    """``target``: with ``labels = "first"``, the per-row shape and dtype of the targets that travel with the
    activations, ``{ shape = [], dtype = "int64" }`` for class ids; absent otherwise."""
    if labels != "first":
        if value is not None:
            raise _fail(source, "[interface] 'target' is for labels = \"first\" (targets that travel)")
        return None
    if not isinstance(value, dict) or set(value) - {"shape", "dtype"} or value.get("dtype") not in TARGET_DTYPES \
            or not (value.get("shape") == [] or _shape_list(value.get("shape"))):
        raise _fail(source, f"[interface] labels = \"first\" needs 'target' = {{ shape = [per-row shape], dtype = "
                            f"\"int64\" or \"float32\" }} (class ids: shape = []), got {value!r}")
    shape = tuple(value["shape"])
    return ((batch, *shape) if batch is not None else shape), value["dtype"]


def _check_built(exp: Experiment, source: str) -> None:
    """Build what this experiment's files define once, so a bad one fails here: every data source (and
    shard), the numpy models against their input shapes and cuts, the optimisers, and the targets
    against the last stage's prediction."""
    try:
        exp.interface_parts()
        check_staleness(exp, exp.staleness)
        check_codecs(exp)
        if exp.vertical:
            exp.input_shape(exp.stage_names[-1])         # the parties' embeddings combine
        for spec in exp.stages:
            first, last = spec.name in exp.data_owners, spec.name == exp.stage_names[-1]
            if spec.columns is not None and not first:
                raise ConfigError(f"stage {spec.name!r}: 'columns' selects a data owner's feature columns; "
                                  f"this stage receives activations")
            holds_data = bool(exp.data if spec.data is None else spec.data)
            if not holds_data and (first or spec.name == exp.label_owner):
                raise ConfigError(f"stage {spec.name!r} needs a [data] table with its "
                                  f"{'features' if first else 'labels'}")
            if holds_data:
                data = exp.build_data(stage=spec.name)
                for client in range(exp.clients.count if exp.federated and first else 0):
                    exp.build_data(client=client, stage=spec.name)
                if first and data.feature_shape is None:
                    raise ConfigError(f"the data owner {spec.name!r} needs features in its [data]")
                if spec.name == exp.label_owner and not data.has_labels:
                    raise ConfigError(f"stage {spec.name!r} holds the labels: its [data] needs labels")
                if exp.target is not None and first and (tuple(data.target_shape), np.dtype(data.target_dtype).name
                                                         ) != exp.target:
                    raise ConfigError(f"the interface's targets are {exp.target}, but the data gives "
                                      f"{(tuple(data.target_shape), np.dtype(data.target_dtype).name)}")
            if spec.model is None:
                continue
            model = build_model(spec.model, spec.init_seed(exp.seed))
            shape = model.output_shape(exp.input_shape(spec.name))
            if not last and tuple(shape) != exp.output_shape(spec.name):
                raise ConfigError(f"stage {spec.name!r} outputs shape {tuple(shape)}, but the interface says "
                                  f"the activation it sends is {exp.output_shape(spec.name)}")
            build_optimizer(spec.optimizer)
            if last and exp.has_stage(exp.label_owner):
                check_targets(exp, exp.build_data(stage=exp.label_owner), shape)
        numpy_stages = [s for s in exp.stages if s.model is not None]
        Sequential([layer for s in numpy_stages for layer in build_model(s.model, s.init_seed(exp.seed)).layers])
    except ConfigError as e:
        raise _fail(source, str(e)) from e


def combine_stage_files(parts: Sequence[Experiment]) -> Experiment:
    """Several parties' stage files as one experiment (for ``distgrad run A.toml B.toml`` and the in-process
    reference): their interfaces must agree, each stage defined once. Raises ``ConfigError`` naming the
    first interface field that differs."""
    first = parts[0]
    seen: dict[str, str] = {}
    for exp in parts:
        if exp.data or exp.raw.get("stages") is not None:
            raise ConfigError(f"{exp.source} is a combined experiment; give it alone, or only stage files")
        ours, theirs = first.interface_parts(), exp.interface_parts()
        for key in interface_differences(ours, theirs):
                raise ConfigError(f"the stage files disagree on the interface: {key}: {first.source} has "
                                  f"{ours.get(key)!r}, {exp.source} has {theirs.get(key)!r}")
        for spec in exp.stages:
            if spec.name in seen:
                raise ConfigError(f"stage {spec.name!r} is defined by both {seen[spec.name]} and {exp.source}")
            seen[spec.name] = exp.source
    missing = [n for n in first.stage_names if n not in seen]
    if missing:
        raise ConfigError(f"no stage file defines {missing}; the interface's stages are {list(first.stage_names)}")
    order = {name: i for i, name in enumerate(first.stage_names)}
    stages = sorted((s for exp in parts for s in exp.stages), key=lambda s: order[s.name])
    raw = {"stage files": [exp.raw for exp in parts]}
    return Experiment(first.name, first.steps, first.seed, first.labels, first.allow_nonfinite, {}, stages, raw,
                      _digest(raw, 64), ",".join(exp.source for exp in parts), first.clients, list(first.stage_names),
                      first.cuts, first.batch, first.reduction, first.micro_batches, first.eval_every,
                      first.epochs, first.description, first.target, aggregate=first.aggregate,
                      activation_codec=first.activation_codec, gradient_codec=first.gradient_codec,
                      staleness=first.staleness)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_targets(exp: Experiment, data: DataSource, output_shape: Shape) -> None:
    """Raise ``ConfigError`` unless the data's targets fit the loss of the last stage's output.

    A prediction of 2 columns against 1 target column would broadcast in the
    loss and train silently; the shapes and dtypes must match exactly.
    """
    loss = exp.final_loss
    expected = tuple(loss.target_shape(tuple(output_shape)))
    last = exp.stage_names[-1]
    spec = exp.spec(last)
    loss_name = spec.loss if isinstance(spec.loss, str) else spec.loss.get("type")
    if np.dtype(data.target_dtype) != loss.target_dtype:
        raise ConfigError(f"{loss_name} needs {loss.target_dtype} targets, but the data gives "
                          f"{np.dtype(data.target_dtype)} targets (set label_dtype in [data])")
    if tuple(data.target_shape) != expected:
        raise ConfigError(f"the last stage {last!r} outputs shape {tuple(output_shape)}, so {loss_name} needs "
                          f"targets of shape {expected}, but the data gives targets of shape "
                          f"{tuple(data.target_shape)}")


def check_run_settings(exp: Experiment, *, steps: Any = None, seed: Any = None, micro_batches: Any = 1,
                       init: Mapping[str, float] | None = None, checkpoint_dir: Any = None,
                       checkpoint_every: Any = None, resume: bool = False, in_process: bool = False,
                       eval_every: Any = None, staleness: Any = None) -> None:
    """The settings of one run, checked once before any process or step starts (every path calls it:
    ``distgrad run``, ``--in-process``, ``distgrad-stage``, the Python API).

    ``None`` means the experiment's value or the default. Raises ``ConfigError``
    naming the bad value: ``steps`` below 1, a negative ``seed``,
    ``micro_batches`` that do not divide the batch, unknown ``init`` names,
    ``checkpoint_every`` or ``resume`` without ``checkpoint_dir``, and with
    ``in_process`` (which keeps no checkpoints) any checkpoint setting; a
    negative ``eval_every``; a ``staleness`` (None: the experiment's) that is
    negative, or above 0 where it is not supported (several clients, vertical
    parties, a first stage computing off the CPU).
    """
    if steps is not None and (not _whole(steps) or steps < 1):
        raise ConfigError(f"--steps must be an integer >= 1, got {steps!r}")
    if seed is not None and (not _whole(seed) or seed < 0):
        raise ConfigError(f"--seed must be an integer >= 0, got {seed!r}")
    if not _whole(micro_batches) or micro_batches < 1:
        raise ConfigError(f"--micro-batches must be an integer >= 1, got {micro_batches!r}")
    if micro_batches > 1 and (exp.batch is None or exp.batch % micro_batches):
        raise ConfigError(f"experiment {exp.name!r} has batches of {exp.batch or 'no'} rows: "
                          f"they do not split into {micro_batches} equal micro-batches")
    check_init_overrides(exp, init or {})
    check_staleness(exp, exp.staleness if staleness is None else staleness)
    if eval_every is not None and (not _whole(eval_every) or eval_every < 0):
        raise ConfigError(f"--eval-every must be an integer >= 0 (0: only after the last step), got {eval_every!r}")
    if checkpoint_every is not None and (not _whole(checkpoint_every) or checkpoint_every < 0):
        raise ConfigError(f"--checkpoint-every must be an integer >= 0, got {checkpoint_every!r}")
    if checkpoint_every and checkpoint_dir is None:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir (where to save the checkpoints)")
    if resume and checkpoint_dir is None:
        raise ConfigError("--resume needs --checkpoint-dir")
    if in_process and (checkpoint_dir is not None or checkpoint_every or resume):
        raise ConfigError("--in-process keeps no checkpoints: drop --checkpoint-dir, --checkpoint-every "
                          "and --resume (or run the stages as processes)")


MAX_STALENESS = 64     # steps in flight: each holds a copy of the first stage's parameters


def check_staleness(exp: Experiment, staleness: Any) -> None:
    """Raise ``ConfigError`` unless ``staleness`` S (steps in flight) is a whole number from 0 to
    ``MAX_STALENESS`` that this experiment supports: two stages or a chain, with a first stage whose
    parameters of an earlier step can be swapped back in for a backward (host memory)."""
    if not _whole(staleness) or not 0 <= staleness <= MAX_STALENESS:
        raise ConfigError(f"--staleness must be an integer from 0 to {MAX_STALENESS}, got {staleness!r}")
    if not staleness:
        return
    if exp.federated or exp.vertical:
        raise ConfigError(f"staleness {staleness}: asynchronous pipelining is for two stages and chains; "
                          f"experiment {exp.name!r} has {'[clients]' if exp.federated else 'feature parties'} "
                          f"(use staleness = 0)")
    if any(codec.endswith("+ef") for codec in (exp.activation_codec, exp.gradient_codec)):
        raise ConfigError(f"staleness {staleness}: a codec with error feedback (+ef) keeps what it dropped for the "
                          f"next step, which steps in flight would send before it is known; use staleness = 0 "
                          f"or a codec without +ef")
    first = exp.stage_names[0]
    if exp.has_stage(first) and exp.spec(first).device != "cpu":
        raise ConfigError(f"staleness {staleness}: the first stage {first!r} computes on {exp.spec(first).device}; "
                          f"asynchronous pipelining keeps its earlier parameters in host memory (device = \"cpu\")")


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


def load_experiment(name_or_path: str | Path | Sequence[str | Path]) -> Experiment:
    """Load a built-in experiment by name, an experiment or stage file by path, or (a list) several
    parties' stage files as one experiment (``combine_stage_files``).

    Raises ``ConfigError`` naming the file and the problem.
    """
    if not isinstance(name_or_path, (str, Path)):
        paths = list(name_or_path)
        if len(paths) == 1:
            return load_experiment(paths[0])
        return combine_stage_files([load_experiment(path) for path in paths])
    path = Path(name_or_path)
    if not path.is_file():
        builtin = BUILTIN_DIR / f"{name_or_path}.toml"
        if not builtin.is_file():
            raise ConfigError(f"no experiment file {str(name_or_path)!r} and no built-in of that name; "
                              f"built-ins: {', '.join(builtin_names())}")
        path = builtin
    return parse_experiment(read_toml(path, "experiment"), str(path))


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
    known = exp.known_param_names(set(overrides))
    unknown = set(overrides) - known
    if unknown:
        raise ConfigError(f"--init names unknown parameters {sorted(unknown)}; "
                          f"experiment {exp.name!r} has {sorted(known)}")


def build_stage_parts(exp: Experiment, stage_name: str, seed: int,
                      overrides: Mapping[str, float]) -> tuple[Sequential, Optimizer, Loss | None]:
    """Model, optimizer and (last stage only) loss of a numpy-layer stage, with ``--init`` applied.

    An override fills every element of the named parameter. The stage's own
    ``seed``, when its file gives one, replaces ``seed`` for the initial values.
    """
    check_init_overrides(exp, overrides)
    spec = exp.spec(stage_name)
    if spec.model is None:
        raise ConfigError(f"stage {stage_name!r} is a torch module ({spec.module}), not a list of layers")
    model = build_model(spec.model, spec.init_seed(seed))
    for name, value in overrides.items():
        if name in model.params:
            model.params[name][...] = value
    loss = build_loss(spec.loss) if stage_name == exp.stage_names[-1] else None
    return model, build_optimizer(spec.optimizer), loss


PART_VALUE_MAX = 64       # a part's string value is at most this long
PART_DIGEST_HEX = 16      # hex digits of SHA-256 kept in a digest part: enough to tell two files apart
MAX_PARTS = 128           # parts a hello may name (msgpack maps are limited to 256 entries)
ORIGIN_MAX = 200          # characters of a hello's origin of interface fields (a flag, a file)
