"""The same training, all stages in one process: the reference the wire must match.

It drives the very ``Stage`` objects the daemons use, in the order the
two-process protocol imposes (forward through every stage, the loss, then
each stage's backward and update from the last to the first), with the same
data and seeds. Wherever a tensor would cross the wire, the receiving stage
computes with what the experiment's codec makes of it (``Senders.roundtrip``,
with the sending stage's error feedback), exactly as over the wire. Tests
assert that runs over the wire end bitwise equal to it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import AbstractSet, Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from distgrad.model import aggregate
from distgrad.stage.engine import StepEngine, crossed_direction, crossed_names
from distgrad.config.defended import (attach_dp_sgd, budget_text, check_meter_flag, meter_kind, metered,
                                      privacy_budget, row_defense)
from distgrad.config.experiment import Experiment, check_held_out, check_run_settings, client_stage_name
from distgrad.model.nn import Grads
from distgrad.errors import OutputWriteError
from distgrad.privacy.releases import fresh_secret
from distgrad.run.protocol import evaluation_due
from distgrad.run.metering import Guarding, Metering, PeerMeters, by_owner, step_rows
from distgrad.privacy.meter import INPUTS, LABELS
from distgrad.stage.records import (TraceWriter, best_evaluation_fields, check_trace_filter, ending_fields, evaluation_entry,
                                    evaluation_fields, kept_test_fields, loss_text, scores_text, to_lists,
                                    write_json, write_preparation)
from distgrad.stage.selection import Selection, Verdicts
from distgrad.stage.stage import (Stage, as_of, asked_dx, average_parameters, batch_mixing_of,
                                  check_parameter_files, evaluate_held_out, held_out_part, kept_model, make_save_dir, micro_batch,
                                  parameters_file)
from distgrad.threads import one_compute_thread
from distgrad.wire.messages import LOSS_WITHHELD
from distgrad.wire.wirecodec import ACTIVATION, EVALUATION, GRADIENT, TEST, Senders, stream_name

log = logging.getLogger("distgrad.run.inprocess")


class _TraceLines:
    """The in-process trace: every stage's engine writes its part of a step (``part``); ``flush`` writes
    one line per step, and per client with several, as ``distgrad run`` merges the stages' files."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer
        self.pending: dict[tuple[int, int], dict[str, Any]] = {}

    def part(self, snapshot: bool) -> "_TracePart":
        """A sink for one stage's engine; ``snapshot``: copy its parameters now (a stage that later
        turns change), else read them at ``flush`` (after a SplitFed average, as a driving stage does)."""
        return _TracePart(self, snapshot)

    def flush(self, upto: int | None = None) -> None:
        """Write the lines of every step (up to ``upto``: the steps every stage has applied)."""
        for (step, client), line in sorted(self.pending.items()):
            if upto is not None and step > upto:
                continue
            self.writer.write(step, line["loss"], line["grads"], line["params"],
                              client=None if client < 0 else client)
            del self.pending[(step, client)]


class _TracePart:
    def __init__(self, lines: _TraceLines, snapshot: bool) -> None:
        self.lines, self.snapshot = lines, snapshot

    def wants(self, step: int) -> bool:
        return self.lines.writer.wants(step)

    def write(self, step: int, loss: float | None, grads: Grads, params: Grads, client: int | None = None) -> None:
        line = self.lines.pending.setdefault((step, -1 if client is None else client),
                                             {"loss": None, "grads": {}, "params": {}})
        line["grads"].update(grads)
        line["params"].update({k: v.copy() for k, v in params.items()} if self.snapshot else params)
        if loss is not None:
            line["loss"] = loss


def _engines(stages: list[Stage], exp: Experiment, lines: _TraceLines, shared_last: bool, seed: int,
             copied: bool = False, client: int | None = None, steps: int | None = None,
             secret: int | None = None) -> list[StepEngine]:
    """A step engine per stage, each writing its part of the trace and encoding what its stage sends (its
    defenses of run ``seed``, the experiment's codecs); the last sends ``activation_grad``. ``copied``: every
    part copies its parameters when written (stages that run ahead of the line's flush). ``client``: the
    first stage is that data owner's copy. ``steps``: the run's (a target budget's sigma is chosen for
    them); ``secret``: the noise secret every defense draws from (None: a fresh one per stage)."""
    scale = exp.micro_batch_scale
    engines = [StepEngine(stage, scale, lines.part(snapshot=copied or (shared_last and stage is stages[-1])),
                       trace_sent=stage is stages[-1] and len(stages) > 1,
                       trace_crossed=crossed_direction(exp, i == 0 or stage.name in exp.data_owners,
                                                       stage is stages[-1]),
                       crossed_names=crossed_names(exp, stage.name),
                       senders=Senders(exp.codecs, row_defense(exp, stage.name, seed,
                                                                   client_stage_name(stage.name, client)
                                                                   if i == 0 else stage.name, steps, secret)))
               for i, stage in enumerate(stages)]
    for engine in engines:
        attach_dp_sgd(exp, engine.stage, engine.senders.defense)       # the label owner's DP-SGD
    return engines


def _step(engines: list[StepEngine], step: int, features: np.ndarray, targets: np.ndarray, micro_batches: int,
          client: int | None = None) -> float | None:
    """One step through the stages of ``engines`` in the protocol's order: every micro-batch forward and
    back, then the updates from the last stage up (the order the stages apply them over the wire);
    returns the step's loss. Each tensor that would cross is coded where it would (``_cross``)."""
    rows = [micro_batch(features, i, micro_batches) for i in range(micro_batches)]
    if len(engines) == 1:
        return _below(engines, step, rows, targets, micro_batches, client, above=False)[0]
    first = engines[0]
    outputs = [first.stage.forward(x, i) for i, x in enumerate(rows)]
    sent = [_cross(first, ACTIVATION, y, i, micro_batches, step) for i, (y, _) in enumerate(outputs)]
    loss, dys = _below(engines[1:], step, sent, targets, micro_batches, client)
    first.apply_step(step, micro_batches, ((first.stage.backward(cache, dy, need_dx=False)[1], None)
                                           for (_, cache), dy in zip(outputs, dys)), client=client)
    return loss


def _ledgers(engines: list[StepEngine]) -> dict[str, Any]:
    """The noise ledger of each stage that has one (its held-out rows' releases, ``privacy_budget``)."""
    return {engine.stage.name: engine.senders.defense.ledger for engine in engines
            if engine.senders.defense is not None}


def _worst_rows(engines: list[StepEngine]) -> dict[str, int]:
    """The worst row's count of releases of each stage whose defense counts them (its ledger)."""
    return {engine.stage.name: engine.senders.defense.ledger.worst for engine in engines
            if engine.senders.defense is not None}


def _cross(engine: StepEngine, direction: str, x: np.ndarray, mb: int, micro_batches: int, step: int,
           peer: str = "") -> np.ndarray:
    """What the receiving stage computes with for ``x``, sent by ``engine``'s stage on the stream the stage
    processes use (``stream_name``), with that stage's error feedback."""
    return engine.senders.roundtrip(direction, x, stream_name(direction, mb, micro_batches, peer), step)


def _below(engines: list[StepEngine], step: int, ys: list[np.ndarray], targets: np.ndarray, micro_batches: int,
           client: int | None = None, above: bool = True) -> tuple[float | None, list[np.ndarray]]:
    """Step ``step`` through the stages below the first (``engines``), as they serve it: each micro-batch's
    input ``ys[i]`` forward, the loss, back to the activation gradient the stage above receives; then their
    updates from the last up. Returns the step's loss as the stage above receives it (None: the label owner
    withholds it, ``Senders.sent_loss``, as its replies do) and those gradients. ``client``: whose step it is,
    when the last stage serves several data owners; ``above`` False: ``engines`` are a one-stage
    experiment's, whose input gradient goes nowhere."""
    *middle, last = [engine.stage for engine in engines]
    peer = "" if client is None else f"client{client}"      # the serving stage's name for the stream
    dys = []
    for i, x in enumerate(ys):
        caches = []
        for engine, stage in zip(engines, middle):
            y, cache = stage.forward(x, i)
            caches.append(cache)
            x = _cross(engine, ACTIVATION, y, i, micro_batches, step)
        mb_loss, dx, grads = last.loss_micro_batch(x, micro_batch(targets, i, micro_batches), i)
        last.check_finite("loss", mb_loss, step)
        if above or middle:
            last.check_finite("activation_grad", dx, step)
        engines[-1].add(i, micro_batches, grads, mb_loss, dx)
        dy = _cross(engines[-1], GRADIENT, dx, i, micro_batches, step, peer) if above or middle else dx
        for engine, stage, cache in zip(reversed(engines[:-1]), reversed(middle), reversed(caches)):
            dx_or_none, grads = stage.backward(cache, dy)
            dx = asked_dx(stage.name, dx_or_none)
            stage.check_finite("activation_grad", dx, step)
            engine.add(i, micro_batches, grads)
            dy = _cross(engine, GRADIENT, dx, i, micro_batches, step)
        dys.append(dy)
    loss = None
    for engine in reversed(engines):
        done = engine.update(step, micro_batches, client=client)
        loss = done if engine is engines[-1] else loss
    return (engines[-1].senders.sent_loss(loss) if above or middle else loss), dys


class _InFlight:
    """The first stage with S steps in flight (staleness), as ``driver._Driver`` runs it: the forward of step
    t with its parameters after update t-1-S, its backward of step t (with the parameters and activations of
    that forward) and its update once the forward of step t+S has been sent. The stages below never are
    stale: they take each step whole when its forward comes."""

    def __init__(self, engine: StepEngine, below: list[StepEngine], staleness: int, micro_batches: int) -> None:
        self.engine, self.below, self.depth, self.micro_batches = engine, below, staleness, micro_batches
        self.history: dict[int, dict[str, np.ndarray]] = {}       # parameters after update u
        self.sent: dict[int, tuple[int, list[Any], list[np.ndarray]]] = {}   # step -> (version, caches, dys)

    def send(self, step: int, features: np.ndarray, targets: np.ndarray) -> float | None:
        """Step ``step``'s forward (the live parameters are those after update step-1-S) and the stages
        below it; returns the step's loss."""
        stage, count = self.engine.stage, self.micro_batches
        with as_of(stage, None, step):            # dropout masks of step ``step``
            outputs = [stage.forward(micro_batch(features, i, count), i) for i in range(count)]
        sent = [_cross(self.engine, ACTIVATION, y, i, count, step) for i, (y, _) in enumerate(outputs)]
        loss, dys = _below(self.below, step, sent, targets, count)
        self.sent[step] = (step - 1 - self.depth, [cache for _, cache in outputs], dys)
        return loss

    def complete(self, step: int) -> None:
        """Step ``step``'s backward with its forward's parameters, then its update."""
        stage, count = self.engine.stage, self.micro_batches
        version, caches, dys = self.sent.pop(step)
        version = max(version, 0)
        params = stage.params
        with as_of(stage, self.history[version] if version != stage.step else None, step):
            for i in range(count):
                _, grads = stage.backward(caches[i], dys[i], need_dx=False)
                self.engine.add(i, count, grads)
        self.history[stage.step] = {name: value.copy() for name, value in params.items()}
        for old in [u for u in self.history if u < stage.step + 1 - self.depth]:
            del self.history[old]
        self.engine.update(step, count)


def _vertical_step(parties: list[StepEngine], last: StepEngine, exp: Experiment, step: int,
                   features: list[np.ndarray], own: np.ndarray | None, targets: np.ndarray,
                   micro_batches: int) -> float | None:
    """One step of a vertical experiment in the serving stage's order: per micro-batch, every party's
    forward (party order), the combined input, the loss, and each party's backward of its own part of the
    input's gradient; then the last stage's update and the parties'. ``own``: the label owner's own feature
    columns (``Experiment.own_bottom``), else None. Returns the step's loss as the parties receive it (None:
    the label owner withholds it, ``Senders.sent_loss``)."""
    kind = exp.aggregate_kind
    widths = [cut[-1] for cut in exp.cuts]
    stage = last.stage
    names = exp.stage_names[:-1]
    for i in range(micro_batches):
        outputs = [engine.stage.forward(micro_batch(x, i, micro_batches), i) for engine, x in zip(parties, features)]
        z = aggregate.join_input([_cross(engine, ACTIVATION, y, i, micro_batches, step)
                                  for engine, (y, _) in zip(parties, outputs)],
                                 None if own is None else micro_batch(own, i, micro_batches), kind,
                                 exp.secure_aggregation)
        mb_loss, dz, grads = stage.loss_micro_batch(z, micro_batch(targets, i, micro_batches), i)
        stage.check_finite("loss", mb_loss, step)
        stage.check_finite("activation_grad", dz, step)
        last.add(i, micro_batches, grads, mb_loss, dz)
        for engine, name, (_, cache), dy in zip(parties, names, outputs,
                                                    aggregate.split_input(dz, own is not None, kind, widths)):
            dy = _cross(last, GRADIENT, dy, i, micro_batches, step, name)
            _, party_grads = engine.stage.backward(cache, dy, need_dx=False)
            engine.add(i, micro_batches, party_grads)
    loss = last.update(step, micro_batches)
    for engine in parties:
        engine.update(step, micro_batches)
    return last.senders.sent_loss(loss)


def _evaluate_vertical(parties: list[Stage], last: Stage, exp: Experiment, data: list, labels,
                       step: int, senders: list[Senders], final: bool = False) -> dict[str, Any]:
    """Every party's held-out rows forward (each crossing as its ``senders`` entry's ``evaluation_roundtrip``
    makes it, with the party's defenses, as the evaluation message after ``step`` carries it), combined,
    scored by the last stage; with a validation split the validation rows, or the test rows when ``final``
    (``held_out_part``)."""
    part, _ = held_out_part(labels.validation_count, final)
    purpose = TEST if final else EVALUATION
    z = aggregate.join_input([sent.evaluation_roundtrip(party.forward(d.test_features()[part], training=False)[0],
                                                        step + 1, purpose)
                              for party, d, sent in zip(parties, data, senders)],
                             labels.test_features()[part] if exp.own_bottom else None, exp.aggregate_kind,
                             exp.secure_aggregation)
    return evaluate_held_out(last, z, labels.test_targets(), exp.spec(exp.stage_names[-1]).metrics,
                             labels.validation_count, final)


class _ParameterFiles:
    """``--load`` / ``--save`` of every stage of an in-process run, named as ``distgrad run`` names them."""

    def __init__(self, exp: Experiment, save_dir: str | Path | None, load_dir: str | Path | None,
                 init: bool, seed: int) -> None:
        self.exp, self.save_dir, self.load_dir, self.seed = exp, save_dir, load_dir, seed
        make_save_dir(save_dir)
        for instance, stage in self._instances():
            check_parameter_files(self._path(save_dir, instance, stage), self._path(load_dir, instance, stage), init)

    def _instances(self) -> list[tuple[str, str]]:
        first, *rest = self.exp.stage_names
        clients = range(self.exp.clients.count) if self.exp.federated else [None]
        return [(client_stage_name(first, c), first) for c in clients] + [(name, name) for name in rest]

    def _path(self, directory: str | Path | None, instance: str, stage: str) -> Path | None:
        return None if directory is None else parameters_file(directory, instance, self.exp, stage)

    def loaded(self, built: Stage, stage: str, client: int | None = None) -> Stage:
        path = self._path(self.load_dir, client_stage_name(stage, client), stage)
        if path is not None:
            built.load_parameters(path)
        return built

    def save(self, built: Stage, stage: str, client: int | None = None) -> None:
        """Write the stage's parameters and, beside them, its data preparation statistics (as a stage
        process does: ``records.write_preparation``)."""
        path = self._path(self.save_dir, client_stage_name(stage, client), stage)
        if path is not None:
            built.save_parameters(path)
            write_preparation(path, self.exp.preparation(self.seed, client, stage))


def _evaluate(upstream: list[Stage], last: Stage, data, labels, senders: list[Senders], step: int,
              metrics: Sequence[str], final: bool = False) -> dict[str, Any]:
    """The held-out rows forward through every stage, scored by the last (``Stage.evaluate_last``); each
    activation crosses as its stage's ``senders`` entry's ``evaluation_roundtrip`` makes it (the data owner's
    defenses, no error feedback: an evaluation changes nothing), as the evaluation message after ``step``
    carries it; ``metrics``: the scores besides the loss. With a validation split the validation rows, or the
    test rows when ``final`` (``held_out_part``)."""
    part, _ = held_out_part(labels.validation_count, final)
    x = data.test_features()[part]
    for stage, sent in zip(upstream, senders, strict=True):
        x, _ = stage.forward(x, training=False)
        x = sent.evaluation_roundtrip(x, step + 1, TEST if final else EVALUATION)
    return evaluate_held_out(last, x, labels.test_targets(), metrics, labels.validation_count, final)


def _labelled(exp: Experiment, data: Any, labels: Any, step: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Step ``step``'s targets, and the active label owner's own feature columns (else None): with
    ``send_rows``, those of the rows the data owner ``data`` trains on (as the label owner takes them from
    each forward's ``rows``); else the label owner's ``labels`` in its own sample order."""
    if not exp.send_rows:
        return labels.targets(step), labels.features(step) if exp.own_bottom else None
    rows = data.step_rows(step)
    return labels.targets_at(rows), labels.features_at(rows) if exp.own_bottom else None


class _Federation:
    """Several data owners (clients) against one serving stage, as ``_train_federated`` runs them: each
    client's copy of the first stage, the one last stage, their engines (a pair per client, sharing the last),
    each client's data and labels, the meters, and each client's loss and evaluations so far."""

    def __init__(self, exp: Experiment, steps: int, seed: int, init: Mapping[str, float] | None,
                 lines: _TraceLines, files: _ParameterFiles, eval_every: int, noise_secret: int | None,
                 privacy_meter: bool) -> None:
        self.exp, self.steps, self.seed, self.files = exp, steps, seed, files
        first_name, last_name = self.names = exp.stage_names
        self.clients = clients = [files.loaded(Stage.from_experiment(exp, first_name, seed, init), first_name, c)
                                  for c in range(exp.clients.count)]
        self.last = files.loaded(Stage.from_experiment(exp, last_name, seed, init), last_name)
        self.last_engine = last_engine = _engines([clients[0], self.last], exp, lines, shared_last=True,
                                                  seed=seed, steps=steps, secret=noise_secret)[1]
        self.pairs = pairs = [[_engines([client, self.last], exp, lines, shared_last=True, seed=seed, client=c,
                                        steps=steps, secret=noise_secret)[0], last_engine]
                              for c, client in enumerate(clients)]
        self.data = data = [exp.build_data(seed, client=c, stage=first_name) for c in range(exp.clients.count)]
        for c, source in enumerate(data):
            _holds_out(client_stage_name(first_name, c), source, eval_every)
        self.labels = labels = [exp.build_data(seed, client=c, stage=exp.label_owner)
                                for c in range(exp.clients.count)]
        # Each client's own meter and guard, and the label owner's meter of each client (as the processes run
        # them: a client's windows follow its own evaluations; the label owner's, those its hellos announce).
        self.owned = [_OwnerMeters(exp, first_name, pair[0], data[c], eval_every if len(data[c].test_rows) else 0,
                                   steps, privacy_meter, c) for c, pair in enumerate(pairs)]
        self.peer_meters = _peer_meters(exp, last_engine, [pair[0] for pair in pairs],
                                        [f"client{c}" for c in range(len(pairs))], labels,
                                        eval_every if len(data[-1].test_rows) else 0, steps, privacy_meter, True)
        self.losses: list[float | None] = [None] * len(clients)
        self.evaluations: list[list[dict[str, Any]]] = [[] for _ in clients]
        self.scores: list[dict[str, Any] | None] = [None] * len(clients)
        self.tests: list[dict[str, Any] | None] = [None] * len(clients)    # validation split: the final ones

    def step(self, step: int, micro_batches: int) -> None:
        """Step ``step`` of client 0, 1, ... in turn (its forward, the serving stage's update, its own update);
        with ``splitfed``, after every ``average_every`` steps each client's first-stage parameters become
        their mean."""
        exp, clients = self.exp, self.clients
        for c, engines in enumerate(self.pairs):
            self.losses[c] = _step(engines, step, self.data[c].features(step),
                                   _labelled(exp, self.data[c], self.labels[c], step)[0], micro_batches, c)
        if exp.clients.mode == "splitfed" and step % exp.clients.average_every == 0:
            mean = average_parameters([client.params for client in clients])
            for client in clients:
                for name, value in mean.items():
                    client.params[name][...] = value

    def evaluate(self, step: int) -> None:
        """Each client holding out rows scored after ``step`` with the serving stage of that step."""
        for c, client in enumerate(self.clients):
            if len(self.data[c].test_rows):
                self.scores[c] = score = _evaluate([client], self.last, self.data[c], self.labels[c],
                                                   [self.pairs[c][0].senders], step,
                                                   self.exp.spec(self.names[1]).metrics)
                self.evaluations[c].append(evaluation_entry(step, score))

    def evaluate_test(self) -> None:
        """The test rows, once, after every step: each client's own (with a validation split only)."""
        for c, client in enumerate(self.clients):
            if self.data[c].validation_count:
                self.tests[c] = {**_evaluate([client], self.last, self.data[c], self.labels[c],
                                             [self.pairs[c][0].senders], self.steps,
                                             self.exp.spec(self.names[1]).metrics, final=True), "step": self.steps}

    def save(self) -> None:
        """Every client's first stage, then the last stage, to their parameter files (``_ParameterFiles``)."""
        first_name, last_name = self.names
        for c, client in enumerate(self.clients):
            self.files.save(client, first_name, c)
        self.files.save(self.last, last_name)

    def client_entries(self) -> list[dict[str, Any]]:
        """Each client's part of the summary: the shape of the launcher's merged summary
        (``records.merge_client_summaries``), with no run ids in one process."""
        per_client = []
        for c in range(len(self.clients)):
            entry: dict[str, Any] = {"client": c, "run_id": None, "steps": self.steps, "final_loss": self.losses[c],
                                     "status": "completed"}
            if len(self.data[c].test_rows):
                entry.update(evaluation_fields(self.scores[c]), **kept_test_fields(self.tests[c]),
                             evaluations=self.evaluations[c])
            per_client.append(entry)
        return per_client

    def summary(self, micro_batches: int, started: float, cpu_started: float) -> dict[str, Any]:
        """The run's summary (``train_in_process`` says what it holds), timed from ``started``
        (``time.perf_counter``) and ``cpu_started`` (``time.process_time``)."""
        exp, steps = self.exp, self.steps
        return {
            "experiment": exp.name, "steps": steps, "seed": self.seed, "micro_batches": micro_batches,
            "elapsed_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started,
            "status": "completed", "mode": "in-process", "transport": None,
            "clients": self.client_entries(),
            **privacy_budget(exp, exp.stage_names, steps, self.seed, _worst_rows([self.last_engine]),
                             held_out=_ledgers([self.pairs[0][0]]),      # every client evaluates as often
                             mixing=batch_mixing_of([self.last_engine.stage])),
            **owners_fields(self.owned, self.peer_meters),
            "params": self.params(),
        }

    def params(self) -> dict[str, Any]:
        """Every client's first stage's parameters (``f@K``) and the last stage's, for the summary."""
        first_name, last_name = self.names
        return {**{client_stage_name(first_name, c): to_lists(s.params) for c, s in enumerate(self.clients)},
                last_name: to_lists(self.last.params)}


def _train_federated(exp: Experiment, steps: int, seed: int, init: Mapping[str, float] | None,
                     summary_path: str | Path | None, micro_batches: int, lines: _TraceLines,
                     files: _ParameterFiles, eval_every: int, noise_secret: int | None = None,
                     privacy_meter: bool = False, check_stop: Callable[[], None] | None = None) -> dict[str, Any]:
    """Several data owners against one serving stage, in the order the serving stage applies them.

    Every step, client 0, 1, ... in turn: its forward, the serving stage's
    update, its own update. With ``splitfed``, after every ``average_every``
    steps each client's first-stage parameters become their mean. After
    every ``eval_every``-th step (after the average) and the last, each
    client holding out rows is scored with the serving stage of that step.
    """
    run = _Federation(exp, steps, seed, init, lines, files, eval_every, noise_secret, privacy_meter)
    started, cpu_started = time.perf_counter(), time.process_time()
    done = 0
    try:
        for step in range(1, steps + 1):
            run.step(step, micro_batches)
            done = step
            lines.flush()
            if check_stop is not None:
                check_stop()            # a signal between rounds: the run ends here, its summary says so
            if evaluation_due(step, steps, eval_every):
                run.evaluate(step)
            if step % max(1, steps // 10) == 0 or step == steps:
                log.info("step %d/%d losses %s", step, steps, " ".join(loss_text(loss) for loss in run.losses))
        run.evaluate_test()
    except BaseException as e:      # the summary still says how the run ended (as ``_Reference.write_ended``)
        write_ended(summary_path, {
            "experiment": exp.name, "steps": done, "seed": seed, "micro_batches": micro_batches,
            "elapsed_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started,
            "mode": "in-process", "clients": [{"client": c, "steps": done, "final_loss": loss if done else None}
                                              for c, loss in enumerate(run.losses)],
            "params": run.params()}, e)
        raise
    run.save()
    summary = run.summary(micro_batches, started, cpu_started)
    if summary_path is not None:
        write_json(summary_path, summary)
    return summary


def write_ended(summary_path: str | Path | None, summary: dict[str, Any], error: BaseException) -> None:
    """``summary`` of a run that ended on ``error``, with its ``status`` and ``error`` (``records.ending_fields``),
    written to ``summary_path`` when given. Best effort: ``error`` is what the run ends with, so a write that
    fails is only logged."""
    if summary_path is None:
        return
    try:
        write_json(summary_path, {**summary, **ending_fields(error)})
    except OutputWriteError as e:
        log.error("the summary of the run that ended could not be written: %s", e)


def _holds_out(stage: str, data: Any, eval_every: int) -> bool:
    """Whether data owner ``stage``'s ``data`` holds out rows to evaluate; evaluations every ``eval_every``
    steps of none are said at WARNING (``check_held_out``), as the stage's process says them."""
    check_held_out(stage, eval_every, len(data.test_rows))
    return len(data.test_rows) > 0


class _OwnerMeters:
    """A data owner's own meter and guard in a run of several data owners (a feature party ``stage``, or
    client ``client``'s copy of the first stage), on its ``engine`` and its own ``data``, as its stage
    process runs them (``driver._Driver``)."""

    def __init__(self, exp: Experiment, stage: str, engine: StepEngine, data: Any, window: int, steps: int,
                 privacy_meter: bool, client: int | None = None) -> None:
        self.name = client_stage_name(stage, client)
        self.metering = (Metering(INPUTS, engine, data.features, window, steps, rows_of=step_rows(data))
                         if metered(exp, stage, privacy_meter) else None)
        max_r2 = exp.spec(stage).input_guard if exp.has_stage(stage) else None
        self.guarding = (Guarding(engine, data.features, max_r2, self.name, rows_of=step_rows(data))
                         if max_r2 is not None else None)

    def summary_fields(self) -> dict[str, Any]:
        return {**(self.metering.summary_fields() if self.metering else {}),
                **(self.guarding.summary_fields() if self.guarding else {})}


def _peer_meters(exp: Experiment, last: StepEngine, owners: list[StepEngine], streams: list[str], labels: list[Any],
                 window: int, steps: int, privacy_meter: bool, clients: bool) -> PeerMeters | None:
    """The label owner's meter of each data owner (``owners``' engines, whose sends it reads for model
    completion; ``streams``: the peer part of the streams it answers each on), when it is metered."""
    name = exp.stage_names[-1]
    if not metered(exp, name, privacy_meter):
        return None
    first = exp.stage_names[0]
    names = [client_stage_name(first, c) for c in range(len(owners))] if clients else list(exp.data_owners)
    meters = PeerMeters(last, names, streams, [source.true_targets for source in labels],
                        [step_rows(source) for source in labels], window, steps, clients=clients)
    for index, engine in enumerate(owners):
        if not exp.secure_aggregation:      # masked, a party's embedding reaches no one alone
            meters.tap_received(engine.senders, index)
    return meters


def owners_fields(owned: list[_OwnerMeters], peer_meters: PeerMeters | None) -> dict[str, Any]:
    """The summary's ``input_meters`` (each data owner's own) and ``label_meters`` (the label owner's of
    each), as the merged summary of the stage processes holds them."""
    fields: dict[str, Any] = {}
    for owner in owned:
        for key, value in by_owner(INPUTS, owner.name, owner.summary_fields()).items():
            fields.setdefault(key, {}).update(value)
    return {**fields, **(peer_meters.summary_fields() if peer_meters is not None else {})}


class _Reference:
    """The stages of an experiment with one data owner (or vertical parties) in this process, stepped and
    evaluated as the stage processes of ``distgrad run`` step and evaluate them: ``train`` runs the steps
    (``applied``) and scores the held-out rows when due (``evaluate``), ``save`` writes the parameters,
    ``summary`` is what ``train_in_process`` returns (``finish``: both, and the summary written). The settings
    are checked by the caller."""

    applied_steps = 0                                   # the steps every stage has applied so far
    check_stop: Callable[[], None] | None = None        # may raise to end the run between steps

    def __init__(self, exp: Experiment, steps: int, seed: int, init: Mapping[str, float] | None,
                 files: _ParameterFiles, lines: _TraceLines, micro_batches: int, staleness: int, eval_every: int,
                 privacy_meter: bool, noise_secret: int | None = None) -> None:
        self.exp, self.steps, self.seed, self.files, self.lines = exp, steps, seed, files, lines
        self.micro_batches, self.staleness, self.eval_every = micro_batches, staleness, eval_every
        self.stages = [files.loaded(Stage.from_experiment(exp, name, seed, init), name) for name in exp.stage_names]
        # With steps in flight the stages below run ahead of the first: their trace parts are copied when
        # written, and a step's line is written once the first stage has applied it.
        self.engines = _engines(self.stages, exp, lines, shared_last=False, seed=seed, copied=bool(staleness),
                                steps=steps, secret=noise_secret)
        self.in_flight = (_InFlight(self.engines[0], self.engines[1:], staleness, micro_batches) if staleness
                          else None)
        self.owners = [exp.build_data(seed, stage=name) for name in exp.data_owners]
        self.data = self.owners[0]
        self.labels = exp.build_data(seed, stage=exp.label_owner)
        self.holds_out = _holds_out(exp.data_owners[0], self.data, eval_every)
        window = eval_every if self.holds_out else 0
        if exp.vertical:        # each party's own meter and guard; the label owner's meter of each party
            parties = self.engines[:-1]
            self.owned = [_OwnerMeters(exp, name, engine, data, window, steps, privacy_meter)
                          for name, engine, data in zip(exp.data_owners, parties, self.owners)]
            self.peer_meters = _peer_meters(exp, self.engines[-1], parties, exp.data_owners,
                                            [self.labels] * len(parties), window, steps, privacy_meter, False)
            self.meters: list[Metering] = []
            self.guarding: Guarding | None = None
        else:
            self.owned, self.peer_meters = [], None
            self.meters = [Metering(meter_kind(exp, stage.name), engine,
                                    self.labels.true_targets if stage is self.stages[-1] else self.data.features,
                                    window, steps,
                                    rows_of=step_rows(self.labels if stage is self.stages[-1] else self.data))
                           for stage, engine in zip(self.stages, self.engines)
                           if metered(exp, stage.name, privacy_meter)]
            max_r2 = exp.spec(exp.stage_names[0]).input_guard if exp.has_stage(exp.stage_names[0]) else None
            self.guarding = (Guarding(self.engines[0], self.data.features, max_r2, exp.stage_names[0],
                                      rows_of=step_rows(self.data))
                             if max_r2 is not None else None)
            for metering in self.meters:
                if metering.kind == LABELS:     # model completion: what the label owner receives
                    metering.tap_received(self.engines[-2].senders)
        self.spec = exp.spec(exp.stage_names[-1])
        self.selection, self.verdicts = Selection(self.spec.keep_best, self.spec.early_stopping), Verdicts()
        self.loss: float | None = None
        self.evaluation: dict[str, Any] | None = None
        self.evaluations: list[dict[str, Any]] = []
        # With a validation split: every stage's kept model (keep_best's copy of its parameters and forward state
        # at the best evaluation), and the final evaluation of the test rows with it (``evaluate_test``).
        self.kept: list[dict[str, dict[str, np.ndarray]]] | None = None
        self.test: dict[str, Any] | None = None
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def applied(self) -> Iterator[int]:
        """Run the steps, yielding each once every stage has applied it (``loss``: its loss). With S steps
        in flight the first stage sends the forward of step t+S before its backward and update of step t,
        as the driver does."""
        exp, data, labels, steps, depth = self.exp, self.data, self.labels, self.steps, self.staleness
        losses: dict[int, float | None] = {}
        for step in range(1, steps + 1 if self.in_flight is None else steps + depth + 1):
            if self.in_flight is not None:
                if step <= steps:
                    losses[step] = self.in_flight.send(step, data.features(step),
                                                       _labelled(exp, data, labels, step)[0])
                step -= depth
                if step < 1:
                    continue
                self.in_flight.complete(step)
                self.loss = losses.pop(step)
            elif exp.vertical:
                targets, own = _labelled(exp, data, labels, step)
                self.loss = _vertical_step(self.engines[:-1], self.engines[-1], exp, step,
                                           [d.features(step) for d in self.owners], own, targets, self.micro_batches)
            else:
                self.loss = _step(self.engines, step, data.features(step), _labelled(exp, data, labels, step)[0],
                                  self.micro_batches)
            self.applied_steps = step
            yield step

    def train(self) -> None:
        """Every step, each step's trace line and log line, and the evaluations when due; early stopping
        ends the run at the step it judges (``steps`` becomes that step)."""
        log_every = max(1, self.steps // 10)
        self.started, self.cpu_started = time.perf_counter(), time.process_time()
        for step in self.applied():
            self.lines.flush(upto=step)
            if self.check_stop is not None:
                self.check_stop()           # a signal between steps: Interrupted, the run's summary says so
            if step % log_every == 0 or step == self.steps:
                log.info("step %d/%d loss %s", step, self.steps, loss_text(self.loss))
            if self.holds_out and evaluation_due(step, self.steps, self.eval_every) and self.evaluate(step):
                log.info("early stopping after step %d", step)
                self.steps = step
                break

    def evaluate(self, step: int) -> bool:
        """Score the held-out rows after ``step`` (with keep_best, a new best step's parameters are saved);
        True when early stopping ends the run there."""
        exp, (*upstream, last) = self.exp, self.stages
        senders = [engine.senders for engine in self.engines[:-1]]
        self.evaluation = (_evaluate_vertical(upstream, last, exp, self.owners, self.labels, step, senders)
                           if exp.vertical else _evaluate(upstream, last, self.data, self.labels, senders, step,
                                                          self.spec.metrics))
        self.evaluations.append(evaluation_entry(step, self.evaluation))
        for stage in self.stages:           # ReduceLROnPlateau steps on the loss, before the next update
            stage.evaluated(self.evaluation["loss"])
        log.info("step %d: %s loss %.6g%s", step, "validation" if self.labels.validation_count else "test",
                 self.evaluation["loss"], scores_text(self.evaluations[-1]))
        if not self.selection.active:
            return False
        verdict = self.selection.judge(step, evaluation_fields(self.evaluation), step == self.steps)
        if self.verdicts.note(step, verdict):
            self.save_all()                 # keep_best: --save writes every stage's of this step
            if self.labels.validation_count:
                self.kept = [{"params": {name: value.copy() for name, value in stage.params.items()},
                              "state": stage.forward_state()} for stage in self.stages]
        return bool(verdict.get("stop"))

    def evaluate_test(self) -> None:
        """With a validation split, after the last step (or the early stop): the test rows, once, through every
        stage with its kept model (keep_best's, else the live one), as the final evaluation message carries them."""
        if not (self.holds_out and self.labels.validation_count):
            return
        exp, (*upstream, last), step = self.exp, self.stages, self.steps
        senders = [engine.senders for engine in self.engines[:-1]]
        kept = self.kept if self.kept is not None and self.verdicts.best_step else [None] * len(self.stages)
        with contextlib.ExitStack() as models:
            for stage, model in zip(self.stages, kept):
                models.enter_context(kept_model(stage, model))
            result = (_evaluate_vertical(upstream, last, exp, self.owners, self.labels, step, senders, final=True)
                      if exp.vertical else _evaluate(upstream, last, self.data, self.labels, senders, step,
                                                     self.spec.metrics, final=True))
        self.test = {**result, "step": self.verdicts.best_step if self.kept is not None and self.verdicts.best_step
                     else step}
        log.info("the kept model, after step %d, on %d test rows: test loss %.6g%s", self.test["step"],
                 result["count"], result["loss"], scores_text(kept_test_fields(self.test)))

    def save_all(self) -> None:
        for stage in self.stages:
            self.files.save(stage, stage.name)

    def save(self) -> None:
        """After the run: every stage's parameters (unless keep_best saved those of the best step)."""
        if not (self.spec.keep_best and self.verdicts.best_step):
            self.save_all()

    def finish(self, summary_path: str | Path | None) -> dict[str, Any]:
        """After the run: the parameters saved (``save``), the privacy budget logged, and the summary returned
        and written to ``summary_path`` when given."""
        self.save()
        summary = self.summary()
        if "privacy" in summary:
            log.info("privacy after %d steps: %s", self.steps, budget_text(summary["privacy"]))
        if summary_path is not None:
            write_json(summary_path, summary)
        return summary

    def write_ended(self, summary_path: str | Path | None, error: BaseException) -> None:
        """The summary of a run that ended on ``error`` before its last step, written to ``summary_path`` (when
        given): the steps every stage applied, the last one's loss, the evaluations taken and the parameters,
        with ``status`` and ``error`` (``records.ending_fields``); no privacy figures (the run did not end
        as planned). Best effort: ``error`` is what the run ends with, so a write that fails is only logged."""
        write_ended(summary_path, {
            "experiment": self.exp.name, "steps": self.applied_steps, "seed": self.seed,
            "micro_batches": self.micro_batches,
            "final_loss": float(self.loss) if self.loss is not None and self.applied_steps else None,
            "elapsed_s": time.perf_counter() - self.started, "cpu_s": time.process_time() - self.cpu_started,
            "mode": "in-process", **({"evaluations": self.evaluations} if self.holds_out else {}),
            "params": {s.name: to_lists(s.params) for s in self.stages},
        }, error)

    def summary(self) -> dict[str, Any]:
        """The run's summary (``train_in_process`` says what it holds)."""
        exp, steps, evaluations = self.exp, self.steps, self.evaluations
        return {
            "experiment": exp.name,
            "steps": steps,
            "seed": self.seed,
            "micro_batches": self.micro_batches,
            "final_loss": float(self.loss) if self.loss is not None else None,
            # as the data owner's summary says it: the label owner's replies carry no loss (``Senders.sent_loss``)
            **({"training_loss": LOSS_WITHHELD} if self.engines[-1].senders.withholds_loss else {}),
            "elapsed_s": time.perf_counter() - self.started,
            "cpu_s": time.process_time() - self.cpu_started,
            "mode": "in-process",
            "status": "completed",      # as a run in processes says it (one that ends early: ``write_ended``)
            **evaluation_fields(self.evaluation),
            **({"evaluations": evaluations} if self.holds_out else {}),
            **self.verdicts.summary(),
            **best_evaluation_fields(evaluations, self.verdicts.best_step),
            **kept_test_fields(self.test),
            **privacy_budget(exp, exp.stage_names, steps, self.seed, _worst_rows(self.engines),
                             held_out=_ledgers(self.engines), mixing=batch_mixing_of(self.stages)),
            **{key: value for metering in self.meters for key, value in metering.summary_fields().items()},
            **(self.guarding.summary_fields() if self.guarding else {}),
            **owners_fields(self.owned, self.peer_meters),
            "params": {s.name: to_lists(s.params) for s in self.stages},
        }


@one_compute_thread()
def train_in_process(exp: Experiment, steps: int | None = None, seed: int | None = None,
                     init: Mapping[str, float] | None = None, summary_path: str | Path | None = None,
                     trace_path: str | Path | None = None, micro_batches: int = 1,
                     trace_params: AbstractSet[str] | None = None, trace_every: int = 1, eval_every: int | None = None,
                     save_dir: str | Path | None = None, load_dir: str | Path | None = None, staleness: int | None = None,
                     privacy_meter: bool = False, noise_secret: int | None = None,
                     check_stop: Callable[[], None] | None = None) -> dict[str, Any]:
    """Train every stage of ``exp`` in this process and return the summary dict.

    With ``micro_batches`` M, each batch is split into M equal micro-batches
    whose gradients every stage sums in order 0..M-1 before one update, as
    the pipelined schedules do. The summary has ``experiment``, ``steps``,
    ``final_loss``, ``elapsed_s`` and ``params`` (``{stage: {param: values}}``);
    it is also written to ``summary_path`` when given, and one trace line per
    traced step to ``trace_path`` (``trace_params``, ``trace_every``: see
    ``records.TraceWriter``). When the data holds out rows, they are
    evaluated after every ``eval_every``-th step (None: the experiment's;
    0: only the last) and the last: the summary's ``evaluations`` lists each
    (``step``, ``test_loss``, ``test_accuracy``), and ``test_loss`` and
    ``test_accuracy`` are the last one's. With several clients (``[clients]``)
    the summary has one parameter set per client (``f@0``, ``f@1``, ...) and a
    ``clients`` list with each one's loss and evaluations, and no top-level
    ``final_loss``: the shape ``distgrad run`` merges. ``load_dir`` /
    ``save_dir``: each stage starts from / ends by writing
    ``stage.parameters_file(DIR, ...)``, as the stage processes of ``distgrad run`` do.
    ``staleness`` S (None: the experiment's) keeps S steps of the first stage in
    flight, in the order ``--staleness S`` runs them over the wire; an
    evaluation after step t then scores the first stage after its update of
    step t with the others after theirs of step min(t+S, steps).
    ``privacy_meter`` (``--privacy-meter``) meters the first and last stage as their 'privacy_meter' keys
    do (``distgrad.run.metering``), over the same windows as a run in processes; the summary's
    ``input_leaks`` and ``label_leaks`` list each window's figures.
    ``noise_secret``: for tests and for reproducing one run of stage processes only: the secret every
    defense draws its noise and its randomized labels (``label_dp``) from (``privacy.releases.fresh_secret``;
    None: a fresh one, as each stage process draws for each run, or ``DISTGRAD_NOISE_SECRET`` when set).
    ``check_stop``: called after each step, may raise to end the run; the summary then says how (``write_ended``).
    """
    steps, seed, eval_every, staleness = _checked_settings(exp, steps, seed, micro_batches, init, eval_every, staleness,
                                                           privacy_meter, trace_params, trace_every, trace_path)
    files = _ParameterFiles(exp, save_dir, load_dir, bool(init), seed)
    _draw_label_secrets(exp, noise_secret)
    with TraceWriter(trace_path, params=trace_params, every=trace_every, last_step=steps) as trace:
        lines = _TraceLines(trace)
        if exp.federated:
            return _train_federated(exp, steps, seed, init, summary_path, micro_batches, lines, files, eval_every,
                                    noise_secret, privacy_meter, check_stop)
        run = _Reference(exp, steps, seed, init, files, lines, micro_batches, staleness, eval_every, privacy_meter,
                         noise_secret)
        _train_to_end(run, summary_path, check_stop)
    return run.finish(summary_path)


def _train_to_end(run: _Reference, summary_path: str | Path | None, check_stop: Callable[[], None] | None) -> None:
    """``run`` trained and its test rows scored; on an error (a non-finite step, ``check_stop`` raising on a
    signal) its summary says how it ended (``write_ended``) before the error is raised."""
    run.check_stop = check_stop
    try:
        run.train()
        run.evaluate_test()
    except BaseException as e:
        run.write_ended(summary_path, e)
        raise


def _checked_settings(exp: Experiment, steps: int | None, seed: int | None, micro_batches: int,
                      init: Mapping[str, float] | None, eval_every: int | None, staleness: int | None,
                      privacy_meter: bool, trace_params: AbstractSet[str] | None, trace_every: int,
                      trace_path: str | Path | None) -> tuple[int, int, int, int]:
    """``train_in_process``'s settings checked (``ConfigError`` from ``check_run_settings``,
    ``check_meter_flag`` and ``check_trace_filter``, in that order), and ``(steps, seed, eval_every,
    staleness)`` with the experiment's for each None."""
    check_run_settings(exp, steps=steps, seed=seed, micro_batches=micro_batches, init=init, in_process=True,
                       eval_every=eval_every, staleness=staleness)
    if privacy_meter:
        check_meter_flag(exp)                  # never accepted and ignored
    staleness = exp.staleness if staleness is None else staleness
    steps = exp.steps if steps is None else steps
    seed = exp.seed if seed is None else seed
    eval_every = exp.eval_every if eval_every is None else eval_every
    check_trace_filter(trace_params, trace_every, exp.known_param_names(trace_params, seed), trace_path is not None)
    return steps, seed, eval_every, staleness


def _draw_label_secrets(exp: Experiment, noise_secret: int | None) -> None:
    """A new run: the secret of each stage with ``label_dp`` (its randomized labels) drawn afresh
    (``fresh_secret``: ``noise_secret`` when given)."""
    for name in exp.stage_names:
        if exp.has_stage(name) and exp.spec(name).defenses.label_dp is not None:
            exp.run_secret(name).value = fresh_secret(noise_secret)
