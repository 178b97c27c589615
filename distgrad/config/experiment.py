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
``distgrad.config.schema``, from which docs/stage-files.md is generated.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import AbstractSet, Any, Mapping, Sequence

import numpy as np

from distgrad.model.aggregate import OwnBottom, combined_shape
from distgrad.wire.codecs import Codec, parse_codec
from distgrad.wire.masking import SecureSumCodec
from distgrad.config.data import ColumnView, DataSource, RandomizedLabels, ReleasedLabels, build_data
from distgrad.config.prepare import Preparation, prepares
from distgrad.jsontext import json_text
from distgrad.errors import ConfigError
from distgrad.config.keys import GUARD_AFTER_STEPS, is_whole, whole
from distgrad.config.horizons import check_checkpoint_horizon, check_rate_horizon
from distgrad.model.losses import Loss, SoftmaxCrossEntropy, TorchLoss, build_loss, build_module_loss
from distgrad.model.metrics import check_metrics
from distgrad.model.nn import DTYPE, Sequential, Shape, build_model
from distgrad.model.optim import Optimizer, build_optimizer
from distgrad.model.schedules import PLATEAU, PLATEAU_OPTIONS, Plateau
from distgrad.privacy.defenses import Defenses
from distgrad.privacy.guard import rows_needed
from distgrad.privacy.labeldp import LabelRelease, TrainingLabels
from distgrad.privacy.releases import RunSecret

log = logging.getLogger("distgrad.config")

BUILTIN_DIR = Path(__file__).parent.parent / "experiments"
CLIENT_MODES = ("separate", "splitfed")
# A module stage's parameter names are its module's: ``function(exp, name, seed)`` builds it to tell them.
# Looked up by name only when asked (``Experiment.all_param_names``): this module imports no torch.
MODULE_PARAM_NAMES = "distgrad.stage.torch_stage:module_param_names"
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
    ``scheduler`` a torch stage's ``torch.optim.lr_scheduler`` table (None: none);
    ``defenses`` what it does to what it sends and to its labels (``distgrad.config.defended``);
    ``metrics``, ``keep_best`` and ``early_stopping`` the last stage's held-out scores
    and its verdicts on them (``check_evaluation_keys``). ``bottom`` (the last
    stage of a vertical experiment, numpy layers) is the label owner's own
    bottom model over its own feature ``columns``; its output joins the
    parties' embeddings as one more party, the last (``aggregate.OwnBottom``).
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
    defenses: Defenses = Defenses()
    metrics: tuple[str, ...] = ()
    keep_best: str | None = None
    early_stopping: dict[str, Any] | None = None
    privacy_meter: bool = False      # meter what this stage sends across the cut (``distgrad.privacy.meter``)
    input_guard: tuple[float, int] | None = None   # a data owner's (max_r2, after): stop before invertible rows leave
    bottom: list[dict[str, Any]] | None = None   # a vertical label owner's own bottom model (``Experiment.model``)

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
    activation_codec: str = "none"             # how activations cross the wire (``distgrad.wire.codecs``, canonical)
    gradient_codec: str = "none"               # how activation gradients cross it
    send_rows: bool = False                    # every training forward carries its rows' numbers (``rows``)
    secure_aggregation: bool = False           # vertical sum/mean: the label owner sees only the parties' sum
    flag_origins: tuple[tuple[str, str], ...] = ()   # interface fields a command-line flag set, and the flag
    # Values derived from the fields above, computed once (see ``final_loss``, ``interface_parts``).
    _derived: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    # Each stage's noise secret of its current run in this process (``run_secret``), shared by its copies.
    _secrets: dict[str, RunSecret] = field(default_factory=dict, repr=False, compare=False)

    @property
    def vertical(self) -> bool:
        """True when every stage but the last is a feature party feeding the last (``aggregate``)."""
        return self.aggregate is not None

    @property
    def aggregate_kind(self) -> str:
        """How a vertical experiment combines its parties' outputs (``aggregate``); ``ConfigError`` for another."""
        if self.aggregate is None:
            raise ConfigError(f"experiment {self.name!r} is not vertical: it has no 'aggregate'")
        return self.aggregate

    @property
    def codecs(self) -> dict[str, Codec]:
        """The wire codec of each direction: ``{"activation": ..., "activation_grad": ...}``
        (``distgrad.wire.wirecodec``)."""
        if self.secure_aggregation:      # the parties' fixed-point parts, unmasked (``distgrad.wire.masking``)
            activation: Codec = SecureSumCodec(len(self.data_owners))
        else:
            activation = parse_codec(self.activation_codec)
        return {"activation": activation, "activation_grad": parse_codec(self.gradient_codec)}

    def with_codecs(self, activation: str | None = None, gradient: str | None = None) -> "Experiment":
        """This experiment with the codecs ``--activation-codec`` / ``--gradient-codec`` give (None: the
        file's). The codecs are part of the interface, so a stage given other codecs than its peer is
        refused at the handshake, naming the field; checkpoints of other codecs are not resumed (the
        fingerprint changes). Raises ``ConfigError`` for a bad name or a cut the codec cannot carry."""
        names = [self.activation_codec if activation is None else codec_name(activation, "--activation-codec"),
                 self.gradient_codec if gradient is None else codec_name(gradient, "--gradient-codec")]
        if names == [self.activation_codec, self.gradient_codec]:
            return self
        flags = [(field, flag) for field, flag, given in (("activation_codec", "--activation-codec", activation),
                                                          ("gradient_codec", "--gradient-codec", gradient))
                 if given is not None]
        exp = dataclasses.replace(self, activation_codec=names[0], gradient_codec=names[1],
                                  fingerprint=value_digest({"file": self.fingerprint, "codecs": names}, 64),
                                  _derived={},
                                  flag_origins=(*self.flag_origins, *flags))
        check_codecs(exp)
        check_secure_aggregation(exp)
        return exp

    @property
    def data_owners(self) -> list[str]:
        """The stages that hold features and drive: the feature parties (vertical), else the first stage."""
        return list(self.stage_names[:-1]) if self.vertical else [self.stage_names[0]]

    def downstream(self, name: str) -> str:
        """The stage ``name`` sends its activations to (the last one for a feature party)."""
        index = self.stage_index(name)
        return self.stage_names[-1] if self.vertical else self.stage_names[index + 1]

    def relays_below(self, name: str) -> int:
        """How many stages beneath ``name``'s stage below pass its requests on (the middle stages of a chain
        under it; none in a vertical run): each tells the stage above why it stopped only once its own wait
        below gives up."""
        if self.vertical:
            return 0
        return max(0, len(self.stage_names) - self.stage_index(name) - 2)

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

    def run_secret(self, name: str) -> RunSecret:
        """Stage ``name``'s noise secret of its current run in this process: what its randomized labels
        (``label_dp``) and its noise ledger draw from. One per stage, created fresh (``fresh_secret``); the
        stage's runner sets it when a run begins or resumes from a checkpoint, and everything built from this
        experiment (its data, its stage) reads it when it draws."""
        if name not in self._secrets:
            self._secrets[name] = RunSecret()
        return self._secrets[name]

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
        self._check_preparation(spec, table)
        data = build_data(table, self.seed if seed is None else seed, spec.base_dir)
        if client is not None and self.federated:
            data.shard(client, self.clients.count)
        label_dp = spec.defenses.label_dp
        if label_dp is not None and data.has_labels and hasattr(data, "all_targets"):
            if label_dp.staged:         # released during training by the stage (``training_labels``)
                data = ReleasedLabels(data)
            else:
                data = RandomizedLabels(data, label_dp.epsilon,  # type: ignore[arg-type]
                                        self.run_secret(spec.name), spec.name)
        return data if spec.columns is None else ColumnView(data, spec.columns)

    def _check_preparation(self, spec: StageSpec, table: Mapping[str, Any]) -> None:
        """``ConfigError`` for data preparation a stage's [data] asks for where it cannot keep the parties'
        rows alike: ``drop_rows`` on a party's own table when another party holds a part of the same rows
        (it cannot know which rows the others drop), ``categorical`` with a vertical party's ``columns``
        (they index the file's columns, which one-hot encoding widens)."""
        if table.get("missing") == "drop_rows" and spec.data is not None and not (
                self.labels == "first" and table.get("features") is not None and table.get("labels") is not None):
            raise ConfigError(f"stage {spec.name!r}: missing = \"drop_rows\" leaves out the rows with a missing "
                              f"cell, which keeps the parties' rows aligned only where one [data] table holds "
                              f"every part of them (a combined experiment's [data], or a data owner holding "
                              f"the labels too, with labels = \"first\"); here another party holds part of the "
                              f"same rows and cannot know which ones this party drops: use missing = \"mean\" or "
                              f"\"median\", or remove those rows from every party's file first")
        if table.get("validation_fraction") and self.labels_travel:
            raise ConfigError(f"stage {spec.name!r}: validation_fraction needs the labels at the last stage, which "
                              f"scores the evaluations and tells validation rows from test rows by its own [data]; "
                              f"with labels = \"first\" it holds none")
        if table.get("categorical") is not None and spec.columns is not None:
            raise ConfigError(f"stage {spec.name!r}: 'columns' picks columns of the shared [data] by position, and "
                              f"categorical columns are one-hot encoded into several: give each party its own "
                              f"stage file and [data] with its own columns (distgrad split, or distgrad align)")

    def preparation(self, seed: int | None = None, client: int | None = None, stage: str | None = None
                    ) -> Preparation | None:
        """Stage ``stage``'s data preparation statistics (``distgrad.config.prepare``), learnt from its own
        training rows; None when its [data] prepares nothing (or it has no data)."""
        spec = self.spec(stage) if stage is not None else self.stages[0]
        table = self.data if spec.data is None else spec.data
        if not prepares(table):
            return None
        prepare = getattr(self.build_data(seed, client, stage), "preparation", None)
        prep = prepare() if prepare is not None else None
        if prep is None:
            return None
        if not (spec.name in self.data_owners or (spec.name == self.stage_names[-1] and self.own_bottom)):
            prep.columns = []           # the features' statistics are the data owners' own
        if spec.name != self.label_owner:
            prep.classes = None         # the class names are the label owner's
        return prep if prep.columns or prep.classes is not None else None

    def training_labels(self, name: str, seed: int | None = None) -> TrainingLabels | None:
        """What label owner ``name``'s stage adds to its training loss under ``label_dp`` (None: nothing; its
        data's randomized labels with its own loss): the flip-rate-aware loss, and with ``stages`` the release
        of the labels during training (``privacy.labeldp``), drawn from the stage's run secret (``run_secret``). Raises
        ``ConfigError`` when the stage's loss cannot take it."""
        if not self.has_stage(name) or name != self.stage_names[-1] or self.labels_travel:
            return None
        spec = self.spec(name)
        setting = spec.defenses.label_dp
        if setting is None or spec.data == {}:
            return None
        loss_name = setting.loss_for(softmax_cross_entropy(self.final_loss))
        if loss_name == "plain" and not setting.staged:
            return None
        if not softmax_cross_entropy(self.final_loss):
            loss = self.final_loss
            given = f"{loss.type} {loss.options}" if isinstance(loss, TorchLoss) else type(loss).__name__
            what = "stages" if setting.staged else 'loss = "corrected"'
            raise ConfigError(f"stage {name!r}: 'label_dp' with {what} trains with its own softmax cross-entropy on "
                              f"the randomized labels: the stage's loss must be softmax_cross_entropy or "
                              f"CrossEntropyLoss (no option but reduction), not {given}")
        seed = self.seed if seed is None else seed
        data = build_data(self.data if spec.data is None else spec.data, seed, spec.base_dir)
        if not hasattr(data, "all_targets"):
            return None             # refused by check_defenses: no table of class labels
        labels = data.all_targets()
        classes = int(labels.max()) + 1 if len(labels) else 0
        if classes < 2:
            raise ConfigError(f"'label_dp' randomizes class ids among at least 2 classes; the labels hold {classes}")
        release = None
        if setting.staged:
            per_epoch = len(data.train_rows) // data.batch      # type: ignore[attr-defined]
            run_updates = self.steps * (self.clients.count if self.federated else 1)
            release = LabelRelease(setting, labels, data.train_rows, classes,  # type: ignore[attr-defined]
                                   setting.updates_per_stage(per_epoch, run_updates), self.run_secret(name), name)
        return TrainingLabels(setting, classes, loss_name, release)

    @property
    def own_bottom(self) -> bool:
        """True when the label owner of a vertical experiment holds features and its own ``bottom`` model."""
        return self.vertical and self.has_stage(self.stage_names[-1]) and \
            self.spec(self.stage_names[-1]).bottom is not None

    def model(self, name: str, seed: int) -> Sequential:
        """The numpy layers of stage ``name`` (``seed``: the run's); a label owner's ``bottom`` comes first,
        as ``aggregate.OwnBottom``."""
        spec = self.spec(name)
        if spec.model is None:
            raise ConfigError(f"stage {name!r} is a torch module ({spec.module}), not a list of layers")
        model = build_model(spec.model, spec.init_seed(seed))
        if spec.bottom is None:
            return model
        return Sequential([self.bottom_layer(name, seed), *model.layers])

    def bottom_layer(self, name: str, seed: int) -> OwnBottom:
        """The label owner's own ``bottom`` (numpy layers; ``seed``: the run's) as the first layer of its
        stage, ``aggregate.OwnBottom`` (a torch stage builds the same in torch)."""
        spec = self.spec(name)
        if spec.bottom is None:
            raise ConfigError(f"stage {name!r} has no 'bottom'")
        bottom = build_model(spec.bottom, spec.init_seed(seed))
        return OwnBottom(self.aggregate, [cut[-1] for cut in self.cuts], bottom)    # type: ignore[arg-type]

    def own_features_shape(self, seed: int | None = None) -> Shape:
        """The per-step shape of the label owner's own feature columns (``own_bottom``)."""
        key = ("own", self.seed if seed is None else seed)
        if key not in self._derived:
            shape = self.build_data(seed, stage=self.stage_names[-1]).feature_shape
            if shape is None:
                raise ConfigError(f"the label owner {self.stage_names[-1]!r} has a 'bottom': its [data] needs "
                                  f"its own features")
            self._derived[key] = tuple(shape)
        return self._derived[key]

    def input_shape(self, name: str, seed: int | None = None) -> Shape:
        """The per-step shape of what stage ``name`` receives: its data's features (a data owner), the
        parties' embeddings combined (the last stage of a vertical experiment; with its own ``bottom``, the
        embeddings and its own columns side by side), else the activation at the cut above it."""
        index = self.stage_index(name)
        if self.vertical and index == len(self.stage_names) - 1:
            if self.own_bottom:
                own = self.own_features_shape(seed)
                if len(own) != 2 or any(len(cut) != 2 or cut[0] != own[0] for cut in self.cuts):
                    raise ConfigError(f"the label owner's 'bottom' takes rows of feature columns and joins "
                                      f"embeddings of rows; got its features {own} and the parties' {self.cuts}")
                return (own[0], sum(cut[-1] for cut in self.cuts) + own[-1])
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
            self._derived[key] = self.model(name, self.seed if seed is None else seed
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
                names.update(self.model(spec.name, seed).params)
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
                     **({"send_rows": True} if self.send_rows else {}),
                     **({"secure_aggregation": True} if self.secure_aggregation else {}),

                     # Only when set, so that experiments without codecs keep their fingerprints.
                     **({"activation_codec": self.activation_codec} if self.activation_codec != "none" else {}),
                     **({"gradient_codec": self.gradient_codec} if self.gradient_codec != "none" else {})}
            parts.update(self._order_parts())
            parts = fitted_parts(parts)
            if len(parts) > MAX_PARTS:
                raise ConfigError(f"experiment {self.name!r} has too many interface fields for a hello ("
                                  f"{len(parts)}, at most {MAX_PARTS}): {len(self.cuts)} cuts between "
                                  f"{len(self.stage_names)} stages; use fewer stages or feature parties")
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
                if not self.send_rows:      # with send_rows the data owner's loader picks a step's rows
                    digest.update(np.asarray(data.epoch_order(0) if hasattr(data, "epoch_order") else rows,
                                             np.int64).tobytes())
                ids = data.row_id_digest() if hasattr(data, "row_id_digest") else None
                return {"rows": int(len(rows) + len(data.test_rows)), "held-out rows": int(len(data.test_rows)),
                        "sample order": digest.hexdigest()[:PART_DIGEST_HEX], **({"row ids": ids} if ids else {})}
        return {}

    def interface_origins(self) -> dict[str, str]:
        """Where this party's interface fields come from, for a refusal to name (the hello carries it):
        ``"*"`` for every field its file sets (a built-in experiment's name, else the file's name without its
        folders, which are this party's own business, a long one's tail), and each field a command-line flag
        set, the flag (``--gradient-codec``)."""
        name = Path(self.source).name
        path = name if len(name) <= ORIGIN_MAX // 2 else "..." + name[3 - ORIGIN_MAX // 2:]
        origin = (NOT_A_FILE[self.source] if self.source in NOT_A_FILE
                  else f"built-in experiment {Path(self.source).stem!r}" if Path(self.source).parent == BUILTIN_DIR
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


def file_error(source: str, message: str) -> ConfigError:
    """The ``ConfigError`` for ``message`` about the experiment or stage file ``source``."""
    return ConfigError(f"experiment {source}: {message}")


def interface_digest(parts: Mapping[str, Any]) -> str:
    """The fingerprint of an interface's fields: equal fields, equal fingerprint."""
    return value_digest(dict(parts), 64)


def value_digest(value: Any, hex_digits: int) -> str:
    """The first ``hex_digits`` hex digits of SHA-256 over ``value`` as canonical JSON (sorted keys)."""
    canonical = json_text(value, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:hex_digits]


def codec_name(text: Any, where: str) -> str:
    """The canonical name of the codec ``text`` names (``parse_codec``); ``ConfigError`` naming ``where``."""
    try:
        return parse_codec(text).name
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from e


def check_codecs(exp: "Experiment") -> None:
    """Raise ``ConfigError`` unless each direction's codec can carry the tensors of every cut (``int8`` and
    ``topk:K`` need an axis; ``K`` at most the entries of a row; both only finite values, so not with
    ``allow_nonfinite``), and unless every codec is ``none`` in an experiment of one stage (no tensor crosses
    a wire there)."""
    if len(exp.stage_names) < 2:
        for key, name in (("activation_codec", exp.activation_codec), ("gradient_codec", exp.gradient_codec)):
            if name != "none":
                raise ConfigError(f"{key} {name!r}: experiment {exp.name!r} has one stage, so no tensor crosses "
                                  f"a wire for a codec to code; use \"none\"")
    for direction, codec in exp.codecs.items():
        key = "activation_codec" if direction == "activation" else "gradient_codec"
        if exp.allow_nonfinite and not codec.carries_nonfinite:
            raise ConfigError(f"{key} {codec.name!r} carries only finite values, and allow_nonfinite lets NaN and "
                              f"Inf cross: a step holding one would fail rather than send it. Use none, float16 or "
                              f"bfloat16 for {key}, or drop allow_nonfinite")
        for i, cut in enumerate(exp.cuts):
            try:
                codec.check_shape(tuple(cut))
            except ConfigError as e:
                raise ConfigError(f"{key} {codec.name!r} cannot carry activation {i + 1} of shape {tuple(cut)}: "
                                  f"{e}") from e


def check_secure_aggregation(exp: "Experiment") -> None:
    """Raise ``ConfigError`` with the reason when ``secure_aggregation`` is on where it cannot hide the
    parties' embeddings: it needs aggregate = sum or mean (concat hands the label owner each party's own
    columns), two or more feature parties (the sum of one is its embedding), the parties' embeddings alone
    (not a label owner's own 'bottom'), no activation codec (the masked integers cross exactly), finite
    values (fixed point has no NaN)."""
    if not exp.secure_aggregation:
        return
    why = None
    if not exp.vertical:
        why = "it hides each feature party's embedding in their sum: give aggregate = \"sum\" or \"mean\""
    elif exp.aggregate not in ("sum", "mean"):
        why = (f"aggregate = {exp.aggregate!r} hands the label owner each party's own embedding; only \"sum\" "
               f"and \"mean\" can hide them in their sum")
    elif len(exp.data_owners) < 2:
        why = "the sum of one feature party's embedding is that embedding: it needs two or more feature parties"
    elif exp.own_bottom:
        why = ("the label owner's own 'bottom' joins the parties' embeddings in the clear; secure aggregation "
               "hides the feature parties' embeddings only: leave out 'bottom' (or secure_aggregation)")
    elif exp.activation_codec != "none":
        why = (f"the masked integers must cross exactly, so activation_codec {exp.activation_codec!r} cannot "
               f"carry them (use \"none\")")
    elif exp.allow_nonfinite:
        why = "fixed point has no NaN or Inf: allow_nonfinite cannot be kept"
    if why is not None:
        raise ConfigError(f"secure_aggregation: {why}")


def softmax_cross_entropy(loss: Loss) -> bool:
    """Whether ``loss`` is a plain softmax cross-entropy over class ids (distgrad's, or torch's
    CrossEntropyLoss with no option but its reduction): the loss ``label_dp``'s training loss replaces."""
    if isinstance(loss, TorchLoss):
        return loss.type == "CrossEntropyLoss" and set(loss.options) <= {"reduction"}
    return isinstance(loss, SoftmaxCrossEntropy)


def stage_loss(spec: StageSpec) -> Loss:
    """The last stage's loss as distgrad knows it: a distgrad loss, or for a module stage also a torch.nn loss
    class (``losses.TorchLoss``: its targets, reduction and accuracy; torch computes it)."""
    try:
        return build_module_loss(spec.loss) if spec.module is not None else build_loss(spec.loss)
    except ConfigError as e:
        raise ConfigError(f"stage {spec.name!r}: {e}") from e


def reported_fields(spec: StageSpec) -> list[str]:
    """The held-out scores an evaluation by the last stage ``spec`` reports: ``test_loss``, ``test_accuracy``
    for a loss of class ids, and ``test_NAME`` for each of its ``metrics``."""
    fields = ["test_loss"] + (["test_accuracy"] if stage_loss(spec).classifies else [])
    return fields + [f"test_{m}" for m in spec.metrics if f"test_{m}" not in fields]


def check_evaluation_keys(spec: StageSpec) -> None:
    """Raise ``ConfigError`` unless the last stage's ``metrics`` fit its loss and ``keep_best`` and
    ``early_stopping`` name a score it reports (``reported_fields``)."""
    where = f"stage {spec.name!r}"
    check_metrics(spec.metrics, stage_loss(spec).classifies, where)
    fields = reported_fields(spec)
    for key, field_ in (("keep_best", spec.keep_best),
                        ("early_stopping's metric", (spec.early_stopping or {}).get("metric"))):
        # "validation_accuracy" names the same score as "test_accuracy": judged on the validation rows when
        # [data] has a validation_fraction (stage.selection.judged_field), on the held-out rows otherwise
        if field_ is not None and field_.replace("validation_", "test_", 1) not in fields:
            raise ConfigError(f"{where}: {key} {field_!r} is not a score this stage reports; it reports {fields} "
                              f"(add a metric to 'metrics' to report it)")


def loss_reduction(spec: StageSpec) -> str:
    """How the last stage's loss reduces rows: a distgrad loss's own, or a torch loss's ``reduction``."""
    return stage_loss(spec).reduction


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
    if loss.classifies and len(output_shape) >= 2 and hasattr(data, "all_targets"):
        # Found here, not at the step or evaluation whose batch first holds such a label.
        labels = np.asarray(data.all_targets())
        ignored = loss.options.get("ignore_index") if isinstance(loss, TorchLoss) else None
        labels = labels[labels != ignored] if ignored is not None else labels
        classes = int(output_shape[1])
        if len(labels) and (int(labels.min()) < 0 or int(labels.max()) >= classes):
            raise ConfigError(f"the labels hold class ids {int(labels.min())}..{int(labels.max())}, but the last "
                              f"stage {last!r} outputs scores for {classes} classes (shape {tuple(output_shape)}), "
                              f"so {loss_name} takes class ids 0..{classes - 1}")


def idle_row_defense(exp: Experiment, stage: str, rows: int | None) -> str | None:
    """Why a defense of ``stage`` that acts within each micro-batch would do nothing in micro-batches of
    ``rows`` rows (None: it acts, or ``rows`` is unknown): the label owner's ``max_norm`` (noise up to the
    largest norm of the micro-batch) and ``marvell`` (noise from the difference of its two classes) add no
    noise to a micro-batch of one row; a data owner's ``nopeek`` has no gradient in one of two rows or fewer
    (the distance correlation of two rows is 1 whatever they are)."""
    if rows is None or rows > 2 or not exp.has_stage(stage):
        return None
    defenses, fix = exp.spec(stage).defenses, "use fewer micro-batches or larger batches"
    if defenses.nopeek is not None:
        return (f"'nopeek' adds the gradient of each micro-batch's distance correlation, which is constant in "
                f"a micro-batch of {rows} row{'s' if rows > 1 else ''} (0 for one, 1 for two): it would change "
                f"nothing ({fix})")
    if rows > 1:
        return None
    if defenses.max_norm:
        return (f"'max_norm' adds to each row the noise that brings it to the largest norm of its micro-batch, "
                f"and a micro-batch of {rows} row has no other: it would add no noise ({fix})")
    if defenses.marvell is not None:
        return (f"'marvell' shapes its noise by the two classes of each micro-batch, and a micro-batch of {rows} "
                f"row holds one class: every row would cross as computed ({fix})")
    return None


def check_run_settings(exp: Experiment, *, steps: Any = None, seed: Any = None, micro_batches: Any = 1,
                       init: Mapping[str, float] | None = None, checkpoint_dir: Any = None,
                       checkpoint_every: Any = None, resume: bool = False, in_process: bool = False,
                       eval_every: Any = None, staleness: Any = None, evaluations_known: bool = True,
                       steps_known: bool = True, trains: bool = True) -> None:
    """The settings of one run, checked once before any process or step starts (every path calls it:
    ``distgrad run``, ``--in-process``, ``distgrad-stage``, the Python API).

    ``None`` means the experiment's value or the default. Raises ``ConfigError``
    naming the bad value: ``steps`` below 1, a negative ``seed``,
    ``micro_batches`` that do not divide the batch, unknown ``init`` names,
    ``checkpoint_every`` or ``resume`` without ``checkpoint_dir``, and with
    ``in_process`` (which keeps no checkpoints) any checkpoint setting; a
    negative ``eval_every``; a ``staleness`` (None: the experiment's) that is
    negative, or above 0 or ``auto`` where it is not supported (several
    clients, vertical parties, a first stage computing off the CPU), and
    ``auto`` with ``in_process`` (no link to measure) or ``resume``. Settings
    that a run of ``steps`` is too short to let act are logged at WARNING,
    not refused (a short trial of a file made for a longer run is ordinary
    use): a data owner's ``input_guard`` that would judge no step
    (``check_guard_horizon``), SplitFed clients that would average none
    (``check_average_horizon``), a learning-rate schedule or scheduler whose
    steps all lie past the last update (``horizons.check_rate_horizon``), a
    ``checkpoint_every`` that saves nothing before the last step
    (``horizons.check_checkpoint_horizon``) and, unless the evaluations are
    another process's to say (``evaluations_known`` False: a stage that follows the
    driving stage's hello, which says them once the hello arrives, or a launcher
    that passes the driving stage its flags), verdicts and schedulers the
    evaluations could not act on before the last step (``check_evaluation_horizon``).
    These need a training run: ``trains`` False (a stage serving predictions) skips them.
    ``steps_known`` False (a stage whose run's steps its driving stage's hello says,
    ``StageOptions.follows_steps``): the schedule and ``checkpoint_every``
    warnings wait for them (``check_step_horizons``, at the hello).
    """
    _check_flag("--steps", steps, 1)
    _check_flag("--seed", seed, 0)
    _check_micro_batches(exp, micro_batches)
    check_init_overrides(exp, init or {})
    check_staleness(exp, exp.staleness if staleness is None else staleness)
    _check_flag("--eval-every", eval_every, 0, " (0: only after the last step)")
    check_verdicts(exp, exp.eval_every if eval_every is None else eval_every,
                   exp.staleness if staleness is None else staleness)
    check_plateau(exp, exp.eval_every if eval_every is None else eval_every,
                  exp.staleness if staleness is None else staleness)
    check_scheduler_horizon(exp, exp.steps if steps is None else steps)
    run_steps, flag = exp.steps if steps is None else steps, "--steps" if steps is not None else ""
    if trains:                  # what would act during the training steps: nothing to do for a prediction
        if evaluations_known:
            check_evaluation_horizon(exp, run_steps, exp.eval_every if eval_every is None else eval_every, flag)
        check_guard_horizon(exp, run_steps, flag)
        check_average_horizon(exp, run_steps, flag)
        if steps_known:
            check_rate_horizon([(spec, stage_updates(exp, spec.name, run_steps)) for spec in exp.stages], run_steps,
                               _steps_given(exp, run_steps, flag))
    _check_run_mode(checkpoint_dir, checkpoint_every, resume, in_process, staleness)
    if trains and steps_known:
        check_checkpoint_horizon(checkpoint_every, run_steps, _steps_given(exp, run_steps, flag))


def _check_micro_batches(exp: Experiment, micro_batches: Any) -> None:
    """``ConfigError`` unless ``micro_batches`` is a whole number >= 1 that splits ``exp``'s batch into equal
    micro-batches, in each of which every stage's row defenses would act (``idle_row_defense``)."""
    _check_flag("--micro-batches", micro_batches, 1)
    if micro_batches > 1 and (exp.batch is None or exp.batch % micro_batches):
        raise ConfigError(f"experiment {exp.name!r} has batches of {exp.batch or 'no'} rows: "
                          f"they do not split into {micro_batches} equal micro-batches")
    for spec in exp.stages:         # a defense of each micro-batch's rows that would do nothing there
        idle = idle_row_defense(exp, spec.name, exp.batch // micro_batches if exp.batch else 1)
        if idle is not None:
            raise ConfigError(f"stage {spec.name!r}: {idle}")


def _check_run_mode(checkpoint_dir: Any, checkpoint_every: Any, resume: bool, in_process: bool,
                    staleness: Any) -> None:
    """``ConfigError`` for checkpoint and staleness settings the way the run is made cannot take:
    ``checkpoint_every`` (a whole number >= 0) or ``resume`` without ``checkpoint_dir``; any checkpoint setting
    ``in_process`` (which keeps none); ``--staleness auto`` ``in_process`` (no link to measure) or on
    ``resume`` (the run goes on with the S it chose)."""
    _check_flag("--checkpoint-every", checkpoint_every, 0)
    if checkpoint_every and checkpoint_dir is None:
        raise ConfigError("--checkpoint-every needs --checkpoint-dir (where to save the checkpoints)")
    if resume and checkpoint_dir is None:
        raise ConfigError("--resume needs --checkpoint-dir")
    if in_process and (checkpoint_dir is not None or checkpoint_every or resume):
        raise ConfigError("--in-process keeps no checkpoints: drop --checkpoint-dir, --checkpoint-every "
                          "and --resume (or run the stages as processes)")
    if staleness == AUTO_STALENESS and in_process:
        raise ConfigError("--staleness auto measures the link to the stage below, and a run in one process "
                          "(--in-process, or an experiment of one stage) has none: give --staleness S (a run with "
                          "auto records the S it chose in its summary's 'staleness')")
    if staleness == AUTO_STALENESS and resume:
        raise ConfigError("--staleness auto chooses S from the first step when a run starts; a resumed run must "
                          "go on with the S it chose: give --staleness S (its summary's 'staleness', or the log "
                          "line 'staleness auto: S = ...')")


def _check_flag(flag: str, value: Any, low: int, note: str = "") -> None:
    """Raise ``ConfigError`` naming ``flag`` unless ``value`` (None: not given) is an integer, not a bool, of
    at least ``low``: the check of the file key of the same range (``keys.whole``)."""
    check = whole(low)
    if value is not None and not check.accepts(value):
        raise ConfigError(f"{flag} must be an {check.kind}{note}, got {value!r}")


def check_verdicts(exp: Experiment, eval_every: Any, staleness: Any) -> None:
    """Raise ``ConfigError`` when the last stage's ``keep_best`` or ``early_stopping`` cannot act: with
    several data owners (each is scored on its own rows: no one step is best for all), with steps in flight
    (``staleness``: the stages below have applied later steps when an evaluation is scored), or early
    stopping without evaluations during the run (``eval_every`` 0)."""
    last = next((spec for spec in exp.stages if spec.name == exp.stage_names[-1]), None)
    if last is None or (last.keep_best is None and last.early_stopping is None):
        return
    given = [key for key in ("keep_best", "early_stopping") if getattr(last, key) is not None]
    if exp.federated:
        raise ConfigError(f"{given}: with [clients] each data owner is scored on its own held-out rows, so no one "
                          f"step is the best or the last for all; drop {given} or the [clients] table")
    if staleness == AUTO_STALENESS or (is_whole(staleness) and staleness > 0):
        raise ConfigError(f"{given} with staleness {staleness}: with steps in flight the stages below have applied "
                          f"later steps than the one evaluated, so no one step is kept or stopped at on every party; "
                          f"use staleness = 0")
    if last.early_stopping is not None and is_whole(eval_every) and eval_every == 0:
        raise ConfigError("early_stopping judges the evaluations during the run, and eval_every is 0 (only after "
                          "the last step): set eval_every (or --eval-every) to K > 0")


def check_plateau(exp: Experiment, eval_every: Any, staleness: Any) -> None:
    """Raise ``ConfigError`` where a stage's ``scheduler = { type = "ReduceLROnPlateau" }`` cannot be fed the
    loss of each evaluation at the same point on every party: without evaluations during the run
    (``eval_every`` 0), with steps in flight (``staleness``) or with [clients] (each scored on its own rows)."""
    named = [spec.name for spec in exp.stages if (spec.scheduler or {}).get("type") == PLATEAU]
    if not named:
        return
    where = f"stage(s) {named}: scheduler ReduceLROnPlateau"
    if is_whole(eval_every) and eval_every == 0:
        raise ConfigError(f"{where} is stepped with the loss of each evaluation during the run, and eval_every is 0 "
                          f"(only after the last step): set eval_every (or --eval-every) to K > 0")
    if staleness == AUTO_STALENESS or (is_whole(staleness) and staleness > 0):
        raise ConfigError(f"{where} with staleness {staleness}: with steps in flight the parties apply an "
                          f"evaluation's loss after different steps; use staleness = 0")
    if exp.federated:
        raise ConfigError(f"{where}: with [clients] each data owner is scored on its own held-out rows, so no one "
                          f"loss steps the shared stage; drop the scheduler or the [clients] table")


def check_evaluation_horizon(exp: Experiment, steps: int, eval_every: int, flag: str = "", *,
                             drivers: Sequence[str] = ()) -> None:
    """Where what the evaluations during the run decide could not act before the last step, which is evaluated
    anyway and ends the run, log a WARNING naming the key, its value, ``eval_every`` and the run's ``steps``
    (``--steps`` when ``flag`` names it): ``keep_best`` with no evaluation before it (the last model is kept,
    as without it), ``early_stopping`` whose patience cannot run out before it (its earliest stop is after
    evaluation patience + 1: the first sets the best), and a ``ReduceLROnPlateau`` scheduler that cannot lower
    its rate before it (the earliest after evaluation patience + 2). A run that long would let them act: each
    watches every evaluation. The evaluations are after every ``eval_every``-th step (0: none during the run),
    on every path alike, a resumed run too. ``drivers``: a stage that follows the hello of these driving
    stages, whose ``eval_every`` and ``steps`` these are: the WARNING names them as where to change them."""
    during = (steps - 1) // eval_every if eval_every > 0 else 0     # evaluations before the last step
    if not drivers:
        given = f"eval_every = {eval_every} and {steps} steps ({_steps_given(exp, steps, flag)})"
        setting, where = "eval_every (or --eval-every)", ""
    else:
        several = len(drivers) > 1
        who = f"the driving stage{'s' if several else ''} {', '.join(map(repr, drivers))}"
        their, plural = ("their", "s") if several else ("its", "")
        given = f"eval_every = {eval_every} and {steps} steps (as {who} asked in {their} hello{plural})"
        setting = "eval_every"
        where = (f" on the data owner's side ({who}: eval_every in {their} stage file{plural}, or {their} "
                 f"--eval-every K)")
    last = next((spec for spec in exp.stages if spec.name == exp.stage_names[-1]), None)
    if last is not None and last.keep_best is not None and during == 0:
        log.warning("stage %r: keep_best = %r keeps the parameters of the best evaluation, and with %s the run "
                    "evaluates only after its last step: it keeps the last model, as without it. Set %s to K "
                    "below %d%s, or drop keep_best", last.name, last.keep_best, given, setting, steps, where)
    waits = [(f"stage {last.name!r}: early_stopping (patience = {last.early_stopping['patience']})",
              int(last.early_stopping["patience"]) + 1, "stop the run")] if last and last.early_stopping else []
    waits += [(f"stage {spec.name!r}: scheduler ReduceLROnPlateau (patience = {_plateau_patience(spec)})",
               _plateau_patience(spec) + 2, "lower its rate")
              for spec in exp.stages if (spec.scheduler or {}).get("type") == PLATEAU]
    for what, needed, acts in waits:
        if during < needed:         # eval_every 0 is refused where the run is configured; a hello may ask it
            most = (steps - 1) // needed
            fix = f"eval_every = K of at most {most}{where or ' (or --eval-every K)'}, " if most else ""
            log.warning("%s can %s after its evaluation %d at the earliest, and with %s the run evaluates %d "
                        "time(s) before its last step: it will not in this run. Give %sa lower patience or more "
                        "steps", what, acts, needed, given, during, fix)


def check_held_out(stage: str, eval_every: int, held_out: int, flag: str = "") -> None:
    """Log a WARNING when data owner ``stage`` asks for an evaluation after every ``eval_every``-th step
    (``--eval-every`` when ``flag`` names it) and its data holds out no rows (``held_out`` 0): nothing is
    evaluated, during the run or after it, so the setting would do nothing."""
    if eval_every > 0 and held_out == 0:
        setting = f"{flag} {eval_every}" if flag else f"eval_every = {eval_every}"
        log.warning("stage %r: %s asks for an evaluation of the held-out rows every %d step(s), and its "
                    "[data] holds out none: nothing is evaluated, during the run or after its last step. Set "
                    "test_fraction in its [data] (a file kind), or drop %s", stage, setting, eval_every,
                    flag or "eval_every")


def _plateau_patience(spec: StageSpec) -> int:
    """A ``ReduceLROnPlateau`` scheduler's patience (torch's default when its table gives none)."""
    patience = (spec.scheduler or {}).get("patience", Plateau.DEFAULT_PATIENCE)
    return patience if is_whole(patience) and patience >= 0 else Plateau.DEFAULT_PATIENCE


def check_scheduler_horizon(exp: Experiment, steps: int) -> None:
    """Raise ``ConfigError`` where a stage's ``scheduler = { type = "OneCycleLR", ... }`` ends before the run
    does: torch refuses to step it past its ``total_steps`` (or ``epochs`` x ``steps_per_epoch``), which
    would stop the run at that update. A serving stage of several clients updates once per client a step."""
    for spec in exp.stages:
        table = spec.scheduler or {}
        if table.get("type") != "OneCycleLR":
            continue
        total = table.get("total_steps")
        if total is None and is_whole(table.get("epochs")) and is_whole(table.get("steps_per_epoch")):
            total = table["epochs"] * table["steps_per_epoch"]
        serving = exp.federated and spec.name == exp.stage_names[-1]
        updates = steps * (exp.clients.count if serving else 1)
        if isinstance(total, int) and is_whole(total) and total < updates:
            raise ConfigError(f"stage {spec.name!r}: scheduler OneCycleLR has {total} steps and the stage makes "
                              f"{updates} updates in this run: give total_steps >= {updates} (or fewer steps)")


def check_step_horizons(exp: Experiment, steps: int, given: str, checkpoint_every: Any = None) -> None:
    """What ``check_run_settings`` says of a run of ``steps`` steps (``given``: where they come from) once they
    are known: a schedule or scheduler that would never change the rate (``horizons.check_rate_horizon``) and a
    ``checkpoint_every`` that would save nothing before the last step (``horizons.check_checkpoint_horizon``)."""
    check_rate_horizon([(spec, stage_updates(exp, spec.name, steps)) for spec in exp.stages], steps, given)
    check_checkpoint_horizon(checkpoint_every, steps, given)


def stage_updates(exp: Experiment, stage: str, steps: int) -> int:
    """The optimizer updates stage ``stage`` makes in a run of ``steps`` steps: one a step, and a serving stage
    of several clients one per client a step."""
    serving = exp.federated and stage == exp.stage_names[-1]
    return steps * (exp.clients.count if serving else 1)


def _steps_given(exp: Experiment, steps: int, flag: str) -> str:
    """Where a run's ``steps`` come from, for an error: the flag, else the file's steps or epochs."""
    if flag:
        return f"{flag} {steps}"
    return f"steps = {steps}" if exp.epochs is None else f"epochs = {exp.epochs} of {steps // exp.epochs} steps"


def check_guard_horizon(exp: Experiment, steps: int, flag: str = "") -> None:
    """Log a WARNING naming the stage, 'input_guard', its value and the run's ``steps`` where a data owner's
    guard will judge no step of this run, so that every row leaves unjudged: its ``after`` (the steps it does
    not judge) at or beyond the last step, or fewer rows sent in the whole run than it needs to score
    (``privacy.guard.rows_needed``: each data owner, each client, sends a batch of its own rows a step).
    ``steps`` are the run's (``--steps`` when ``flag`` names it); a resumed run's are the same, and the
    guard's rows and peak come back from its checkpoints, so the rule is the same for it."""
    given = _steps_given(exp, steps, flag)
    for spec in exp.stages:
        if spec.input_guard is None or spec.name not in exp.data_owners or not exp.cuts:
            continue
        max_r2, after = spec.input_guard
        where = f"stage {spec.name!r}: 'input_guard' {{ max_r2 = {max_r2:g}, after = {after} }}"
        if after >= steps:
            default = f" ({GUARD_AFTER_STEPS} when not given)" if after == GUARD_AFTER_STEPS else ""
            log.warning("%s%s judges only the steps after step %d, and this run has %d steps (%s): it will "
                        "judge none and every row leaves unjudged. Give after = K below %d, or run more steps",
                        where, default, after, steps, given, steps)
            continue
        cut = exp.cuts[exp.stage_index(spec.name)]
        rows = cut[0] if cut else 1
        need = rows_needed(int(np.prod(cut[1:])))
        if steps * rows < need:
            log.warning("%s scores the rows it sent once it holds %d of them (its activation has %d values a "
                        "row), and this run sends %d (%d steps of %d rows, %s): it will judge none and every row "
                        "leaves unjudged. Run at least %d steps", where, need, int(np.prod(cut[1:])),
                        steps * rows, steps, rows, given, -(-need // rows))


def check_average_horizon(exp: Experiment, steps: int, flag: str = "") -> None:
    """Log a WARNING naming [clients] average_every and the run's ``steps`` (``--steps`` when ``flag`` names it)
    where SplitFed will average no step: every K-th step is averaged, and a run of fewer than K steps has
    none, so its clients train apart as with mode = "separate" while the file says they average."""
    every = exp.clients.average_every
    if exp.clients.mode != "splitfed" or every <= steps:
        return
    log.warning("[clients] mode = 'splitfed' averages the clients' first stages every %d steps (average_every = "
                "%d), and this run has %d steps (%s): it will average none, the clients training apart. Give "
                "average_every = K of at most %d, or run at least %d steps", every, every, steps,
                _steps_given(exp, steps, flag), steps, every)


def check_send_rows(exp: Experiment) -> None:
    """Raise ``ConfigError`` where ``send_rows`` cannot act: data without numbered rows (unbatched), targets
    that travel with the activations (``labels = "first"``: the label owner is the sender, nothing is looked
    up by row), and a label owner's Marvell, which reads its labels in its own sample order (its privacy
    meter likewise: ``defended.meter_kind``)."""
    if not exp.send_rows:
        return
    if exp.batch is None:
        raise ConfigError("send_rows sends each step's row numbers, and this experiment's data is unbatched "
                          "(no rows): drop send_rows or use batched rows (npz, npy, csv or synthetic)")
    if exp.labels_travel:
        raise ConfigError("send_rows lets the label owner take the targets of the rows it is sent; with "
                          "labels = \"first\" the targets travel with the activations already: drop send_rows")
    last = exp.stage_names[-1]
    if exp.has_stage(last) and exp.spec(last).defenses.marvell is not None:
        raise ConfigError(f"send_rows with 'marvell' on the label owner {last!r}: Marvell reads its labels in its "
                          f"own sample order, not those of the rows it is sent; drop one of them")


MAX_STALENESS = 64     # steps in flight: each holds a copy of the first stage's parameters
AUTO_STALENESS = "auto"   # --staleness auto: the driving stage chooses S from its link (run/autostaleness.py)


def check_staleness(exp: Experiment, staleness: Any) -> None:
    """Raise ``ConfigError`` unless ``staleness`` S (steps in flight) is a whole number from 0 to
    ``MAX_STALENESS``, or ``AUTO_STALENESS``, that this experiment supports: two stages or a chain, with a
    first stage whose parameters of an earlier step can be swapped back in for a backward (host memory).
    ``auto`` may choose any S, so it is refused wherever S > 0 is."""
    if staleness != AUTO_STALENESS and not whole(0, MAX_STALENESS).accepts(staleness):
        raise ConfigError(f"--staleness must be an integer from 0 to {MAX_STALENESS} or 'auto', got {staleness!r}")
    if not staleness:
        return
    if len(exp.stage_names) < 2:
        raise ConfigError(f"staleness {staleness}: experiment {exp.name!r} has one stage, so no step is ever in "
                          f"flight (there is no stage below to wait for); use staleness = 0")
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
    model = exp.model(stage_name, seed)
    for name, value in overrides.items():
        if name in model.params:
            model.params[name][...] = value
    loss = build_loss(spec.loss) if stage_name == exp.stage_names[-1] else None
    optimizer = build_optimizer(spec.optimizer)
    if spec.scheduler is not None and spec.framework != "torch":     # ReduceLROnPlateau: the only one a numpy stage takes
        options = {k: v for k, v in spec.scheduler.items() if k != "type"}
        try:
            optimizer.schedule = Plateau(float(optimizer.schedule(1)), **options)
        except TypeError as e:
            raise ConfigError(f"stage {stage_name!r}: scheduler {PLATEAU} takes {list(PLATEAU_OPTIONS)}, got "
                              f"{sorted(options)}") from e
    return model, optimizer, loss


PART_VALUE_MAX = 64       # a part's string value is at most this long (a longer one is cut: ``fitted_parts``)
PART_DIGEST_HEX = 16      # hex digits of SHA-256 kept in a digest part: enough to tell two files apart
MAX_PARTS = 128           # parts a hello may name (msgpack maps are limited to 256 entries)
# A cut library party's interface given in code rather than in a file: its ``source``, and how a refusal names
# where that party's interface fields come from (``interface_origins``).
ARGUMENTS_SOURCE, TABLE_SOURCE = "the interface's arguments", "the interface table"
NOT_A_FILE = {ARGUMENTS_SOURCE: "interface given as keyword arguments", TABLE_SOURCE: "interface given as a table"}
ORIGIN_MAX = 200          # characters of a hello's origin of interface fields (a flag, a file)


def fitted_parts(parts: dict[str, Any]) -> dict[str, Any]:
    """``parts`` with every string value longer than ``PART_VALUE_MAX`` cut into pieces of that length under
    ``NAME``, ``NAME 2``, ``NAME 3``, ...: the stage list of many feature parties (or a long experiment
    name) still fits a hello, and equal interfaces still give equal parts; short values are unchanged."""
    out: dict[str, Any] = {}
    for name, value in parts.items():
        if not isinstance(value, str) or len(value) <= PART_VALUE_MAX:
            out[name] = value
            continue
        for piece, start in enumerate(range(0, len(value), PART_VALUE_MAX)):
            out[name if piece == 0 else f"{name} {piece + 1}"] = value[start:start + PART_VALUE_MAX]
    return out
