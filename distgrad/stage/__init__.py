"""The stage and its step engine: one party's part of the model, computed the same way in every runner.

``stage`` (a numpy stage: forward, backward, optimiser, the shapes it expects), ``torch_stage`` (the same
contract for PyTorch modules; its parts ``torch_state``, ``torch_tensors``, ``torch_layers``, ``torch_optim``,
``torch_module``, ``torch_per_example``), ``engine`` (a step's forward and backward over micro-batches), ``checkpoint``
(atomic checkpoint files, no pickle), ``records`` (metrics, traces, atomic writes), ``selection`` (the verdicts
on evaluations) and ``history`` (a driving stage's parameters for its steps in flight). Imports the layers
below; never a process, a socket or a front end.
"""
