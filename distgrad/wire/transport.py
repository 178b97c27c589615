"""ZeroMQ sockets: bind and connect, bounded waits, frames out and in.

The serving side binds a ROUTER (it can answer any peer, including one that
sends garbage, and later several clients); the driving side connects a
DEALER. Every receive is bounded (``poll_frames``: a blocking receive with a
timeout), in ticks short enough to notice a stop request. Sockets close with a bounded LINGER.
A socket may first spin (check for a message without sleeping) for a few
microseconds before it blocks: a process that is already running answers
sooner than one the kernel has to wake, at the cost of a busy core while
it spins (``--spin-us``; off by default). It spins once per wait: a
client at the start of each ``wait``, a server on its first receive after
a message; the ticks after that block at once. The spinning thread holds
the GIL, so other Python threads of the process wait for it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import struct
import threading
import time
import uuid
from typing import Any, Callable, Collection, Protocol, Sequence, cast

import numpy as np
import zmq

from distgrad.wire import messages as wire
from distgrad.errors import ConfigError, PeerRejected, PeerTimeout, ProtocolError, TooManyFrames

log = logging.getLogger("distgrad.wire.transport")

DEFAULT_TIMEOUT_S = 5.0       # how long a request waits for its reply
POLL_TICK_S = 0.1             # longest a loop waits before checking for a stop request
LINGER_MS = 200               # how long close() may spend flushing unsent messages
NOTICE_LINGER_MS = 1000       # how long closing waits for an ``aborted`` notice (wire.abort_notice) to leave
ZERO_COPY_MIN_BYTES = 64 * 1024  # below this a copy is cheaper than pyzmq's zero-copy bookkeeping
IPC_PATH_MAX = 100            # sun_path is 108 bytes on Linux; leave room
HEARTBEATS_PER_LIVENESS = 5   # ZMTP heartbeat interval = liveness / this
MAX_LIVENESS_S = 6553.0       # ZMTP carries the heartbeat TTL in deciseconds in 16 bits (libzmq: 6553599 ms)
SEND_TIMEOUT_MS = 1000        # a send with no usable connection (e.g. refused by CURVE) gives up after this
MAX_SPIN_S = 0.01             # the longest spin-before-block a socket accepts (well below a tick)
# The most frames a valid message has: routing id and empty delimiter, header, one per tensor.
# What CURVE adds to each frame on the wire (its MESSAGE command: name, nonce, flags, MAC: 33 bytes), with room to
# spare; ZeroMQ's MAXMSGSIZE counts it.
CURVE_FRAME_OVERHEAD_BYTES = 64
# ZeroMQ limits the size of a frame (MAXMSGSIZE) but not their number, so poll_frames does.
MAX_FRAMES = 2 + 1 + wire.MAX_TENSORS
REFUSAL_LOG_INTERVAL_S = 60.0  # a refused key or failed handshake of one kind is logged once per this
REFUSAL_LOG_KEYS = 32         # distinct keys logged per interval; refusals of others are only counted
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)

_ENDPOINT = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5}|\*)|ipc://.+)$")

StopCheck = Callable[[], None]


def check_endpoint(endpoint: str, bind: bool) -> str:
    """Return ``endpoint`` if it is a usable tcp:// or ipc:// address, else raise ``ConfigError``.

    ``tcp://HOST:*`` (any free port) is allowed only for binding.
    """
    if not _ENDPOINT.match(endpoint):
        raise ConfigError(f"invalid endpoint {endpoint!r}: use tcp://HOST:PORT or ipc:///path/to/socket")
    if endpoint.startswith("tcp://"):
        port = endpoint.rsplit(":", 1)[1]
        if port == "*" and not bind:
            raise ConfigError(f"cannot connect to {endpoint!r}: a port wildcard is only for --bind")
        if port != "*" and not 0 < int(port) < 65536:
            raise ConfigError(f"invalid port in endpoint {endpoint!r}")
    elif len(endpoint) - len("ipc://") > IPC_PATH_MAX:
        raise ConfigError(f"ipc path in {endpoint!r} is longer than {IPC_PATH_MAX} characters")
    return endpoint


class SocketSecurity(Protocol):
    """Something that secures a socket before it binds or connects (see ``distgrad.wire.keys``)."""

    def apply(self, sock: zmq.Socket) -> None: ...


def _configure(sock: zmq.Socket, max_message_bytes: int | None, liveness_s: float,
               security: SocketSecurity | None) -> None:
    sock.setsockopt(zmq.LINGER, LINGER_MS)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    if max_message_bytes is not None:
        # ZeroMQ drops the connection of a peer that sends a bigger frame, before we allocate it. Under CURVE
        # it compares the encrypted frame, CURVE_FRAME_OVERHEAD_BYTES longer than the frame sent.
        overhead = CURVE_FRAME_OVERHEAD_BYTES if security is not None else 0
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + overhead)
    # ZMTP heartbeats run in ZeroMQ's I/O thread, even while this process computes: a peer
    # whose connection stops answering them is disconnected after liveness_s.
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, int(liveness_s * 1000 / HEARTBEATS_PER_LIVENESS)))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(liveness_s * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TTL, int(liveness_s * 1000))
    if security is not None:
        security.apply(sock)


# The Cython socket methods, called directly: pyzmq's Python-level wrappers (``Socket.poll``
# builds a Poller per call, ``send`` and ``recv_multipart`` add a layer per frame) cost
# several microseconds per message, which is a visible part of a small round trip.
_BackendSocket = zmq.backend.Socket       # the base class of zmq.Socket: pyzmq's compiled socket
_send = _BackendSocket.send
_recv = _BackendSocket.recv
# The options read through ``_get`` (EVENTS, RCVMORE) are ints; the stub types every option's value int | bytes.
_get = cast("Callable[[zmq.Socket, int], int]", _BackendSocket.get)
_set = _BackendSocket.set
# ``get`` and ``set`` look their option up as a ``SocketOption`` (Python code in the enum module) on every call,
# so a message's receive asks the socket nothing (``poll_frames``). Flags are plain ints (a member's ``&`` builds
# another member).
_RCVMORE, _EVENTS, _RCVTIMEO = zmq.RCVMORE, zmq.EVENTS, zmq.RCVTIMEO
_SNDMORE, _POLLIN = int(zmq.SNDMORE), int(zmq.POLLIN)
_RCVTIMEO_KEY = "_distgrad_rcvtimeo_ms"     # poll_frames' memo of the RCVTIMEO it last set on a socket


def send_frames(sock: zmq.Socket, frames: Sequence[Any], envelope: Sequence[bytes] = ()) -> int:
    """Send one multipart message; large tensor frames leave without a copy. Returns the bytes sent."""
    parts = [*envelope, *frames] if envelope else frames
    last = len(parts) - 1
    total = 0
    for i, part in enumerate(parts):
        size = part.nbytes if type(part) is np.ndarray else memoryview(part).nbytes
        total += size
        _send(sock, part, _SNDMORE if i < last else 0, size < ZERO_COPY_MIN_BYTES, False)
    return total


class RefusalLog:
    """WARNING lines about refused peers and messages, bounded in rate under a flood: the first refusal of
    a key in an interval of ``interval_s`` is logged in full, the repeats are counted and logged as one
    line per key when the interval is over (at the next refusal, or ``flush``), and at most ``max_keys``
    keys are logged per interval; refusals past that are counted in the next line. Thread-safe.

    Every place that logs a refusal goes through one (``refusal_log``): a peer looping on bad messages
    costs a few lines a minute, not one a message."""

    def __init__(self, log: logging.Logger, interval_s: float | None = None,
                 max_keys: int = REFUSAL_LOG_KEYS) -> None:
        self.log, self.max_keys = log, max_keys
        self.interval_s = REFUSAL_LOG_INTERVAL_S if interval_s is None else interval_s
        self._lock = threading.Lock()
        self._window = -math.inf
        self._counts: dict[str, int] = {}   # repeats per key logged this interval, not yet logged
        self._unlogged = 0                  # refusals of keys over max_keys, not yet logged

    def note(self, key: str, text: str, *args: Any) -> None:
        """Count a refusal of ``key``; log ``text % args`` if ``key`` is not logged this interval."""
        with self._lock:
            now = time.monotonic()
            repeats = self._close_window(now) if now - self._window >= self.interval_s else []
            if key in self._counts:
                self._counts[key] += 1
                logged = False
            elif len(self._counts) >= self.max_keys:
                self._unlogged += 1
                logged = False
            else:
                self._counts[key] = 0
                unlogged, self._unlogged = self._unlogged, 0
                logged = True
        self._log_repeats(repeats)
        if logged:
            more = f" (and {unlogged} refusals of other keys not logged)" if unlogged else ""
            self.log.warning(text + " [logged once per %g s per key]%s", *args, self.interval_s, more)

    def tick(self) -> None:
        """Log the repeats counted in an interval that is over (a server's idle moment calls it)."""
        with self._lock:
            due = any(self._counts.values()) and time.monotonic() - self._window >= self.interval_s
            repeats = self._close_window(time.monotonic()) if due else []
        self._log_repeats(repeats)

    def flush(self) -> None:
        """Log the repeats counted so far (a server closing, or a loop's idle moment) and start a new interval."""
        with self._lock:
            repeats = self._close_window(time.monotonic())
        self._log_repeats(repeats)

    def _close_window(self, now: float) -> list[tuple[str, int]]:
        repeats = [(key, count) for key, count in self._counts.items() if count]
        self._window, self._counts = now, {}
        return repeats

    def _log_repeats(self, repeats: list[tuple[str, int]]) -> None:
        for key, count in repeats:
            self.log.warning("%d more refusal(s) like the one logged before (%s) within %g s", count, key,
                             self.interval_s)


_REFUSAL_LOGS: dict[str, RefusalLog] = {}
_REFUSAL_LOGS_LOCK = threading.Lock()


def tick_refusal_logs() -> None:
    """``RefusalLog.tick`` of every logger's ``refusal_log``: the repeats of intervals that are over."""
    with _REFUSAL_LOGS_LOCK:
        refusals = list(_REFUSAL_LOGS.values())
    for each in refusals:
        each.tick()


def refusal_log(log: logging.Logger) -> RefusalLog:
    """The one ``RefusalLog`` of logger ``log`` (made on first use), shared by every caller logging there."""
    with _REFUSAL_LOGS_LOCK:
        refusals = _REFUSAL_LOGS.get(log.name)
        if refusals is None or refusals.log is not log:
            refusals = _REFUSAL_LOGS[log.name] = RefusalLog(log)
        return refusals


def read_monitor_event(sock: zmq.Socket, flags: int = 0) -> tuple[int, int]:
    """The ``(event, value)`` of the next message on a ZeroMQ monitor socket.

    Read here rather than through ``zmq.utils.monitor``, which imports ``zmq.asyncio`` (asyncio, ssl): a serving
    stage's handshake watch reads its monitor from the start, and that import cost every stage process some
    20 ms of CPU. The message is ZeroMQ's (version 1) monitor event: a frame of the event id (16 bits) and its
    value (32 bits), unsigned, in native byte order, then a frame with the endpoint. Raises ``ValueError`` for
    anything else.
    """
    frames = sock.recv_multipart(flags)
    if len(frames) != 2 or len(frames[0]) != 6:
        raise ValueError(f"not a ZeroMQ monitor event: {len(frames)} frames, the first of {len(frames[0])} bytes")
    event, value = struct.unpack("=HI", frames[0])
    return event, value


def describe_handshake_failure(event: int, value: int, server: bool) -> str:
    """What a ZMTP handshake failure event (``zmq.EVENT_HANDSHAKE_FAILED_*``) means, in words,
    on the ``server``'s side or the client's."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"the CURVE server refused this client's key (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return "security mechanism mismatch: one side uses CURVE and the other does not"
        if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
            return "CURVE cryptographic error: the client was given another server key than this server's"
        return f"ZMTP protocol error 0x{value:x}"
    if server:
        return "the peer closed the connection during the handshake (a plaintext client, or one given another server key)"
    return "the server closed the connection during the handshake (a wrong --server-key, or a server without CURVE)"


class HandshakeWatch:
    """Logs the failed ZMTP handshakes of a bound socket (a plaintext client against a CURVE
    stage, a client with the wrong server key) at WARNING, bounded by ``RefusalLog``.

    A thread reads the socket's monitor; ``close`` stops it. Refused CURVE keys are logged by
    the ZAP handler, which knows the key (``keys.CurveServer``), so they are skipped here.
    """

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, endpoint: str) -> None:
        self.sock, self.endpoint = sock, endpoint
        self.refusals = RefusalLog(log)
        address = f"inproc://distgrad-handshakes-{uuid.uuid4().hex}"
        sock.monitor(address, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self._pair = ctx.socket(zmq.PAIR)          # used by the thread alone until close() joins it
        self._pair.connect(address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distgrad-handshakes", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._pair.poll(int(POLL_TICK_S * 1000)):
                continue
            try:
                event, value = read_monitor_event(self._pair, zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            what = describe_handshake_failure(event, value, server=True)
            self.refusals.note(what, "a peer failed the handshake on %s: %s", self.endpoint, what)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * POLL_TICK_S + 1.0)
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._pair.close(0)


class Traffic:
    """Counters a driver keeps across its sockets: bytes each way, seconds spent waiting."""

    def __init__(self) -> None:
        self.sent = self.received = 0
        self.wait_s = 0.0


def check_spin(spin_s: float) -> float:
    """``spin_s`` if it is a usable spin-before-block time in seconds, else raise ``ConfigError``."""
    if not 0 <= spin_s <= MAX_SPIN_S:
        raise ConfigError(f"the spin-before-block time (--spin-us) must be between 0 and "
                          f"{MAX_SPIN_S * 1e6:.0f} microseconds, got {spin_s * 1e6:g}")
    return spin_s


def poll_frames(sock: zmq.Socket, timeout_s: float, spin_s: float = 0.0,
                copy_first: bool = False) -> list[Any] | None:
    """The next multipart message (``zmq.Frame`` objects), or None if none arrives within ``timeout_s``.

    The wait is the receive itself, bounded by the socket's ``RCVTIMEO``: one
    blocking call into ZeroMQ, where a ``zmq_poll`` before the receive would
    cost a few more system calls per message. ``RCVTIMEO`` belongs to this
    function: it is set only when it changes (the value last set is kept in
    the socket's ``__dict__``, as pyzmq's ``setsockopt`` runs Python code for
    each call), so nothing else may set it on a socket read here.
    With ``spin_s`` > 0, first checks for a message without sleeping for up
    to that long (it counts towards ``timeout_s``), then blocks.
    ``copy_first``: the first frame as ``bytes`` (a ROUTER's routing id, at
    most 255 bytes, which a reply sends back).
    """
    if spin_s > 0:
        clock = time.perf_counter
        started = clock()
        end = started + min(spin_s, timeout_s)
        while not _get(sock, _EVENTS) & _POLLIN:
            if clock() >= end:
                timeout_s -= clock() - started
                break
    timeout_ms = int(timeout_s * 1000) if timeout_s > 0 else 0
    memo = sock.__dict__
    if memo.get(_RCVTIMEO_KEY) != timeout_ms:
        _set(sock, _RCVTIMEO, timeout_ms)
        memo[_RCVTIMEO_KEY] = timeout_ms
    try:
        first = _recv(sock, 0, False)
    except zmq.Again:
        return None
    more = first.more           # a Frame knows; asking the socket (``getsockopt``) costs more
    parts = [first.bytes if copy_first else first]
    for _ in _MORE_FRAMES:
        if not more:
            return parts
        frame = _recv(sock, 0, False)
        parts.append(frame)
        more = frame.more
    if not more:
        return parts
    # A flood: ZeroMQ hands over a multipart message only whole, so its frames are all in
    # ZeroMQ's queue already; read them out as plain bytes, kept by nobody (an empty frame
    # makes no object at all), so this process holds no more than MAX_FRAMES of them.
    count = len(parts)
    while _get(sock, _RCVMORE):
        _recv(sock, 0, True)
        count += 1
    raise TooManyFrames(parts, count, MAX_FRAMES)


_MORE_FRAMES = range(MAX_FRAMES - 1)


def _envelope_size(parts: Sequence[zmq.Frame]) -> int:
    """How many of a ROUTER's received frames are the envelope: the routing id, and the empty
    delimiter a REQ peer sends when one follows it."""
    return 2 if len(parts) > 2 and len(parts[1]) == 0 else 1


def _envelope(parts: Sequence[Any]) -> list[bytes]:
    """A ROUTER's received envelope (the routing id as bytes, ``copy_first``; maybe the empty delimiter)
    as the frames a reply sends back."""
    return [part if type(part) is bytes else part.bytes for part in parts]


def release_free_memory() -> None:
    """Give the memory ZeroMQ freed after a flood back to the system (glibc's ``malloc_trim``).

    libzmq queues about 64 bytes per frame in small blocks; glibc keeps them
    after they are freed, so without this a 6-million-frame message would
    leave the process hundreds of MB bigger. Does nothing without glibc.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class Server:
    """A bound ROUTER that receives requests and sends replies to their sender."""

    def __init__(self, ctx: zmq.Context, endpoint: str, max_message_bytes: int | None = None,
                 liveness_s: float = 10.0, security: SocketSecurity | None = None, spin_s: float = 0.0) -> None:
        check_endpoint(endpoint, bind=True)
        self.spin_s = check_spin(spin_s)
        self._spin_next = False       # spin on the first receive after a message only
        self.sock = ctx.socket(zmq.ROUTER)
        _configure(self.sock, max_message_bytes, liveness_s, security)
        try:
            self.sock.bind(endpoint)
        except zmq.ZMQError as e:
            self.sock.close(0)
            raise ConfigError(f"cannot bind {endpoint}: {e}") from e
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.authenticated = security is not None
        self.handshakes = HandshakeWatch(ctx, self.sock, self.endpoint)
        self.floods = 0                 # messages with too many frames discarded

    def receive(self, timeout_s: float) -> tuple[list[bytes], list[zmq.Frame], str] | None:
        """``(envelope, frames, peer_key)`` of the next request, or None after ``timeout_s``.

        The envelope is the peer's routing id, plus the empty delimiter a REQ
        peer puts before its frames; replies must carry it back. ``peer_key``
        is the CURVE public key the peer authenticated with ("" in plaintext).
        """
        try:
            # With CURVE the routing id stays a Frame: its metadata names the peer's key (below).
            parts = poll_frames(self.sock, timeout_s, self.spin_s if self._spin_next else 0.0,
                                copy_first=not self.authenticated)
        except TooManyFrames as e:
            self._flooded(e)
            return None
        self._spin_next = parts is not None
        if parts is None:
            tick_refusal_logs()             # idle: the repeats of a flood that stopped are logged now
            return None
        split = _envelope_size(parts)
        if split == 1 and not self.authenticated:       # a DEALER's request in plaintext: its id is bytes already
            return [parts[0]], parts[1:], ""
        peer_key = ""
        if self.authenticated:
            try:
                peer_key = parts[0].get("User-Id")   # set by the ZAP authenticator
            except zmq.ZMQError:
                pass
        return _envelope(parts[:split]), parts[split:], peer_key

    def _flooded(self, e: TooManyFrames) -> None:
        """Answer a message of too many frames with a ``malformed`` error (a ROUTER discards it when its
        sender is gone or its queue is full) and log it, bounded in rate. No connection is dropped: ZeroMQ cannot name the
        sender's, and its descriptor may already be another peer's (docs/protocol.md, *Size limits*)."""
        envelope = _envelope(e.kept[:_envelope_size(e.kept)])
        release_free_memory()
        self.reply(envelope, wire.error_message("", 0, wire.ErrorCode.MALFORMED, str(e.args[0])))
        self.floods += 1
        refusal_log(log).note("too many frames", "discarded a message with too many frames (the last: %d frames, "
                              "the limit is %d) and answered it with a 'malformed' error", e.frames, MAX_FRAMES)

    def reply(self, envelope: Sequence[bytes], msg: wire.Message) -> None:
        send_frames(self.sock, wire.encode(msg), envelope)

    def notify(self, envelope: Sequence[bytes], msg: wire.Message) -> bool:
        """Send ``msg`` to ``envelope`` only while the socket that sent from it is still connected
        (``ROUTER_MANDATORY``): whether it was, so ``msg`` is on its way to it. A peer that has since
        resent on a fresh socket (or is gone) is not reached, where ``reply`` would drop ``msg`` silently."""
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self.reply(envelope, msg)
            return True
        except zmq.ZMQError:         # EHOSTUNREACH: not connected; EAGAIN: its queue full for SEND_TIMEOUT_MS
            return False
        finally:
            self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)

    def close(self, linger_ms: int = LINGER_MS) -> None:
        self.handshakes.close()
        self.sock.close(linger_ms)


class Client:
    """A connected DEALER that sends a request and waits, bounded, for the matching reply."""

    def __init__(self, ctx: zmq.Context, endpoint: str, max_message_bytes: int | None = None,
                 max_reply_bytes: int = wire.DEFAULT_MAX_TENSOR_BYTES, liveness_s: float = 10.0,
                 security: SocketSecurity | None = None, traffic: Traffic | None = None,
                 spin_s: float = 0.0) -> None:
        self.endpoint = check_endpoint(endpoint, bind=False)
        self.spin_s = check_spin(spin_s)
        self.traffic = traffic or Traffic()
        self.max_reply_bytes = max_reply_bytes
        self.sock = ctx.socket(zmq.DEALER)
        _configure(self.sock, max_message_bytes, liveness_s, security)
        self.curve = security is not None
        self.handshake_failure = ""          # the last failed handshake with the server, in words
        self._monitor = self.sock.get_monitor_socket(HANDSHAKE_FAILURES)
        self.sock.connect(endpoint)

    def check_handshake(self) -> str:
        """The last failed handshake with the server, in words ("" if none failed so far)."""
        while self._monitor.poll(0):
            event, value = read_monitor_event(self._monitor)
            self.handshake_failure = describe_handshake_failure(event, value, server=False)
        return self.handshake_failure

    def unreachable_hint(self) -> str:
        """Why a serving stage may not answer, for a timeout's message."""
        failure = self.check_handshake()
        if failure:
            return (f"the CURVE handshake with it failed: {failure}; check --server-key, that this client's "
                    f"public key is in the stage's --allow directory, and that both sides use CURVE or neither")
        if self.curve:
            return ("is the serving stage running and reachable there? If it is, a CURVE handshake may have "
                    "failed: a wrong --server-key, this client's key not in the stage's --allow, or the stage "
                    "without CURVE")
        return ("is the serving stage running and reachable there? If it uses CURVE, this plaintext client "
                "cannot talk to it")

    def send(self, msg: wire.Message) -> None:
        """Queue ``msg``; if no connection takes it within ``SEND_TIMEOUT_MS`` it is dropped,
        and the wait for its reply times out like any lost message."""
        try:
            self.traffic.sent += send_frames(self.sock, wire.encode(msg))
        except zmq.Again:
            log.debug("no connection to %s took %s; it will be resent", self.endpoint, msg.describe())

    def wait(self, run: str, keys: Collection[tuple[int, int]], timeout_s: float,
             check_stop: StopCheck | None = None, what: Callable[[], str] = lambda: "a request") -> wire.Message:
        """The first reply for ``run`` whose ``(step, mb)`` is one of ``keys``.

        Other replies (to earlier requests) are dropped. Raises ``PeerTimeout``
        naming the endpoint when none arrives within ``timeout_s``,
        ``PeerRejected`` for an error reply to one of ``keys`` (or to an
        undecodable request), ``ProtocolError`` for a malformed reply.
        """
        traffic, sock, clock, spin_s = self.traffic, self.sock, time.monotonic, self.spin_s
        now = clock()
        deadline = now + timeout_s
        while True:
            if check_stop is not None:
                check_stop()
            left = deadline - now
            if not left > 0:                    # a NaN timeout too: never a wait without end
                raise PeerTimeout(f"no reply from {self.endpoint} within {timeout_s:g} s to {what()} "
                                  f"({self.unreachable_hint()})")
            try:
                frames = poll_frames(sock, left if left < POLL_TICK_S else POLL_TICK_S, spin_s)
                spin_s = 0.0                    # only the first tick spins
                waited, now = now, clock()
                traffic.wait_s += now - waited
                if frames is None:
                    continue
                traffic.received += sum(map(len, frames))      # a Frame's len is its byte length
                reply = wire.decode(frames, self.max_reply_bytes)
            except ProtocolError as e:          # says whose reply it was: the peer's, not this side's bug
                raise ProtocolError(e.code, f"the reply from {self.endpoint} to {what()}: {e.args[0]}") from e
            key = (reply.step, reply.mb)
            if reply.type == wire.ERROR and (key in keys or key == (0, 0)):
                raise PeerRejected(str(reply.body.get("code", "?")), str(reply.body.get("message", "")))
            if reply.run == run and key in keys:
                return reply
            log.debug("dropping stale reply %s while waiting for %s", reply.describe(), what())

    def request(self, msg: wire.Message, timeout_s: float, check_stop: StopCheck | None = None) -> wire.Message:
        """Send ``msg`` and return the reply that echoes its run, step and micro-batch (see ``wait``)."""
        self.send(msg)
        return self.wait(msg.run, {(msg.step, msg.mb)}, timeout_s, check_stop, msg.describe)

    def close(self, linger_ms: int = LINGER_MS) -> None:
        try:
            self.sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)
        self.sock.close(linger_ms)

