"""Every Python and shell block of the README and docs/ runs as written against a gateway on
the tiny model (issue 72 item 1), or says why not (``<!-- not run: REASON -->`` on the line
before it). A snippet's ``tcp://127.0.0.1:5557`` is this test's gateway; nothing else of it is
changed. A snippet that stops working fails CI."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_docs import DOCS, ROOT

_BLOCK = re.compile(r"^( *)```(python|bash)\n(.*?)^\1```", re.M | re.S)  # (in a list too)
_NOT_RUN = re.compile(r"<!-- not run: (.+?) -->\s*$")
ADDRESS = "tcp://127.0.0.1:5557"


def blocks() -> list[tuple[str, str, str, str | None]]:
    """(where, language, code, why not run) of every Python and shell block."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for match in _BLOCK.finditer(text):
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            why = _NOT_RUN.search(before)
            line = text[: match.start()].count("\n") + 1
            where = f"{doc.relative_to(ROOT)}:{line}"
            code = textwrap.dedent(match.group(3))
            found.append((where, match.group(2), code, why and why.group(1)))
    return found


BLOCKS = blocks()
RUN = [b for b in BLOCKS if b[3] is None]


def test_every_block_runs_or_says_why_not():
    assert len(BLOCKS) >= 14 and len(RUN) >= 8
    for where, _, _, why in BLOCKS:
        assert why is None or len(why) > 10, f"{where}: say why it is not run"


@pytest.fixture(scope="module")
def docs_gateway():
    """The tiny model's gateway, control calls open (the control snippet reloads weights)."""
    from gateway.health_cli import health_main
    from tests.processes import GatewayProcess

    gateway = GatewayProcess("--control-open")
    try:
        deadline = time.monotonic() + 240
        while health_main([gateway.address, "--timeout", "1"]) != 0:
            assert gateway.proc.poll() is None, gateway.output()[-3000:]
            assert time.monotonic() < deadline, "the docs' gateway did not start"
            time.sleep(0.5)
        yield gateway
    finally:
        gateway.stop()


@pytest.mark.parametrize(("where", "language", "code", "why"), RUN, ids=[b[0] for b in RUN])
def test_the_block_runs_as_written(docs_gateway, where, language, code, why):
    code = code.replace(ADDRESS, docs_gateway.address)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    if language == "python":
        argv = [sys.executable, "-c", code]
    else:
        argv = ["bash", "-euo", "pipefail", "-c", code]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{where}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_the_serving_line_says_how_the_gateway_serves(docs_gateway):
    """Issue 72 item 3: start-up says what it does, and the one serving line states the
    address, CURVE, who may call control operations, routing and metrics."""
    deadline = time.monotonic() + 30  # ready answers health before its line reaches the pipe
    while "; control calls: " not in (out := docs_gateway.output()):
        assert time.monotonic() < deadline, out[-3000:]
        time.sleep(0.1)
    assert "starting the engine for" in out and "engine up: 1 data-parallel rank(s)" in out
    phases = [line for line in out.splitlines() if "engine-gateway start-up, rank 0: " in line]
    said = [line.split("rank 0: ", 1)[1] for line in phases]
    assert [s.split()[0] for s in said] == ["loading", "weights", "KV", "up"], phases
    assert re.fullmatch(r"KV cache of \d+ blocks of \d+ tokens; warming the model up", said[2])
    (line,) = [line for line in out.splitlines() if " serving " in line and "CURVE" in line]
    assert docs_gateway.address in line
    assert "CURVE off" in line and "control calls: open to every client" in line
    assert "routing: load, PrefixQuery index approximate" in line and "metrics: off" in line
