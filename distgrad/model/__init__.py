"""Model math: what one process computes, with no knowledge of stages, files or the wire.

``nn`` (layers over float32 numpy arrays, their forward and backward), ``losses``, ``optim`` (Adam after
TensorFlow 1's float32 kernel, SGD), ``schedules`` (learning-rate schedules) and ``aggregate`` (how vertical
parties' outputs combine). Imports only ``distgrad.errors``.
"""
