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
from typing import Any, Mapping

import numpy as np

from .experiment import Experiment, check_init_overrides
from .records import TraceWriter, to_lists, write_json
from .stage import Stage, check_micro_batches, combine_losses, micro_batch

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


def train_in_process(exp: Experiment, steps: int | None = None, seed: int | None = None,
                     init: Mapping[str, float] | None = None, summary_path: str | Path | None = None,
                     trace_path: str | Path | None = None, micro_batches: int = 1) -> dict[str, Any]:
    """Train every stage of ``exp`` in this process and return the summary dict.

    With ``micro_batches`` M, each batch is split into M equal micro-batches
    whose gradients every stage sums in order 0..M-1 before one update, as
    the pipelined schedules do. The summary has ``experiment``, ``steps``,
    ``final_loss``, ``elapsed_s`` and ``params`` (``{stage: {param: values}}``);
    it is also written to ``summary_path`` when given, and one trace line per
    step to ``trace_path``.
    """
    steps = exp.steps if steps is None else steps
    seed = exp.seed if seed is None else seed
    check_init_overrides(exp, init or {})
    stages = [Stage.from_experiment(exp, spec.name, seed, init) for spec in exp.stages]
    data = exp.build_data(seed)
    check_micro_batches(exp, micro_batches, data.feature_shape)
    *upstream, last = stages
    assert last.loss is not None
    scale = last.loss.micro_batch_scale(micro_batches)
    loss = None
    log_every = max(1, steps // 10)
    started = time.perf_counter()
    with TraceWriter(trace_path) as trace:
        for step in range(1, steps + 1):
            features, targets = data.features(step), data.targets(step)
            losses, sent_back = [], []
            for i in range(micro_batches):
                x, caches = micro_batch(features, i, micro_batches), []
                for stage in upstream:
                    x, cache = stage.forward(x)
                    caches.append(cache)
                mb_loss, dx, grads = last.loss_micro_batch(x, micro_batch(targets, i, micro_batches))
                last.accumulator.add(grads, i, micro_batches)
                losses.append(mb_loss)
                if trace.enabled and upstream:
                    sent_back.append(dx)
                for stage, cache in zip(reversed(upstream), reversed(caches)):
                    dx, grads = stage.backward(cache, dx, need_dx=stage is not stages[0])
                    stage.accumulator.add(grads, i, micro_batches)
            loss = combine_losses(losses, scale)
            applied = {}
            for stage in reversed(stages):
                grads = stage.accumulator.take(scale)
                if trace.enabled:
                    applied.update({k: v.copy() for k, v in grads.items()})
                stage.apply(grads)
            if trace.enabled:
                if sent_back:
                    applied["activation_grad"] = np.concatenate(sent_back) if micro_batches > 1 else sent_back[0]
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
        "mode": "in-process",
        **evaluation_fields(evaluation),
        "params": {s.name: to_lists(s.params) for s in stages},
    }
    if summary_path is not None:
        write_json(summary_path, summary)
    return summary
