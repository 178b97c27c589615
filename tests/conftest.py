"""Fixtures for tests that start real stage processes over real sockets.

Every process is started through ``StageProcess``, which always stops it
(SIGTERM, then SIGKILL after a grace period) and reaps it; every wait has a
deadline; every ZeroMQ socket made by a test is closed with linger 0.

Markers: a test that starts a process or opens a socket is marked
``integration`` here, at collection (see ``integration_reason``), so that
``pytest -m "not integration"`` runs the pure unit tests alone. The rule is
kept true at run time: a test not marked ``integration`` that starts a
process or makes a socket fails, naming what it did (``_forbid_processes_and_sockets``).
"""

from __future__ import annotations

import os

# Pin BLAS pools before numpy loads, as the launcher does for every stage, so any
# reference computed in this process uses the same kernels as the stage processes.
from distgrad.threads import pin_blas_threads  # noqa: E402  (imports neither numpy nor the package's API)

pin_blas_threads()

import contextlib
import dataclasses
import inspect
import io
import json
import logging
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
import zmq

from distgrad.run.launcher import pinned_env, stop_process
from handshake import hello_message  # noqa: F401  (the tests import it from here)

CLI = [sys.executable, "-m", "distgrad.cli"]
REQUIRE_VARIABLE = "DISTGRAD_REQUIRE"     # comma-separated modules whose absence fails the run instead of skipping


def _compile_the_sources_once() -> None:
    """Byte-compile distgrad, benchmarks/ and tests/ in place, once per session, as a regular install would.

    The package is installed editable, so its .pyc files are written by the first import, unless
    PYTHONDONTWRITEBYTECODE is set (as on some CI and sandbox images): then each of the suite's several
    hundred stage processes compiled the whole package from source again, about 0.1 s of CPU each.
    Compiling skips files whose .pyc is current; processes only read them.
    """
    import compileall

    root = Path(__file__).resolve().parent.parent
    for directory in (root / "distgrad", root / "benchmarks", root / "tests"):
        if directory.is_dir():
            compileall.compile_dir(directory, quiet=2, workers=1)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session: pytest.Session) -> Iterator[None]:
    """Keep the test modules' assertion-rewritten code in tests/__pycache__, whatever PYTHONDONTWRITEBYTECODE says.

    pytest rewrites the asserts of every test module it imports and caches the result in a .pyc of its own,
    which it reads whatever PYTHONDONTWRITEBYTECODE says but writes only without it: with it set (as on some
    CI and sandbox images) every collection, in every xdist worker, rewrote and compiled all of tests/ again,
    about 5 s of CPU each (more than half of collecting the suite). Only collection writes them: the imports
    a test makes while it runs (modules a test writes into its tmp_path) still follow the environment.
    """
    saved = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = saved


def _build_matplotlib_font_cache() -> None:
    """Build matplotlib's font cache before any test runs, where matplotlib is installed.

    On a machine where matplotlib never ran (an empty HOME, MPLCONFIGDIR or XDG_CACHE_HOME) its first
    import scans the system fonts and runs ``fc-list`` in a subprocess; inside a unit test that draws a
    plot, the guard below would take that for the test starting a process. Building the cache here, as
    matplotlib's own first run would, keeps the plot tests unit tests on a fresh machine too.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.font_manager  # noqa: F401  (builds and saves the font cache on first import)
    except ImportError:
        pass


def pytest_configure(config: pytest.Config) -> None:
    """Where the environment promises optional modules (CI installs torch), a missing one is an error:
    without this its tests would be skipped and the run would still pass."""
    import importlib

    if sys.dont_write_bytecode:
        _compile_the_sources_once()
    _build_matplotlib_font_cache()

    for name in filter(None, (n.strip() for n in os.environ.get(REQUIRE_VARIABLE, "").split(","))):
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken install raising anything else
            pytest.exit(f"{REQUIRE_VARIABLE} names {name!r} but it cannot be imported "
                        f"({type(e).__name__}: {e}); its tests would be skipped", returncode=3)


# ---------------------------------------------------------------- the integration marker

# Fixtures that start processes or make sockets (directly or through a factory the test calls).
PROCESS_FIXTURES = frozenset({"start_server", "stage_group", "zmq_ctx"})
# Names whose use in a test, or in a function, class or fixture of tests/ that it uses, means it
# starts a process or opens a socket. Erring on the side of integration costs only speed.
PROCESS_NAMES = frozenset({
    "run_cli", "run_launcher", "StageProcess", "StageGroup", "wait_for_file", "CLI", "STAGE_CLI", "BIN",  # conftest
    "subprocess", "Popen", "pty", "multiprocessing", "fork",                                   # processes
    "run_local", "soak", "serve", "serve_stage", "drive_stage",                                # distgrad's
    "zmq", "socket", "Client", "Server", "bind_to_random_port",                                # sockets
})
# Modules every test of which is an integration test, whether or not a name above shows it.
INTEGRATION_MODULES = frozenset({
    "test_api",             # runs the Python API example of docs/experiments.md (processes, sockets)
    "test_benchmarks",      # runs every script in benchmarks/
    "test_netns",           # network namespaces and stage processes, through module fixtures
    "test_readme",          # runs the commands of the README and the reference pages in docs/
    "test_soak",            # two stage processes through benchmarks/soak.py
    "test_vertical_example",  # distgrad align and four stage processes, through the example's main
})


def _code_names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    yield from code.co_freevars
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_names(const)


def _is_test_code(obj: Any) -> bool:
    """A function or class defined in a module of tests/ (a test module or this conftest)."""
    module = getattr(obj, "__module__", "") or ""
    return (inspect.isfunction(obj) or inspect.isclass(obj)) and (module == "conftest" or module.startswith("test_"))


def _uses_process_names(obj: Any, seen: set[int]) -> str | None:
    """The first process or socket name ``obj`` uses, following the functions and classes of tests/
    that it names (helpers, base classes); None when it uses none."""
    if id(obj) in seen:
        return None
    seen.add(id(obj))
    if inspect.isclass(obj):
        parts = [getattr(m, "__func__", getattr(m, "fget", m)) for m in vars(obj).values()]
        parts += [b for b in obj.__bases__ if _is_test_code(b)]
        return next(filter(None, (_uses_process_names(x, seen) for x in parts)), None)
    code = getattr(inspect.unwrap(obj), "__code__", None) if callable(obj) else None
    if code is None:
        return None
    module = sys.modules.get(obj.__module__)
    for name in _code_names(code):
        if name in PROCESS_NAMES:
            return name
        helper = getattr(module, name, None)
        if _is_test_code(helper):
            found = _uses_process_names(helper, seen)
            if found:
                return f"{name} -> {found}"
    return None


def integration_reason(item: pytest.Item) -> str | None:
    """Why ``item`` is an integration test (it starts a process or opens a socket), or None.

    In order: it is in ``INTEGRATION_MODULES``; it uses a fixture of
    ``PROCESS_FIXTURES``; it, or a fixture it uses, names one of
    ``PROCESS_NAMES`` (directly or through a function or class of tests/ that it names).
    """
    module = getattr(item, "module", None)
    name = getattr(module, "__name__", "")
    if name in INTEGRATION_MODULES:
        return f"module {name}"
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & PROCESS_FIXTURES:
        return f"fixture {sorted(fixtures & PROCESS_FIXTURES)[0]}"
    seen: set[int] = set()
    function = getattr(item, "function", None)
    if function is not None:
        found = _uses_process_names(function, seen)
        if found:
            return f"calls {found}"
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for fixture in sorted(fixtures):
        for fixturedef in defs.get(fixture, ()):
            found = _uses_process_names(fixturedef.func, seen) if _is_test_code(fixturedef.func) else None
            if found:
                return f"fixture {fixture} -> {found}"
    return None


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    """Whether ``item`` uses a module-scoped fixture of tests/ (set up once for the module's tests in a row)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(fixturedef.scope == "module" and _is_test_code(fixturedef.func)
               for fixture in getattr(item, "fixturenames", ()) for fixturedef in defs.get(fixture, ()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the integration tests; then run the unit tests after all the others.

    The order is for pytest-xdist's balance: its workers take the tests in this order, so the last ones to
    start were integration tests of a few seconds each (several PyTorch or kill -9 runs among them), and a
    worker that started one late kept the run going while the others had nothing left. The unit tests, some
    1800 of a fraction of a second, now fill that end instead. Each part keeps its order (files, then
    tests), and a unit test that shares a module fixture stays with its module's other tests, so that the
    fixture is not set up twice.
    """
    for item in items:
        reason = integration_reason(item)
        if reason is not None and item.get_closest_marker("integration") is None:
            item.add_marker(pytest.mark.integration(reason=reason))
    items.sort(key=lambda item: item.get_closest_marker("integration") is None and not _shares_a_module_fixture(item))


def _forbidden(item: pytest.Item, what: str):
    def refuse(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(f"{item.nodeid} is not marked integration but {what}: use a fixture of "
                    f"conftest.PROCESS_FIXTURES or a helper of conftest.PROCESS_NAMES, or add its module to "
                    f"conftest.INTEGRATION_MODULES", pytrace=False)
    return refuse


# What a test not marked ``integration`` may not call: (owner, attribute, what calling it does).
FORBIDDEN_CALLS = (
    (subprocess.Popen, "__init__", "starts a process (subprocess.Popen)"),   # subprocess.run, check_output, ...
    (os, "fork", "forks (os.fork)"),                                         # multiprocessing
    (os, "posix_spawn", "starts a process (os.posix_spawn)"),
    (socket.socket, "__init__", "opens a socket (socket.socket)"),
    (zmq.Context, "socket", "opens a ZeroMQ socket (zmq.Context.socket)"),
)


@contextlib.contextmanager
def _forbid_processes_and_sockets(item: pytest.Item) -> Iterator[None]:
    """While ``item`` runs, starting a process or making a socket fails it (pytest.fail is a
    BaseException: an ``except Exception`` in the code under test does not hide it)."""
    monkeypatch = pytest.MonkeyPatch()
    try:
        for owner, name, what in FORBIDDEN_CALLS:
            if hasattr(owner, name):
                monkeypatch.setattr(owner, name, _forbidden(item, what))
        yield
    finally:
        monkeypatch.undo()


def _guard(item: pytest.Item):
    return contextlib.nullcontext() if item.get_closest_marker("integration") else _forbid_processes_and_sockets(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _guard(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _guard(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    with _guard(item):
        yield


# ---------------------------------------------------------------- processes

STAGE_CLI = [*CLI, "stage"]
BIN = Path(sys.executable).parent
PROCESS_DEADLINE_S = 60.0


def run_cli(args: Sequence[str], timeout: float = PROCESS_DEADLINE_S, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``distgrad ARGS`` to completion (bounded) and return the result with text output."""
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=pinned_env(), cwd=cwd, stdin=subprocess.DEVNULL)


@dataclasses.dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str          # what the command wrote there, then its log lines


def run_main(args: Sequence[str]) -> CliResult:
    """Run ``distgrad ARGS`` in this process (``distgrad.cli.main``), as ``run_cli`` would in a child.

    For commands that end before anything starts (usage and configuration errors, listings): a
    test that uses only this stays a unit test, so the guard fails it if the command starts a
    process or opens a socket after all. Argparse's exit is returned as the code; the log records of
    ``distgrad`` that pass the root logger's level (WARNING unless pytest sets another) follow in
    ``stderr``, formatted as the CLI formats them; the logging setup is restored afterwards.
    """
    from distgrad.cli import LOG_FORMAT, main

    out, err = io.StringIO(), io.StringIO()
    root, log = logging.getLogger(), logging.getLogger("distgrad")
    saved_handlers, saved_level = root.handlers[:], root.level    # the CLI's basicConfig may add one
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    log.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:      # argparse: usage errors, --help
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    finally:
        log.removeHandler(handler)
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
    return CliResult(code, out.getvalue(), err.getvalue())


def run_launcher(args: Sequence[str]) -> CliResult:
    """``distgrad run ARGS`` with the launcher in this process and each stage a real process, as ``run_cli``
    would run it, less the launcher's own interpreter start (a third of a second before the first stage
    starts). For tests of what crosses between stages; the launcher as a process (its signals, its
    output) is tested through ``run_cli``. The launcher's SIGINT/SIGTERM handlers are undone afterwards.
    Call it from the main thread (signal handlers can be set only there)."""
    import signal

    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run_main(args)
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def free_tcp_port() -> int:
    """A loopback TCP port free a moment ago (the kernel's pick): tests never name a fixed port, so
    that they can run side by side (pytest -n, two checkouts on one machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_tcp_endpoint() -> str:
    """``tcp://127.0.0.1:PORT`` on a ``free_tcp_port``."""
    return f"tcp://127.0.0.1:{free_tcp_port()}"


def watched_dealer(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A DEALER connected to ``endpoint`` (LINGER 0) and a monitor socket that receives its
    ``EVENT_DISCONNECTED``: a test sees at once that the stage dropped the connection (a frame over its limit)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    sock.connect(endpoint)
    return sock, monitor


class HonestDataOwner:
    """An experiment's data owner driven by hand in the test's process, step by step (what ``distgrad stage f``
    computes): ``forward`` makes step ``step``'s forward message of run ``run``; ``took`` applies its reply."""

    def __init__(self, exp: Any) -> None:
        from distgrad.stage.stage import Stage
        self.exp, self.f, self.data, self.caches = exp, Stage.from_experiment(exp, "f"), exp.build_data(), {}

    def forward(self, run: str, step: int) -> Any:
        from distgrad.wire import messages as wire
        y, self.caches[step] = self.f.forward(self.data.features(step))
        return wire.Message(wire.FORWARD, run, step, tensors={"activation": y})

    def took(self, step: int, reply: Any) -> None:
        _, grads = self.f.backward(self.caches.pop(step), reply.tensors["activation_grad"].copy())
        self.f.apply(grads)


DIGITS_NPZ = Path(__file__).resolve().parent.parent / "distgrad" / "datasets" / "digits.npz"


def splitfed_every(tmp_path: Path, every: int) -> Path:
    """The built-in digits-splitfed averaging every ``every`` steps (a short run must average at least once:
    a SplitFed run of fewer steps than average_every is refused), written under ``tmp_path``."""
    builtin = Path(__file__).resolve().parent.parent / "distgrad" / "experiments" / "digits-splitfed.toml"
    text = builtin.read_text()
    assert "average_every = 10" in text and '"../datasets/digits.npz"' in text
    path = tmp_path / f"splitfed-every-{every}.toml"
    path.write_text(text.replace("average_every = 10", f"average_every = {every}").replace(
        '"../datasets/digits.npz"', f'"{DIGITS_NPZ}"'))
    return path


def digits_data_table(batch: int = 32, test_fraction: float = 0.2) -> str:
    """The ``[data]`` table of the built-in digits (its npz; pixels scaled to [0, 1]) for an experiment a test
    writes, ending in a newline."""
    return (f'[data]\nkind = "npz"\npath = "{DIGITS_NPZ}"\nfeatures = "pixels"\nlabels = "digit"\n'
            f'feature_scale = 0.0625\nbatch = {batch}\ntest_fraction = {test_fraction}\n')


class StageProcess:
    """A ``distgrad-stage`` process (or, with ``distgrad=True``, ``distgrad ARGS``; with ``command``,
    ``COMMAND ARGS``) whose output goes to a log file; always stopped on exit."""

    def __init__(self, args: Sequence[str], log_path: Path, distgrad: bool = False,
                 command: Sequence[str] | None = None) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")
        program = command if command is not None else CLI if distgrad else STAGE_CLI
        self.proc = subprocess.Popen([*map(str, program), *map(str, args)], stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=pinned_env())

    @property
    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait(self, timeout: float = PROCESS_DEADLINE_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"stage process did not exit within {timeout} s; output:\n{self.output}")

    def signal(self, signum: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signum)

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()

    def __enter__(self) -> "StageProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class StageGroup:
    """The stage processes of one run, each restartable with its command line ``args[name]``.

    Every wait has a deadline; ``stop`` stops every process (the ``stage_group`` fixture calls it).
    """

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.args: dict[str, list] = {}
        self.commands: dict[str, list] = {}      # a name's program, when not ``distgrad stage``
        self.procs: dict[str, StageProcess] = {}
        self.starts: dict[str, int] = {}
        self._counted: dict[str, tuple[tuple[int, int], int, int]] = {}   # trace -> (file id, offset, lines)

    def start(self, name: str) -> None:
        self.starts[name] = self.starts.get(name, 0) + 1
        self.procs[name] = StageProcess(self.args[name], self.tmp / f"{name}.{self.starts[name]}.log",
                                        command=self.commands.get(name))

    def kill_9_and_restart(self, name: str) -> None:
        """SIGKILL stage ``name``, which must still be running (else the run ended before the kill), and start
        it again with the same command line."""
        self.procs[name].signal(signal.SIGKILL)
        assert self.procs[name].wait(10) == -signal.SIGKILL, "the run ended before the kill"
        self.start(name)

    def lines(self, trace: str) -> int:
        """Whole lines (steps) in the trace file ``tmp_path/trace`` so far.

        Counted from where the last call stopped: waits poll this every few ms, and rereading a trace
        of tens of MB each time took a core from the stages. A file replaced (a rollback on resume
        writes a new one) or shortened is counted again from its start.
        """
        try:
            with open(self.tmp / trace, "rb") as f:
                stat = os.fstat(f.fileno())
                file_id = (stat.st_dev, stat.st_ino)
                counted_id, offset, count = self._counted.get(trace, (file_id, 0, 0))
                if counted_id != file_id or stat.st_size < offset:
                    offset, count = 0, 0
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return 0
        whole = data.rfind(b"\n") + 1              # a line still being written is counted once it ends
        self._counted[trace] = (file_id, offset + whole, count + data.count(b"\n", 0, whole))
        return self._counted[trace][2]

    def wait_until(self, condition, what: str, timeout: float = 30.0, all_running: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.logs()}"
            if all_running:
                for proc in self.procs.values():
                    assert proc.proc.poll() is None, f"a stage exited early:\n{self.logs()}"
            time.sleep(0.002)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()}" for p in sorted(self.tmp.glob("*.log")))

    def wait_all(self, timeout: float = 60.0) -> None:
        """Wait for every process to exit, and fail unless each exits 0."""
        for name, proc in self.procs.items():
            code = proc.wait(timeout)
            assert code == 0, f"{name} exited {code}:\n{self.logs()}"

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.stop()


@pytest.fixture
def stage_group():
    """A factory ``stage_group(GroupClass, *args)``; every group made is stopped afterwards."""
    made: list[StageGroup] = []

    def make(cls: type, *args, **kwargs) -> StageGroup:
        made.append(cls(*args, **kwargs))
        return made[-1]

    yield make
    for group in made:
        group.stop()


def wait_for_file(path: Path, proc: StageProcess, timeout: float = 30.0) -> str:
    """Contents of ``path`` once it exists; fails if ``proc`` exits or time runs out first."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.proc.poll() is not None:
            pytest.fail(f"process exited with {proc.proc.returncode} before writing {path}:\n{proc.output}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} not written within {timeout} s:\n{proc.output}")
        time.sleep(0.02)
    return path.read_text().strip()


@pytest.fixture
def start_server(tmp_path: Path):
    """Start a serving stage bound to a free port; yields ``(process, endpoint)`` via a factory."""
    started: list[StageProcess] = []

    def start(experiment: str, *extra: str, stage: str = "g", bind: str = "tcp://127.0.0.1:*",
              name: str = "g") -> tuple[StageProcess, str]:
        ready = tmp_path / f"{name}.ready"
        proc = StageProcess([stage, "--experiment", experiment, "--bind", bind, "--ready-file", ready, *extra],
                            tmp_path / f"{name}.log")
        started.append(proc)
        return proc, wait_for_file(ready, proc)

    start.adopt = started.append        # a serving process started otherwise, stopped with the others
    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def zmq_ctx() -> Iterator[zmq.Context]:
    """A private context; every socket it made is closed with linger 0 afterwards."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def read_json(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_last_step(stage, x, target):
    """One whole step of a last stage outside any runner: forward, loss, backward, and the update
    through a step engine (the one update path). Returns ``(loss, dx, grads)``."""
    import numpy as np

    from distgrad.stage.engine import StepEngine

    loss, dx, grads = stage.loss_micro_batch(x, target)
    engine = StepEngine(stage, lambda micro_batches: np.float32(1))
    engine.add(0, 1, grads, loss)
    engine.update(stage.step + 1, 1)
    return loss, dx, grads


@pytest.fixture
def fixed_noise_secret(monkeypatch: pytest.MonkeyPatch) -> str:
    """Every run of this test (stage processes it starts, and the in-process reference) draws its defenses'
    noise from one secret (``DISTGRAD_NOISE_SECRET``), so a run of stage processes is comparable bitwise
    with ``--in-process``; without it each run draws its own."""
    secret = "5eed0f5ec7e7"
    monkeypatch.setenv("DISTGRAD_NOISE_SECRET", secret)
    return secret
