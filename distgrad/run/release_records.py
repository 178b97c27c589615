"""What a stage keeps of the privacy of its runs: the run's noise secret, every release of the run, each row's
releases over all the runs it serves, and the runs whose randomized labels crossed.

A ``ReleaseRecords`` is held by the stage's ``run.stage_state.StageState`` and rolls back with it: a
checkpoint holds the secret and the release counts (``checkpoint_meta``, ``arrays``), a resume or a rollback
takes them back (``load``, ``restart``). With a checkpoint directory the releases are also written there
before each one leaves (``DIR/.INSTANCE.released``, ``.lifetime.json``, ``.label_dp_runs.json``), so that a
stage resumed after kill -9 still refuses a step computed again on other input, and a row's releases
compose over every run (docs/privacy.md).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

import numpy as np

from distgrad.config.defended import label_owner_sends_gradients, privacy_budget
from distgrad.errors import CheckpointWriteError, ConfigError
from distgrad.jsontext import json_text
from distgrad.privacy.releases import (COUNTS, HELD_OUT, HELD_OUT_AHEAD, HELD_OUT_STREAM, LABEL_RUNS_SUFFIX,
                                      LIFETIME_SUFFIX, LabelRuns, Lifetime, Release, fresh_secret)
from distgrad.run.options import StageOptions
from distgrad.stage.checkpoint import Checkpoint, stage_token
from distgrad.stage.stage import Stage, batch_mixing_of
from distgrad.wire.wirecodec import GRADIENT, Senders


class ReleaseRecords:
    """The privacy records of the runs of one stage, hooked to what it sends (``senders``' defense and taps).

    ``live_run`` gives the id of the run in progress (the stage's ``run_id``), which each release is
    recorded under. File errors raise ``CheckpointWriteError``; a checkpoint whose records cannot be read,
    ``ConfigError``. ``ledger`` and ``lifetime`` stay the same objects for its whole life (the stage holds them
    too, and reads the ledger on a step's path).
    """

    def __init__(self, opts: StageOptions, senders: Senders, live_run: Callable[[], str],
                 log: logging.Logger) -> None:
        self.opts, self.log, self._live_run = opts, log, live_run
        self.defense = senders.defense
        exp = opts.experiment
        # The run's noise secret and every release of the run (None: no defense
        # draws noise). With a checkpoint directory they are also appended to a file there before each
        # release leaves, so that a resume after kill -9 still refuses a step computed again on other input.
        self.ledger = self.defense.ledger if self.defense is not None else None
        # The run's secret: the ledger's, which a label owner's randomized labels (label_dp) share, or theirs
        # alone (None: nothing of this stage draws from one). Kept in each checkpoint's meta.
        label_dp = exp.has_stage(opts.stage) and exp.spec(opts.stage).defenses.label_dp is not None
        self.secret = (self.ledger.key if self.ledger is not None else exp.run_secret(opts.stage)
                       if label_dp else None)
        self.released_file = (opts.checkpoint_dir / f".{stage_token(opts.instance)}.released"
                              if opts.checkpoint_dir is not None and self.ledger is not None else None)
        if self.ledger is not None and self.released_file is not None:
            self.ledger.on_release = self._append_release
        # Every run's per-row release counts (a row's budget is spent over all the runs this stage serves): in
        # memory across the runs of this process, and in DIR/.INSTANCE.lifetime.json with a checkpoint directory.
        # (A ledger kept only to refuse a step computed again on other input, RR-with-prior's, noises nothing.)
        noised = self.defense is not None and self.defense.defenses.on_rows
        self.lifetime = (Lifetime(opts.checkpoint_dir / f".{stage_token(opts.instance)}{LIFETIME_SUFFIX}"
                                  if opts.checkpoint_dir is not None else None) if noised else None)
        if self.ledger is not None and self.lifetime is not None:
            self.ledger.on_count = self._count_lifetime
            self.ledger.earlier_source = self.lifetime.source
        # The runs whose randomized labels (label_dp) crossed: each run draws its own, so a label's epsilons add
        # up over the runs this stage serves; kept as the release counts are (``LabelRuns``).
        self.label_runs = (LabelRuns(opts.checkpoint_dir / f".{stage_token(opts.instance)}{LABEL_RUNS_SUFFIX}"
                                     if opts.checkpoint_dir is not None else None)
                           if label_dp and label_owner_sends_gradients(exp, opts.stage) else None)
        if self.label_runs is not None:
            senders.taps[GRADIENT].append(self._labels_released)

    def begin(self, run_id: str) -> None:
        """The new run ``run_id`` (already the live one) begins: a run served before under this id stays an
        earlier run, and the run draws a secret of its own."""
        try:        # a run served before under this id (the data owner names its run) stays an earlier run
            for counted in (self.lifetime, self.label_runs):
                if counted is not None:
                    counted.retire(run_id)
        except OSError as e:
            raise CheckpointWriteError(f"cannot keep the release counts of the earlier run {run_id}: "
                                       f"{e.strerror or e}") from e
        if self.ledger is not None:
            self.ledger.new_run(fresh_secret())     # two runs never share a noise draw (nor randomized labels)
            self._rewrite_released([])
            self._join_lifetime(run_id)             # but a row's releases compose over all of them
        elif self.secret is not None:
            self.secret.value = fresh_secret()

    def restart(self) -> None:
        """The live run rolls back to step 0: the same run, with its secret and the releases it already made."""
        if self.ledger is not None:
            self.ledger.restore(self.ledger.secret, None, [], 0)

    def checkpoint_meta(self) -> dict[str, Any]:
        """What a checkpoint's metadata keeps of them: the run's secret, and the sigma its releases so far were
        noised with (``check_sigma``)."""
        meta: dict[str, Any] = {}
        if self.secret is not None:
            meta["noise_secret"] = f"{self.secret.value:x}"
        if self._target_sigma is not None:      # what the releases so far were noised with (``check_sigma``)
            meta["clip_target"] = {"sigma": self._target_sigma, "steps": self.opts.total_steps}
        return meta

    def arrays(self, step: int) -> dict[str, np.ndarray]:
        """The ledger's counts after ``step`` for a checkpoint ({} without a ledger)."""
        return self.ledger.arrays(step) if self.ledger is not None else {}

    def load(self, ckpt: Checkpoint) -> None:
        """Back to what ``ckpt`` holds (its run's secret and release counts), with the releases of its run that
        the file of releases holds since; ``ConfigError`` for a checkpoint that holds no secret or counts it
        cannot read."""
        if self.secret is not None:
            secret = ckpt.meta.get("noise_secret")
            if not isinstance(secret, str):
                raise ConfigError(f"checkpoint {ckpt.path} holds no noise secret: it was written before the "
                                  f"defenses drew from one; start a new run (without --resume)")
            self.secret.value = int(secret, 16)
        if self.ledger is not None:
            released = self._released_since(ckpt.run, 0)
            try:
                self.ledger.restore(self.ledger.secret, ckpt.arrays.get(COUNTS), released, ckpt.step,
                                    ckpt.arrays.get(HELD_OUT, np.zeros(2, np.int64)), ckpt.arrays.get(HELD_OUT_AHEAD))
            except ValueError as e:
                raise ConfigError(f"checkpoint {ckpt.path}: its count of releases cannot be read: {e}") from e
            # Written again whole: a line a kill -9 tore would otherwise take the next release appended. Every
            # held-out release of the run stays: a later rollback to an older checkpoint counts those after it.
            self._rewrite_released([*self.ledger.pending.values(),
                                    *(r for r in released if r.stream.startswith(HELD_OUT_STREAM + "/"))],
                                   ckpt.run)
            self._join_lifetime(ckpt.run)

    def privacy_fields(self, steps: int, stage: Stage) -> dict[str, Any]:
        """The summary's ``privacy`` field of this stage after ``steps`` steps (rounds, with several clients):
        what its defenses guarantee (``config.defended.privacy_budget``); {} without defenses."""
        ledger, name = self.ledger, self.opts.stage
        return privacy_budget(self.opts.experiment, [name], steps, self.opts.seed,
                              {} if ledger is None else {name: ledger.worst}, self.opts.total_steps,
                              {} if ledger is None else {name: ledger},
                              {} if ledger is None else {name: ledger.lifetime_worst}, batch_mixing_of([stage]),
                              {} if self.label_runs is None else {name: self.label_runs.lifetime(self._live_run())})

    @property
    def _target_sigma(self) -> float | None:
        """The sigma a target form ``clip_noise = { epsilon = E }`` chose for this run's planned steps (None:
        no target form)."""
        clip = self.defense.defenses.clip_noise if self.defense is not None else None
        return float(clip.noise) if clip is not None and clip.epsilon is not None else None

    def check_sigma(self, ckpt: Checkpoint) -> None:
        """``ConfigError`` when ``ckpt``'s releases were noised with another target-form sigma than this run
        would use (a resume with other ``--steps``): the releases before and after would compose to more than
        the target, which counts every release at one sigma."""
        saved, sigma = ckpt.meta.get("clip_target"), self._target_sigma
        if sigma is None or not isinstance(saved, dict) or saved.get("sigma") == sigma:
            return
        raise ConfigError(
            f"checkpoint {ckpt.path}: this run's clip_noise sigma {saved.get('sigma')} was chosen for the releases "
            f"of its {saved.get('steps')} planned steps; with {self.opts.total_steps} steps the target form would "
            f"choose {sigma:g}, and the releases before and after would compose to more than its epsilon. Resume "
            f"with --steps {saved.get('steps')}, or start a new run (without --resume) planned for more steps")

    @property
    def _sigma(self) -> float:
        """The noise (in units of C) of the label owner's cut gradients in this run (0: none)."""
        clip = self.defense.defenses.clip_noise if self.defense is not None else None
        return float(clip.sigma or 0.0) if clip is not None else 0.0

    def _count_lifetime(self, counts: np.ndarray, run: str | None = None) -> None:
        """Before a release leaves: the per-row ``counts`` of ``run`` (default: the live one) in the stage's
        ``Lifetime`` (its file rewritten)."""
        assert self.lifetime is not None
        try:
            self.lifetime.record(self._live_run() if run is None else run, self._sigma, counts)
        except OSError as e:
            raise CheckpointWriteError(f"cannot record the per-row release counts in {self.lifetime.path}: "
                                       f"{e.strerror or e}") from e

    def _labels_released(self, received: Callable[[], np.ndarray], stream: str, step: int) -> None:
        """Before a gradient computed from the run's randomized labels leaves: the run in ``label_runs``."""
        assert self.label_runs is not None
        run_id = self._live_run()
        if run_id in self.label_runs.runs:
            return
        try:
            self.label_runs.record(run_id)
        except OSError as e:
            raise CheckpointWriteError(f"cannot record the run's randomized labels in {self.label_runs.path}: "
                                       f"{e.strerror or e}") from e
        earlier = len(self.label_runs.runs) - 1
        if earlier:
            self.log.warning("privacy: %d earlier run(s) of this stage released other randomized labels of the same "
                             "rows; their label_dp epsilons add up with this run's", earlier)

    def _join_lifetime(self, run: str) -> None:
        """The ledger counts ``run``'s releases against every other run's (``Lifetime.earlier``). Its own
        counts are those the ledger holds now (a resume's: its checkpoint's and the releases since), or those
        the lifetime file recorded, if more (releases the file of releases no longer holds): never added to."""
        if self.ledger is None or self.lifetime is None:
            return
        recorded = self.lifetime.runs.get(run)
        if recorded is not None and len(recorded[1]):
            counts = self.ledger.counts
            size = max(len(counts), len(recorded[1]))
            merged = np.zeros(size, np.int64)
            merged[:len(counts)] = counts
            merged[:len(recorded[1])] = np.maximum(merged[:len(recorded[1])], recorded[1])
            self.ledger.counts = merged
        self.ledger.earlier = self.lifetime.earlier(run, self._sigma)
        spent = float(self.ledger.earlier.max(initial=0.0))
        if spent > 0:
            self.log.info("privacy: earlier runs of this stage released a row up to %.4g times (at this run's "
                          "noise, counted in %s); the run's releases compose with theirs%s", spent,
                          self.lifetime.source, "" if self.ledger.limit is None else
                          f", against the budget of {self.ledger.limit} releases its sigma was chosen for")
        if self.ledger.counts.any():
            self._count_lifetime(self.ledger.counts, run)

    def _append_release(self, release: Release) -> None:
        """Before a release leaves: its line in the file of the run's releases."""
        assert self.released_file is not None
        try:
            with open(self.released_file, "a", encoding="utf-8") as f:
                f.write(json_text({"run": self._live_run(), **release.as_json()}) + "\n")
        except OSError as e:
            raise CheckpointWriteError(f"cannot record a release in {self.released_file}: {e.strerror or e}") from e

    def _released_since(self, run: str, step: int) -> list[Release]:
        """The releases of ``run`` after ``step`` the file holds (a torn last line is skipped: its release
        never left)."""
        if self.released_file is None or not self.released_file.exists():
            return []
        found = []
        for line in self.released_file.read_text(encoding="utf-8").splitlines():
            try:
                entry = json.loads(line)
                release = Release.from_json(entry)
            except (ValueError, KeyError, TypeError):
                continue
            if entry.get("run") == run and release.step > step:
                found.append(release)
        return found

    def _rewrite_released(self, releases: list[Release], run: str | None = None) -> None:
        """The file of releases holds only ``releases`` (every release of the run ``run``, by default the
        live one)."""
        if self.released_file is None:
            return
        run = self._live_run() if run is None else run
        text = "".join(json_text({"run": run, **r.as_json()}) + "\n" for r in releases)
        tmp = self.released_file.with_name(self.released_file.name + ".tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(self.released_file)
        except OSError as e:
            raise CheckpointWriteError(f"cannot rewrite {self.released_file}: {e.strerror or e}") from e
