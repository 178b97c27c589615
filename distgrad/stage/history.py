"""A driving stage's parameter history: what it needs again for the steps it has in flight (staleness S).

Pure bookkeeping over a ``Stage``'s arrays (no sockets, no files): ``run.stage_state.StageState`` holds one,
rolls it back with the stage and checkpoints it (``arrays``, ``load``).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from distgrad.errors import StageError
from distgrad.stage.stage import Stage


class ParameterHistory:
    """A driving stage's parameters after each of its last ``depth`` updates (staleness S = ``depth``), and its
    forward state before each step in flight.

    With S steps in flight, the forward of step t used the parameters after
    update t-1-S, and its backward needs them again after later updates; after
    a rollback the steps in flight are sent again with them. ``versions[u]``
    are the parameters after update u, for u from ``step - S`` to ``step - 1``
    (``step``'s own are the live ones). ``forward_states[t]`` is what a
    training forward changes besides its output (``Stage.forward_state``:
    batch norm's running statistics) as it was before the forward of step t
    in flight, so that sending the steps in flight again (``rewind``) counts
    each forward once. Both roll back, and are checkpointed, with the stage
    (``arrays``: ``history/U/NAME`` and ``forward/T/NAME``).
    """

    PREFIX = "history/"
    FORWARD_PREFIX = "forward/"

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.versions: dict[int, dict[str, np.ndarray]] = {}
        self.forward_states: dict[int, dict[str, np.ndarray]] = {}

    def clear(self) -> None:
        """Forget every version and forward state (a new run, a rollback to step 0)."""
        self.versions, self.forward_states = {}, {}

    def before_forward(self, step: int, stage: Stage) -> None:
        """Keep the stage's forward state before it sends the forward of step ``step`` in flight."""
        if self.depth:
            self.forward_states[step] = stage.forward_state()

    def before_update(self, stage: Stage) -> None:
        """Keep the live parameters (those after update ``stage.step``) before the next update changes them,
        and forget the forward state of the step that update completes."""
        if not self.depth:
            return
        self.versions[stage.step] = {name: value.copy() for name, value in stage.params.items()}
        for old in [u for u in self.versions if u < stage.step + 1 - self.depth]:
            del self.versions[old]
        for done in [t for t in self.forward_states if t <= stage.step + 1]:
            del self.forward_states[done]

    def rewind(self, stage: Stage) -> None:
        """The steps in flight are dropped, to be sent again: return the stage's forward state to what it
        was before the first of them (step ``stage.step + 1``)."""
        first = self.forward_states.get(stage.step + 1)
        if first is not None:
            stage.restore_forward_state(first)
        self.forward_states = {}

    def at(self, version: int, stage: Stage) -> Mapping[str, np.ndarray]:
        """The parameters after update ``version`` (those of step 0 for a version below 0); ``StageError``
        when they are not kept."""
        version = max(version, 0)
        if version == stage.step:
            return stage.params
        if version not in self.versions:
            raise StageError(f"stage {stage.name}: the parameters after update {version} are not kept "
                             f"(at step {stage.step}, staleness {self.depth})")
        return self.versions[version]

    def arrays(self) -> dict[str, np.ndarray]:
        return {**{f"{self.PREFIX}{u}/{name}": value for u, params in self.versions.items()
                   for name, value in params.items()},
                **{f"{self.FORWARD_PREFIX}{t}/{name}": value for t, state in self.forward_states.items()
                   for name, value in state.items()}}

    def load(self, arrays: Mapping[str, np.ndarray]) -> None:
        """The versions and forward states a checkpoint's ``arrays`` hold (none for a checkpoint without them)."""
        self.clear()
        for key, value in arrays.items():
            for prefix, kept in ((self.PREFIX, self.versions), (self.FORWARD_PREFIX, self.forward_states)):
                if key.startswith(prefix):
                    number, name = key[len(prefix):].split("/", 1)
                    kept.setdefault(int(number), {})[name] = np.array(value)
