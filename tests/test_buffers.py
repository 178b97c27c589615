"""A large gradient of a fixed shape is written into the same memory step after step, but never while anything
still refers to the last one: a reply kept for a resent request, a zero-copy frame ZeroMQ has not sent yet."""

from __future__ import annotations

import sys
import time

import numpy as np
import zmq

from distgrad.model.buffers import REUSE_MIN_BYTES, BufferRing
from distgrad.model.losses import SumSquaredError

BIG = REUSE_MIN_BYTES // 4          # float32 elements: the smallest gradient that is reused


def _pred_target(step: int) -> tuple[np.ndarray, np.ndarray]:
    pred = np.arange(BIG, dtype=np.float32)
    pred *= np.float32(1 / BIG)
    return pred, np.full(BIG, np.float32(step) / 3, np.float32)


def test_a_large_gradient_reuses_its_memory_once_released_and_equals_a_fresh_one():
    loss = SumSquaredError()
    pred, target = _pred_target(1)
    value, first = loss.forward_backward(pred, target)
    assert np.array_equal(first, (pred - target) * np.float32(2))
    held = first                                  # a reply still cached: the next gradient goes elsewhere
    pred, target = _pred_target(2)
    value, second = loss.forward_backward(pred, target)
    assert second is not held and held[-1] == (pred[-1] - np.float32(1) / 3) * np.float32(2)
    del held, first                               # released: its memory is written again
    address = second.ctypes.data
    del second
    pred, target = _pred_target(3)
    value, third = loss.forward_backward(pred, target)
    diff = pred - target
    assert third.ctypes.data in {address} | {b.ctypes.data for b in loss._gradients._ring}
    assert np.array_equal(third, diff * np.float32(2))
    assert value == np.float32(np.add.reduce(diff * diff, dtype=np.float32))


def test_a_gradient_zeromq_still_holds_is_not_written_again():
    ring = BufferRing()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect("tcp://127.0.0.1:9")        # nobody listens: the frame waits in ZeroMQ's queue
    try:
        sent = ring.take((BIG,), np.dtype(np.float32))
        sent[...] = 1.0
        refs = sys.getrefcount(sent)
        sock.send(sent, copy=False)
        assert sys.getrefcount(sent) > refs          # pyzmq holds the array while libzmq has its frame
        address = sent.ctypes.data
        del sent
        other = ring.take((BIG,), np.dtype(np.float32))
        assert other.ctypes.data != address
        del other
        sock.close(0)                                # the frame is dropped: ZeroMQ lets the array go
        deadline = time.monotonic() + 10
        while True:
            again = ring.take((BIG,), np.dtype(np.float32))
            if again.ctypes.data == address:
                break
            del again
            assert time.monotonic() < deadline, "the ring never reused the array ZeroMQ released"
            time.sleep(0.01)
    finally:
        sock.close(0)
        ctx.term()


def test_small_or_other_shapes_are_fresh_arrays():
    ring = BufferRing(size=1)
    small = ring.take((16,), np.dtype(np.float32))
    assert ring.take((16,), np.dtype(np.float32)) is not small
    big = ring.take((BIG,), np.dtype(np.float32))
    address = big.ctypes.data
    del big
    assert ring.take((BIG,), np.dtype(np.float32)).ctypes.data == address
    other = ring.take((BIG + 1,), np.dtype(np.float32))         # the shape changed: the free one is replaced
    assert other.shape == (BIG + 1,)
