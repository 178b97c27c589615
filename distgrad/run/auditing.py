"""``distgrad audit``: a run's recorded view of the cut, read and attacked as the other party would.

The view is a trace (``--trace``) holding what crossed on its traced steps,
exactly as the receiver decoded it (after the sender's defenses and codec):
``sent_activation_grad`` (the label owner's, what the data owner received) and
``sent_activation`` (the data owner's, what the label owner received). With
several data owners each is audited apart: a client's on its own lines (each
names its ``client``), a feature party's views named ``NAME/PARTY``; the
report names each (``labels/a``, ``inputs/f@1``). The
secret rows they belong to come from the experiment's own data, rebuilt with
the run's seed, as the meter takes them: the label owner's true labels of
each traced step, the data owner's raw input rows. The attacks are
``distgrad.privacy.audit``'s; the figures the live meter reports too are
computed by the same functions (``leaks.label_figures``, ``leaks.input_figures``).
The labels' report adds the strongest attack the live meter plays, the data
owner's per-row averaging over every audited step (``averaged_recovery_1``,
``averaged_recovery_10``: ``meter.AttackMeter``), which a window's figures
understate against a defense that noises each release.

A trace is untrusted input, validated whole before anything is scored: a
regular file of at most ``max_bytes`` (``DEFAULT_MAX_TRACE_BYTES``; read with
that cap, line by line), each line a JSON object (no key twice), with a
whole ``step`` from 1 to the run's last, the steps strictly increasing (a
step written twice would be scored twice), ``grads`` and ``params`` objects
of numbers or arrays, a number ``loss``, a ``client`` only in a run with
[clients] (then on every line, each client's steps increasing); and each view a
regular array of finite float32-range numbers of exactly the cut's shape for
a batch. Anything else, and bad settings, raise ``ConfigError`` (exit 2)
naming the line, the step and the problem.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from distgrad.config.experiment import Experiment, client_stage_name, is_whole
from distgrad.config.parse import load_experiment
from distgrad.errors import ConfigError
from distgrad.jsontext import json_text
from distgrad.privacy import audit
from distgrad.privacy.meter import LABELS, AttackMeter, sampled, window_steps

LABEL_VIEW, INPUT_VIEW = "sent_activation_grad", "sent_activation"
DEFAULT_MAX_TRACE_BYTES = 512 * 2 ** 20     # the largest trace read (bytes); settable, --max-trace-bytes
FLOAT32_MAX = float(np.finfo(np.float32).max)

View = list[tuple[int, np.ndarray]]          # (step, the rows that crossed on it), steps increasing


def _no_twice(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's members, refusing a key given twice (``json`` would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"the key {key!r} appears twice in one object")
        out[key] = value
    return out


def _trace_texts(path: Path, max_bytes: int) -> Iterator[tuple[int, bytes]]:
    """The lines of the file at ``path`` (bytes, with their 1-based numbers), read with a cap of
    ``max_bytes``; ``ConfigError`` for a missing, unreadable, non-regular or too large file."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise ConfigError(f"audit: no trace file {path}") from None
    except OSError as e:
        raise ConfigError(f"audit: cannot read the trace {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a device, pipe or socket"
        raise ConfigError(f"audit: {path} is {kind}, not a regular file: give the file --trace wrote")
    too_large = (f"audit: {path} is over the audit's limit of {max_bytes} bytes (--max-trace-bytes): "
                 f"trace fewer steps or tensors (--trace-every, --trace-params), or raise the limit")
    if info.st_size > max_bytes:
        raise ConfigError(too_large.replace(" is over", f" is {info.st_size} bytes, over"))
    try:
        # Non-blocking: a pipe put in the file's place since the check above must not hold the open.
        with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"audit: {path} is not a regular file: give the file --trace wrote")
            read, number = 0, 0
            while True:
                text = f.readline(max_bytes - read + 1)      # never more than the cap, even if the file grows
                if not text:
                    return
                read, number = read + len(text), number + 1
                if read > max_bytes:
                    raise ConfigError(too_large)
                yield number, text
    except OSError as e:
        raise ConfigError(f"audit: cannot read the trace {path}: {e.strerror or e}") from None


def _parse(text: bytes, where: str) -> dict[str, Any]:
    """One trace line as a JSON object."""
    try:
        line = json.loads(text.decode("utf-8"), object_pairs_hook=_no_twice)
    except UnicodeDecodeError:
        raise ConfigError(f"{where} is not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"{where} is JSON nested too deeply to be a trace line") from None
    except ValueError as e:      # JSONDecodeError, a key twice, a number too long to convert
        raise ConfigError(f"{where} is not a trace line (one JSON object a line, as --trace writes): {e}") from None
    if not isinstance(line, dict):
        raise ConfigError(f"{where} is a JSON {type(line).__name__}, not an object: "
                          f"a trace holds one JSON object a line, as --trace writes")
    return line


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe(value: Any) -> str:
    """A short name of a JSON value for a message (never the whole of a nested one)."""
    if isinstance(value, (list, dict)):
        return "an array" if isinstance(value, list) else "an object"
    if value is None or isinstance(value, bool):
        return json_text(value)
    if isinstance(value, str):
        return f"the string {json_text(value[:20])}{'...' if len(value) > 20 else ''}"
    return repr(value) if not isinstance(value, int) or value.bit_length() < 64 else "a very long integer"


def _rows(value: Any, shape: tuple[int, ...], where: str) -> np.ndarray:
    """A view's rows as float64, refused unless a regular array of finite float32-range numbers of ``shape``."""
    nominal, first = [], value             # the shape its first elements give: a cheap check before building
    while isinstance(first, list):
        nominal.append(len(first))
        first = first[0] if first else None
    if tuple(nominal) != shape:
        raise ConfigError(f"{where} has shape {tuple(nominal)}, but the cut carries {shape} a step (a batch's rows "
                          f"of {shape[1:]}): is the trace of this experiment and --seed?")
    try:
        held = np.array(value, dtype=object)
    except ValueError:
        held = None
    if held is None or (held.shape != shape and any(isinstance(v, list) for v in held.reshape(-1))):
        raise ConfigError(f"{where} is not a regular array (rows of unequal lengths), but the cut carries an "
                          f"array of shape {shape} a step: is the trace of this experiment and --seed?")
    if held.shape != shape:
        raise ConfigError(f"{where} has shape {held.shape}, but the cut carries {shape} a step (a batch's rows "
                          f"of {shape[1:]}): is the trace of this experiment and --seed?")
    flat = held.reshape(-1)
    if not set(map(type, flat)) <= {int, float}:       # bool, str, None, list, dict: not numbers
        bad = next(v for v in flat if not _is_number(v))
        raise ConfigError(f"{where} holds {_describe(bad)}: every value must be a number")
    try:
        rows = held.astype(np.float64)
    except (OverflowError, ValueError):
        raise ConfigError(f"{where} holds a number too large for float32") from None
    if not np.isfinite(rows).all():
        raise ConfigError(f"{where} holds NaN or infinite values: what crosses the cut is finite")
    if np.abs(rows).max(initial=0.0) > FLOAT32_MAX:
        raise ConfigError(f"{where} holds a number too large for float32 (the cut carries float32)")
    return rows


def read_views(path: Path, shapes: dict[str, tuple[int, ...]], last_step: int,
               max_bytes: int = DEFAULT_MAX_TRACE_BYTES, clients: int = 0) -> dict[str, View]:
    """Every line of the trace at ``path`` validated (see the module's contract), and the rows of the views
    named in ``shapes`` (each a step's shape) on every step that holds them. ``clients``: a run with that many
    clients, whose lines each name theirs (``client``: 0 to ``clients`` - 1; each client's steps increase),
    and whose views are returned per client as ``NAME@K``; 0: a line naming a client is refused. Raises
    ``ConfigError``."""
    views: dict[str, View] = ({f"{name}@{k}": [] for name in shapes for k in range(clients)} if clients
                              else {name: [] for name in shapes})
    previous_of: dict[Any, tuple[int, int]] = {}         # by client: (step, line number) of its last line
    for number, text in _trace_texts(path, max_bytes):
        where = f"audit: {path}: line {number}"
        if not text.strip():
            continue
        line = _parse(text, where)
        step = line.get("step")
        if not (isinstance(step, int) and not isinstance(step, bool)):
            raise ConfigError(f"{where} has no whole-number 'step' (got {_describe(step)})")
        if not 1 <= step <= last_step:
            raise ConfigError(f"{where} is of step {_describe(step)}, outside the run's steps 1 to {last_step} "
                              f"(the experiment's; --run-steps N for a run given --steps N)")
        client = line.get("client")
        if "client" in line and not clients:
            raise ConfigError(f"{where} (step {step}) is of client {_describe(client)}: a run with [clients], "
                              f"and this experiment has none")
        if clients and not (isinstance(client, int) and not isinstance(client, bool) and 0 <= client < clients):
            raise ConfigError(f"{where} (step {step}) names no client of the run's {clients} (got "
                              f"{_describe(client)}): each line of a run with [clients] is one client's")
        previous = previous_of.get(client)
        of = "" if client is None else f" of client {client}"
        if previous is not None and step <= previous[0]:
            raise ConfigError(f"{where}: step {step}{of} is written twice (lines {previous[1]} and {number})"
                              if step == previous[0] else
                              f"{where}: step {step}{of} comes after step {previous[0]} (line {previous[1]}): "
                              f"a trace's steps only increase")
        previous_of[client] = (step, number)
        where = f"{where} (step {step}{of})"
        if "loss" in line and not _is_number(line["loss"]):
            raise ConfigError(f"{where}: 'loss' must be a number, got {_describe(line['loss'])}")
        for field in ("grads", "params"):
            tensors = line.get(field, {})
            if not isinstance(tensors, dict):
                raise ConfigError(f"{where}: {field!r} must be an object of named arrays")
            for name, value in tensors.items():
                if not (isinstance(value, list) or _is_number(value)):
                    raise ConfigError(f"{where}: {field}.{name} must be an array of numbers")
        for name, shape in shapes.items():
            if name in line.get("grads", {}):
                views[name if client is None else f"{name}@{client}"].append(
                    (step, _rows(line["grads"][name], shape, f"{where}: {name}")))
    return views


def _check_settings(exp: Experiment, seed: Any, first: Any, last: Any, public_fraction: Any, micro_batches: Any,
                    run_steps: Any, max_bytes: Any) -> None:
    """``ConfigError`` naming the first bad setting."""
    if not is_whole(seed) or seed < 0:
        raise ConfigError(f"audit: --seed must be an integer >= 0, got {seed!r}")
    if not is_whole(first) or first < 1 or (last is not None and (not is_whole(last) or last < first)):
        raise ConfigError(f"audit: --steps must be FIRST:LAST with 1 <= FIRST <= LAST, got {first!r}:{last!r}")
    if not _is_number(public_fraction) or not 0 < public_fraction < 1:
        raise ConfigError(f"audit: --public-fraction must be a fraction in (0, 1), got {public_fraction!r}")
    if not is_whole(run_steps) or run_steps < 1:
        raise ConfigError(f"audit: --run-steps must be an integer >= 1, got {run_steps!r}")
    if not is_whole(max_bytes) or max_bytes < 1:
        raise ConfigError(f"audit: --max-trace-bytes must be an integer >= 1, got {max_bytes!r}")
    batch = exp.cuts[0][0] if exp.cuts and exp.cuts[0] else None
    if not is_whole(micro_batches) or micro_batches < 1 or (micro_batches > 1 and (batch is None or
                                                                                   batch % micro_batches)):
        raise ConfigError(f"audit: --micro-batches must be an integer >= 1 that divides the batch of "
                          f"{batch} rows, got {micro_batches!r}")


def run_audit(experiment: str, trace: Path, seed: int | None = None, first: int = 1, last: int | None = None,
              public_fraction: float = 0.5, mlp: bool = False, micro_batches: int | None = None,
              run_steps: int | None = None, max_bytes: int = DEFAULT_MAX_TRACE_BYTES,
              window: int | None = None) -> dict[str, dict[str, float]]:
    """The audit of the run of ``experiment`` (a name, an experiment file or the auditing party's stage
    file; ``seed``: the run's, default the experiment's; ``micro_batches``: the run's, default the
    experiment's; ``run_steps``: the run's last step, default the experiment's) recorded in ``trace`` (read
    up to ``max_bytes``), over its traced steps ``first`` to ``last``: ``{"labels": figures, "inputs":
    figures}``, each present when the trace holds that view and ``experiment`` defines the stage whose secret
    it is (a stage file: its own). The figures the live meter reports too are scored on the steps the meter
    scores (``meter.sampled``) in windows of ``window`` steps counted from ``first``; by default one window
    of the range ``first`` to ``last`` when ``last`` is given (so the audit of a meter window's steps gives
    that window's figures exactly), else the experiment's meter window. Every line of the trace is validated
    first. Raises ``ConfigError`` for a
    missing, oversized or malformed trace, one that holds neither view, an experiment whose data cannot pair
    with it, or bad settings."""
    exp = load_experiment(experiment)
    if len(exp.stage_names) < 2:
        raise ConfigError("audit: a one-stage experiment has no cut to audit")
    seed = exp.seed if seed is None else seed
    micro_batches = exp.micro_batches if micro_batches is None else micro_batches
    run_steps = exp.steps if run_steps is None else run_steps
    _check_settings(exp, seed, first, last, public_fraction, micro_batches, run_steps, max_bytes)
    if window is not None and (not is_whole(window) or window < 1):
        raise ConfigError(f"audit: --window must be an integer >= 1, got {window!r}")
    if window is None:
        window = last - first + 1 if last is not None else window_steps(exp.eval_every)
    # A party's stage file holds only its own data: it audits what the other party learns of its secret.
    # Both views are validated, whichever this party can pair with its data.
    owners = _owners(exp)
    shapes = {name: shape for owner in owners for name, shape in owner.shapes.items()}
    views = read_views(trace, shapes, run_steps, max_bytes, exp.clients.count if exp.federated else 0)
    views = {name: [(step, rows) for step, rows in view if first <= step and (last is None or step <= last)]
             for name, view in views.items()}
    report: dict[str, dict[str, float]] = {}
    for owner in owners:
        label_view, input_view = views.get(owner.label_view), views.get(owner.input_view)
        if label_view and exp.has_stage(exp.label_owner):
            data = exp.build_data(seed, client=owner.client, stage=exp.label_owner)
            rows, labels = _paired(label_view, data.true_targets, "labels", trace)
            try:
                metered = _metered(label_view, first, window, 1)
                report["labels" + owner.suffix] = {**audit.label_attacks(rows, labels, seed, metered),
                                                   **_averaged(label_view, data)}
            except ValueError as e:
                raise ConfigError(f"audit: the labels of {exp.label_owner!r}{owner.suffix} cannot be attacked: "
                                  f"{e}") from None
        if input_view and exp.has_stage(owner.stage):
            data = exp.build_data(seed, client=owner.client, stage=owner.stage)
            z, x = _paired(input_view, data.features, "input rows", trace)
            batches = [len(rows) for _, rows in input_view]       # each step's whole batch, as the meter
            batches_metered = [bool(flag) for flag in _metered(input_view, first, window, 1, per_row=False)]
            try:
                report["inputs" + owner.suffix] = audit.input_attacks(z, x, public_fraction, seed, mlp,
                                                                      batches=batches, metered=batches_metered)
            except ValueError as e:
                raise ConfigError(f"audit: the inputs{owner.suffix} cannot be attacked: {e}") from None
    if not report:
        pairable = [name for owner in owners for name, have in ((owner.label_view, exp.label_owner),
                                                                   (owner.input_view, owner.stage))
                    if exp.has_stage(have)]
        names = list(dict.fromkeys(name.split("@")[0] for name in pairable))
        raise ConfigError(f"audit: {trace} holds no {' or '.join(names)} on steps {first} to "
                          f"{'the last' if last is None else last}, which is what {experiment}'s data can be "
                          f"paired with: trace the run with --trace (and, with --trace-params, name "
                          f"{' or '.join(names)})")
    return report


@dataclass(frozen=True)
class _Owner:
    """One data owner of a run as the audit pairs it: the trace's views of what it sent (``input_view``) and
    was sent (``label_view``), each a step's ``shapes``, its ``stage`` and ``client`` (its data), and the
    ``suffix`` that names it in the report (``labels/a``, ``inputs/f@1``; "" for a run's one data owner)."""

    stage: str
    client: int | None
    label_view: str
    input_view: str
    shapes: dict[str, tuple[int, ...]]
    suffix: str


def _owners(exp: Experiment) -> list[_Owner]:
    """The data owners of ``exp``: the first stage; each client (its lines name it: ``read_views``' ``NAME@K``);
    each feature party (its views named ``NAME/PARTY``, as its stage and the label owner trace them)."""
    first = exp.stage_names[0]
    if exp.vertical:        # a party's embedding and its gradient have its own cut's shape
        return [_Owner(party, None, f"{LABEL_VIEW}/{party}", f"{INPUT_VIEW}/{party}",
                       {f"{view}/{party}": tuple(exp.cuts[index]) for view in (LABEL_VIEW, INPUT_VIEW)},
                       f"/{party}") for index, party in enumerate(exp.data_owners)]
    shapes = {LABEL_VIEW: tuple(exp.cuts[-1]),         # what the last stage sends back up
              INPUT_VIEW: tuple(exp.cuts[0])}          # what the first stage sends down
    if exp.federated:
        return [_Owner(first, k, f"{LABEL_VIEW}@{k}", f"{INPUT_VIEW}@{k}", shapes if k == 0 else {},
                       f"/{client_stage_name(first, k)}") for k in range(exp.clients.count)]
    return [_Owner(first, None, LABEL_VIEW, INPUT_VIEW, shapes, "")]


def _metered(view: View, first: int, window: int, parts: int, per_row: bool = True) -> np.ndarray:
    """A flag per row (``per_row``) or per micro-batch (``parts`` a step) of ``view``: whether the live meter
    scores its step (``meter.sampled`` in windows of ``window`` from ``first``). When the trace holds none of
    those steps (``--trace-every``), every traced one is scored instead."""
    flags = [sampled(step - first, window) for step, _ in view]
    if not any(flags):
        flags = [True] * len(flags)
    if per_row:
        return np.concatenate([np.full(len(rows), flag) for flag, (_, rows) in zip(flags, view)])
    return np.repeat(np.array(flags, bool), parts)


def _averaged(view: View, data: Any) -> dict[str, float]:
    """The data owner's per-row averaging attack on the gradient rows of ``view`` (every audited step, each row
    numbered as ``data`` walks its rows): ``averaged_recovery_1`` and ``_10`` beside their chance, as the live
    meter's whole-run figures (``AttackMeter``) are over the same steps; {} for data without row numbers."""
    if not view or not hasattr(data, "step_rows"):
        return {}
    meter = AttackMeter(LABELS, window=view[-1][0])
    for step, sent in view:
        meter.observe(step, 0, np.asarray(data.true_targets(step)), sent, np.asarray(data.step_rows(step)))
    figures = meter.close(view[-1][0], last=True) or {}
    return {name: value for name, value in figures.items() if name.startswith("averaged_recovery")}


def _paired(view: View, secret_of: Any, what: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """The view's rows and the secret rows of the same steps, stacked; ``ConfigError`` when they do not pair
    (the trace is of another experiment or seed)."""
    rows, secrets = [], []
    for step, sent in view:
        secret = np.asarray(secret_of(step))
        if len(secret) != len(sent):
            raise ConfigError(f"audit: {path}: step {step} sent {len(sent)} rows but the experiment's {what} of "
                              f"that step are {len(secret)}: is the trace of this experiment and --seed?")
        rows.append(sent.reshape(len(sent), -1))
        secrets.append(secret.reshape(len(secret), -1) if secret.ndim > 1 else secret)
    return np.concatenate(rows), np.concatenate(secrets)


def audit_text(report: dict[str, dict[str, float]]) -> str:
    """The report as lines: ``labels: label_recovery 1.000 (chance 0.100), ...``."""
    out = []
    for view, figures in report.items():
        shown = [f"{name} {value:.3f} (chance {figures[name + '_chance']:.3f})"
                 for name, value in figures.items() if not name.endswith("_chance") and name + "_chance" in figures]
        shown += [f"{name} {value:.4f} (chance {figures['reconstruction_mse_chance']:.4f})"
                  for name, value in figures.items() if name.endswith("_reconstruction_mse")]
        out.append(f"{view}: " + ", ".join(shown))
    return "\n".join(out)
