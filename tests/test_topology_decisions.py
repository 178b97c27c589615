"""A serving stage's topology decides; the serving stage acts.

Each topology (one driver, clients in turn, vertical feature parties) reads the
run's state and returns typed decisions (``distgrad.run.decisions``); calling
one changes nothing of the serving stage, its run or its peers until the
serving stage applies what it returned. The interface is an abstract class,
typed: a topology is given a read-only view of its serving stage, not ``Any``.
"""

from __future__ import annotations

import abc
import typing

import numpy as np

from distgrad.config.parse import load_experiment
from distgrad.run import decisions
from distgrad.run import topology as topology_module
from distgrad.run.handshake import hello
from distgrad.run.options import StageOptions
from distgrad.run.serving import PeerStatus, Phase, ServingStage
from distgrad.run.topology import ServingView, Topology
from distgrad.stage.stage import Stage
from distgrad.wire import messages as wire
from distgrad.wire.messages import Message

from handshake import hello_message, only_reply

PEER = [b"peer"]


def _serving(name: str, **options) -> tuple[ServingStage, object]:
    exp = load_experiment(name)
    return ServingStage(StageOptions(exp, exp.stage_names[-1], exp.seed, **options)), exp


def _forward(exp, run: str, step: int, client: int | None = None, stage: str | None = None) -> Message:
    first = stage or exp.stage_names[0]
    x = Stage.from_experiment(exp, first).forward(exp.build_data(client=client, stage=stage).features(step))[0]
    return Message(wire.FORWARD, run, step, tensors={"activation": x})


def _snapshot(server: ServingStage) -> tuple:
    """Everything of the serving stage's run and peers a topology could change, comparable with ==."""
    run = server.run
    peers = tuple((p.index, p.status, p.run, p.owner, p.step, p.since, p.last_seen, p.mbs, tuple(p.waiting),
                   tuple(p.cached), p.average is None, p.averaged is None, p.evaluate is None,
                   p.evaluated is None, p.loss, p.failure) for p in run.peers)
    return (run.phase, run.round, tuple(run.order), run.turn, tuple(sorted(run.owed)), run.first_hello,
            run.joined_at, run.lost_since, run.active, run.steps, tuple(run.bye_replies), server.stage.step,
            server.engine.done, server.failure, server.closing, len(server.notices), server.state.run_id, peers)


def test_the_topology_interface_is_abstract_and_typed():
    """``Topology`` is an ``abc.ABC`` whose decisions are abstract methods; it is built with a typed,
    read-only view of its serving stage, and its methods return decision types, not None."""
    assert issubclass(Topology, abc.ABC)
    assert {"join", "round_order", "in_turn", "advance_round", "compute", "score", "advance_joining",
            "advance_evaluating", "answer_evaluations", "tick", "lost_message", "completed_message",
            "summary_fields"} <= Topology.__abstractmethods__
    names = vars(topology_module)
    assert typing.get_type_hints(Topology.__init__, names)["serving"] is ServingView
    returns = {name: typing.get_type_hints(getattr(Topology, name), names)["return"]
               for name in ("join", "tick", "failed", "resumed", "advance_joining", "score")}
    assert returns == {"join": decisions.Join, "tick": decisions.Liveness, "failed": decisions.Failure,
                       "resumed": decisions.Resume, "advance_joining": decisions.Transition,
                       "score": decisions.Scores}


def test_one_drivers_hello_of_its_run_is_a_rollback_decided_and_nothing_changes_until_applied():
    """The driver comes back holding only step 0 while the stage stands at step 2 (no checkpoints): its
    topology decides a rollback to step 0 (``Join``); the stage, the run and the peer are untouched until
    ``handle`` applies it."""
    server, exp = _serving("tanh-regression")
    server.handle(PEER, hello_message(exp, "r"), 0.0)
    for step in (1, 2):
        assert only_reply(server.handle(PEER, _forward(exp, "r", step), 0.0)).type == wire.BACKWARD
        server.settle()
    peer, before = server.peers[0], _snapshot(server)
    assert set(peer.cached) == {(2, 0)}
    again = hello_message(exp, "r")
    joined = server.topology.join(peer, again, 1, 0, "", 1.0)
    assert isinstance(joined, decisions.Join) and (joined.next_step, joined.step, joined.kept) == (1, 0, None)
    assert joined.rollback == 0 and joined.restart and joined.reset_engine and not joined.begin
    assert _snapshot(server) == before and server.stage.step == 2
    welcome = only_reply(server.handle(PEER, again, 1.0))       # now the serving stage applies it
    assert welcome.body["next_step"] == 1 and server.stage.step == 0 and server.phase is Phase.ROUND
    assert peer.cached == {} and peer.step == 0


def test_a_silent_client_is_a_drop_decided_and_applied_by_the_serving_stage_alone():
    """Client 0, in turn, stays silent: its topology's tick names it dropped (``Liveness``) and leaves its
    status alone; ``tick`` of the serving stage drops it and the round goes on with client 1."""
    server, exp = _serving("digits-clients", liveness_s=1.0)
    for c in range(3):
        server.handle([b"c%d" % c], hello_message(exp, f"run{c}", client=c), 0.0)
    for c in (1, 2):
        server.handle([b"c%d" % c], _forward(exp, f"run{c}", 1, client=c), 2.0)
    before = _snapshot(server)
    decided = server.topology.tick(2.0)
    assert isinstance(decided, decisions.Liveness) and decided.drop == (server.peers[0],) and decided.advance
    assert decided.lost_since is None and _snapshot(server) == before
    assert server.peers[0].status is PeerStatus.ACTIVE
    replies = server.tick(2.0)
    assert server.peers[0].status is PeerStatus.DROPPED
    assert [(envelope, reply.type) for envelope, reply in replies] == [([b"c1"], wire.BACKWARD)]


def test_parties_micro_batch_is_taken_then_computed_without_writing_and_its_update_waits_for_settle():
    """Both feature parties' parts are in: the topology names them (``Take``) and ``compute`` returns each
    party's reply and the gradients to add later (``Computed``), changing nothing; the serving stage caches
    the replies, sends them, and applies the update in ``settle``."""
    exp = load_experiment("digits-halves")
    server = ServingStage(StageOptions(exp, "g", exp.seed, steps=4))
    names = server.parties
    for index, name in enumerate(names):
        said = hello(exp, name, exp.seed, exp.cuts[index], f"run-{name}", [0], 4, 1)
        assert only_reply(server.handle([name.encode()], said, 0.0)).type == wire.WELCOME
    forwards = [_forward(exp, f"run-{name}", 1, stage=name) for name in names]
    assert server.handle([names[0].encode()], forwards[0], 0.0) == []
    peer = server.peers[1]
    peer.waiting[(1, 0)] = forwards[1]          # as ``handle`` would keep it, so the topology can be asked alone
    before, params = _snapshot(server), {k: v.copy() for k, v in server.stage.params.items()}
    take = server.topology.advance_round()
    assert isinstance(take, decisions.Take) and take.peers == tuple(server.peers) and take.key == (1, 0)
    computed = server.topology.compute(take.peers, [p.waiting[take.key] for p in take.peers], 0.0)
    assert isinstance(computed, decisions.Computed) and computed.failure is None and computed.refusal is None
    assert [(p.index, m.type) for p, m in computed.answers] == [(0, wire.BACKWARD), (1, wire.BACKWARD)]
    assert computed.gradients is not None and computed.gradients.step == 1
    assert _snapshot(server) == before
    assert all(np.array_equal(v, server.stage.params[k]) for k, v in params.items())
