"""Output files other tools read: the summary JSON and the per-step trace.

Float32 values are written as JSON numbers through Python floats, which
represent every float32 exactly, so ``np.float32(value)`` read back is
bit-for-bit the value that was written.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, AbstractSet, Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from distgrad.config.prepare import Preparation, preparation_path, preparation_text
from distgrad.jsontext import json_text
from distgrad.errors import ConfigError, Interrupted, OutputWriteError, PeerTimeout, StageError
from distgrad.wire.messages import LOSS_WITHHELD

TRACE_WARN_BYTES = 1 << 20      # a trace line larger than this gets one warning naming the filters

log = logging.getLogger("distgrad.trace")


def to_lists(arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """``{name: nested list}`` for JSON."""
    return {name: np.asarray(value).tolist() for name, value in arrays.items()}


def evaluation_fields(evaluation: Mapping[str, Any] | None) -> dict[str, Any]:
    """Summary fields for a held-out evaluation: ``test_loss``, ``test_count``, ``test_accuracy`` when
    classifying, and ``test_NAME`` for each of the label owner's ``metrics`` (None where undefined). With a
    validation split, an evaluation during the run scores the validation rows (``held_out`` "validation"):
    the same fields named ``validation_*``; the test rows are scored once, at the end, for the kept model
    only (``kept_test_fields``)."""
    if evaluation is None:
        return {}
    prefix = "validation_" if evaluation.get("held_out") == "validation" else "test_"
    fields = {f"{prefix}loss": evaluation["loss"], f"{prefix}count": evaluation["count"]}
    if evaluation.get("correct") is not None:
        fields[f"{prefix}accuracy"] = evaluation["correct"] / evaluation["count"]
    fields.update({f"{prefix}{name}": value for name, value in evaluation.get("metrics", {}).items()})
    return fields


def kept_test_fields(test: Mapping[str, Any] | None) -> dict[str, Any]:
    """With a validation split: the kept model's scores of the test rows, from the final evaluation
    (``test``: its scores and ``step``, the step the kept model comes from: keep_best's best step, else the
    last), as summary fields: ``test_loss``, ``test_count``, ``test_accuracy``, ``test_NAME`` (``evaluation_fields``)
    and ``test_step``. {} when there was none."""
    if test is None:
        return {}
    return {**evaluation_fields({k: v for k, v in test.items() if k not in ("held_out", "step")}),
            "test_step": test["step"]}


def evaluation_entry(step: int, evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """One entry of a summary's ``evaluations``: ``step`` and the scores of ``evaluation_fields`` (not the
    row count)."""
    return {"step": step, **{k: v for k, v in evaluation_fields(evaluation).items()
                             if k not in ("test_count", "validation_count")}}


def best_evaluation_fields(evaluations: Sequence[Mapping[str, Any]], best_step: int) -> dict[str, Any]:
    """The summary's ``best_evaluation`` with ``keep_best``: the entry of ``evaluations`` (``evaluation_entry``)
    of ``best_step``, the model ``--save`` writes; {} when no evaluation was judged the best (``best_step``
    0) or its entry is not among ``evaluations``."""
    entry = next((e for e in evaluations if e["step"] == best_step), None) if best_step else None
    return {"best_evaluation": dict(entry)} if entry is not None else {}


def loss_text(loss: float | None) -> str:
    """A step's training loss for a log line: ``0.123456``, or ``withheld by the label owner`` for None (its
    replies carried none: ``wire.LOSS_WITHHELD``)."""
    return LOSS_WITHHELD if loss is None else f"{loss:.6g}"


def scores_text(fields: Mapping[str, Any]) -> str:
    """The scores of ``evaluation_fields`` but the loss and row count, for a log line: ``, test accuracy
    0.9123, test auc 0.9876`` (an undefined one as n/a)."""
    return "".join(f", {key.replace('_', ' ', 1)} " + ("n/a" if value is None else f"{value:.4f}"
                                                       if isinstance(value, (int, float))
                                                       else str(value))   # a non-finite one read back: "nan", "inf"
                   for key, value in fields.items() if key.startswith(("test_", "validation_"))
                   and key not in _NOT_SCORES)


_NOT_SCORES = ("test_loss", "test_count", "test_step", "validation_loss", "validation_count")


def is_special(path: str | Path) -> bool:
    """Whether ``path`` is something other than a regular file or folder (``/dev/null``, ``/dev/stdout``, a
    FIFO): written into as it is, never replaced by a rename (which would put a file where the device was)."""
    path = Path(path)
    return path.exists() and not path.is_file() and not path.is_dir()


@contextmanager
def writing(path: str | Path | None, what: str = "") -> Iterator[None]:
    """Turn an ``OSError`` of the block (disk full, read-only folder, a lost mount) into an
    ``OutputWriteError`` naming ``path`` and the cause, so a command ends on one clear line, not a traceback."""
    try:
        yield
    except OutputWriteError:
        raise
    except OSError as e:
        raise OutputWriteError(f"cannot write {what + ' ' if what else ''}{path}: {e.strerror or e}") from e


def write_json(path: str | Path, obj: Mapping[str, Any]) -> None:
    """Write ``obj`` as JSON to ``path`` (``write_atomic``: never seen half written, no temporary file left on
    failure, a device or FIFO written into). Raises ``OutputWriteError`` naming ``path``."""
    data = (json_text(obj, indent=1, sort_keys=True) + "\n").encode("utf-8")
    with writing(path):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, lambda f: f.write(data))


def write_preparation(parameters: str | Path, prep: Preparation | None) -> None:
    """Write a party's data preparation statistics beside its parameters file ``parameters``
    (``prepare.preparation_path``), atomically; nothing when its [data] prepares nothing. Raises ``OSError``."""
    if prep is not None:
        text = preparation_text(prep)
        write_atomic(preparation_path(parameters), lambda f: f.write(text))


def write_atomic(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    """Write a file through ``write(file)`` under a temporary name, fsync it and rename it into place, so
    ``path`` is never seen half written; the temporary file is removed on failure. Raises ``OSError``."""
    path = Path(path)
    if is_special(path):                # a device or FIFO: written into, never replaced
        with open(path, "wb") as f:
            write(f)
        return path
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def check_trace_filter(names: AbstractSet[str] | None, every: int, known: AbstractSet[str],
                       tracing: bool) -> None:
    """Validate ``--trace-params`` / ``--trace-every``; raises ``ConfigError`` naming the bad value.

    ``known`` is every parameter name of the experiment (any stage: each stage
    keeps the names it owns); ``activation_grad``, ``sent_activation`` and ``sent_activation_grad`` (the
    tensors that crossed, ``StepEngine``; with feature parties they keep every party's ``NAME/PARTY``) are
    always valid names.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"--trace-every must be an integer >= 1, got {every!r}")
    if (names is not None or every != 1) and not tracing:
        raise ConfigError("--trace-params and --trace-every need --trace PATH")
    if names is not None:
        valid = set(known) | {"activation_grad", "sent_activation", "sent_activation_grad"}
        unknown = sorted(set(names) - valid)
        if unknown or not names:
            raise ConfigError(f"--trace-params: unknown name(s) {', '.join(unknown) or '(none given)'}; "
                              f"the experiment's are {', '.join(sorted(valid))}")


def parse_trace_params(text: str | None) -> frozenset[str] | None:
    """``"w1,b1"`` -> ``{"w1", "b1"}``; None (every parameter) when not given."""
    if text is None:
        return None
    return frozenset(name.strip() for name in text.split(",") if name.strip())


def close_after_failure(file: IO[str]) -> None:
    """Close ``file`` after a write to it failed (``OutputWriteError``: disk full): what it could not take is
    dropped, and the same failure is not raised a second time (the caller raises the first)."""
    try:
        file.close()
    except OSError:
        pass


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
            with writing(self.path, "the trace"):
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # a line at a time: a stage killed (SIGKILL) leaves every traced step's line, and whole
                self._file = open(self.path, "a" if append else "w", encoding="utf-8", buffering=1)

    def flush(self) -> None:
        """Make every line written so far durable (called before a checkpoint is saved)."""
        if self._file is not None:
            with writing(self.path, "the trace"):
                self._file.flush()
                os.fsync(self._file.fileno())

    def rollback(self, step: int) -> None:
        """Drop the lines of steps after ``step`` (a rollback to that step's state).

        A torn last line, left by a crash, is dropped too.
        """
        if self._file is None or self.path is None or is_special(self.path):
            return                      # a device or FIFO keeps no lines to drop
        file, self._file = self._file, None
        with writing(self.path, "the trace"):
            file.close()
            kept = [line for line in read_trace(self.path, tolerate_torn=True) if line["step"] <= step]
            text = "".join(json_text(line, separators=(",", ":")) + "\n" for line in kept).encode("utf-8")
            write_atomic(self.path, lambda f: f.write(text))     # a crash keeps the old file
            self._file = open(self.path, "a", encoding="utf-8", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def wants(self, step: int) -> bool:
        """Whether ``write(step, ...)`` writes a line: callers copy what they trace only then."""
        return self._file is not None and (step % self.every == 0 or step == self.last_step)

    def _kept(self, arrays: Mapping[str, np.ndarray]) -> dict[str, Any]:
        # ``sent_activation`` keeps each feature party's ``sent_activation/PARTY`` too (``StepEngine``)
        return to_lists({k: v for k, v in arrays.items()
                         if self.names is None or k in self.names or k.split("/", 1)[0] in self.names})

    def write(self, step: int, loss: float | None, grads: Mapping[str, np.ndarray],
              params: Mapping[str, np.ndarray], client: int | None = None) -> None:
        """One line for ``step`` (of ``client``'s turn, for a stage serving several) if it is traced."""
        if not self.wants(step):
            return
        assert self._file is not None
        line: dict[str, Any] = {"step": step, "grads": self._kept(grads), "params": self._kept(params)}
        if client is not None:
            line["client"] = client
        if loss is not None:
            line["loss"] = float(loss)
        text = json_text(line, separators=(",", ":")) + "\n"
        if len(text) > TRACE_WARN_BYTES and not self._warned:
            self._warned = True
            log.warning("the trace %s takes %.1f MB a step (every parameter and gradient as JSON); "
                        "--trace-params NAME,... and --trace-every K make it smaller", self.path, len(text) / 1e6)
        try:
            with writing(self.path, "the trace"):
                self._file.write(text)
        except OutputWriteError:        # disk full: closed now, what it could not take dropped (close is quiet)
            file, self._file = self._file, None
            close_after_failure(file)
            raise

    def close(self) -> None:
        """Raises ``OutputWriteError`` when the last lines cannot be written; the file is closed all the same."""
        file, self._file = self._file, None
        if file is not None:
            with writing(self.path, "the trace"):
                file.close()

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
    """One summary from per-stage summaries: ``params``, ``privacy`` and ``cpu_s`` joined by stage
    (``{stage: ...}``), the meters of several data owners (``input_meters``, ``label_meters``) by data owner, every other field from the first summary that has it
    (pass the driving stage's first)."""
    merged: dict[str, Any] = {"params": {}}
    for summary in summaries:
        for key, value in summary.items():
            if key in ("params", "privacy", "input_meters", "label_meters"):
                merged.setdefault(key, {}).update(value)
            elif key == "cpu_s":
                merged.setdefault("cpu_s", {})[summary.get("stage", "?")] = value
            elif key != "stage":
                merged.setdefault(key, value)
    return merged


def _read_part(path: str | Path, what: str, cut_short: bool = False) -> list[dict[str, Any]]:
    """The lines of one process's metrics or trace file; raises ``StageError`` naming a missing one. With
    ``cut_short`` (the files of a run that ended on an error: a process may have been killed mid-line), a
    line that does not parse is left out."""
    try:
        return read_trace(path, tolerate_torn=cut_short)
    except FileNotFoundError as e:
        raise StageError(f"no {what} file {path}: the stage that should have written it wrote none") from e
    except json.JSONDecodeError as e:
        raise StageError(f"{what} file {path} is not JSON lines: {e}") from e


def _client_of(line: Mapping[str, Any], client: int | None, path: str | Path) -> int | None:
    """The client a line belongs to: its own ``client`` key, else the client whose file it is."""
    said = line.get("client", client)
    if client is not None and said != client:
        raise StageError(f"{path}: a line of client {said} in the file of client {client}")
    return said


def _by_step_and_client(key: tuple[int, int | None]) -> tuple[int, int]:
    return key[0], -1 if key[1] is None else key[1]


def _write_lines(out: str | Path, lines: Iterable[Mapping[str, Any]], what: str) -> None:
    """Raises ``OutputWriteError`` naming ``out``."""
    out = Path(out)

    def write(f: IO[bytes]) -> None:
        for line in lines:
            f.write((json_text(line, separators=(",", ":")) + "\n").encode("utf-8"))

    with writing(out, what):
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(out, write)        # never seen half written, another run's file kept on a failure


def merge_metrics(paths: Sequence[str | Path], out: str | Path, clients: Sequence[int],
                  cut_short: bool = False) -> None:
    """Join the clients' metrics files (``paths[k]`` is client ``clients[k]``'s) into ``out``:
    each line gains ``"client": K``, sorted by step then client. Raises ``StageError`` for a
    missing or unreadable file (``cut_short``: see ``_read_part``)."""
    merged = []
    for path, client in zip(paths, clients, strict=True):
        for line in _read_part(path, "metrics", cut_short):
            merged.append({**line, "client": _client_of(line, client, path)})
    merged.sort(key=lambda line: (line["step"], line["client"]))
    _write_lines(out, merged, "the metrics")


def merge_traces(paths: Sequence[str | Path], out: str | Path,
                 clients: Sequence[int | None] | None = None, cut_short: bool = False) -> None:
    """Join per-process traces on (step, client): one line per step with every stage's values.

    ``clients[k]`` is the client whose lines ``paths[k]`` holds (None: lines of no client, or
    lines that say theirs in a ``client`` key, as the serving stage of several clients writes).
    Two stages or a chain give one line per step, as each stage's; several clients give one line
    per (step, client) with ``client``, that client's values and the serving stage's after its
    turn. Sorted by step then client. Raises ``StageError`` for a missing file (``cut_short``: see
    ``_read_part``).
    """
    clients = [None] * len(paths) if clients is None else clients
    merged: dict[tuple[int, int | None], dict[str, Any]] = {}
    for path, client in zip(paths, clients, strict=True):
        for line in _read_part(path, "trace", cut_short):
            who = _client_of(line, client, path)
            entry = merged.get((line["step"], who))
            if entry is None:
                entry = merged[line["step"], who] = {"step": line["step"]}
                if who is not None:
                    entry["client"] = who
                entry.update(grads={}, params={})
            entry["grads"].update(line.get("grads", {}))
            entry["params"].update(line.get("params", {}))
            if "loss" in line:
                entry["loss"] = line["loss"]
    _write_lines(out, (merged[key] for key in sorted(merged, key=_by_step_and_client)), "the trace")


def ending_fields(error: BaseException) -> dict[str, Any]:
    """The summary fields of a run that ended on ``error`` instead of completing: ``status`` (``"stopped"`` by
    a signal, ``"lost"`` when a peer stayed silent past its deadline, else ``"failed"``) and ``error``, the
    message the command ended with."""
    if isinstance(error, (Interrupted, KeyboardInterrupt)):
        status = "stopped"
    elif isinstance(error, PeerTimeout):
        status = "lost"
    else:
        status = "failed"
    return {"status": status, "error": str(error) or type(error).__name__}


def ended_summary(parts: Sequence[Mapping[str, Any]], experiment: str, error: BaseException,
                  clients: Mapping[int, Mapping[str, Any]] | None = None, **run: Any) -> dict[str, Any]:
    """The summary of a run of several processes that ended on ``error``: the summaries the processes wrote
    before they ended (``parts``, the driving stage's first; any may be missing) merged as a completed run's
    are (``merge_summaries``), with the whole run's ``status`` and ``error`` (``ending_fields``) and ``run``
    (e.g. ``mode``) over them; ``params`` are those of the processes that wrote one. With several clients
    (``clients``: the summaries of those that wrote one, by client), each client's own figures
    (``CLIENT_SUMMARY_FIELDS``, its scores) are in ``clients``, one entry per client that wrote one, as
    ``merge_client_summaries`` puts them, and not at the top level."""
    merged = merge_summaries(parts)
    if clients is not None:
        merged = {key: value for key, value in merged.items() if not _client_field(key)}
        merged["clients"] = [{"client": k, **{key: value for key, value in summary.items() if _client_field(key)}}
                             for k, summary in sorted(clients.items())]
        # the rounds the serving stage completed, as a completed run's summary says them
        merged["steps"] = merged.get("rounds", max((e.get("steps", 0) for e in merged["clients"]), default=0))
    return {"experiment": experiment, **merged, **run, **ending_fields(error)}


def _client_field(key: str) -> bool:
    return key in CLIENT_SUMMARY_FIELDS or key.startswith(("test_", "validation_"))


CLIENT_SUMMARY_FIELDS = ("run_id", "steps", "final_loss", "status", "evaluations")   # and every test_ score


def merge_client_summaries(clients: Sequence[Mapping[str, Any]], serving: Mapping[str, Any] | None,
                           **run: Any) -> dict[str, Any]:
    """One summary of a run with several clients from each client's summary (in client order)
    and the serving stage's (None when it wrote none, e.g. a run finished earlier).

    The top level holds only what is true of the whole run: ``experiment``, ``steps`` (rounds),
    ``seed``, ``micro_batches``, ``elapsed_s`` (the longest process's), ``cpu_s`` and ``params``
    (``{process: ...}``), ``status`` (the serving stage's, else the clients' if they agree), then
    ``run`` (e.g. ``mode``, ``transport``), ``privacy`` (by stage, when defended), the privacy meters
    (``input_meters``: each client's own, ``label_meters``: the label owner's of each client, by ``f@K``). Each client's ``run_id``, ``steps``, ``final_loss``,
    ``status`` and evaluation are in ``clients``, one entry per client; the serving stage's view
    of a client's status (``dropped``) wins over the client's own.
    """
    first = clients[0]
    seen = {entry.get("client"): entry for entry in (serving or {}).get("clients", [])}
    per_client = []
    for k, summary in enumerate(clients):
        entry: dict[str, Any] = {"client": k}
        entry.update({key: value for key, value in summary.items()
                      if key in CLIENT_SUMMARY_FIELDS or key.startswith(("test_", "validation_"))})
        if "status" in seen.get(k, {}):
            entry["status"] = seen[k]["status"]
        per_client.append(entry)
    statuses = {entry.get("status") for entry in per_client}
    parts = [*clients, *([serving] if serving is not None else [])]
    merged = merge_summaries(parts)
    return {
        "experiment": first["experiment"],
        "steps": serving.get("rounds", serving["steps"]) if serving is not None else max(
            entry.get("steps", 0) for entry in per_client),
        "seed": first.get("seed"),
        "micro_batches": first.get("micro_batches", 1),
        "elapsed_s": max(part.get("elapsed_s", 0.0) for part in parts),
        "cpu_s": merged.get("cpu_s", {}),
        "status": serving["status"] if serving is not None else statuses.pop() if len(statuses) == 1 else "mixed",
        **run,
        "clients": per_client,
        **({"privacy": merged["privacy"]} if "privacy" in merged else {}),
        **{key: merged[key] for key in ("input_meters", "label_meters") if key in merged},
        "params": merged["params"],
    }
