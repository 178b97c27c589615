"""The serving stage's message handling, without sockets: ``ServingStage.handle`` and ``settle``.

Hello, forward (with its deferred update), repeats, past and future steps,
bye, evaluate, ping and refusals, for one peer and for several; what a
refused message leaves behind (nothing).
"""

from __future__ import annotations

import numpy as np
import pytest

from distgrad.wire import messages as wire
from distgrad.errors import ConfigError, ProtocolError
from distgrad.config.experiment import BUILTIN_DIR
from distgrad.config.parse import load_experiment
from distgrad.run.handshake import hello
from distgrad.run.options import StageOptions
from distgrad.run.serving import PeerStatus, Phase, ServingStage
from distgrad.stage.stage import Stage
from distgrad.wire.messages import ErrorCode, Message

from handshake import hello_message, only_reply

PEER = [b"peer"]


def _serving(name: str, **options) -> tuple[ServingStage, object]:
    exp = load_experiment(name)
    return ServingStage(StageOptions(exp, exp.stage_names[-1], exp.seed, **options)), exp


def _activation(exp, step: int, client: int | None = None) -> np.ndarray:
    f = Stage.from_experiment(exp, exp.stage_names[0])
    return f.forward(exp.build_data(client=client).features(step))[0]


def _forward(exp, run: str, step: int, client: int | None = None) -> Message:
    return Message(wire.FORWARD, run, step, tensors={"activation": _activation(exp, step, client)})


def _params(server: ServingStage) -> dict[str, np.ndarray]:
    return {k: v.copy() for k, v in server.stage.params.items()}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_hello_opens_the_run_at_step_one():
    server, exp = _serving("tanh-regression")
    welcome = only_reply(server.handle(PEER, hello_message(exp, "r"), 0.0))
    assert welcome.type == wire.WELCOME and welcome.body == {"stage": "g", "next_step": 1}
    assert server.phase is Phase.ROUND and server.peers[0].status is PeerStatus.ACTIVE


def test_a_forward_is_answered_before_its_update_and_updated_once():
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    before = _params(server)
    reply = only_reply(server.handle(PEER, _forward(exp, "r", 1), 0.0))
    assert reply.type == wire.BACKWARD and reply.tensors["activation_grad"].shape == server.stage.input_shape
    assert server.stage.step == 0 and _same(before, server.stage.params)     # the update waits for settle
    assert server.settle() == []
    assert server.stage.step == 1 and not _same(before, server.stage.params)
    after = _params(server)
    again = only_reply(server.handle(PEER, _forward(exp, "r", 1), 0.0))      # a repeat: the same reply
    server.settle()
    assert again is reply and server.stage.step == 1 and _same(after, server.stage.params)


@pytest.mark.parametrize("step", [1, 4, 9])
def test_past_and_future_steps_are_refused_and_change_nothing(step):
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    for s in (1, 2, 3):
        server.handle(PEER, _forward(exp, "r", s), 0.0)
        server.settle()
    server.peers[0].cached.clear()                 # step 1 is past and no longer cached
    before = _params(server)
    expected_refusal = step != 4
    if expected_refusal:
        with pytest.raises(ProtocolError) as refused:
            server.handle(PEER, _forward(exp, "r", step), 0.0)
        assert refused.value.code == ErrorCode.STEP
        assert server.stage.step == 3 and _same(before, server.stage.params)
    else:
        assert only_reply(server.handle(PEER, _forward(exp, "r", step), 0.0)).type == wire.BACKWARD


def test_refusals_for_another_run_bad_tensors_and_types_change_nothing():
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    before = _params(server)
    cases = [
        (_forward(exp, "other", 1), ErrorCode.RUN),
        (Message(wire.FORWARD, "r", 1, tensors={"activation": np.zeros((3, 3), np.float32)}), ErrorCode.TENSOR),
        (Message(wire.WELCOME, "r", 1), ErrorCode.TYPE),
        (Message(wire.BYE, "r", 1, body={"steps": 5}), ErrorCode.STEP),
    ]
    for msg, code in cases:
        with pytest.raises(ProtocolError) as refused:
            server.handle(PEER, msg, 0.0)
        assert refused.value.code == code, msg.describe()
    assert server.stage.step == 0 and _same(before, server.stage.params)
    assert only_reply(server.handle(PEER, _forward(exp, "r", 1), 0.0)).type == wire.BACKWARD


def test_a_hello_of_a_new_run_while_the_client_is_live_is_busy():
    server, exp = _serving("tanh-regression", liveness_s=5.0)
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    with pytest.raises(ProtocolError, match="busy") as refused:
        server.handle([b"other"], hello_message(exp, "s"), 1.0)
    assert refused.value.code == ErrorCode.RUN
    welcome = only_reply(server.handle([b"other"], hello_message(exp, "s"), 10.0))   # the first one is gone
    assert welcome.body["next_step"] == 1 and server.peers[0].run == "s"


def test_a_hello_of_the_same_run_rolls_back_to_the_newest_step_both_hold():
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    start = _params(server)
    for s in (1, 2):
        server.handle(PEER, _forward(exp, "r", s), 0.0)
        server.settle()
    welcome = only_reply(server.handle(PEER, hello_message(exp, "r", held=[0, 1]), 0.0))
    assert welcome.body["next_step"] == 1                 # no checkpoints here: back to the initial state
    assert server.stage.step == 0 and _same(start, server.stage.params)


def test_bye_completes_the_run_and_a_repeated_bye_is_answered_again():
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    server.handle(PEER, _forward(exp, "r", 1), 0.0)
    server.settle()
    bye = only_reply(server.handle(PEER, Message(wire.BYE, "r", 2, body={"steps": 1}), 0.0))
    assert bye.type == wire.BYE and bye.body == {"steps": 1}
    summary = server.finish_run()
    assert summary["status"] == "completed" and summary["steps"] == 1 and isinstance(summary["final_loss"], float)
    assert only_reply(server.handle(PEER, Message(wire.BYE, "r", 2, body={"steps": 1}), 0.0)) is bye


def test_evaluate_scores_the_held_out_rows_and_changes_nothing():
    server, exp = _serving("digits")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    f = Stage.from_experiment(exp, "f")
    data = exp.build_data()
    rows = data.test_features()
    before = _params(server)
    activation = f.forward(rows, training=False)[0]
    evaluation = only_reply(server.handle(PEER, Message(wire.EVALUATE, "r", 1, tensors={"activation": activation}),
                                          0.0))
    assert evaluation.type == wire.EVALUATION and evaluation.body["count"] == len(rows)
    # The scores are the label owner's own, computed apart by a fresh g on the same held-out rows and labels.
    expected = Stage.from_experiment(exp, "g").evaluate_last(activation, data.test_targets())
    assert (evaluation.body["loss"], evaluation.body["correct"]) == (expected["loss"], expected["correct"])
    assert 0 <= evaluation.body["correct"] <= len(rows) and _same(before, server.stage.params)


def test_ping_says_where_the_stage_stands():
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    pong = only_reply(server.handle(PEER, Message(wire.PING, "", 0), 0.5))
    assert pong.type == wire.PONG
    assert {k: pong.body[k] for k in ("stage", "run", "step", "client_live")} == {
        "stage": "g", "run": "r", "step": 0, "client_live": True}


def test_several_clients_are_answered_in_client_order_whatever_order_they_send_in():
    server, exp = _serving("digits-clients")
    peers = [[b"c0"], [b"c1"], [b"c2"]]
    for c in range(3):
        server.handle(peers[c], hello_message(exp, f"run{c}", client=c), 0.0)
    assert server.phase is Phase.ROUND and server.order == [0, 1, 2]
    assert server.handle(peers[2], _forward(exp, "run2", 1, client=2), 0.0) == []      # not its turn yet
    assert server.handle(peers[1], _forward(exp, "run1", 1, client=1), 0.0) == []
    answered = server.handle(peers[0], _forward(exp, "run0", 1, client=0), 0.0)
    assert [envelope for envelope, _ in answered] == [peers[0]]
    while True:                        # each reply leaves before its update; then the next turn's work
        more = server.settle()
        if not more:
            break
        answered += more
    assert [envelope for envelope, _ in answered] == peers
    assert all(reply.type == wire.BACKWARD and reply.step == 1 for _, reply in answered)
    assert server.round == 2 and server.stage.step == 3                 # three updates, one per client


def test_a_hello_naming_no_client_or_another_index_is_refused():
    server, exp = _serving("digits-clients")
    for client in (None, 3, True):
        hello = hello_message(exp, "r", **({} if client is None else {"client": client}))
        with pytest.raises(ProtocolError, match="give --client") as refused:
            server.handle(PEER, hello, 0.0)
        assert refused.value.code == ErrorCode.MISMATCH
    single, exp = _serving("tanh-regression")
    with pytest.raises(ProtocolError, match="has no \\[clients\\]"):
        single.handle(PEER, hello_message(exp, "r", client=1), 0.0)


def test_a_bye_leaves_the_finished_checkpoint_newest(tmp_path):
    from distgrad.stage.checkpoint import steps_on_disk
    from distgrad.run.stage_state import finished_run

    server, exp = _serving("tanh-regression", checkpoint_dir=tmp_path, checkpoint_every=1)
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    for s in (1, 2):
        server.handle(PEER, _forward(exp, "r", s), 0.0)
        server.settle()
    server.handle(PEER, Message(wire.BYE, "r", 3, body={"steps": 2}), 0.0)
    server.settle()
    server.finish_run()
    assert steps_on_disk(tmp_path, "g") == [0, 1, 2]          # no step the run never took
    opts = StageOptions(exp, "g", exp.seed, steps=2, checkpoint_dir=tmp_path, resume=True)
    assert finished_run(opts) is not None


def test_a_new_run_after_a_gone_client_starts_its_own_loss_and_clock():
    server, exp = _serving("tanh-regression", liveness_s=1.0)
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    server.handle(PEER, _forward(exp, "r", 1), 0.0)
    server.settle()
    assert server.loss is not None
    server.handle(PEER, hello_message(exp, "s"), 10.0)
    assert server.loss is None and server.peers[0].run == "s" and server.stage.step == 0


def _client_1_waits_for_its_turn() -> tuple[ServingStage, list[list[bytes]], Message]:
    """digits-clients with three clients said hello; client 1's forward of step 1 waits for client 0's turn."""
    server, exp = _serving("digits-clients")
    peers = [[b"c0"], [b"c1"], [b"c2"]]
    for c in range(3):
        server.handle(peers[c], hello_message(exp, f"run{c}", client=c), 0.0)
    forward = _forward(exp, "run1", 1, client=1)
    assert server.handle(peers[1], forward, 0.0) == []
    return server, peers, forward


def test_a_forward_resent_while_it_waits_for_its_turn_still_waits():
    server, peers, forward = _client_1_waits_for_its_turn()
    assert server.handle(peers[1], forward, 0.5) == []          # the link's resend: no refusal, still queued
    assert list(server.peers[1].waiting) == [(1, 0)]


def test_a_forward_resent_while_it_waits_with_another_micro_batch_count_is_refused():
    """The resend of a waiting forward is checked as the first was: another micro-batch count would slice the
    step's targets otherwise when its turn comes."""
    server, peers, forward = _client_1_waits_for_its_turn()
    other = Message(wire.FORWARD, "run1", 1, 0, 2, tensors=forward.tensors)
    with pytest.raises(ProtocolError, match="micro-batch 0/2; expected step 1 micro-batch") as refused:
        server.handle(peers[1], other, 0.5)
    assert refused.value.code == ErrorCode.STEP
    assert server.peers[1].waiting[(1, 0)] is forward and server.peers[1].waiting[(1, 0)].mbs == 1


def test_a_client_slot_stays_with_the_key_that_opened_it():
    server, exp = _serving("digits-clients", liveness_s=1.0)
    server.handle([b"c0"], hello_message(exp, "run0", client=0), 0.0, peer_key="A")
    with pytest.raises(ProtocolError, match="another client key") as refused:
        server.handle([b"x"], hello_message(exp, "other", client=0), 100.0, peer_key="B")
    assert refused.value.code == ErrorCode.RUN and server.peers[0].owner == "A"


def test_after_a_failed_run_a_new_run_is_not_busy(monkeypatch):
    server, exp = _serving("tanh-regression", liveness_s=60.0)
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    monkeypatch.setattr(Stage, "check_finite", lambda self, tensor, value, step=None: (_ for _ in ()).throw(
        __import__("distgrad.errors", fromlist=["NonFiniteError"]).NonFiniteError("injected")))
    with pytest.raises(ProtocolError):
        server.handle(PEER, _forward(exp, "r", 1), 1.0)
    assert server.end_failed_run() is not None
    monkeypatch.undo()
    assert only_reply(server.handle(PEER, hello_message(exp, "new"), 2.0)).type == wire.WELCOME


# --- Evaluations during the run (eval_every) -------------------------------------------------------------------

def _micro_forwards(exp, run: str, step: int, mbs: int, client: int | None = None) -> list[Message]:
    x = _activation(exp, step, client)
    rows = len(x) // mbs
    return [Message(wire.FORWARD, run, step, i, mbs, tensors={"activation": x[i * rows:(i + 1) * rows]})
            for i in range(mbs)]


def _evaluate_message(exp, run: str, step: int, client: int | None = None) -> Message:
    f = Stage.from_experiment(exp, exp.stage_names[0])
    rows = exp.build_data(client=client).test_features()
    return Message(wire.EVALUATE, run, step, tensors={"activation": f.forward(rows)[0]})


def _settle_all(server: ServingStage, replies: list) -> list:
    while True:
        more = server.settle()
        if not more:
            return replies
        replies += more


def test_an_evaluation_between_steps_scores_the_step_just_applied_and_the_run_goes_on():
    server, exp = _serving("digits")
    server.handle(PEER, hello_message(exp, "r", micro_batches=2), 0.0)
    for step in (1, 2):
        for msg in _micro_forwards(exp, "r", step, 2):
            assert only_reply(server.handle(PEER, msg, 0.0)).type == wire.BACKWARD
    server.settle()                                                    # step 2's update
    request = _evaluate_message(exp, "r", 3)
    before = _params(server)
    expected = server.stage.evaluate_last(request.tensors["activation"], exp.build_data().test_targets())
    evaluation = only_reply(server.handle(PEER, request, 0.0))
    assert server.stage.step == 2
    assert evaluation.type == wire.EVALUATION and evaluation.step == 3 and evaluation.body == expected
    assert _same(before, server.stage.params)
    for msg in _micro_forwards(exp, "r", 3, 2):                         # step 3 is taken as usual
        assert only_reply(server.handle(PEER, msg, 0.0)).type == wire.BACKWARD
    server.settle()
    assert server.stage.step == 3


def test_several_clients_evaluate_at_the_end_of_their_round_however_late_the_request_comes():
    server, exp = _serving("digits-clients")
    peers = [[b"c0"], [b"c1"], [b"c2"]]
    for c in range(3):         # client 1 evaluates every step; the others only at the end
        server.handle(peers[c], hello_message(exp, f"run{c}", client=c, **({"eval_every": 1} if c == 1 else {})), 0.0)
    for c in range(3):
        _settle_all(server, server.handle(peers[c], _forward(exp, f"run{c}", 1, client=c), 0.0))
    assert server.phase is Phase.EVALUATING and server.owed == {1} and server.rounds_done == 1
    after_round = _params(server)
    # Client 0 is already at step 2; client 1's evaluation request is late. The round waits for it.
    assert _settle_all(server, server.handle(peers[0], _forward(exp, "run0", 2, client=0), 0.0)) == []
    assert _same(after_round, server.stage.params)
    request = _evaluate_message(exp, "run1", 2, client=1)
    expected = server.stage.evaluate_last(request.tensors["activation"],
                                          exp.build_data(client=1, stage="g").test_targets())
    replies = server.handle(peers[1], request, 0.0)
    assert [(envelope, reply.type) for envelope, reply in replies] == [(peers[1], wire.EVALUATION),
                                                                       (peers[0], wire.BACKWARD)]
    assert replies[0][1].body == expected and server.phase is Phase.ROUND and server.round == 2
    _settle_all(server, [])
    again = only_reply(server.handle(peers[1], request, 0.1))      # resent: the same scores, nothing waits
    assert again.body == expected


def test_a_client_silent_when_its_evaluation_is_due_is_dropped_and_the_round_goes_on():
    server, exp = _serving("digits-clients", liveness_s=1.0)
    peers = [[b"c0"], [b"c1"], [b"c2"]]
    for c in range(3):
        server.handle(peers[c], hello_message(exp, f"run{c}", client=c, eval_every=1), 0.0)
    for c in range(3):
        _settle_all(server, server.handle(peers[c], _forward(exp, f"run{c}", 1, client=c), 0.0))
    assert server.owed == {0, 1, 2}
    for c in (0, 2):
        assert only_reply(server.handle(peers[c], _evaluate_message(exp, f"run{c}", 2, client=c), 0.5)).type \
            == wire.EVALUATION
    assert server.phase is Phase.EVALUATING
    server.tick(5.0)
    assert server.peers[1].status is PeerStatus.DROPPED and server.phase is Phase.ROUND and server.round == 2


def test_one_driver_clients_and_parties_are_each_a_topology_class_inside_the_same_serving_stage():
    """One driver, clients in turn, vertical parties: each served by a ``ServingStage`` (the one state machine),
    each with its own subclass of ``Topology``, bound to that stage."""
    from distgrad.run.topology import Topology

    topologies = {}
    for name, expected in [("tanh-regression", "OnePeer"), ("digits-clients", "Clients"), ("digits-halves", "Parties")]:
        server, _ = _serving(name)
        assert type(server) is ServingStage, name
        assert isinstance(server.topology, Topology) and type(server.topology).__name__ == expected, name
        assert server.topology.serving is server, name
        topologies[name] = type(server.topology)
    assert len(set(topologies.values())) == 3, topologies


def test_a_topology_decides_every_abstract_method_or_cannot_be_built():
    """``Topology`` is an interface: a topology that leaves out one of its decisions (here, what a run lost
    for good is told as) is refused when built, not found missing mid-run."""
    import pytest
    from distgrad.run.topology import OnePeer, Topology

    assert {"join", "round_order", "in_turn", "advance_round", "advance_joining", "advance_evaluating",
            "answer_evaluations", "tick", "lost_message", "completed_message"} <= Topology.__abstractmethods__

    class Unfinished(OnePeer):
        lost_message = Topology.lost_message

    with pytest.raises(TypeError, match="lost_message"):
        Unfinished(None, 1)


def test_every_topology_answers_which_peers_are_missing():
    """``missing_parties`` names the silent feature parties of a vertical run and is empty for one driver
    and for clients in turn (it was an attribute error there)."""
    for name in ("tanh-regression", "digits-clients"):
        server, _ = _serving(name)
        assert server.missing_parties(1e9) == [], name


def _parties_toml(count: int) -> str:
    """A vertical experiment of ``count`` feature parties of 4 columns each (embeddings of 4), over synthetic rows."""
    parties = "".join(f'''
[[stages]]
name = "p{i}"
columns = {list(range(4 * i, 4 * i + 4))}
model = [{{ type = "dense", name = "p{i}d", in = 4, out = 4 }}]
optimizer = {{ type = "sgd", lr = 0.01 }}
''' for i in range(count))
    return f'''name = "parties-{count}"
steps = 10
seed = 0
labels = "last"
aggregate = "concat"

[data]
kind = "synthetic_classification"
samples = 256
features = {4 * count}
classes = 3
batch = 8
{parties}
[[stages]]
name = "g"
model = [{{ type = "dense", name = "g1", in = {4 * count}, out = 3 }}]
optimizer = {{ type = "sgd", lr = 0.01 }}
loss = "softmax_cross_entropy"
'''


class _CountedPeers(list):
    """A serving stage's peers that count how often one of them is looked at (by index or by a loop)."""

    looks = 0

    def __getitem__(self, index):
        _CountedPeers.looks += 1
        return super().__getitem__(index)

    def __iter__(self):
        for peer in super().__iter__():
            _CountedPeers.looks += 1
            yield peer


@pytest.mark.parametrize("count", [4, 16])
def test_a_partys_forward_does_not_make_the_label_owner_look_at_every_party(tmp_path, count):
    """What the label owner does per party's message does not grow with the number of
    parties (finding the party, telling whether it is its turn, whether every part is in): a step looks at
    each party a fixed number of times, O(parties) per step (5 looks per party, whatever their number). It
    used to look at every party on every party's message, O(parties^2) per step (12.5 looks per party at 4
    parties, 42.5 at 16)."""
    path = tmp_path / "parties.toml"
    path.write_text(_parties_toml(count))
    exp = load_experiment(str(path))
    server = ServingStage(StageOptions(exp, "g", exp.seed, steps=10))
    names = [f"p{i}" for i in range(count)]
    for i, name in enumerate(names):
        said = hello(exp, name, exp.seed, exp.cuts[i], f"run-{name}", [0], 10, 1)
        assert only_reply(server.handle([name.encode()], said, 0.0)).type == wire.WELCOME
    server.peers = _CountedPeers(server.peers)
    parties = [Stage.from_experiment(exp, name) for name in names]
    looks = []
    for step in (1, 2, 3):
        _CountedPeers.looks = 0
        replies, before = [], _params(server)
        for i in reversed(range(count)):        # the last party first: any scan from party 0 runs in full
            x = parties[i].forward(exp.build_data(stage=names[i]).features(step))[0]
            forward = Message(wire.FORWARD, f"run-{names[i]}", step, tensors={"activation": x})
            replies += server.handle([names[i].encode()], forward, 0.0)
        assert len(replies) == count and _same(_params(server), before)   # every reply before the update
        replies = _settle_all(server, replies)
        assert not _same(_params(server), before)
        assert sorted(envelope[0].decode() for envelope, _ in replies) == sorted(names)
        assert all(reply.type == wire.BACKWARD and reply.step == step for _, reply in replies)
        looks.append(_CountedPeers.looks / count)
    assert max(looks[1:]) <= 8, looks       # looks per party per step, after the first (which finds each run)


def test_the_hello_of_one_of_many_parties_fits_and_too_many_cuts_are_a_config_error(tmp_path):
    """A vertical experiment's hello names every stage ("p0,p1,...,g"); past about 20 parties that
    list outgrew a hello's 64-character field and every party was refused at its hello (MALFORMED). It is
    sent in pieces now. An experiment with more cuts than a hello can name fails when it is read (exit 2)."""
    path = tmp_path / "parties.toml"
    path.write_text(_parties_toml(24))
    exp = load_experiment(str(path))
    server = ServingStage(StageOptions(exp, "g", exp.seed, steps=10))
    for i, name in enumerate(exp.stage_names[:-1]):
        said = hello(exp, name, exp.seed, exp.cuts[i], f"run-{name}", [0], 10, 1)
        assert only_reply(server.handle([name.encode()], said, 0.0)).type == wire.WELCOME
    assert server.phase is Phase.ROUND
    path.write_text(_parties_toml(130))
    with pytest.raises(ConfigError, match="too many interface fields for a hello"):
        load_experiment(str(path))


def test_a_stage_without_checkpoint_every_gives_its_engine_no_checkpoint_observer(tmp_path):
    """A step's update builds a StepRecord (and its learning rate) only for an observer that uses it: none
    is registered to checkpoint unless ``--checkpoint-every`` asks for it."""
    from distgrad.run.stage_state import StageState
    exp = load_experiment("tanh-regression")
    assert StageState(StageOptions(exp, "f", exp.seed)).engine.observers == []
    state = StageState(StageOptions(exp, "f", exp.seed, checkpoint_dir=tmp_path, checkpoint_every=2))
    assert len(state.engine.observers) == 1


def test_a_reply_leaves_before_the_reply_cache_is_pruned():
    """``handle`` does only what the reply needs before it leaves; dropping the replies of the
    driver's earlier steps from the reply cache (``Turns.after_reply``) runs after it, in ``settle``, with
    the micro-batch's gradients and update. Nothing sees the cache between the two: the next message's
    ``handle`` settles first, so a repeat of an old step is still refused and the step's own repeat gets
    its reply."""
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    first = only_reply(server.handle(PEER, _forward(exp, "r", 1), 0.0))
    server.settle()
    second = only_reply(server.handle(PEER, _forward(exp, "r", 2), 0.0))
    peer = server.peers[0]
    assert set(peer.cached) == {(1, 0), (2, 0)} and peer.cached[(1, 0)] is first   # pruned only after the reply
    assert server.settle() == [] and set(peer.cached) == {(2, 0)} and server.stage.step == 2
    assert only_reply(server.handle(PEER, _forward(exp, "r", 2), 0.0)) is second
    with pytest.raises(ProtocolError, match="expected step 3"):
        server.handle(PEER, _forward(exp, "r", 1), 0.0)


def test_a_steps_targets_are_looked_up_once_and_before_its_first_forward():
    """The label owner looks up a step's targets once (each of its micro-batches slices them; each
    used to gather the whole batch again), and looks up the next step's after a step's update, in
    ``settle``, so none is looked up between a forward's arrival and its reply. The replies are those of
    a stage that looks each up when it is needed."""
    server, exp = _serving("digits")
    reference, _ = _serving("digits")
    lookups = []
    data = server.data[0]
    looked_up = data.targets
    data.targets = lambda step: lookups.append(step) or looked_up(step)
    for stage in (server, reference):
        stage.handle(PEER, hello_message(exp, "r", micro_batches=4), 0.0)
    for step in (1, 2, 3):
        for msg in _micro_forwards(exp, "r", step, 4):
            reply = only_reply(server.handle(PEER, msg, 0.0))
            assert lookups.count(step) == 1 and not lookups.count(step + 1)
            expected = only_reply(reference.handle(PEER, msg, 0.0))
            assert reply.body["loss"] == expected.body["loss"]
            assert np.array_equal(reply.tensors["activation_grad"], expected.tensors["activation_grad"])
        server.settle()
        reference.settle()
        assert lookups == list(range(1, step + 2))         # the next step's, after this step's update
    assert _same(_params(server), _params(reference))


def test_a_forward_after_the_early_stop_is_refused_and_changes_nothing(tmp_path):
    """early_stopping ends the run on every party at the step whose evaluation said stop: a data owner that
    sends a later step anyway (a hand-made one; the daemons and the cut library stop there) is refused
    (step) and the label owner trains no further; the bye after that step ends the run, stopped there."""
    path = tmp_path / "digits.toml"
    path.write_text((BUILTIN_DIR / "digits.toml").read_text()
                    .replace('path = "../datasets/', f'path = "{BUILTIN_DIR.parent}/datasets/')
                    .replace('loss = "softmax_cross_entropy"', 'loss = "softmax_cross_entropy"\n'
                             'early_stopping = { metric = "test_loss", patience = 1 }')
                    .replace("steps = 800", "steps = 800\neval_every = 1"))
    exp = load_experiment(path)
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    held_out = _evaluate_message(exp, "r", 2).tensors["activation"]
    for step, h in ((1, held_out), (2, held_out * 100)):     # the second evaluation's loss is worse: stop
        assert only_reply(server.handle(PEER, _forward(exp, "r", step), 0.0)).type == wire.BACKWARD
        server.settle()
        evaluation = only_reply(server.handle(PEER, Message(wire.EVALUATE, "r", step + 1,
                                                             tensors={"activation": h}), 0.0))
    assert evaluation.body["stop"] and server.stage.step == 2
    before = _params(server)
    with pytest.raises(ProtocolError, match="forward for step 3: early stopping ended the run after step 2") as e:
        server.handle(PEER, _forward(exp, "r", 3), 0.0)
    assert e.value.code == ErrorCode.STEP
    server.settle()
    assert server.stage.step == 2 and _same(before, server.stage.params)
    assert only_reply(server.handle(PEER, Message(wire.BYE, "r", 3, body={"steps": 2}), 0.0)).type == wire.BYE


def test_a_client_restarted_without_the_update_of_its_last_step_gets_its_replies_again_and_skips_nothing():
    # Killed after this stage answered its step 1 and before it checkpointed its own update, client 1
    # restarts (same run, --resume) holding only step 0: it redoes step 1 from the kept replies (exactly once
    # on both sides) instead of being told to go on at step 2 without that update.
    server, exp = _serving("digits-clients")
    peers = [[b"c0"], [b"c1"], [b"c2"]]
    for c in range(3):
        server.handle(peers[c], hello_message(exp, f"run{c}", client=c), 0.0)
    replies = {}
    for c in range(3):
        for envelope, reply in server.handle(peers[c], _forward(exp, f"run{c}", 1, client=c), 0.0):
            replies[envelope[0]] = reply
        server.settle()
    assert server.round == 2 and server.stage.step == 3
    before = _params(server)
    again = [reply for _, reply in server.handle([b"c1 again"], hello_message(exp, "run1", client=1, held=[0],
                                                                                step=0), 0.0)
             if reply.type == wire.WELCOME]
    assert [welcome.body["next_step"] for welcome in again] == [1]
    resent = only_reply(server.handle([b"c1 again"], _forward(exp, "run1", 1, client=1), 0.0))
    server.settle()
    assert resent is replies[b"c1"]
    assert server.stage.step == 3 and _same(before, server.stage.params)
    # A client that holds its latest step here goes on after it, as before.
    held = [reply for _, reply in server.handle([b"c2 again"], hello_message(exp, "run2", client=2, held=[0, 1],
                                                                               step=1), 0.0)
            if reply.type == wire.WELCOME]
    assert [welcome.body["next_step"] for welcome in held] == [2]


def _splitfed_parties(tmp_path) -> tuple[ServingStage, object]:
    """digits-splitfed as stage files (``distgrad split``): the label owner's serving stage, built from its own
    file, which does not define the data owners' model, and the data owners' experiment (their file)."""
    from distgrad.config.split import split_experiment
    files = {path.stem: path for path in split_experiment(load_experiment("digits-splitfed"), tmp_path / "parties")}
    g_exp, f_exp = load_experiment(str(files["g"])), load_experiment(str(files["f"]))
    assert not g_exp.has_stage("f")
    return ServingStage(StageOptions(g_exp, "g", g_exp.seed)), f_exp


def _through_first_average(server: ServingStage, f_exp, tensors: list[dict[str, np.ndarray] | None]) -> list:
    """Three clients' hellos and forwards up to the first average, then their averages (``tensors[c]``; None:
    client c sends none): the replies to the averages, or the refusals."""
    peers = [[b"c0"], [b"c1"], [b"c2"]]
    for c in range(3):
        server.handle(peers[c], hello_message(f_exp, f"run{c}", client=c), 0.0)
    every = f_exp.clients.average_every
    for step in range(1, every + 1):
        for c in range(3):
            server.handle(peers[c], _forward(f_exp, f"run{c}", step, client=c), 0.0)
            while server.settle():
                pass
    replies = []
    for c in range(3):
        if tensors[c] is None:          # this client sends none yet
            continue
        try:
            replies += server.handle(peers[c], Message(wire.AVERAGE, f"run{c}", every, tensors=tensors[c]), 0.0)
        except ProtocolError as refused:
            replies.append((peers[c], refused))
        replies += server.settle()
    return replies


def test_a_splitfed_label_owner_from_its_own_stage_file_averages_what_the_clients_send(tmp_path):
    """The label owner's stage file does not hold the clients' model: it still serves SplitFed, taking the
    parameters' names and shapes from the clients' averages (every client's alike), and answers each with
    their mean in client order."""
    server, f_exp = _splitfed_parties(tmp_path)
    f = Stage.from_experiment(f_exp, "f")
    sent = [{name: value + np.float32(c) for name, value in f.params.items()} for c in range(3)]
    replies = _through_first_average(server, f_exp, sent)
    assert [reply.type for _, reply in replies] == [wire.AVERAGE] * 3
    for name in f.params:
        expected = (sent[0][name] + sent[1][name] + sent[2][name]) / np.float32(3)
        for _, reply in replies:
            assert np.array_equal(reply.tensors[name], expected), name


def test_a_splitfed_client_whose_parameters_differ_from_the_others_is_refused_and_nothing_changes(tmp_path):
    """A client with another model (another stage file) sends parameters of other shapes: refused with the
    reason (code tensor), the others' average is not answered with them."""
    server, f_exp = _splitfed_parties(tmp_path)
    f = Stage.from_experiment(f_exp, "f")
    sent = [dict(f.params), dict(f.params), {name: np.zeros((2, *value.shape), np.float32)
                                             for name, value in f.params.items()}]
    replies = _through_first_average(server, f_exp, sent)
    refused = [reply for _, reply in replies if isinstance(reply, ProtocolError)]
    assert len(refused) == 1 and refused[0].code == ErrorCode.TENSOR, replies
    assert "client 2's parameters are not the model client 0 averages" in str(refused[0])
    assert "expected float32" in str(refused[0])
    assert not any(getattr(reply, "type", None) == wire.AVERAGE for _, reply in replies)
    assert server.peers[2].average is None                      # nothing of the refused average is kept
    # The stage goes on serving: client 2's parameters of the model, sent then, complete the average.
    replies = server.handle([b"c2"], Message(wire.AVERAGE, "run2", f_exp.clients.average_every,
                                             tensors=dict(f.params)), 0.0) + server.settle()
    assert [reply.type for _, reply in replies] == [wire.AVERAGE] * 3
    mean = {name: (value + value + value) / np.float32(3) for name, value in f.params.items()}
    assert all(np.array_equal(reply.tensors[name], mean[name]) for _, reply in replies for name in f.params)


def test_a_splitfed_client_sending_its_average_again_with_other_shapes_is_refused(tmp_path):
    """The first average of the run sets the model a label owner without the clients' model averages, also for
    the client that sent it: the same client's average sent again with other shapes is refused (it replaced
    the first, and the other clients' averages of the model were refused), and the average goes on."""
    server, f_exp = _splitfed_parties(tmp_path)
    f = Stage.from_experiment(f_exp, "f")
    other = {name: np.zeros((2, *value.shape), np.float32) for name, value in f.params.items()}
    every = f_exp.clients.average_every
    assert _through_first_average(server, f_exp, [dict(f.params), None, None]) == []   # only client 0's is in
    with pytest.raises(ProtocolError, match="client 0's parameters are not the model it sent before") as refused:
        server.handle([b"c0"], Message(wire.AVERAGE, "run0", every, tensors=other), 0.0)
    assert refused.value.code == ErrorCode.TENSOR
    assert server.peers[0].average.tensors["f1.W"].shape == f.params["f1.W"].shape
    replies = []
    for c in (1, 2):
        replies += server.handle([b"c%d" % c], Message(wire.AVERAGE, f"run{c}", every, tensors=dict(f.params)),
                                 0.0) + server.settle()
    assert [reply.type for _, reply in replies] == [wire.AVERAGE] * 3


def test_an_average_to_a_stage_that_averages_nothing_is_refused_saying_so():
    server, exp = _serving("digits-clients")
    for c in range(3):
        server.handle([b"c%d" % c], hello_message(exp, f"run{c}", client=c), 0.0)
    before = _params(server)
    with pytest.raises(ProtocolError, match="averages nothing") as refused:
        server.handle([b"c0"], Message(wire.AVERAGE, "run0", 0, tensors={"x": np.ones(2, np.float32)}), 0.0)
    assert refused.value.code == ErrorCode.TYPE and "never" not in str(refused.value)
    assert _same(before, server.stage.params) and server.peers[0].average is None
