"""Output files other tools read: the summary JSON and the per-step trace.

Float32 values are written as JSON numbers through Python floats, which
represent every float32 exactly, so ``np.float32(value)`` read back is
bit-for-bit the value that was written.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import IO, AbstractSet, Any, Iterable, Mapping

import numpy as np

from .errors import ConfigError

TRACE_WARN_BYTES = 1 << 20      # a trace line larger than this gets one warning naming the filters

log = logging.getLogger("distgrad.trace")


def to_lists(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``{name: nested list}`` for JSON."""
    return {name: np.asarray(value).tolist() for name, value in arrays.items()}


def write_json(path: str | Path, obj: Mapping[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    tmp.replace(path)


def read_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def check_trace_filter(names: AbstractSet[str] | None, every: int, known: AbstractSet[str],
                       tracing: bool) -> None:
    """Validate ``--trace-params`` / ``--trace-every``; raises ``ConfigError`` naming the bad value.

    ``known`` is every parameter name of the experiment (any stage: each stage
    keeps the names it owns); ``activation_grad`` is always a valid name.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"--trace-every must be an integer >= 1, got {every!r}")
    if (names is not None or every != 1) and not tracing:
        raise ConfigError("--trace-params and --trace-every need --trace PATH")
    if names is not None:
        valid = set(known) | {"activation_grad"}
        unknown = sorted(set(names) - valid)
        if unknown or not names:
            raise ConfigError(f"--trace-params: unknown name(s) {', '.join(unknown) or '(none given)'}; "
                              f"the experiment's are {', '.join(sorted(valid))}")


def parse_trace_params(text: str | None) -> frozenset[str] | None:
    """``"w1,b1"`` -> ``{"w1", "b1"}``; None (every parameter) when not given."""
    if text is None:
        return None
    return frozenset(name.strip() for name in text.split(",") if name.strip())


class TraceWriter:
    """Writes one JSON line per traced step; a no-op when ``path`` is None.

    ``params`` keeps only these names in a line's ``grads`` and ``params``
    (None: all); ``every`` traces the steps that are multiples of it, and
    ``last_step`` too. A line's size is about 21 bytes per float32 value, for
    each parameter and its gradient: a full trace of a large model is large,
    and the first line over ``TRACE_WARN_BYTES`` logs one warning.
    """

    def __init__(self, path: str | Path | None, append: bool = False, params: AbstractSet[str] | None = None,
                 every: int = 1, last_step: int | None = None) -> None:
        self._file: IO[str] | None = None
        self.path = Path(path) if path is not None else None
        self.names = frozenset(params) if params is not None else None
        self.every, self.last_step = every, last_step
        self._warned = False
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a" if append else "w", encoding="utf-8")

    def flush(self) -> None:
        """Make every line written so far durable (called before a checkpoint is saved)."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def rollback(self, step: int) -> None:
        """Drop the lines of steps after ``step`` (a rollback to that step's state).

        A torn last line, left by a crash, is dropped too.
        """
        if self._file is None or self.path is None:
            return
        self._file.close()
        kept = [line for line in read_trace(self.path, tolerate_torn=True) if line["step"] <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:       # replaced atomically: a crash keeps the old file
            f.writelines(json.dumps(line, separators=(",", ":")) + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(self.path)
        self._file = open(self.path, "a", encoding="utf-8")

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def wants(self, step: int) -> bool:
        """Whether ``write(step, ...)`` writes a line: callers copy what they trace only then."""
        return self._file is not None and (step % self.every == 0 or step == self.last_step)

    def _kept(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
        return to_lists({k: v for k, v in arrays.items() if self.names is None or k in self.names})

    def write(self, step: int, loss: float | None, grads: Mapping[str, np.ndarray],
              params: Mapping[str, np.ndarray]) -> None:
        if not self.wants(step):
            return
        assert self._file is not None
        line: dict[str, Any] = {"step": step, "grads": self._kept(grads), "params": self._kept(params)}
        if loss is not None:
            line["loss"] = float(loss)
        text = json.dumps(line, separators=(",", ":")) + "\n"
        if len(text) > TRACE_WARN_BYTES and not self._warned:
            self._warned = True
            log.warning("the trace %s takes %.1f MB a step (every parameter and gradient as JSON); "
                        "--trace-params NAME,... and --trace-every K make it smaller", self.path, len(text) / 1e6)
        self._file.write(text)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "TraceWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_trace(path: str | Path, tolerate_torn: bool = False) -> list[dict[str, Any]]:
    """The lines of a trace file; with ``tolerate_torn``, lines that do not parse are skipped."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            if not text.strip():
                continue
            try:
                lines.append(json.loads(text))
            except json.JSONDecodeError:
                if not tolerate_torn:
                    raise
    return lines


def merge_summaries(summaries: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """One summary from per-stage summaries: ``params`` and ``cpu_s`` joined by stage
    (``{stage: ...}``), every other field from the first summary that has it
    (pass the driving stage's first)."""
    merged: dict[str, Any] = {"params": {}}
    for summary in summaries:
        for key, value in summary.items():
            if key == "params":
                merged["params"].update(value)
            elif key == "cpu_s":
                merged.setdefault("cpu_s", {})[summary.get("stage", "?")] = value
            elif key != "stage":
                merged.setdefault(key, value)
    return merged


def merge_traces(paths: Iterable[str | Path], out: str | Path) -> None:
    """Join per-stage traces line by line on ``step``: one line per step with every stage's values."""
    by_step: dict[int, dict[str, Any]] = {}
    for path in paths:
        for line in read_trace(path):
            entry = by_step.setdefault(line["step"], {"step": line["step"], "grads": {}, "params": {}})
            entry["grads"].update(line.get("grads", {}))
            entry["params"].update(line.get("params", {}))
            if "loss" in line:
                entry["loss"] = line["loss"]
    with open(out, "w", encoding="utf-8") as f:
        for step in sorted(by_step):
            f.write(json.dumps(by_step[step], separators=(",", ":")) + "\n")
