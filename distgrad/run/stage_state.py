"""A stage's run state: the stage and its step engine, run id, checkpoints and trace, which roll back together.

Reliability (docs/reliability.md): on every (re)connect the stages roll back
to the newest step they all hold (a checkpoint, their live state, or the
initial state at step 0), so a run interrupted anywhere ends with the
parameters of an uninterrupted one. A stage process holds its checkpoint
directory's lock for its whole life (``lock_checkpoint_dir``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from distgrad.config.defended import attach_dp_sgd, budget_text, row_defense
from distgrad.config.prepare import Preparation
from distgrad.errors import CheckpointWriteError, ConfigError, OutputWriteError, StageError
from distgrad.run.metering import checkpointed_fields
from distgrad.run.options import StageOptions
from distgrad.run.release_records import ReleaseRecords
from distgrad.run.run_verdicts import RunVerdicts
from distgrad.stage.checkpoint import Checkpoint, CheckpointStore, StageLock, lock_stage, steps_on_disk
from distgrad.stage.engine import StepEngine, crossed_direction, crossed_names
from distgrad.stage.history import ParameterHistory
from distgrad.stage.records import TraceWriter, kept_test_fields, scores_text, to_lists, write_json, write_preparation
from distgrad.stage.stage import Stage
from distgrad.wire.codecs import Codec
from distgrad.wire.keys import CurveClient
from distgrad.wire.masking import SecureSumCodec, load_party_keys
from distgrad.wire.messages import LOSS_WITHHELD
from distgrad.wire.wirecodec import ACTIVATION, Senders, without_codec_state


EXTRA_PREFIX = "extra/"      # a checkpoint's arrays of its runner (``StageState.extra_arrays``), not of the stage
KEPT_PREFIX = "kept/"        # a checkpoint's arrays of what rolls back with the stage (``StageState.keep``)


class Kept(Protocol):
    """What rolls back with a stage and is checkpointed with it (a privacy meter, an input guard)."""

    def checkpoint_state(self, step: int) -> dict[str, np.ndarray]:
        """Its state after ``step``, the stage's live step, as arrays (at least one)."""

    def load_checkpoint_state(self, arrays: Mapping[str, np.ndarray] | None, step: int) -> None:
        """Back to what ``checkpoint_state`` gave after ``step`` (None: the run's start, or a checkpoint
        without it); ``ValueError`` for arrays it cannot take."""


def sent_codecs(opts: StageOptions) -> dict[str, Codec]:
    """The codecs this stage sends with: the experiment's, except that a feature party of secure aggregation
    masks its activations with the keys it shares with every other party (its CURVE key pair and
    ``--party-keys``, ``masking.load_party_keys``). Raises ``ConfigError`` when such a party lacks them, or
    when ``--party-keys`` is given to any other stage."""
    exp = opts.experiment
    party = exp.secure_aggregation and opts.role == "driving"
    if opts.party_keys is not None and not party:
        raise ConfigError("--party-keys is for a feature party of an experiment with secure_aggregation: the "
                          "other parties' public keys, whose pairwise masks hide its embedding")
    if not party:
        return exp.codecs
    if opts.party_keys is None or not isinstance(opts.security, CurveClient):
        raise ConfigError(f"secure_aggregation: feature party {opts.stage} needs its key pair and every other "
                          f"party's public key: run it with CURVE (--curve-secret, --server-key) and "
                          f"--party-keys DIR holding NAME.key of each other feature party")
    masks = load_party_keys(opts.party_keys, exp.data_owners, opts.stage, opts.security.public,
                            opts.security.secret)
    return {**exp.codecs, ACTIVATION: SecureSumCodec(len(exp.data_owners), masks)}


def step_engine(opts: StageOptions, stage: Stage) -> StepEngine:
    """The step engine of ``stage`` as ``opts`` run it: what it traces, what crosses the cut there, and the
    codecs and the defense of what it sends (``sent_codecs``, ``config.defended.row_defense``)."""
    return StepEngine(stage, opts.experiment.micro_batch_scale, trace_sent=opts.role == "serving",
                      trace_crossed=crossed_direction(opts.experiment, opts.role == "driving", opts.role == "serving"),
                      crossed_names=crossed_names(opts.experiment, opts.stage),
                      senders=Senders(sent_codecs(opts), row_defense(opts.experiment, opts.stage, opts.seed,
                                                                     opts.instance, opts.total_steps)))


class StageState:
    """A stage with its run id, checkpoints and trace: what rolls back together.

    Step 0 (the initial state) is always held: it is rebuilt from the seed and
    the ``--init`` overrides, which a restart repeats. Two collaborators roll
    back with it: the privacy records of its runs (``releases``,
    ``ReleaseRecords``) and the verdicts on the run's evaluations with the
    kept model and the final test (``run_verdicts``, ``RunVerdicts``).
    """

    def __init__(self, opts: StageOptions, checkpoint_each_step: bool = True) -> None:
        """``checkpoint_each_step``: the engine's every update is a step of the run (checkpointed every
        ``--checkpoint-every``); a stage serving several clients checkpoints at the end of a round instead."""
        self.opts = opts
        self.log = logging.getLogger(f"distgrad.{opts.instance}")
        self.engine = step_engine(opts, self._fresh())
        self.releases = ReleaseRecords(opts, self.senders, lambda: self.run_id, self.log)
        attach_dp_sgd(opts.experiment, self.stage, self.senders.defense)     # the label owner's DP-SGD
        # A driving stage with steps in flight keeps its parameters of the last S updates (staleness S).
        self.history = ParameterHistory(opts.steps_in_flight if opts.role == "driving" else 0)
        if checkpoint_each_step and opts.checkpoint_every:     # without one, no step of the engine's checkpoints
            self.engine.observers.append(lambda record: self.after_step(record.step))
        self.extra_meta: Callable[[], dict[str, Any]] = dict   # more to save with each checkpoint
        # More arrays to save with the checkpoint of a step (stored under ``EXTRA_PREFIX``).
        self.extra_arrays: Callable[[int], dict[str, np.ndarray]] = lambda step: {}
        self.kept: dict[str, Kept] = {}      # checkpointed and rolled back with the stage, by name (``keep``)
        self.resumed_step = 0                                  # of the checkpoint ``resume_latest`` loaded
        self.resumed_meta: dict[str, Any] = {}                 # its metadata
        self.resumed_extra: dict[str, np.ndarray] = {}         # its ``extra_arrays``
        self.run_id = ""
        self.owner = ""          # CURVE key of the client that opened the run ("" in plaintext)
        self.cpu_started = time.process_time()   # CPU time of this process when the run began here
        # A checkpoint is only valid for the same starting point: seed and --init overrides.
        self.meta = start_meta(opts)
        saved = self.meta.get("preparation")      # this party's data statistics, saved beside its parameters
        self.preparation = Preparation.from_json(saved, "the stage's [data]") if saved is not None else None
        self.store = (CheckpointStore(opts.checkpoint_dir, opts.instance, opts.experiment.fingerprint, self.meta)
                      if opts.checkpoint_dir is not None else None)
        self.trace: TraceWriter | None = None
        self.write_failed = False       # a checkpoint could not be written: no more attempts
        self.run_verdicts = RunVerdicts(opts)
        # Their parts read on a step's path, as attributes (the same objects for the stage's life): the ledger of
        # the run's releases (None: no defense draws noise), every run's per-row release counts (None: no defense
        # noises rows) and the verdicts taken (keep_best's best step, early stopping's last).
        self.ledger, self.lifetime = self.releases.ledger, self.releases.lifetime
        self.verdicts = self.run_verdicts.verdicts

    @property
    def stage(self) -> Stage:
        """The live stage (replaced by a rollback to step 0)."""
        return self.engine.stage

    @stage.setter
    def stage(self, stage: Stage) -> None:
        self.engine.stage = stage
        self.engine.reset()
        attach_dp_sgd(self.opts.experiment, stage, self.senders.defense)

    @property
    def senders(self) -> Senders:
        """What this stage encodes its outgoing tensors with; its residuals roll back with the stage."""
        return self.engine.senders

    @property
    def final_test(self) -> dict[str, Any] | None:
        """The final evaluation's scores with the step of the kept model (``record_test``; None: not yet)."""
        return self.run_verdicts.final_test

    @property
    def best_copy(self) -> dict[str, dict[str, np.ndarray]] | None:
        """keep_best's copy of the best step's parameters and forward state (``RunVerdicts.best_copy``)."""
        return self.run_verdicts.best_copy

    @property
    def plateau_at(self) -> int:
        """The step whose evaluation's loss a ReduceLROnPlateau took last."""
        return self.run_verdicts.plateau_at

    def _fresh(self) -> Stage:
        """The stage at step 0: built from its file and seed, then ``--load``'s values when given."""
        if self.opts.stage_factory is not None:
            stage = self.opts.stage_factory()
            stage.allow_nonfinite = self.opts.experiment.allow_nonfinite
            stage.label_dp = self.opts.experiment.training_labels(self.opts.stage, self.opts.seed)
        else:
            stage = Stage.from_experiment(self.opts.experiment, self.opts.stage, self.opts.seed, self.opts.init)
        if self.opts.load_path is not None:
            stage.load_parameters(self.opts.load_path)
        return stage

    def judged(self, step: int, result: dict[str, Any], last: bool, gives: bool) -> dict[str, Any]:
        """``result`` (the evaluation after ``step``; ``last``: the run's last step) with the verdicts this
        stage gives (``gives``: the last stage, by ``selection``) or passes on (those from below), each
        recorded here (``take_verdict``)."""
        result = self.run_verdicts.judge(step, result, last, gives)
        self.take_verdict(step, result)
        return result

    def take_verdict(self, step: int, evaluation: Mapping[str, Any]) -> None:
        """Record the verdict an evaluation after ``step`` carries (``best``, ``stop``); at the best so far,
        ``--save`` writes this stage's parameters now, and not again at the end. With checkpoints, step
        ``step``'s is saved again with the verdict (and, on the label owner, the evaluations it judged)."""
        stepped, best = self.run_verdicts.take(step, evaluation, self.stage)
        if best and self.opts.save_path is not None:
            self._write_parameters("the best evaluation so far (keep_best)")
        if evaluation.get("stop"):
            self.log.info("early stopping after step %d: the label owner ends the run here", step)
        if ("best" in evaluation or "stop" in evaluation or stepped) and self.store is not None \
                and self.stage.step == step:
            self.save(step)     # the checkpoint of this step holds its verdict: a resume here keeps it

    def kept_model(self) -> dict[str, dict[str, np.ndarray]] | None:
        """The model the final evaluation scores (``stage.kept_model``): keep_best's copy of the best step's
        parameters and forward state; None (the live ones) without one."""
        return self.run_verdicts.kept_model()

    def record_test(self, scores: Mapping[str, Any], checkpoint_step: int | None = None) -> None:
        """The final evaluation's ``scores`` (the kept model on the test rows, scored once), with the step the
        kept model comes from (keep_best's best step, else the live one): kept for the summary
        (``records.kept_test_fields``) and, with checkpoints, saved at once as step ``checkpoint_step`` (default:
        the stage's step), so that a stage resumed after a kill -9 answers or skips it again instead of
        releasing or scoring the test rows a second time."""
        after = self.stage.step if checkpoint_step is None else checkpoint_step
        step = self.run_verdicts.record_test(scores, after)
        self.log.info("the kept model, after step %d, on %d test rows: test loss %.6g%s", step, scores["count"],
                      scores["loss"], scores_text(kept_test_fields(self.final_test)))
        if self.store is not None:
            self.save(after)

    def keep(self, name: str, kept: Kept) -> None:
        """Checkpoint ``kept`` with the stage (arrays ``kept/NAME/...``) and take it back with it: at a new run
        and a rollback to step 0 its start, at a resume or a rollback its state of that step."""
        if not name or "/" in name or name in self.kept:
            raise ValueError(f"cannot keep {name!r} with the stage: a name without '/' used once is needed")
        self.kept[name] = kept

    def _kept_arrays(self, step: int) -> dict[str, np.ndarray]:
        return {f"{KEPT_PREFIX}{name}/{key}": value for name, kept in self.kept.items()
                for key, value in kept.checkpoint_state(step).items()}

    def _load_kept(self, arrays: Mapping[str, np.ndarray] | None, step: int, source: str) -> None:
        """Each kept thing's state of ``step`` from ``arrays`` (None: its start); ``ConfigError`` naming
        ``source`` when one cannot be read."""
        for name, kept in self.kept.items():
            prefix = f"{KEPT_PREFIX}{name}/"
            mine = {key[len(prefix):]: value for key, value in (arrays or {}).items() if key.startswith(prefix)}
            try:
                kept.load_checkpoint_state(mine or None, step)
            except (KeyError, TypeError, ValueError) as e:
                raise ConfigError(f"{source}: the state of its {name} cannot be read: {e}") from e

    def save_parameters(self) -> None:
        """With ``--save``: write the stage's final parameters, or with ``keep_best`` leave those of the best
        evaluation that ``take_verdict`` wrote (raises ``CheckpointWriteError``)."""
        if self.opts.save_path is None:
            return
        if self.run_verdicts.keeping_best and self.verdicts.best_step:
            self.log.info("--save %s holds the parameters of step %d, the best evaluation (keep_best)",
                          self.opts.save_path, self.verdicts.best_step)
            return
        self._write_parameters("the last")

    def _write_parameters(self, which: str) -> None:
        path = self.opts.save_path
        assert path is not None                 # only with --save
        try:
            self.stage.save_parameters(path)
            write_preparation(path, self.preparation)
        except OSError as e:
            raise CheckpointWriteError(f"--save {path}: cannot write the parameters of stage "
                                       f"{self.opts.instance}: {e.strerror or e}") from e
        self.log.info("saved the parameters of step %d, %s, to %s", self.stage.step, which, path)

    def begin(self, run_id: str, owner: str = "") -> None:
        """Start ``run_id`` from the initial state (other runs' checkpoints stay where they are)."""
        if self.stage.step != 0 or self.stage.label_dp is not None:    # no label of another run is kept
            self.stage = self._fresh()
        self.history.clear()
        self.senders.reset()
        self.run_verdicts.load(None, 0)
        self._load_kept(None, 0, "a new run")
        self.run_id, self.owner = run_id, owner
        self.releases.begin(run_id)
        self.cpu_started = time.process_time()
        if self.store is not None:
            self.save()
        self.open_trace(append=False)

    def open_trace(self, append: bool) -> None:
        if self.trace is not None:
            self.trace.close()
        opts = self.opts
        self.trace = TraceWriter(opts.trace_path, append=append and opts.trace_path is not None
                                 and opts.trace_path.exists(), params=opts.trace_params, every=opts.trace_every,
                                 last_step=opts.total_steps)
        self.engine.trace = self.trace
        if append:
            self.trace.rollback(self.stage.step)

    def held(self) -> list[int]:
        """Steps this stage can return to: 0, its checkpoints of this run, its live step."""
        steps = {0, self.stage.step}
        if self.store is not None and self.run_id:
            steps.update(self.store.steps(self.run_id))
        return sorted(steps)

    def rollback(self, step: int) -> None:
        """Return to the state after ``step`` (one of ``held()``)."""
        if step == self.stage.step:
            # What the steps in flight beyond it sent is forgotten: they are sent again.
            for name, kept in self.kept.items():
                kept.load_checkpoint_state(kept.checkpoint_state(step), step)
            return
        if step == 0:
            fresh = self._fresh()
            fresh.keep_label_releases(self.stage)       # label_dp: a label is released once in a run
            self.stage = fresh
            self.history.clear()
            self.senders.reset()
            self.run_verdicts.load(None, 0)
            self._load_kept(None, 0, "the rollback to step 0")
            self.releases.restart()
        else:
            ckpt = self.store.at(self.run_id, step) if self.store is not None else None
            if ckpt is None:
                raise StageError(f"stage {self.opts.stage}: cannot roll back to step {step}: no checkpoint of it")
            self._load(ckpt)
        self.log.warning("rolled back to step %d", step)
        if self.trace is not None:
            self.trace.rollback(step)

    def after_step(self, step: int) -> None:
        """Step ``step`` of the run is complete: checkpoint it every ``--checkpoint-every`` steps."""
        every = self.opts.checkpoint_every
        if every and step % every == 0:
            self.save(step)

    def save(self, step: int | None = None, final_loss: float | None = None, finished: bool = False) -> None:
        """Checkpoint the live state as step ``step`` of the run (default: the stage's step count);
        ``finished`` marks the completed run's last one (``--resume`` then has nothing to do).
        Raises ``CheckpointWriteError`` (and every later save is skipped)."""
        if self.store is not None and self.run_id and not self.write_failed:
            if self.trace is not None:
                try:
                    self.trace.flush()      # the trace then holds every step the checkpoint has
                except OutputWriteError:
                    self.write_failed = True    # the exit save must not report it a second time
                    raise
            meta = dict(self.meta, owner=self.owner, **self.extra_meta(), verdicts=self.run_verdicts.state())
            meta.update(self.releases.checkpoint_meta())    # the run's secret, and what its releases were noised with
            step = self.stage.step if step is None else step
            if finished:        # and the run's privacy budget, which a --resume with nothing to do reports
                meta.update(finished=True, final_loss=final_loss, **self.releases.privacy_fields(step, self.stage))
            extra = {EXTRA_PREFIX + name: value for name, value in self.extra_arrays(step).items()}
            extra.update(self._kept_arrays(step))      # the meters' and the guard's (``keep``)
            released, kept = self.releases.arrays(step), self.run_verdicts.arrays()
            try:
                self.store.save(self.run_id, step, {**self.stage.state_arrays(), **self.senders.state_arrays(),
                                                    **self.history.arrays(), **extra, **released, **kept}, meta)
            except CheckpointWriteError:
                self.write_failed = True    # the exit save must not report it a second time
                raise

    def resume_latest(self) -> bool:
        """Load the newest valid checkpoint of the run saved last; False (fresh start) when there is
        none, or when that run is finished (a serving stage then waits for a new run)."""
        ckpt = self.store.latest() if self.store is not None else None
        if ckpt is None:
            self._say_nothing_resumed()
            return False
        if is_finished(ckpt, self.opts):
            self.log.info("run %s finished at step %d; not resuming it", ckpt.run, ckpt.step)
            return False
        self._load(ckpt)
        self.run_id, self.owner = ckpt.run, ckpt.meta.get("owner", "")
        self.resumed_step, self.resumed_meta = ckpt.step, dict(ckpt.meta)
        self.resumed_extra = {name[len(EXTRA_PREFIX):]: value for name, value in ckpt.arrays.items()
                              if name.startswith(EXTRA_PREFIX)}
        self.log.info("resumed run %s at step %d from %s", ckpt.run, ckpt.step, ckpt.path)
        return True

    def _say_nothing_resumed(self) -> None:
        """``--resume`` found checkpoint files of this stage but none it can use (torn, corrupt, of another
        experiment or settings: each was logged with why): say once that a new run starts, and that they stay."""
        store = self.store
        found = steps_on_disk(store.directory, store.stage) if store is not None else []
        if store is not None and found:
            self.log.warning("--resume: none of the %d checkpoint file(s) of stage %s in %s can be resumed (each "
                             "is named above with why); a new run starts at step 0, and those files are left as "
                             "they are. To resume, restore an intact checkpoint of this experiment, --seed and "
                             "--init there", len(found), self.opts.instance, store.directory)

    def _load(self, ckpt: Checkpoint) -> None:
        """The live state back to ``ckpt``'s; ``ConfigError`` for a checkpoint that does not fit this stage
        or this run's settings."""
        self.releases.check_sigma(ckpt)
        if ckpt.run != self.run_id and self.stage.label_dp is not None:
            self.stage = self._fresh()      # no label another run released is kept (LabelRelease keeps its own)
        self.engine.reset()
        try:
            self.stage.load_state_arrays(without_codec_state(ckpt.arrays), ckpt.step)
            self.senders.load_state_arrays(ckpt.arrays)     # error-feedback residuals (none: zeros)
        except ValueError as e:
            raise ConfigError(f"checkpoint {ckpt.path} does not fit this stage's model: {e}") from e
        self.history.load(ckpt.arrays)
        self.run_verdicts.load(ckpt.meta.get("verdicts"), ckpt.step)
        self._load_kept(ckpt.arrays, ckpt.step, f"checkpoint {ckpt.path}")
        self.run_verdicts.load_best_copy(ckpt.arrays)
        self.releases.load(ckpt)

    def summary(self, status: str, started: float, loss: float | None, **extra: Any) -> dict[str, Any]:
        summary = {
            "experiment": self.opts.experiment.name,
            "stage": self.opts.instance,
            "run_id": self.run_id,
            "status": status,
            "steps": self.stage.step,
            "seed": self.opts.seed,
            "final_loss": loss,
            "elapsed_s": time.perf_counter() - started,
            "cpu_s": time.process_time() - self.cpu_started,    # every thread of this process, ZeroMQ's too
            **extra,
            **self.run_verdicts.summary_fields("best_evaluation" in extra),
            # with several clients or parties, a step of the run is a round of updates
            **self.releases.privacy_fields(extra.get("rounds", self.stage.step), self.stage),
            "params": {self.opts.instance: to_lists(self.stage.params)},
        }
        if "privacy" in summary:
            self.log.info("privacy: %s", budget_text(summary["privacy"]))
        if self.opts.summary_path is not None:
            write_json(self.opts.summary_path, summary)
        return summary

    def close(self) -> None:
        if self.trace is not None:
            self.trace.close()


def lock_checkpoint_dir(opts: StageOptions) -> StageLock | None:
    """Hold ``DIR/.INSTANCE.lock`` for this stage process (None without ``--checkpoint-dir``);
    raises ``ConfigError`` when the directory is unwritable or another process runs the stage there."""
    return lock_stage(opts.checkpoint_dir, opts.instance) if opts.checkpoint_dir is not None else None


def start_meta(opts: StageOptions) -> dict[str, Any]:
    """What a checkpoint is valid for: the same starting point (seed, ``--init``, ``--load``'s file)."""
    meta: dict[str, Any] = {"seed": opts.seed, "init": dict(sorted(opts.init.items()))}
    # The data's statistics (distgrad.config.prepare): a resume uses exactly those of its checkpoint.
    keeps = opts.save_path is not None or opts.checkpoint_dir is not None
    prep = opts.experiment.preparation(opts.seed, opts.client, opts.stage) if keeps else None
    if prep is not None:
        meta["preparation"] = prep.to_json()
    if opts.load_path is not None:
        meta["load"] = hashlib.sha256(opts.load_path.read_bytes()).hexdigest()[:16]
    return meta


def is_finished(ckpt: Checkpoint, opts: StageOptions) -> bool:
    """The final checkpoint of a completed run with at least the steps asked for (``--steps``, else the
    experiment's; a larger ``--steps`` continues the run instead), or which early stopping ended there."""
    verdicts = ckpt.meta.get("verdicts")
    taken = verdicts.get("taken") if isinstance(verdicts, dict) else None
    stopped = isinstance(taken, dict) and taken.get("stopped_at") == ckpt.step > 0      # early stopping ended it
    return ckpt.meta.get("finished") is True and (ckpt.step >= opts.total_steps or stopped)


def resumed_checkpoint(opts: StageOptions) -> Checkpoint | None:
    """With ``--resume``: the checkpoint this stage would resume (its newest of the run saved last), finished
    or not; None without one."""
    if not opts.resume or opts.checkpoint_dir is None:
        return None
    meta = start_meta(opts)
    return CheckpointStore(opts.checkpoint_dir, opts.instance, opts.experiment.fingerprint, meta).latest()


def finished_run(opts: StageOptions) -> Checkpoint | None:
    """With ``--resume``: the final checkpoint of the run this stage would resume, if that run is finished."""
    ckpt = resumed_checkpoint(opts)
    return ckpt if ckpt is not None and is_finished(ckpt, opts) else None


def nothing_to_do(opts: StageOptions, ckpt: Checkpoint) -> dict[str, Any]:
    """Log that the run is finished; return its summary from its final checkpoint (no file is written)."""
    logging.getLogger(f"distgrad.{opts.instance}").info(
        "run %s finished at step %d; nothing to do (start without --resume for a new run)", ckpt.run, ckpt.step)
    params = {name[len("param/"):]: value for name, value in ckpt.arrays.items() if name.startswith("param/")}
    exp = opts.experiment
    kept = {name: {key[len(f"{KEPT_PREFIX}{name}/"):]: value for key, value in ckpt.arrays.items()
                   if key.startswith(f"{KEPT_PREFIX}{name}/")} for name in ("meter", "guard")}
    try:        # the figures of the meter and the guard that ran it, as its last checkpoint holds them
        metered = checkpointed_fields(opts.meter_kind, exp.spec(opts.stage).input_guard
                                      if exp.has_stage(opts.stage) else None, kept["meter"], kept["guard"])
    except ValueError as e:
        raise ConfigError(f"checkpoint {ckpt.path}: the figures of its meter or guard cannot be read: {e}") from e
    return {"experiment": exp.name, "stage": opts.instance, "run_id": ckpt.run, "status": "finished",
            "steps": ckpt.step, "seed": opts.seed, "final_loss": ckpt.meta.get("final_loss"), "elapsed_s": 0.0,
            **metered, **({"privacy": privacy} if isinstance(privacy := ckpt.meta.get("privacy"), dict) else {}),
            # the label owner withheld the training loss from this data owner (``wire.LOSS_WITHHELD``)
            **({"training_loss": LOSS_WITHHELD} if ckpt.meta.get("training_loss") == LOSS_WITHHELD else {}),
            "params": {opts.instance: to_lists(params)}}


