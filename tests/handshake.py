"""Valid handshake messages, for the tests and benchmarks/per_message.py (no pytest here).

The hello is the one ``distgrad.run.handshake.hello`` builds, so a field the
handshake comes to need is added in one place.
"""

from __future__ import annotations

from typing import Any

from distgrad.run import handshake

from distgrad.wire import messages as wire
from distgrad.config.experiment import Experiment


def hello_message(exp: Experiment, run: str, **changes: Any) -> wire.Message:
    """A valid hello from a fresh driving stage of ``exp`` (``handshake.hello``, the one the driver
    sends); ``changes`` replace body fields."""
    message = handshake.hello(exp, exp.stage_names[0], exp.seed, exp.cuts[0], run, [0], exp.steps, 1)
    message.body.update(changes)
    return message


def only_reply(replies: list) -> "wire.Message":
    """The one reply a serving stage's ``handle`` returned (``[(envelope, message)]``)."""
    (_, message), = replies
    return message
