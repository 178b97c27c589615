"""The wire: what crosses between stage processes, and how.

``messages`` (the msgpack message kinds and their checks; never pickle), ``codecs`` (lossy and lossless tensor
codecs), ``wirecodec`` (tensors as they travel: dtype, shape, codec, error feedback), ``transport`` (ZeroMQ
sockets with bounded waits), ``link`` (one request and its checked reply) and ``keys`` (CurveZMQ keys).
Imports ``distgrad.errors`` and ``distgrad.model`` only; nothing here knows an experiment.
"""
