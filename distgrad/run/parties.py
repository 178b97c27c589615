"""The feature parties of a vertical experiment, as a serving stage's topology (``Parties``).

Every party sends its own embedding of the same rows; a micro-batch waits for
all of them, combines them (``aggregate``) and sends each party the gradient
of its own part. A party that goes back to an earlier step takes this stage
and every other party back with it; a silent party is waited for (a step
needs every party), never dropped.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from distgrad.model import aggregate

from distgrad.wire import masking, messages as wire
from distgrad.errors import NonFiniteError, ProtocolError, StageError
from distgrad.run.decisions import Computed, Evaluate, Failure, Gradients, Join, Liveness, Scores, Take, Transition
from distgrad.run.handshake import check_hello, common_step, same_exactly
from distgrad.run.peers import Peer, PeerStatus, Phase
from distgrad.run.protocol import hello_peer
from distgrad.stage.records import evaluation_fields
from distgrad.stage.stage import evaluate_held_out, held_out_part, kept_model, micro_batch
from distgrad.wire.link import is_final
from distgrad.run.topology import LabelSource, ServingView, Topology, label_sources
from distgrad.wire.messages import ErrorCode, Message
from distgrad.wire.wirecodec import GRADIENT


class Parties(Topology):
    """Vertical feature parties, combined by the experiment's ``aggregate`` into one step."""

    def __init__(self, serving: ServingView, count: int) -> None:
        super().__init__(serving, count)
        self.found = 0      # a hint: parties 0 .. found - 1 had sent their part of the micro-batch (``all_in``)
        self.widths = [self.input_shape(index)[-1] for index in range(count)]   # of each party's embedding
        self.aggregate = serving.exp.aggregate_kind     # how the parties' embeddings combine
        self.secure = serving.exp.secure_aggregation    # their parts are masked fixed point (``masking``)
        self.tags: dict[str, dict[str, str]] = {}       # secure: each party's hello's pair tags, by party

    def build_data(self, seed: int, stage: str) -> list[LabelSource]:
        """Every party's rows are the same rows: one label source."""
        return label_sources([self.serving.exp.build_data(seed, stage=stage)] * self.count)

    def input_shape(self, index: int) -> tuple[int, ...]:
        """A party's forwards carry its own embedding."""
        exp = self.serving.exp
        return exp.cuts[exp.stage_index(self.serving.parties[index])]

    def name(self, peer: Peer) -> str:
        return f"party {self.serving.parties[peer.index]}"

    def stream(self, peer: Peer) -> str:
        return self.serving.parties[peer.index]

    # -- hello
    def check_hello(self, body: dict[str, Any]) -> int:
        s = self.serving
        index = self.peer_index(body)
        role = s.parties[index]
        micro_batches = check_hello(body, role, s.exp, s.opts.seed, s.input_shapes[index], s.opts.stage)
        if self.secure:
            masking.read_tags(body.get("mask_tags"), s.parties, role)     # kept once ``join`` accepts the hello
        return micro_batches

    def peer_index(self, body: dict[str, Any]) -> int:
        return hello_peer(body, self.serving.exp.name, parties=self.serving.parties)

    def join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> Join:
        """It goes on from the newest step it and this stage both hold, no later than where this stage
        stands. When that is earlier, this stage rolls back to it and every other party must say hello
        again (``STALE``), so all of them go on from one step. After the last step only a party of the run
        holding it may come back (for its evaluation and bye)."""
        s = self.serving
        held = msg.body.get("held")
        common_step([0], held)                          # validates the list
        assert isinstance(held, list)
        self._check_join(peer, msg, mbs, eval_every, peer_key, now)
        if self.secure:
            name = s.parties[peer.index]
            self.tags[name] = masking.read_tags(msg.body.get("mask_tags"), s.parties, name)
        live = s.stage.step
        common = max([step for step in set(s.state.held()) & set(held) if step <= live] or [0])
        if peer.run and peer.run != msg.run:
            s.log.warning("%s starts a new run (%s, holding steps %s) in place of run %s", self.name(peer),
                          msg.run, held[-8:], peer.run)
        # Secure: the masks' session is every party's run id (``mask_runs``): a party's new run changes it, and
        # every other party must say hello again to learn it (masks of two sessions would not cancel).
        renewed = f"{self.name(peer)} began a new run: its masks changed; say hello again" if (
            self.secure and peer.run and peer.run != msg.run) else ""
        owner, since = (peer_key, time.time()) if peer.run != msg.run else (peer.owner, peer.since)
        if common < live:
            s.log.warning("%s goes on from step %d: this stage and every other party go back to it",
                          self.name(peer), common)
            return Join(common + 1, PeerStatus.ACTIVE, common, msg.run, owner, since, None, open_run=True,
                        rollback=common, restart=True, reset_engine=True, still_owes=True,
                        stale=f"{self.name(peer)} went back to step {common}; the run goes on from there: "
                              f"say hello again")
        # The round in progress goes on; the party's replies of it stay, so a micro-batch it sends
        # again (it computes the same values) gets the same reply.
        return Join(common + 1, PeerStatus.ACTIVE, common, msg.run, owner, since, (common + 1, common + 1),
                    open_run=True, still_owes=True, stale=renewed)

    def _check_join(self, peer: Peer, msg: Message, mbs: int, eval_every: int, peer_key: str, now: float) -> None:
        """What every party must agree on (steps, micro-batches, evaluations), one key per party, and no
        second process in a live party's place; ``ProtocolError`` otherwise."""
        s, run = self.serving, self.run
        steps = msg.body.get("steps")
        if not same_exactly(steps, run.steps):
            # This stage counts the run's steps itself: a party that would stop elsewhere would stall the rest.
            raise ProtocolError(ErrorCode.MISMATCH, f"{self.name(peer)} runs {wire.show(steps)} steps, this stage "
                                                    f"{run.steps} (give every stage the same --steps)")
        for other in run.peers:
            if peer_key and other is not peer and other.owner == peer_key:
                # With CURVE a key is one party: the key of party a cannot also take party b's place.
                raise ProtocolError(ErrorCode.RUN, f"this client key said hello as {self.name(other)}; it cannot "
                                                   f"also be {self.name(peer)} (each party has its own key)")
        if peer.run and peer.run != msg.run and peer.live(now, s.opts.liveness_s):
            # Another process naming the same party (or one restarted without --resume too soon): it would
            # take the live party's place and send every party back to its step.
            busy = wire.busy_text("run", peer.run, peer.since, self.name(peer), now - peer.last_seen, s.opts.liveness_s)
            raise ProtocolError(ErrorCode.RUN, f"{busy}; cannot start run {msg.run!r}")
        for other in run.peers:
            if other is not peer and other.status is PeerStatus.ACTIVE and (other.mbs, other.eval_every) != (
                    mbs, eval_every):
                raise ProtocolError(ErrorCode.MISMATCH, f"{self.name(peer)} asks for {mbs} micro-batches and an "
                                                        f"evaluation every {eval_every} steps, {self.name(other)} "
                                                        f"for {other.mbs} and {other.eval_every}")
        if run.phase is Phase.DONE and not (peer.run == msg.run and peer.status is not PeerStatus.FINISHED
                                            and s.stage.step in msg.body["held"]):
            raise ProtocolError(ErrorCode.RUN, f"every step of this run is done; {self.name(peer)} cannot "
                                               f"join now")

    # -- the rounds
    def round_order(self) -> list[int]:
        return list(range(self.count))      # every party, every round

    def turn_peers(self) -> list[Peer]:
        """Every feature party of the round, whose embeddings combine."""
        run = self.run
        if run.phase is not Phase.ROUND or run.turn >= 1:
            return []
        return [run.peers[i] for i in run.order]

    def in_turn(self, peer: Peer) -> bool:
        """Every party takes part in every round: no scan of the parties."""
        return self.run.phase is Phase.ROUND and self.run.turn < 1

    def current(self) -> Peer | None:
        return None

    def advance_round(self) -> Take | Transition:
        run = self.run
        if run.turn == 0:
            key = (run.round, self.serving.engine.done)
            if not self.all_in(key):
                return Transition.WAIT      # a step needs every party's embedding
            return Take(tuple(self.turn_peers()), key)
        return Transition.END_ROUND

    def all_in(self, key: tuple[int, int]) -> bool:
        """Every party taking part has sent its part of micro-batch ``key`` (step, micro-batch).

        Called on every party's message: each call goes on from the party where the last one stopped
        (``found``), so a micro-batch costs O(parties) checks in all, not O(parties) per message. Before
        the parts combine every party is checked again (one may have said hello again meanwhile, which
        drops what it had sent, or the run gone back to an earlier step)."""
        peers, found, active = self.run.peers, self.found, PeerStatus.ACTIVE
        while found < self.count and peers[found].status is active and key in peers[found].waiting:
            found += 1
        if found < self.count:
            self.found = found
            return False
        self.found = 0
        return all(p.status is active and key in p.waiting for p in peers)

    def advance_joining(self, now: float) -> Transition:
        run = self.run
        if any(p.status is not PeerStatus.ACTIVE or p.step != run.round for p in run.peers):
            return Transition.WAIT      # a step needs every party: no round starts without one
        # Going on after a step whose evaluation is due (a resume or a rollback to it): every party
        # evaluates it again after its hello (``driver_records._owes_evaluation``) before the next step.
        return Transition.ROUND_DONE if run.round > 0 else Transition.START_ROUND

    def advance_evaluating(self) -> Evaluate | None:
        run = self.run
        group = tuple(run.peers[i] for i in sorted(run.owed))
        if any(p.evaluate is None or p.evaluate.step != run.round + 1 or is_final(p.evaluate) for p in group):
            return None                 # every party's held-out embeddings combine
        return Evaluate((group,), then_start=True)

    def answer_evaluations(self) -> Evaluate | None:
        """After the last round: once every party has sent its held-out embeddings of the last step (then, with
        a validation split, once every party has sent its test rows' for the final evaluation)."""
        run = self.run
        requests = [p.evaluate for p in run.peers]
        if run.phase is Phase.DONE and all(m is not None and m.step == run.round for m in requests) \
                and len({is_final(m) for m in requests if m is not None}) == 1:
            return Evaluate((tuple(run.peers),))
        return None

    def compute(self, peers: tuple[Peer, ...], msgs: list[Message], now: float) -> Computed:
        """One micro-batch: the parties' embeddings combined (``aggregate``), the loss, and each party's
        reply with the gradient of its own embedding; the gradients and the update are deferred until the
        replies have left. A non-finite loss or gradient fails the run, applying nothing."""
        s = self.serving
        stage, first = s.stage, msgs[0]
        step, mb, mbs = first.step, first.mb, first.mbs
        started = time.perf_counter()
        rows = self.common_rows(peers, msgs)
        refused = rows if isinstance(rows, str) else self.unsummable(peers, msgs, f"step {step} micro-batch {mb}")
        if refused is not None:     # nothing of the micro-batch is applied
            s.log.warning("%s", refused)
            return Computed([(p, wire.error_message(m.run, step, ErrorCode.MISMATCH, refused, mb, mbs))
                             for p, m in zip(peers, msgs)])
        assert not isinstance(rows, str)
        try:
            if rows is None:
                own = micro_batch(s.data[0].features(step), mb, mbs) if s.exp.own_bottom else None
            else:           # send_rows: the label owner's own columns of the rows the parties sent
                own = s.data[0].features_at(rows) if s.exp.own_bottom else None
            target = self.micro_targets(0, step, mb, mbs, rows)
            for peer, msg in zip(peers, msgs):      # each party's meter: model completion's input (masked: none)
                if not self.secure:
                    s.metering.received_activations(step, mb, mbs, msg.tensors["activation"], peer.index)
            z = aggregate.join_input([m.tensors["activation"] for m in msgs], own, self.aggregate, self.secure)
            with stage.labels_drawn_if_sent():      # a label drawn for replies refused is not released
                mb_loss, dz, grads_later = stage.loss_micro_batch_deferred(z, target, mb)
                stage.check_finite("loss", mb_loss, step)
                stage.check_finite("activation_grad", dz, step)
                parts = aggregate.split_input(dz, s.exp.own_bottom, self.aggregate, self.widths)
                sent = [s.encode(GRADIENT, dy, peer.streams[mb], step, rows) for peer, dy in zip(peers, parts)]
        except (NonFiniteError, StageError) as e:
            code = ErrorCode.NONFINITE_STEP if isinstance(e, NonFiniteError) else ErrorCode.STAGE
            s.log.error("%s", e)
            return Computed([(p, wire.error_message(m.run, step, code, str(e), mb, mbs)) for p, m in zip(peers, msgs)],
                            failure=Failure(peers, e, ends_run=isinstance(e, NonFiniteError), reset_engine=True))
        # every reply's (read only); without the loss when this stage withholds it
        body = {**s.engine.senders.reply_body(mb_loss), "compute_s": time.perf_counter() - started}
        answers = [(peer, Message(wire.BACKWARD, msg.run, step, mb, mbs, body=body, tensors=tensors))
                   for peer, msg, tensors in zip(peers, msgs, sent)]
        return Computed(answers, Gradients(peers, step, mb, mbs, grads_later, mb_loss, dz, self.client_of(peers), 0))

    def unsummable(self, peers: tuple[Peer, ...], msgs: list[Message], what: str) -> str | None:
        """Secure aggregation: why the parties' masked parts of ``what`` would not cancel in their sum (two
        parties' keys of their pair differ, ``unpaired``; a part masked for another session than the one of
        the runs this stage names, ``masking.unmatched_sessions``), else None."""
        if not self.secure:
            return None
        return self.unpaired() or masking.unmatched_sessions(
            [(self.name(peer), msg) for peer, msg in zip(peers, msgs)], self.mask_runs(), what)

    def mask_runs(self) -> list[str]:
        """Every party's run id in party order ("" for a party not heard yet): the runs its masks bind to."""
        return [peer.run for peer in self.run.peers]

    def unpaired(self) -> str | None:
        """Secure aggregation: why two parties' masks would not cancel (their hellos' tags of their pair
        differ; ``masking.check_tags``, in party order), else None."""
        if not self.secure:
            return None
        return masking.check_tags({name: self.tags[name] for name in self.serving.parties if name in self.tags})

    def common_rows(self, group: tuple[Peer, ...], msgs: list[Message]) -> np.ndarray | str | None:
        """The rows every party's forward of a micro-batch carries (``send_rows``; None without), or, when
        two parties sent different rows, the refusal's text (each party gets a ``mismatch``; nothing of the
        micro-batch is applied)."""
        if not self.serving.exp.send_rows:
            return None
        rows = msgs[0].tensors["rows"]
        for peer, msg in zip(group[1:], msgs[1:]):
            if not np.array_equal(msg.tensors["rows"], rows):
                differ = int(np.argmax(msg.tensors["rows"] != rows))
                return (f"the feature parties sent different rows for step {msg.step} micro-batch {msg.mb}: "
                        f"{self.name(group[0])} row {int(rows[differ])}, {self.name(peer)} row "
                        f"{int(msg.tensors['rows'][differ])} at position {differ}; every party must send the "
                        f"same rows (nothing was applied)")
        return rows

    def score(self, group: tuple[Peer, ...], requests: list[Message]) -> Scores:
        """Every party's held-out embeddings combined and scored; the same scores go to each. The final
        evaluation (``link.is_final``): their test rows', scored with the kept model (``StageState.kept_model``)."""
        s = self.serving
        step, final = requests[0].step - 1, is_final(requests[0])
        refused = self.unsummable(group, requests, f"the {'final ' if final else ''}evaluation after step {step}")
        if refused is not None:
            s.log.warning("%s", refused)
            return Scores(step, None, (ErrorCode.MISMATCH, refused), s.run.steps, final)
        data = s.data[0]
        try:
            part, _ = held_out_part(data.validation_count, final)
            own = data.test_features()[part] if s.exp.own_bottom else None
            with kept_model(s.stage, s.state.kept_model() if final else None):
                z = aggregate.join_input([m.tensors["activation"] for m in requests], own, self.aggregate, self.secure)
                result = evaluate_held_out(s.stage, z, data.test_targets(), s.metrics, data.validation_count, final)
        except StageError as e:
            return Scores(step, None, (ErrorCode.STAGE, str(e)), s.run.steps, final)
        return Scores(step, result, None, s.run.steps, final)

    # -- liveness and the end of the run
    def tick(self, now: float) -> Liveness:
        """Log which silent party the run waits for (the others wait, nothing is dropped), and when it is
        back; ``lost_since`` tells ``serve`` how long the run has been stuck."""
        s, run = self.serving, self.run
        missing = self.missing(now)
        if missing and run.lost_since is None:
            s.log.warning("waiting for %s: silent for more than %g s at step %d; a step needs every party, "
                          "the others wait (restart it with --resume to go on)",
                          ", ".join(self.name(p) for p in missing), s.opts.liveness_s, run.round)
            return Liveness((), now)
        if not missing and run.lost_since is not None:
            s.log.info("every party is back at step %d", run.round)
            return Liveness((), None)
        return Liveness((), run.lost_since)

    def missing(self, now: float) -> list[Peer]:
        """The parties the run waits for that have been silent for ``liveness_s``: not (back) in the run,
        or without their part of the micro-batch or evaluation in progress."""
        s, run = self.serving, self.run
        since = lambda p: max(p.last_seen, run.joined_at)     # noqa: E731
        if run.phase is Phase.DONE:
            # Every step is done: a party that has not said bye still owes its evaluation and bye.
            awaited = [p for p in run.peers if p.status is not PeerStatus.FINISHED]
        elif run.phase is Phase.ROUND:
            key = (run.round, s.engine.done)
            awaited = [p for p in run.peers if p.status is not PeerStatus.ACTIVE or key not in p.waiting]
        elif run.phase is Phase.EVALUATING:
            awaited = [run.peers[i] for i in sorted(run.owed) if run.peers[i].evaluate is None]
        else:
            awaited = [p for p in run.peers if p.status is not PeerStatus.ACTIVE or p.step != run.round]
        return [p for p in awaited if now - since(p) > s.opts.liveness_s]

    def lost_message(self) -> str:
        s, run = self.serving, self.run
        names = ", ".join(self.name(p) for p in self.missing(run.now)) or "a party"
        unmask = "; with secure_aggregation the sum cannot be unmasked without every party's part" if self.secure else ""
        return (f"{names} silent for more than {s.opts.liveness_s + s.opts.peer_deadline_s:g} s at step {run.round}; "
                f"giving up (a step needs every feature party{unmask})")

    def completed_message(self, finished: dict[str, Any]) -> str:
        return f"run completed: {finished.get('rounds', 0)} steps with parties {self.serving.parties}"

    def pong_fields(self, now: float) -> dict[str, Any]:
        return {"waiting_for": [self.serving.parties[p.index] for p in self.missing(now)], **self.welcome_fields()}

    def welcome_fields(self) -> dict[str, Any]:
        """Secure: ``mask_runs``, every party's run id in party order, once each party has said hello (a
        party binds its masks to them, ``PairMasks.for_run``; until then it asks again with pings)."""
        runs = self.mask_runs()
        return {"mask_runs": runs} if self.secure and all(runs) else {}

    def summary_fields(self) -> dict[str, Any]:
        s, run = self.serving, self.run
        return {"parties": [{"party": s.parties[p.index], "run_id": p.run, "steps": p.step,
                             "status": "completed" if p.status is PeerStatus.FINISHED else p.status.value}
                            for p in run.peers],
                "rounds": min(run.rounds_done, run.steps or 0), **evaluation_fields(run.peers[0].evaluation)}
