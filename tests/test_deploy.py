"""The files under deploy/ run command lines that the real CLI accepts.

Every ``distgrad`` and ``distgrad-stage`` command line is taken out of:

- deploy/Dockerfile: ENTRYPOINT + CMD, and the HEALTHCHECK;
- deploy/compose.yaml, compose.vertical.yaml and compose.vertical-active.yaml: each service's entrypoint +
  command, and its health check (its own, or the one it inherits from the image);
- deploy/k8s/*.yaml, k8s-vertical/*.yaml and k8s-vertical-active/*.yaml: each container's command + args
  (resolved against the image's ENTRYPOINT and CMD as Kubernetes does; init
  containers too), and its probes;
- deploy/systemd/*.service: ExecStart, with the specifiers resolved for the
  instance ``seed-reverse`` and the variables taken from the example
  environment file and from what systemd sets (STATE_DIRECTORY, CREDENTIALS_DIRECTORY);
- deploy/README.md: the command lines in its shell code blocks.

Each is parsed by ``distgrad.cli.build_stage_parser()`` or
``distgrad.cli.build_parser()``, and every option must be spelled exactly as
the parser names it (argparse alone would accept a prefix, so a flag renamed
to a longer name would slip through). Then come the checks the CLI makes only
at run time (one of --bind/--connect, and the right one for the stage; CURVE
flags all or none; --resume needs --checkpoint-dir; valid endpoints), and the
checks that the pieces of one deployment fit: each party reads a stage file
of its own stage (mounted from its own folder under deploy/parties/ or its own
ConfigMap; no container holds another party's file), the parties' files load
together as one experiment (their interfaces agree, as the handshake checks),
deploy/parties/ holds what ``distgrad init`` (the two-party example, from the table deploy/data ships),
``distgrad split`` and the vertical example write, every data file a stage file reads is in the repository (or,
on Kubernetes, on the party's claim, awaited by an init container; no Secret carries data),
the driving stages connect to the port the serving stage binds, all checkpoint
with the same K and resume, all use CURVE, health checks ping the serving
stage with keys it can accept, and every file a command names is mounted in
its container. In the vertical deployments every party first runs ``distgrad
align`` (one coordinator, the label owner, that the others reach; the same
keys as its stage) and its stage file reads the rows its own alignment wrote
(stand-ins computed here, the aligned rows, let the files be parsed), and where more than two parties align,
every party but the coordinator checks the others' digests with ``--party-keys``.

YAML needs PyYAML; without it the YAML tests are skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterator

import pytest

from distgrad import cli, vertical_example
from distgrad.errors import ConfigError
from distgrad.config.experiment import Experiment
from distgrad.config.parse import combine_stage_files, load_experiment, parse_experiment, parse_init_overrides
from distgrad.config.split import stage_files
from distgrad.wire.transport import check_endpoint

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_VERTICAL = DEPLOY / "compose.vertical.yaml"
COMPOSE_VERTICAL_ACTIVE = DEPLOY / "compose.vertical-active.yaml"   # the label owner holds features too
K8S = DEPLOY / "k8s"
K8S_VERTICAL = DEPLOY / "k8s-vertical"
K8S_VERTICAL_ACTIVE = DEPLOY / "k8s-vertical-active"     # the label owner holds features too
SYSTEMD = DEPLOY / "systemd"
ENV_EXAMPLE = SYSTEMD / "distgrad.env.example"
README = DEPLOY / "README.md"
PARTIES = DEPLOY / "parties"         # each party's own folder: its stage file (and data)
INSTANCE = "seed-reverse"            # the systemd instance the units are checked with
TWO_PARTY = PARTIES / "two-party"    # compose.yaml's and k8s/'s parties: distgrad init of the shipped table
TWO_PARTY_TABLE = DEPLOY / "data" / "breast-cancer-small.csv"
IMAGE = "distgrad-stage"             # the image built from deploy/Dockerfile
PROGRAMS = {"distgrad", "distgrad-stage"}
PATH_FLAGS = ("checkpoint_dir", "summary", "trace", "ready_file", "curve_secret", "allow", "server_key", "input", "out",
              "party_keys")
WRITTEN = ("checkpoint_dir", "summary", "trace", "ready_file", "out")
READ = ("curve_secret", "allow", "server_key", "input", "experiment", "party_keys")     # must be mounted read-only
KEYS = ("curve_secret", "allow", "server_key")


def _yaml():
    return pytest.importorskip("yaml", reason="PyYAML is needed to parse the compose file and the manifests")


# ------------------------------------------------------------------ command lines and their context

@dataclass(frozen=True)
class Mount:
    target: str
    read_only: bool
    kind: str            # bind, volume, tmpfs; or the Kubernetes volume type
    source: str = ""     # host path, volume, claim, ConfigMap or Secret name


@dataclass
class Command:
    where: str                      # file and place, for messages
    argv: list[str]
    group: str                      # the deployment it belongs to: compose, k8s, systemd, ...
    container: str = ""             # commands with the same container run side by side
    mounts: list[Mount] | None = None           # None: runs on a host, not in a container
    files: dict[str, str | Path] = field(default_factory=dict)  # absolute path -> the text mounted there (a
                                                                # ConfigMap's), or the repository file it is
    written: dict[str, Path] = field(default_factory=dict)     # files an earlier command writes -> stand-ins
    env: dict[str, str] = field(default_factory=dict)          # systemd: the variables it was expanded with
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def program(self) -> str:
        return PurePosixPath(self.argv[0]).name

    def __str__(self) -> str:
        return f"{self.where}: `{shlex.join(self.argv)}`"


@dataclass
class Parsed:
    cmd: Command
    ns: argparse.Namespace
    kind: str                       # "stage" or the distgrad subcommand
    exp: Experiment | None = None
    serving: bool = False


def _all_options(parser: argparse.ArgumentParser, args: list[str]) -> set[str]:
    options = {s for action in parser._actions for s in action.option_strings}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            command = next((a for a in args if not a.startswith("-")), None)
            if command in action.choices:
                options |= _all_options(action.choices[command], [])
    return options


def parse(cmd: Command) -> Parsed:
    """Parse ``cmd`` with the real CLI parser; fail naming the command if it is refused."""
    assert cmd.program in PROGRAMS, f"{cmd} is not a distgrad command"
    args = cmd.argv[1:]
    if cmd.program == "distgrad-stage":
        parser, kind = cli.build_stage_parser(), "stage"
    elif args[:1] == ["stage"]:
        parser, kind, args = cli.build_stage_parser("distgrad stage"), "stage", args[1:]
    else:
        parser, kind = cli.build_parser(), None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            ns = parser.parse_args(args)
    except SystemExit as e:
        pytest.fail(f"the CLI refuses {cmd} (exit {e.code}):\n{err.getvalue()}")
    known = _all_options(parser, args)
    for token in args:
        if token == "--":
            break
        if token.startswith("--") and token.split("=", 1)[0] not in known:
            pytest.fail(f"{cmd}: {token.split('=', 1)[0]} is not an option of the CLI, only a prefix of one")
    return Parsed(cmd, ns, kind or ns.command)


def _mount_of(cmd: Command, path: str) -> Mount | None:
    best = None
    for m in cmd.mounts or []:
        target = m.target.rstrip("/") or "/"
        if (path == target or path.startswith(target + "/")) and (best is None or len(target) > len(best.target)):
            best = m
    return best


def _endpoint_port(endpoint: str) -> tuple[str, str]:
    match = re.fullmatch(r"tcp://(.+):(\d+|\*)", endpoint)
    assert match, f"not a tcp endpoint: {endpoint}"
    return match.group(1), match.group(2)


def mounted_file(cmd: Command, path: str) -> tuple[str, str]:
    """The text of the file ``cmd`` reads at ``path`` and the name to parse it under (the repository file's
    path when there is one, so that its relative paths resolve as they would in the container)."""
    value = cmd.files.get(path)
    if isinstance(value, str):
        return value, path
    if value is None:
        mount = _mount_of(cmd, path)
        assert mount is not None and mount.kind == "bind", \
            f"{cmd}: no file is mounted at {path} (mounted: {sorted(cmd.files)} and {cmd.mounts})"
        value = DEPLOY / mount.source / PurePosixPath(path).relative_to(mount.target)
    assert value.is_file(), f"{cmd}: {path} is {value.relative_to(ROOT)} in the repository, which does not exist"
    return value.read_text(), str(value)


def resolve_experiment(cmd: Command, name_or_path: str) -> Experiment:
    if name_or_path.startswith("/"):
        text, source = mounted_file(cmd, name_or_path)
        raw = tomllib.loads(text)
        data = raw.get("data", {})
        if str(data.get("path", "")).startswith("/"):
            # Data that an earlier command of the deployment writes (distgrad align's --out), or that an init
            # container waits for on the party's claim: a stand-in.
            assert data["path"] in cmd.written, f"{cmd}: {name_or_path} reads {data['path']}, which nothing writes"
            data["path"] = str(cmd.written[data["path"]])
        elif "path" in data:
            assert (Path(source).parent / data["path"]).is_file(), \
                f"{cmd}: {name_or_path} reads {data['path']}, which is not beside it in the repository"
        return parse_experiment(raw, source)
    assert "/" not in name_or_path, f"{cmd}: relative experiment path {name_or_path!r} depends on the working directory"
    try:
        return load_experiment(name_or_path)
    except ConfigError as e:
        pytest.fail(f"{cmd}: {e}")


def check_stage(p: Parsed) -> None:
    """What distgrad-stage checks before it starts (cli._run_stage, cli._curve), and more."""
    cmd, ns = p.cmd, p.ns
    p.exp = exp = resolve_experiment(cmd, ns.experiment)
    assert ns.stage in exp.stage_names, f"{cmd}: {exp.name} has no stage {ns.stage!r}"
    p.serving = ns.stage == exp.stage_names[-1]
    if p.serving:
        assert ns.bind and not ns.connect, f"{cmd}: the serving stage {ns.stage} needs --bind and no --connect"
        assert not ns.server_key, f"{cmd}: --server-key is for the driving stage"
        assert ns.micro_batches is None and ns.schedule == "1f1b", \
            f"{cmd}: --micro-batches and --schedule are for the driving stage"
    else:
        assert ns.stage in exp.data_owners, f"{cmd}: {ns.stage} is neither a data owner nor the last stage"
        assert ns.connect and not ns.bind, f"{cmd}: the driving stage {ns.stage} needs --connect and no --bind"
        assert not (ns.keep_serving or ns.ready_file or ns.allow), f"{cmd}: serving-stage flags on the driver"
    endpoint = ns.bind or ns.connect
    try:
        check_endpoint(endpoint, bind=p.serving)
        parse_init_overrides(ns.init)
    except ConfigError as e:
        pytest.fail(f"{cmd}: {e}")
    curve = [ns.curve_secret, ns.allow if p.serving else ns.server_key]
    assert all(curve) or not any(curve), f"{cmd}: CURVE needs --curve-secret and --allow/--server-key together"
    if ns.resume or ns.checkpoint_every:
        assert ns.checkpoint_dir, f"{cmd}: --resume and --checkpoint-every need --checkpoint-dir"
    if ns.steps is not None:
        assert ns.steps >= 1, f"{cmd}: --steps must be >= 1"


def check_ping(p: Parsed) -> None:
    cmd, ns = p.cmd, p.ns
    try:
        check_endpoint(ns.endpoint, bind=False)
    except ConfigError as e:
        pytest.fail(f"{cmd}: {e}")
    assert bool(ns.curve_secret) == bool(ns.server_key), f"{cmd}: ping needs --curve-secret and --server-key together"
    assert ns.timeout > 0


def check_align(p: Parsed) -> None:
    """What distgrad align checks before it starts (align.AlignOptions), and CURVE flags all or none."""
    cmd, ns = p.cmd, p.ns
    assert bool(ns.bind) != bool(ns.connect), f"{cmd}: give --bind (the coordinator) or --connect, one of them"
    p.serving = bool(ns.bind)
    try:
        check_endpoint(ns.bind or ns.connect, bind=p.serving)
    except ConfigError as e:
        pytest.fail(f"{cmd}: {e}")
    assert not p.serving or (ns.parties and ns.parties >= 2), f"{cmd}: the coordinator needs --parties N"
    assert ns.name, f"{cmd}: name the party (--name), as its stage is named"
    curve = [ns.curve_secret, ns.allow if p.serving else ns.server_key]
    assert all(curve) or not any(curve), f"{cmd}: CURVE needs --curve-secret and --allow/--server-key together"
    assert not (ns.allow if not p.serving else ns.server_key), f"{cmd}: --allow is the coordinator's, --server-key the others'"


def check_paths(p: Parsed) -> None:
    """Every file a containerised command names is on a mount of its container: keys read-only, output writable."""
    cmd = p.cmd
    if cmd.mounts is None:
        return
    names = [f for f in PATH_FLAGS if getattr(p.ns, f, None) is not None]
    if p.kind == "stage" and str(p.ns.experiment).startswith("/"):
        names.append("experiment")
    for flag in names:
        path = str(getattr(p.ns, flag))
        assert path.startswith("/"), f"{cmd}: --{flag.replace('_', '-')} {path} is relative"
        mount = _mount_of(cmd, path)
        assert mount is not None, f"{cmd}: --{flag.replace('_', '-')} {path} is on no mount of the container"
        if flag in WRITTEN:
            assert not mount.read_only and mount.kind not in ("configMap", "secret", "tmpfs"), \
                f"{cmd}: --{flag.replace('_', '-')} {path} must be on a writable, persistent volume"
        elif flag in READ:
            assert mount.read_only, f"{cmd}: --{flag.replace('_', '-')} {path} should be mounted read-only"


def check_command(cmd: Command) -> Parsed:
    p = parse(cmd)
    if p.kind == "stage":
        check_stage(p)
    elif p.kind == "ping":
        check_ping(p)
    elif p.kind == "align":
        check_align(p)
    check_paths(p)
    return p


def check_own_stage_files(stages: list[Parsed], group: str) -> Experiment:
    """Each party reads a stage file of its own stage, its container holds no other party's file, and the
    files load together as one experiment (their interfaces agree, as the handshake will check)."""
    for p in stages:
        assert not p.exp.data, f"{p.cmd}: a deployed party reads its own stage file, not a combined experiment"
        assert [s.name for s in p.exp.stages] == [p.ns.stage], f"{p.cmd}: the stage file is not {p.ns.stage}'s"
        for mount in p.cmd.mounts or []:
            if mount.kind == "bind" and mount.source.startswith("./parties/"):
                names = {path.name.split(".")[0] for path in (DEPLOY / mount.source).iterdir()}
                assert names <= {p.ns.stage}, f"{p.cmd}: {mount.source} holds other parties' files {names}"
        for path, text in p.cmd.files.items():
            if isinstance(text, str):
                assert PurePosixPath(path).name.split(".")[0] == p.ns.stage, \
                    f"{p.cmd}: {path}, another party's file, is mounted"
    try:
        return combine_stage_files([p.exp for p in stages])
    except ConfigError as e:
        pytest.fail(f"{group}: the parties' stage files do not fit together: {e}")


def check_deployment(parsed: list[Parsed], group: str) -> tuple[Parsed, list[Parsed]]:
    """The stages of one deployment fit together: one serving stage, and a driving stage for every data owner
    of the parties' stage files (one, or a vertical experiment's feature parties); its pings reach the
    serving stage. Returns the serving stage and the driving ones."""
    stages = [p for p in parsed if p.kind == "stage"]
    servers = [p for p in stages if p.serving]
    drivers = [p for p in stages if not p.serving]
    assert len(servers) == 1 and drivers, \
        f"{group}: expected one serving stage and driving ones, got {[str(p.cmd) for p in stages]}"
    g = servers[0]
    exp = check_own_stage_files(stages, group)
    assert sorted(p.ns.stage for p in drivers) == sorted(exp.data_owners), \
        f"{group}: the data owners {exp.data_owners} each need a driving stage"
    for p in stages:
        ns = p.ns
        assert ns.checkpoint_dir and ns.resume and ns.checkpoint_every, \
            f"{p.cmd}: a deployed stage needs --checkpoint-dir, --checkpoint-every and --resume"
        assert ns.curve_secret, f"{p.cmd}: a deployed stage should use CURVE"
    _, bind_port = _endpoint_port(g.ns.bind)
    assert bind_port != "*", f"{g.cmd}: a deployed g needs a fixed port"
    for f in drivers:
        for option in ("checkpoint_every", "seed"):
            assert getattr(g.ns, option) == getattr(f.ns, option), \
                f"{group}: {f.ns.stage} and {g.ns.stage} differ in --{option.replace('_', '-')}"
        _, connect_port = _endpoint_port(f.ns.connect)
        assert connect_port == bind_port, f"{f.cmd}: connects to port {connect_port}, but g binds {bind_port}"
    for p in parsed:
        if p.kind != "ping":
            continue
        host, port = _endpoint_port(p.ns.endpoint)
        assert port == bind_port, f"{p.cmd}: pings port {port}, but g binds {bind_port}"
        if p.cmd.container:
            assert p.cmd.container == g.cmd.container, f"{p.cmd}: a health check must run beside the serving stage"
            assert host in ("127.0.0.1", "localhost"), f"{p.cmd}: ping the stage in the same container on loopback"
        if g.ns.curve_secret:
            assert p.ns.curve_secret, f"{p.cmd}: g uses CURVE, so a plaintext ping times out (exit 3) like a dead g"
    return g, drivers


# ------------------------------------------------------------------ Dockerfile

def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if buf and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: a continuation line runs off the end"
    return out


def _exec_or_shell(text: str) -> list[str]:
    if text.startswith("["):
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value)
        return value
    return ["/bin/sh", "-c", text]


@dataclass
class Image:
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str] | None
    user: str
    instructions: list[tuple[str, str]]


def image() -> Image:
    entrypoint, cmd, health, user = [], [], None, "root"
    instructions = dockerfile_instructions()
    assert [w for w, _ in instructions].count("FROM") == 1, "expected a single-stage Dockerfile"
    for word, rest in instructions:
        if word == "ENTRYPOINT":
            entrypoint = _exec_or_shell(rest)   # (it would also drop a CMD inherited from the base image)
        elif word == "CMD":
            cmd = _exec_or_shell(rest)
        elif word == "USER":
            user = rest
        elif word == "HEALTHCHECK":
            if rest.upper() == "NONE":
                health = None
                continue
            options = re.match(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(.*)", rest, re.S)
            assert options, f"Dockerfile: cannot read HEALTHCHECK {rest!r}"
            health = _exec_or_shell(options.group(2).strip())
    return Image(entrypoint, cmd, health, user, instructions)


def test_dockerfile_builds_a_non_root_stage_image_without_secrets():
    img = image()
    words = [w for w, _ in img.instructions]
    assert img.instructions[0] == ("FROM", "python:3.11-slim")
    assert img.entrypoint == ["distgrad-stage"]
    assert any(w == "RUN" and re.search(r"\bpip install \.(\s|$)", r) for w, r in img.instructions)
    user = img.user.split(":")[0]
    assert user not in ("root", "0", ""), f"the image runs as {img.user}"
    # Nothing but the package sources goes in: no keys, checkpoints or experiment files of a user.
    for word, rest in img.instructions:
        if word in ("COPY", "ADD"):
            sources = [s for s in shlex.split(rest) if not s.startswith("--")][:-1]
            assert set(sources) <= {"pyproject.toml", "README.md", "distgrad"}, f"{word} {rest}"
        if word in ("ENV", "ARG"):
            assert not re.search(r"secret|password|token|key", rest, re.I), f"{word} {rest}"
    assert "ADD" not in words
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["distgrad-stage"] == "distgrad.cli:stage_main" and scripts["distgrad"] == "distgrad.cli:main"


def test_dockerfile_command_lines_are_accepted_by_the_cli():
    img = image()
    stage = check_command(Command("Dockerfile ENTRYPOINT + CMD", img.entrypoint + img.cmd, "dockerfile"))
    assert stage.kind == "stage" and stage.serving, "the image's default command should be a serving g"
    assert img.healthcheck is not None, "the Dockerfile has no HEALTHCHECK"
    health = check_command(Command("Dockerfile HEALTHCHECK", img.healthcheck, "dockerfile"))
    assert health.kind == "ping"
    assert _endpoint_port(health.ns.endpoint)[1] == _endpoint_port(stage.ns.bind)[1]


# ------------------------------------------------------------------ compose

_COMPOSE_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def compose_interpolate(text: str, where: str) -> str:
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        if m.group(2) and m.group(2).endswith("-"):
            return m.group(3)
        pytest.fail(f"{where}: set no plausible value for {m.group(0)}: give it a default (${{VAR:-value}})")
    return _COMPOSE_VAR.sub(sub, text)


def _compose_words(value: Any, where: str) -> list[str]:
    if value is None:
        return []
    words = shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    return [compose_interpolate(w, where) for w in words]


def _compose_mounts(service: dict) -> list[Mount]:
    mounts = []
    for volume in service.get("volumes", []):
        if isinstance(volume, str):
            parts = volume.split(":")
            source, target = (parts[0], parts[1]) if len(parts) > 1 else ("", parts[0])
            options = parts[2].split(",") if len(parts) > 2 else []
            kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            mounts.append(Mount(target, "ro" in options, kind, source))
        else:
            mounts.append(Mount(volume["target"], bool(volume.get("read_only")), volume.get("type", "volume"),
                                str(volume.get("source", ""))))
    tmpfs = service.get("tmpfs", [])
    for target in [tmpfs] if isinstance(tmpfs, str) else tmpfs:
        mounts.append(Mount(target.split(":")[0], False, "tmpfs"))
    return mounts


def compose_commands(path: Path = COMPOSE) -> tuple[list[Command], dict]:
    yaml = _yaml()
    doc = yaml.safe_load(path.read_text())
    img = image()
    commands = []
    for name, service in doc["services"].items():
        where = f"{path.name} services.{name}"
        build = service.get("build", {})
        assert isinstance(build, dict) and build.get("dockerfile") == "deploy/Dockerfile", f"{where}: build it from deploy/Dockerfile"
        assert (path.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE.resolve()
        entrypoint = _compose_words(service["entrypoint"], where) if "entrypoint" in service else img.entrypoint
        command = _compose_words(service["command"], where) if "command" in service else (
            [] if "entrypoint" in service else img.cmd)
        mounts = _compose_mounts(service)
        commands.append(Command(f"{where}.command", entrypoint + command, "compose", name, mounts))
        health = service.get("healthcheck", {})
        if health.get("disable") or health.get("test") in (["NONE"], "NONE"):
            continue
        test = health.get("test")
        if test is None:
            argv = img.healthcheck
            assert argv is not None
            where_h = f"{where} (the image's HEALTHCHECK)"
        elif isinstance(test, str) or test[0] == "CMD-SHELL":
            argv = shlex.split(test if isinstance(test, str) else test[1])
            where_h = f"{where}.healthcheck"
        else:
            assert test[0] == "CMD", f"{where}.healthcheck.test: {test}"
            argv = _compose_words(test[1:], where)
            where_h = f"{where}.healthcheck"
        commands.append(Command(where_h, argv, "compose", name, mounts))
    return commands, doc


def test_compose_command_lines_are_accepted_by_the_cli():
    commands, doc = compose_commands()
    for cmd in commands:
        assert cmd.program in PROGRAMS, f"{cmd}: every service and health check should run distgrad"
    parsed = [check_command(c) for c in commands]
    g, (f,) = check_deployment(parsed, "compose.yaml")
    assert len(parsed) == 3, [str(c) for c in commands]   # g, f and g's health check
    host, port = _endpoint_port(f.ns.connect)
    assert host == g.cmd.container, f"{f.cmd}: connect to the serving service by its name, {g.cmd.container}"
    assert [p.cmd.container for p in parsed if p.kind == "ping"] == [g.cmd.container]
    services = doc["services"]
    depends = services[f.cmd.container].get("depends_on", {})
    assert g.cmd.container in depends, "f should depend on g"
    if isinstance(depends, dict):
        assert depends[g.cmd.container].get("condition") in ("service_healthy", "service_started")
    for p in (g, f):
        assert str(services[p.cmd.container].get("restart", "")).startswith("on-failure"), \
            f"{p.cmd.container}: a stage that exits non-zero should be restarted (and resume)"
    # f's container sees only its own key pair and g's public key file, never g's secret key.
    g_secret = _mount_of(g.cmd, str(g.ns.curve_secret))
    assert g_secret.source not in {m.source for m in f.cmd.mounts}, f"f mounts g's key directory {g_secret.source}"
    assert _mount_of(f.cmd, str(f.ns.server_key)).target == str(f.ns.server_key), \
        "mount only g's public key file into f, not the directory that holds g's secret key"


# ------------------------------------------------------------------ Kubernetes

def k8s_docs(folder: Path = K8S) -> list[tuple[str, dict]]:
    yaml = _yaml()
    docs = []
    for path in sorted(folder.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def _pod_spec(doc: dict) -> dict | None:
    kind = doc.get("kind")
    if kind == "Pod":
        return doc["spec"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return doc["spec"]["template"]["spec"]
    if kind == "CronJob":
        return doc["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None


def _k8s_expand(words: list[Any], container: dict, where: str) -> list[str]:
    env = {e["name"]: e.get("value", "") for e in container.get("env", []) if "value" in e}
    out = []
    for word in map(str, words):
        def sub(m: re.Match) -> str:
            assert m.group(1) in env, f"{where}: $({m.group(1)}) is not set in the container's env"
            return env[m.group(1)]
        out.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, word).replace("$$", "$"))
    return out


def _install_copies(script: str) -> dict[str, str]:
    """``{destination: source}`` of the ``install [-m MODE] SRC DST`` lines of an init container's script."""
    copies = {}
    for line in script.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["install"] and "-d" not in words:
            files = [w for i, w in enumerate(words[1:], 1) if not w.startswith("-") and words[i - 1] not in ("-m", "-o", "-g")]
            assert len(files) == 2, line
            copies[files[1]] = files[0]
    return copies


@dataclass
class Workload:
    file: str
    doc: dict
    pod: dict
    commands: list[Command]
    init_copies: dict[str, str]          # files the init containers put in place: destination -> source
    init_mounts: list[Mount]
    awaited: dict[str, Mount] = field(default_factory=dict)   # files an init container waits for -> their mount


def k8s_workloads(folder: Path = K8S) -> tuple[list[Workload], list[tuple[str, dict]]]:
    docs = k8s_docs(folder)
    img = image()
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for _, d in docs if d.get("kind") == "ConfigMap"}
    workloads = []
    for file, doc in docs:
        pod = _pod_spec(doc)
        if pod is None:
            continue
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        init_copies, init_mounts, commands, awaited = {}, [], [], {}
        for section in ("initContainers", "containers"):
            for c in pod.get(section, []):
                where = f"{folder.name}/{file} {doc['kind']}/{doc['metadata']['name']} {section}[{c['name']}]"
                mounts, files = [], {}
                for vm in c.get("volumeMounts", []):
                    volume = volumes[vm["name"]]
                    kind = next(k for k in volume if k != "name")
                    source = volume[kind].get("name") or volume[kind].get("secretName") or volume[kind].get("claimName") or ""
                    mounts.append(Mount(vm["mountPath"], bool(vm.get("readOnly")), kind, source))
                    if kind == "configMap":
                        assert source in config_maps, f"{where}: no ConfigMap {source} in k8s/"
                        data = config_maps[source]
                        items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in data]
                        for item in items:
                            files[f"{vm['mountPath'].rstrip('/')}/{item['path']}"] = data[item["key"]]
                uses_image = c["image"].split(":")[0].rsplit("/", 1)[-1] == IMAGE
                if "command" in c:
                    argv = _k8s_expand(c["command"] + c.get("args", []), c, where)
                else:
                    assert uses_image, f"{where}: no command, and not the distgrad-stage image"
                    argv = img.entrypoint + (_k8s_expand(c["args"], c, where) if "args" in c else img.cmd)
                if section == "initContainers" and PurePosixPath(argv[0]).name not in PROGRAMS:
                    assert argv[:2] in (["sh", "-c"], ["/bin/sh", "-c"]), f"{where}: unexpected init command {argv}"
                    assert "distgrad" not in argv[2], f"{where}: a distgrad command inside a script is not checked"
                    init_copies.update(_install_copies(argv[2]))
                    init_mounts += mounts
                    for path in re.findall(r"\[ -s (/\S+) \]", argv[2]):
                        mount = next((m for m in mounts if path.startswith(m.target.rstrip("/") + "/")), None)
                        assert mount is not None and mount.kind == "persistentVolumeClaim" and not mount.read_only, \
                            f"{where}: waits for {path}, which is on no writable claim of the init container"
                        awaited[path] = mount
                    continue
                container = f"{doc['metadata']['name']}/{c['name']}"
                commands.append(Command(where, argv, "k8s", container, mounts, files, extra={"spec": c}))
                for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                    if probe in c:
                        assert "exec" in c[probe], f"{where}.{probe}: expected an exec probe running distgrad ping"
                        commands.append(Command(f"{where}.{probe}", _k8s_expand(c[probe]["exec"]["command"], c, where),
                                                "k8s", container, mounts, files, extra={"probe": probe}))
        workloads.append(Workload(file, doc, pod, commands, init_copies, init_mounts, awaited))
    return workloads, docs


def check_k8s_pod(load: Workload, p: Parsed, by_name: dict[tuple[str, str], dict]) -> None:
    """``p`` runs in ``load``'s pod as a non-root user, with its claims defined, its Secrets mounted 0400, and
    its keys read from the copies an init container made of a Secret's entries."""
    security = load.pod.get("securityContext", {})
    assert security.get("runAsNonRoot") and security.get("runAsUser", 0) != 0, f"{p.cmd}: run as non-root"
    for volume in load.pod.get("volumes", []):
        if "secret" in volume:
            assert volume["secret"].get("defaultMode") == 0o400, f"{load.file}: secret volume defaultMode 0400"
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"]["claimName"]
            assert ("PersistentVolumeClaim", claim) in by_name, f"{load.file}: no PVC {claim} beside it"
    # distgrad reads keys only from files an init container copied (as the pod's user, mode 0600):
    # a Secret volume's files are root's, or group-readable under an fsGroup, and either way refused.
    for flag in KEYS:
        path = getattr(p.ns, flag)
        if path is None:
            continue
        mount = _mount_of(p.cmd, str(path))
        assert mount.kind != "secret", f"{p.cmd}: --{flag.replace('_', '-')} reads the Secret volume directly"
        if flag == "allow":
            assert any(PurePosixPath(d).parent == PurePosixPath(path) and d.endswith(".key") for d in load.init_copies), \
                f"{p.cmd}: the init container puts no client key in {path}"
        else:
            assert str(path) in load.init_copies, f"{p.cmd}: the init container does not put {path} in place"
    secret_names = {m.source for m in load.init_mounts if m.kind == "secret"}
    for source in load.init_copies.values():
        mount = next(m for m in load.init_mounts if source.startswith(m.target.rstrip("/") + "/"))
        assert mount.kind == "secret"
        secret = by_name.get(("Secret", mount.source))
        assert secret is not None and secret.get("type") == "Opaque", f"{load.file}: no Opaque Secret {mount.source}"
        key = source[len(mount.target.rstrip("/")) + 1:]
        assert key in secret.get("stringData", {}), f"Secret {mount.source} has no {key}"
    assert secret_names, f"{load.file}: no Secret is mounted for the keys"


def _awaited_data(load: Workload, parties: Path) -> None:
    """Each command of ``load`` reads the files its init containers wait for (a party's CSV on its claim) as
    the repository's copy of that party's file (``parties/PARTY/NAME``), mounted read-only from the same claim."""
    for cmd in load.commands:
        for path, mount in load.awaited.items():
            own = _mount_of(cmd, path)
            assert own is not None and own.source == mount.source and own.read_only, \
                f"{cmd}: mount the claim {mount.source} read-only at {mount.target}"
            name = PurePosixPath(path).name
            cmd.written[path] = parties / name.split(".")[0] / name


def test_k8s_command_lines_are_accepted_by_the_cli():
    workloads, docs = k8s_workloads()
    for load in workloads:
        _awaited_data(load, TWO_PARTY)
    commands = [c for w in workloads for c in w.commands]
    for cmd in commands:
        assert cmd.program in PROGRAMS, f"{cmd}: every container and probe should run distgrad"
    parsed = [check_command(c) for c in commands]
    pings = [p for p in parsed if p.kind == "ping"]
    g, (f,) = check_deployment(parsed, "k8s")
    assert len(parsed) == 4 and len(pings) == 2, [str(c) for c in commands]  # g, f, g's liveness and readiness
    assert any(p.cmd.extra.get("probe") == "livenessProbe" for p in pings), "g needs a liveness probe"
    assert g.ns.keep_serving, f"{g.cmd}: in a Deployment g must --keep-serving, or it exits after a run and is restarted"

    by_name = {(d["kind"], d["metadata"]["name"]): d for _, d in docs if "metadata" in d}
    g_load = next(w for w in workloads if g.cmd in w.commands)
    f_load = next(w for w in workloads if f.cmd in w.commands)
    assert g_load.doc["kind"] == "Deployment" and g_load.doc["spec"].get("replicas") == 1
    assert g_load.doc["spec"].get("strategy", {}).get("type") == "Recreate", "never two g pods on one checkpoint claim"
    assert f_load.doc["kind"] == "Job" and f_load.pod.get("restartPolicy") in ("Never", "OnFailure")

    # f connects to a Service that selects g's pod and forwards to the port g binds.
    host, port = _endpoint_port(f.ns.connect)
    service = by_name.get(("Service", host))
    assert service is not None, f"{f.cmd}: no Service named {host}"
    labels = g_load.doc["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), f"Service {host} does not select g's pod"
    ports = [sp for sp in service["spec"]["ports"] if str(sp["port"]) == port]
    assert ports, f"Service {host} has no port {port}"
    target = ports[0].get("targetPort", ports[0]["port"])
    container_ports = {cp.get("name"): cp["containerPort"] for cp in g.cmd.extra["spec"].get("ports", [])}
    target = container_ports.get(target, target)
    assert str(target) == _endpoint_port(g.ns.bind)[1], f"Service {host} forwards to {target}, g binds {g.ns.bind}"

    for load, p in ((g_load, g), (f_load, f)):
        check_k8s_pod(load, p, by_name)

    # g's probes ping with g's own key pair, whose public key is therefore in g's --allow directory.
    for p in pings:
        assert p.ns.curve_secret == g.ns.curve_secret, f"{p.cmd}: ping with g's own key pair"
        server_key_source = g_load.init_copies[str(p.ns.server_key)]
        allowed = {src for dst, src in g_load.init_copies.items() if PurePosixPath(dst).parent == PurePosixPath(g.ns.allow)}
        assert server_key_source in allowed, f"{p.cmd}: its key is not in g's --allow directory, so g would not answer"

    kustomization = next(d for _, d in docs if d.get("kind") == "Kustomization")
    listed = set(kustomization["resources"])
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == files - {"secret.yaml"}, "kustomization.yaml should list every manifest but the Secret template"


def test_party_folders_are_what_distgrad_split_writes():
    """deploy/parties/seed-reverse/ (the systemd units' instance) is `distgrad split seed-reverse`'s output: a
    party given its file and one given the built-in interoperate, and nothing in deploy/ drifts from what the
    parser makes of the built-in."""
    written = stage_files(load_experiment(INSTANCE))
    folder = PARTIES / INSTANCE
    assert {p.name for p in folder.iterdir()} == set(written)
    for stage, (text, arrays) in written.items():
        assert not arrays and sorted(p.name for p in (folder / stage).iterdir()) == [f"{stage}.toml"]
        assert (folder / stage / f"{stage}.toml").read_text() == text, \
            f"deploy/parties/{INSTANCE}/{stage}/{stage}.toml differs from `distgrad split {INSTANCE}`'s"


def test_two_party_folders_are_what_distgrad_init_writes_from_the_shipped_table(tmp_path: Path):
    """deploy/parties/two-party/ (compose.yaml's and k8s/'s parties) is what `distgrad init
    deploy/data/breast-cancer-small.csv --label diagnosis` writes: each party's stage file and its own
    columns of the shipped table; the Kubernetes ConfigMaps hold copies of the stage files, one party's each,
    whose [data] reads the party's CSV from its claim (/input/PARTY.csv)."""
    from distgrad.config.scaffold import init_parties

    assert TWO_PARTY_TABLE.stat().st_size < 100_000, "ship a small table"
    init_parties([TWO_PARTY_TABLE], "diagnosis", tmp_path / "two-party")
    fresh = {p.relative_to(tmp_path / "two-party"): p.read_bytes() for p in (tmp_path / "two-party").rglob("*")
             if p.is_file()}
    shipped = {p.relative_to(TWO_PARTY): p.read_bytes() for p in TWO_PARTY.rglob("*") if p.is_file()}
    assert shipped == fresh, "deploy/parties/two-party/ differs from what distgrad init writes"
    assert sorted(map(str, shipped)) == ["f/f.csv", "f/f.toml", "g/g.csv", "g/g.toml"]
    expected = {}
    for party in ("f", "g"):
        raw = tomllib.loads((TWO_PARTY / party / f"{party}.toml").read_text())
        assert raw["data"]["path"] == f"{party}.csv"
        raw["data"]["path"] = f"/input/{party}.csv"
        expected[party] = raw
    _config_maps_are_copies(K8S, expected)


def test_no_secret_carries_data():
    """Secrets (1 MiB at most, and meant for keys) hold only CURVE keys: every party's rows are on volumes."""
    for folder in (K8S, K8S_VERTICAL, K8S_VERTICAL_ACTIVE):
        for file, doc in k8s_docs(folder):
            if doc.get("kind") == "Secret":
                entries = {**doc.get("stringData", {}), **doc.get("data", {})}
                assert all(k.endswith((".key", ".key_secret")) for k in entries), \
                    f"{folder.name}/{file} Secret {doc['metadata']['name']} holds {sorted(entries)}: keys only"


# ------------------------------------------------------------------ vertical: K feature parties and a label owner

VERTICAL = PARTIES / "breast-cancer"
VERTICAL_ACTIVE = PARTIES / "breast-cancer-active"


@pytest.fixture(scope="module")
def aligned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What `distgrad align` leaves each party of the vertical example with (its rows of the IDs all parties
    hold, in ascending ID text), computed here in the clear from the CSVs `python -m distgrad.vertical_example
    --prepare-only` writes: stand-ins for the files the deployments' align commands write, so that the stage
    files that read them can be parsed as they will be at run time."""
    return _aligned(tmp_path_factory.mktemp("parties"), [])


@pytest.fixture(scope="module")
def aligned_active(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``aligned`` of the active example (``--active``: the label owner holds the worst columns too)."""
    return _aligned(tmp_path_factory.mktemp("active-parties"), ["--active"])


def _aligned(folder: Path, flags: list[str]) -> dict[str, Path]:
    assert vertical_example.main(["--prepare-only", *flags, "--workdir", str(folder)]) == 0
    tables = {}
    for party_folder in sorted(folder.iterdir()):
        with open(party_folder / f"{party_folder.name}.csv", newline="") as f:
            header, *rows = list(csv.reader(f))
        tables[party_folder.name] = header, {row[0]: row for row in rows}
    common = sorted(set.intersection(*(set(rows) for _, rows in tables.values())))
    assert len(common) > 400
    out = {}
    for party, (header, rows) in tables.items():
        out[party] = folder / party / f"{party}.aligned.csv"
        with open(out[party], "w", newline="") as f:
            csv.writer(f).writerows([header, *(rows[i] for i in common)])
    return out


def check_vertical(commands: list[Command], group: str, aligned: dict[str, Path]) -> tuple[list[Parsed], Parsed,
                                                                                              list[Parsed]]:
    """A vertical deployment: every party first runs `distgrad align` (the label owner coordinates, the others
    connect to it, all with CURVE), then trains its own stage file, which reads the rows its own alignment
    wrote, on the same volume, with the same keys. Returns the aligns, the serving stage and the driving ones."""
    is_align = [c.program == "distgrad" and c.argv[1:2] == ["align"] for c in commands]
    aligns = [check_command(c) for c, yes in zip(commands, is_align) if yes]
    coordinators = [a for a in aligns if a.serving]
    assert len(coordinators) == 1, f"{group}: one party coordinates the alignment (--bind), got {len(coordinators)}"
    coord = coordinators[0]
    assert coord.ns.parties == len(aligns), f"{coord.cmd}: --parties {coord.ns.parties}, but {len(aligns)} parties align"
    by_party = {a.ns.name: a for a in aligns}
    assert len(by_party) == len(aligns), f"{group}: two aligns share a --name"
    assert set(by_party) == set(aligned), f"{group}: the parties that align are {sorted(by_party)}, not {sorted(aligned)}"
    _, align_port = _endpoint_port(coord.ns.bind)
    for a in aligns:
        assert a.ns.curve_secret, f"{a.cmd}: align with CURVE, as the stages do"
        if a is not coord and len(aligns) > 2:
            # Else the coordinator could relay to this party a digest another party never sent (and align warns).
            assert a.ns.party_keys, f"{a.cmd}: {len(aligns)} parties align: pass --party-keys (the others' keys)"
        if a is not coord:
            assert _endpoint_port(a.ns.connect)[1] == align_port, f"{a.cmd}: the coordinator binds {align_port}"
            assert a.ns.parties in (None, coord.ns.parties), f"{a.cmd}: --parties differs from the coordinator's"
    for c, yes in zip(commands, is_align):
        if not yes and c.program == "distgrad-stage" and c.argv[1] in by_party:
            a = by_party[c.argv[1]]
            c.written = {str(a.ns.out): aligned[a.ns.name]}      # its own party's aligned rows, nobody else's
    parsed = [check_command(c) for c, yes in zip(commands, is_align) if not yes]
    g, drivers = check_deployment(parsed, group)
    assert coord.ns.name == g.ns.stage, f"{coord.cmd}: the label owner {g.ns.stage} should coordinate (it binds)"
    assert sorted(p.ns.stage for p in [g, *drivers]) == sorted(by_party), f"{group}: every party that aligns trains"
    for p in [g, *drivers]:
        a = by_party[p.ns.stage]
        out = str(a.ns.out)
        assert _mount_of(a.cmd, out).source == _mount_of(p.cmd, out).source, \
            f"{p.cmd}: reads {out} from another volume than {a.cmd} writes it to"
        assert PurePosixPath(str(a.ns.input)).name == f"{p.ns.stage}.csv", f"{a.cmd}: aligns another party's file"
        for flag in KEYS:
            assert getattr(a.ns, flag) == getattr(p.ns, flag), f"{a.cmd}: --{flag} differs from its stage's"
    return aligns, g, drivers


def test_vertical_example_prepare_only_needs_a_workdir(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        vertical_example.main(["--prepare-only"])
    assert exit_.value.code == 2 and "--prepare-only needs --workdir" in capsys.readouterr().err


def _example_stage_files(aligned: dict[str, Path], parties: Path) -> dict[str, dict]:
    """Check that deploy/parties/PARTIES/PARTY/PARTY.toml is what distgrad/vertical_example.py writes for PARTY,
    but for the path of the aligned rows (on the party's volume); returns those stage files by party."""
    expected = {path.stem: tomllib.loads(path.read_text()) for path in vertical_example.write_stage_files(aligned)}
    for party, raw in expected.items():
        raw["data"]["path"] = f"/data/{party}.aligned.csv"
    assert {p.name for p in parties.iterdir()} == set(expected)
    for party, raw in expected.items():
        folder = parties / party
        assert {p.name for p in folder.iterdir()} <= {f"{party}.toml", f"{party}.csv"}, f"{folder}: not only {party}'s"
        assert tomllib.loads((folder / f"{party}.toml").read_text()) == raw, \
            f"{folder / party}.toml differs from what distgrad/vertical_example.py writes"
    return expected


def test_active_vertical_stage_files_are_the_examples(aligned_active: dict[str, Path]):
    """deploy/parties/breast-cancer-active/: the label owner's holds its bottom, its worst columns and the labels."""
    expected = _example_stage_files(aligned_active, VERTICAL_ACTIVE)
    assert set(expected) == {"mean", "se", "diagnosis"} and "bottom" in expected["diagnosis"]["stage"]
    assert all(name.startswith("worst") for name in expected["diagnosis"]["data"]["features"])
    _config_maps_are_copies(K8S_VERTICAL_ACTIVE, expected)


def test_vertical_stage_files_are_the_examples(aligned: dict[str, Path]):
    """The passive example's stage files (``_example_stage_files``); the ConfigMaps of k8s-vertical/ are copies."""
    _config_maps_are_copies(K8S_VERTICAL, _example_stage_files(aligned, VERTICAL))


def _config_maps_are_copies(folder: Path, expected: dict[str, dict]) -> None:
    """The ConfigMaps of a k8s folder hold one party's stage file each, copies of ``expected``."""
    maps = {d["metadata"]["name"]: d["data"] for _, d in k8s_docs(folder) if d.get("kind") == "ConfigMap"}
    assert all(len(data) == 1 for data in maps.values()), f"one party's stage file per ConfigMap: {maps.keys()}"
    copies = {key: tomllib.loads(text) for data in maps.values() for key, text in data.items()}
    assert copies == {f"{party}.toml": raw for party, raw in expected.items()}


@pytest.mark.parametrize("path,parties", [(COMPOSE_VERTICAL, "aligned"), (COMPOSE_VERTICAL_ACTIVE, "aligned_active")])
def test_compose_vertical_aligns_then_trains(path: Path, parties: str, request: pytest.FixtureRequest):
    """compose.vertical.yaml (three feature parties) and compose.vertical-active.yaml (two, and a label owner
    holding features of its own)."""
    aligned = request.getfixturevalue(parties)
    commands, doc = compose_commands(path)
    for cmd in commands:
        assert cmd.program in PROGRAMS, f"{cmd}: every service and health check should run distgrad"
    aligns, g, drivers = check_vertical(commands, path.name, aligned)
    services = doc["services"]
    coord = next(a for a in aligns if a.serving)
    by_party = {a.ns.name: a for a in aligns}
    for a in aligns:
        if a is not coord:
            assert _endpoint_port(a.ns.connect)[0] == coord.cmd.container, f"{a.cmd}: connect to {coord.cmd.container}"
    for f in drivers:
        assert _endpoint_port(f.ns.connect)[0] == g.cmd.container, f"{f.cmd}: connect to {g.cmd.container}"
        assert services[f.cmd.container]["depends_on"][g.cmd.container]["condition"] == "service_healthy"
    for p in [g, *drivers, *aligns]:
        assert str(services[p.cmd.container].get("restart", "")).startswith("on-failure"), p.cmd.container
    for p in [g, *drivers]:
        # Training starts once this party's own alignment has written its rows.
        own = by_party[p.ns.stage].cmd.container
        assert services[p.cmd.container]["depends_on"][own]["condition"] == "service_completed_successfully", \
            f"{p.cmd.container}: start once {own} completed"
    # No party's container mounts another party's secret key; the others mount only the label owner's public key.
    parsed = [*aligns, g, *drivers]
    for p in parsed:
        secret = _mount_of(p.cmd, str(p.ns.curve_secret)).source
        party = p.ns.name if p.kind == "align" else p.ns.stage
        for other in parsed:
            if (other.ns.name if other.kind == "align" else other.ns.stage) != party:
                assert secret not in {m.source for m in other.cmd.mounts}, f"{other.cmd} mounts {party}'s key {secret}"
        if p.ns.server_key:
            assert _mount_of(p.cmd, str(p.ns.server_key)).target == str(p.ns.server_key), \
                f"{p.cmd}: mount only the label owner's public key file, not its key directory"


@pytest.mark.parametrize("folder,parties", [(K8S_VERTICAL, "aligned"), (K8S_VERTICAL_ACTIVE, "aligned_active")])
def test_k8s_vertical_aligns_then_trains(folder: Path, parties: str, request: pytest.FixtureRequest):
    """k8s-vertical/ (three feature parties) and k8s-vertical-active/ (two, and a label owner holding features
    of its own)."""
    aligned = request.getfixturevalue(parties)
    workloads, docs = k8s_workloads(folder)
    commands = [c for w in workloads for c in w.commands]
    aligns, g, drivers = check_vertical(commands, folder.name, aligned)
    by_name = {(d["kind"], d["metadata"]["name"]): d for _, d in docs if "metadata" in d}
    by_party = {a.ns.name: a for a in aligns}
    for p in [g, *drivers]:
        load = next(w for w in workloads if p.cmd in w.commands)
        a = by_party[p.ns.stage]
        init = [c["name"] for c in load.pod["initContainers"]]
        assert a.cmd in load.commands and a.cmd.container.split("/")[1] in init, \
            f"{a.cmd}: align in an init container of {p.ns.stage}'s pod, so that it has run when training starts"
        assert load.doc["kind"] == "Job" and load.pod.get("restartPolicy") == "OnFailure", \
            f"{load.file}: a Job whose failed stage restarts in its pod (the alignment is not redone)"
        for q in (a, p):
            check_k8s_pod(load, q, by_name)
        if a.ns.party_keys is not None:
            others = {f"{o.ns.name}.key" for o in aligns if o is not a and o.ns.name != g.ns.stage}
            placed = {PurePosixPath(d).name for d in load.init_copies
                      if PurePosixPath(d).parent == PurePosixPath(a.ns.party_keys)}
            assert others <= placed, f"{a.cmd}: the init container puts {placed} in --party-keys, not {others}"
        secrets = {v["secret"]["secretName"] for v in load.pod["volumes"] if "secret" in v}
        assert all(name.startswith(f"distgrad-vertical-{p.ns.stage}-") for name in secrets), \
            f"{load.file}: mounts another party's Secret: {secrets}"
    # The feature parties reach the label owner's pod through one Service, for the alignment (while the pod
    # is still in its init containers, so not ready) and for training.
    g_load = next(w for w in workloads if g.cmd in w.commands)
    labels = g_load.doc["spec"]["template"]["metadata"]["labels"]
    coord = by_party[g.ns.stage]
    for p, port in [(a, _endpoint_port(coord.ns.bind)[1]) for a in aligns if a is not coord] + \
                   [(f, _endpoint_port(g.ns.bind)[1]) for f in drivers]:
        host, connect_port = _endpoint_port(p.ns.connect)
        service = by_name.get(("Service", host))
        assert service is not None and service["spec"]["selector"].items() <= labels.items(), \
            f"{p.cmd}: no Service {host} selects the label owner's pod"
        assert service["spec"].get("publishNotReadyAddresses") is True, \
            f"Service {host}: the alignment runs before the pod is ready; publish its address anyway"
        assert any(str(sp["port"]) == connect_port and str(sp.get("targetPort", sp["port"])) == port
                   for sp in service["spec"]["ports"]), f"Service {host} does not forward {connect_port} to {port}"
    kustomization = next(d for _, d in docs if d.get("kind") == "Kustomization")
    files = {p.name for p in folder.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files - {"secret.yaml"}


# ------------------------------------------------------------------ systemd

def read_env_file(path: Path = ENV_EXAMPLE) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()), f"{path.name}: bad line {line!r}"
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current, buf = None, ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith(("#", ";")) or (not stripped and not buf):
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        buf += stripped
        if buf.startswith("[") and buf.endswith("]"):
            current = buf[1:-1]
            sections.setdefault(current, [])
        else:
            key, sep, value = buf.partition("=")
            assert sep and current, f"{path.name}: cannot read {buf!r}"
            sections[current].append((key.strip(), value.strip()))
        buf = ""
    return sections


def _specifiers(text: str, unit: str) -> str:
    instance = INSTANCE
    values = {"i": instance, "I": instance.replace("-", "/"), "S": "/var/lib", "%": "%",
              "n": unit, "N": unit.removesuffix(".service"), "p": unit.split("@")[0],
              "d": f"/run/credentials/{unit}"}
    def sub(m: re.Match) -> str:
        assert m.group(1) in values, f"{unit}: specifier %{m.group(1)} not known to this test"
        return values[m.group(1)]
    return re.sub(r"%(.)", sub, text)


def systemd_units() -> list[tuple[Path, str, dict[str, list[tuple[str, str]]]]]:
    units = sorted(SYSTEMD.glob("*@.service"))
    assert {u.name for u in units} >= {"distgrad-g@.service", "distgrad-f@.service"}
    return [(u, u.name.replace("@.", f"@{INSTANCE}."), read_unit(u)) for u in units]


def systemd_command(path: Path, unit: str, sections: dict) -> Command:
    service = sections["Service"]
    values = {}
    for key, value in service:
        values.setdefault(key, []).append(value)
    exec_start = values.get("ExecStart", [])
    assert len(exec_start) == 1, f"{path.name}: expected one ExecStart"
    line = _specifiers(exec_start[0], unit).lstrip("@-:+!")
    env = {}
    for env_file in values.get("EnvironmentFile", []):
        name = _specifiers(env_file.lstrip("-"), unit)
        assert name.startswith("/etc/distgrad/") and name.endswith(".env"), name
        env.update(read_env_file())     # the example stands for /etc/distgrad/INSTANCE.env
    for assignment in values.get("Environment", []):
        for word in shlex.split(assignment):
            key, _, value = word.partition("=")
            env.setdefault(key, _specifiers(value, unit))
    state = [_specifiers(v, unit) for v in " ".join(values.get("StateDirectory", [])).split()]
    if state:
        env["STATE_DIRECTORY"] = ":".join(f"/var/lib/{s}" for s in state)
    if "LoadCredential" in values or "SetCredential" in values:
        env["CREDENTIALS_DIRECTORY"] = f"/run/credentials/{unit}"
    argv = []
    for word in shlex.split(line):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            assert whole.group(1) in env, f"{path.name}: ${whole.group(1)} is set nowhere (it would expand to nothing)"
            argv += env[whole.group(1)].split()
            continue
        def sub(m: re.Match) -> str:
            assert m.group(1) in env, f"{path.name}: ${{{m.group(1)}}} is set nowhere (it would expand to nothing)"
            return env[m.group(1)]
        word = re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", sub, word)
        assert "$" not in word, f"{path.name}: cannot expand {word!r}"
        argv.append(word)
    # The host holds its own party's folder of `distgrad split` as /etc/distgrad/INSTANCE/.
    stage = unit.split("@")[0].removeprefix("distgrad-")
    files: dict[str, str | Path] = {f"/etc/distgrad/{INSTANCE}/{stage}.toml": PARTIES / INSTANCE / stage / f"{stage}.toml"}
    return Command(f"systemd/{path.name} ExecStart (as {unit})", argv, "systemd", files=files, env=env,
                   extra={"values": values})


def test_systemd_units_are_unprivileged_restartable_templates():
    for path, unit, sections in systemd_units():
        values = dict(sections["Service"])
        assert values.get("Restart") == "on-failure", f"{path.name}: Restart=on-failure"
        assert values.get("DynamicUser") == "yes" or values.get("User") not in (None, "", "root", "0"), \
            f"{path.name}: run as an unprivileged user"
        assert values.get("StateDirectory"), f"{path.name}: keep checkpoints in a StateDirectory"
        assert "143" in values.get("SuccessExitStatus", "").split(), f"{path.name}: SIGTERM exits 143, a clean stop"
        assert "2" in values.get("RestartPreventExitStatus", "").split(), f"{path.name}: do not restart on usage errors"
        exec_start = values["ExecStart"]
        assert re.match(r"/usr/local/bin/distgrad-stage (\S+) --experiment /etc/distgrad/%i/\1\.toml ", exec_start), \
            f"{path.name}: the stage's own file in the instance's folder: {exec_start}"
        assert "WantedBy" in dict(sections.get("Install", []))


# The exit codes a restart cannot fix: a usage or configuration error, a refusal by the peer, and a run the
# data owner's input_guard stopped (resumed before that step, it is judged and stopped there again).
FINAL_EXIT_CODES = {cli.EXIT_USAGE, cli.EXIT_REJECTED, cli.EXIT_GUARD}


def test_no_deployment_restarts_a_stage_on_an_exit_a_restart_cannot_fix():
    """Every systemd unit prevents a restart, and the k8s Job of the driving stage fails at once, on each exit
    code that a retry only repeats (``FINAL_EXIT_CODES``, from the CLI's own constants)."""
    for path, _, sections in systemd_units():
        prevented = {int(code) for code in dict(sections["Service"]).get("RestartPreventExitStatus", "").split()}
        assert FINAL_EXIT_CODES <= prevented, f"{path.name}: RestartPreventExitStatus lacks " \
                                              f"{sorted(FINAL_EXIT_CODES - prevented)}"
    jobs = [(file, doc) for file, doc in k8s_docs() if doc.get("kind") == "Job"]
    assert jobs
    for file, doc in jobs:
        if _pod_spec(doc).get("restartPolicy") != "Never":
            continue              # podFailurePolicy needs restartPolicy Never
        failing = {code for rule in doc["spec"]["podFailurePolicy"]["rules"] if rule["action"] == "FailJob"
                   for code in rule.get("onExitCodes", {}).get("values", [])}
        assert FINAL_EXIT_CODES <= failing, f"k8s/{file} Job: FailJob lacks {sorted(FINAL_EXIT_CODES - failing)}"


def test_systemd_command_lines_are_accepted_by_the_cli():
    parsed = []
    for path, unit, sections in systemd_units():
        cmd = systemd_command(path, unit, sections)
        assert cmd.program == "distgrad-stage" and cmd.argv[0].startswith("/"), f"{cmd}: an absolute path to distgrad-stage"
        p = check_command(cmd)
        assert p.kind == "stage" and p.ns.experiment == f"/etc/distgrad/{INSTANCE}/{p.ns.stage}.toml", \
            f"{cmd}: the instance name names the folder of the stage's own file"
        env, values = cmd.env, cmd.extra["values"]
        for flag in WRITTEN:
            value = getattr(p.ns, flag, None)
            if value is not None:
                assert str(value).startswith(env["STATE_DIRECTORY"] + "/"), f"{cmd}: --{flag} outside the StateDirectory"
        credentials = {c.split(":", 1)[0]: c.split(":", 1)[1] for c in values.get("LoadCredential", [])}
        secret = PurePosixPath(str(p.ns.curve_secret))
        assert str(secret.parent) == env.get("CREDENTIALS_DIRECTORY") and secret.name in credentials, \
            f"{cmd}: read the secret key from a LoadCredential= credential (mode 0400, owned by the service)"
        for flag in ("allow", "server_key"):
            value = getattr(p.ns, flag)
            if value is not None:
                assert str(value).startswith("/etc/distgrad/"), f"{cmd}: --{flag} {value}"
        parsed.append(p)
    g, (f,) = check_deployment(parsed, "systemd")


def test_env_example_sets_every_variable_the_units_use():
    env = read_env_file()
    used = set()
    for path, unit, sections in systemd_units():
        text = dict(sections["Service"])["ExecStart"]
        used |= set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))
    assert used - {"STATE_DIRECTORY", "CREDENTIALS_DIRECTORY"} <= env.keys()
    check_endpoint(env["DISTGRAD_BIND"], bind=True)
    check_endpoint(env["DISTGRAD_CONNECT"], bind=False)


# ------------------------------------------------------------------ README

def readme_commands() -> Iterator[Command]:
    in_block, buf, start = False, "", 0
    for number, line in enumerate(README.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_block = not in_block and line.strip("`").strip() in ("sh", "bash", "console", "shell")
            continue
        if not in_block:
            continue
        if not buf:
            start = number
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        words = shlex.split(buf + line, comments=True)
        buf = ""
        while words[:1] in (["$"], ["sudo"]):
            words = words[1:]
        if words and words[0] in PROGRAMS:
            yield Command(f"deploy/README.md line {start}", words, "readme")


def test_readme_command_lines_are_accepted_by_the_cli():
    commands = list(readme_commands())
    assert len(commands) >= 4, [str(c) for c in commands]
    for cmd in commands:
        check_command(cmd)
