"""CURVE keys: generate them, load them, and configure sockets to use them.

Key files are pyzmq's certificate format (``zmq.auth``): ``NAME.key`` holds a
public key and may be shared; ``NAME.key_secret`` holds the public and secret
key and must stay private (mode 0600). The serving side accepts exactly the
clients whose public ``*.key`` files sit in its allow directory.

Every failure a user can fix raises ``ConfigError`` naming the file.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import zmq
import zmq.auth

from distgrad.errors import ConfigError
from distgrad.wire.transport import RefusalLog

if TYPE_CHECKING:     # imported where a CURVE server starts: zmq.auth.thread loads asyncio and ssl, which
    from zmq.auth.thread import ThreadAuthenticator     # every stage process paid for at start without --secure

log = logging.getLogger("distgrad.wire.keys")

# Not starting with "." because zmq.auth loads the allow directory with glob("*.key"), which skips dotfiles.
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*$")
_Z85_KEY_LEN = 40  # a 32-byte CURVE key in Z85


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    """Write a new key pair as ``directory/NAME.key`` and ``directory/NAME.key_secret``.

    ``directory`` is created with mode 0700 if it does not exist. Both files
    get mode 0600 and are never visible with looser permissions: they are
    written in a private temporary directory and linked into place, which
    also refuses to overwrite an existing file. ``name`` may hold letters,
    digits, ``-``, ``_`` and ``.`` (not first). Returns ``(public_path, secret_path)``.
    """
    if not _NAME.match(name):
        raise ConfigError(f"invalid key name {name!r}: use letters, digits, '-', '_' and '.' "
                          f"(not first), without path separators")
    directory = Path(directory)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True)
        directory.chmod(0o700)
    elif not directory.is_dir():
        raise ConfigError(f"key directory {directory} exists but is not a directory")
    for path in (public, secret):
        if path.exists():
            raise ConfigError(f"refusing to overwrite {path}: choose another name or remove the old key pair")
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=directory))  # mode 0700
    try:
        made = [Path(p) for p in zmq.auth.create_certificates(staging, name)]
        for path in made:
            path.chmod(0o600)
        linked: list[Path] = []
        try:
            for src, dst in ((made[1], secret), (made[0], public)):
                os.link(src, dst)
                linked.append(dst)
        except FileExistsError as e:
            for path in linked:
                path.unlink()
            raise ConfigError(f"refusing to overwrite {e.filename2 or e.filename}: "
                              f"choose another name or remove the old key pair") from e
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return public, secret


def check_private(path: Path) -> None:
    """Raise ``ConfigError`` unless ``path`` exists and no one but its owner may read or write it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise ConfigError(f"secret key file {path} does not exist (create one with keygen)") from None
    if mode & 0o077:
        raise ConfigError(f"secret key file {path} is accessible by other users (mode {stat.filemode(mode)}): "
                          f"run `chmod 600 {path}`")


def check_trusted(path: Path, what: str) -> None:
    """Raise ``ConfigError`` if ``path`` (a file or directory that decides whom this stage trusts) may be
    written by anyone but its owner: another local user could then add or swap a public key and get in."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return      # a missing file or directory is reported by whoever reads it, naming it
    if mode & 0o022:
        raise ConfigError(f"{what} {path} is writable by other users (mode {stat.filemode(mode)}), so any of "
                          f"them could add or replace a public key: run `chmod go-w {path}`")


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except OSError as e:
        raise ConfigError(f"cannot read key file {path}: {e}") from e
    except ValueError as e:
        raise ConfigError(f"{path} is not a key file: no public-key line found") from e
    for kind, key in (("public", public), ("secret", secret)):
        if key is not None and len(key) != _Z85_KEY_LEN:
            raise ConfigError(f"{kind} key in {path} is malformed: expected {_Z85_KEY_LEN} Z85 characters")
    return public, secret


def load_secret(path: Path) -> tuple[bytes, bytes]:
    """``(public, secret)`` Z85 keys from a ``.key_secret`` file, after ``check_private``."""
    check_private(path)
    public, secret = _load(path)
    if secret is None:
        raise ConfigError(f"{path} holds no secret key: pass the NAME.key_secret file, not NAME.key")
    return public, secret


def load_public(path: Path) -> bytes:
    """The Z85 public key in a ``.key`` or ``.key_secret`` file."""
    return _load(path)[0]


class CurveServer:
    """CURVE for a serving socket: a ZAP authenticator on ``ctx`` plus the server's key pair.

    Only clients whose public keys are in ``allow_dir/*.key`` are accepted;
    the directory is read once, here. Call ``apply(sock)`` before binding.
    One authenticator serves a whole context, so make one ``CurveServer`` per
    context. Usable as a context manager; close its sockets before ``stop()``.
    """

    def __init__(self, ctx: zmq.Context, secret_file: Path, allow_dir: Path) -> None:
        self.public, self.secret = load_secret(secret_file)
        allow_dir = Path(allow_dir)
        if not allow_dir.is_dir():
            raise ConfigError(f"client key directory {allow_dir} does not exist")
        check_trusted(allow_dir, "client key directory")
        allowed = sorted(allow_dir.glob("*.key"))  # the same files zmq.auth reads
        if not allowed:
            raise ConfigError(f"client key directory {allow_dir} holds no *.key files: "
                              f"copy each allowed client's NAME.key there")
        for path in allowed:
            check_trusted(path, "client key file")
        self.allowed = frozenset(load_public(path) for path in allowed)
        self.allow_dir = allow_dir
        self.refusals = RefusalLog(log)
        from zmq.auth.thread import ThreadAuthenticator

        self._auth: ThreadAuthenticator | None = ThreadAuthenticator(ctx)
        try:
            self._auth.start()
        except zmq.ZMQError as e:
            self.stop()
            hint = "this context already has one; share a single CurveServer" if e.errno == zmq.EADDRINUSE else str(e)
            raise ConfigError(f"cannot start the CURVE authenticator: {hint}") from e
        self._auth.configure_curve_callback(domain="*", credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP decision for a client's public key (Z85), in the authenticator's thread.

        A refused key is logged at WARNING (a public key: never a secret), at
        most once per key per ``REFUSAL_LOG_INTERVAL_S``, with a count.
        """
        if client_key in self.allowed:
            return True
        shown = client_key.decode("ascii", "replace")
        self.refusals.note(shown, "refused a CURVE client: its public key %s is not in %s", shown, self.allow_dir)
        return False

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE server with this key pair; call before ``bind``.

        Without a ZAP handler ZeroMQ accepts any CURVE client, unless the
        socket names a ZAP domain and enforces it; so we name ``*`` (the
        domain the allow list is registered under) and enforce it where the
        libzmq build supports that option, to fail closed after ``stop()``.
        """
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True
        sock.zap_domain = b"*"
        try:
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except (AttributeError, zmq.ZMQError):
            pass  # a draft option in libzmq 4.3; without it, keep the authenticator running while sockets are open

    def stop(self) -> None:
        """Stop the authenticator; calling it again does nothing."""
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()

    def __enter__(self) -> "CurveServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class CurveClient:
    """CURVE client settings: the key pair in ``secret_file``, trusting only the server
    whose public key is in ``server_key_file``. Keys are loaded (and checked) once."""

    def __init__(self, secret_file: Path, server_key_file: Path) -> None:
        self.public, self.secret = load_secret(secret_file)
        check_trusted(server_key_file, "server key file")
        self.server_key = load_public(server_key_file)

    def apply(self, sock: zmq.Socket) -> None:
        """Call before ``connect``."""
        sock.curve_serverkey = self.server_key
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public


def apply_curve_client(sock: zmq.Socket, secret_file: Path, server_key_file: Path) -> None:
    """Make ``sock`` a CURVE client (see ``CurveClient``); call before ``connect``."""
    CurveClient(secret_file, server_key_file).apply(sock)
