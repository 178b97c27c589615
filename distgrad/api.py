"""The Python API behind the CLI, for notebooks and tests.

``train_in_process`` and ``run_local`` train a whole experiment; ``serve_stage``
and ``drive_stage`` run one stage each inside this process (the serving one in
a background thread), speaking the same protocol over real sockets.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import zmq

from distgrad.run.options import StageOptions, StopFlag
from distgrad.run.driver import drive_first_stage
from distgrad.run.serving import serve
from distgrad.errors import DistgradError, StageError
from distgrad.config.experiment import Experiment
from distgrad.config.parse import load_experiment

READY_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 10.0


def _options(experiment: str | Path | Experiment, stage: str | None, first: bool, **options: Any) -> StageOptions:
    exp = experiment if isinstance(experiment, Experiment) else load_experiment(experiment)
    name = stage or exp.stage_names[0 if first else -1]
    return StageOptions(exp, name, options.pop("seed", exp.seed), **options)


class ServedStage:
    """The last stage of an experiment, served on ``endpoint`` by a thread of this process.

    Use it as a context manager: leaving it stops the thread (bounded) and
    closes its sockets. ``summary`` is the last completed run's summary.
    """

    def __init__(self, opts: StageOptions, bind: str, keep_serving: bool) -> None:
        self._stop, self._ready = StopFlag(), threading.Event()
        self._ctx = zmq.Context()
        self.endpoint = ""
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None

        def ready(endpoint: str) -> None:
            self.endpoint = endpoint
            self._ready.set()

        def run() -> None:
            try:
                self.summary = serve(opts, bind, self._stop, keep_serving=keep_serving, ctx=self._ctx, on_ready=ready)
            except DistgradError as e:
                if self._stop.signum is None:
                    self.error = e
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=run, name=f"distgrad-{opts.stage}", daemon=True)

    def __enter__(self) -> "ServedStage":
        self._thread.start()
        if not self._ready.wait(READY_TIMEOUT_S) or not self.endpoint:
            self.__exit__()
            raise StageError(f"the served stage did not start listening: {self.error}")
        return self

    def __exit__(self, exc_type: type | None = None, *exc: object) -> None:
        if self._thread.is_alive():
            self._stop.signum = signal.SIGTERM      # the loop stops at its next tick
        self._thread.join(JOIN_TIMEOUT_S)
        self._ctx.destroy(linger=0)
        if self.error is not None and exc_type is None:
            raise self.error

    def wait(self, timeout_s: float = 60.0) -> dict[str, Any] | None:
        """Wait (bounded) for the served run to complete; returns its summary."""
        self._thread.join(timeout_s)
        if self.error is not None:
            raise self.error
        return self.summary


def serve_stage(experiment: str | Path | Experiment, bind: str = "tcp://127.0.0.1:*", stage: str | None = None,
                keep_serving: bool = False, **options: Any) -> ServedStage:
    """Serve the last stage in a background thread: ``with serve_stage("seed-reverse") as g: ... g.endpoint``.

    ``options`` are ``StageOptions`` fields (``steps``, ``init``, ``timeout_s``, ``checkpoint_dir``, ...);
    the driving stage's pipeline settings (``staleness``, ``in_flight``, ``schedule``, ``eval_every``,
    ``micro_batches``) are refused with ``ConfigError``: the served stage follows the driving stage's hello.
    """
    return ServedStage(_options(experiment, stage, False, **options), bind, keep_serving)


def drive_stage(experiment: str | Path | Experiment, connect: str, stage: str | None = None,
                **options: Any) -> dict[str, Any]:
    """Run the first stage in this thread against the stage serving at ``connect``; returns its summary."""
    ctx = zmq.Context()
    try:
        return drive_first_stage(_options(experiment, stage, True, **options), connect, StopFlag(), ctx)
    finally:
        ctx.destroy(linger=0)

