"""Stage processes and runners: who drives a step, who serves it, and the single-process reference.

``options`` and ``stage_state`` (a stage process's settings, state and checkpoints, with ``release_records``
and ``run_verdicts``),
``handshake`` (the hello every peer must agree on), ``serving`` (the one serving state machine) with
``peers`` (what it knows of each peer), ``accepts`` (what it accepts) and ``topology`` / ``parties`` (one class
per topology: one driver, clients in turn, vertical parties), ``driver`` (the first stage's loop), ``predict``
(forward only), ``inprocess`` (every stage in one process: the reference the tests compare with),
``progress`` (progress bar, metrics and TensorBoard writers) and ``launcher`` (local stage processes).
"""
