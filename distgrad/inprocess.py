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

from .experiment import Experiment, check_init_overrides
from .records import TraceWriter, to_lists, write_json
from .stage import Stage

log = logging.getLogger("distgrad.inprocess")


def train_in_process(exp: Experiment, steps: int | None = None, seed: int | None = None,
                     init: Mapping[str, float] | None = None, summary_path: str | Path | None = None,
                     trace_path: str | Path | None = None) -> dict[str, Any]:
    """Train every stage of ``exp`` in this process and return the summary dict.

    The summary has ``experiment``, ``steps``, ``final_loss``, ``elapsed_s``
    and ``params`` (``{stage: {param: values}}``); it is also written to
    ``summary_path`` when given, and one trace line per step to ``trace_path``.
    """
    steps = exp.steps if steps is None else steps
    seed = exp.seed if seed is None else seed
    check_init_overrides(exp, init or {})
    stages = [Stage.from_experiment(exp, spec.name, seed, init) for spec in exp.stages]
    data = exp.build_data(seed)
    *upstream, last = stages
    loss = None
    log_every = max(1, steps // 10)
    started = time.perf_counter()
    with TraceWriter(trace_path) as trace:
        for step in range(1, steps + 1):
            x, caches = data.features(step), []
            for stage in upstream:
                x, cache = stage.forward(x)
                caches.append(cache)
            loss, dx, last_grads = last.train_last(x, data.targets(step))
            step_grads = [last_grads]
            if trace.enabled:
                step_grads[0] = dict(last_grads, activation_grad=dx) if upstream else last_grads
            for stage, cache in zip(reversed(upstream), reversed(caches)):
                dx, grads = stage.backward(cache, dx)
                stage.apply(grads)
                step_grads.append(grads)
            if trace.enabled:
                trace.write(step, loss, {k: v for g in reversed(step_grads) for k, v in g.items()},
                            {k: v for s in stages for k, v in s.params.items()})
            if step % log_every == 0 or step == steps:
                log.info("step %d/%d loss %.6g", step, steps, loss)
    summary = {
        "experiment": exp.name,
        "steps": steps,
        "seed": seed,
        "final_loss": float(loss) if loss is not None else None,
        "elapsed_s": time.perf_counter() - started,
        "mode": "in-process",
        "params": {s.name: to_lists(s.params) for s in stages},
    }
    if summary_path is not None:
        write_json(summary_path, summary)
    return summary
