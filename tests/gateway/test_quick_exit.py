"""gateway.quick_exit: a process ended with its status and its exit handlers, without the
interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.processes import ROOT

# An object in a reference cycle, with a __del__ that only the teardown's garbage
# collection runs; an exit handler; output left in Python's buffer (stdout is a pipe).
_PROGRAM = """
import atexit, sys
from gateway.quick_exit import exit_now

class Cycle:
    def __del__(self):
        print("teardown ran", flush=True)

cycle = Cycle()
cycle.self = cycle
atexit.register(lambda: print("exit handler ran"))
print("buffered")
exit_now({status})
"""


def _run(status: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _PROGRAM.format(status=status)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(("status", "code"), [("None", 0), ("0", 0), ("3", 3), ("256 + 7", 7)])
def test_the_status_the_handlers_and_the_output_survive_and_the_teardown_is_skipped(status, code):
    done = _run(status)
    assert done.returncode == code, done.stderr
    assert done.stdout == "buffered\nexit handler ran\n", done.stdout
    assert "teardown ran" not in done.stdout


def test_a_message_is_printed_and_exits_1_as_sys_exit_does():
    done = _run("'no such model'")
    assert done.returncode == 1
    assert done.stderr.strip() == "no such model"
