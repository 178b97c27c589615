"""What one stage's noise is keyed by in one run, and what it has released: its ``NoiseLedger``.

Every noise draw of a stage's defenses comes from the run's *noise secret* (``fresh_secret``: random bytes
drawn when the run begins, never the run's seed, which the other party knows), the stage, the tensor's
stream, the step and the digest of the values the noise is added to (``defenses.defense_rng``). So two runs
never share a draw, and a step computed again on the same values (a resume, a rollback) draws the same noise:
the resumed run is bitwise the uninterrupted one. A step computed again on *other* values would be answered
with independent noise, a second release of the same rows; the ledger refuses it instead
(``NoiseReuseError``), from the digests of every step of the run released so far (a stage process keeps
them in a file beside its checkpoints, so they outlive a kill -9 and a rollback behind the last checkpoint).

The ledger also counts how many times each row was released (each step it is in, each peer its gradient
goes to) for the per-row budget (``privacy.budget``); with a ``limit`` (the target form of ``clip_noise``) it
refuses the release that would take a row past it (``BudgetExhausted``), before anything is sent.

A data owner's evaluations and predictions (held-out or new rows) are released with noise too; the ledger
counts them apart (``release_held_out``: each evaluation releases every held-out row once more; a prediction
chunk releases its rows once), since their rows are not the training rows the per-row counts number.

The counts are a row's releases in *this* run; a label owner serves many runs (``--keep-serving``, a restart with
the same stage file), each with fresh noise, and a row's releases compose over all of them. ``Lifetime`` holds
every run's counts by run id (in memory, and with a checkpoint directory in a file there, rewritten atomically
before each release leaves); the ledger's ``earlier`` is what the other runs released of each row, which the
limit counts too (``lifetime_worst``). A new run under the id of a run served before keeps that run apart
(``Lifetime.retire``). The runs whose randomized labels (``label_dp``) left the stage are counted the same way
(``LabelRuns``): each is a fresh response of every label, and their epsilons add up.

The secret and the counts are checkpointed with the stage (``arrays`` / ``restore``), so a resumed run keeps
both. The secret lives in a ``RunSecret``, which a label owner's randomized labels (``label_dp``) share with
its ledger: they are drawn from the same secret as its noise, never from the seed.

``NOISE_SECRET_VARIABLE`` is for tests and for reproducing a run with the in-process reference only: it makes
every run draw from the same secret, so two runs then repeat their noise (and their randomized labels).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from distgrad.errors import BudgetExhausted, ConfigError, NoiseReuseError
from distgrad.jsontext import json_text

NOISE_SECRET_VARIABLE = "DISTGRAD_NOISE_SECRET"   # testing only: a fixed secret (hex) for every run
SECRET_BYTES = 16                                  # 128 random bits a run
COUNTS = "privacy/releases"                        # the checkpoint array of the per-row release counts
HELD_OUT = "privacy/held_out_releases"             # and of the releases of held-out rows (evaluations;
                                                   # then the final evaluation's of the test rows, if any)
# and those of steps after the checkpoint's that it counted (made before it was saved: the evaluation after its
# step, the final one), which a resume finds in the file of releases too and must not count again: JSON as uint8
HELD_OUT_AHEAD = "privacy/held_out_ahead"
HELD_OUT_STREAM = "held_out"                       # a held-out release's stream in the file: held_out/PURPOSE/ROWS
LIFETIME_SUFFIX = ".lifetime.json"                 # DIR/.INSTANCE.lifetime.json: every run's per-row counts
LABEL_RUNS_SUFFIX = ".label_dp_runs.json"          # DIR/.INSTANCE.label_dp_runs.json: runs that released labels
UNNUMBERED_ROW = 0                                 # what a release of data without numbered rows counts as
UNBOUNDED_RELEASES = 2**62                         # ``lifetime_worst`` after a release without noise: no bound


# The purposes whose held-out releases a checkpoint counts (``HELD_OUT``: releases, rows of each, in this order):
# every evaluation's, and the final evaluation's of the test rows (with a validation split).
_CHECKPOINTED_HELD_OUT = ("evaluation", "test")


def _ahead_keys(ahead: np.ndarray | None) -> set[tuple[int, str, str]]:
    """The (step, purpose, digest) of each held-out release a checkpoint's ``HELD_OUT_AHEAD`` names."""
    if ahead is None:
        return set()
    keys = json.loads(np.asarray(ahead, np.uint8).tobytes().decode())       # ValueError when damaged
    if not isinstance(keys, list) or not all(isinstance(k, list) and len(k) == 3 and isinstance(k[0], int)
                                             and isinstance(k[1], str) and isinstance(k[2], str) for k in keys):
        raise ValueError(f"the held-out releases ahead of the checkpoint are not [step, purpose, digest] "
                         f"triples: {keys!r:.80}")
    return {(k[0], k[1], k[2]) for k in keys}


def fresh_secret(override: int | None = None) -> int:
    """A new run's noise secret: ``override`` when given, else ``NOISE_SECRET_VARIABLE`` (hex) when set
    (testing: every run then draws the same noise), else 128 bits from ``os.urandom``. Raises
    ``ConfigError`` for a variable that is not hex."""
    if override is not None:
        return int(override)
    text = os.environ.get(NOISE_SECRET_VARIABLE, "").strip()
    if text:
        try:
            return int(text, 16)
        except ValueError as e:
            raise ConfigError(f"{NOISE_SECRET_VARIABLE}={text!r}: the noise secret must be hexadecimal") from e
    return int.from_bytes(os.urandom(SECRET_BYTES), "big")


def digest(x: np.ndarray) -> str:
    """The SHA-256 of ``x``'s dtype, shape and bytes, in hex: what identifies the values of a release."""
    h = hashlib.sha256(f"{x.dtype.str}{x.shape}".encode())
    h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


class RunSecret:
    """The noise secret of one stage's current run (``value``, an int of ``SECRET_BYTES`` random bytes), shared
    by everything of the stage that draws from it: its ``NoiseLedger`` and its randomized labels
    (``label_dp``), which read ``value`` each time they draw, so a new run (``NoiseLedger.new_run``) or a
    resume (``NoiseLedger.restore``) rekeys them all at once. ``value`` defaults to ``fresh_secret()``."""

    def __init__(self, value: int | None = None) -> None:
        self.value = fresh_secret(value)

    def __repr__(self) -> str:
        return "RunSecret(...)"          # never printed: it is what the other party must not learn


def _weight(sigma: float, other: float) -> float:
    """What one release at noise ``other`` costs in releases at noise ``sigma`` (both in units of C): a
    Gaussian mechanism's Renyi divergence is proportional to 1 / sigma^2 at every order, so k releases at
    ``other`` compose exactly as k * (sigma / other)^2 at ``sigma``. Without noise a release costs everything."""
    if sigma == other or sigma == 0:
        return 1.0
    return math.inf if other == 0 else (sigma / other) ** 2


class Lifetime:
    """Every run's per-row release counts a stage has served, by run id, with the sigma (noise in units of C)
    of each run's releases: what a row's budget is spent by over the stage's lifetime, not only in one run.

    ``path``: the file that keeps them across processes (``DIR/.INSTANCE.lifetime.json``; None: in memory
    only, for the life of this process). Each ``record`` rewrites it atomically (a temporary file, then
    ``os.replace``), so a kill -9 leaves the old or the new one whole. A run's entry is *replaced* by its
    counts, never added to, so a resumed run (whose ledger holds the run's every release again: its
    checkpoint's counts and the file of releases since) does not count its releases twice. Deleting the
    file resets the lifetime budget: only do it knowingly (every earlier release still composes).
    Raises ``ConfigError`` for a file that is not one this class wrote."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.runs: dict[str, tuple[float, np.ndarray]] = {}
        if path is not None and path.exists():
            try:
                saved = json.loads(path.read_text(encoding="utf-8"))
                self.runs = {str(run): (float(entry["sigma"]), np.array([int(c) for c in entry["counts"]], np.int64))
                             for run, entry in saved["runs"].items()}
                if any(noise < 0 or not math.isfinite(noise) or (counts < 0).any() for noise, counts in self.runs.values()):
                    raise ValueError("a negative or non-finite sigma, or a negative count")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{path}: the per-row release counts of this stage's earlier runs cannot be "
                                  f"read ({e}); it is what the privacy budget of every run is counted against. "
                                  f"Restore it, or delete it knowingly (the earlier releases still compose)") from e

    def __repr__(self) -> str:
        return f"Lifetime({self.path}, {len(self.runs)} runs)"

    @property
    def source(self) -> str:
        """Where the counts are kept, for messages."""
        return str(self.path) if self.path is not None else "this process's memory (no --checkpoint-dir)"

    def earlier(self, run: str, sigma: float) -> np.ndarray:
        """Each row's releases by every run but ``run``, in releases at noise ``sigma`` (``_weight``; float)."""
        total = np.zeros(0, np.float64)
        for other, (noise, counts) in self.runs.items():
            if other == run or not counts.any():
                continue
            if len(counts) > len(total):
                total = np.concatenate([total, np.zeros(len(counts) - len(total))])
            weight, cost = _weight(sigma, noise), counts.astype(np.float64)
            if math.isinf(weight):
                cost[counts > 0] = math.inf          # (0 * inf would be nan: a row never released costs nothing)
            else:
                cost *= weight
            total[:len(counts)] += cost
        return total

    def retire(self, run: str) -> None:
        """A *new* run begins with the id ``run`` of a run served before (a data owner may name its run): the
        earlier run's counts are kept apart, under a name of their own (``retired_name``), at their own sigma,
        so the new run starts from none and counts the earlier one as earlier (``earlier``), never taking over
        its entry. Nothing when ``run`` is unknown. Raises ``OSError`` when the file cannot be rewritten."""
        if run in self.runs:
            self.runs[retired_name(run, self.runs)] = self.runs.pop(run)
            self._write()

    def record(self, run: str, sigma: float, counts: np.ndarray) -> None:
        """``run``'s per-row counts are now ``counts`` (released at noise ``sigma``); the file is rewritten
        before this returns. Raises ``OSError`` when it cannot be."""
        self.runs[run] = (float(sigma), np.array(counts, np.int64))
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        text = json_text({"runs": {r: {"sigma": noise, "counts": c.tolist()} for r, (noise, c) in self.runs.items()}})
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.path)


class LabelRuns:
    """The runs whose randomized labels (``label_dp``) a label owner has released: each run draws its own
    randomized response of every label from its fresh secret, so a data owner that opens k runs against the
    same label owner (``--keep-serving``, or a restart with the same stage file) gets k independent responses
    of each label, and their epsilons add up (pure differential privacy composes by addition: k runs at
    epsilon e are at most k*e-label-DP). A run counts once it has sent a gradient computed from its labels,
    however often it resumes.

    ``path``: the file that keeps the run ids across processes (``DIR/.INSTANCE.label_dp_runs.json``; None: in
    memory only, for the life of this process), rewritten atomically (a temporary file, then ``os.replace``)
    when a run first releases, before its gradient leaves. Deleting it resets the count: only do it knowingly
    (every earlier response still composes). Raises ``ConfigError`` for a file that is not one this class
    wrote."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.runs: list[str] = []
        if path is not None and path.exists():
            try:
                saved = json.loads(path.read_text(encoding="utf-8"))["runs"]
                if not isinstance(saved, list) or not all(isinstance(run, str) for run in saved):
                    raise ValueError(f"'runs' is not a list of run ids: {saved!r:.80}")
                self.runs = list(saved)
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ConfigError(f"{path}: the runs whose randomized labels this stage released cannot be read "
                                  f"({e}); the label_dp epsilon of every run adds up over them. Restore it, or "
                                  f"delete it knowingly (the earlier runs' labels still compose)") from e

    def __repr__(self) -> str:
        return f"LabelRuns({self.path}, {len(self.runs)} runs)"

    def record(self, run: str) -> None:
        """``run`` released randomized labels (nothing new when it is known); the file is rewritten before
        this returns. Raises ``OSError`` when it cannot be."""
        if run in self.runs:
            return
        self.runs.append(run)
        self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json_text({"runs": self.runs}), encoding="utf-8")
        os.replace(tmp, self.path)

    def retire(self, run: str) -> None:
        """A *new* run begins with the id ``run`` of a run that released labels before: the earlier one is kept
        under a name of its own (``retired_name``), so the new run counts once more when it releases. Raises
        ``OSError`` when the file cannot be rewritten."""
        if run in self.runs:
            self.runs[self.runs.index(run)] = retired_name(run, self.runs)
            self._write()

    def lifetime(self, run: str) -> int | None:
        """The runs that released the labels, ``run`` included if it did; None when no run but ``run`` did
        (the run's own epsilon is the lifetime's)."""
        return len(self.runs) if any(other != run for other in self.runs) else None


def retired_name(run: str, taken: Iterable[str]) -> str:
    """The name an earlier run ``run`` is kept under when a new run takes its id: ``RUN/earlier-K``, the first K
    not in ``taken`` (a run id of the wire never holds "/")."""
    names = set(taken)
    k = 1
    while f"{run}/earlier-{k}" in names:
        k += 1
    return f"{run}/earlier-{k}"


def reset_text(source: str) -> str:
    """How to reset a lifetime budget kept in ``source`` (``Lifetime.source``), and why only knowingly."""
    where = (f"delete {source} (with the label owner stopped)" if source.endswith(LIFETIME_SUFFIX)
             else "restart the label owner (its counts are in memory only)")
    return (f"To reset the budget, {where}, knowingly: the data owner keeps every earlier release, so the rows' "
            f"real epsilon is that of all of them")


@dataclass(frozen=True, eq=False)
class Release:
    """One tensor sent with noise: its ``step``, ``stream``, the ``digest`` of the values the noise was
    added to, and the row numbers it holds (int32; None: not counted per row)."""

    step: int
    stream: str
    digest: str
    rows: np.ndarray | None

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "stream": self.stream, "digest": self.digest,
                "rows": None if self.rows is None else self.rows.tolist()}

    @staticmethod
    def from_json(entry: Any) -> "Release":
        """Raises ``ValueError`` (or ``KeyError``/``TypeError``) for an entry that is not one."""
        rows = entry["rows"]
        return Release(int(entry["step"]), str(entry["stream"]), str(entry["digest"]),
                       None if rows is None else np.array([int(r) for r in rows], np.int32))


class NoiseLedger:
    """One stage's noise secret in its current run, the releases since its last checkpoint, and the
    per-row release counts of the run.

    ``secret``: the run's secret, or the ``RunSecret`` holding it (shared with the stage's randomized labels).
    ``limit``: the most releases a row may have, counting those of earlier runs (``earlier``; None: no limit).
    ``on_release`` is called with each new release before its values are noised (a stage process appends it
    to its file), ``on_count`` with the run's per-row counts after each release that counted rows, before its
    values are noised (a stage process records them in its ``Lifetime``).

    ``earlier``: each row's releases by the stage's other runs (float: releases at this run's noise,
    ``Lifetime.earlier``; empty: none, as in the in-process reference, whose one run is its lifetime), set by
    the stage when a run begins or resumes, and ``earlier_source`` where they are kept (for the message).

    ``unnumbered``: the stage's rows have no numbers (data without numbered rows, such as the ramp), so a
    release that names none counts as one more release of one example (``UNNUMBERED_ROW``), as the budget's
    plan assumes (every step releases it), never as no release. Without it such a release is not counted
    per row (a data owner's activations)."""

    def __init__(self, secret: int | RunSecret, limit: int | None = None,
                 on_release: Callable[[Release], None] | None = None, unnumbered: bool = False) -> None:
        self.key = secret if isinstance(secret, RunSecret) else RunSecret(secret)
        self.limit = limit
        self.unnumbered = unnumbered
        self.on_release = on_release
        self.pending: dict[tuple[int, str], Release] = {}
        self.counts = np.zeros(0, np.int64)
        self.held_out: dict[str, int] = {}          # purpose ("evaluation", "predict") -> releases
        self.held_out_rows: dict[str, int] = {}     # purpose -> rows in them
        self._held_out_seen: set[tuple[int, str, str]] = set()
        self.on_count: Callable[[np.ndarray], None] | None = None
        self.earlier = np.zeros(0, np.float64)
        self.earlier_source = ""

    @property
    def secret(self) -> int:
        """The run's noise secret (``key.value``)."""
        return self.key.value

    @secret.setter
    def secret(self, value: int) -> None:
        self.key.value = value

    def new_run(self, secret: int) -> None:
        """A new run: a new secret, nothing released in it (``earlier`` is the stage's to set)."""
        self.secret, self.pending, self.counts = secret, {}, np.zeros(0, np.int64)
        self.held_out, self.held_out_rows, self._held_out_seen = {}, {}, set()

    def release_held_out(self, step: int, purpose: str, values: str, rows: int) -> None:
        """Record that held-out or new rows (``rows`` of them, values of digest ``values``) are sent with noise
        for ``purpose`` (``"evaluation"`` after step ``step - 1``, ``"predict"`` chunk ``step``). The same
        values again at the same step draw the same noise (a resent message): nothing new."""
        if (step, purpose, values) in self._held_out_seen:
            return
        release = Release(step, f"{HELD_OUT_STREAM}/{purpose}/{int(rows)}", values, None)
        if self.on_release is not None:      # in the file of releases since the checkpoint: a kill -9 keeps it
            self.on_release(release)
        self._count_held_out(release)

    def _count_held_out(self, release: Release) -> None:
        """Count a ``release_held_out`` release (its stream ``held_out/PURPOSE/ROWS``) once."""
        _, purpose, rows = release.stream.split("/")
        key = (release.step, purpose, release.digest)
        if key in self._held_out_seen:
            return
        self._held_out_seen.add(key)
        self.held_out[purpose] = self.held_out.get(purpose, 0) + 1
        self.held_out_rows[purpose] = self.held_out_rows.get(purpose, 0) + int(rows)

    @property
    def worst(self) -> int:
        """The most times any one row was released so far."""
        return int(self.counts.max(initial=0))

    def lifetime(self) -> np.ndarray:
        """Each row's releases by every run of the stage: ``earlier`` plus this run's (float)."""
        size = max(len(self.counts), len(self.earlier))
        total = np.zeros(size, np.float64)
        total[:len(self.earlier)] += self.earlier
        total[:len(self.counts)] += self.counts
        return total

    @property
    def lifetime_worst(self) -> int:
        """The most releases any one row had over every run of the stage (releases at this run's noise,
        rounded up: ``Lifetime.earlier``); ``worst`` when no other run released a row; ``UNBOUNDED_RELEASES``
        when an earlier run released one without noise (sigma 0) and this one has noise."""
        top = float(self.lifetime().max(initial=0.0))
        return int(math.ceil(top - 1e-9)) if math.isfinite(top) else UNBOUNDED_RELEASES

    def release(self, step: int, stream: str, values: str, rows: np.ndarray | None) -> None:
        """Record that ``step`` sends on ``stream`` noise added to values of digest ``values`` holding
        ``rows``. The same values again (a step computed again): nothing new. Raises ``NoiseReuseError``
        for other values of a step already released, ``BudgetExhausted`` when a row would pass ``limit``."""
        key = (step, stream)
        known = self.pending.get(key)
        if known is not None:
            if known.digest == values:
                return
            raise NoiseReuseError(
                f"step {step} ({stream}) is computed again on other input than the first time (a resume or a "
                f"resend whose activations differ): answering would release the step's rows a second time. "
                f"Refused; the first answer stands. Send the step's activations as they were the first time, "
                f"or start a new run")
        if rows is None and self.unnumbered:
            rows = np.full(1, UNNUMBERED_ROW, np.int64)
        counted = None if rows is None else np.asarray(rows, np.int64).reshape(-1)
        if counted is not None and len(counted):
            if counted.min() < 0:
                raise ValueError(f"step {step}: negative row numbers")
            top = int(counted.max()) + 1
            if top > len(self.counts):
                self.counts = np.concatenate([self.counts, np.zeros(top - len(self.counts), np.int64)])
            ours = self.counts[counted] + np.bincount(counted, minlength=top)[counted]
            before = np.zeros(len(counted))
            inside = counted < len(self.earlier)
            before[inside] = self.earlier[counted[inside]]
            after = ours + before
            if self.limit is not None and after.max() > self.limit + 1e-9:
                at = int(np.argmax(after))
                row, total = int(counted[at]), float(after[at])
                told = f"{total:.4g}" if not float(total).is_integer() else f"{int(total)}"
                if before[at] > 0:
                    raise BudgetExhausted(
                        f"step {step}: row {row} would be released {told} times, more than the {self.limit} its "
                        f"privacy budget allows (clip_noise epsilon): the budget was spent by earlier runs of "
                        f"this label owner ({before[at]:.4g} releases of the row at this run's noise, counted "
                        f"in {self.earlier_source or 'its memory'}), and their releases compose with this "
                        f"run's. Nothing of this step was sent or applied. {reset_text(self.earlier_source)}")
                raise BudgetExhausted(
                    f"step {step}: row {row} would be released {told} times, more than the "
                    f"{self.limit} its privacy budget allows (clip_noise epsilon); nothing of this step was sent "
                    f"or applied, and the checkpoints are kept. The run stops here: a new run with more "
                    f"planned steps (sigma is chosen for them) or a larger epsilon can go further")
        release = Release(step, stream, values, None if counted is None else counted.astype(np.int32))
        if self.on_release is not None:
            self.on_release(release)
        self._record(release)
        if self.on_count is not None and release.rows is not None and len(release.rows):
            self.on_count(self.counts)      # before its values are noised and sent: a kill -9 loses none

    def _record(self, release: Release) -> None:
        self.pending[(release.step, release.stream)] = release
        if release.rows is not None and len(release.rows):
            rows = release.rows.astype(np.int64)
            top = int(rows.max()) + 1
            if top > len(self.counts):
                self.counts = np.concatenate([self.counts, np.zeros(top - len(self.counts), np.int64)])
            np.add.at(self.counts, rows, 1)

    def _pending_counts(self, after: int) -> np.ndarray:
        """The releases per row of the pending steps after ``after``."""
        extra = np.zeros(len(self.counts), np.int64)
        for release in self.pending.values():
            if release.step > after and release.rows is not None and len(release.rows):
                np.add.at(extra, release.rows.astype(np.int64), 1)
        return extra

    def arrays(self, step: int) -> dict[str, np.ndarray]:
        """The checkpoint of ``step``'s counts: every release up to ``step`` (later ones, of steps in
        flight, stay pending and come back with ``restore``)."""
        counted = [(self.held_out.get(p, 0), self.held_out_rows.get(p, 0)) for p in _CHECKPOINTED_HELD_OUT]
        if not counted[-1][0]:
            counted.pop()               # no test rows released: the layout of a checkpoint without them
        ahead = sorted(key for key in self._held_out_seen if key[0] > step)
        return {COUNTS: self.counts - self._pending_counts(step),
                **({HELD_OUT: np.array([n for pair in counted for n in pair], np.int64)} if counted[0][0] else {}),
                **({HELD_OUT_AHEAD: np.frombuffer(json_text(ahead).encode(), np.uint8).copy()} if ahead else {})}

    def restore(self, secret: int, counts: np.ndarray | None, pending: Iterable[Release], step: int,
                held_out: np.ndarray | None = None, ahead: np.ndarray | None = None) -> None:
        """Back to the checkpoint of ``step`` of the same run: its ``secret`` and ``counts`` (None: none
        released), with the releases of the run that were already made (``pending``, and those this ledger
        holds) kept, so a step released before is refused on other values, and those after ``step`` counted;
        ``held_out``: the checkpoint's evaluations and their rows (``HELD_OUT``; None: the counts stay as
        they are, a rollback within the process), ``ahead`` those of later steps it counted already
        (``HELD_OUT_AHEAD``). Raises ``ValueError`` for an ``ahead`` that is not what ``arrays`` writes."""
        self.secret = secret
        if held_out is not None:
            values = [int(v) for v in np.asarray(held_out, np.int64).reshape(-1)]
            self.held_out, self.held_out_rows, self._held_out_seen = {}, {}, _ahead_keys(ahead)
            for purpose, (releases, rows) in zip(_CHECKPOINTED_HELD_OUT, zip(values[0::2], values[1::2])):
                if releases:
                    self.held_out[purpose], self.held_out_rows[purpose] = releases, rows
        pending = list(pending)
        kept = {(r.step, r.stream): r for r in [*self.pending.values(), *pending]
                if not r.stream.startswith(HELD_OUT_STREAM + "/")}
        for release in pending:      # held-out rows released after the checkpoint, before a kill -9
            if release.stream.startswith(HELD_OUT_STREAM + "/") and release.step > step:
                self._count_held_out(release)
        self.counts = np.array(counts, np.int64) if counts is not None else np.zeros(0, np.int64)
        self.pending = {}
        for release in sorted(kept.values(), key=lambda r: (r.step, r.stream)):
            if release.step > step:
                self._record(release)
            else:
                self.pending[(release.step, release.stream)] = release     # counted in ``counts`` already
