"""The ``integration`` marker: applied by tests/conftest.py at collection, and kept true at run time.

These are unit tests themselves: they run under ``-m "not integration"``,
where the guard refuses processes and sockets.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import types

import pytest
import zmq

import conftest
from conftest import PROCESS_FIXTURES, integration_reason


def _sample(source: str, name: str = "test_sample") -> types.ModuleType:
    """A test module ``name`` made of ``source`` (its functions are read, never called)."""
    module = types.ModuleType(name)
    exec(textwrap.dedent(source), module.__dict__)
    return module


class _Item:
    """What ``integration_reason`` reads of a collected test."""

    def __init__(self, function, fixtures=(), module=None) -> None:
        self.function, self.fixturenames = function, list(fixtures)
        self.module = module


def _zmq_socket() -> None:
    ctx = zmq.Context()
    try:
        ctx.socket(zmq.DEALER).close(0)
    finally:
        ctx.term()


# Each probe starts a process or opens a socket. The test below names none of these itself, so the
# collection rule leaves it a unit test and the guard is on while it runs.
PROBES = {
    "subprocess.run": (lambda: subprocess.run(["true"], check=False), "starts a process"),
    "socket.socket": (lambda: socket.socket().close(), "opens a socket"),
    "zmq socket": (_zmq_socket, "opens a ZeroMQ socket"),
}


@pytest.mark.parametrize("probe", sorted(PROBES))
def test_a_unit_test_cannot_start_a_process_or_open_a_socket(request, probe):
    assert request.node.get_closest_marker("integration") is None
    start, what = PROBES[probe]
    with pytest.raises(pytest.fail.Exception, match=f"is not marked integration but {what}"):
        start()


def test_a_unit_test_cannot_fork(request):
    assert request.node.get_closest_marker("integration") is None
    assert getattr(os, "fork").__name__ == "refuse"          # not called: it would fork this test run


@pytest.mark.parametrize("source, expected", [
    ("def test_x(tmp_path):\n    run_cli(['run', 'seed-reverse'])", "calls run_cli"),
    ("def test_x():\n    subprocess.run(['true'])", "calls subprocess"),
    ("def test_x():\n    with zmq.Context() as c: pass", "calls zmq"),
    ("def test_x():\n    distgrad.drive_stage('seed-reverse', 'tcp://x:1')", "calls drive_stage"),
    # through a helper of the test module, however deep
    ("def helper():\n    return inner()\ndef inner():\n    StageProcess([], None)\n"
     "def test_x():\n    helper()", "calls helper -> inner -> StageProcess"),
    # through a class of the test module and its base
    ("class Base:\n    def go(self):\n        socket.socket()\nclass Pair(Base):\n    pass\n"
     "def test_x():\n    Pair().go()", "calls Pair -> socket"),
    ("def test_x():\n    assert (lambda: Popen(['true']))", "calls Popen"),     # nested code too
])
def test_a_test_that_names_a_process_helper_is_integration(source, expected):
    module = _sample(source)
    sys.modules[module.__name__] = module        # helpers are looked up in the test's module
    try:
        assert integration_reason(_Item(module.test_x, module=module)) == expected
    finally:
        del sys.modules[module.__name__]


@pytest.mark.parametrize("fixture", sorted(PROCESS_FIXTURES))
def test_a_process_fixture_makes_a_test_integration(fixture):
    test = _sample("def test_x():\n    pass").test_x
    assert integration_reason(_Item(test, fixtures=["tmp_path", fixture])) == f"fixture {fixture}"


def test_pure_math_is_not_integration():
    test = _sample("def test_x(tmp_path):\n    assert np.float32(1) + np.float32(2) == 3\n    Adam(lr=0.1)").test_x
    assert integration_reason(_Item(test, fixtures=["tmp_path"])) is None


def test_every_collected_test_using_a_process_fixture_is_marked(request):
    for item in request.session.items:
        if set(getattr(item, "fixturenames", ())) & PROCESS_FIXTURES:
            assert item.get_closest_marker("integration") is not None, item.nodeid


def test_the_integration_modules_exist():
    tests = conftest.Path(conftest.__file__).parent
    for name in conftest.INTEGRATION_MODULES:
        assert (tests / f"{name}.py").is_file(), name
