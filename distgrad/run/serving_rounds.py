"""The phases of a served run's rounds (``RoundMachine``): joining, the turns of a round, SplitFed's average,
the evaluations owed after a round, and the work a micro-batch's reply defers (its gradients and update).

The topology decides what comes next (``decisions``); this class applies it. It builds on ``ServedRun``
(``serving_run``) and is the base of ``serving.ServingStage``.
"""

from __future__ import annotations

from typing import Any


from distgrad.wire import messages as wire
from distgrad.errors import NonFiniteError
from distgrad.wire.link import evaluation_reply
from distgrad.run.decisions import (Average, Computed, Evaluate, Gradients, Transition)
from distgrad.run.protocol import prune_replies
from distgrad.run.peers import Peer, PeerStatus, Phase, Reply
from distgrad.wire.messages import ErrorCode, Message

from distgrad.run.serving_run import ServedRun


class RoundMachine(ServedRun):
    """The rounds of a served run: ``advance`` does every piece of work whose inputs have arrived, in the fixed
    order (turns, averages, evaluations), and ``settle`` the work a sent reply deferred."""

    # -- the phases
    def start_round(self) -> None:
        """The next round, or the end of the run after the last. A peer rejoining takes part from it."""
        run = self.run
        run.round += 1
        if run.steps is not None and run.round > run.steps:
            run.phase = Phase.DONE
            self.log.info("every step is done; answering evaluations and byes")
            return
        for peer in run.peers:
            if peer.status is PeerStatus.REJOINING:
                peer.status = PeerStatus.ACTIVE
        run.order = self.topology.round_order()
        run.turn, run.phase = 0, Phase.ROUND

    def advance(self, now: float) -> list[Reply]:
        """Do every piece of work whose inputs have arrived, in the fixed order; return the replies."""
        replies: list[Reply] = []
        while self.deferred is None and self._advance_phase(now, replies):
            pass                            # a reply's gradients and update come before any later work
        if self.evaluating:
            answers = self.topology.answer_evaluations()
            if answers is not None:
                replies += self._answer_all(answers)
            self.evaluating = any(peer.evaluate is not None for peer in self.run.peers)
        return replies

    def _advance_phase(self, now: float, replies: list[Reply]) -> bool:
        """Do the next piece of work of the phase, adding its replies; False while it waits."""
        phase = self.run.phase
        if phase is Phase.ROUND:            # the hot path first
            take = self.topology.advance_round()
            if isinstance(take, Transition):
                return take is not Transition.WAIT and self.transition(take)
            msgs = [peer.waiting.pop(take.key) for peer in take.peers]
            replies += self.apply_computed(self.topology.compute(take.peers, msgs, now), now)
            return True
        if phase is Phase.JOINING:
            return self.transition(self.topology.advance_joining(now))
        if phase is Phase.AVERAGING:
            average = self.topology.advance_averaging()
            if average is None:
                return False
            replies += self._averaged(average, now)
            return True
        if phase is Phase.EVALUATING:
            evaluate = self.topology.advance_evaluating()
            if evaluate is None:
                return False
            replies += self._answer_all(evaluate)
            self.run.owed -= {peer.index for group in evaluate.groups for peer in group}
            if evaluate.then_start:
                self.run.owed = set()
                self.start_round()
            return evaluate.then_start
        return False

    def transition(self, to: Transition) -> bool:
        """Move the phase on as the topology decided; False for ``WAIT``."""
        if to is Transition.WAIT:
            return False
        if to is Transition.NEXT_TURN:
            self.run.turn += 1
        elif to is Transition.START_ROUND:
            self.start_round()
        elif to is Transition.END_ROUND:
            self.end_round()
        else:                               # ROUND_DONE: the round before the first, done before
            self.run.order = self.topology.round_order()
            self.round_done()
        return True

    def end_round(self) -> None:
        """Every peer of the round had its turn: its average (SplitFed), or its checkpoint and the next round.
        A round with an average is checkpointed with it (``_averaged``), never without it."""
        run = self.run
        if self.exp.clients.mode == "splitfed" and run.round % self.exp.clients.average_every == 0:
            run.phase = Phase.AVERAGING
            return
        self.state.after_step(run.round)
        self.round_done()

    def _averaged(self, d: Average, now: float) -> list[Reply]:
        """SplitFed: each peer of the round gets back the mean (``Average``); then the round's checkpoint,
        taken before these replies leave, holds them: a client whose reply the stage's kill lost gets it
        from the restarted stage (``Clients.resent_reply``)."""
        replies = []
        for p in d.peers:
            p.averaged = Message(wire.AVERAGE, p.run, self.run.round, tensors=d.mean)
            p.average, p.last_seen = None, now
            replies.append((p.envelope, p.averaged))
        self.state.after_step(self.run.round)
        self.round_done()
        return replies

    def round_done(self) -> None:
        """After a round (and its average): the peers due to evaluate after it are answered (phase
        EVALUATING) before the next round starts."""
        owed = self.topology.owed_after_round()
        if owed:
            self.run.owed, self.run.phase = owed, Phase.EVALUATING
            return
        self.start_round()

    # -- evaluations
    def _answer_all(self, d: Evaluate) -> list[Reply]:
        replies: list[Reply] = []
        for group in d.groups:
            requests = [peer.evaluate for peer in group]
            replies += self.answer(group, [m for m in requests if m is not None])
        return replies

    def answer(self, group: tuple[Peer, ...], requests: list[Message]) -> list[Reply]:
        """Score ``group``'s evaluation ``requests`` (``topology.score``), give the verdicts and answer each
        peer; no state changes but the peers' last evaluation (and the verdicts recorded). The final
        evaluation (``Scores.final``: the kept model's test rows) is recorded instead (``StageState.record_test``;
        with several clients, each client's own summary holds its figures), never judged."""
        scores = self.topology.score(group, requests)
        result = scores.result
        if result is not None and scores.final:
            if not self.exp.federated:
                self.state.record_test(result, self.topology.checkpoint_step())
        elif result is not None:
            result = self.judged(scores.step, result, scores.last)
        replies = []
        for peer, msg in zip(group, requests):
            peer.evaluate = None
            if result is None:
                code, text = scores.error or (ErrorCode.STAGE, "")
                replies.append((peer.envelope, wire.error_message(msg.run, msg.step, code, text)))
            elif scores.final:
                peer.tested = evaluation_reply(msg.run, msg.step, result)
                replies.append((peer.envelope, peer.tested))
            else:
                peer.evaluation = result
                peer.evaluated = evaluation_reply(msg.run, msg.step, result)
                replies.append((peer.envelope, peer.evaluated))
        return replies

    def _tested_before(self, msg: Message) -> Message | None:
        """A final evaluation this stage scored before it was restarted (its checkpoint holds the scores,
        ``StageState.final_test``): the reply, from those scores, without scoring the test rows again."""
        test = self.state.final_test
        if test is None or msg.run != self.state.run_id or msg.step != test["after"] + 1:
            return None
        return evaluation_reply(msg.run, msg.step, test)

    def judged(self, step: int, result: dict[str, Any], last: int | None) -> dict[str, Any]:
        """``result`` of the evaluation after ``step`` with its verdicts (``StageState.judged``; ``last``:
        the run's last step); early stopping ends the rounds after ``step`` when this stage counts them."""
        result = self.state.judged(step, result, step == last, gives=self.link is None)
        if result.get("stop") and self.run.steps is not None:
            self.run.steps = step
        return result

    # -- a micro-batch
    def apply_computed(self, d: Computed, now: float) -> list[Reply]:
        """What computing a micro-batch gave (``Computed``): its replies (each cached, its peer seen, when
        the step went through), the gradients deferred until they have left, or the failure (raising the
        refusal, if any, after it)."""
        if d.failure is not None:
            self.apply_failure(d.failure)
        if d.refusal is not None:
            raise d.refusal
        if d.gradients is not None:
            key = (d.gradients.step, d.gradients.mb)
            for peer, reply in d.answers:
                peer.cached[key] = reply
                peer.last_seen = now
            self.deferred = d.gradients
        return [(peer.envelope, reply) for peer, reply in d.answers]

    def accumulate(self, g: Gradients) -> None:
        """A micro-batch's parameter gradients, added in micro-batch order; after the last, the update
        (``g.peers``: whose turn it is, every party of a vertical round) and the next step's targets looked
        up (``Topology.prefetch``). After a step's first micro-batch each peer holds every reply of its earlier
        steps but those still in flight (staleness), so its reply cache keeps only these and this reply."""
        if g.mb == 0:           # in lockstep only this step's replies may be asked for again
            for peer in g.peers:
                peer.cached = prune_replies(peer.cached, g.step - peer.staleness)
        self.engine.add(g.mb, g.mbs, g.later(), g.loss, g.dx)
        if g.mb < g.mbs - 1:
            return
        self.loss = self.engine.update(g.step, g.mbs, client=g.client)
        if self.loss is None and self.link is not None:    # the label owner below withheld it (its replies)
            self.loss_withheld = True
        for peer in g.peers:
            peer.loss, peer.step = self.loss, g.step
        self.run.turn += 1
        self.topology.prefetch(g.data, g.step + 1)

    def settle(self) -> list[Reply]:
        """Run what ``handle`` deferred until its reply had been sent (gradients, update, pruning the reply
        cache), if any; return the replies of the work that then became possible (send, then settle again).

        A non-finite gradient there applies nothing; the peer hears of it in
        reply to its next message (with several clients, it is dropped)."""
        gradients, self.deferred = self.deferred, None
        if gradients is None:
            return []
        try:
            self.accumulate(gradients)
        except NonFiniteError as e:
            self.log.error("%s", e)
            self.apply_failure(self.topology.deferred_failed(gradients.peers, e))   # whose micro-batch it was
        return self.advance(self.run.now)
