"""Reading experiments: a combined experiment or a party's stage file (TOML, or a dict) into an ``Experiment``.

``load_experiment`` takes a built-in's name, a file, or several stage files (combined by
``combine_stage_files``); ``parse_experiment`` takes the parsed table. Every key is checked against
``distgrad.config.schema`` and every error is a ``ConfigError`` naming the file and the key. The experiment model
itself (``Experiment``, ``StageSpec``) and the checks of run settings are in ``distgrad.config.experiment``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from distgrad.config import schema
from distgrad.config.keys import Key, read_keys, refuse_unknown, restricted
from distgrad.config.data import ColumnView, DataSource, build_data
from distgrad.config.defended import check_defenses
from distgrad.errors import ConfigError
from distgrad.config.experiment import (BUILTIN_DIR, FILE_KINDS, FRAMEWORKS,
                                        builtin_names, check_codecs, check_evaluation_keys, check_secure_aggregation,
                                        check_send_rows, check_staleness, check_targets, Clients,
                                        Experiment, file_error, interface_differences, loss_reduction, StageSpec, value_digest)
from distgrad.model.nn import Sequential, Shape, build_model
from distgrad.model.optim import build_optimizer
from distgrad.model.schedules import PLATEAU
from distgrad.config.tomlfile import read_toml
from distgrad.privacy.defenses import parse_defenses


def _base_dir(source: str) -> Path:
    """The folder a file's relative paths start from: the file's own, else the working directory."""
    return Path(source).parent if source and Path(source).is_file() else Path.cwd()


def _parse_stage(source: str, table: Any, index: int, last: bool, party: bool) -> StageSpec:
    """One ``[[stages]]`` (combined) or ``[stage]`` (stage file) table: its keys read through their
    declarations (``_stage_values``), the rules between them (``_check_computation``, ``_check_place``), then
    the ``StageSpec`` (``_stage_spec``), whose evaluation keys must fit the last stage's loss."""
    keys = schema.STAGE_KEYS if party else schema.COMBINED_STAGE_KEYS
    values = _stage_values(source, table, keys, "[stage]" if party else f"stage {index}")
    _check_computation(source, table, values)
    _check_place(source, table, keys, values["name"], last, party)
    spec = _stage_spec(source, table, values)
    if last and spec.loss is not None:
        try:
            check_evaluation_keys(spec)
        except ConfigError as e:
            raise file_error(source, str(e)) from e
    return spec


def _stage_values(source: str, table: Any, keys: Mapping[str, Key], where: str) -> dict[str, Any]:
    """A stage table's keys, each read through its declaration (``read_keys``), with its
    ``framework`` filled in (torch for a 'module'). ``where`` names the table until its name is known."""
    if not isinstance(table, dict):
        raise file_error(source, f"{where} is not a table")
    try:
        refuse_unknown(table, keys, f"{where} has unknown keys")
    except ConfigError as e:
        raise file_error(source, str(e)) from e
    name = _read(source, table, {"name": keys["name"]}, f"{where}: ")["name"]
    values = _read(source, table, keys, f"stage {name!r}: ")
    if values["framework"] is None:
        values["framework"] = "torch" if values["module"] is not None else "numpy"
    return values


def _check_computation(source: str, table: Mapping[str, Any], values: Mapping[str, Any]) -> None:
    """The rules between the keys that say what computes a stage: 'model' or 'module', the torch-only keys
    ('module_args', 'output', 'scheduler', a device other than the CPU)."""
    name, module, framework = values["name"], values["module"], values["framework"]
    if (values["model"] is not None) == (module is not None):
        raise file_error(source, f"stage {name!r} needs either 'model' (a list of layers) or 'module' "
                                 f"(\"package.module:factory\" returning a torch.nn.Module), not both")
    if table.get("module_args") is not None and module is None:
        raise file_error(source, f"stage {name!r}: 'module_args' is a table of keyword arguments for 'module'")
    if module is not None and framework != "torch":
        raise file_error(source, f"stage {name!r}: 'framework' must be one of {list(FRAMEWORKS)} (a 'module' is "
                                 f"torch), got {framework!r}")
    if values.get("output") is not None and module is None:
        raise file_error(source, f"stage {name!r}: 'output' is the per-row output shape of a 'module' stage, a list "
                                 f"of positive whole numbers, got {values.get('output')!r}")
    if values["scheduler"] is not None and framework != "torch" and values["scheduler"].get("type") != PLATEAU:
        raise file_error(source, f"stage {name!r}: 'scheduler' is a torch.optim.lr_scheduler class, for a torch "
                                 f"stage; a numpy stage's learning rate follows its optimizer's 'schedule' table "
                                 f"(see Learning-rate schedules), or {PLATEAU}'s rule")
    if values["scheduler"] is not None and "schedule" in values["optimizer"]:
        raise file_error(source, f"stage {name!r}: give the optimizer's 'schedule' (distgrad's float32 schedules) "
                                 f"or 'scheduler' (torch's), not both")
    if values["device"] != "cpu" and framework != "torch":
        raise file_error(source, f"stage {name!r}: 'device' {values['device']!r} needs framework = \"torch\"")


def _check_place(source: str, table: Mapping[str, Any], keys: Mapping[str, Key], name: str, last: bool,
                 party: bool) -> None:
    """The keys only the last stage may give (``schema.LAST``), and its 'loss' (a stage file's, against the
    interface's stages: ``_parse_stage_file``)."""
    given = restricted(table, keys, schema.LAST)
    if given and not last:
        reasons = "; ".join(dict.fromkeys(keys[key].why for key in given))
        raise file_error(source, f"stage {name!r}: {given} belong to the last stage ({reasons}): only the last "
                                 f"stage may set them")
    if not party and last != ("loss" in table):
        raise file_error(source, f"stage {name!r}: exactly the last stage has a 'loss'")


def _stage_spec(source: str, table: Mapping[str, Any], values: Mapping[str, Any]) -> StageSpec:
    """The ``StageSpec`` of a stage table whose keys ``values`` holds (read and checked), with its defenses
    (``parse_defenses``)."""
    name = values["name"]
    try:
        defenses = parse_defenses(table, name)
    except ConfigError as e:
        raise file_error(source, str(e)) from e

    def copied(key: str, kind: Callable[[Any], Any]) -> Any:
        return None if values.get(key) is None else kind(values[key])
    return StageSpec(name, copied("model", list), dict(values["optimizer"]), values["loss"], values["framework"],
                     values["module"], dict(values["module_args"]), values["device"], copied("output", tuple),
                     None, values.get("seed"), _base_dir(source), source, copied("columns", list),
                     copied("scheduler", dict), defenses, tuple(values["metrics"]), values["keep_best"],
                     copied("early_stopping", dict), privacy_meter=values["privacy_meter"],
                     input_guard=values["input_guard"],
                     bottom=None if values["bottom"] is None else [dict(t) for t in values["bottom"]])


def _check_scored(exp: Experiment) -> None:
    """Raise ``ConfigError`` when the last stage asks for held-out scores or verdicts of an experiment whose
    data holds out no rows: they would never be computed."""
    last = next((s for s in exp.stages if s.name == exp.stage_names[-1]), None)
    if last is None:            # a party of another stage: it scores nothing
        return
    given = [key for key in ("metrics", "keep_best", "early_stopping") if getattr(last, key)]
    if given:
        raise ConfigError(f"stage {last.name!r}: {given} judge the held-out rows, and the data holds out none: set "
                          f"test_fraction in [data] (a file kind) or drop {given}")


def _check_parts_held(exp: Experiment, spec: StageSpec) -> None:
    """Raise ``ConfigError`` when a party's own [data] (a stage file's, of a file kind) names a part of the rows
    its stage never reads: labels at a stage that is not the label owner, features at one that is not a data
    owner (nor a vertical label owner with its own 'bottom'). They would be accepted and ignored, and a party
    that holds another's part of the rows is no split."""
    if spec.data is None or spec.data.get("kind") not in FILE_KINDS:
        return
    reads_features = spec.name in exp.data_owners or (spec.name == exp.stage_names[-1] and exp.own_bottom)
    for part, reads, who in (("labels", spec.name == exp.label_owner, f"{exp.label_owner!r} holds the labels "
                                                                        f"(labels = {exp.labels!r})"),
                             ("features", reads_features, f"the data owner(s) {exp.data_owners} hold the features")):
        if spec.data.get(part) is not None and not reads:
            raise ConfigError(f"stage {spec.name!r} names {part!r} in its [data], which it never reads: {who}; "
                              f"drop {part!r} from its [data]")


def _check_plateau_fed(exp: Experiment) -> None:
    """Raise ``ConfigError`` when a stage of these files has a ``ReduceLROnPlateau`` scheduler and the data
    holds out no rows: with no evaluation its rate would never change."""
    named = [spec.name for spec in exp.stages if (spec.scheduler or {}).get("type") == PLATEAU]
    if named:
        raise ConfigError(f"stage(s) {named}: scheduler ReduceLROnPlateau is stepped with the loss of each "
                          f"evaluation of the held-out rows, and the data holds out none: set test_fraction in "
                          f"[data] (a file kind) or drop the scheduler")


def _read(source: str, table: Mapping[str, Any], keys: Mapping[str, Key], where: str) -> dict[str, Any]:
    """``read_keys`` with the file named in its error."""
    try:
        return read_keys(table, keys, where)
    except ConfigError as e:
        raise file_error(source, str(e)) from e


def _refuse_unknown(source: str, table: Mapping[str, Any], keys: Mapping[str, Key], what: str,
                    hint: str = "") -> None:
    """``refuse_unknown`` with the file named in its error."""
    try:
        refuse_unknown(table, keys, what, hint)
    except ConfigError as e:
        raise file_error(source, str(e)) from e


def _settings(source: str, raw: Mapping[str, Any], keys: Mapping[str, Key], where: str) -> dict[str, Any]:
    """A combined experiment's top level or a stage file's [interface] (``keys``: its declarations, the
    settings both forms share among them): unknown keys refused, each key read through its declaration;
    'steps' and 'epochs' exclude each other."""
    _refuse_unknown(source, raw, keys, f"{where}has unknown keys" if where else "unknown top-level keys",
                    "" if where else " (a stage file has [interface], [stage] and [data] instead)")
    if "steps" in raw and "epochs" in raw:
        raise file_error(source, f"{where}give 'steps' or 'epochs', not both")
    return _read(source, raw, keys, where)


def _parse_aggregate(source: str, kind: str | None, where: str, names: Sequence[str], labels: str,
                     clients: Clients) -> str | None:
    """``aggregate`` (its form read already): absent (a chain), or how the last stage combines its feature
    parties' embeddings, which needs feature parties, the labels at the last stage and one data owner."""
    if kind is None:
        return None
    if len(names) < 2:
        raise file_error(source, f"{where}'aggregate' needs feature parties and a last stage: at least two stages")
    if labels != "last":
        raise file_error(source, f"{where}a vertical experiment ('aggregate') keeps the labels at its last stage: "
                                 f"labels = \"first\" is not supported")
    if clients.count > 1:
        raise file_error(source, f"{where}'aggregate' (feature parties) and [clients] (data owners of other rows) "
                                 f"cannot be combined")
    return kind


def parse_experiment(raw: Mapping[str, Any], source: str = "<dict>") -> Experiment:
    """Validate a parsed experiment or stage-file table and return an ``Experiment``.

    Everything that can be built is built once here, so a bad file fails
    now, naming itself and the problem (``ConfigError``), not mid-run.
    """
    raw = dict(raw)
    if "interface" in raw or "stage" in raw:
        return _parse_stage_file(raw, source)
    settings = _settings(source, raw, schema.TOP_KEYS, "")
    stage_tables = settings["stages"]
    stages = [_parse_stage(source, table, i, i == len(stage_tables) - 1, party=False)
              for i, table in enumerate(stage_tables)]
    names = [s.name for s in stages]
    if len(set(names)) != len(names):
        raise file_error(source, f"stage names must be unique, got {names}")
    clients, aggregate = _parties(source, settings, names, "")
    try:
        reduction = loss_reduction(stages[-1])
        if settings["reduction"] not in (None, reduction):
            raise ConfigError(f"'reduction' is {settings['reduction']!r} but the loss reduces rows by {reduction}")
        source_data = build_data(settings["data"], settings["seed"], _base_dir(source))
        cuts = _combined_cuts(stages, source_data, aggregate, settings["seed"])
        steps = _steps(settings, source_data)
    except ConfigError as e:
        raise file_error(source, str(e)) from e
    target = ((tuple(source_data.target_shape), np.dtype(source_data.target_dtype).name)
              if settings["labels"] == "first" and len(stages) > 1 else None)
    exp = _experiment(settings, raw, source, settings["data"], stages, names, clients, aggregate, cuts,
                      getattr(source_data, "batch", None), reduction, steps, target)
    _check_built(exp, source)
    return exp


def _parties(source: str, settings: Mapping[str, Any], names: Sequence[str], where: str
             ) -> tuple[Clients, str | None]:
    """Who holds the rows: [clients] (several data owners of other rows) and 'aggregate' (feature parties
    of the same rows); 'epochs' counts one data owner's rows."""
    clients = _parse_clients(source, settings["clients"], len(names))
    if settings["epochs"] is not None and clients.count > 1:
        raise file_error(source, "'epochs' counts passes over one data owner's rows; with several data owners "
                                 "([clients]) give 'steps'")
    return clients, _parse_aggregate(source, settings["aggregate"], where, names, settings["labels"], clients)


def _combined_cuts(stages: Sequence[StageSpec], data: DataSource, aggregate: str | None,
                   seed: int) -> tuple[Shape, ...]:
    """The shape of what crosses each cut of a combined experiment, computed from its data and the stages
    above the cut (a 'module' stage says its per-row 'output'). Raises ``ConfigError``."""
    batch = getattr(data, "batch", None)
    if data.feature_shape is None:
        raise ConfigError("the data holds no features for the first stage: give [data] 'features'")
    cuts, shape = [], tuple(data.feature_shape)
    for spec in stages[:-1]:
        if aggregate is not None:        # each feature party starts from its own columns
            shape = tuple(data.feature_shape)
        if spec.columns is not None:
            shape = tuple(ColumnView(data, spec.columns).feature_shape)
        if spec.model is not None:
            shape = build_model(spec.model, seed).output_shape(shape)
        elif spec.output is not None:
            shape = (batch, *spec.output) if batch is not None else spec.output
        else:
            raise ConfigError(f"stage {spec.name!r} is a torch module before the last stage: give its "
                              f"per-row output shape, e.g. output = [64]")
        cuts.append(tuple(shape))
    return tuple(cuts)


def _experiment(settings: Mapping[str, Any], raw: dict[str, Any], source: str, data: dict[str, Any],
                stages: list[StageSpec], names: Sequence[str], clients: Clients, aggregate: str | None,
                cuts: tuple[Shape, ...], batch: int | None, reduction: str, steps: int,
                target: tuple[Shape, str] | None) -> Experiment:
    """The ``Experiment`` of either form: its settings (read through their declarations) and what the form
    computed of its stages, cuts and data."""
    return Experiment(settings["name"], steps, settings["seed"], settings["labels"], settings["allow_nonfinite"],
                      data, stages, raw, value_digest(raw, 64), source, clients, list(names), cuts, batch,
                      reduction, settings["micro_batches"], settings["eval_every"], settings["epochs"],
                      settings["description"], target, aggregate=aggregate,
                      activation_codec=settings["activation_codec"], gradient_codec=settings["gradient_codec"],
                      staleness=settings["staleness"], send_rows=settings["send_rows"],
                      secure_aggregation=settings["secure_aggregation"])


def _steps(settings: Mapping[str, Any], data: DataSource | None) -> int:
    """``steps``, or ``epochs`` times the batches in one epoch of the data's training rows."""
    if settings["epochs"] is None:
        return settings["steps"]
    per_epoch = getattr(data, "batches_per_epoch", None)
    if per_epoch is None:
        raise ConfigError("'epochs' needs data with rows to walk (npz, npy, csv or synthetic); "
                          "give 'steps'")
    return settings["epochs"] * per_epoch


def _parse_stage_file(raw: dict[str, Any], source: str, own_loop: bool = False) -> Experiment:
    """One party's stage file: ``[interface]``, ``[stage]``, its own ``[data]``. ``own_loop``: the party
    trains in its own loop through the cut library (``distgrad.cut``), so ``[stage]`` names its stage and
    nothing else, and ``[data]`` is optional."""
    _refuse_unknown(source, raw, schema.STAGE_FILE_KEYS, "unknown top-level keys",
                    " (a combined experiment has 'name', [data] and [[stages]] instead)")
    top = _read(source, raw, schema.STAGE_FILE_KEYS, "")
    settings = {**_settings(source, top["interface"], schema.INTERFACE_KEYS, "[interface] "),
                "description": top["description"]}
    names, batch = settings["stages"], settings["batch"]
    cuts = _parse_cuts(source, top["interface"].get("activation"), len(names), batch)
    target = _parse_target(source, top["interface"].get("target"), settings["labels"], batch)
    clients, aggregate = _parties(source, settings, names, "[interface] ")
    spec = _party_stage(source, top, names, own_loop)
    last = spec.name == names[-1] and not own_loop
    try:
        reduction = loss_reduction(spec) if last else settings["reduction"] or "mean"
        if last and settings["reduction"] not in (None, reduction):
            raise ConfigError(f"[interface] 'reduction' is {settings['reduction']!r} but this stage's loss "
                              f"reduces rows by {reduction}")
        steps = _party_steps(settings, spec.data, source)
    except ConfigError as e:
        raise file_error(source, str(e)) from e
    exp = _experiment(settings, raw, source, {}, [spec], names, clients, aggregate, cuts, batch, reduction, steps,
                      target)
    _check_built(exp, source, own_loop)
    return exp


def _party_stage(source: str, top: Mapping[str, Any], names: Sequence[str], own_loop: bool) -> StageSpec:
    """A stage file's ``[stage]``, one of the interface's stages (the last one, and only it, with a 'loss'),
    with the party's own ``[data]`` (of a file kind: only the parts it names)."""
    table = top["stage"]
    if own_loop:
        spec = _own_loop_stage(source, table)
    else:
        spec = _parse_stage(source, table, 0, isinstance(table, dict) and table.get("name") == names[-1],
                            party=True)
    if spec.name not in names:
        raise file_error(source, f"[stage] is {spec.name!r}, which is not one of the interface's stages {names}")
    if not own_loop and (spec.name == names[-1]) != (spec.loss is not None):
        raise file_error(source, f"stage {spec.name!r}: exactly the last stage ({names[-1]!r}) has a 'loss'")
    data = top["data"]
    if data and data.get("kind") in FILE_KINDS:
        data = {"features": None, "labels": None, **data}     # a party holds only the parts it names
    return StageSpec(**{**spec.__dict__, "data": data or {}})


def _party_steps(settings: Mapping[str, Any], data: dict[str, Any] | None, source: str) -> int:
    """A stage file's steps: 'steps', or 'epochs' counted on this party's [data], which must batch as the
    interface says."""
    batch = settings["batch"]
    source_data = build_data(data, settings["seed"], _base_dir(source)) if data else None
    if source_data is not None and getattr(source_data, "batch", None) != batch:
        raise ConfigError(f"[data] gives batches of {getattr(source_data, 'batch', None)} rows, the "
                          f"interface 'batch' is {batch}")
    if source_data is None and settings["epochs"] is not None:
        raise ConfigError("[interface] 'epochs' needs this party's [data] to count the batches of an "
                          "epoch; give 'steps'")
    return _steps(settings, source_data)


def _own_loop_stage(source: str, table: Any) -> StageSpec:
    """The ``[stage]`` of a party training in its own loop: its ``name`` only (its model, optimiser and
    loss are its code's; a key that would configure them is refused rather than ignored)."""
    if not isinstance(table, dict) or not isinstance(table.get("name"), str) or not table["name"]:
        raise file_error(source, "[stage] needs a 'name': the stage this party's own loop computes")
    others = sorted(set(table) - {"name"})
    if others:
        raise file_error(source, f"[stage] has {others}, but this party trains in its own loop (distgrad.cut): "
                                 f"its model, optimiser and loss are its code's, so [stage] takes only 'name'")
    return StageSpec(table["name"], None, {}, base_dir=_base_dir(source), source=source)


def parse_own_loop(raw: Mapping[str, Any], source: str = "<arguments>") -> Experiment:
    """The interface of a party that trains in its own loop through the cut library (``distgrad.cut``): a
    stage-file table (``[interface]``, a ``[stage]`` with only its ``name``, an optional ``[data]``)
    validated like a stage file. Raises ``ConfigError`` naming ``source`` and the problem."""
    return _parse_stage_file(dict(raw), source, own_loop=True)


def _parse_cuts(source: str, value: Any, stage_count: int, batch: int | None) -> tuple[Shape, ...]:
    """``activation``: one table (two stages) or a list of one per cut, each read through
    ``schema.ACTIVATION_KEYS`` with the per-row shape; the whole batch's is ``(batch, *shape)`` (``shape``
    alone when the interface has no batch)."""
    tables = value if isinstance(value, list) else [value]
    if len(tables) != stage_count - 1 or not all(isinstance(t, dict) for t in tables):
        raise file_error(source, f"[interface] 'activation' must be {stage_count - 1} table(s) "
                                 f"{{ shape = [...], dtype = \"float32\" }}, one per cut between the stages, got "
                                 f"{value!r}")
    cuts = []
    for i, table in enumerate(tables):
        where = f"[interface] activation{f' {i + 1}' if len(tables) > 1 else ''}"
        _refuse_unknown(source, table, schema.ACTIVATION_KEYS, f"{where} has unknown keys")
        shape = _read(source, table, schema.ACTIVATION_KEYS, f"{where}: ")["shape"]
        cuts.append(tuple(shape) if batch is None else (batch, *shape))
    return tuple(cuts)


def _parse_target(source: str, value: Any, labels: str, batch: int | None) -> tuple[Shape, str] | None:
    """``target``: with ``labels = "first"`` (and then only), the per-row shape and dtype of the targets
    that travel with the activations (``schema.TARGET_KEYS``), ``{ shape = [], dtype = "int64" }`` for class
    ids."""
    if labels != "first":
        if value is not None:
            raise file_error(source, "[interface] 'target' is for labels = \"first\" (targets that travel)")
        return None
    if not isinstance(value, dict):
        raise file_error(source, f"[interface] labels = \"first\" needs 'target' = {{ shape = [per-row shape], dtype = "
                                 f"\"int64\" or \"float32\" }} (class ids: shape = []), got {value!r}")
    _refuse_unknown(source, value, schema.TARGET_KEYS, "[interface] target has unknown keys")
    target = _read(source, value, schema.TARGET_KEYS, "[interface] target: ")
    shape = tuple(target["shape"])
    return ((batch, *shape) if batch is not None else shape), target["dtype"]


def _check_built(exp: Experiment, source: str, own_loop: bool = False) -> None:
    """Build what this experiment's files define once, so a bad one fails here: every data source (and
    shard), the numpy models against their input shapes and cuts, the optimisers, and the targets
    against the last stage's prediction. ``own_loop``: a party of the cut library may hold no data."""
    try:
        exp.interface_parts()
        check_staleness(exp, exp.staleness)
        check_send_rows(exp)
        check_codecs(exp)
        check_secure_aggregation(exp)
        check_defenses(exp)
        if any(spec.bottom is not None for spec in exp.stages) and not exp.vertical:
            raise ConfigError(f"stage {exp.stage_names[-1]!r}: 'bottom' is the label owner's own bottom model in a "
                              f"vertical experiment (give 'aggregate'); in a chain the first stage holds the features")
        if exp.vertical:
            exp.input_shape(exp.stage_names[-1])         # the parties' embeddings combine
        for spec in exp.stages:
            first, last = spec.name in exp.data_owners, spec.name == exp.stage_names[-1]
            if spec.columns is not None and not first and not (last and spec.bottom is not None):
                raise ConfigError(f"stage {spec.name!r}: 'columns' selects a data owner's feature columns; "
                                  f"this stage receives activations")
            holds_data = bool(exp.data if spec.data is None else spec.data)
            if not holds_data and not own_loop and (first or spec.name == exp.label_owner):
                raise ConfigError(f"stage {spec.name!r} needs a [data] table with its "
                                  f"{'features' if first else 'labels'}")
            if holds_data and not own_loop:
                _check_parts_held(exp, spec)
            if holds_data:
                data = exp.build_data(stage=spec.name)
                if exp.federated and first:
                    # Every owner keeps every count-th row from its own index, so the last owner's shard is
                    # the smallest: it alone tells whether each gets a batch (one build, not one per owner).
                    exp.build_data(client=exp.clients.count - 1, stage=spec.name)
                if first and data.feature_shape is None:
                    raise ConfigError(f"the data owner {spec.name!r} needs features in its [data]")
                if spec.name == exp.label_owner and not data.has_labels:
                    raise ConfigError(f"stage {spec.name!r} holds the labels: its [data] needs labels")
                if spec.name == exp.label_owner and not len(data.test_rows):
                    _check_scored(exp)
                if not len(data.test_rows):
                    _check_plateau_fed(exp)
                if exp.target is not None and first and (tuple(data.target_shape), np.dtype(data.target_dtype).name
                                                         ) != exp.target:
                    raise ConfigError(f"the interface's targets are {exp.target}, but the data gives "
                                      f"{(tuple(data.target_shape), np.dtype(data.target_dtype).name)}")
            if spec.model is None:
                if spec.bottom is not None:        # a module label owner's own bottom takes its own columns
                    exp.bottom_layer(spec.name, exp.seed).output_shape(exp.input_shape(spec.name))
                continue
            model = exp.model(spec.name, exp.seed)
            shape = model.output_shape(exp.input_shape(spec.name))
            if not last and tuple(shape) != exp.output_shape(spec.name):
                raise ConfigError(f"stage {spec.name!r} outputs shape {tuple(shape)}, but the interface says "
                                  f"the activation it sends is {exp.output_shape(spec.name)}")
            build_optimizer(spec.optimizer)
            if last and exp.has_stage(exp.label_owner):
                check_targets(exp, exp.build_data(stage=exp.label_owner), shape)
        numpy_stages = [s for s in exp.stages if s.model is not None]
        Sequential([layer for s in numpy_stages for layer in exp.model(s.name, exp.seed).layers])
    except ConfigError as e:
        raise file_error(source, str(e)) from e


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
                      value_digest(raw, 64), ",".join(exp.source for exp in parts), first.clients,
                      list(first.stage_names),
                      first.cuts, first.batch, first.reduction, first.micro_batches, first.eval_every,
                      first.epochs, first.description, first.target, aggregate=first.aggregate,
                      activation_codec=first.activation_codec, gradient_codec=first.gradient_codec,
                      staleness=first.staleness, send_rows=first.send_rows)


def _parse_clients(source: str, table: Mapping[str, Any] | None, stage_count: int) -> Clients:
    """[clients] (its keys ``schema.CLIENT_KEYS``; absent: one data owner): 'average_every' goes with
    'splitfed' alone, and several data owners share the serving stage of a two-stage experiment."""
    table = table or {}
    _refuse_unknown(source, table, schema.CLIENT_KEYS, "[clients] has unknown keys")
    values = _read(source, table, schema.CLIENT_KEYS, "[clients] ")
    count, mode, every = values["count"], values["mode"], values["average_every"]
    if (mode == "splitfed") != (every > 0):
        raise file_error(source, f"[clients] average_every must be a positive integer with mode = 'splitfed' "
                                 f"(and absent otherwise), got {every!r}")
    if mode == "splitfed" and count < 2:
        raise file_error(source, f"[clients] mode = 'splitfed' averages the first stages of several clients, and "
                                 f"count is {count}: one client's average is its own parameters, unchanged. Give "
                                 f"count >= 2, or leave out mode and average_every")
    if count > 1 and stage_count != 2:
        raise file_error(source, f"several clients share one serving stage: the experiment needs exactly two "
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


