"""Secure aggregation of vertical feature parties (``secure_aggregation``): the label owner sees only their sum.

Each party's embedding crosses in fixed point plus pairwise masks that cancel
in the sum (``distgrad.wire.masking``); the label owner adds the integers
(``aggregate.combine_fixed``), the in-process reference adds the unmasked
ones, so runs stay bitwise. Checked here without sockets (the math, the
masks, the label owner's handling of masked forwards, the refusals);
tests/test_vertical.py runs three parties over processes against the
in-process reference.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from distgrad.config.parse import load_experiment, parse_experiment
from distgrad.config.tomlfile import read_toml
from distgrad.errors import CodecRangeError, ConfigError
from distgrad.model import aggregate
from distgrad.run.inprocess import train_in_process
from distgrad.wire import masking
from distgrad.wire.keys import keygen, load_secret

PARTIES = ["a", "b", "c"]
RUNS = [f"run-{name}" for name in PARTIES]      # each party's run id: its masks are bound to them all
BUILTIN = Path(__file__).parent.parent / "distgrad" / "experiments" / "vertical-classify.toml"


def _raw(kind: str = "sum", secure: bool = True) -> dict:
    """vertical-classify's table with the parties' embeddings summed (g takes 8 columns), secure or not."""
    raw = read_toml(BUILTIN)
    last = dict(raw["stages"][3], model=[{"type": "dense", "name": "g1", "in": 8 if kind != "concat" else 24,
                                          "out": 4}])
    return {**raw, "aggregate": kind, "secure_aggregation": secure, "stages": [*raw["stages"][:3], last]}


def _keys(tmp_path: Path, names=PARTIES) -> dict[str, masking.PairMasks]:
    """A CURVE key pair per party (distgrad keygen), every party's public key in one directory, and each
    party's masks loaded as a stage process loads them (``--party-keys``)."""
    for name in names:
        keygen(tmp_path / "keys", name)
    return {name: masking.load_party_keys(tmp_path / "keys", names, name,
                                          *load_secret(tmp_path / "keys" / f"{name}.key_secret"))
            for name in names}


# -- the fixed-point math

def test_fixed_point_sum_is_the_exact_sum_rounded_once():
    """Values rounded to 2**-32 and added as integers: the float32 result is the exact sum of the rounded
    values, rounded once (within one float32 rounding of the float64 sum); mean divides after."""
    rng = np.random.default_rng(0)
    parts = [rng.standard_normal((16, 8)).astype(np.float32) for _ in range(3)]
    fixed = [aggregate.quantise(p, 3) for p in parts]
    exact = sum(p.astype(np.float64) for p in parts)
    total = aggregate.combine_fixed("sum", fixed)
    assert total.dtype == np.float32
    np.testing.assert_allclose(total, exact, rtol=2 ** -23, atol=2 ** -31)
    assert np.array_equal(aggregate.combine_fixed("mean", fixed), total / np.float32(3))
    back = aggregate.dequantise(aggregate.quantise(np.float32([1e-9, -0.5, 3.25]), 2))
    assert np.array_equal(back, np.float32([np.float32(round(1e-9 * 2 ** 32) / 2 ** 32), -0.5, 3.25]))


def test_a_value_fixed_point_cannot_carry_is_a_clear_error():
    """NaN, Inf and magnitudes at 2**30 / K or beyond (the exact total must fit int64) name the value."""
    limit = aggregate.fixed_point_limit(4)
    assert limit == 2.0 ** 28
    for bad in (np.nan, np.inf, limit, -limit * 2):
        x = np.float32([[0.0, bad]])
        with pytest.raises(CodecRangeError, match=r"at index \(0, 1\).*below 2\.68435e\+08 \(2\*\*30 / 4\)"):
            aggregate.quantise(x, 4, "activation/mb0of1", 7)
    aggregate.quantise(np.float32([np.nextafter(np.float32(limit), np.float32(0))]), 4)


# -- the masks

def test_masks_cancel_exactly_and_hide_each_part(tmp_path):
    """What each party sends is its fixed point plus masks: no part equals (or is near) the party's own
    values, the parts look uniform over 64 bits, and their sum is exactly the unmasked sum, so the label
    owner's input equals the in-process reference's. A mask depends on the stream and the step."""
    masks = _keys(tmp_path)
    rng = np.random.default_rng(1)
    parts = [np.tanh(rng.standard_normal((32, 8))).astype(np.float32) for _ in PARTIES]
    codecs = [masking.SecureSumCodec(3, masks[name]).for_run(RUNS) for name in PARTIES]
    sent = [codec.encode(x, "activation/mb0of1", 5)["masked"] for codec, x in zip(codecs, parts)]
    plain = [masking.SecureSumCodec(3).roundtrip(x, "activation/mb0of1", 5) for x in parts]
    for masked, fixed in zip(sent, plain):
        assert masked.dtype == np.int64 and not np.any(masked == fixed)
        assert np.mean(np.abs(masked.astype(np.float64)) > 2.0 ** 40) > 0.99   # fixed point is below 2**32
        bits = masked.view(np.uint64)
        assert 0.4 < np.mean((bits >> np.uint64(63)) == 1) < 0.6
    assert np.array_equal(aggregate.combine_fixed("sum", sent), aggregate.combine_fixed("sum", plain))
    assert np.array_equal(aggregate.combine_fixed("mean", sent), aggregate.combine_fixed("mean", plain))
    again = codecs[0].encode(parts[0], "activation/mb0of1", 5)["masked"]
    assert np.array_equal(again, sent[0])                    # the same values sent again cross the same
    for stream, step in (("activation/mb0of1", 6), ("activation/mb1of2", 5), ("activation", 5)):
        assert not np.any(codecs[0].encode(parts[0], stream, step)["masked"] == sent[0])
    tags = {name: masks[name].tags() for name in PARTIES}
    assert masking.check_tags(tags) is None


def test_two_runs_with_the_same_keys_share_no_mask_and_each_runs_masks_cancel(tmp_path):
    """Masks are bound to the run (every party's run id, ``mask_session``): the masked parts of two runs made
    with the same key pairs differ by more than the parties' values do, so subtracting them does not cancel
    the masks (it did while a mask was a function of the keys, the stream and the step only); in each run
    the masks cancel exactly. A party's own new run id alone renews every mask of its pairs, whatever run
    ids the other parties are said to hold (a label owner naming an earlier run's); the same run ids again
    (a resumed run) draw the same masks, bit for bit."""
    masks = _keys(tmp_path)
    rng = np.random.default_rng(2)
    first = [np.tanh(rng.standard_normal((32, 8))).astype(np.float32) for _ in PARTIES]
    second = [x + np.float32(0.125) for x in first]          # the next run's values: other data, other weights
    again = [f"again-{name}" for name in PARTIES]
    plain = masking.SecureSumCodec(3)

    def sent(runs, parts):
        return [masking.SecureSumCodec(3, masks[name]).for_run(runs).encode(x, "activation/mb0of1", 5)["masked"]
                for name, x in zip(PARTIES, parts)]

    one, two = sent(RUNS, first), sent(again, second)
    for parts, masked in ((first, one), (second, two)):
        assert np.array_equal(aggregate.combine_fixed("sum", masked), aggregate.combine_fixed(
            "sum", [plain.roundtrip(x, "activation/mb0of1", 5) for x in parts]))
    for i in range(3):
        shown = one[i] - two[i]          # what a label owner that saw both runs can compute (mod 2**64)
        truth = plain.roundtrip(first[i], "activation/mb0of1", 5) - plain.roundtrip(second[i], "activation/mb0of1", 5)
        assert not np.any(shown == truth)
        assert np.mean(np.abs(shown.astype(np.float64)) > 2.0 ** 40) > 0.99
    replayed = ["again-a", *RUNS[1:]]          # b and c named as in the first run: a's new run renews its pairs
    assert all(not np.any(new == old) for new, old in zip(sent(replayed, first), one))
    assert all(np.array_equal(new, old) for new, old in zip(sent(list(RUNS), first), one))      # resumed
    assert masking.mask_session(RUNS) != masking.mask_session(["run-a", "run-bc", "-"])
    assert masking.mask_session(["ab", "c"]) != masking.mask_session(["a", "bc"])


def test_masks_bind_only_to_every_partys_run_with_this_partys_own_at_its_place(tmp_path):
    """What the label owner relays is checked: one valid run id per party, in order, and this party's own
    run id at its place (no one else chooses its part of the session); nothing is masked before."""
    from distgrad.errors import ProtocolError
    masks = _keys(tmp_path)
    with pytest.raises(ProtocolError, match="names run 'run-c' for party b, whose run is run-b: its masks are bound"):
        masks["b"].for_run(["run-a", "run-c", "run-c"], "run-b")
    for bad in (RUNS[:2], [*RUNS, "run-d"], "run-a", None, ["run-a", 7, "run-c"], ["run-a", "", "run-c"],
                ["run-a", "run b", "run-c"]):
        with pytest.raises(ProtocolError, match="mask_runs"):
            masks["b"].for_run(bad)
    assert masks["b"].for_run(RUNS, "run-b").runs == tuple(RUNS)
    with pytest.raises(ConfigError, match="masks are drawn for a run"):
        masks["b"].mask((2, 3), "activation/mb0of1", 1)


def test_party_keys_are_checked(tmp_path):
    """Each other party's NAME.key must be there, a key, and not this party's own; without a key for c, a
    party cannot run. Parties with keys that do not pair up are told apart by their tags."""
    masks = _keys(tmp_path)
    secret = load_secret(tmp_path / "keys" / "a.key_secret")
    with pytest.raises(ConfigError, match=r"has no d\.key: secure aggregation needs the public key of every other"):
        masking.load_party_keys(tmp_path / "keys", [*PARTIES, "d"], "a", *secret)
    (tmp_path / "keys" / "b.key").write_bytes((tmp_path / "keys" / "a.key").read_bytes())
    with pytest.raises(ConfigError, match=r"b\.key holds the same key as this party's own key \(a\)"):
        masking.load_party_keys(tmp_path / "keys", PARTIES, "a", *secret)
    with pytest.raises(ConfigError, match="not a directory"):
        masking.load_party_keys(tmp_path / "nowhere", PARTIES, "a", *secret)
    (tmp_path / "keys" / "b.key").write_bytes((tmp_path / "keys" / "b.key_secret").read_bytes())
    for path in (tmp_path / "keys" / "c.key", tmp_path / "keys"):     # another user could swap a party's key
        path.chmod(path.stat().st_mode | 0o002)
        with pytest.raises(ConfigError, match=rf"{path.name} is writable by other users.*chmod go-w"):
            masking.load_party_keys(tmp_path / "keys", PARTIES, "a", *secret)
        path.chmod(path.stat().st_mode & ~0o002)
    masking.load_party_keys(tmp_path / "keys", PARTIES, "a", *secret)
    bad = dict(masks["b"].tags(), c="0" * 32)
    assert "feature parties b and c do not share a mask key" in masking.check_tags(
        {"a": masks["a"].tags(), "b": bad, "c": masks["c"].tags()})


# -- the runs

def test_in_process_reference_sums_in_fixed_point():
    """The reference applies the same fixed-point rounding: a secure run ends close to, not necessarily
    bitwise with, a run that adds float32 embeddings."""
    secure = train_in_process(parse_experiment(_raw()), steps=30)
    plain = train_in_process(parse_experiment(_raw(secure=False)), steps=30)
    assert abs(secure["final_loss"] - plain["final_loss"]) < 1e-4
    for stage, params in plain["params"].items():
        for name, values in params.items():
            np.testing.assert_allclose(np.array(secure["params"][stage][name], np.float64), values, atol=1e-4)


class _Parties:
    """The three feature parties as the label owner sees them: hellos and masked forwards, as their
    processes send them (the parties themselves do not learn here)."""

    def __init__(self, exp, masks: dict[str, masking.PairMasks]) -> None:
        from distgrad.stage.stage import Stage
        self.exp, self.masks = exp, masks
        self.stages = {name: Stage.from_experiment(exp, name) for name in PARTIES}
        self.data = {name: exp.build_data(stage=name) for name in PARTIES}
        self.codecs = {name: masking.SecureSumCodec(3, masks[name]) for name in PARTIES}

        self.runs = dict(zip(PARTIES, RUNS))

    def hello(self, g, name: str, now: float, tags: dict[str, str] | None = None, run: str | None = None,
              held: tuple[int, ...] = (0,)):
        """``name``'s hello (of run ``run``: a new run of it); its masks bound to the runs its welcome names
        (none until every party's hello). Returns the welcome."""
        from distgrad.run import handshake
        self.runs[name] = run or self.runs[name]
        hello = handshake.hello(self.exp, name, self.exp.seed, self.stages[name].output_shape, self.runs[name],
                                list(held), 3, 1)
        hello.body["mask_tags"] = self.masks[name].tags() if tags is None else tags
        welcome = [r for _, r in g.handle([name.encode()], hello, now) if r.type == "welcome"][0]
        if "mask_runs" in welcome.body:
            self.codecs[name] = self.codecs[name].for_run(welcome.body["mask_runs"], self.runs[name])
        return welcome

    def bind_all(self, g, now: float) -> None:
        """Every party's masks bound to the runs a pong names, as a party does that said hello first."""
        from distgrad.wire import messages as wire
        for name in PARTIES:
            pong = [r for _, r in g.handle([name.encode()], wire.Message(wire.PING, self.runs[name]), now)][0]
            self.codecs[name] = self.codecs[name].for_run(pong.body["mask_runs"], self.runs[name])

    def forwards(self, g, step: int, now: float, names=PARTIES) -> list:
        """The masked forward of ``step`` of every party (of ``names``); the label owner's replies."""
        from distgrad.wire import messages as wire
        replies = []
        for name in names:
            sent = self.tensors(name, step)
            assert sent["activation.masked"].dtype == np.int64
            replies += g.handle([name.encode()], wire.Message(wire.FORWARD, self.runs[name], step, tensors=sent), now)
        return replies

    def tensors(self, name: str, step: int, stream: str = "activation/mb0of1") -> dict[str, np.ndarray]:
        """The message tensors party ``name`` sends of step ``step``: its embedding in fixed point, masked
        (``activation.masked``), and the tag of the session its masks are bound to (``activation.session``)."""
        y, _ = self.stages[name].forward(self.data[name].features(step))
        parts = self.codecs[name].encode(y, stream, step)
        assert not np.any(parts["masked"] == self.codecs[name].roundtrip(y, stream, step))
        return {f"activation.{part}": value for part, value in parts.items()}

    def masked(self, name: str, step: int) -> np.ndarray:
        """What party ``name`` sends of step ``step``: its embedding in fixed point, masked."""
        return self.tensors(name, step)["activation.masked"]


def _serving(exp):
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage
    return ServingStage(StageOptions(exp, "g", exp.seed, steps=3, liveness_s=1.0, peer_deadline_s=2.0))


def test_the_label_owner_sees_masked_integers_and_their_sum_only(tmp_path):
    """g serves three parties whose forwards carry masked fixed point (int64, none equal to a party's own
    fixed point): it answers each with the gradient of the sum (the same to each), and after step 1 stands
    exactly where the in-process reference does. A party silent past the bound is named, and why the run
    cannot go on without it."""
    exp = parse_experiment(_raw())
    parties, g, now = _Parties(exp, _keys(tmp_path)), _serving(exp), time.monotonic()
    for name in PARTIES:
        parties.hello(g, name, now)
    # Only the last hello's welcome names every party's run; the others ask with a ping.
    assert [parties.codecs[name].masks.runs for name in PARTIES] == [None, None, tuple(RUNS)]
    parties.bind_all(g, now)
    for step in (1, 2):
        replies = parties.forwards(g, step, now)
        assert [(e[0].decode(), r.type) for e, r in replies] == [(n, "backward") for n in PARTIES]
        grads = [r.tensors["activation_grad"] for _, r in replies]
        assert all(np.array_equal(grad, grads[0]) for grad in grads)
        g.settle()
        if step == 1:       # these parties do not learn: after step 1 only, g stands where the reference does
            assert {k: v.tolist() for k, v in g.stage.params.items()} == train_in_process(exp, steps=1)["params"]["g"]
    g.tick(now + 5.0)
    assert "party a, party b, party c silent" in g.lost_message()
    assert "cannot be unmasked without every party's part" in g.lost_message()


def test_parties_whose_keys_do_not_pair_up_are_refused_naming_the_pair(tmp_path):
    """b runs with a key for c that is not c's: every party's forward gets a mismatch naming b and c (their
    masks would not cancel), nothing of the step is applied; a hello without tags is refused."""
    from distgrad.errors import ProtocolError
    exp = parse_experiment(_raw())
    masks = _keys(tmp_path)
    parties, g, now = _Parties(exp, masks), _serving(exp), time.monotonic()
    with pytest.raises(ProtocolError, match="party a says no mask key for each other party"):
        parties.hello(g, "a", now, tags={})
    for name in PARTIES:
        parties.hello(g, name, now, tags=dict(masks["b"].tags(), c="0" * 32) if name == "b" else None)
    parties.bind_all(g, now)
    replies = parties.forwards(g, 1, now)
    assert [r.type for _, r in replies] == ["error"] * 3
    assert all("feature parties b and c do not share a mask key" in r.body["message"] for _, r in replies)
    assert g.stage.step == 0


def _label_owner(exp, tmp_path: Path):
    """g with a checkpoint after every step in ``tmp_path/g``."""
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage
    return ServingStage(StageOptions(exp, "g", exp.seed, steps=3, liveness_s=1.0, peer_deadline_s=2.0,
                                     checkpoint_dir=tmp_path / "g", checkpoint_every=1))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_part_masked_for_another_session_is_refused_and_the_label_owner_goes_on(tmp_path):
    """Party b still masks for the session of an earlier list of runs (c's former run) while g names the
    current runs: the masks would not cancel, so g refuses every party's forward of the micro-batch with a
    mismatch naming b, both sessions and what to do, applies nothing and writes nothing. Once b binds its
    masks to the runs g names, the same step is summed and g stands bitwise where the reference does."""
    exp = parse_experiment(_raw())
    parties, g, now = _Parties(exp, _keys(tmp_path)), _label_owner(exp, tmp_path), time.monotonic()
    for name in PARTIES:
        parties.hello(g, name, now)
    parties.bind_all(g, now)
    before, files = {k: v.copy() for k, v in g.stage.params.items()}, _files(tmp_path / "g")
    stale = ["run-a", "run-b", "run-c0"]
    parties.codecs["b"] = parties.codecs["b"].for_run(stale, "run-b")
    replies = parties.forwards(g, 1, now)
    assert [(e[0], r.type, r.body["code"]) for e, r in replies] == [(n.encode(), "error", "mismatch") for n in PARTIES]
    text = replies[0][1].body["message"]
    assert all(r.body["message"] == text for _, r in replies)
    good, bad = (masking.session_tag(masking.mask_session(runs)).hex() for runs in (RUNS, stale))
    assert text.startswith("secure aggregation: the masks of step 1 micro-batch 0 would not cancel, so nothing "
                           "was summed or applied: party b masked for another session than the runs this stage "
                           "names, and must say hello again to bind its masks to them (restart the parties with "
                           "--resume)")
    assert f"party a, party c masked for session {good}; party b masked for session {bad}" in text
    assert f"session {good}" in text.split("(mask_runs)")[1] and "'run-c'" in text
    assert g.stage.step == 0 and all(np.array_equal(g.stage.params[k], v) for k, v in before.items())
    assert _files(tmp_path / "g") == files
    parties.bind_all(g, now)                          # b's masks bound to the runs g names: the step goes on
    replies = parties.forwards(g, 1, now)
    assert [r.type for _, r in replies] == ["backward"] * 3
    g.settle()
    assert {k: v.tolist() for k, v in g.stage.params.items()} == train_in_process(exp, steps=1)["params"]["g"]


def test_an_evaluation_masked_for_another_session_is_refused_and_answered_once_bound(tmp_path):
    """digits-halves' two parties, summed securely: after the last step their held-out embeddings are
    summed, and right's, masked for another session (a list naming left's former run), gets both parties
    a mismatch naming right; no scores are recorded. The same evaluations masked for g's runs are scored."""
    from distgrad.run import handshake
    from distgrad.stage.stage import Stage
    from distgrad.wire import messages as wire
    digits = BUILTIN.parent / "digits-halves.toml"
    raw = read_toml(digits)
    raw = {**raw, "aggregate": "sum", "secure_aggregation": True,
           "stages": [*raw["stages"][:2], dict(raw["stages"][2], model=[{"type": "dense", "name": "g1", "in": 32,
                                                                          "out": 10}])]}
    exp, names = parse_experiment(raw, str(digits)), ["left", "right"]
    masks, g, now = _keys(tmp_path, names), _label_owner(exp, tmp_path), time.monotonic()
    runs = [f"run-{name}" for name in names]
    stages = {name: Stage.from_experiment(exp, name) for name in names}
    data = {name: exp.build_data(stage=name) for name in names}
    codecs = {name: masking.SecureSumCodec(2, masks[name]).for_run(runs) for name in names}

    def send(name: str, kind: str, step: int, rows: np.ndarray, stream: str) -> list:
        y, _ = stages[name].forward(rows, training=False)
        tensors = {f"activation.{part}": value for part, value in codecs[name].encode(y, stream, step).items()}
        return [r for _, r in g.handle([name.encode()], wire.Message(kind, f"run-{name}", step, tensors=tensors), now)]

    for name, run in zip(names, runs):
        hello = handshake.hello(exp, name, exp.seed, stages[name].output_shape, run, [0], 3, 1)
        hello.body["mask_tags"] = masks[name].tags()
        g.handle([name.encode()], hello, now)
    for step in (1, 2, 3):
        replies = [r for name in names for r in send(name, wire.FORWARD, step, data[name].features(step),
                                                      "activation/mb0of1")]
        assert [r.type for r in replies] == ["backward"] * 2
        g.settle()
    good, files = codecs["right"], _files(tmp_path / "g")
    codecs["right"] = good.for_run(["run-left0", "run-right"], "run-right")
    replies = [r for name in names for r in send(name, wire.EVALUATE, 4, data[name].test_features(), "activation")]
    assert [(r.type, r.body["code"]) for r in replies] == [("error", "mismatch")] * 2
    assert all("the masks of the evaluation after step 3 would not cancel" in r.body["message"]
               and "party right masked for another session" in r.body["message"] for r in replies)
    assert g.stage.step == 3 and _files(tmp_path / "g") == files
    codecs["right"] = good
    replies = [r for name in names for r in send(name, wire.EVALUATE, 4, data[name].test_features(), "activation")]
    assert [r.type for r in replies] == ["evaluation"] * 2
    assert replies[0].body == replies[1].body and replies[0].body["count"] == len(data["left"].test_rows)


def test_the_session_crosses_with_every_masked_part_and_the_check_names_who_differs(tmp_path):
    """A masked part carries the tag of its session (8 bytes, ``activation.session``) through the binary
    header, and the receiver keeps it beside the masked integers. ``unmatched_sessions`` passes parts of
    the session of the runs named, and names every party whose part has another session or none."""
    from distgrad.wire import messages as wire
    from distgrad.wire.wirecodec import ACTIVATION, Expected, WireTensor
    masks = _keys(tmp_path)
    x = np.float32([[0.25, -0.5], [1.0, 2.0]])

    def received(name: str, runs: list[str]) -> wire.Message:
        codec = masking.SecureSumCodec(3, masks[name]).for_run(runs)
        tensor = WireTensor(ACTIVATION, x.shape, codec)
        msg = wire.decode(wire.encode(wire.Message(wire.FORWARD, "r", 1, tensors=tensor.pack(
            codec.encode(x, "activation/mb0of1", 1)))))
        Expected(WireTensor(ACTIVATION, x.shape, masking.SecureSumCodec(3))).receive(msg, False)
        assert list(msg.tensors) == ["activation", "activation.session"] and msg.tensors["activation"].dtype == np.int64
        return msg

    honest = [(f"party {name}", received(name, RUNS)) for name in PARTIES]
    assert honest[1][1].tensors["activation.session"].tobytes() == masking.mask_session(RUNS)[:8]
    assert masking.unmatched_sessions(honest, RUNS, "step 1 micro-batch 0") is None
    total = aggregate.combine_fixed("sum", [m.tensors["activation"] for _, m in honest])
    assert np.array_equal(total, aggregate.combine_fixed("sum", [masking.SecureSumCodec(3).roundtrip(
        x, "activation/mb0of1", 1)] * 3))                   # the honest case sums exactly as before
    other = ["run-a", "run-b", "run-c2"]           # every party bound to one list, g naming another
    text = masking.unmatched_sessions([(f"party {n}", received(n, other)) for n in PARTIES], RUNS, "step 1 micro-batch 0")
    assert "party a, party b, party c masked for another session" in text and "bind their masks" in text
    bare = wire.Message(wire.FORWARD, "r", 1, tensors={"activation": honest[2][1].tensors["activation"]})
    text = masking.unmatched_sessions([*honest[:2], ("party c", bare)], RUNS, "step 1 micro-batch 0")
    assert "party c masked for another session" in text and "party c named no session" in text
    text = masking.unmatched_sessions(honest, ["run-a", "", "run-c"], "step 1 micro-batch 0")
    assert "this stage has not named every feature party's run yet" in text


def test_a_partys_new_run_sends_every_other_party_to_bind_its_masks_again(tmp_path):
    """Before the first step party c begins a new run (a new run id): the masks' session changes, so every
    other party says hello again (the forward a had sent is refused naming c's new run; b's is refused
    until its hello), learns the new runs from its welcome, and the step then stands where the reference
    does: the masks of all three cancel."""
    from distgrad.errors import ProtocolError
    exp = parse_experiment(_raw())
    parties, g, now = _Parties(exp, _keys(tmp_path)), _serving(exp), time.monotonic()
    for name in PARTIES:
        parties.hello(g, name, now)
    parties.bind_all(g, now)
    assert parties.forwards(g, 1, now, ["a"]) == []           # waiting for b and c
    first = parties.masked("a", 1)
    now += 1.5                                                  # c's last process is gone (liveness 1 s)
    parties.runs["c"] = "run-c2"
    replies = g.handle([b"c"], _hello_of(parties, "c"), now)
    assert [(e[0], r.type) for e, r in replies] == [(b"a", "error"), (b"c", "welcome")]
    assert "party c began a new run: its masks changed; say hello again" in replies[0][1].body["message"]
    assert replies[1][1].body["mask_runs"] == ["run-a", "run-b", "run-c2"]
    parties.codecs["c"] = parties.codecs["c"].for_run(replies[1][1].body["mask_runs"], "run-c2")
    again = g.handle([b"c"], _hello_of(parties, "c"), now)      # its hello again: the same run, nothing renewed
    assert [r.type for _, r in again] == ["welcome"]
    with pytest.raises(ProtocolError, match="party b must say hello again") as e:
        parties.forwards(g, 1, now, ["b"])
    assert e.value.code == "run"
    for name in ("a", "b"):
        assert parties.hello(g, name, now).body["mask_runs"] == ["run-a", "run-b", "run-c2"]
    assert not np.any(parties.masked("a", 1) == first)         # the same values, the new run's masks
    replies = parties.forwards(g, 1, now)
    assert [r.type for _, r in replies] == ["backward"] * 3
    g.settle()
    assert {k: v.tolist() for k, v in g.stage.params.items()} == train_in_process(exp, steps=1)["params"]["g"]


def _hello_of(parties, name: str):
    from distgrad.run import handshake
    hello = handshake.hello(parties.exp, name, parties.exp.seed, parties.stages[name].output_shape,
                            parties.runs[name], [0], 3, 1)
    hello.body["mask_tags"] = parties.masks[name].tags()
    return hello


def test_a_resumed_run_draws_the_same_masks(tmp_path):
    """kill -9 and --resume keep every run id, hence the masks: the label owner resumed from its checkpoint
    names the same runs, and a party resumed from its own binds its masks to its run again (``_bind_masks``,
    asking with pings until every party's run is known), so what it sends again is the same integers."""
    from types import SimpleNamespace
    from distgrad.errors import PeerTimeout, ProtocolError
    from distgrad.run.driver import _Driver
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage
    from distgrad.run.stage_state import StageState
    from distgrad.wire.keys import CurveClient
    from distgrad.wire import messages as wire
    from distgrad.wire.wirecodec import ACTIVATION

    exp = parse_experiment(_raw())
    masks = _keys(tmp_path)
    label = StageOptions(exp, "g", exp.seed, steps=3, liveness_s=1.0, peer_deadline_s=2.0,
                         checkpoint_dir=tmp_path / "g", checkpoint_every=1)
    parties, g, now = _Parties(exp, masks), ServingStage(label), time.monotonic()
    for name in PARTIES:
        parties.hello(g, name, now)
    parties.bind_all(g, now)
    parties.forwards(g, 1, now)
    g.settle()
    g.state.close()
    resumed = ServingStage(replace(label, resume=True))             # the label owner after kill -9, --resume
    pong = resumed.handle([b"a"], wire.Message(wire.PING, "run-a"), now)[0][1]
    assert pong.body["mask_runs"] == RUNS
    before = parties.masked("b", 2)

    keygen(tmp_path / "server", "g")
    party = StageOptions(exp, "b", exp.seed, checkpoint_dir=tmp_path / "b", party_keys=tmp_path / "keys",
                         security=CurveClient(tmp_path / "keys" / "b.key_secret", tmp_path / "server" / "g.key"))
    state = StageState(party)
    state.begin("run-b")
    state.save()
    again = StageState(replace(party, resume=True))                 # party b after kill -9, --resume
    assert again.resume_latest() and again.run_id == "run-b"
    pongs = iter([{}, {"waiting_for": ["c"]}, {"mask_runs": pong.body["mask_runs"]}])
    link = SimpleNamespace(welcome={"stage": "g", "next_step": 2},
                           ping=lambda run, timeout: SimpleNamespace(body=next(pongs)))
    driver = SimpleNamespace(state=again, link=link, opts=party, stop=SimpleNamespace(check=lambda: None),
                             below="g", log=again.log)
    _Driver._bind_masks(driver, again.senders.codec(ACTIVATION))
    y, _ = parties.stages["b"].forward(parties.data["b"].features(2))
    assert np.array_equal(again.senders.codec(ACTIVATION).encode(y, "activation/mb0of1", 2)["masked"], before)
    link.welcome = {"mask_runs": ["run-a", "run-x", "run-c"]}      # the label owner names another run for b
    with pytest.raises(ProtocolError, match="names run 'run-x' for party b, whose run is run-b"):
        _Driver._bind_masks(driver, again.senders.codec(ACTIVATION))
    link.welcome, link.ping = {}, lambda run, timeout: SimpleNamespace(body={})
    with pytest.raises(PeerTimeout, match="did not name every feature party's run within 0.01 s"):
        _Driver._bind_masks(SimpleNamespace(**{**vars(driver), "opts": replace(party, peer_deadline_s=0.01)}),
                            again.senders.codec(ACTIVATION))
    again.close()
    state.close()


# -- refusals

@pytest.mark.parametrize("change,message", [
    (dict(aggregate="concat"), "aggregate = 'concat' hands the label owner each party's own embedding"),
    (dict(activation_codec="int8"), "the masked integers must cross exactly, so activation_codec 'int8'"),
    (dict(allow_nonfinite=True), "fixed point has no NaN or Inf"),
])
def test_secure_aggregation_is_refused_where_it_cannot_hide_the_parts(change, message):
    raw = _raw(change.get("aggregate", "sum"))
    with pytest.raises(ConfigError, match=f"secure_aggregation: {message}"):
        parse_experiment({**raw, **change})


def test_one_party_a_bottom_and_a_codec_flag_are_refused():
    raw = _raw()
    one = {**raw, "stages": [raw["stages"][0], dict(raw["stages"][3])]}
    with pytest.raises(ConfigError, match="needs two or more feature parties"):
        parse_experiment(one)
    bottom = {**raw, "data": dict(raw["data"], features=14), "stages": [*raw["stages"][:3], dict(
        raw["stages"][3], columns=[12, 13], bottom=[{"type": "dense", "name": "gb", "in": 2, "out": 8}])]}
    with pytest.raises(ConfigError, match="the label owner's own 'bottom' joins"):
        parse_experiment(bottom)
    with pytest.raises(ConfigError, match="activation_codec 'float16' cannot carry them"):
        parse_experiment(raw).with_codecs("float16")
    with pytest.raises(ConfigError, match="'secure_aggregation' must be true or false, got 'yes'"):
        parse_experiment({**_raw("concat", secure=False), "secure_aggregation": "yes"})


def test_a_party_masks_with_its_curve_key_pair_and_the_party_keys(tmp_path):
    """A feature party's stage process (CURVE key pair, --party-keys) sends with the masks of its pairs;
    the label owner's codec holds none (it cannot mask, nor unmask one part)."""
    from distgrad.run.options import StageOptions
    from distgrad.run.stage_state import sent_codecs
    from distgrad.wire.keys import CurveClient
    from distgrad.wire.wirecodec import ACTIVATION

    exp = parse_experiment(_raw())
    masks = _keys(tmp_path)
    keygen(tmp_path / "server", "g")
    security = CurveClient(tmp_path / "keys" / "b.key_secret", tmp_path / "server" / "g.key")
    codec = sent_codecs(StageOptions(exp, "b", exp.seed, security=security, party_keys=tmp_path / "keys"))[ACTIVATION]
    assert isinstance(codec, masking.SecureSumCodec) and codec.masks is not None
    assert codec.masks.tags() == masks["b"].tags()
    x = np.float32([[0.25, -0.5]])
    with pytest.raises(ConfigError, match="masks are drawn for a run; bind them to it first"):
        codec.encode(x, "activation/mb0of1", 1)          # no masks before the run is known
    assert np.array_equal(codec.for_run(RUNS, "run-b").encode(x, "activation/mb0of1", 1)["masked"],
                          masking.SecureSumCodec(3, masks["b"]).for_run(RUNS).encode(x, "activation/mb0of1", 1)["masked"])
    assert sent_codecs(StageOptions(exp, "g", exp.seed))[ACTIVATION].masks is None


def test_a_party_without_keys_and_keys_without_secure_aggregation_are_refused(tmp_path):
    from distgrad.run.options import StageOptions
    from distgrad.run.stage_state import sent_codecs

    exp = parse_experiment(_raw())
    with pytest.raises(ConfigError, match="feature party a needs its key pair and every other party's public key"):
        sent_codecs(StageOptions(exp, "a", exp.seed))
    plain = parse_experiment(_raw(secure=False))
    with pytest.raises(ConfigError, match="--party-keys is for a feature party of an experiment with secure_agg"):
        sent_codecs(StageOptions(plain, "a", plain.seed, party_keys=tmp_path))
    with pytest.raises(ConfigError, match="--party-keys is for a feature party"):
        sent_codecs(StageOptions(exp, "g", exp.seed, party_keys=tmp_path))


def test_predictions_and_the_cut_library_are_refused(tmp_path):
    """Predictions would repeat their masks (every prediction numbers its chunks from 1); the cut library
    has no party keys: both say so."""
    from distgrad.config.split import toml_document
    from distgrad.run.cut_interface import FIRST, cut_side
    from distgrad.run.predict import check_predicts

    with pytest.raises(ConfigError, match="predictions of an experiment with secure_aggregation are not supported"):
        check_predicts(parse_experiment(_raw()))
    check_predicts(load_experiment("vertical-classify"))
    raw = _raw()
    path = tmp_path / "secure.toml"
    path.write_text(toml_document({"data": raw["data"]}, {k: v for k, v in raw.items() if k != "data"}))
    parse_experiment(read_toml(path))
    with pytest.raises(ConfigError, match="the cut library does not support secure aggregation"):
        cut_side(FIRST, path, {}, "a")


def test_split_stage_files_keep_secure_aggregation(tmp_path):
    """`distgrad split` writes it into every party's [interface], and it is part of the interface the
    handshake compares (a party whose file lacks it is refused, naming the field)."""
    from distgrad.config.split import interface_table
    exp, plain = parse_experiment(_raw()), parse_experiment(_raw(secure=False))
    assert interface_table(exp)["secure_aggregation"] is True and "secure_aggregation" not in interface_table(plain)
    assert exp.interface_parts()["secure_aggregation"] is True
    assert "secure_aggregation" not in plain.interface_parts()
    assert exp.interface_fingerprint != plain.interface_fingerprint


# Slow: torch in four processes. The same path with numpy stages is test_vertical's secure-sum case (slow too);
# by default, test_the_label_owner_sees_masked_integers_and_their_sum_only covers it without processes.
@pytest.mark.slow
@pytest.mark.timeout(180)    # four PyTorch processes
def test_torch_stages_over_processes_equal_the_reference(tmp_path):
    """Torch feature parties and a torch label owner, securely aggregated over processes: bitwise equal to
    the in-process reference."""
    pytest.importorskip("torch")
    from conftest import read_json, run_launcher
    from distgrad.config.split import toml_document

    raw = _raw()
    raw["stages"] = [dict(stage, framework="torch") for stage in raw["stages"]]
    path = tmp_path / "secure-torch.toml"
    path.write_text(toml_document({"data": raw["data"]}, {k: v for k, v in raw.items() if k != "data"}))
    flags = ["--steps", "10", "--micro-batches", "2"]
    result = run_launcher(["run", path, "--summary", tmp_path / "run.json", *flags])
    assert result.returncode == 0, result.stdout + result.stderr
    reference = train_in_process(parse_experiment(read_toml(path), str(path)), steps=10, micro_batches=2)
    summary = read_json(tmp_path / "run.json")
    assert summary["params"] == reference["params"] and summary["final_loss"] == reference["final_loss"]


def test_a_value_out_of_range_is_not_told_to_the_label_owner_nor_relayed_to_the_other_parties():
    """A feature party whose embedding holds a value secure aggregation cannot carry stops; its abort notice
    (which the label owner relays to every other party) names the codec, the stream and the step, never the
    value or its index: those are the party's embedding, which no one else may see."""
    from types import SimpleNamespace
    from distgrad.run.driver import _Driver
    from distgrad.wire import messages as wire

    x = np.zeros((4, 3), np.float32)
    x[2, 1] = 7.25e8
    with pytest.raises(CodecRangeError) as e:
        aggregate.quantise(x, 3, "activation/mb0of1", 5)
    assert "725000000" in str(e.value) and "(2, 1)" in str(e.value)      # the party's own log names them
    sent: list = []
    driver = SimpleNamespace(state=SimpleNamespace(run_id="r1"), opts=SimpleNamespace(stage="a"),
                             link=SimpleNamespace(send=sent.append))
    assert _Driver._tell_below(driver, e.value)
    text = str(sent[0].body["message"])
    assert sent[0].type == wire.ERROR and "'activation/mb0of1' at step 5" in text and "secure_sum" in text
    assert "725000000" not in text and "7.25e" not in text and "(2, 1)" not in text and "index" not in text
