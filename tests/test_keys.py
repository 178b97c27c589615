"""CURVE key files and socket configuration (distgrad.wire.keys), over real loopback tcp sockets.

Every wait is a bounded poll; every socket is closed with linger 0 and the
private context destroyed after each test.
"""

from __future__ import annotations

import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from distgrad.errors import ConfigError
from distgrad.wire.keys import CurveServer, apply_curve_client, check_private, keygen, load_public, load_secret

SERVER_WAIT_MS = 1000   # how long the server waits for a message that must not arrive
CLIENT_WAIT_MS = 300    # how long a client waits for a reply that must not arrive

pytestmark = pytest.mark.timeout(10)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# ---------------------------------------------------------------- key files


def test_keygen_writes_owner_only_files(tmp_path: Path) -> None:
    directory = tmp_path / "new" / "keys"
    public, secret = keygen(directory, "alice")
    assert (public, secret) == (directory / "alice.key", directory / "alice.key_secret")
    assert mode(directory) == 0o700
    assert mode(public) == 0o600
    assert mode(secret) == 0o600
    assert sorted(p.name for p in directory.iterdir()) == ["alice.key", "alice.key_secret"]  # no staging left
    assert "secret-key" not in public.read_text()
    assert "secret-key" in secret.read_text()


def test_keygen_keeps_an_existing_directory_mode(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    keygen(tmp_path, "bob")
    assert mode(tmp_path) == 0o755


@pytest.mark.parametrize("existing", ["bob.key", "bob.key_secret"])
def test_keygen_refuses_to_overwrite(tmp_path: Path, existing: str) -> None:
    (tmp_path / existing).write_text("old")
    with pytest.raises(ConfigError, match=r"refusing to overwrite .*" + existing.replace(".", r"\.")):
        keygen(tmp_path, "bob")
    assert (tmp_path / existing).read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [existing]


def test_keygen_twice_keeps_the_first_pair(tmp_path: Path) -> None:
    public, secret = keygen(tmp_path, "carol")
    before = secret.read_bytes()
    with pytest.raises(ConfigError, match="refusing to overwrite"):
        keygen(tmp_path, "carol")
    assert secret.read_bytes() == before


@pytest.mark.parametrize("name", ["", "a/b", "../up", "/abs", "a\\b", "sp ace", ".hidden", "tab\t", "naïve"])
def test_keygen_rejects_bad_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError, match="invalid key name"):
        keygen(tmp_path / "keys", name)
    assert not (tmp_path / "keys").exists()


def test_keygen_accepts_dots_dashes_underscores(tmp_path: Path) -> None:
    public, _ = keygen(tmp_path, "host-1_f.stage")
    assert public.name == "host-1_f.stage.key"


def test_load_round_trip(tmp_path: Path) -> None:
    public_path, secret_path = keygen(tmp_path, "dave")
    public, secret = load_secret(secret_path)
    assert len(public) == len(secret) == 40
    assert zmq.curve_public(secret) == public
    assert load_public(public_path) == public
    assert load_public(secret_path) == public
    other_public, _ = load_secret(keygen(tmp_path, "erin")[1])
    assert other_public != public


def test_load_secret_of_a_public_file_says_so(tmp_path: Path) -> None:
    public_path, _ = keygen(tmp_path, "frank")
    with pytest.raises(ConfigError, match=r"frank\.key holds no secret key"):
        load_secret(public_path)


@pytest.mark.parametrize("bad_mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_check_private_refuses_shared_files(tmp_path: Path, bad_mode: int) -> None:
    _, secret_path = keygen(tmp_path, "gina")
    secret_path.chmod(bad_mode)
    with pytest.raises(ConfigError, match=r"chmod 600 .*gina\.key_secret"):
        check_private(secret_path)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(secret_path)
    secret_path.chmod(0o600)
    check_private(secret_path)
    load_secret(secret_path)


def test_missing_files_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "nobody.key_secret"
    with pytest.raises(ConfigError, match=r"nobody\.key_secret does not exist"):
        check_private(missing)
    with pytest.raises(ConfigError, match=r"nobody\.key"):
        load_public(tmp_path / "nobody.key")


def test_not_a_key_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.key"
    junk.write_text("hello\n")
    with pytest.raises(ConfigError, match=r"junk\.key is not a key file"):
        load_public(junk)
    short = tmp_path / "short.key"
    short.write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(ConfigError, match=r"public key in .*short\.key is malformed"):
        load_public(short)


# ---------------------------------------------------------------- sockets


@dataclass
class Keys:
    server_public: Path
    server_secret: Path
    client_secret: Path      # its public half is in allow_dir
    stranger_public: Path    # not in allow_dir
    stranger_secret: Path
    allow_dir: Path


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def keys(tmp_path: Path) -> Keys:
    server_public, server_secret = keygen(tmp_path / "server", "server")
    client_public, client_secret = keygen(tmp_path / "client", "client")
    stranger_public, stranger_secret = keygen(tmp_path / "stranger", "stranger")
    allow_dir = tmp_path / "allowed"
    allow_dir.mkdir()
    shutil.copy(client_public, allow_dir)
    return Keys(server_public, server_secret, client_secret, stranger_public, stranger_secret, allow_dir)


@dataclass
class EchoServer:
    curve: CurveServer
    sock: zmq.Socket
    endpoint: str

    def echo_one(self, timeout_ms: int = SERVER_WAIT_MS) -> bool:
        """Echo one message back to its sender if one arrives in time; say whether one did."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return False
        self.sock.send_multipart(self.sock.recv_multipart())
        return True


@pytest.fixture
def server(ctx: zmq.Context, keys: Keys) -> Iterator[EchoServer]:
    with CurveServer(ctx, keys.server_secret, keys.allow_dir) as curve:
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        curve.apply(sock)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        yield EchoServer(curve, sock, f"tcp://127.0.0.1:{port}")
        sock.close(0)


def dealer(ctx: zmq.Context, endpoint: str, secret: Path | None = None, server_key: Path | None = None) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.sndtimeo = 1000       # a refused handshake can leave no pipe: never block on send
    if secret is not None:
        assert server_key is not None
        apply_curve_client(sock, secret, server_key)
    sock.connect(endpoint)
    return sock


def send_refused(client: zmq.Socket) -> None:
    """Send as a refused client would: queued, or dropped if the refusal already removed the pipe."""
    try:
        client.send(b"let me in")  # ZeroMQ does not report the refusal here
    except zmq.Again:
        pass


def assert_round_trip(ctx: zmq.Context, server: EchoServer, keys: Keys) -> None:
    client = dealer(ctx, server.endpoint, keys.client_secret, keys.server_public)
    client.send(b"ping")
    assert server.echo_one(), "the allowed client's message did not reach the server"
    assert client.poll(SERVER_WAIT_MS, zmq.POLLIN), "the allowed client got no reply"
    assert client.recv() == b"ping"
    client.close(0)


def test_allowed_client_gets_its_echo(ctx: zmq.Context, server: EchoServer, keys: Keys) -> None:
    assert_round_trip(ctx, server, keys)


@pytest.mark.parametrize("who", ["plaintext", "unknown_key", "wrong_server_key"])
def test_rejected_clients_get_nothing_through(ctx: zmq.Context, server: EchoServer, keys: Keys, who: str) -> None:
    if who == "plaintext":
        client = dealer(ctx, server.endpoint)
    elif who == "unknown_key":
        client = dealer(ctx, server.endpoint, keys.stranger_secret, keys.server_public)
    else:  # an allowed client, but it takes another key pair's public key for the server's
        client = dealer(ctx, server.endpoint, keys.client_secret, keys.stranger_public)
    send_refused(client)
    assert not server.echo_one(SERVER_WAIT_MS), f"{who} client's message reached the server"
    assert not client.poll(CLIENT_WAIT_MS, zmq.POLLIN), f"{who} client got a reply"
    client.close(0)
    assert_round_trip(ctx, server, keys)  # the server itself still works


def test_stopped_server_still_refuses_unknown_keys(ctx: zmq.Context, server: EchoServer, keys: Keys) -> None:
    """Without a ZAP handler libzmq admits any CURVE client unless the domain is enforced."""
    server.curve.stop()
    server.curve.stop()  # idempotent
    client = dealer(ctx, server.endpoint, keys.stranger_secret, keys.server_public)
    send_refused(client)
    assert not server.echo_one(SERVER_WAIT_MS)
    client.close(0)


def test_one_authenticator_per_context(ctx: zmq.Context, server: EchoServer, keys: Keys) -> None:
    with pytest.raises(ConfigError, match="already has one"):
        CurveServer(ctx, keys.server_secret, keys.allow_dir)
    assert_round_trip(ctx, server, keys)  # the first one is untouched


def test_curve_server_checks_the_allow_dir(ctx: zmq.Context, keys: Keys, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nowhere does not exist"):
        CurveServer(ctx, keys.server_secret, tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(keys.client_secret, empty)  # a .key_secret is not a *.key file
    with pytest.raises(ConfigError, match=r"empty holds no \*\.key files"):
        CurveServer(ctx, keys.server_secret, empty)
    (keys.allow_dir / "broken.key").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"broken\.key is not a key file"):
        CurveServer(ctx, keys.server_secret, keys.allow_dir)


def test_curve_server_checks_its_secret_file(ctx: zmq.Context, keys: Keys) -> None:
    keys.server_secret.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        CurveServer(ctx, keys.server_secret, keys.allow_dir)
    keys.server_secret.chmod(0o600)
    CurveServer(ctx, keys.server_secret, keys.allow_dir).stop()  # no authenticator was left behind


@pytest.mark.parametrize("loose", ["allow_dir", "client_key", "server_key"])
@pytest.mark.parametrize("bits", [0o020, 0o002])
def test_key_files_others_may_write_are_refused(ctx: zmq.Context, keys: Keys, loose: str, bits: int) -> None:
    """Another local user who may write to --allow, to a key in it or to --server-key could add or swap a public
    key and get in (or stand in for the server): the stage refuses to start, naming the path, as ssh does."""
    from distgrad.wire.keys import CurveClient

    client_key = next(keys.allow_dir.glob("*.key"))
    path = {"allow_dir": keys.allow_dir, "client_key": client_key, "server_key": keys.server_public}[loose]
    path.chmod(stat.S_IMODE(path.stat().st_mode) | bits)
    if loose == "server_key":
        with pytest.raises(ConfigError, match=rf"{path.name} is writable by other users.*chmod go-w"):
            CurveClient(keys.client_secret, path)
        path.chmod(stat.S_IMODE(path.stat().st_mode) & ~bits)
        CurveClient(keys.client_secret, path)
        return
    with pytest.raises(ConfigError, match=rf"{path.name} is writable by other users.*chmod go-w"):
        CurveServer(ctx, keys.server_secret, keys.allow_dir)
    CurveClient(keys.client_secret, keys.server_public)      # the client does not read the allow directory
    path.chmod(stat.S_IMODE(path.stat().st_mode) & ~bits)
    CurveServer(ctx, keys.server_secret, keys.allow_dir).stop()          # no authenticator was left behind
