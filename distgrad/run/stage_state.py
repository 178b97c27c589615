"""A stage's run state: the stage and its step engine, run id, checkpoints and trace, which roll back together.

Reliability (docs/reliability.md): on every (re)connect the stages roll back
to the newest step they all hold (a checkpoint, their live state, or the
initial state at step 0), so a run interrupted anywhere ends with the
parameters of an uninterrupted one. A stage process holds its checkpoint
directory's lock for its whole life (``lock_checkpoint_dir``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from distgrad.config.defended import (attach_dp_sgd, budget_text, label_owner_sends_gradients, privacy_budget,
                                      row_defense)
from distgrad.config.prepare import Preparation
from distgrad.jsontext import json_text
from distgrad.privacy.releases import (COUNTS, HELD_OUT, HELD_OUT_AHEAD, HELD_OUT_STREAM, LABEL_RUNS_SUFFIX,
                                      LIFETIME_SUFFIX, LabelRuns, Lifetime, Release, fresh_secret)
from distgrad.stage.checkpoint import Checkpoint, CheckpointStore, StageLock, lock_stage
from distgrad.stage.engine import StepEngine, crossed_direction, crossed_names
from distgrad.errors import CheckpointWriteError, ConfigError, OutputWriteError, StageError
from distgrad.run.metering import checkpointed_fields
from distgrad.run.options import StageOptions
from distgrad.stage.records import (TraceWriter, best_evaluation_fields, evaluation_fields, kept_test_fields,
                                    scores_text, to_lists, write_json, write_preparation)
from distgrad.stage.selection import Selection, Verdicts
from distgrad.stage.stage import Stage, batch_mixing_of
from distgrad.wire import link
from distgrad.wire.codecs import Codec
from distgrad.wire.keys import CurveClient
from distgrad.wire.masking import SecureSumCodec, load_party_keys
from distgrad.wire.messages import LOSS_WITHHELD
from distgrad.wire.wirecodec import ACTIVATION, GRADIENT, Senders, without_codec_state


EXTRA_PREFIX = "extra/"      # a checkpoint's arrays of its runner (``StageState.extra_arrays``), not of the stage
KEPT_PREFIX = "kept/"        # a checkpoint's arrays of what rolls back with the stage (``StageState.keep``)


class Kept(Protocol):
    """What rolls back with a stage and is checkpointed with it (a privacy meter, an input guard)."""

    def checkpoint_state(self, step: int) -> dict[str, np.ndarray]:
        """Its state after ``step``, the stage's live step, as arrays (at least one)."""

    def load_checkpoint_state(self, arrays: Mapping[str, np.ndarray] | None, step: int) -> None:
        """Back to what ``checkpoint_state`` gave after ``step`` (None: the run's start, or a checkpoint
        without it); ``ValueError`` for arrays it cannot take."""
BEST_PREFIX = "best/"        # and of the kept model (``StageState.best_copy``): best/params/NAME, best/state/NAME


class ParameterHistory:
    """A driving stage's parameters after each of its last ``depth`` updates (staleness S = ``depth``), and its
    forward state before each step in flight.

    With S steps in flight, the forward of step t used the parameters after
    update t-1-S, and its backward needs them again after later updates; after
    a rollback the steps in flight are sent again with them. ``versions[u]``
    are the parameters after update u, for u from ``step - S`` to ``step - 1``
    (``step``'s own are the live ones). ``forward_states[t]`` is what a
    training forward changes besides its output (``Stage.forward_state``:
    batch norm's running statistics) as it was before the forward of step t
    in flight, so that sending the steps in flight again (``rewind``) counts
    each forward once. Both roll back, and are checkpointed, with the stage
    (``arrays``: ``history/U/NAME`` and ``forward/T/NAME``).
    """

    PREFIX = "history/"
    FORWARD_PREFIX = "forward/"

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.versions: dict[int, dict[str, np.ndarray]] = {}
        self.forward_states: dict[int, dict[str, np.ndarray]] = {}

    def clear(self) -> None:
        """Forget every version and forward state (a new run, a rollback to step 0)."""
        self.versions, self.forward_states = {}, {}

    def before_forward(self, step: int, stage: Stage) -> None:
        """Keep the stage's forward state before it sends the forward of step ``step`` in flight."""
        if self.depth:
            self.forward_states[step] = stage.forward_state()

    def before_update(self, stage: Stage) -> None:
        """Keep the live parameters (those after update ``stage.step``) before the next update changes them,
        and forget the forward state of the step that update completes."""
        if not self.depth:
            return
        self.versions[stage.step] = {name: value.copy() for name, value in stage.params.items()}
        for old in [u for u in self.versions if u < stage.step + 1 - self.depth]:
            del self.versions[old]
        for done in [t for t in self.forward_states if t <= stage.step + 1]:
            del self.forward_states[done]

    def rewind(self, stage: Stage) -> None:
        """The steps in flight are dropped, to be sent again: return the stage's forward state to what it
        was before the first of them (step ``stage.step + 1``)."""
        first = self.forward_states.get(stage.step + 1)
        if first is not None:
            stage.restore_forward_state(first)
        self.forward_states = {}

    def at(self, version: int, stage: Stage) -> Mapping[str, np.ndarray]:
        """The parameters after update ``version`` (those of step 0 for a version below 0); ``StageError``
        when they are not kept."""
        version = max(version, 0)
        if version == stage.step:
            return stage.params
        if version not in self.versions:
            raise StageError(f"stage {stage.name}: the parameters after update {version} are not kept "
                             f"(at step {stage.step}, staleness {self.depth})")
        return self.versions[version]

    def arrays(self) -> dict[str, np.ndarray]:
        return {**{f"{self.PREFIX}{u}/{name}": value for u, params in self.versions.items()
                   for name, value in params.items()},
                **{f"{self.FORWARD_PREFIX}{t}/{name}": value for t, state in self.forward_states.items()
                   for name, value in state.items()}}

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The versions and forward states a checkpoint's ``arrays`` hold (none for a checkpoint without them)."""
        self.clear()
        for key, value in arrays.items():
            for prefix, kept in ((self.PREFIX, self.versions), (self.FORWARD_PREFIX, self.forward_states)):
                if key.startswith(prefix):
                    number, name = key[len(prefix):].split("/", 1)
                    kept.setdefault(int(number), {})[name] = np.array(value)


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


class StageState:
    """A stage with its run id, checkpoints and trace: what rolls back together.

    Step 0 (the initial state) is always held: it is rebuilt from the seed and
    the ``--init`` overrides, which a restart repeats.
    """

    def __init__(self, opts: StageOptions, checkpoint_each_step: bool = True) -> None:
        """``checkpoint_each_step``: the engine's every update is a step of the run (checkpointed every
        ``--checkpoint-every``); a stage serving several clients checkpoints at the end of a round instead."""
        self.opts = opts
        self.engine = StepEngine(self._fresh(), opts.experiment.micro_batch_scale,
                                 trace_sent=opts.role == "serving",
                                 trace_crossed=crossed_direction(opts.experiment, opts.role == "driving",
                                                                 opts.role == "serving"),
                                 crossed_names=crossed_names(opts.experiment, opts.stage),
                                 senders=Senders(sent_codecs(opts),
                                                 row_defense(opts.experiment, opts.stage, opts.seed,
                                                             opts.instance, opts.total_steps)))
        # The run's noise secret and every release of the run (None: no defense
        # draws noise). With a checkpoint directory they are also appended to a file there before each
        # release leaves, so that a resume after kill -9 still refuses a step computed again on other input.
        self.ledger = self.senders.defense.ledger if self.senders.defense is not None else None
        # The run's secret: the ledger's, which a label owner's randomized labels (label_dp) share, or theirs
        # alone (None: nothing of this stage draws from one). Kept in each checkpoint's meta.
        exp = opts.experiment
        self.secret = (self.ledger.key if self.ledger is not None else exp.run_secret(opts.stage)
                       if exp.has_stage(opts.stage) and exp.spec(opts.stage).defenses.label_dp is not None else None)
        self.released_file = (opts.checkpoint_dir / f".{opts.instance}.released"
                              if opts.checkpoint_dir is not None and self.ledger is not None else None)
        if self.ledger is not None and self.released_file is not None:
            self.ledger.on_release = self._append_release
        # Every run's per-row release counts (a row's budget is spent over all the runs this stage serves): in
        # memory across the runs of this process, and in DIR/.INSTANCE.lifetime.json with a checkpoint directory.
        # (A ledger kept only to refuse a step computed again on other input, RR-with-prior's, noises nothing.)
        noised = self.senders.defense is not None and self.senders.defense.defenses.on_rows
        self.lifetime = (Lifetime(opts.checkpoint_dir / f".{opts.instance}{LIFETIME_SUFFIX}"
                                  if opts.checkpoint_dir is not None else None) if noised else None)
        if self.ledger is not None and self.lifetime is not None:
            self.ledger.on_count = self._count_lifetime
            self.ledger.earlier_source = self.lifetime.source
        # The runs whose randomized labels (label_dp) crossed: each run draws its own, so a label's epsilons add
        # up over the runs this stage serves; kept as the release counts are (``LabelRuns``).
        self.label_runs = (LabelRuns(opts.checkpoint_dir / f".{opts.instance}{LABEL_RUNS_SUFFIX}"
                                     if opts.checkpoint_dir is not None else None)
                           if exp.has_stage(opts.stage) and exp.spec(opts.stage).defenses.label_dp is not None
                           and label_owner_sends_gradients(exp, opts.stage) else None)
        if self.label_runs is not None:
            self.senders.taps[GRADIENT].append(self._labels_released)
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
        self.log = logging.getLogger(f"distgrad.{opts.instance}")
        # The label owner's verdicts on the evaluations (keep_best, early_stopping): given here when this is
        # the last stage (``selection``), received otherwise; both are checkpointed with the stage.
        spec = next((s for s in opts.experiment.stages if s.name == opts.stage), None)
        self.selection = Selection(spec.keep_best, spec.early_stopping) if spec else Selection(None, None)
        self.verdicts = Verdicts()
        self.keeping_best = False       # the verdicts say which evaluation is the best: --save writes its step
        # With a validation split: the kept model (keep_best's best step's parameters and forward state, copied
        # when the verdict arrives; None: the live ones), which the final evaluation scores on the test rows,
        # and that evaluation's scores with the step of the kept model (``record_test``; None: not yet).
        self.best_copy: dict[str, dict[str, np.ndarray]] | None = None
        self.final_test: dict[str, Any] | None = None
        self.plateau_at = 0             # the step whose evaluation's loss a ReduceLROnPlateau took last

    def judged(self, step: int, result: dict[str, Any], last: bool, gives: bool) -> dict[str, Any]:
        """``result`` (the evaluation after ``step``; ``last``: the run's last step) with the verdicts this
        stage gives (``gives``: the last stage, by ``selection``) or passes on (those from below), each
        recorded here (``take_verdict``)."""
        if gives and self.selection.active:
            result = {**result, **self.selection.judge(step, evaluation_fields(result), last)}
        self.take_verdict(step, result)
        return result

    def take_verdict(self, step: int, evaluation: Mapping[str, Any]) -> None:
        """Record the verdict an evaluation after ``step`` carries (``best``, ``stop``); at the best so far,
        ``--save`` writes this stage's parameters now, and not again at the end. With checkpoints, step
        ``step``'s is saved again with the verdict (and, on the label owner, the evaluations it judged)."""
        # ReduceLROnPlateau steps once on each evaluation's loss, after the update of ``step``, before the next.
        stepped = self.stage.plateau and self.stage.step == step and step > self.plateau_at \
            and isinstance(evaluation.get("loss"), float)
        if stepped:
            self.stage.evaluated(evaluation["loss"])
            self.plateau_at = step
        self.keeping_best = self.keeping_best or "best" in evaluation
        if self.verdicts.note(step, evaluation):
            if evaluation.get(link.HELD_OUT) == link.VALIDATION_ROWS:     # the final evaluation scores these on the test rows
                self.best_copy = {"params": {name: value.copy() for name, value in self.stage.params.items()},
                                  "state": self.stage.forward_state()}
            if self.opts.save_path is not None:
                self._write_parameters("the best evaluation so far (keep_best)")
        if evaluation.get("stop"):
            self.log.info("early stopping after step %d: the label owner ends the run here", step)
        if ("best" in evaluation or "stop" in evaluation or stepped) and self.store is not None \
                and self.stage.step == step:
            self.save(step)     # the checkpoint of this step holds its verdict: a resume here keeps it

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

    def kept_model(self) -> dict[str, dict[str, np.ndarray]] | None:
        """The model the final evaluation scores (``stage.kept_model``): keep_best's copy of the best step's
        parameters and forward state; None (the live ones) without one."""
        return self.best_copy if self.verdicts.best_step else None

    def record_test(self, scores: Mapping[str, Any], checkpoint_step: int | None = None) -> None:
        """The final evaluation's ``scores`` (the kept model on the test rows, scored once), with the step the
        kept model comes from (keep_best's best step, else the live one): kept for the summary
        (``records.kept_test_fields``) and, with checkpoints, saved at once as step ``checkpoint_step`` (default:
        the stage's step), so that a stage resumed after a kill -9 answers or skips it again instead of
        releasing or scoring the test rows a second time."""
        after = self.stage.step if checkpoint_step is None else checkpoint_step
        step = self.verdicts.best_step if self.kept_model() is not None else after
        self.final_test = {**{k: v for k, v in scores.items() if k not in ("best", "stop")}, "step": step,
                           "after": after}
        self.log.info("the kept model, after step %d, on %d test rows: test loss %.6g%s", step, scores["count"],
                      scores["loss"], scores_text(kept_test_fields(self.final_test)))
        if self.store is not None:
            self.save(after)

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

    def save_parameters(self) -> None:
        """With ``--save``: write the stage's final parameters, or with ``keep_best`` leave those of the best
        evaluation that ``take_verdict`` wrote (raises ``CheckpointWriteError``)."""
        if self.opts.save_path is None:
            return
        if self.keeping_best and self.verdicts.best_step:
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

    def resume_latest(self) -> bool:
        """Load the newest valid checkpoint of the run saved last; False (fresh start) when there is
        none, or when that run is finished (a serving stage then waits for a new run)."""
        ckpt = self.store.latest() if self.store is not None else None
        if ckpt is None:
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

    def _load(self, ckpt: Any) -> None:
        self._check_target_sigma(ckpt)
        if ckpt.run != self.run_id and self.stage.label_dp is not None:
            self.stage = self._fresh()      # no label another run released is kept (LabelRelease keeps its own)
        self.engine.reset()
        try:
            self.stage.load_state_arrays(without_codec_state(ckpt.arrays), ckpt.step)
            self.senders.load_state_arrays(ckpt.arrays)     # error-feedback residuals (none: zeros)
        except ValueError as e:
            raise ConfigError(f"checkpoint {ckpt.path} does not fit this stage's model: {e}") from e
        self.history.load(ckpt.arrays)
        self._load_verdicts(ckpt.meta.get("verdicts"), ckpt.step)
        self._load_kept(ckpt.arrays, ckpt.step, f"checkpoint {ckpt.path}")
        kept: dict[str, dict[str, np.ndarray]] = {"params": {}, "state": {}}
        for name, value in ckpt.arrays.items():
            if name.startswith(BEST_PREFIX):
                part, key = name[len(BEST_PREFIX):].split("/", 1)
                kept.setdefault(part, {})[key] = np.array(value)
        self.best_copy = kept if kept["params"] and self.verdicts.best_step else None
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

    @property
    def _target_sigma(self) -> float | None:
        """The sigma a target form ``clip_noise = { epsilon = E }`` chose for this run's planned steps (None:
        no target form)."""
        defense = self.senders.defense
        clip = defense.defenses.clip_noise if defense is not None else None
        return float(clip.noise) if clip is not None and clip.epsilon is not None else None

    def _check_target_sigma(self, ckpt: Any) -> None:
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
        defense = self.senders.defense
        clip = defense.defenses.clip_noise if defense is not None else None
        return float(clip.sigma or 0.0) if clip is not None else 0.0

    def _count_lifetime(self, counts: np.ndarray, run: str | None = None) -> None:
        """Before a release leaves: the per-row ``counts`` of ``run`` (default: the live one) in the stage's
        ``Lifetime`` (its file rewritten)."""
        assert self.lifetime is not None
        try:
            self.lifetime.record(self.run_id if run is None else run, self._sigma, counts)
        except OSError as e:
            raise CheckpointWriteError(f"cannot record the per-row release counts in {self.lifetime.path}: "
                                       f"{e.strerror or e}") from e

    def _labels_released(self, received: Callable[[], np.ndarray], stream: str, step: int) -> None:
        """Before a gradient computed from the run's randomized labels leaves: the run in ``label_runs``."""
        assert self.label_runs is not None
        if self.run_id in self.label_runs.runs:
            return
        try:
            self.label_runs.record(self.run_id)
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
                f.write(json_text({"run": self.run_id, **release.as_json()}) + "\n")
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
        run = self.run_id if run is None else run
        text = "".join(json_text({"run": run, **r.as_json()}) + "\n" for r in releases)
        tmp = self.released_file.with_name(self.released_file.name + ".tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            tmp.replace(self.released_file)
        except OSError as e:
            raise CheckpointWriteError(f"cannot rewrite {self.released_file}: {e.strerror or e}") from e

    def _load_verdicts(self, saved: Any, step: int) -> None:
        """The evaluations judged and the verdicts taken up to ``step`` (a checkpoint's ``verdicts``; None:
        none, as at step 0)."""
        saved = saved or {"judged": [], "taken": {"best_step": 0, "stopped_at": 0}, "keeping_best": False}
        try:
            self.selection.load_state(saved["judged"], step)
            self.verdicts.load_state(saved["taken"], step)
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"checkpoint of step {step}: its verdicts cannot be read: {e}") from e
        self.keeping_best = bool(saved.get("keeping_best"))
        test = saved.get("final_test")
        if test is not None and not (isinstance(test, dict) and isinstance(test.get("step"), int)
                                     and isinstance(test.get("after"), int) and isinstance(test.get("count"), int)):
            raise ConfigError(f"checkpoint of step {step}: its final evaluation is not a map of scores")
        self.final_test = test if test is not None and test["after"] == step else None
        if step == 0:
            self.best_copy = None
        plateau_at = saved.get("plateau_at", 0)
        self.plateau_at = plateau_at if isinstance(plateau_at, int) and plateau_at <= step else 0

    def begin(self, run_id: str, owner: str = "") -> None:
        """Start ``run_id`` from the initial state (other runs' checkpoints stay where they are)."""
        if self.stage.step != 0 or self.stage.label_dp is not None:    # no label of another run is kept
            self.stage = self._fresh()
        self.history.clear()
        self.senders.reset()
        self._load_verdicts(None, 0)
        self._load_kept(None, 0, "a new run")
        self.run_id, self.owner = run_id, owner
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
            self._load_verdicts(None, 0)
            self._load_kept(None, 0, "the rollback to step 0")
            if self.ledger is not None:      # the same run: its secret, and the releases it already made
                self.ledger.restore(self.ledger.secret, None, [], 0)
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
            meta = dict(self.meta, owner=self.owner, **self.extra_meta(),
                        verdicts={"judged": self.selection.state(), "taken": self.verdicts.state(),
                                  "keeping_best": self.keeping_best,
                                  "final_test": self.final_test,
                                  "plateau_at": self.plateau_at})
            if self.secret is not None:
                meta["noise_secret"] = f"{self.secret.value:x}"
            if self._target_sigma is not None:      # what the releases so far were noised with (``_load``)
                meta["clip_target"] = {"sigma": self._target_sigma, "steps": self.opts.total_steps}
            step = self.stage.step if step is None else step
            if finished:        # and the run's privacy budget, which a --resume with nothing to do reports
                meta.update(finished=True, final_loss=final_loss, **self.privacy_fields(step))
            extra = {EXTRA_PREFIX + name: value for name, value in self.extra_arrays(step).items()}
            extra.update(self._kept_arrays(step))      # the meters' and the guard's (``keep``)
            released = self.ledger.arrays(step) if self.ledger is not None else {}
            kept = {f"{BEST_PREFIX}{part}/{name}": value for part, values in (self.best_copy or {}).items()
                    for name, value in values.items()}
            try:
                self.store.save(self.run_id, step, {**self.stage.state_arrays(), **self.senders.state_arrays(),
                                                    **self.history.arrays(), **extra, **released, **kept}, meta)
            except CheckpointWriteError:
                self.write_failed = True    # the exit save must not report it a second time
                raise

    def _best_evaluation(self) -> dict[str, Any]:
        """On the stage that judges the evaluations (kept in its checkpoints): the summary's
        ``best_evaluation``, the scores of the step ``keep_best`` kept ({} when none was kept)."""
        judged = dict(self.selection.history)
        return best_evaluation_fields([{"step": step, **{k: v for k, v in fields.items()
                                                         if k not in ("test_count", "validation_count")}}
                                       for step, fields in judged.items()], self.verdicts.best_step)

    def privacy_fields(self, steps: int) -> dict[str, Any]:
        """The summary's ``privacy`` field of this stage after ``steps`` steps (rounds, with several clients):
        what its defenses guarantee (``config.defended.privacy_budget``); {} without defenses."""
        ledger, stage = self.ledger, self.opts.stage
        return privacy_budget(self.opts.experiment, [stage], steps, self.opts.seed,
                              {} if ledger is None else {stage: ledger.worst}, self.opts.total_steps,
                              {} if ledger is None else {stage: ledger},
                              {} if ledger is None else {stage: ledger.lifetime_worst}, batch_mixing_of([self.stage]),
                              {} if self.label_runs is None else {stage: self.label_runs.lifetime(self.run_id)})

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
            **self.verdicts.summary(),
            **({} if "best_evaluation" in extra else self._best_evaluation()),
            **kept_test_fields(self.final_test),
            # with several clients or parties, a step of the run is a round of updates
            **self.privacy_fields(extra.get("rounds", self.stage.step)),
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


def finished_run(opts: StageOptions) -> Checkpoint | None:
    """With ``--resume``: the final checkpoint of the run this stage would resume, if that run is finished."""
    if not opts.resume or opts.checkpoint_dir is None:
        return None
    meta = start_meta(opts)
    ckpt = CheckpointStore(opts.checkpoint_dir, opts.instance, opts.experiment.fingerprint, meta).latest()
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


