"""Which party applies which defense (``distgrad.privacy.defenses``), and the budget it reports.

A stage's defenses are its own settings (its stage table), checked here against its place in the run:
the label owner (the last stage, with ``labels = "last"``) may defend the activation gradients it sends up
(``clip_noise``, ``max_norm``, ``marvell`` for a two-class task) and its training labels (``label_dp``); a data owner (the first stage, a client,
a feature party) the activations it sends down (``clip_noise``). Anything else is refused, naming the key and
the reason (``check_defenses``), and so is a privacy meter on a stage without labels or inputs (``meter_kind``,
``metered``). ``row_defense`` binds a stage's row defenses to what it sends, for
``distgrad.wire.wirecodec.Senders``, with a ``NoiseLedger`` holding the run's noise secret and counting each
row's releases; ``privacy_budget`` is the label owner's (epsilon, delta) for its summary, from its worst row.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from distgrad.config.experiment import Experiment, stage_loss
from distgrad.errors import ConfigError
from distgrad.model.losses import TorchLoss
from distgrad.privacy.budget import (END_TO_END_SCOPE, GUARANTEE_SCOPE, LABEL_DP_SCOPE, MEANINGFUL_EPSILON,
                                     NO_MEANINGFUL_GUARANTEE, gaussian_label_dp, label_budget, sigma_for_target)
from distgrad.privacy.defenses import DEFAULT_DELTA, ClipNoise, Defenses, SentRows, defense_rng, dp_sgd_gradients
from distgrad.privacy.releases import UNBOUNDED_RELEASES, NoiseLedger, RunSecret, digest, fresh_secret

ACTIVATION, GRADIENT = "activation", "activation_grad"   # the wire's directions (distgrad.wire.wirecodec)
EVALUATION = "evaluation"       # a data owner's held-out rows' releases (``Senders.evaluation_tensors``' purpose)
TEST = "test"                   # with a validation split: its test rows', once, in the final evaluation
NO_GUARANTEE = "no differential-privacy guarantee"
BINARY_LOSSES = ("BCEWithLogitsLoss", "BCELoss")    # two-class losses of 0/1 float targets: Marvell's too
SECURE_REASON = ("is not supported on a feature party with secure_aggregation: the label owner receives only the "
                 "masked sum of every party's embedding, never this party's alone, so this party's rows against "
                 "what it sends measure nothing the label owner can invert")


def label_owner_sends_gradients(exp: Experiment, stage: str) -> bool:
    """True for the stage that holds the labels and sends activation gradients up: the last stage of a run
    of several stages whose labels stay with it."""
    return len(exp.stage_names) > 1 and not exp.labels_travel and stage == exp.stage_names[-1]


def meter_kind(exp: Experiment, stage: str) -> str:
    """What a privacy meter at ``stage`` guards (``distgrad.privacy.meter``): ``"labels"`` at the label owner
    that sends gradients up (with several data owners, one meter per client or feature party:
    ``metering.PeerMeters``), ``"inputs"`` at a data owner (the first stage, each client's copy of it, a
    feature party: each meters its own rows). Raises ``ConfigError`` naming
    'privacy_meter' and why any other stage cannot meter."""
    def refuse(reason: str) -> ConfigError:
        return ConfigError(f"stage {stage!r}: 'privacy_meter' (or --privacy-meter) {reason}")
    if len(exp.stage_names) < 2:
        raise refuse("needs a cut: a one-stage experiment sends nothing to another party")
    if exp.batch is None:
        raise refuse("scores a batch of rows at a time (how their activations or gradients relate), and this "
                      "experiment's data has no batch (one sample a step): it would measure nothing")
    if label_owner_sends_gradients(exp, stage):
        if exp.send_rows:
            raise refuse("reads the label owner's labels in its own sample order; with send_rows a step's rows "
                         "are the data owner's to choose")
        if exp.has_stage(stage) and not _class_ids(exp, stage):
            raise refuse("scores what the gradients tell of class labels (recovery by class, averaging, model "
                         "completion); this label owner's targets are real-valued, so it would measure nothing")
        return "labels"
    if stage in exp.data_owners:        # the first stage, each client's copy of it, or a feature party
        if exp.secure_aggregation:
            raise refuse(SECURE_REASON)
        return "inputs"
    if stage == exp.stage_names[-1]:
        raise refuse("needs labels of its own: with labels = \"first\" the data owner sends them to this stage, "
                     "so its gradients tell the data owner nothing it does not hold")
    raise refuse("needs a stage that holds labels or inputs: a middle stage holds neither")


def _class_ids(exp: Experiment, stage: str) -> bool:
    """Whether the targets of ``stage`` are class ids (integers, or whole-valued floats such as 0/1 or one-hot
    rows): what the label meter scores."""
    data = exp.build_data(stage=stage)
    if data.target_dtype.kind in "iub":
        return True
    every = getattr(data, "all_targets", None)
    if every is None:
        return False
    targets = np.asarray(every(), np.float64)
    return bool(np.isfinite(targets).all() and np.array_equal(targets, np.round(targets)))


def metered(exp: Experiment, stage: str, flag: bool = False) -> bool:
    """Whether ``stage`` meters what it sends: its 'privacy_meter', or ``flag`` (--privacy-meter) on a stage
    that can (with the flag, a stage that cannot simply does not)."""
    if exp.has_stage(stage) and exp.spec(stage).privacy_meter:
        return True
    if not flag:
        return False
    try:
        meter_kind(exp, stage)
    except ConfigError:
        return False
    return True


def check_meter_flag(exp: Experiment) -> None:
    """``--privacy-meter`` for a whole run meters every stage that can (``metered``); raise ``ConfigError``
    with ``meter_kind``'s reason (the one a stage process gives) when no stage of ``exp`` can, so the flag
    is never accepted and ignored."""
    if not any(metered(exp, stage, True) for stage in exp.stage_names):
        meter_kind(exp, exp.stage_names[0])
        raise ConfigError("'privacy_meter' (or --privacy-meter): no stage of this experiment can meter")


def check_input_guard(exp: Experiment, stage: str) -> None:
    """Raise ``ConfigError`` naming 'input_guard' and the reason unless ``stage`` is a data owner of a run of
    several stages: the first stage (each client's copy of it guards its own rows) or a feature party of a
    vertical experiment (each party its own columns)."""
    where = f"stage {stage!r}: 'input_guard'"
    if len(exp.stage_names) < 2:
        raise ConfigError(f"{where} guards what crosses a cut, and a one-stage experiment has none")
    if stage not in exp.data_owners:
        owners = "a feature party" if exp.vertical else "the data owner (the first stage)"
        raise ConfigError(f"{where} is a setting of {owners}, which holds the inputs; {stage!r} receives "
                          f"activations")
    if exp.secure_aggregation:
        raise ConfigError(f"{where} {SECURE_REASON}")


def check_defenses(exp: Experiment) -> None:
    """Raise ``ConfigError`` naming the key and the reason for a defense (or a privacy meter) on a stage that
    cannot apply it."""
    for spec in exp.stages:
        if spec.privacy_meter:
            meter_kind(exp, spec.name)
        if spec.input_guard is not None:
            check_input_guard(exp, spec.name)
        d = spec.defenses
        label_keys = [key for key, on in (("max_norm", d.max_norm), ("label_dp", d.label_dp is not None),
                                          ("marvell", d.marvell is not None), ("dp_sgd", d.dp_sgd is not None))
                      if on]
        if not label_keys and d.clip_noise is None and d.nopeek is None:
            continue
        where = f"stage {spec.name!r}"
        if len(exp.stage_names) < 2:
            raise ConfigError(f"{where}: '{(label_keys or ['clip_noise' if d.clip_noise else 'nopeek'])[0]}' defends "
                              f"what crosses a cut, and a "
                              f"one-stage experiment has none")
        label_owner = label_owner_sends_gradients(exp, spec.name)
        if label_keys and not label_owner:
            reason = ("the labels cross the wire with the activations (labels = \"first\"): there is nothing left "
                      "to defend" if exp.labels_travel else
                      f"it defends the label owner's labels, and the label owner is {exp.label_owner!r}")
            raise ConfigError(f"{where}: '{label_keys[0]}' is a setting of the label owner: {reason}")
        if d.clip_noise is not None and not label_owner and spec.name == exp.stage_names[-1]:
            raise ConfigError(f"{where}: 'clip_noise' on the last stage defends the labels through the gradients "
                              f"it sends up, and the labels cross the wire with the activations (labels = "
                              f"\"first\"): there is nothing left to defend")
        if d.clip_noise is not None and not label_owner and spec.name not in exp.data_owners:
            raise ConfigError(f"{where}: 'clip_noise' is a setting of the label owner (on the gradients it sends) "
                              f"or of a data owner (on the activations it sends); {spec.name!r} is a middle stage")
        if d.clip_noise is not None and d.clip_noise.epsilon is not None and not label_owner:
            raise ConfigError(f"{where}: 'clip_noise' with a target epsilon is the label owner's (a label-DP budget); "
                              f"a data owner's clip_noise states no guarantee for its inputs: give it a sigma")
        if d.clip_noise is not None and d.clip_noise.delta != DEFAULT_DELTA and not label_owner:
            raise ConfigError(f"{where}: 'clip_noise' delta is the delta of the label owner's label-DP budget; a data "
                              f"owner's clip_noise states no guarantee for its inputs, so its delta would change "
                              f"nothing: remove it")
        if d.nopeek is not None and spec.name not in exp.data_owners:
            raise ConfigError(f"{where}: 'nopeek' is a setting of a data owner (it decorrelates the activations it "
                              f"sends from its inputs); {spec.name!r} receives activations")
        if d.label_dp is not None and exp.has_stage(spec.name):
            data = exp.build_data(stage=spec.name)
            if data.target_dtype.kind != "i" or not hasattr(data, "all_targets"):
                raise ConfigError(f"{where}: 'label_dp' randomizes class ids: it needs int64 class labels in "
                                  f"batches of rows, not {data.target_dtype.name} targets")
            if d.label_dp.staged and d.marvell is not None:
                raise ConfigError(f"{where}: 'marvell' shapes its noise by each row's training label, which "
                                  f"'label_dp' with stages draws only when the row is first trained on; use "
                                  f"label_dp without stages, or no marvell")
            exp.training_labels(spec.name)      # the loss it trains with must be a softmax cross-entropy
        if d.marvell is not None:
            _check_marvell(exp, spec.name)
        if d.dp_sgd is not None:
            _check_dp_sgd(exp, spec.name)
        shared = shared_label_reason(exp, spec.name) if label_owner and d.clip_noise is not None else None
        if shared is not None and d.clip_noise is not None and d.clip_noise.epsilon is not None:
            raise ConfigError(f"{where}: 'clip_noise' with a target epsilon is a label-DP budget, which needs each "
                              f"label to reach only its own gradient row; here {shared}: give clip_noise a sigma "
                              f"(its summary then states no guarantee), or remove the cause")


def shared_label_reason(exp: Experiment, stage: str, mixing: str | None = None) -> str | None:
    """Why one training label of the label owner ``stage`` reaches more than its own gradient row of a step
    (None: it reaches only its own, the premise of the ``clip_noise`` label-DP budget, sensitivity 2C):
    its ``marvell`` (whose noise is shaped by the classes of the whole batch), a class-id loss whose mean is
    weighted (divided by the batch's total weight, which each label changes), or ``mixing``, what its built
    stage says mixes the rows of a batch (``Stage.batch_mixing``: a torch module's batch norm)."""
    spec = exp.spec(stage)
    if spec.defenses.marvell is not None:
        return ("'marvell' adds noise shaped by the class means and variances of the whole batch, so one "
                "label changes the noise of every row")
    weighted = _weighted_mean(stage_loss(spec))
    if weighted is not None:
        return weighted
    return mixing


def _weighted_mean(loss: Any) -> str | None:
    """Why a class-id ``loss`` divides each row's gradient by a total every label changes (None: it does not):
    a torch loss with ``weight`` or ``ignore_index`` and reduction "mean"."""
    weighted = sorted({"weight", "ignore_index"} & set(loss.options)) if isinstance(loss, TorchLoss) else []
    if isinstance(loss, TorchLoss) and loss.classifies and loss.reduction == "mean" and weighted:
        return (f"{loss.type} with {' and '.join(weighted)} and reduction \"mean\" divides by the batch's total "
                f"weight, which each example's label changes, so every row's gradient depends on every label")
    return None


def _check_dp_sgd(exp: Experiment, stage: str) -> None:
    """Raise ``ConfigError`` unless the label owner ``stage`` can train by DP-SGD: with its ``clip_noise``
    (whose sigma and budget it shares), layers without batch statistics or dropout (each example is forwarded
    alone; a torch module's are checked when it is built, ``torch_stage.per_example_refusal``), a loss whose
    mean is over the rows, one data owner's rows or vertical parties without a bottom model of its own."""
    where = f"stage {stage!r}: 'dp_sgd'"
    spec = exp.spec(stage)
    if not label_owner_sends_gradients(exp, stage):
        raise ConfigError(f"{where} is the label owner's own update (its labels); {stage!r} is not the label owner")
    if spec.defenses.clip_noise is None:
        raise ConfigError(f"{where} shares clip_noise's sigma and budget: give the stage clip_noise too")
    loss = stage_loss(spec)
    weighted = sorted({"weight", "ignore_index"} & set(loss.options)) if isinstance(loss, TorchLoss) else []
    if isinstance(loss, TorchLoss) and _weighted_mean(loss) is not None:
        raise ConfigError(f"{where}: {loss.type} with {' and '.join(weighted)} and reduction \"mean\" divides "
                          f"by the batch's total weight, which each example's label changes, so no example's "
                          f"gradient is its own: use reduction = \"sum\"")
    if spec.defenses.marvell is not None:
        raise ConfigError(f"{where} makes the run end-to-end label-DP, and 'marvell' adds noise shaped by the "
                          f"classes of the whole batch to the gradient rows sent, so one label changes every "
                          f"row's noise: remove marvell or dp_sgd")
    if exp.federated:
        raise ConfigError(f"{where} is not supported with [clients] yet: each client's steps are updates of the "
                          f"one label owner, counted apart")
    if exp.own_bottom:
        raise ConfigError(f"{where} is not supported with the label owner's own bottom model: its update would "
                          f"stay exact")
    kinds = {str(layer.get("type")) for layer in (spec.model or []) if isinstance(layer, dict)}
    refused = sorted(kinds & {"batchnorm", "batch_norm", "dropout"})
    if refused:
        raise ConfigError(f"{where}: each example is forwarded alone for its gradient, so layers that mix or "
                          f"draw across a batch ({', '.join(refused)}) are refused")


def attach_dp_sgd(exp: Experiment, stage: Any, defense: SentRows | None) -> None:
    """Make ``stage`` (the label owner's ``Stage``) compute its parameter gradients by DP-SGD
    (``privacy.defenses.dp_sgd_gradients``) when its ``dp_sgd`` is set: each example's gradient clipped to
    the bound, the noise of its ``clip_noise`` sigma drawn from the run's noise secret (``defense``'s ledger),
    keyed by the update and the digests of what it is computed from. Nothing for any other stage."""
    if defense is None or defense.defenses.dp_sgd is None or defense.defenses.clip_noise is None:
        return
    bound, sigma = defense.defenses.dp_sgd, defense.defenses.clip_noise.noise
    ledger, name = defense.ledger, defense.stage

    def update(x: np.ndarray, dy: np.ndarray, mb: int) -> dict[str, np.ndarray]:
        scale = len(x) if stage.loss is not None and stage.loss.reduction == "mean" else 1
        rng = defense_rng(ledger.secret, name, f"dp_sgd/mb{mb}", stage.step + 1, digest(x) + digest(dy))
        return dp_sgd_gradients(stage.per_example_grads(x, dy, mb), bound, sigma, float(scale), rng)
    stage.private_update = update


def _check_marvell(exp: Experiment, stage: str) -> None:
    """Raise ``ConfigError`` unless the label owner ``stage`` can apply Marvell: a two-class loss of class ids
    0 and 1 (or a binary cross-entropy of one 0/1 target per row), one data owner's rows (not [clients])."""
    where = f"stage {stage!r}: 'marvell'"
    if exp.federated:
        raise ConfigError(f"{where} is not supported with [clients] yet: each client's rows would need their "
                          f"own labels at the label owner")
    if not exp.has_stage(stage):
        return
    loss = exp.final_loss
    binary = isinstance(loss, TorchLoss) and loss.type in BINARY_LOSSES
    if not loss.classifies and not binary:
        raise ConfigError(f"{where} is defined for a two-class loss of class ids (0 and 1, or the 0/1 targets of "
                          f"a binary cross-entropy: {', '.join(BINARY_LOSSES)}); this loss has real-valued targets")
    data = exp.build_data(stage=stage)
    targets = np.asarray(data.all_targets()) if hasattr(data, "all_targets") else None
    if binary and targets is not None and len(targets) and targets[0].size != 1:
        raise ConfigError(f"{where} needs one 0/1 target per row (a two-class task); these rows have "
                          f"{targets[0].size} targets each (several labels at once)")
    classes = np.unique(targets) if targets is not None else None
    if classes is None or classes.tolist() != [0, 1]:
        held = "no table of rows" if classes is None else f"the class ids {classes.tolist()[:10]}"
        raise ConfigError(f"{where} is defined for a two-class task, labels 0 and 1 (Li et al.'s norm and "
                          f"direction leaks); the labels hold {held}")


def row_defense(exp: Experiment, stage: str, seed: int, instance: str | None = None, steps: int | None = None,
                secret: int | None = None) -> SentRows | None:
    """What ``stage`` does to the rows it sends (None: nothing): its ``clip_noise`` (a target form's sigma
    chosen for the releases of ``steps`` steps, default the experiment's: ``stage_defenses``), ``max_norm``
    and ``marvell`` bound to the direction it sends in, Marvell to the class ids the stage trains on (its own
    data's ``targets``, after any ``label_dp``), and its ``instance`` name (a client's copy of the first
    stage, ``f@2``; default: the stage's), which ``defense_rng`` draws from with the run's noise ``secret``
    (default: a fresh one, ``fresh_secret``). The label owner's ledger counts each row's releases (the rows of
    its own data's order, or those a forward names) and, for a target form, refuses the release that would
    pass the planned count. A label owner with RR-with-prior (``label_dp`` in stages) gets one too, which
    sends its rows unchanged and refuses a step computed again on other values."""
    if not exp.has_stage(stage):
        return None
    defenses = stage_defenses(exp, stage, exp.steps if steps is None else steps, seed)
    gradients = label_owner_sends_gradients(exp, stage)
    # RR-with-prior draws a row's label with the prior of the forward that first trains on it: a step computed
    # again on other activations (a resume after kill -9 lost its answers) would draw it again, so its
    # releases are recorded and such a step refused, as a noised one's are (nothing is added to the rows).
    staged = gradients and defenses.label_dp is not None and defenses.label_dp.staged
    if not defenses.on_rows and not staged:
        return None
    direction = GRADIENT if gradients else ACTIVATION
    labels = exp.build_data(seed, stage=stage).targets if defenses.marvell is not None else None
    limit = (_cut_releases(exp, stage, exp.steps if steps is None else steps, seed)
             if gradients and defenses.clip_noise is not None and defenses.clip_noise.epsilon is not None else None)
    rows = _row_order(exp, stage, seed) if gradients else None
    # A label owner's randomized labels draw from the secret of its noise (one per stage in this process).
    key = exp.run_secret(stage) if defenses.label_dp is not None else RunSecret()
    key.value = fresh_secret(secret)
    # A label owner whose data numbers no rows (the ramp) counts each release as one more of one example, as
    # the plan does (``_releases``: every step), never as none: its budget then composes every release.
    return SentRows(defenses, direction, instance or stage, NoiseLedger(key, limit, unnumbered=gradients and rows is None),
                    labels, rows)


def _row_order(exp: Experiment, stage: str, seed: int) -> Any:
    """``rows(step, stream)``: the row numbers of the step's batch the label owner ``stage`` walks for the
    peer a stream goes to (a client's own shard, ``clientN``), or None for data without numbered rows."""
    if exp.federated:
        sources = [exp.build_data(seed, client=c, stage=stage) for c in range(exp.clients.count)]
    else:
        sources = [exp.build_data(seed, stage=stage)]
    if not all(hasattr(data, "step_rows") for data in sources):
        return None

    def rows(step: int, stream: str) -> np.ndarray:
        index = 0
        for part in stream.split("/"):
            if part.startswith("client") and part[len("client"):].isdigit():
                index = int(part[len("client"):])
        return np.asarray(getattr(sources[index], "step_rows")(step))
    return rows


def stage_defenses(exp: Experiment, stage: str, steps: int, seed: int) -> Defenses:
    """``stage``'s defenses with a target form's sigma chosen for the releases of ``steps`` steps (its
    ``planned_releases``; ``sigma_for_target``). Raises ``ConfigError`` when it cannot be chosen."""
    defenses = exp.spec(stage).defenses
    clip = defenses.clip_noise
    if clip is None or clip.sigma is not None or clip.epsilon is None:
        return defenses
    return replace(defenses, clip_noise=chosen_clip(exp, stage, clip, steps, seed))


def chosen_clip(exp: Experiment, stage: str, clip: ClipNoise, steps: int, seed: int) -> ClipNoise:
    """The target form ``clip`` with its sigma chosen for ``stage``'s planned releases in ``steps`` steps."""
    assert clip.epsilon is not None
    planned = planned_releases(exp, stage, steps, seed)
    try:
        return clip.with_sigma(sigma_for_target(clip.epsilon, planned, clip.delta))
    except (ImportError, ValueError) as e:
        raise ConfigError(f"stage {stage!r}: 'clip_noise' epsilon {clip.epsilon:g}: cannot choose sigma for "
                          f"{planned} releases per row: {e}") from e


def planned_releases(exp: Experiment, stage: str, steps: int, seed: int) -> int:
    """The most releases of one row the label owner ``stage`` plans in ``steps`` steps: its gradient rows
    (``_cut_releases``), and with ``dp_sgd`` its update too, once per epoch."""
    epochs = _releases(exp, stage, steps, seed)
    dp_sgd = exp.spec(stage).defenses.dp_sgd is not None
    return _cut_releases(exp, stage, steps, seed) + (epochs if dp_sgd else 0)


def _cut_releases(exp: Experiment, stage: str, steps: int, seed: int) -> int:
    """The releases of one row's gradient the label owner ``stage`` plans in ``steps`` steps: once per epoch
    the run reaches (``_releases``), times the feature parties its gradient goes to (a vertical experiment)."""
    return _releases(exp, stage, steps, seed) * _parties(exp, stage)


def _parties(exp: Experiment, stage: str) -> int:
    """How many data owners the label owner ``stage`` sends each row's gradient to in a step."""
    return max(len(exp.upstream(stage)), 1) if exp.vertical else 1


def privacy_budget(exp: Experiment, stages: list[str], steps: int, seed: int,
                   released: dict[str, int] | None = None, planned_steps: int | None = None,
                   held_out: dict[str, NoiseLedger] | None = None,
                   lifetime: dict[str, int] | None = None, mixing: dict[str, str] | None = None,
                   label_runs: dict[str, int | None] | None = None) -> dict[str, Any]:
    """A summary's ``privacy`` field after ``steps`` steps, ``{"privacy": {stage: entry}}`` for those of
    ``stages`` this experiment defines that have defenses ({} for none; ``stage_budget``); ``mixing``: what a
    built stage mixes the rows of a batch with (``Stage.batch_mixing``), by stage; ``released``: the
    worst row's count of releases of a stage (its ledger's), ``planned_steps`` the steps a target form's
    sigma was chosen for (default ``steps``); ``held_out``: a data owner's ledger, whose releases of held-out
    rows (its evaluations, when there were any) its entry counts (``held_out_budget``); ``lifetime``: the
    worst row's count of releases of a stage over every run it served (``NoiseLedger.lifetime_worst``);
    ``label_runs``: the runs of a stage that released its randomized labels (``LabelRuns.lifetime``)."""
    released, held_out, lifetime, mixing = released or {}, held_out or {}, lifetime or {}, mixing or {}
    label_runs = label_runs or {}
    entries = {stage: stage_budget(exp, stage, steps, seed, released.get(stage), planned_steps, lifetime.get(stage),
                                   mixing.get(stage), label_runs.get(stage))
               for stage in stages if exp.has_stage(stage)}
    for stage, ledger in held_out.items():
        if entries.get(stage) and not label_owner_sends_gradients(exp, stage):
            for purpose in (EVALUATION, TEST):
                if ledger.held_out.get(purpose):
                    entries[stage].update(held_out_budget(ledger, purpose))
    entries = {stage: entry for stage, entry in entries.items() if entry}
    return {"privacy": entries} if entries else {}


def stage_budget(exp: Experiment, stage: str, steps: int, seed: int, released: int | None = None,
                 planned_steps: int | None = None, lifetime: int | None = None,
                 mixing: str | None = None, label_runs: int | None = None) -> dict[str, Any]:
    """What ``stage``'s defenses guarantee after ``steps`` steps ({} without defenses): the label
    owner's label-DP (epsilon, delta) for ``label_dp`` and ``clip_noise`` (``privacy.budget``) of its worst
    row, released ``released`` times (None: once per epoch the steps reach), and for every other defense
    the statement that it has no differential-privacy guarantee. Where one label reaches more than its own
    gradient row (``shared_label_reason``, ``mixing`` the built stage's part of it) the ``clip_noise`` entry
    has no epsilon: its ``guarantee`` says there is none, and why. With ``lifetime`` (the worst row's releases
    over every run the stage served) other than ``released``, the ``clip_noise`` entry adds
    ``lifetime_releases`` and ``lifetime_epsilon``: the same row composed over all of them. With ``label_runs``
    (the runs of the stage that released randomized labels, when runs other than this one did) the ``label_dp``
    entry adds them as ``lifetime_releases`` and ``lifetime_epsilon`` (each run is another response of every
    label: their epsilons add up). docs/privacy.md states the assumptions."""
    d = exp.spec(stage).defenses
    if label_owner_sends_gradients(exp, stage):
        planned = steps if planned_steps is None else planned_steps
        clip = d.clip_noise
        if clip is not None and clip.sigma is None:
            clip = chosen_clip(exp, stage, clip, planned, seed)
        worst = released if released is not None else (_cut_releases(exp, stage, steps, seed)
                                                        if clip is not None else 0)
        if d.dp_sgd is not None:        # each step a row is in also releases its part of the update
            worst += worst // _parties(exp, stage)
        shared = shared_label_reason(exp, stage, mixing) if clip is not None else None
        entry: dict[str, Any] = label_budget(d.label_dp, clip, worst,
                                             planned_releases(exp, stage, planned, seed)
                                             if clip is not None and clip.epsilon is not None else None,
                                             END_TO_END_SCOPE if d.withholds_loss else
                                             LABEL_DP_SCOPE if d.label_dp is not None else GUARANTEE_SCOPE,
                                             None if shared is None else f"{NO_GUARANTEE}: {shared}")
        if d.label_dp is not None and label_runs:
            _add_label_lifetime(entry["label_dp"], label_runs)
        if clip is not None and lifetime is not None and released is not None and lifetime != released:
            _add_lifetime(entry["clip_noise"], lifetime + (lifetime // _parties(exp, stage) if d.dp_sgd else 0))
    else:
        entry = {"clip_noise": NO_GUARANTEE + " is stated for the inputs"} if d.clip_noise is not None else {}
    if d.max_norm:
        entry["max_norm"] = NO_GUARANTEE
    if d.marvell is not None:
        entry["marvell"] = NO_GUARANTEE
    if d.nopeek is not None:
        entry["nopeek"] = NO_GUARANTEE
    return entry


def _add_lifetime(entry: dict[str, Any], releases: int) -> None:
    """A label owner's ``clip_noise`` budget ``entry`` with its worst row's ``releases`` over every run it
    served (earlier runs' counted at this run's sigma) and their composed epsilon (``lifetime_epsilon``); when
    that is ``MEANINGFUL_EPSILON`` or more, the entry's ``guarantee`` says it bounds nothing, as the printed line does."""
    if releases >= UNBOUNDED_RELEASES:      # an earlier run released a row without noise: nothing bounds it
        entry.update(lifetime_releases=math.inf, lifetime_epsilon=math.inf, guarantee=NO_MEANINGFUL_GUARANTEE)
        return
    entry["lifetime_releases"] = releases
    if "epsilon" in entry:
        entry["lifetime_epsilon"] = gaussian_label_dp(entry["sigma"], releases, entry["delta"]) if releases else 0.0
    if not float(entry.get("lifetime_epsilon", 0.0)) < MEANINGFUL_EPSILON:
        entry["guarantee"] = NO_MEANINGFUL_GUARANTEE        # the row's runs together bound nothing


def _add_label_lifetime(entry: dict[str, Any], runs: int) -> None:
    """A label owner's ``label_dp`` budget ``entry`` with the ``runs`` that released its randomized labels
    (``lifetime_releases``: each a fresh response of every label) and their composed epsilon, the sum of theirs
    (``lifetime_epsilon``); when that is ``MEANINGFUL_EPSILON`` or more, its ``guarantee`` says it bounds
    nothing, as the printed line does."""
    entry.update(lifetime_releases=runs, lifetime_epsilon=runs * float(entry["epsilon"]))
    if not entry["lifetime_epsilon"] < MEANINGFUL_EPSILON:
        entry["guarantee"] = NO_MEANINGFUL_GUARANTEE


def held_out_budget(ledger: NoiseLedger, purpose: str) -> dict[str, Any]:
    """A data owner's releases of held-out rows for ``purpose`` (``"evaluation"``: every evaluation releases
    each held-out row once more, the validation rows with a validation split; ``"test"``: then the final
    evaluation releases each test row once; ``"predict"``: each new row once), as its budget entry's
    ``evaluation_releases``, ``test_releases`` or ``prediction_releases``: ``{"releases": tensors sent, "rows": rows in them,
    "per_row": releases of each row}``. Its ``clip_noise`` states no guarantee for them either."""
    releases, rows = ledger.held_out.get(purpose, 0), ledger.held_out_rows.get(purpose, 0)
    per_row = releases if purpose == EVALUATION else min(releases, 1)
    key = {EVALUATION: "evaluation_releases", TEST: "test_releases"}.get(purpose, "prediction_releases")
    return {key: {"releases": releases, "rows": rows, "per_row": per_row}}


def budget_text(privacy: dict[str, Any]) -> str:
    """One line of a summary's ``privacy`` field, for the log and the command line."""
    return "; ".join(f"{stage}: {_entry_text(entry)}" for stage, entry in privacy.items())


def _entry_text(entry: dict[str, Any]) -> str:
    parts = []
    for key, value in entry.items():
        if isinstance(value, dict) and "epsilon" in value:
            delta = f", delta {value['delta']:g}" if "delta" in value else ""
            epsilon = float(value["epsilon"])
            worth = (f" over {value['releases']} releases of the worst row" if "releases" in value else "")
            if "lifetime_epsilon" in value and key == "label_dp":    # each run is another response of each label
                worth += (f" in this run; label-DP epsilon {float(value['lifetime_epsilon']):.4g} over the "
                          f"{value['lifetime_releases']} runs this stage served that released randomized labels")
            elif "lifetime_epsilon" in value:     # the worst row's releases compose over every run served
                worth += (f" in this run; label-DP epsilon {float(value['lifetime_epsilon']):.4g} over "
                          f"{value['lifetime_releases']} releases of the worst row in every run this stage served")
            if not max(epsilon, float(value.get("lifetime_epsilon", 0.0))) < MEANINGFUL_EPSILON:
                parts.append(f"{key}: label-DP epsilon {epsilon:.4g}{delta}{worth}: NO meaningful guarantee "
                             f"(epsilon >= {MEANINGFUL_EPSILON:g})")
            else:
                scope = f" ({value['guarantee']})" if "guarantee" in value else ""
                parts.append(f"{key}: label-DP epsilon {epsilon:.4g}{delta}{worth}{scope}")
        elif isinstance(value, dict) and "guarantee" in value and "error" not in value:
            parts.append(f"{key}: {value['guarantee']}")      # no epsilon: it states why there is none
        elif isinstance(value, dict) and "per_row" in value:
            what = {"evaluation_releases": "held-out rows in evaluations",
                    "test_releases": "test rows in the final evaluation"}.get(key, "new rows in predictions")
            parts.append(f"{what}: {value['rows']} row releases in {value['releases']} tensors, each row released "
                         f"{value['per_row']} times with the clip_noise noise ({NO_GUARANTEE})")
        elif isinstance(value, dict):
            parts.append(f"{key}: {value.get('error', value)}")
        else:
            parts.append(f"{key}: {value}")
    return ", ".join(parts)


def _releases(exp: Experiment, stage: str, steps: int, seed: int) -> int:
    """The most times one training row's gradient is sent in ``steps`` steps: once per epoch the run
    reaches (each step every row at most once; with several data owners, each walks its own share), or every
    step for data without rows."""
    sources = ([exp.build_data(seed, client=c, stage=stage) for c in range(exp.clients.count)] if exp.federated
               else [exp.build_data(seed, stage=stage)])
    per_epoch = min(getattr(data, "batches_per_epoch", 0) for data in sources)
    return steps if not per_epoch else max(1, math.ceil(steps / per_epoch))
