"""One exception hierarchy for distgrad.

Every error a user can act on is a ``DistgradError``; each also subclasses the
builtin it means, so callers that catch ``ValueError`` or ``TimeoutError``
keep working.
"""

from __future__ import annotations


class DistgradError(Exception):
    """Base of every error distgrad raises on purpose."""


class ConfigError(DistgradError, ValueError):
    """An experiment file, a command-line value or an override is invalid."""


class ProtocolError(DistgradError, ValueError):
    """A message broke the wire protocol.

    ``code`` is the short machine-readable name sent back in an error reply
    (see docs/protocol.md); the message says what was wrong and what was
    expected.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.args[0]}"


class TooManyFrames(ProtocolError):
    """A message had more frames than any valid one; the rest of it was read and discarded.

    ``kept`` are its first ``limit`` frames (on a server, the routing id
    first), ``frames`` how many it had in all.
    """

    def __init__(self, kept: list, frames: int, limit: int) -> None:
        super().__init__("malformed", f"a message of {frames} frames; no valid message has more than {limit}")
        self.kept, self.frames = kept, frames


class PeerTimeout(DistgradError, TimeoutError):
    """The peer did not answer within the configured time."""


class PeerRejected(DistgradError, RuntimeError):
    """The peer answered with an error reply (code and message included)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"peer replied with error {code}: {message}")
        self.code = code
        self.peer_message = message


class PeerAborted(PeerRejected):
    """The peer stopped before the run's end and said why (an ``aborted`` notice, ``wire.abort_notice``):
    ``peer_message`` is its reason. Nothing more will come from it."""

    def __init__(self, message: str) -> None:
        super().__init__("aborted", message)
        self.args = (f"the other side stopped and said why: {message}",)


class PeerBusy(PeerRejected):
    """The stage below serves another run whose peer is live (the ``busy`` refusal of a hello): this run
    cannot start there now. ``endpoint`` is the stage's address; the message says whose run and since when."""

    def __init__(self, code: str, message: str, endpoint: str) -> None:
        super().__init__(code, message)
        self.endpoint = endpoint

    def __str__(self) -> str:
        return (f"the serving stage at {self.endpoint} is {self.peer_message}. It serves one run at a time: "
                f"wait until that run ends, or start another serving stage")


class StageError(DistgradError, RuntimeError):
    """A stage failed while computing a step; the cause is chained."""


class CutMisuse(DistgradError, RuntimeError):
    """A loop used the cut library (``distgrad.cut``, ``distgrad.torch``) against its contract: a batch
    replied to twice or not at all, a tensor of the wrong shape or dtype, a step out of order, a closed cut;
    the message says what to do instead."""


class OutputWriteError(DistgradError, OSError):
    """A file the run writes (summary, trace, metrics, checkpoint) could not be written (disk full, read-only
    folder); names the file and the cause. Exit code 1, one log line, no traceback."""


class CheckpointWriteError(OutputWriteError):
    """A checkpoint could not be written (disk full, read-only directory); names the directory and cause."""


class NonFiniteError(StageError):
    """A stage's own loss or gradient is NaN or +-Inf (the experiment forbids them).

    Raised before anything of the step is applied or checkpointed; the
    message names the stage, the step and the tensor. Exit code 1.
    """


class CodecRangeError(DistgradError, ValueError):
    """A tensor holds a value its wire codec cannot carry (``distgrad.wire.codecs``).

    A finite value beyond float16's or bfloat16's range (it would cross as
    Inf), or NaN/Inf for ``int8`` and ``topk:K``. Raised by the sending side
    before anything is sent; the message names the codec, the tensor and the
    step, which are also kept as attributes.
    """

    def __init__(self, codec: str, tensor: str, step: int, message: str) -> None:
        super().__init__(f"codec {codec}: tensor {tensor!r} at step {step}: {message}")
        self.codec, self.tensor, self.step = codec, tensor, step

    @property
    def public(self) -> str:
        """What a peer may be told (``peer_text``): the codec, the tensor and the step, not the value or its
        index, which are the sender's own data (under secure aggregation, what no one else may see)."""
        return (f"codec {self.codec}: tensor {self.tensor!r} at step {self.step} holds a value the codec cannot "
                f"carry (the log of the stage that sent it names the value)")


def peer_text(error: BaseException) -> str:
    """The text of ``error`` that a stage may send its peer (an abort notice, which a label owner of vertical
    parties relays to every other party): ``CodecRangeError.public`` for a value out of a codec's range,
    else ``str(error)``."""
    return error.public if isinstance(error, CodecRangeError) else str(error)


class InputGuardStop(DistgradError, RuntimeError):
    """A data owner's ``input_guard`` found its activations invertible beyond its ``max_r2``: the run stops
    before that step's activations are sent (nothing of it is applied or checkpointed). Exit code 5."""


class Interrupted(DistgradError):
    """A stop was requested (SIGINT or SIGTERM); ``signum`` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum


class NoiseReuseError(StageError):
    """A step computed again (a resume, a resend) on other input than its first computation, by a stage
    whose defense draws noise: answering it would reuse the first computation's noise on other values, so
    the difference of the two replies would be noise-free. Nothing of the step is sent or applied."""


class BudgetExhausted(StageError):
    """A stage's privacy budget (``clip_noise = { epsilon = E }``) allows no more releases of a row the next
    step holds: nothing of that step is sent or applied, and the checkpoints stay as they are."""
