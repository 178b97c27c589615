"""What the cut library (``distgrad.cut``, ``distgrad.torch``) agrees on with its peer: a party's interface.

A party that trains in its own loop still shakes hands as a daemon does, so it
needs the same interface: its stage file (``[interface]``, a ``[stage]`` that
names only its stage, an optional ``[data]``; ``config.parse.parse_own_loop``),
a combined experiment's interface and data as ``distgrad split`` writes them,
or the interface's fields as keyword arguments. ``CutSide`` holds it with the
connection settings both sides share (timeouts, CURVE key files), so the
client (``run.cut_client``) and the server (``run.cut_server``) read one
thing. The library covers cuts with the labels at the label owner: one data
owner, several in turn (``[clients]``: a ``Cut`` names its ``client``) or
vertical feature parties (``aggregate``: a ``Cut`` is one party, named by its
stage or ``party`` index); a ``Cut`` in lockstep (staleness 0; a ``CutServer``
serves one daemon's steps in flight). Anything else is refused here, naming
the field and the reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property, wraps
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar, cast

import numpy as np

from distgrad.config.experiment import (ARGUMENTS_SOURCE, BUILTIN_DIR, TABLE_SOURCE, Experiment,
                                         check_run_settings, is_whole)
from distgrad.config.parse import load_experiment, parse_own_loop
from distgrad.config.prepare import PREPARATION_OPTIONS
from distgrad.config.split import interface_table
from distgrad.config.tomlfile import read_toml
from distgrad.errors import ConfigError, CutMisuse
from distgrad.run.options import DEFAULT_LIVENESS_S, DEFAULT_PEER_DEADLINE_S, check_wait
from distgrad.stage.stage import micro_shape
from distgrad.wire import messages as wire
from distgrad.wire.transport import DEFAULT_TIMEOUT_S
from distgrad.wire.wirecodec import STATE_PREFIX, stream_name

STATE_VERSION = 1
STATE_KEYS = ("version", "interface", "run", "step", "residuals")    # what a Cut's state_dict holds
FIRST, LAST = "first", "last"        # which end of the cut a library party is: the data owner, the label owner

Call = TypeVar("Call", bound=Callable[..., Any])
_DRIVER_LOCK = threading.Lock()      # guards the check-and-set of an end's driving thread (``one_loop``)


def one_loop(method: Call) -> Call:
    """``method`` of a cut end (a ``Cut``, a ``CutServer``), refused with ``CutMisuse`` while another thread is
    inside one of the end's methods so marked: one loop drives an end, one call at a time. Its socket and step
    count are that loop's: two threads' steps at once would both send step k and both get its one reply, two
    gradients for one step applied once (and ZeroMQ sockets are not thread-safe). The same thread may nest
    (``close`` saying bye, ``connect`` loading a state); threads taking turns, one call after another, are
    fine."""
    @wraps(method)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        me = threading.get_ident()
        with _DRIVER_LOCK:
            driver = self.__dict__.get("_driver")
            if driver is not None and driver[0] != me:
                raise CutMisuse(f"{type(self).__name__}.{method.__name__.strip('_')} was called from thread "
                                f"{threading.current_thread().name!r} while thread {driver[2]!r} is inside its "
                                f"{driver[3].strip('_')}: one loop drives a cut end, one call at a time (its socket "
                                f"and its step count are that loop's). Call it from one thread, or hold a lock "
                                f"around every call")
            # (thread id, calls of it inside, its name, the outermost call): the thread driving the end now
            self._driver = ((me, 1, threading.current_thread().name, method.__name__) if driver is None
                            else (me, driver[1] + 1, driver[2], driver[3]))
        try:
            return method(self, *args, **kwargs)
        finally:
            with _DRIVER_LOCK:
                me, depth, name, outer = self._driver
                self._driver = None if depth == 1 else (me, depth - 1, name, outer)
    return cast(Call, guarded)


@dataclass(frozen=True)
class Bounds:
    """How long this side waits, in seconds: ``timeout_s`` for one reply before resending (a client),
    ``liveness_s`` before a silent peer counts as lost, ``peer_deadline_s`` before a lost peer is given up
    (``PeerTimeout``); the daemons' ``--timeout``, ``--liveness`` and ``--peer-deadline``."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    liveness_s: float = DEFAULT_LIVENESS_S
    peer_deadline_s: float = DEFAULT_PEER_DEADLINE_S

    def __post_init__(self) -> None:
        for name in ("timeout_s", "liveness_s", "peer_deadline_s"):
            check_wait(name, getattr(self, name))           # the daemons' rule for their flags


@dataclass(frozen=True)
class CutSide:
    """One party's end of the cut: the interface (``exp``), which end it is (``FIRST`` or ``LAST``), its
    stage's name, which data owner it is with ``[clients]`` (``client``; None otherwise and at the label
    owner), and the activation it sends or receives for a whole batch (``shape``: a feature party's own
    embedding; at a vertical label owner, the parties' embeddings combined)."""

    exp: Experiment
    end: str
    stage: str
    client: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        exp = self.exp
        if exp.vertical:
            return exp.input_shape(self.stage) if self.end == LAST else exp.cuts[exp.stage_index(self.stage)]
        return exp.cuts[0] if self.end == FIRST else exp.cuts[-1]

    @property
    def micro_batches(self) -> int:
        return self.exp.micro_batches

    def micro_shape(self, micro_batches: int) -> tuple[int, ...]:
        """The activation (and its gradient) of one of ``micro_batches`` micro-batches."""
        return micro_shape(self.shape, micro_batches)

    def scale(self, micro_batches: int) -> np.float32:
        """The float32 factor the daemons put on the sum of a step's micro-batch gradients and losses."""
        return self.exp.micro_batch_scale(micro_batches)

    def rows(self, step: int) -> np.ndarray:
        """The row numbers of step ``step`` (from 1) in the interface's shared sample order (int64); needs
        this party's ``[data]`` (``ConfigError`` without it)."""
        if self.data is None:
            raise ConfigError(f"stage {self.stage!r} has no [data], so the shared sample order is unknown here: "
                              f"give the interface a [data] table (its kind, rows and batch; the same as the "
                              f"daemons' file) to get the rows of a step")
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 1 <= step <= self.exp.steps:
            raise ConfigError(f"step {step!r} is not a step of this run (an integer, 1 to {self.exp.steps})")
        if not hasattr(self.data, "step_rows"):
            raise ConfigError(f"stage {self.stage!r}'s data ({self.data.__class__.__name__}) has no numbered rows")
        return np.asarray(self.data.step_rows(step), np.int64)

    @cached_property
    def data(self) -> Any | None:
        """This party's ``[data]`` as the daemons build it (None without one)."""
        return self.data_of(self.client)

    def data_of(self, client: int | None) -> Any | None:
        """This party's ``[data]`` as the daemons build it, with ``[clients]`` data owner ``client``'s shard
        of the training rows (None without a ``[data]``)."""
        if not self.exp.spec(self.stage).data:
            return None
        return self.exp.build_data(stage=self.stage, client=client)


def cut_side(end: str, interface: str | Path | Mapping[str, Any] | None, fields: Mapping[str, Any],
             party: int | str | None = None, client: int | None = None) -> CutSide:
    """The ``end`` (``FIRST`` or ``LAST``) of the cut that ``interface`` describes: a stage-file path, a
    stage-file table, a combined experiment (a built-in's name or its file; ``fields`` may then hold only
    ``stage``), or None with the interface's fields as ``fields`` (``name``, ``stages``, ``batch``,
    ``activation``, ``steps``, ...; ``stage``: this party's stage, by default the first or last of
    ``stages``; ``data``: its ``[data]`` table; ``parties`` N: N feature parties ``p0`` ... and the label
    owner ``g`` when ``stages`` is not given; ``clients`` N: ``[clients] count = N``). A data owner's end
    of a vertical interface is feature party ``party`` (its index among the parties, or its stage name;
    by default the stage the file or ``stage=`` names, else the first); of an interface with
    ``[clients]``, data owner ``client`` (0 to count - 1, required). Raises ``ConfigError`` naming what is
    wrong."""
    fields = dict(fields)
    if interface is not None and not isinstance(interface, Mapping) and _is_combined(interface):
        stage = fields.pop("stage", None)
        if fields:
            raise ConfigError(f"a combined experiment takes only stage= beside it, got {sorted(fields)}")
        raw, source = _raw_from_combined(end, interface, stage, party)
    elif interface is not None and fields:
        raise ConfigError(f"give the interface as a stage file or as its fields, not both (got a file and "
                          f"{sorted(fields)}; only a combined experiment takes stage=)")
    elif interface is None:
        raw, source = _raw_from_fields(end, fields, party), ARGUMENTS_SOURCE
    elif isinstance(interface, Mapping):
        raw, source = dict(interface), TABLE_SOURCE
    else:
        raw, source = read_toml(Path(interface), "stage file"), str(interface)
    exp = parse_own_loop(raw, source)
    try:        # the checks every path of a run makes before its first step (the daemons', --in-process)
        check_run_settings(exp, micro_batches=exp.micro_batches)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e
    side = CutSide(exp, end, exp.stages[0].name, _check_client(exp, end, client, source))
    if party is not None and side.stage != _party_stage(exp, party, source):
        raise ConfigError(f"{source}: [stage] is {side.stage!r}, but party={party!r} is stage "
                          f"{_party_stage(exp, party, source)!r}: give the party's own stage file")
    _check_supported(side, source)
    return side


def _party_stage(exp: Experiment, party: int | str, source: str) -> str:
    """The stage of feature party ``party`` (its index among the parties, or its stage name)."""
    if not exp.vertical:
        raise ConfigError(f"{source}: party={party!r} names a feature party, but this interface has no "
                          f"'aggregate' (no vertical parties)")
    parties = exp.data_owners
    if isinstance(party, str) and party in parties:
        return party
    if is_whole(party) and 0 <= party < len(parties):        # type: ignore[operator]
        return parties[party]                                # type: ignore[index]
    raise ConfigError(f"{source}: party={party!r} is not a feature party: give its index (0 to "
                      f"{len(parties) - 1}) or its stage name, one of {parties}")


def _check_client(exp: Experiment, end: str, client: Any, source: str) -> int | None:
    """``client`` checked: a data owner's end of an interface with ``[clients]`` needs it (0 to count - 1);
    anywhere else it is refused."""
    count = exp.clients.count
    if end == FIRST and exp.federated:
        if not is_whole(client) or not 0 <= client < count:
            raise ConfigError(f"{source}: the interface has [clients] count = {count}: give this data owner's "
                              f"client=, an integer from 0 to {count - 1}, got {client!r}")
        return int(client)
    if client is not None:
        where = "the label owner serves every client" if end == LAST else "the interface has no [clients]"
        raise ConfigError(f"{source}: client={client!r} names one of several data owners, but {where}")
    return None


def _is_combined(interface: str | Path) -> bool:
    """Whether ``interface`` names a combined experiment (a built-in's name, or a file without
    ``[interface]``) rather than a party's stage file."""
    path = Path(interface)
    if not path.is_file():
        return (BUILTIN_DIR / f"{interface}.toml").is_file()
    return "interface" not in read_toml(path, "experiment or stage file")


def _raw_from_combined(end: str, interface: str | Path, stage: str | None,
                       party: int | str | None = None) -> tuple[dict[str, Any], str]:
    """The own-loop stage-file table (and its source: the experiment's file) of stage ``stage`` (by default the first or the last) of a combined
    experiment: its interface as ``distgrad split`` writes it, the stage's name and the experiment's
    ``[data]`` (paths relative to the experiment's folder, as before). The models, optimisers and losses
    the file gives its stages are the daemons': the loop's own replace them."""
    exp = load_experiment(interface)
    if stage is None and party is not None and end == FIRST:
        stage = _party_stage(exp, party, str(interface))
    if stage is None:
        stage = exp.stage_names[0] if end == FIRST else exp.stage_names[-1]
    if stage not in exp.stage_names:
        raise ConfigError(f"{interface}: no stage {stage!r}; its stages are {list(exp.stage_names)}")
    defended = sorted(exp.spec(stage).defenses.as_table())
    if defended:
        raise ConfigError(f"{interface}: stage {stage!r} has {defended}, but the cut library's loop sends what it "
                          f"computes: it applies no stage's defenses, to its steps or its evaluations. Remove them "
                          f"from stage {stage!r} and add any noise in the loop itself, or run the stage as the "
                          f"daemon (distgrad-stage), which applies them")
    spec = exp.spec(stage)
    private = [key for key, on in (("privacy_meter", spec.privacy_meter), ("input_guard", spec.input_guard is not None))
               if on]
    if private:
        raise ConfigError(f"{interface}: stage {stage!r} has {private}, but the cut library's loop meters and "
                          f"guards nothing of what it sends. Remove them from stage {stage!r}, or run the stage as "
                          f"the daemon (distgrad-stage), which meters and guards it")
    judged = [key for key, on in (("metrics", spec.metrics), ("keep_best", spec.keep_best),
                                  ("early_stopping", spec.early_stopping)) if on]
    if end == LAST and judged:
        raise ConfigError(f"{interface}: stage {stage!r} has {judged}, which a daemon label owner applies to its "
                          f"evaluations (the scores it reports, the step whose parameters every party keeps, the "
                          f"step the run stops after), but a CutServer's loop scores the held-out rows itself "
                          f"(evaluate= gives the loss and the rows right) and decides itself what it keeps and "
                          f"when it stops, so they would do nothing. Remove them from stage {stage!r}, or run the "
                          f"label owner as the daemon (distgrad-stage)")
    data = spec.data
    data = dict(exp.data if data is None else data)
    if stage not in exp.data_owners:
        data.pop("feature_scale", None)     # the data owner's, as distgrad split leaves it to the data owner's file
    return ({"interface": interface_table(exp), "stage": {"name": stage}, **({"data": data} if data else {})},
            exp.source)


def _raw_from_fields(end: str, fields: dict[str, Any], party: int | str | None = None) -> dict[str, Any]:
    """A stage-file table from keyword arguments: ``activation`` may be the per-row shape alone (with
    ``parties``, every party's), ``parties`` N names N feature parties, ``clients`` N is ``[clients]``."""
    stage, data = fields.pop("stage", None), fields.pop("data", None)
    parties = fields.pop("parties", None)
    if parties is not None:
        if not is_whole(parties) or parties < 1:
            raise ConfigError(f"parties must be the number of feature parties, an integer >= 1, got {parties!r}")
        fields.setdefault("stages", [*(f"p{i}" for i in range(parties)), "g"])
        if not isinstance(fields["stages"], (list, tuple)) or len(fields["stages"]) != parties + 1:
            raise ConfigError(f"parties={parties} feature parties and the label owner are {parties + 1} stages, "
                              f"but stages= names {wire.show(fields['stages'])}")
    if is_whole(fields.get("clients")):
        fields["clients"] = {"count": fields["clients"]}
    names = fields.get("stages")
    if parties is None and fields.get("aggregate") is not None and isinstance(names, (list, tuple)):
        parties = len(names) - 1
    activation = fields.get("activation")
    if isinstance(activation, (list, tuple)) and all(isinstance(n, int) for n in activation):
        fields["activation"] = {"shape": list(activation), "dtype": "float32"}
        if parties is not None and parties > 1:          # every party's embedding of that shape
            fields["activation"] = [fields["activation"]] * parties
    elif isinstance(activation, (list, tuple)) and all(isinstance(a, (list, tuple)) for a in activation):
        fields["activation"] = [{"shape": list(a), "dtype": "float32"} for a in activation]
    if stage is None and isinstance(names, (list, tuple)) and names:
        if end == FIRST and party is not None and fields.get("aggregate") is not None:
            if isinstance(party, str) and party in names[:-1]:
                stage = party
            elif is_whole(party) and 0 <= party < len(names) - 1:     # type: ignore[operator]
                stage = names[party]                                  # type: ignore[index]
        if stage is None:
            stage = names[0] if end == FIRST else names[-1]
    if isinstance(names, tuple):
        fields["stages"] = list(names)
    return {"interface": fields, "stage": {"name": stage}, **({"data": data} if data is not None else {})}


def _check_supported(side: CutSide, source: str) -> None:
    exp, names = side.exp, side.exp.stage_names
    expected = exp.data_owners if side.end == FIRST else [names[-1]]
    who = ("a Cut drives " + ("a feature party" if exp.vertical else "the first stage") if side.end == FIRST
           else "a CutServer serves the last stage")
    if side.stage not in expected:
        raise ConfigError(f"{source}: [stage] is {side.stage!r}, but {who} "
                          f"({' or '.join(map(repr, expected))} of {names})")
    refused = {"labels": (exp.labels != "last", "labels travel with the activations (labels = 'first')"),
               "clients": (exp.federated and exp.clients.mode != "separate",
                           f"[clients] mode = {exp.clients.mode!r} (the data owners' models averaged; only "
                           f"'separate' is)"),
               "aggregate": (exp.vertical and exp.federated, "vertical parties and [clients] together"),
               "secure_aggregation": (exp.secure_aggregation, "secure aggregation (the feature parties' pairwise "
                                                              "masks)")}
    for key, (bad, what) in refused.items():
        if bad:
            raise ConfigError(f"{source}: the cut library does not support {what} yet: its loops keep the "
                              f"labels with the label owner; remove '{key}' or run the daemons (distgrad-stage)")
    spec = exp.spec(side.stage)
    table = exp.data if spec.data is None else spec.data
    prepared = [key for key in PREPARATION_OPTIONS if (table or {}).get(key) not in (None, False, "error")]
    scale = (table or {}).get("feature_scale", 1.0)
    if isinstance(scale, bool) or scale != 1:        # scaling by 1 is what the daemons do without the key
        prepared.append("feature_scale")
    if prepared:
        raise ConfigError(f"{source}: stage {side.stage!r}: [data] sets {', '.join(prepared)}, which prepare the rows "
                          f"the daemons read, but the cut library takes only the sample order from [data] and your loop "
                          f"reads its own features and labels, so it cannot apply them: leave them out of [data] "
                          f"and prepare the rows in your loop (feature_scale: multiply your features by it), or run "
                          f"the daemons (distgrad-stage)")
    if (table or {}).get("validation_fraction"):
        raise ConfigError(f"{source}: stage {side.stage!r}: validation_fraction is the daemons' rule: their "
                          f"keep_best and early_stopping choose on the validation rows and the test rows cross "
                          f"once, after the last step, with the kept model; a loop of your own decides when it "
                          f"evaluates, when it stops and which parameters it keeps, so the cut library cannot "
                          f"apply it: leave validation_fraction out of [data], set validation rows apart in your "
                          f"loop and score your test rows once, at its end")
    if side.end == FIRST and exp.staleness > 0:
        raise ConfigError(f"{source}: a Cut runs the data owner's loop in lockstep (cut.step returns step k's "
                          f"gradient before step k+1 is sent), so it cannot keep staleness = {exp.staleness} steps "
                          f"in flight: a PyTorch loop would call backward on step k's graph after its optimizer "
                          f"had changed the parameters in place for the steps in between, which autograd refuses. "
                          f"Remove 'staleness' from both parties' interface, or run the data owner as the daemon "
                          f"(distgrad-stage --staleness S), which a CutServer serves with steps in flight")


def torch_hint(value: Any) -> str:
    """What to do about a torch tensor given to the numpy layer (``distgrad.cut``), to end its ``CutMisuse``
    message with; "" for anything else."""
    if not type(value).__module__.startswith("torch"):
        return ""
    return (": distgrad.cut takes numpy arrays and numbers (t.detach().cpu().numpy(), loss.item()); "
            "distgrad.torch takes tensors and back-propagates for you")


def check_step(step: Any, steps: int) -> int:
    """``step`` (the steps a side has applied; a numpy integer too) checked against the run's ``steps``
    (``ConfigError``), as an int."""
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or not 0 <= step <= steps:
        raise ConfigError(f"step must be the steps applied, an integer from 0 to {steps}, got {step!r}")
    return int(step)


def check_state(state: Any, exp: Any, keys: tuple[str, ...], owner: str) -> int:
    """Check a ``state_dict`` given to a ``owner`` (``"Cut"`` or ``"CutServer"``, whose state holds exactly
    ``keys``): its version, keys, interface, run id, step and residuals (float32 arrays named ``codec/...``);
    returns its step. Raises ``ConfigError`` naming what is wrong, before anything is changed."""
    if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
        raise ConfigError(f"not a cut state of version {STATE_VERSION}: {wire.show(state)}")
    missing, extra = [k for k in keys if k not in state], sorted(map(str, set(state) - set(keys)))
    if missing or extra:
        raise ConfigError(f"not a {owner}'s state_dict: it {'lacks ' + str(missing) if missing else ''}"
                          f"{' and ' if missing and extra else ''}{'has ' + str(extra) if extra else ''}; a "
                          f"{owner}'s holds exactly {list(keys)} (a Cut's and a CutServer's differ)")
    if state["interface"] != exp.interface_fingerprint:
        raise ConfigError("this state is of another interface (its fingerprint differs): resume with the "
                          "interface it was saved under")
    check_run(state["run"])
    residuals = state["residuals"]
    if not isinstance(residuals, Mapping) or not all(
            isinstance(name, str) and name.startswith(STATE_PREFIX) and isinstance(array, np.ndarray)
            and array.dtype == np.float32 for name, array in residuals.items()):
        raise ConfigError(f"the state's residuals must map names {STATE_PREFIX}... to float32 arrays, got "
                          f"{wire.show(residuals)}")
    return check_step(state["step"], exp.steps)


def check_residuals(residuals: Mapping[str, np.ndarray], side: CutSide, direction: str, mbs: int,
                    whole: tuple[int, ...] | None = None) -> None:
    """Check a state's error-feedback residuals (from ``check_state``) against what this side sends: the
    ``direction``'s streams of ``mbs`` micro-batches, each of a micro-batch's shape (of ``whole``, a whole
    batch's, by default the side's) (``ConfigError``)."""
    shape = micro_shape(whole, mbs) if whole is not None else side.micro_shape(mbs)
    streams = {STATE_PREFIX + stream_name(direction, mb, mbs) for mb in range(mbs)}
    for name, array in residuals.items():
        if name not in streams or array.shape != shape:
            raise ConfigError(f"the state's residual {name!r} of shape {array.shape} is not one this side keeps "
                              f"(it keeps {sorted(streams)}, each of shape {shape})")


def check_run(run: Any) -> str:
    """``run`` checked as a run id (``ConfigError``)."""
    if not isinstance(run, str) or not run or not wire.RUN_ID.fullmatch(run):
        raise ConfigError(f"run id {wire.show(run)} is not one: 1 to 128 of A-Z a-z 0-9 _ . -")
    return run
