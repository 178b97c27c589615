"""The noise of a stage's defenses never repeats across runs, and a step is never answered twice on other input.

A data owner that opens two runs with the same activations (a label owner with ``--keep-serving``, or
restarted with the same stage file) gets other noise each time; a step computed again (a resend after a
rollback, a resume after kill -9) on other activations than the first time is refused; on the same
activations it is answered bitwise as the first time. The label owner's randomized labels (``label_dp``) are
drawn from the same per-run secret: another run, other labels, whatever seed the data owner knows. The data
owner here is the cut library (``Cut``): it sends exactly the activations the test chooses, as a determined
party would.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from distgrad.cut import Cut
from distgrad.errors import NoiseReuseError, PeerRejected, ProtocolError
from distgrad.privacy.releases import NOISE_SECRET_VARIABLE, NoiseLedger, fresh_secret

from conftest import run_main, wait_for_file
from test_defenses import _digits

G_CLIP = "clip_noise = { max_norm = 0.05, sigma = 1.0 }"
BOUNDS = dict(timeout_s=2.0, peer_deadline_s=30.0)


@pytest.fixture
def fresh_secrets(monkeypatch):
    """Each run draws its own secret, as in production (no test override)."""
    monkeypatch.delenv(NOISE_SECRET_VARIABLE, raising=False)


def _parties(tmp_path: Path, g_extra: str = G_CLIP) -> tuple[Path, Path]:
    """The digits experiment with the label owner's ``g_extra``, split into the two parties' stage files: the
    data owner's for its own loop (``Cut``), the label owner's."""
    assert run_main(["split", _digits(tmp_path, "", g_extra), tmp_path / "parts"]).returncode == 0
    f_file = tmp_path / "parts" / "f" / "f.toml"
    head, rest = f_file.read_text().split("[stage]\n")
    own_loop = f_file.with_name("f-lib.toml")            # the cut library's party: [stage] names it only
    # The loop reads its own features (the cut library refuses feature_scale, which it could not apply).
    data = re.sub(r"\nfeature_scale = [^\n]*", "", rest.split("[data]", 1)[1])
    own_loop.write_text(head + '[stage]\nname = "f"\n\n[data]' + data)
    return own_loop, tmp_path / "parts" / "g" / "g.toml"


def _activations(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((32, 64)).astype(np.float32)


def _one_step(endpoint: str, f_file: Path, h: np.ndarray, vanish: bool = False, **where) -> tuple[str, np.ndarray]:
    """One step of a run through ``Cut`` (a new run, or ``where``: ``step``/``run`` of one going on):
    its run id and the gradient the label owner sent. The cut then closes before the run's end (the label
    owner ends the run), or with ``vanish`` disappears without a word (the run stays open, to be rejoined)."""
    cut = Cut.connect(endpoint, interface=f_file, **BOUNDS, **where)
    try:
        _, dh = cut.step(h, cut.rows(cut.applied + 1))
    finally:
        if vanish:
            cut.closed = True
            cut.link.close(linger_ms=0)
        else:
            cut.close(finished=False)
    return cut.run_id, dh


# --- the ledger -------------------------------------------------------------------------------------------

def test_fresh_secrets_differ_and_the_test_override_is_read():
    assert fresh_secret() != fresh_secret()
    assert fresh_secret(7) == 7


def test_the_ledger_refuses_other_values_for_a_step_and_keeps_releases_through_a_restore():
    ledger = NoiseLedger(secret=1)
    ledger.release(1, "s", "aa", np.array([0, 1]))
    ledger.release(1, "s", "aa", np.array([0, 1]))          # computed again on the same values: nothing new
    assert ledger.worst == 1
    with pytest.raises(NoiseReuseError, match="computed again on other input"):
        ledger.release(1, "s", "bb", np.array([0, 1]))
    ledger.release(2, "s", "cc", np.array([1, 2]))
    saved = ledger.arrays(1)                                 # the checkpoint of step 1: step 2 still pending
    ledger.restore(1, saved["privacy/releases"], [], 1)      # back to step 1: step 2 was released already
    assert ledger.counts.tolist() == [1, 2, 1]
    with pytest.raises(NoiseReuseError):
        ledger.release(2, "s", "dd", np.array([1, 2]))


# --- randomized labels (label_dp) draw from the run's secret too --------------------------------------------

PLAIN_LABEL_DP = "label_dp = { epsilon = 2.0 }"
STAGED_LABEL_DP = "label_dp = { epsilon = 2.0, stages = 2, epochs_per_stage = 0.05 }"     # stage 2 from step 3


@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
@pytest.mark.parametrize("label_dp", [PLAIN_LABEL_DP, STAGED_LABEL_DP])
def test_two_runs_of_a_keep_serving_label_owner_train_on_other_randomized_labels(tmp_path, start_server, label_dp):
    """The randomized labels are a fresh release each run, keyed by the run's secret, not by the seed the data
    owner knows: two runs against the same label owner (no other defense) answer the same activations of
    the same rows with other gradients, as other labels give. So each label was released twice: the second
    run's summary says so, its label_dp epsilons added up."""
    f_file, g_file = _parties(tmp_path, label_dp)
    summary = tmp_path / "g.json"
    g, endpoint = start_server(str(g_file), "--keep-serving", "--summary", summary)
    h = _activations()
    first = _one_step(endpoint, f_file, h)[1]
    assert "lifetime_epsilon" not in json.loads(wait_for_file(summary, g))["privacy"]["g"]["label_dp"]
    summary.unlink()
    second = _one_step(endpoint, f_file, h)[1]
    assert not np.array_equal(first, second)
    label_dp = json.loads(wait_for_file(summary, g))["privacy"]["g"]["label_dp"]
    assert label_dp["epsilon"] == 2.0 and label_dp["lifetime_releases"] == 2 and label_dp["lifetime_epsilon"] == 4.0
    assert g.proc.poll() is None


@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
def test_after_kill_9_the_resumed_label_owner_draws_the_same_randomized_labels(tmp_path, start_server):
    """The secret of the randomized labels is kept in the checkpoint (the label owner has no other defense):
    after kill -9 and --resume from the checkpoint of step 2, step 3 (whose rows' labels are drawn in stage 2,
    after the checkpoint) is answered bitwise as before the kill. On other activations it is refused: their
    prior would draw those labels a second time (another answer from the same random numbers)."""
    f_file, endpoint, run, hs, replies = _three_steps_then_kill_9_and_resume(tmp_path, start_server, STAGED_LABEL_DP)
    with pytest.raises(PeerRejected, match="computed again on other input"):
        _one_step(endpoint, f_file, _activations(9), vanish=True, run=run, step=2)
    np.testing.assert_array_equal(_one_step(endpoint, f_file, hs[2], vanish=True, run=run, step=2)[1], replies[2])


def _three_steps_then_kill_9_and_resume(tmp_path: Path, start_server, g_extra: str = G_CLIP) -> tuple:
    """A label owner with ``g_extra`` checkpointing every 2 steps answers steps 1-3 of a run through ``Cut``,
    is killed -9 and started again with --resume: ``(f_file, its endpoint, the run id, the three activations,
    the three replies)``."""
    f_file, g_file = _parties(tmp_path, g_extra)
    flags = ("--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "2", "--resume")
    g, endpoint = start_server(str(g_file), *flags)
    hs = [_activations(i) for i in range(3)]
    with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
        replies = [cut.step(h, cut.rows(step))[1] for step, h in enumerate(hs, 1)]
        run = cut.run_id
        g.signal(signal.SIGKILL)
        g.wait(10)
        cut.closed = True
        cut.link.close(linger_ms=0)
    return (f_file, start_server(str(g_file), *flags, name="g2")[1], run, hs, replies)


# --- over processes ---------------------------------------------------------------------------------------

@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
def test_two_runs_of_a_keep_serving_label_owner_answer_the_same_activations_with_other_noise(tmp_path,
                                                                                              start_server):
    f_file, g_file = _parties(tmp_path)
    g, endpoint = start_server(str(g_file), "--keep-serving")
    h = _activations()
    first, second = (_one_step(endpoint, f_file, h)[1] for _ in range(2))
    assert not np.array_equal(first, second)
    # The same label owner restarted with the same stage file: other noise again.
    g.signal(signal.SIGTERM)
    g.wait(10)
    g2, endpoint2 = start_server(str(g_file), "--keep-serving", name="g2")
    third = _one_step(endpoint2, f_file, h)[1]
    assert not np.array_equal(third, first) and not np.array_equal(third, second)
    # Not by accident: the label owner's clip bound holds and the difference is noise of the stated size.
    assert np.std(first - second) == pytest.approx(np.sqrt(2) * 1.0 * 0.05, rel=0.1)


@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
def test_a_step_computed_again_on_other_activations_is_refused_and_on_the_same_is_answered_alike(tmp_path,
                                                                                                 start_server):
    """A data owner rejoining its run at step 0 makes the label owner roll back and compute step 1 again:
    the same activations get the very gradient of the first time, others are refused (the label owner keeps
    serving)."""
    f_file, g_file = _parties(tmp_path)
    g, endpoint = start_server(str(g_file), "--keep-serving")
    h = _activations()
    run, first = _one_step(endpoint, f_file, h, vanish=True)
    again = _one_step(endpoint, f_file, h, vanish=True, run=run)[1]
    np.testing.assert_array_equal(again, first)
    with pytest.raises(PeerRejected, match="computed again on other input"):
        _one_step(endpoint, f_file, _activations(1), vanish=True, run=run)
    assert g.proc.poll() is None
    np.testing.assert_array_equal(_one_step(endpoint, f_file, h, vanish=True, run=run)[1], first)


@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
def test_after_kill_9_the_resumed_label_owner_answers_alike_and_refuses_other_activations(tmp_path, start_server):
    """The secret is kept in the checkpoint and the digests of the steps after it in a file beside it: after
    kill -9 and --resume, step 3 (after the checkpoint of step 2) on its first activations is answered bitwise
    as before the kill, and on others it is refused."""
    f_file, endpoint, run, hs, replies = _three_steps_then_kill_9_and_resume(tmp_path, start_server)
    with pytest.raises(PeerRejected, match="computed again on other input"):
        _one_step(endpoint, f_file, _activations(9), vanish=True, run=run, step=2)
    np.testing.assert_array_equal(_one_step(endpoint, f_file, hs[2], vanish=True, run=run, step=2)[1], replies[2])


@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
def test_a_resent_forward_with_other_activations_is_refused_and_the_run_goes_on(tmp_path, start_server):
    """A forward sent again for a step the label owner answered (its reply cache) must carry the same
    activations: the same get the same reply, others are refused; the next step is answered as usual."""
    from distgrad.run.protocol import forward_message
    from distgrad.wire.link import check_reply
    from distgrad.wire.wirecodec import ACTIVATION, stream_name

    f_file, g_file = _parties(tmp_path)
    g, endpoint = start_server(str(g_file), "--keep-serving")
    h = _activations()
    with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
        _, first = cut.step(h, cut.rows(1))

        def resend(x: np.ndarray) -> np.ndarray:
            msg = forward_message(cut.senders, cut.run_id, 1, 0, 1, x, stream_name(ACTIVATION, 0, 1))
            cut.link.send(msg)
            reply = cut.link.await_reply({(1, 0): msg}, (1, 0))
            return check_reply(reply, 1, cut.reply_specs, False, "g")[1]

        np.testing.assert_array_equal(resend(h), first)
        with pytest.raises(PeerRejected, match="sent again with other activations"):
            resend(_activations(1))
        cut.step(h, cut.rows(2))
        cut.close(finished=False)
    assert g.proc.poll() is None


@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
@pytest.mark.parametrize("back_to", [0, 2])
def test_a_rollback_behind_the_last_checkpoint_still_refuses_other_activations(tmp_path, start_server, back_to):
    """The label owner checkpoints steps 2 and 4; the data owner rejoins its run at an earlier step (0, or
    the checkpoint of step 2: its own newest), so the label owner rolls back behind its last checkpoint. Step
    ``back_to + 1`` was released before: other activations for it are refused, the same are answered alike,
    and the per-row counts still hold every release made."""
    f_file, g_file = _parties(tmp_path)
    flags = ("--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "2", "--keep-serving")
    g, endpoint = start_server(str(g_file), *flags)
    hs = [_activations(i) for i in range(4)]
    cut = Cut.connect(endpoint, interface=f_file, **BOUNDS)
    replies = [cut.step(h, cut.rows(step))[1] for step, h in enumerate(hs, 1)]
    run = cut.run_id
    cut.closed = True
    cut.link.close(linger_ms=0)
    where = dict(run=run, step=back_to) if back_to else dict(run=run)
    with pytest.raises(PeerRejected, match="computed again on other input"):
        _one_step(endpoint, f_file, _activations(9), vanish=True, **where)
    assert g.proc.poll() is None
    np.testing.assert_array_equal(_one_step(endpoint, f_file, hs[back_to], vanish=True, **where)[1],
                                  replies[back_to])



@pytest.mark.integration
@pytest.mark.usefixtures("fresh_secrets")
def test_a_release_recorded_after_a_torn_line_outlives_the_next_kill_9(tmp_path, start_server):
    """A kill -9 while a release's line is being appended leaves a torn last line (that release never left).
    The resumed label owner's next release must not be glued to it, where it could not be read back: after
    a second kill -9, step 5 (released after the torn line) on other activations is still refused."""
    f_file, g_file = _parties(tmp_path)
    flags = ("--checkpoint-dir", tmp_path / "ckpt", "--checkpoint-every", "3", "--resume")
    g, endpoint = start_server(str(g_file), *flags)
    hs = [_activations(i) for i in range(5)]

    def steps(endpoint: str, first: int, last: int, **where) -> list[np.ndarray]:
        cut = Cut.connect(endpoint, interface=f_file, **BOUNDS, **where)
        try:
            return [cut.step(hs[step - 1], cut.rows(step))[1] for step in range(first, last + 1)]
        finally:
            cut.closed = True
            cut.link.close(linger_ms=0)

    with Cut.connect(endpoint, interface=f_file, **BOUNDS) as cut:
        for step in range(1, 5):                    # the checkpoint of step 3, then step 4
            cut.step(hs[step - 1], cut.rows(step))
        run = cut.run_id
        g.signal(signal.SIGKILL)
        g.wait(10)
        cut.closed = True
        cut.link.close(linger_ms=0)
    [released] = (tmp_path / "ckpt").glob(".*.released")
    with open(released, "a", encoding="utf-8") as f:
        f.write('{"run": "' + run + '", "step": 5, "stream": "activ')        # torn by the kill
    g2, endpoint2 = start_server(str(g_file), *flags, name="g2")
    fifth = steps(endpoint2, 4, 5, run=run, step=3)[1]
    g2.signal(signal.SIGKILL)
    g2.wait(10)
    g3, endpoint3 = start_server(str(g_file), *flags, name="g3")
    hs[3] = _activations(8)                 # step 4, released before the torn line: kept as well
    with pytest.raises(PeerRejected, match="computed again on other input"):
        steps(endpoint3, 4, 4, run=run, step=3)
    hs[3] = _activations(3)
    hs[4] = _activations(9)
    with pytest.raises(PeerRejected, match="computed again on other input"):
        steps(endpoint3, 4, 5, run=run, step=3)
    hs[4] = _activations(4)
    np.testing.assert_array_equal(steps(endpoint3, 4, 5, run=run, step=3)[1], fifth)



def test_a_forward_resent_while_it_waits_for_its_turn_counts_as_what_the_step_received(tmp_path):
    """Client 1's forward arrives during client 0's turn and waits; sent again with other activations
    before its turn, it replaces the first. The step is computed on the second: a later resend of the second
    is answered from the reply cache with the same reply, a resend of the first (not what the step received)
    is refused."""
    from distgrad.config.parse import load_experiment
    from distgrad.run.options import StageOptions
    from distgrad.run.serving import ServingStage
    from distgrad.wire import messages as wire

    from handshake import hello_message, only_reply
    from test_defenses import _defended

    exp = load_experiment(_defended(tmp_path, "digits-clients", {1: G_CLIP}, "clients.toml"))
    server = ServingStage(StageOptions(exp, "g", exp.seed))
    peers = [[b"c0"], [b"c1"], [b"c2"]]
    for c in range(3):
        server.handle(peers[c], hello_message(exp, f"run{c}", client=c), 0.0)

    def forward(c: int, seed: int) -> wire.Message:   # as received: decoded from its frames
        msg = wire.Message(wire.FORWARD, f"run{c}", 1, tensors={"activation": _activations(seed)[:32]})
        return wire.decode(wire.encode(msg))

    def answer(c: int, msg: wire.Message) -> list:
        replies = server.handle(peers[c], msg, 0.0)
        while True:
            more = server.settle()
            if not more:
                return replies
            replies += more

    assert answer(1, forward(1, 1)) == []               # not its turn: it waits
    assert answer(1, forward(1, 2)) == []               # sent again, other activations: replaces the first
    computed = [reply for reply in answer(0, forward(0, 0)) if reply[0] == peers[1]]
    assert len(computed) == 1 and computed[0][1].type == wire.BACKWARD
    again = only_reply(answer(1, forward(1, 2)))
    assert again.type == wire.BACKWARD
    assert again.tensors.keys() == computed[0][1].tensors.keys()
    for name, tensor in again.tensors.items():
        np.testing.assert_array_equal(tensor, computed[0][1].tensors[name])
    with pytest.raises(ProtocolError, match="sent again with other activations"):
        answer(1, forward(1, 1))
