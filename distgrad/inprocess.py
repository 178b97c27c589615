"""The same training, all stages in one process: the reference the wire must match.

It drives the very ``Stage`` objects the daemons use, in the order the
two-process protocol imposes (forward through every stage, the loss, then
each stage's backward and update from the last to the first), with the same
data and seeds. Tests assert that runs over the wire end bitwise equal to it.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import AbstractSet, Any, Mapping

import numpy as np

from .errors import ConfigError
from .experiment import Experiment, check_run_settings
from .records import TraceWriter, check_trace_filter, to_lists, write_json
from .stage import (Stage, average_parameters, check_micro_batches, client_stage_name, combine_losses,
                    micro_batch)

log = logging.getLogger("distgrad.inprocess")


def evaluation_fields(evaluation: Mapping[str, Any] | None) -> dict[str, Any]:
    """Summary fields for a held-out evaluation: ``test_loss`` and, when classifying, ``test_accuracy``."""
    if evaluation is None:
        return {}
    fields = {"test_loss": evaluation["loss"], "test_count": evaluation["count"]}
    if evaluation.get("correct") is not None:
        fields["test_accuracy"] = evaluation["correct"] / evaluation["count"]
    return fields


def _accuracy_text(evaluation: Mapping[str, Any]) -> str:
    fields = evaluation_fields(evaluation)
    return f", test accuracy {fields['test_accuracy']:.4f}" if "test_accuracy" in fields else ""


def _step(stages: list[Stage], features: np.ndarray, targets: np.ndarray, micro_batches: int,
          scale: np.float32, tracing: bool) -> tuple[np.float32, dict[str, np.ndarray]]:
    """One step through ``stages`` in the protocol's order; returns the loss and (when
    ``tracing``) copies of the applied gradients with the last stage's activation gradient."""
    *upstream, last = stages
    losses, sent_back = [], []
    for i in range(micro_batches):
        x, caches = micro_batch(features, i, micro_batches), []
        for stage in upstream:
            x, cache = stage.forward(x)
            caches.append(cache)
        mb_loss, dx, grads = last.loss_micro_batch(x, micro_batch(targets, i, micro_batches))
        last.check_finite("loss", mb_loss)
        if upstream:
            last.check_finite("activation_grad", dx)
        last.accumulator.add(grads, i, micro_batches)
        losses.append(mb_loss)
        if tracing and upstream:
            sent_back.append(dx)
        for stage, cache in zip(reversed(upstream), reversed(caches)):
            dx, grads = stage.backward(cache, dx, need_dx=stage is not stages[0])
            if stage is not stages[0]:
                stage.check_finite("activation_grad", dx)
            stage.accumulator.add(grads, i, micro_batches)
    # Every stage's gradients are checked before any stage is updated.
    taken = [(stage, stage.accumulator.take(scale)) for stage in reversed(stages)]
    for stage, grads in taken:
        stage.check_grads(grads)
    applied = {}
    for stage, grads in taken:
        if tracing:
            applied.update({k: v.copy() for k, v in grads.items()})
        stage.apply(grads)
    if sent_back:
        applied["activation_grad"] = np.concatenate(sent_back) if micro_batches > 1 else sent_back[0]
    return combine_losses(losses, scale), applied


def _train_federated(exp: Experiment, steps: int, seed: int, init: Mapping[str, float] | None,
                     summary_path: str | Path | None, micro_batches: int) -> dict[str, Any]:
    """Several data owners against one serving stage, in the order the serving stage applies them.

    Every step, client 0, 1, ... in turn: its forward, the serving stage's
    update, its own update. With ``splitfed``, after every ``average_every``
    steps each client's first-stage parameters become their mean.
    """
    first_name, last_name = exp.stage_names
    clients = [Stage.from_experiment(exp, first_name, seed, init) for _ in range(exp.clients.count)]
    last = Stage.from_experiment(exp, last_name, seed, init)
    data = [exp.build_data(seed, client=c) for c in range(exp.clients.count)]
    check_micro_batches(exp, micro_batches, data[0].feature_shape)
    assert last.loss is not None
    scale = last.loss.micro_batch_scale(micro_batches)
    losses: list[float | None] = [None] * len(clients)
    started, cpu_started = time.perf_counter(), time.process_time()
    for step in range(1, steps + 1):
        for c, client in enumerate(clients):
            losses[c] = float(_step([client, last], data[c].features(step), data[c].targets(step), micro_batches,
                                    scale, False)[0])
        if exp.clients.mode == "splitfed" and step % exp.clients.average_every == 0:
            mean = average_parameters([client.params for client in clients])
            for client in clients:
                for name, value in mean.items():
                    client.params[name][...] = value
        if step % max(1, steps // 10) == 0 or step == steps:
            log.info("step %d/%d losses %s", step, steps, " ".join(f"{loss:.6g}" for loss in losses))
    per_client = []
    for c, client in enumerate(clients):
        # The shape of the launcher's merged summary (records.merge_client_summaries); no run ids in one process.
        entry: dict[str, Any] = {"client": c, "run_id": None, "steps": steps, "final_loss": losses[c],
                                 "status": "completed"}
        if len(data[c].test_rows):
            x, _ = client.forward(data[c].test_features())
            entry.update(evaluation_fields(last.evaluate_last(x, data[c].test_targets())))
        per_client.append(entry)
    summary = {
        "experiment": exp.name, "steps": steps, "seed": seed, "micro_batches": micro_batches,
        "elapsed_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu_started,
        "status": "completed", "mode": "in-process", "transport": None,
        "clients": per_client,
        "params": {**{client_stage_name(first_name, c): to_lists(s.params) for c, s in enumerate(clients)},
                   last_name: to_lists(last.params)},
    }
    if summary_path is not None:
        write_json(summary_path, summary)
    return summary


def train_in_process(exp: Experiment, steps: int | None = None, seed: int | None = None,
                     init: Mapping[str, float] | None = None, summary_path: str | Path | None = None,
                     trace_path: str | Path | None = None, micro_batches: int = 1,
                     trace_params: AbstractSet[str] | None = None, trace_every: int = 1) -> dict[str, Any]:
    """Train every stage of ``exp`` in this process and return the summary dict.

    With ``micro_batches`` M, each batch is split into M equal micro-batches
    whose gradients every stage sums in order 0..M-1 before one update, as
    the pipelined schedules do. The summary has ``experiment``, ``steps``,
    ``final_loss``, ``elapsed_s`` and ``params`` (``{stage: {param: values}}``);
    it is also written to ``summary_path`` when given, and one trace line per
    traced step to ``trace_path`` (``trace_params``, ``trace_every``: see
    ``records.TraceWriter``). With several clients (``[clients]``) the summary
    has one parameter set per client (``f@0``, ``f@1``, ...) and a
    ``clients`` list with each one's loss and evaluation, and no top-level
    ``final_loss``: the shape ``distgrad run`` merges.
    """
    check_run_settings(exp, steps=steps, seed=seed, micro_batches=micro_batches, init=init, in_process=True)
    steps = exp.steps if steps is None else steps
    seed = exp.seed if seed is None else seed
    check_trace_filter(trace_params, trace_every, exp.all_param_names(seed), trace_path is not None)
    if exp.federated:
        if trace_path is not None:
            raise ConfigError("--in-process writes no trace for runs with several clients; use --summary")
        return _train_federated(exp, steps, seed, init, summary_path, micro_batches)
    stages = [Stage.from_experiment(exp, spec.name, seed, init) for spec in exp.stages]
    data = exp.build_data(seed)
    check_micro_batches(exp, micro_batches, data.feature_shape)
    *upstream, last = stages
    assert last.loss is not None
    scale = last.loss.micro_batch_scale(micro_batches)
    loss = None
    log_every = max(1, steps // 10)
    started, cpu_started = time.perf_counter(), time.process_time()
    with TraceWriter(trace_path, params=trace_params, every=trace_every, last_step=steps) as trace:
        for step in range(1, steps + 1):
            loss, applied = _step(stages, data.features(step), data.targets(step), micro_batches, scale,
                                  trace.wants(step))
            if trace.wants(step):
                trace.write(step, loss, applied, {k: v for s in stages for k, v in s.params.items()})
            if step % log_every == 0 or step == steps:
                log.info("step %d/%d loss %.6g", step, steps, loss)
    evaluation = None
    if len(data.test_rows):
        x = data.test_features()
        for stage in upstream:
            x, _ = stage.forward(x)
        evaluation = last.evaluate_last(x, data.test_targets())
        log.info("test loss %.6g%s", evaluation["loss"], _accuracy_text(evaluation))
    summary = {
        "experiment": exp.name,
        "steps": steps,
        "seed": seed,
        "micro_batches": micro_batches,
        "final_loss": float(loss) if loss is not None else None,
        "elapsed_s": time.perf_counter() - started,
        "cpu_s": time.process_time() - cpu_started,
        "mode": "in-process",
        **evaluation_fields(evaluation),
        "params": {s.name: to_lists(s.params) for s in stages},
    }
    if summary_path is not None:
        write_json(summary_path, summary)
    return summary
